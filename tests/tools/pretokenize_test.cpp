// Tests for tools/pretokenize (memopt-pretokenize's work, called in-process) and for
// memopt::data::ShardWriter, which it writes with: shards byte-identical to write_shard's,
// the .tmp removed when not closed; a JSONL + text corpus cut into >= 3 shards whose ids are
// the documents' ids with EOS after each, byte-identical for 1 and 3 workers; StreamLoader on
// the index giving exactly the batches it gives on the raw text; index.json's fields; bad
// input (tokenizer, --out, a JSONL record without the field) refused with a HINT; a Parquet
// text column cut into the same shards, byte for byte, as the same documents in JSONL.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "support.hpp"

#include <memopt/data/shard.hpp>
#include <memopt/data/source.hpp>
#include <memopt/data/stream.hpp>
#include <memopt/io/checkpoint.hpp>
#include <pretokenize/pretokenize.hpp>

namespace fs = std::filesystem;
using memopt::data::ShardWriter;
using memopt::data::SourceOptions;
using memopt::data::Split;
using memopt::data::StreamLoader;
using memopt::data::StreamOptions;
using memopt::tools::PretokenizeOptions;

namespace {

struct TempDir : memopt::test::TempDir {
  TempDir() : memopt::test::TempDir("memopt_pretokenize_test") {}
};

using memopt::test::read_text;
using memopt::test::require_error;
using memopt::test::write_text;

// A BPE model: <unk> 0, <s> 1, </s> 2 (EOS), ▁ 3, 'a'..'z' 4..29, '0'..'9' 30..39, then a few
// merges ("th", "he", "▁t", "▁th", "▁the", "in", "ng", "ing"), so encoding is more than a lookup.
std::string write_model(const TempDir& dir) {
  const std::string ws = "\xe2\x96\x81";
  std::vector<std::tuple<std::string, float, int>> pieces = {{"<unk>", 0.f, 2}, {"<s>", 0.f, 3}, {"</s>", 0.f, 3},
                                                             {ws, 0.f, 1}};
  for (char c = 'a'; c <= 'z'; ++c) pieces.emplace_back(std::string(1, c), 0.f, 1);
  for (char c = '0'; c <= '9'; ++c) pieces.emplace_back(std::string(1, c), 0.f, 1);
  float score = -1.f;
  for (const std::string& merged : std::vector<std::string>{"th", "he", ws + "t", ws + "th", ws + "the", "in", "ng", "ing"}) {
    pieces.emplace_back(merged, score, 1);
    score -= 1.f;
  }
  const std::string path = dir.file("tiny.model");
  write_text(path, memopt::test::make_model(pieces));
  return path;
}

// Document k's text: words drawn from a fixed list by k (some upper case: <unk> ids).
std::string doc_text(int k) {
  static const std::vector<std::string> words = {"the", "thing", "sing", "then", "ring", "other", "in", "them",
                                                 "Nothing", "42", "hen", "x7", "breathing", "tint"};
  std::string text;
  for (int w = 0; w < 3 + (k * 7) % 11; ++w) {
    if (w > 0) text += ' ';
    text += words[static_cast<size_t>((k * 31 + w * 17) % static_cast<int>(words.size()))];
  }
  return text;
}

// corpus/: a.jsonl (records, one blank line, extra fields), b.txt (lines, blank lines),
// sub/c.txt (paragraphs of 1-3 lines). About 500 documents when read by line.
std::string write_corpus(const TempDir& dir) {
  std::string jsonl, text, paragraphs;
  for (int k = 0; k < 150; ++k) {
    jsonl += nlohmann::json{{"id", k}, {"text", doc_text(k)}, {"meta", {{"k", k}}}}.dump() + "\n";
    if (k == 70) jsonl += "\n";
  }
  for (int k = 150; k < 330; ++k) text += doc_text(k) + (k % 13 == 0 ? "\n\n" : "\n");
  for (int k = 330; k < 500; ++k) paragraphs += doc_text(k) + (k % 3 == 2 ? "\n\n" : "\n");
  write_text(dir.file("corpus/a.jsonl"), jsonl);
  write_text(dir.file("corpus/b.txt"), text);
  write_text(dir.file("corpus/sub/c.txt"), paragraphs);
  return dir.file("corpus");
}

PretokenizeOptions options_for(const std::string& corpus, const std::string& model, const std::string& out) {
  return PretokenizeOptions().sources({corpus}).tokenizer(model).out(out).shard_tokens(1000).block_documents(7);
}

// What StreamLoader makes from the raw text: each document's ids, then EOS, in file order.
std::vector<int32_t> expected_ids(const std::string& corpus, const std::string& model, SourceOptions source) {
  const memopt::data::Tokenizer tok(model);
  memopt::data::DocumentReader reader(memopt::data::resolve_sources({corpus}), source.shuffle_files(false));
  std::vector<int32_t> ids;
  memopt::data::RawDocument doc;
  while (reader.next(doc)) {
    for (int32_t id : tok.encode(doc.text)) ids.push_back(id);
    ids.push_back(static_cast<int32_t>(tok.eos_id()));
  }
  return ids;
}

std::vector<int32_t> shard_ids(const std::string& path) {
  auto shard = memopt::data::TokenShard::open(path);
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < shard->size(); ++i) ids.push_back(static_cast<int32_t>(shard->at(i)));
  return ids;
}

std::vector<memopt::Batch> drain(StreamLoader& loader) {
  std::vector<memopt::Batch> batches;
  while (loader.has_next()) batches.push_back(loader.next());
  return batches;
}

}  // namespace

// ---- ShardWriter ------------------------------------------------------------------------

TEST_CASE("ShardWriter streams ids into the same bytes write_shard makes", "[pretokenize][shard]") {
  TempDir dir;
  for (const int64_t vocab : {int64_t{50000}, int64_t{100000}}) {  // uint16, uint32
    const std::vector<int32_t> a = {1, 2, 49999, 0}, b = {}, c = {7, 8, 9};
    const std::string streamed = dir.file(fmt::format("streamed-{}.bin", vocab)), whole = dir.file("whole.bin");
    {
      ShardWriter out(streamed, vocab);
      CHECK(out.bytes_per_token() == (vocab <= 65536 ? 2 : 4));
      out.append(a);
      out.append(b);
      CHECK(fs::exists(streamed + ".tmp"));
      CHECK_FALSE(fs::exists(streamed));
      out.append(std::span<const int32_t>(c));
      CHECK(out.size() == 7);
      out.close();
      CHECK(out.closed());
    }
    CHECK_FALSE(fs::exists(streamed + ".tmp"));
    std::vector<int32_t> all = a;
    all.insert(all.end(), c.begin(), c.end());
    memopt::data::write_shard(whole, all, vocab);
    CHECK(read_text(streamed) == read_text(whole));
    CHECK(shard_ids(streamed) == all);
  }

  SECTION("an empty shard") {
    ShardWriter out(dir.file("empty.bin"), 10);
    out.close();
    CHECK(memopt::data::TokenShard::open(dir.file("empty.bin"))->size() == 0);
  }
}

TEST_CASE("ShardWriter: no close() leaves no file, bad ids and closed writers are errors", "[pretokenize][shard]") {
  TempDir dir;
  const std::string path = dir.file("s.bin");
  {
    ShardWriter out(path, 100);
    out.append({1, 2, 3});
  }  // destroyed without close(): as if interrupted
  CHECK_FALSE(fs::exists(path));
  CHECK_FALSE(fs::exists(path + ".tmp"));

  ShardWriter out(path, 100);
  out.append({5, 6});
  require_error([&] { out.append({7, 100, 8}); }, "memopt::data::ShardWriter", {path, "token id 100", "position 3", "vocab_size 100"});
  require_error([&] { out.append({-1}); }, "memopt::data::ShardWriter", {"token id -1", "position 2"});
  out.append({9});  // nothing of a refused append was written
  out.close();
  CHECK(shard_ids(path) == std::vector<int32_t>{5, 6, 9});
  require_error([&] { out.append({1}); }, "memopt::data::ShardWriter", {path, "closed"});
  require_error([&] { out.close(); }, "memopt::data::ShardWriter", {path, "closed"});

  require_error([&] { ShardWriter(dir.file("no/such/dir/s.bin"), 100); }, "memopt::data::ShardWriter",
                {"no/such/dir/s.bin.tmp", "No such file", "writable"});
  require_error([&] { ShardWriter(dir.file("v.bin"), 0); }, "memopt::data::ShardWriter", {"vocab_size", "got 0"});
}

// ---- memopt-pretokenize ------------------------------------------------------------------

TEST_CASE("pretokenize: >= 3 shards holding the documents' ids + EOS, the same for 1 and 3 workers",
          "[pretokenize]") {
  TempDir dir;
  const std::string model = write_model(dir), corpus = write_corpus(dir);
  const auto one = memopt::tools::pretokenize(options_for(corpus, model, dir.file("out1")).workers(1));
  const auto three = memopt::tools::pretokenize(options_for(corpus, model, dir.file("out3")).workers(3));

  const std::vector<int32_t> expected = expected_ids(corpus, model, SourceOptions());
  CHECK(one.tokens == static_cast<int64_t>(expected.size()));
  CHECK(one.documents == 150 + 180 + 170);  // every non-blank line or record
  REQUIRE(one.shards >= 3);
  CHECK(one.shards == (one.tokens + 999) / 1000);
  CHECK(three.tokens == one.tokens);
  CHECK(three.shards == one.shards);

  std::vector<int32_t> streamed;
  for (int64_t s = 0; s < one.shards; ++s) {
    const std::string name = fmt::format("shard-{:05d}.bin", s);
    INFO(name);
    const std::string bytes = read_text(dir.file("out1/" + name));
    CHECK(bytes == read_text(dir.file("out3/" + name)));  // byte-identical whatever the workers
    const auto ids = shard_ids(dir.file("out1/" + name));
    CHECK(static_cast<int64_t>(ids.size()) == (s + 1 < one.shards ? 1000 : one.tokens - 1000 * s));
    streamed.insert(streamed.end(), ids.begin(), ids.end());
  }
  CHECK(streamed == expected);
  CHECK(read_text(dir.file("out1/index.json")) == read_text(dir.file("out3/index.json")));
  for (const auto& entry : fs::directory_iterator(dir.file("out1"))) {
    CHECK(entry.path().extension() != ".tmp");
  }
}

TEST_CASE("pretokenize: StreamLoader on index.json gives the batches it gives on the raw text", "[pretokenize]") {
  TempDir dir;
  const std::string model = write_model(dir), corpus = write_corpus(dir);
  const auto tokenizer = std::make_shared<const memopt::data::Tokenizer>(model);

  struct Case {
    const char* name;
    Split split;
    int64_t max_examples;
    int64_t shuffle_buffer, workers;
  };
  const Case c = GENERATE(Case{"lines", Split::kLine, 0, 1, 0}, Case{"paragraphs, 200 examples", Split::kParagraph, 200, 1, 0},
                          Case{"lines, shuffle buffer 64, 2 workers", Split::kLine, 0, 64, 2});
  INFO(c.name);
  const std::string out = dir.file(std::string("out-") + c.name);
  memopt::tools::pretokenize(
      options_for(corpus, model, out).split(c.split).max_examples(c.max_examples).workers(2));

  auto stream_options = [&] {
    StreamOptions options = StreamOptions(4, 16).shuffle_buffer(c.shuffle_buffer).workers(c.workers).seed(7);
    options.source().shuffle_files(false);  // the same document order on both sides
    return options;
  };
  auto raw_options = stream_options();
  raw_options.source().split(c.split).max_examples(c.max_examples);  // the shards hold what these chose
  StreamLoader raw({corpus}, tokenizer, raw_options);
  StreamLoader pre({out + "/index.json"}, tokenizer, stream_options());
  StreamLoader folder({out}, nullptr, stream_options());  // the folder stands for its index; no tokenizer needed
  const auto a = drain(raw), b = drain(pre), f = drain(folder);
  REQUIRE(a.size() >= 10);
  REQUIRE(b.size() == a.size());
  REQUIRE(f.size() == a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("batch " << i);
    CHECK(torch::equal(a[i].inputs, b[i].inputs));
    CHECK(torch::equal(a[i].targets, b[i].targets));
    CHECK(torch::equal(a[i].inputs, f[i].inputs));
  }
}

TEST_CASE("pretokenize: index.json names the tokenizer, its checksum, the counts, sources and shards",
          "[pretokenize]") {
  TempDir dir;
  const std::string model = write_model(dir), corpus = write_corpus(dir), out = dir.file("out");
  const auto summary = memopt::tools::pretokenize(options_for(corpus, model, out).workers(2));
  CHECK(summary.index == out + "/index.json");
  const auto index = nlohmann::json::parse(read_text(summary.index));
  const memopt::data::Tokenizer tok(model);

  CHECK(index["format"] == "memopt-token-shards");
  CHECK(index["version"] == 1);
  CHECK(index["tokenizer"] == fs::absolute(model).lexically_normal().string());
  CHECK(index["tokenizer_xxh3"] == memopt::io::digest_file(model).xxh3);
  CHECK(index["tokenizer_xxh3"].get<std::string>().size() == 16);
  CHECK(index["vocab_size"] == tok.vocab_size());
  CHECK(index["eos_id"] == tok.eos_id());
  CHECK(index["documents"] == summary.documents);
  CHECK(index["tokens"] == summary.tokens);
  CHECK(index["sources"] == std::vector<std::string>{fs::absolute(dir.file("corpus/a.jsonl")).string(),
                                                      fs::absolute(dir.file("corpus/b.txt")).string(),
                                                      fs::absolute(dir.file("corpus/sub/c.txt")).string()});
  REQUIRE(index["shards"].size() == static_cast<size_t>(summary.shards));
  int64_t tokens = 0, documents = 0;
  for (size_t s = 0; s < index["shards"].size(); ++s) {
    const auto& shard = index["shards"][s];
    CHECK(shard["file"] == fmt::format("shard-{:05d}.bin", s));
    CHECK(fs::file_size(out + "/" + shard["file"].get<std::string>()) == 64 + 2 * shard["tokens"].get<uint64_t>());
    tokens += shard["tokens"].get<int64_t>();
    documents += shard["documents"].get<int64_t>();
  }
  CHECK(tokens == summary.tokens);
  CHECK(documents == summary.documents);  // a document counts in the shard holding its EOS

  // What the stream reader makes of the folder: its index's shards, in order.
  const auto files = memopt::data::resolve_sources({out});
  REQUIRE(files.size() == static_cast<size_t>(summary.shards));
  CHECK(fs::path(files.back().path).filename() == fmt::format("shard-{:05d}.bin", summary.shards - 1));
}

TEST_CASE("pretokenize: bad input is refused with the file, the value and a HINT", "[pretokenize]") {
  TempDir dir;
  const std::string model = write_model(dir), corpus = write_corpus(dir);
  const std::string prefix = "memopt-pretokenize";

  SECTION("missing tokenizer") {
    require_error([&] { memopt::tools::pretokenize(options_for(corpus, dir.file("nope.model"), dir.file("o"))); }, prefix,
                  {"--tokenizer", "nope.model", "does not exist"});
    require_error([&] { memopt::tools::pretokenize(options_for(corpus, "", dir.file("o"))); }, prefix, {"no tokenizer"});
    CHECK_FALSE(fs::exists(dir.file("o")));  // nothing is created before the checks pass
  }
  SECTION("no sources, a missing source, a token shard as a source") {
    require_error([&] { memopt::tools::pretokenize(options_for(corpus, model, dir.file("o")).sources({})); }, prefix,
                  {"no sources"});
    require_error([&] { memopt::tools::pretokenize(options_for(dir.file("missing.txt"), model, dir.file("o"))); },
                  "memopt::data", {"missing.txt", "does not exist"});
    fs::create_directories(dir.file("old"));
    memopt::data::write_shard(dir.file("old/x.bin"), {1, 2}, 10);
    require_error([&] { memopt::tools::pretokenize(options_for(dir.file("old/x.bin"), model, dir.file("o"))); }, prefix,
                  {"x.bin", "already a token shard"});
  }
  SECTION("existing --out without --force; --force replaces only the index and shards") {
    const std::string out = dir.file("out");
    write_text(out + "/notes.md", "keep me\n");
    write_text(out + "/shard-00042.bin", "stale");
    require_error([&] { memopt::tools::pretokenize(options_for(corpus, model, out)); }, prefix,
                  {out, "exists and is not empty", "--force"});
    const auto summary = memopt::tools::pretokenize(options_for(corpus, model, out).force(true));
    CHECK(fs::exists(out + "/notes.md"));
    CHECK_FALSE(fs::exists(out + "/shard-00042.bin"));
    CHECK(memopt::data::resolve_sources({out}).size() == static_cast<size_t>(summary.shards));
  }
  SECTION("--out that cannot be made") {
    write_text(dir.file("file"), "x");
    require_error([&] { memopt::tools::pretokenize(options_for(corpus, model, dir.file("file/out"))); }, prefix,
                  {"cannot create --out", "file/out"});
    require_error([&] { memopt::tools::pretokenize(options_for(corpus, model, dir.file("file"))); }, prefix,
                  {"is a file, not a folder"});
  }
  SECTION("a JSONL record without the text field: file:line; no index, no shard left") {
    std::string jsonl;
    for (int k = 0; k < 300; ++k) jsonl += nlohmann::json{{k == 250 ? "body" : "text", doc_text(k)}}.dump() + "\n";
    write_text(dir.file("bad/b.jsonl"), jsonl);
    const std::string out = dir.file("out");
    for (int64_t workers : {1, 3}) {
      require_error([&] { memopt::tools::pretokenize(options_for(dir.file("bad"), model, out).shard_tokens(100).workers(workers)); },
                    "memopt::data", {"b.jsonl:251", "no field \"text\"", "--text_field"});
      CHECK(fs::is_empty(out));  // the shards written before the error are removed
    }
    // The right field name reads it (and a record without "body" is then the error).
    require_error([&] { memopt::tools::pretokenize(options_for(dir.file("bad"), model, out).text_field("body")); },
                  "memopt::data", {"b.jsonl:1", "no field \"body\""});
  }
  SECTION("bad numbers") {
    require_error([&] { memopt::tools::pretokenize(options_for(corpus, model, dir.file("o")).shard_tokens(0)); }, prefix,
                  {"--shard_tokens", "got 0"});
    require_error([&] { memopt::tools::pretokenize(options_for(corpus, model, dir.file("o")).workers(0)); }, prefix,
                  {"--workers", "got 0"});
  }
}

TEST_CASE("pretokenize: a Parquet text column gives the shards the same documents give as JSONL",
          "[pretokenize][parquet]") {
  TempDir dir;
  memopt::test::ScopedPython python;  // the tests' Python, with pyarrow
  const std::string model = write_model(dir);
  nlohmann::json rows = nlohmann::json::array(), ids = nlohmann::json::array();
  std::string jsonl;
  for (int k = 0; k < 300; ++k) {
    if (k % 17 == 5) rows.push_back(nullptr);  // a null row is no document
    const std::string text = k == 100 ? std::string() : k == 200 ? "caf\u00e9 \U0001F642 the thing" : doc_text(k);
    rows.push_back(text);  // "" is a document: its ids are EOS alone, as in JSONL
    jsonl += nlohmann::json{{"text", text}}.dump() + "\n";
  }
  const std::string parquet = dir.file("pq/corpus.parquet");
  for (size_t i = 0; i < rows.size(); ++i) ids.push_back(i);
  memopt::test::write_parquet(parquet, {{"id", ids}, {"text", rows}}, 64);
  write_text(dir.file("js/corpus.jsonl"), jsonl);

  for (const int64_t max_examples : {0, 120}) {
    INFO("max_examples " << max_examples);
    const std::string suffix = std::to_string(max_examples);
    auto run = [&](const std::string& source, const std::string& out) {
      return memopt::tools::pretokenize(options_for(source, model, out).max_examples(max_examples).workers(2));
    };
    const auto p = run(dir.file("pq"), dir.file("out-pq" + suffix));
    const auto j = run(dir.file("js/corpus.jsonl"), dir.file("out-js" + suffix));
    CHECK(p.documents == (max_examples > 0 ? max_examples : 300));
    CHECK(p.documents == j.documents);
    CHECK(p.tokens == j.tokens);
    REQUIRE(p.shards == j.shards);
    REQUIRE(p.shards >= 2);
    for (int64_t s = 0; s < p.shards; ++s) {
      const std::string name = fmt::format("/shard-{:05d}.bin", s);
      INFO(name);
      CHECK(read_text(dir.file("out-pq" + suffix) + name) == read_text(dir.file("out-js" + suffix) + name));
    }
    const auto size = static_cast<int64_t>(fs::file_size(parquet));  // progress: a share of the file by rows
    CHECK((max_examples > 0 ? p.bytes > 0 && p.bytes < size : p.bytes == size));
  }
  require_error([&] { memopt::tools::pretokenize(options_for(parquet, model, dir.file("bad")).text_field("body")); },
                "memopt::data", {parquet, "no column \"body\"", "its columns: id, text"});
  CHECK(fs::is_empty(dir.file("bad")));  // no shard, no index
}
