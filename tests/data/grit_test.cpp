// Tests for memopt/data/grit.hpp: pool masks and generative targets, length bucketing,
// determinism and the pre-filters. Tokenizers are small hand-written SentencePiece models; no
// data/ is needed. The formats and instruction prefixes are tested in grit_format_test.cpp, the
// JSONL readers in grit_records_test.cpp, the Prefetcher in prefetch_test.cpp, user symbols in
// tokenizer_test.cpp.
#include <catch2/catch.hpp>

#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "data/fixtures.hpp"
#include "support.hpp"

#include <memopt/data/grit.hpp>
#include <memopt/data/tokenizer.hpp>

using namespace memopt::test::data::grit;  // NOLINT: the fixtures of the GritLM tests

using memopt::data::EmbedRecord;
using memopt::data::GenRecord;
using memopt::data::GritBatch;
using memopt::data::GritBatcher;
using memopt::data::GritBatcherOptions;
using memopt::data::GritFormat;

namespace {

std::vector<int64_t> row(const torch::Tensor& t, int64_t i) {
  const torch::Tensor r = t[i].to(torch::kLong).contiguous();
  return {r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel()};
}
std::vector<int64_t> as64(const std::vector<int32_t>& v) { return {v.begin(), v.end()}; }

}  // namespace

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

TEST_CASE("GritBatcher: batch(index) is a pure function of seed and index, epochs reshuffle", "[grit]") {
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
  require_error([&] { a.batch(-1); }, {"batch index must be >= 0 (got -1)"}, "memopt::data");
}

TEST_CASE("GritBatcher: drops long instructions and records without negatives, char pre-filter", "[grit]") {
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
                {"1 contrastive records, fewer than batch_size 2"}, "memopt::data");
  require_error([&] { GritBatcher(format, {records[2]}, {}, GritBatcherOptions(1).group_size(2)); },
                {"no records left", "1 without negatives"}, "memopt::data");
  require_error([&] { GritBatcher(format, {records[0]}, {}, GritBatcherOptions(1).query_max_len(1)); },
                {"query_max_len, passage_max_len and gen_max_len must be >= 2"}, "memopt::data");
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
