// Tests for memopt/data/grit.hpp and memopt/data/prefetch.hpp: tokenizer user symbols,
// GritLM's formats and instruction prefixes, pool masks and generative targets, the JSONL
// readers (fixtures in tests/data/fixtures), contrastive/generative pairs from fake Brown
// documents and fake King James chapters, length bucketing, determinism, and the Prefetcher (order, errors, bounds,
// shutdown). Tokenizers are small hand-written SentencePiece models; no data/ is needed.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include <torch/torch.h>

#include "support.hpp"

#include <memopt/data/brown.hpp>
#include <memopt/data/grit.hpp>
#include <memopt/data/kjv.hpp>
#include <memopt/data/prefetch.hpp>
#include <memopt/data/tokenizer.hpp>

namespace fs = std::filesystem;
using memopt::data::EmbedRecord;
using memopt::data::GenRecord;
using memopt::data::GritBatch;
using memopt::data::GritBatcher;
using memopt::data::GritBatcherOptions;
using memopt::data::GritFormat;
using memopt::data::Prefetcher;
using memopt::data::PrefetchOptions;
using memopt::data::Tokenizer;

namespace {

struct TempDir : memopt::test::TempDir {
  TempDir() : memopt::test::TempDir("memopt_grit_test") {}
};

void require_error(const std::function<void()>& fn, const std::vector<std::string>& parts,
                   const std::string& prefix = "memopt::data") {
  memopt::test::require_error(fn, prefix, parts);
}

using memopt::test::pb_bytes;
using memopt::test::pb_float;
using memopt::test::pb_int;
std::string le32(uint32_t v) {
  std::string out;
  for (int b = 0; b < 4; ++b) out += static_cast<char>(v >> (8 * b));
  return out;
}

/// A precompiled charsmap (darts-clone double array) with two rules, "\t" -> " " and
/// "\n" -> " ", as SentencePiece's default nmt_nfkc normalizer has.
std::string whitespace_charsmap() {
  std::vector<uint32_t> units(14, 0);
  units[0] = 1u << 10;                           // root: children at 1 ^ byte
  units[1 ^ 0x0A] = (7u << 10) | (1u << 8) | 0x0A;  // '\n', has a leaf at 11 ^ 7 = 12
  units[12] = 1u << 31;                          // leaf: replacement at offset 0
  units[1 ^ 0x09] = (5u << 10) | (1u << 8) | 0x09;  // '\t', leaf at 8 ^ 5 = 13
  units[13] = 1u << 31;
  std::string blob = le32(static_cast<uint32_t>(units.size() * 4));
  for (uint32_t u : units) blob += le32(u);
  blob += std::string(" \0", 2);
  return blob;
}

const std::string kWs = "\xe2\x96\x81";  // "▁"

/// A character-level BPE model with a few merges; `newline_is_space`: "\n" and "\t"
/// normalize to " " (like nmt_nfkc), else the normalizer is the identity.
std::string make_model(bool newline_is_space) {
  std::vector<std::tuple<std::string, float, int>> pieces = {
      {"<unk>", 0.f, 2}, {"<s>", 0.f, 3}, {"</s>", 0.f, 3}, {kWs, 0.f, 1}};
  for (char c : std::string("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?'\"-()/\n")) {
    pieces.emplace_back(std::string(1, c), 0.f, 1);
  }
  for (const auto& [merge, score] : std::vector<std::pair<std::string, float>>{
           {kWs + "t", -1.f}, {"he", -1.5f}, {kWs + "the", -2.f}, {"in", -2.5f}, {"er", -3.f}, {kWs + "a", -3.5f}}) {
    pieces.emplace_back(merge, score, 1);
  }
  std::string model;
  for (const auto& [text, score, type] : pieces) {
    model += pb_bytes(1, pb_bytes(1, text) + pb_float(2, score) + pb_int(3, static_cast<uint64_t>(type)));
  }
  model += pb_bytes(2, pb_int(3, 2));  // model_type BPE
  model += pb_bytes(3, newline_is_space ? pb_bytes(1, "nmt_nfkc") + pb_bytes(2, whitespace_charsmap())
                                        : pb_bytes(1, "identity"));
  return model;
}

/// A tokenizer from make_model, written to a file in a fresh temp folder.
std::shared_ptr<Tokenizer> make_tokenizer(bool newline_is_space = true) {
  static TempDir dir;  // lives for the whole test run
  static std::atomic<int> counter{0};
  const std::string path = dir.file("hand" + std::to_string(counter++) + ".model");
  std::ofstream(path, std::ios::binary) << make_model(newline_is_space);
  return std::make_shared<Tokenizer>(path);
}

std::vector<int32_t> cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<int64_t> row(const torch::Tensor& t, int64_t i) {
  const torch::Tensor r = t[i].to(torch::kLong).contiguous();
  return {r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel()};
}
std::vector<int64_t> as64(const std::vector<int32_t>& v) { return {v.begin(), v.end()}; }

std::string fixture(const std::string& name) {
  return (fs::path(MEMOPT_TEST_BASELINES).parent_path() / "data" / "fixtures" / name).string();
}

/// Records whose query/positive/negative lengths grow with i (a length-diverse set).
std::vector<EmbedRecord> diverse_records(int n) {
  std::vector<EmbedRecord> out;
  for (int i = 0; i < n; ++i) {
    const int words = 1 + (i * 37) % n;  // lengths 1..n in a scrambled order
    std::string q = "q" + std::to_string(i), p = "p" + std::to_string(i), n = "n" + std::to_string(i);
    for (int w = 0; w < words; ++w) {
      q += " ab";
      p += " cd ef";
      n += " gh ij";
    }
    out.push_back({q, p, {n}, "Find the passage"});
  }
  return out;
}

}  // namespace

// ---- tokenizer user symbols ------------------------------------------------------------

TEST_CASE("Tokenizer::add_user_symbols appends whole, unmerged symbols that decode back",
          "[grit][tokenizer]") {
  auto tok = make_tokenizer();
  const int64_t n = tok->vocab_size();
  // Before: '<', '|', '>' are not in the vocab.
  CHECK(tok->encode("<|user|>")[1] == tok->unk_id());
  CHECK(tok->piece_to_id("<|user|>") == tok->unk_id());

  const auto ids = tok->add_user_symbols({"<|user|>", "<|embed|>", "<|assistant|>"});
  CHECK(ids == std::vector<int32_t>{static_cast<int32_t>(n), static_cast<int32_t>(n + 1),
                                    static_cast<int32_t>(n + 2)});
  CHECK(tok->vocab_size() == n + 3);
  CHECK(tok->piece_to_id("<|embed|>") == n + 1);
  CHECK(tok->piece(n + 2) == "<|assistant|>");

  // Matched whole, never merged with neighbours (even without spaces), decoded to their text.
  const auto x = tok->piece_to_id("x"), y = tok->piece_to_id("y");
  CHECK(tok->encode("x<|user|>y") == std::vector<int32_t>{tok->piece_to_id(kWs), x, static_cast<int32_t>(n), y});
  CHECK(tok->encode("<|user|><|embed|>") ==
        std::vector<int32_t>{tok->piece_to_id(kWs), static_cast<int32_t>(n), static_cast<int32_t>(n + 1)});
  CHECK(tok->decode(tok->encode("the cat <|user|> said <|assistant|>hi")) == "the cat <|user|> said <|assistant|>hi");
  CHECK(tok->decode(std::vector<int32_t>{static_cast<int32_t>(n + 1)}) == "<|embed|>");
  CHECK(tok->decode(torch::tensor({n, n + 2})) == "<|user|><|assistant|>");

  // Adding again is a no-op returning the ids; so is a piece already in the model.
  CHECK(tok->add_user_symbols({"<|embed|>", "<|user|>"}) ==
        std::vector<int32_t>{static_cast<int32_t>(n + 1), static_cast<int32_t>(n)});
  CHECK(tok->add_user_symbols({"he", "</s>"}) == std::vector<int32_t>{tok->piece_to_id("he"), 2});
  CHECK(tok->vocab_size() == n + 3);

  require_error([&] { tok->add_user_symbols({"<|ok|>", ""}); }, {"empty user symbol", "symbol 1"});
  require_error([&] { tok->add_user_symbols({"<|a b|>"}); }, {"'<|a b|>'", "whitespace"});
}

// ---- formats and instruction prefixes --------------------------------------------------

TEST_CASE("GritLM formats, instruction prefixes cached once, pooled tokens are the text's",
          "[grit]") {
  using memopt::data::format_embed;
  using memopt::data::format_gen;
  CHECK(format_embed("Retrieve the answer", "The jury said.") ==
        "<s><|user|>\nRetrieve the answer\n<|embed|>\nThe jury said.");
  CHECK(format_embed("", "x") == "<s><|embed|>\nx");
  CHECK(format_embed(" \t: \n", "x") == "<s><|embed|>\nx");                      // strips to nothing
  CHECK(format_embed("\tRetrieve:\n", "x") == "<s><|user|>\nRetrieve\n<|embed|>\nx");  // strip("\t\n :")
  CHECK(format_gen("Say hi", "  Hello there \n") == "<s><|user|>\nSay hi\n<|assistant|>\nHello there</s>");

  auto tok = make_tokenizer(/*newline_is_space=*/true);
  const int64_t before = tok->vocab_size();
  auto format = std::make_shared<GritFormat>(tok);
  CHECK(format->vocab_size() == before + 3);
  CHECK(tok->vocab_size() == before + 3);
  CHECK(format->embed_id() == before + 1);
  CHECK(format->pad_id() == tok->eos_id());  // the model has no <pad>
  const int32_t bos = static_cast<int32_t>(tok->bos_id()), eos = static_cast<int32_t>(tok->eos_id());
  const int32_t ws = tok->piece_to_id(kWs);

  // Without an instruction: <s> ▁ <|embed|> (the dummy-prefix ▁ precedes the first symbol).
  CHECK(format->instruction_length("") == 3);
  CHECK(format->encode_embed("", "a cat").ids ==
        cat({bos, ws, format->embed_id()}, tok->encode("a cat")));
  const std::string instruction = "Find the passage";
  const int64_t length = format->instruction_length(instruction);
  CHECK(length == 1 + static_cast<int64_t>(tok->encode(memopt::data::embed_prefix(instruction)).size()));
  CHECK(length == 1 + 1 + 1 + static_cast<int64_t>(tok->encode(instruction).size()) + 1 + 1);  // <s> ▁ <|user|> .. ▁ <|embed|>
  CHECK(format->cached_instructions() == 2);
  format->instruction_length(":Find the passage:\n");  // the same instruction once stripped
  format->encode_embed(instruction, "more text");
  CHECK(format->cached_instructions() == 2);

  for (const std::string text : {"The cat sat.", "  the  other\tone", "x", "in the earth"}) {
    INFO("text: " << text);
    const auto seq = format->encode_embed(instruction, text);
    CHECK(seq.prefix_len == length);
    const std::vector<int32_t> pooled(seq.ids.begin() + seq.prefix_len, seq.ids.end());
    CHECK(pooled == tok->encode(text));
    // With "\n" normalized to a space, prefix + text tokenized apart == the whole string.
    const std::string whole = format_embed(instruction, text).substr(3);  // without "<s>"
    CHECK(seq.ids == cat({bos}, tok->encode(whole)));
  }

  // Generative: [<s>] + user part + answer + [</s>]; also equal to the whole string.
  const auto gen = format->encode_gen("Say the", " the answer ");
  CHECK(gen.ids == cat(cat(cat({bos}, tok->encode(memopt::data::gen_prefix("Say the"))), tok->encode("the answer")), {eos}));
  CHECK(gen.prompt_len == 1 + static_cast<int64_t>(tok->encode(memopt::data::gen_prefix("Say the")).size()));
  const std::string whole_gen = format_gen("Say the", " the answer ");
  CHECK(gen.ids == cat(cat({bos}, tok->encode(whole_gen.substr(3, whole_gen.size() - 3 - 4))), {eos}));
  CHECK(tok->decode(gen.ids) == "<|user|> Say the <|assistant|> the answer");

  // Truncation on the right.
  CHECK(format->encode_embed(instruction, "a long text here", length + 2).ids.size() == static_cast<size_t>(length + 2));
  CHECK(format->encode_gen("Say", "a long answer", 6).ids.size() == 6);
  require_error([&] { format->encode_embed(instruction, "text", length); }, {"no token of the text", "HINT"});
  require_error([&] { format->encode_embed(instruction, "   "); }, {"no token of the text"});

  // An identity normalizer keeps "\n" as a character: the whole string would glue the text's
  // first word to it, while the split encoding keeps pooled tokens == encode(text).
  auto raw_tok = make_tokenizer(/*newline_is_space=*/false);
  GritFormat raw(raw_tok);
  const auto seq = raw.encode_embed(instruction, "cat");
  CHECK(std::vector<int32_t>(seq.ids.begin() + seq.prefix_len, seq.ids.end()) == raw_tok->encode("cat"));
  CHECK(seq.ids != cat({bos}, raw_tok->encode(format_embed(instruction, "cat").substr(3))));
}

// ---- collation -------------------------------------------------------------------------

TEST_CASE("GritBatcher: queries and passages padded, pool masks exclude instruction and padding",
          "[grit]") {
  auto format = std::make_shared<GritFormat>(make_tokenizer());
  std::vector<EmbedRecord> records = {
      {"a short query", "its positive passage is longer than the others", {"negative one", "negative two is long"}, "Find it"},
      {"a much longer second query with words", "pos two", {"n"}, "", "Passage task"},
      {"q3", "p3", {"n3a", "n3b"}, "Find it"},
      {"q4 q4", "p4 p4", {"n4"}, "Another task"}};
  GritBatcher batcher(format, records, {}, GritBatcherOptions(2).group_size(3).bucket(false).seed(5));
  CHECK(batcher.embed_batches_per_epoch() == 2);
  CHECK(batcher.gen_batches_per_epoch() == 0);
  std::set<std::string> seen;
  for (int64_t index = 0; index < 2; ++index) {
    const GritBatch b = batcher.batch(index);
    CHECK(b.group_size == 3);
    CHECK(b.queries.tokens.sizes()[0] == 2);
    CHECK(b.passages.tokens.sizes()[0] == 6);
    CHECK(b.queries.tokens.scalar_type() == torch::kLong);
    CHECK(b.queries.attention.scalar_type() == torch::kBool);
    CHECK(b.passages.pool.scalar_type() == torch::kBool);
    CHECK_FALSE(b.generative.inputs.defined());
    for (int64_t i = 0; i < 2; ++i) {
      // Which record is query i: decode its pooled tokens.
      const auto q = row(b.queries.tokens, i);
      const auto qpool = row(b.queries.pool, i);
      std::vector<int32_t> pooled;
      for (size_t t = 0; t < q.size(); ++t) {
        if (qpool[t]) pooled.push_back(static_cast<int32_t>(q[t]));
      }
      const std::string text = format->tokenizer().decode(pooled);
      const auto it = std::find_if(records.begin(), records.end(), [&](const EmbedRecord& r) { return r.query == text; });
      REQUIRE(it != records.end());
      seen.insert(text);
      // Row by row: tokens, attention and pool exactly as the sequence says.
      auto check_row = [&](const memopt::data::EmbedBatch& e, int64_t r, const std::string& body,
                           const std::string& instruction) {
        const auto seq = format->encode_embed(instruction, body);
        const auto tokens = row(e.tokens, r), attention = row(e.attention, r), pool = row(e.pool, r);
        for (size_t t = 0; t < tokens.size(); ++t) {
          const bool real = t < seq.ids.size();
          CHECK(attention[t] == real);
          CHECK(pool[t] == (real && static_cast<int64_t>(t) >= seq.prefix_len));
          CHECK(tokens[t] == (real ? seq.ids[t] : format->pad_id()));
        }
      };
      check_row(b.queries, i, it->query, it->instruction);
      check_row(b.passages, i * 3, it->pos, memopt::data::passage_instruction(*it));  // row i·G is the positive
      // Passages carry the passage instruction: none (<s> ▁ <|embed|>) unless the record sets one.
      const auto first_pooled = row(b.passages.pool, i * 3);
      const auto prefix = std::find(first_pooled.begin(), first_pooled.end(), 1) - first_pooled.begin();
      CHECK(prefix == format->instruction_length(it->passage_instruction));
      CHECK((prefix == 3) == it->passage_instruction.empty());
      for (int64_t g = 1; g < 3; ++g) {       // then negatives of this record
        const auto p = row(b.passages.tokens, i * 3 + g), pool = row(b.passages.pool, i * 3 + g);
        std::vector<int32_t> body;
        for (size_t t = 0; t < p.size(); ++t) {
          if (pool[t]) body.push_back(static_cast<int32_t>(p[t]));
        }
        const std::string neg = format->tokenizer().decode(body);
        CHECK(std::find(it->neg.begin(), it->neg.end(), neg) != it->neg.end());
        check_row(b.passages, i * 3 + g, neg, it->passage_instruction);
      }
    }
    CHECK(b.num_tokens() == b.queries.attention.sum().item<int64_t>() + b.passages.attention.sum().item<int64_t>());
  }
  CHECK(seen.size() == 4);  // one epoch covers every record once
}

TEST_CASE("GritBatcher: generative targets are ignored on the user part and padding, next token elsewhere",
          "[grit]") {
  auto format = std::make_shared<GritFormat>(make_tokenizer());
  std::vector<GenRecord> records = {{"Say hi", "Hi there, how are you?"},
                                    {"A much longer prompt with many words in it", "Ok"},
                                    {"Count", "1 2 3"}};
  GritBatcher batcher(format, {}, records, GritBatcherOptions(3).bucket(false));
  CHECK(batcher.embed_batches_per_epoch() == 0);
  const GritBatch b = batcher.batch(0);
  CHECK_FALSE(b.queries.tokens.defined());
  CHECK_FALSE(b.passages.tokens.defined());
  const auto& inputs = b.generative.inputs;
  const auto& targets = b.generative.targets;
  REQUIRE(inputs.sizes() == targets.sizes());
  REQUIRE(inputs.sizes()[0] == 3);
  int64_t longest = 0, answers_found = 0, real = 0;
  for (int64_t i = 0; i < 3; ++i) {
    const auto in = row(inputs, i), tg = row(targets, i), att = row(b.generative_attention, i);
    // The record: the one whose sequence has these input tokens.
    for (const auto& r : records) {
      const auto seq = format->encode_gen(r.prompt, r.answer);
      const auto len = static_cast<int64_t>(seq.ids.size());
      if (len - 1 > static_cast<int64_t>(in.size()) ||
          !std::equal(seq.ids.begin(), seq.ids.end() - 1, in.begin())) {
        continue;
      }
      ++answers_found;
      longest = std::max(longest, len - 1);
      for (int64_t t = 0; t < static_cast<int64_t>(in.size()); ++t) {
        INFO("row " << i << " t " << t << " prompt_len " << seq.prompt_len << " len " << len);
        const bool real_input = t < len - 1;
        CHECK(att[t] == real_input);
        real += real_input;
        if (!real_input) {
          CHECK(in[t] == format->pad_id());
          CHECK(tg[t] == memopt::kIgnoreIndex);
        } else if (t + 1 < seq.prompt_len) {
          CHECK(tg[t] == memopt::kIgnoreIndex);  // the user part: <s> <|user|> prompt <|assistant|>
        } else {
          CHECK(tg[t] == seq.ids[t + 1]);        // the answer and </s>
        }
      }
      // The first target is the answer's first token, the last one </s>.
      CHECK(tg[seq.prompt_len - 1] == format->tokenizer().encode(r.answer)[0]);
      CHECK(tg[len - 2] == format->tokenizer().eos_id());
    }
  }
  CHECK(answers_found == 3);
  CHECK(inputs.sizes()[1] == longest);
  CHECK(b.num_tokens() == real);
  CHECK(b.num_targets().item<int64_t>() == 1);
}

// ---- JSONL -----------------------------------------------------------------------------

TEST_CASE("read_embed_jsonl / read_gen_jsonl: records, fatal errors name file:line and field, skips counted",
          "[grit][jsonl]") {
  using memopt::data::OnBadLine;
  const std::string embed_path = fixture("grit_embed.jsonl");
  auto embed = memopt::data::read_embed_jsonl(embed_path, OnBadLine::kSkip);
  CHECK(embed.lines == 8);
  CHECK(embed.skipped == 5);
  REQUIRE(embed.records.size() == 3);
  CHECK(embed.records[0].query == "what keeps training memory low");
  CHECK(embed.records[0].neg == std::vector<std::string>{"a cat sat", "the dog ran"});
  CHECK(embed.records[0].instruction == "Retrieve the answer:");
  CHECK(embed.records[1].pos == "first positive");  // a list: the first
  CHECK(embed.records[1].neg.empty());               // optional
  CHECK(embed.records[2].instruction.empty());
  CHECK(embed.records[2].passage_instruction == "Represent the passage");
  CHECK(embed.records[0].passage_instruction.empty());
  REQUIRE(embed.messages.size() == 5);
  CHECK_THAT(embed.messages[0], Catch::Contains(embed_path + ":3: field 'neg' must be a list"));
  CHECK_THAT(embed.messages[1], Catch::Contains(embed_path + ":5: field 'pos' must be a string or a list"));
  CHECK_THAT(embed.messages[2], Catch::Contains(embed_path + ":6: not valid JSON"));
  CHECK_THAT(embed.messages[3], Catch::Contains(embed_path + ":7: field 'query' is missing"));
  CHECK_THAT(embed.messages[4], Catch::Contains(embed_path + ":8: field 'query' is empty"));
  require_error([&] { memopt::data::read_embed_jsonl(embed_path); }, {embed_path + ":3:", "'neg'", "OnBadLine::kSkip"});

  const std::string gen_path = fixture("grit_gen.jsonl");
  auto gen = memopt::data::read_gen_jsonl(gen_path, OnBadLine::kSkip);
  CHECK(gen.lines == 5);
  CHECK(gen.skipped == 3);
  REQUIRE(gen.records.size() == 2);
  CHECK(gen.records[1].prompt == "Count to three");
  CHECK(gen.records[1].answer == "1 2 3");
  CHECK_THAT(gen.messages[0], Catch::Contains(gen_path + ":2: field 'answer' is missing"));
  CHECK_THAT(gen.messages[1], Catch::Contains(gen_path + ":3: expected a JSON object (got array)"));
  CHECK_THAT(gen.messages[2], Catch::Contains(gen_path + ":4: field 'answer' must be a string (got number)"));
  require_error([&] { memopt::data::read_gen_jsonl(gen_path, OnBadLine::kFatal); },
                {gen_path + ":2:", "'answer' is missing", "{\"prompt\": str, \"answer\": str}"});

  TempDir dir;
  require_error([&] { memopt::data::read_gen_jsonl(dir.file("absent.jsonl")); },
                {dir.file("absent.jsonl"), "does not exist"});
  // Many bad lines: all counted, the first few kept.
  {
    std::ofstream bad(dir.file("bad.jsonl"));
    for (int i = 0; i < 30; ++i) bad << "{\"prompt\": 1}\n";
  }
  auto many = memopt::data::read_gen_jsonl(dir.file("bad.jsonl"), OnBadLine::kSkip);
  CHECK(many.skipped == 30);
  CHECK(many.messages.size() == memopt::data::JsonlRecords<GenRecord>::kMaxMessages);
  CHECK(many.records.empty());
}

// ---- bucketing, determinism, filters -----------------------------------------------------

TEST_CASE("GritBatcher: length bucketing lowers the padding fraction", "[grit]") {
  auto format = std::make_shared<GritFormat>(make_tokenizer());
  const auto records = diverse_records(128);
  std::vector<GenRecord> gen;
  for (int i = 0; i < 128; ++i) {
    gen.push_back({"Continue " + std::to_string(i), std::string(static_cast<size_t>(1 + (i * 53) % 128), 'a')});
  }
  auto options = GritBatcherOptions(4).group_size(2).passage_max_len(1024).query_max_len(1024).gen_max_len(1024);
  GritBatcher plain(format, records, gen, GritBatcherOptions(options).bucket(false));
  GritBatcher bucketed(format, records, gen, GritBatcherOptions(options).bucket(true).bucket_batches(8));
  REQUIRE(plain.batches_per_epoch() == 32);
  const double before = plain.padding(0, 32).fraction();
  const double after = bucketed.padding(0, 32).fraction();
  INFO("padding plain " << before << ", bucketed " << after);
  CHECK(before > 0.25);
  CHECK(after < 0.5 * before);
  // Both cover every record once per epoch.
  for (const GritBatcher* b : {&plain, &bucketed}) {
    std::multiset<int64_t> first_tokens_seen;
    std::set<std::string> queries;
    for (int64_t i = 0; i < 32; ++i) {
      const GritBatch batch = b->batch(i);
      for (int64_t r = 0; r < 4; ++r) {
        const auto t = row(batch.queries.tokens, r), pool = row(batch.queries.pool, r);
        std::vector<int32_t> body;
        for (size_t k = 0; k < t.size(); ++k) {
          if (pool[k]) body.push_back(static_cast<int32_t>(t[k]));
        }
        queries.insert(format->tokenizer().decode(body));
      }
    }
    CHECK(queries.size() == 128);
  }
}

TEST_CASE("GritBatcher: batch(index) is a pure function of seed and index; epochs reshuffle", "[grit]") {
  auto format = std::make_shared<GritFormat>(make_tokenizer());
  const auto records = diverse_records(40);
  std::vector<GenRecord> gen = {{"a", "b c"}, {"d e f", "g"}, {"h", "i j k l"}, {"m", "n"}, {"o p", "q r s"}};
  const auto options = GritBatcherOptions(4).gen_batch_size(2).group_size(2).seed(3);
  GritBatcher a(format, records, gen, options);
  GritBatcher b(format, records, gen, options);
  GritBatcher c(format, records, gen, GritBatcherOptions(options).seed(4));
  CHECK(a.embed_batches_per_epoch() == 10);
  CHECK(a.gen_batches_per_epoch() == 2);
  CHECK(a.batches_per_epoch() == 10);
  auto same = [](const GritBatch& x, const GritBatch& y) {
    return torch::equal(x.queries.tokens, y.queries.tokens) && torch::equal(x.passages.tokens, y.passages.tokens) &&
           torch::equal(x.passages.pool, y.passages.pool) && torch::equal(x.generative.inputs, y.generative.inputs) &&
           torch::equal(x.generative.targets, y.generative.targets);
  };
  // Out of order, on another batcher, from several threads: the same batches.
  const GritBatch a7 = a.batch(7);
  const GritBatch a23 = a.batch(23);  // epoch 2
  std::vector<GritBatch> from_threads(24);
  {
    std::vector<std::thread> threads;
    for (int w = 0; w < 3; ++w) {
      threads.emplace_back([&, w] {
        for (int64_t i = 23 - w; i >= 0; i -= 3) from_threads[static_cast<size_t>(i)] = b.batch(i);
      });
    }
    for (auto& t : threads) t.join();
  }
  CHECK(same(a7, from_threads[7]));
  CHECK(same(a23, from_threads[23]));
  CHECK(same(a.batch(0), from_threads[0]));
  CHECK_FALSE(same(a7, c.batch(7)));
  // Another epoch is another order (batch 10 starts epoch 1 of the contrastive set).
  bool all_equal = true;
  for (int64_t i = 0; i < 10; ++i) all_equal = all_equal && same(from_threads[i], from_threads[i + 10]);
  CHECK_FALSE(all_equal);
  // The generative part cycles through its own epochs of 2 batches.
  CHECK(from_threads[1].generative.inputs.sizes()[0] == 2);
  require_error([&] { a.batch(-1); }, {"batch index must be >= 0 (got -1)"});
}

TEST_CASE("GritBatcher: drops long instructions and records without negatives; char pre-filter", "[grit]") {
  auto format = std::make_shared<GritFormat>(make_tokenizer());
  const std::string huge(5000, 'x');
  std::vector<EmbedRecord> records = {
      {"q1", "p1", {"n1"}, "Short"},
      {"q2", "p2", {"n2"}, "A rather long instruction that fills the query"},  // >= query_max_len tokens
      {"q3", "p3", {}, ""},                                                     // no negative, G = 2
      {"q4 " + huge, "p4 " + huge, {"n4 " + huge}, ""},                          // texts cut before tokenizing
      {"q5", "p5", {"n5"}, std::string(400, 'i')},                               // > 10 × 16 chars
      {"q6", "p6", {"n6"}, "", "A passage instruction longer than the passage limit of tokens"}};
  std::vector<GenRecord> gen = {{"Say", "ok " + huge}, {"A prompt of many many words that will not fit", "x"}, {"P", "a"}};
  GritBatcher batcher(format, records, gen,
                      GritBatcherOptions(2).group_size(2).query_max_len(16).passage_max_len(32).gen_max_len(24));
  const auto& s = batcher.stats();
  CHECK(s.embed_records == 2);
  CHECK(s.dropped_long_instruction == 3);
  CHECK(s.dropped_no_negatives == 1);
  CHECK(s.gen_records == 2);
  CHECK(s.dropped_long_prompt == 1);
  CHECK(s.truncated_texts == 4);  // q4, p4, n4 and the first answer
  const GritBatch b = batcher.batch(0);
  CHECK(b.queries.tokens.sizes()[1] <= 16);
  CHECK(b.passages.tokens.sizes()[1] <= 32);
  CHECK(b.generative.inputs.sizes()[1] <= 23);
  CHECK(b.queries.pool.sum(1).min().item<int64_t>() >= 1);  // every query has pooled tokens
  // The truncated answer still has targets; no </s> at its cut end.
  CHECK(b.generative.targets.ne(memopt::kIgnoreIndex).sum().item<int64_t>() > 0);

  require_error([&] { GritBatcher(format, {records[0]}, {}, GritBatcherOptions(2)); },
                {"1 contrastive records, fewer than batch_size 2"});
  require_error([&] { GritBatcher(format, {records[2]}, {}, GritBatcherOptions(1).group_size(2)); },
                {"no records left", "1 without negatives"});
  require_error([&] { GritBatcher(format, {records[0]}, {}, GritBatcherOptions(1).query_max_len(1)); },
                {"query_max_len, passage_max_len and gen_max_len must be >= 2"});
}

TEST_CASE("GritBatch: to(), pin_memory() on empty parts, num_tokens from masks", "[grit]") {
  auto format = std::make_shared<GritFormat>(make_tokenizer());
  GritBatcher batcher(format, diverse_records(8), {}, GritBatcherOptions(4).group_size(2));
  const GritBatch b = batcher.batch(1);
  const GritBatch moved = b.to(torch::kCPU);
  CHECK(torch::equal(moved.passages.tokens, b.passages.tokens));
  CHECK_FALSE(moved.generative.inputs.defined());
  GritBatch counted = b;
  counted.real_tokens = -1;
  CHECK(counted.num_tokens() == b.num_tokens());
  const auto padding = memopt::data::padding_of(b);
  CHECK(padding.positions == b.queries.tokens.numel() + b.passages.tokens.numel());
  CHECK(padding.tokens == b.num_tokens());
  CHECK(padding.fraction() > 0.0);
  if (torch::cuda::is_available()) {
    const GritBatch pinned = b.pin_memory();
    CHECK(pinned.queries.tokens.is_pinned());
    CHECK_FALSE(pinned.generative.inputs.defined());
  }
}

// ---- Prefetcher ----------------------------------------------------------------------------

TEST_CASE("Prefetcher returns the same sequence with 0, 1 and 3 workers", "[grit][prefetch]") {
  auto format = std::make_shared<GritFormat>(make_tokenizer());
  std::vector<GenRecord> gen = {{"a", "b c"}, {"d e f", "g"}, {"h", "i j k l"}, {"m", "n"}};
  GritBatcher batcher(format, diverse_records(24), gen, GritBatcherOptions(4).gen_batch_size(2));
  std::vector<std::vector<torch::Tensor>> runs;
  for (int64_t workers : {0, 1, 3}) {
    Prefetcher<GritBatch> prefetch([&](int64_t i) { return batcher.batch(i); },
                                   PrefetchOptions().workers(workers).depth(2).pin_memory(true));
    std::vector<torch::Tensor> seq;
    for (int i = 0; i < 9; ++i) {
      const GritBatch b = prefetch.next();
      if (!torch::cuda::is_available()) CHECK_FALSE(b.queries.tokens.is_pinned());  // a no-op without CUDA
      seq.push_back(b.passages.tokens);
      seq.push_back(b.generative.targets);
    }
    CHECK(prefetch.index() == 9);
    runs.push_back(seq);
  }
  for (size_t r = 1; r < runs.size(); ++r) {
    for (size_t k = 0; k < runs[0].size(); ++k) CHECK(torch::equal(runs[0][k], runs[r][k]));
  }
  // Plain values, out-of-order completion (later items are faster): still in order.
  for (int64_t workers : {0, 1, 3}) {
    Prefetcher<int64_t> prefetch([](int64_t i) {
      std::this_thread::sleep_for(std::chrono::milliseconds((7 - i % 7)));
      return i * i;
    }, PrefetchOptions().workers(workers).depth(4));
    for (int64_t i = 0; i < 20; ++i) CHECK(prefetch.next() == i * i);
  }
}

TEST_CASE("Prefetcher rethrows a producer's exception from the next() of its item, with the index",
          "[grit][prefetch]") {
  for (int64_t workers : {0, 2}) {
    INFO("workers " << workers);
    Prefetcher<int64_t> prefetch([](int64_t i) -> int64_t {
      if (i == 2) throw std::runtime_error("boom at two");
      if (i == 4) TORCH_CHECK(false, "torch error at four");
      return i;
    }, PrefetchOptions().workers(workers).depth(3));
    CHECK(prefetch.next() == 0);
    CHECK(prefetch.next() == 1);
    require_error([&] { prefetch.next(); }, {"producing item 2 failed", "boom at two"}, "memopt::data::Prefetcher");
    CHECK(prefetch.next() == 3);  // the sequence goes on
    require_error([&] { prefetch.next(); }, {"producing item 4 failed", "torch error at four"}, "memopt::data::Prefetcher");
    CHECK(prefetch.next() == 5);
  }
}

TEST_CASE("Prefetcher keeps at most depth items ahead; start and skip resume", "[grit][prefetch]") {
  std::atomic<int64_t> produced{0};
  auto wait_for = [&](int64_t n) {
    for (int i = 0; i < 2000 && produced.load() < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  {
    Prefetcher<int64_t> prefetch([&](int64_t i) {
      ++produced;
      return i;
    }, PrefetchOptions().workers(3).depth(3));
    wait_for(3);
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    CHECK(produced.load() == 3);  // full, and no more
    for (int64_t i = 0; i < 5; ++i) CHECK(prefetch.next() == i);
    wait_for(8);
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    CHECK(produced.load() == 5 + 3);
  }
  Prefetcher<int64_t> resumed([](int64_t i) { return i; }, PrefetchOptions().workers(2).depth(2).start(5));
  CHECK(resumed.next() == 5);
  resumed.skip(3);
  CHECK(resumed.index() == 9);
  CHECK(resumed.next() == 9);
  CHECK(resumed.next() == 10);
  Prefetcher<int64_t> inline_one([](int64_t i) { return i; }, PrefetchOptions().workers(0).start(2));
  inline_one.skip(2);
  CHECK(inline_one.next() == 4);
  require_error([&] { resumed.skip(-1); }, {"cannot skip -1"}, "memopt::data::Prefetcher");
  require_error([&] { Prefetcher<int64_t>([](int64_t i) { return i; }, PrefetchOptions().depth(0)); },
                {"depth must be >= 1 (got 0)"}, "memopt::data::Prefetcher");
}

TEST_CASE("Prefetcher's destructor stops workers waiting on a full queue", "[grit][prefetch]") {
  std::atomic<int64_t> produced{0};
  const auto start = std::chrono::steady_clock::now();
  {
    Prefetcher<std::vector<int64_t>> prefetch([&](int64_t i) {
      ++produced;
      return std::vector<int64_t>(100, i);
    }, PrefetchOptions().workers(3).depth(2));
    for (int i = 0; i < 2000 && produced.load() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    CHECK(produced.load() == 2);
  }  // never consumed: the workers wait on the full queue and must wake to stop
  {
    // A producer still running when the prefetcher goes: the call finishes, then the join.
    Prefetcher<int64_t> slow([](int64_t i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      return i;
    }, PrefetchOptions().workers(2).depth(4));
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
}
