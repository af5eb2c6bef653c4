// Tests for memopt/data/stream.hpp: packing with EOS between documents; per-document padded
// rows; the shuffle buffer (size 1 is the reading order); determinism by seed and across worker
// counts; rank sharding (disjoint, covering); max_examples and epochs; resume mid-epoch from
// state(); token shards streamed as they are; a Parquet text column streamed as the same JSONL,
// resumed inside the file; finite epochs ending a Trainer's fit(). The sources (files,
// directories, globs, indexes) and their documents: source_test.cpp.
#include <catch2/catch.hpp>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "data/fixtures.hpp"
#include "support.hpp"

#include <memopt/data/source.hpp>
#include <memopt/data/stream.hpp>
#include <memopt/memopt.hpp>

using memopt::data::Packing;
using memopt::data::StreamLoader;
using memopt::data::StreamOptions;

using namespace memopt::test::data::stream;  // NOLINT: the fixtures of the source and stream tests

namespace {

// A character-level BPE model (no merges): <unk> 0, <s> 1, </s> 2, ▁ 3, 'a'..'z' 4..29,
// '0'..'9' 30..39. "w12" encodes as ▁ w 1 2 = {3, 26, 31, 32}.
using memopt::test::data::kWs;

std::shared_ptr<const memopt::data::Tokenizer> char_tokenizer(const TempDir& dir) {
  std::vector<std::tuple<std::string, float, int>> pieces = {{"<unk>", 0.f, 2}, {"<s>", 0.f, 3}, {"</s>", 0.f, 3},
                                                             {kWs, 0.f, 1}};
  for (char c = 'a'; c <= 'z'; ++c) pieces.emplace_back(std::string(1, c), 0.f, 1);
  for (char c = '0'; c <= '9'; ++c) pieces.emplace_back(std::string(1, c), 0.f, 1);
  write_text(dir.file("char.model"), memopt::test::make_model(pieces));
  return std::make_shared<const memopt::data::Tokenizer>(dir.file("char.model"));
}

// Document k is "w<k>": ids ▁ w digits, then EOS once streamed.
std::vector<int32_t> doc_ids(int k) {
  std::vector<int32_t> ids = {3, 26};
  for (char c : std::to_string(k)) ids.push_back(30 + (c - '0'));
  ids.push_back(kEos);
  return ids;
}

// The document index of a padded row holding one whole document (-1 if it is not one).
int doc_of(const std::vector<int32_t>& row) {
  if (row.size() < 4 || row[0] != 3 || row[1] != 26) return -1;
  int k = 0;
  size_t i = 2;
  for (; i < row.size() && row[i] >= 30 && row[i] < 40; ++i) k = 10 * k + (row[i] - 30);
  return (i + 1 == row.size() && row[i] == kEos) ? k : -1;
}

// Rows of every batch: (B, T + 1) ids rebuilt from inputs and targets (padding cut off).
std::vector<std::vector<int32_t>> rows_of(const memopt::Batch& b) {
  std::vector<std::vector<int32_t>> rows;
  for (int64_t r = 0; r < b.inputs.size(0); ++r) {
    std::vector<int32_t> row;
    for (int64_t t = 0; t < b.inputs.size(1); ++t) {
      if (b.targets[r][t].item<int64_t>() == memopt::kIgnoreIndex) break;
      if (t == 0) row.push_back(static_cast<int32_t>(b.inputs[r][t].item<int64_t>()));
      row.push_back(static_cast<int32_t>(b.targets[r][t].item<int64_t>()));
    }
    rows.push_back(row);
  }
  return rows;
}

std::vector<std::vector<int32_t>> drain(StreamLoader& loader, int64_t max_batches = 1 << 20) {
  std::vector<std::vector<int32_t>> rows;
  for (int64_t i = 0; i < max_batches && loader.has_next(); ++i) {
    for (auto& r : rows_of(loader.next())) rows.push_back(r);
  }
  return rows;
}

StreamOptions padded(int64_t batch, int64_t seq_len) {
  return StreamOptions(batch, seq_len).packing(Packing::kPad).shuffle_buffer(1).workers(0);
}

}  // namespace

TEST_CASE("Packing puts EOS between documents, a shuffle buffer of 1 keeps the reading order",
          "[data][stream]") {
  TempDir dir;
  const auto tok = char_tokenizer(dir);
  write_docs(dir.file("a.txt"), 0, 40);
  std::vector<int32_t> expected;  // the documents' ids, EOS after each
  for (int k = 0; k < 40; ++k) {
    for (int32_t id : doc_ids(k)) expected.push_back(id);
  }
  const int64_t T = 7;
  StreamLoader loader({dir.file("a.txt")}, tok, StreamOptions(3, T).shuffle_buffer(1).workers(0));
  const auto rows = drain(loader);
  const auto windows = static_cast<size_t>((static_cast<int64_t>(expected.size()) - 1) / T);
  CHECK(rows.size() == windows / 3 * 3);  // the last partial batch is dropped
  for (size_t r = 0; r < rows.size(); ++r) {
    const std::vector<int32_t> want(expected.begin() + static_cast<std::ptrdiff_t>(r * T),
                                    expected.begin() + static_cast<std::ptrdiff_t>(r * T + T + 1));
    INFO("row " << r);
    CHECK(rows[r] == want);
  }
  CHECK(std::count(expected.begin(), expected.end(), kEos) == 40);

  SECTION("stride: windows start every `stride` ids and overlap") {
    StreamLoader strided({dir.file("a.txt")}, tok, StreamOptions(2, T).stride(3).shuffle_buffer(1).workers(0));
    const auto s = drain(strided, 4);
    REQUIRE(s.size() == 8);
    for (size_t r = 0; r < s.size(); ++r) {
      CHECK(s[r] == std::vector<int32_t>(expected.begin() + static_cast<std::ptrdiff_t>(3 * r),
                                         expected.begin() + static_cast<std::ptrdiff_t>(3 * r + T + 1)));
    }
  }
  SECTION("a larger buffer draws the same rows in another order") {
    StreamLoader in_order({dir.file("a.txt")}, tok, StreamOptions(1, T).shuffle_buffer(1).workers(0));
    StreamLoader shuffled({dir.file("a.txt")}, tok, StreamOptions(1, T).shuffle_buffer(16).workers(0));
    const auto sequential = drain(in_order);
    auto s = drain(shuffled);
    CHECK(s.size() == windows);
    CHECK(s != sequential);
    auto sorted_s = s, sorted_rows = sequential;
    std::sort(sorted_s.begin(), sorted_s.end());
    std::sort(sorted_rows.begin(), sorted_rows.end());
    CHECK(sorted_s == sorted_rows);
  }
}

TEST_CASE("Padded rows: one document a row, padding masked out of the loss", "[data][stream]") {
  TempDir dir;
  const auto tok = char_tokenizer(dir);
  write_text(dir.file("p.txt"), "w5\nabcdefghij\n");
  StreamLoader loader({dir.file("p.txt")}, tok, padded(3, 6));
  const memopt::Batch b = loader.next();
  // w5 -> ▁ w 5 EOS: 3 inputs, 3 targets, then padding.
  CHECK(b.inputs[0].slice(0, 0, 3).equal(torch::tensor({3, 26, 35}, torch::kLong)));
  CHECK(b.targets[0].slice(0, 0, 3).equal(torch::tensor({26, 35, kEos}, torch::kLong)));
  CHECK(b.targets[0].slice(0, 3).eq(memopt::kIgnoreIndex).all().item<bool>());
  CHECK(b.inputs[0].slice(0, 3).eq(kEos).all().item<bool>());  // no pad piece: EOS pads the inputs
  // abcdefghij -> 12 ids: a full row of 7 ids, then the rest starting at its last id.
  CHECK(b.targets[1].ne(memopt::kIgnoreIndex).sum().item<int64_t>() == 6);
  CHECK(b.inputs[2][0].item<int64_t>() == b.targets[1][5].item<int64_t>());
  CHECK(b.targets[2].ne(memopt::kIgnoreIndex).sum().item<int64_t>() == 5);
  CHECK(b.num_targets().item<int64_t>() == 3 + 6 + 5);
}

TEST_CASE("Streams are deterministic by seed and the same for any number of workers", "[data][stream]") {
  TempDir dir;
  const auto tok = char_tokenizer(dir);
  for (int f = 0; f < 4; ++f) write_docs(dir.file("c/" + std::to_string(f) + ".txt"), 100 * f, 60);
  auto run = [&](uint64_t seed, int64_t workers) {
    StreamLoader loader({dir.file("c")}, tok,
                        StreamOptions(4, 9).shuffle_buffer(32).seed(seed).workers(workers).block_documents(7));
    return drain(loader);
  };
  const auto a = run(7, 0);
  CHECK(a.size() > 50);
  CHECK(run(7, 0) == a);
  CHECK(run(7, 1) == a);
  CHECK(run(7, 2) == a);
  CHECK(run(8, 2) != a);
}

TEST_CASE("Rank sharding: each rank's documents are disjoint and together cover the corpus",
          "[data][stream]") {
  TempDir dir;
  const auto tok = char_tokenizer(dir);
  write_docs(dir.file("c/a.txt"), 0, 50);
  write_docs(dir.file("c/b.txt"), 50, 47);
  std::multiset<int> all;
  for (int64_t rank = 0; rank < 3; ++rank) {
    auto options = padded(1, 8).shuffle_buffer(5);
    options.source().rank(rank).world_size(3);
    StreamLoader loader({dir.file("c")}, tok, options);
    std::set<int> mine;
    for (const auto& row : drain(loader)) {
      const int k = doc_of(row);
      REQUIRE(k >= 0);
      mine.insert(k);
      all.insert(k);
    }
    CHECK(mine.size() >= 32);
  }
  CHECK(all.size() == 97);  // disjoint: no document twice
  for (int k = 0; k < 97; ++k) CHECK(all.count(k) == 1);
}

TEST_CASE("max_examples and epochs bound the stream, epochs(0) streams on", "[data][stream]") {
  TempDir dir;
  const auto tok = char_tokenizer(dir);
  write_docs(dir.file("a.txt"), 0, 30);
  auto options = padded(1, 8);
  options.source().max_examples(10).epochs(2);
  StreamLoader loader({dir.file("a.txt")}, tok, options);
  std::vector<int> docs;
  for (const auto& row : drain(loader)) docs.push_back(doc_of(row));
  std::vector<int> want;
  for (int e = 0; e < 2; ++e) {
    for (int k = 0; k < 10; ++k) want.push_back(k);
  }
  CHECK(docs == want);
  require_error([&] { loader.next(); }, {"the stream ended after 20 batches", "raise epochs"}, "memopt::data");

  auto forever = padded(4, 8);
  forever.source().epochs(0);
  StreamLoader endless({dir.file("a.txt")}, tok, forever);
  CHECK(endless.has_next(100));  // 400 rows of a 30-document corpus
}

TEST_CASE("Resuming from state() gives the remaining batches exactly", "[data][stream]") {
  TempDir dir;
  const auto tok = char_tokenizer(dir);
  for (int f = 0; f < 3; ++f) write_docs(dir.file("c/" + std::to_string(f) + ".txt"), 100 * f, 70);
  memopt::data::write_shard(dir.file("c/z.bin"), [] {
    std::vector<int32_t> ids;
    for (int k = 500; k < 560; ++k) {
      for (int32_t id : doc_ids(k)) ids.push_back(id);
    }
    return ids;
  }(), 40);
  auto options = GENERATE(as<std::string>{}, "pack", "pad");
  auto make = [&] {
    auto o = StreamOptions(3, 6).shuffle_buffer(20).seed(3).workers(2).block_documents(5)
                 .packing(options == "pack" ? Packing::kPack : Packing::kPad);
    o.source().epochs(2).shard_chunk_tokens(9);
    return std::make_unique<StreamLoader>(std::vector<std::string>{dir.file("c")}, tok, o);
  };
  INFO(options);
  auto whole = make();
  const auto all = drain(*whole);
  REQUIRE(all.size() > 150);
  for (int64_t cut : {int64_t{0}, int64_t{1}, int64_t{17}, static_cast<int64_t>(all.size() / 3 / 2) + 3}) {
    INFO("cut after " << cut << " batches");
    auto first = make();
    drain(*first, cut);
    first->has_next(2);  // look-ahead batches are part of the state too
    const std::string saved = first->state().dump();
    auto resumed = make();
    resumed->load_state(nlohmann::json::parse(saved));
    const auto rest = drain(*resumed);
    CHECK(rest == std::vector<std::vector<int32_t>>(all.begin() + cut * 3, all.end()));
  }
  // A state of another seed or shape is refused, naming the field.
  auto other = std::make_unique<StreamLoader>(std::vector<std::string>{dir.file("c")}, tok, StreamOptions(3, 7));
  require_error([&] { other->load_state(whole->state()); }, {"\"seq_len\" is 6 in the checkpoint, 7 now"},
                "memopt::data");
}

TEST_CASE("A Parquet text column streams as the same JSONL does, and resumes from state() inside the file",
          "[data][stream][parquet]") {
  TempDir dir;
  memopt::test::ScopedPython python;  // the tests' Python, with pyarrow
  const auto tok = char_tokenizer(dir);
  nlohmann::json rows = nlohmann::json::array();
  std::string jsonl;
  for (int k = 0; k < 120; ++k) {
    if (k % 9 == 4) rows.push_back(nullptr);  // a null row: no document
    rows.push_back("w" + std::to_string(k));
    jsonl.append("{\"text\": \"w").append(std::to_string(k)).append("\"}\n");
  }
  memopt::test::write_parquet(dir.file("p/a.parquet"), {{"text", rows}}, 16);
  write_text(dir.file("j/a.jsonl"), jsonl);
  auto make = [&](const std::string& folder) {
    auto o = StreamOptions(3, 6).shuffle_buffer(20).seed(3).workers(2).block_documents(5);
    o.source().epochs(2);
    return std::make_unique<StreamLoader>(std::vector<std::string>{dir.file(folder)}, tok, o);
  };
  const auto all = drain(*make("p"));
  REQUIRE(all.size() > 100);
  CHECK(all == drain(*make("j")));
  for (int64_t cut : {int64_t{1}, int64_t{17}, static_cast<int64_t>(all.size() / 3 / 2) + 3}) {
    INFO("cut after " << cut << " batches");
    auto first = make("p");
    drain(*first, cut);
    first->has_next(2);
    const std::string saved = first->state().dump();
    auto resumed = make("p");
    resumed->load_state(nlohmann::json::parse(saved));
    CHECK(drain(*resumed) == std::vector<std::vector<int32_t>>(all.begin() + cut * 3, all.end()));
  }
}

TEST_CASE("Token shards stream as they are, ids beyond the vocabulary are refused", "[data][stream]") {
  TempDir dir;
  std::vector<int32_t> ids;
  for (int k = 0; k < 30; ++k) {
    for (int32_t id : doc_ids(k)) ids.push_back(id);
  }
  memopt::data::write_shard(dir.file("s.bin"), ids, 40);
  auto options = StreamOptions(2, 5).shuffle_buffer(1).workers(1);
  options.source().shard_chunk_tokens(4);
  StreamLoader loader({dir.file("s.bin")}, nullptr, options);  // no tokenizer needed
  const auto rows = drain(loader);
  REQUIRE(rows.size() >= 20);
  for (size_t r = 0; r < rows.size(); ++r) {
    CHECK(rows[r] == std::vector<int32_t>(ids.begin() + static_cast<std::ptrdiff_t>(5 * r),
                                          ids.begin() + static_cast<std::ptrdiff_t>(5 * r + 6)));
  }
  StreamLoader small({dir.file("s.bin")}, nullptr, StreamOptions(2, 5).vocab_size(30).workers(0));
  require_error([&] { small.next(); }, {"id 30", ">= the vocabulary size 30"}, "memopt::data");
  TempDir text_dir;
  write_docs(text_dir.file("t.txt"), 0, 3);
  require_error([&] { StreamLoader({text_dir.file("t.txt")}, nullptr, StreamOptions(2, 5)); },
                {"t.txt", "no tokenizer"}, "memopt::data");
}

TEST_CASE("estimate_memory_usage: a whole dataset against a stream", "[data][stream]") {
  const auto e = memopt::data::estimate_memory_usage(100000, 256, 8, 1000, 4);
  CHECK(e.full_load_bytes == int64_t{100000} * 256 * 16);
  CHECK(e.streaming_bytes == int64_t{1000} * 257 * 4 + 5 * 8 * 256 * 16);
  CHECK(e.ratio() > 100);
  // The seed's counting and keys (its guide: 100K x 128 tokens x 2 x 4 bytes = ~100 MB against
  // 32 x 128 x 2 x 4 bytes = 0.03 MB, savings 99.97%).
  const auto seed = memopt::data::estimate_memory_usage(100000, 128, 32);
  CHECK(seed.full_load_mb == Approx(100000.0 * 128 * 2 * 4 / 1048576).epsilon(1e-12));  // 97.66
  CHECK(seed.streaming_mb == Approx(0.03125).epsilon(1e-12));
  CHECK(seed.memory_savings == "99.97%");
  CHECK(memopt::data::estimate_memory_usage(0, 128, 32).memory_savings == "0.00%");
  require_error([] { memopt::data::estimate_memory_usage(10, 0, 8); }, {"seq_len >= 1"}, "memopt::data");
}

TEST_CASE("A Trainer stops when a finite stream runs out", "[data][stream][trainer]") {
  TempDir dir;
  const auto tok = char_tokenizer(dir);
  write_docs(dir.file("a.txt"), 0, 60);
  torch::manual_seed(0);
  memopt::models::Llama model(memopt::models::LlamaConfig().vocab_size(40).hidden_size(16).num_hidden_layers(1)
                                  .num_attention_heads(2).max_position_embeddings(16));
  StreamLoader loader({dir.file("a.txt")}, tok, StreamOptions(2, 8).shuffle_buffer(4));
  memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::Fixed<2>> trainer(
      *model, memopt::TrainerOptions().max_steps(1000).log_interval(1000));
  const auto result = trainer.fit(loader, memopt::LossSum<memopt::models::Llama>{&model});
  // 60 documents of 4-5 ids + EOS: (60*4.8 - 1) / 8 = 35 windows, 17 batches, 8 steps of 2.
  const int64_t batches = loader.batches_drawn();
  CHECK(result.data_exhausted);
  CHECK(result.steps == batches / 2);
  CHECK(result.steps >= 7);
  CHECK_FALSE(loader.has_next(2));
}
