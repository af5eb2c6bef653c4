// Tests for memopt/data/loader.hpp: the random and sequential loaders (determinism by
// seed, shifted targets, both ends of the shard, skip, order), their errors, and the random
// loader's checkpoint state (state() / load_state).
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

#include <memopt/data/brown.hpp>
#include <memopt/data/kjv.hpp>
#include <memopt/data/loader.hpp>
#include <memopt/data/shard.hpp>
#include <memopt/data/tokenizer.hpp>

#include "data/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::data;  // NOLINT: the fixtures of these tests
using memopt::data::LoaderOptions;
using memopt::data::RandomWindowLoader;
using memopt::data::SequentialLoader;
using memopt::data::TokenShard;

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

TEST_CASE("RandomWindowLoader's state() continues its exact sequence, and another shape is refused", "[checkpoint][data]") {
  memopt::test::TempDir dir("memopt_checkpoint");
  std::vector<int32_t> tokens(500);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i % 97);
  const std::string path = dir.file("train.bin");
  memopt::data::write_shard(path, tokens, 100);
  const auto shard = memopt::data::TokenShard::open(path);
  memopt::data::RandomWindowLoader a(shard, memopt::data::LoaderOptions(3, 16).seed(5));
  a.next();
  a.next();
  const auto state = a.state();
  memopt::data::RandomWindowLoader b(shard, memopt::data::LoaderOptions(3, 16).seed(5));
  b.load_state(state);
  CHECK(b.batches_drawn() == 2);
  CHECK(torch::equal(a.next().inputs, b.next().inputs));
  memopt::data::RandomWindowLoader other(shard, memopt::data::LoaderOptions(4, 16).seed(5));
  memopt::test::require_error([&] { other.load_state(state); }, "memopt::data: RandomWindowLoader::load_state",
                              {"\"batch_size\" is 3 in the checkpoint, 4 now"});
}
