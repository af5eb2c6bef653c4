// tests/dist/data_parallel_test.cpp — memopt/dist/data_parallel.hpp on two ranks (run by
// tests/dist/dist_test.sh): with a sharded optimizer state (ZeRO-1: owners(), ParamShare by
// broadcast or by all-gather, the global-norm clip) each rank trains as one process does (fp32
// AdamW) or as the unsharded ranks do (8-bit AdamW; bf16 weights with fp32 masters), and holds
// half the optimizer state (give or take one tensor); GradientSync's all-reduce and
// reduce-scatter sum what they should where they should, one collective per bucket, freeing
// the gradients a rank does not own.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include <torch/torch.h>

#include <memopt/dist.hpp>
#include <memopt/memopt.hpp>

#include "dist/fixtures.hpp"

using namespace memopt::test::dist;  // dist/fixtures.hpp: launched(), base_options(), Fp32Trainer, ...

TEST_CASE("A sharded optimizer state (ZeRO-1) trains the same and holds half the state", "[dist]") {
  if (!launched()) return;
  SECTION("AdamW, parameters shared by broadcast") {
    check_against_reference<Fp32Trainer>(base_options().shard_optimizer_state(true), 1e-6);
  }
  SECTION("AdamW, parameters shared by all-gather") {
    check_against_reference<Fp32Trainer>(
        base_options().shard_optimizer_state(true).param_gather(memopt::dist::ParamGather::kAllgather), 1e-6);
  }
  SECTION("8-bit AdamW: sharded equals unsharded on the same ranks") {
    // (Against one process the 8-bit state's rounding turns last-bit gradient differences into
    // a quantization step: the sharding itself must change nothing.) No clipping here: the
    // sharded global norm sums its parts in another order, and a last-bit change of the clip
    // factor flips 8-bit codes (1.3e-4 in the weights with LibTorch 2.15's MKL); the global-norm
    // clip is checked against one process in fp32 above.
    using T = memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::Runtime,
                              memopt::state::Int8>;
    const Run whole = train<T>(base_options().grad_clip(0), 6, true);
    const Run sharded = train<T>(base_options().grad_clip(0).shard_optimizer_state(true), 6, true);
    const double diff = (whole.weights - sharded.weights).abs().max().item<double>();
    INFO("max |w_sharded - w_whole| = " << diff);
    CHECK(diff <= 1e-6);
    for (size_t s = 0; s < whole.losses.size(); ++s) CHECK(std::abs(whole.losses[s] - sharded.losses[s]) <= 1e-6);
  }
  SECTION("bf16 weights with fp32 masters: sharded equals unsharded on the same ranks") {
    // The clip norm is the global one: each rank's owned fp32 master gradients, summed over
    // the ranks (measured on the model's bf16 gradients it would miss the owned ones).
    using T = memopt::Trainer<memopt::recompute::None, memopt::precision::Bf16Pure, memopt::accum::Runtime>;
    const Run whole = train<T>(base_options(), 6, true);
    const Run sharded = train<T>(base_options().shard_optimizer_state(true), 6, true);
    const double diff = (whole.weights - sharded.weights).abs().max().item<double>();
    INFO("max |w_sharded - w_whole| = " << diff);
    CHECK(diff <= 1e-6);
    for (size_t s = 0; s < whole.losses.size(); ++s) CHECK(std::abs(whole.losses[s] - sharded.losses[s]) <= 1e-6);
  }
  SECTION("state bytes per rank") {
    const Run whole = train<Fp32Trainer>(base_options(), 1, true);
    const Run sharded = train<Fp32Trainer>(base_options().shard_optimizer_state(true), 1, true);
    torch::manual_seed(1);
    memopt::models::Llama model(tiny_config());
    std::vector<torch::Tensor> params;
    for (const auto& p : model->parameters()) params.push_back(p);
    const auto owner = memopt::dist::owners(params, 2);
    int64_t owned = 0, total = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      total += params[i].numel();
      if (owner[i] == memopt::dist::world().rank()) owned += params[i].numel();
    }
    INFO("rank " << memopt::dist::world().rank() << ": unsharded " << whole.state_bytes << " B, sharded " << sharded.state_bytes << " B, owned " << owned << " of "
                      << total);
    CHECK(whole.state_bytes == 8 * total);  // exp_avg + exp_avg_sq, fp32
    CHECK(sharded.state_bytes == 8 * owned);
    int64_t largest = 0;
    for (const auto& p : params) largest = std::max(largest, p.numel());
    CHECK(std::abs(2 * owned - total) <= largest);  // largest first: the shares differ by at most one tensor
    CHECK(std::abs(static_cast<double>(owned) / static_cast<double>(total) - 0.5) < 0.02);
  }
}

TEST_CASE("GradientSync sums onto every rank, or onto each tensor's owner", "[dist]") {
  if (!launched()) return;
  auto& world = memopt::dist::world();
  const int rank = world.rank();
  const std::vector<int64_t> sizes{5, 3, 8, 1, 4, 2};
  const auto make = [&] {  // rank r's gradient of tensor i: (r + 1) * (i + 1) + arange; tensor 3 has none on rank 1
    std::vector<torch::Tensor> params;
    for (size_t i = 0; i < sizes.size(); ++i) {
      params.push_back(torch::zeros({sizes[i]}, torch::requires_grad()));
      if (i == 3 && rank == 1) continue;
      params.back().mutable_grad() = torch::arange(sizes[i], torch::kFloat) + static_cast<double>((rank + 1) * (i + 1));
    }
    return params;
  };
  const auto expected = [&](size_t i) {  // the sum over both ranks
    torch::Tensor sum = 2 * torch::arange(sizes[i], torch::kFloat) + 3.0 * static_cast<double>(i + 1);
    return i == 3 ? sum - 2.0 * static_cast<double>(i + 1) : sum;  // rank 1's counts as zero
  };
  const auto owner = memopt::dist::owners(make(), 2);
  CHECK(owner == std::vector<int>{1, 0, 0, 0, 1, 1});  // 8 → 0, 5 → 1, 4 → 1, 3 → 0, 2 → 1, 1 → 0: 12 vs 11
  for (const int64_t bucket_bytes : {int64_t{1} << 20, int64_t{16}}) {  // one bucket; buckets one rank owns wholly
    for (const bool scatter : {false, true}) {
      INFO("bucket_bytes " << bucket_bytes << ", reduce-scatter " << scatter);
      auto params = make();
      memopt::dist::GradientSync sync(world, params, bucket_bytes, scatter ? owner : std::vector<int>{});
      torch::Tensor loss = torch::scalar_tensor(rank + 1.0), signal = torch::scalar_tensor(rank == 1 ? 1.0 : 0.0);
      const int64_t before = world.collectives();
      sync.sync({loss, signal});
      CHECK(world.collectives() - before == sync.buckets());
      CHECK((bucket_bytes == 16 ? sync.buckets() > 3 : sync.buckets() == 1));
      CHECK(loss.item<double>() == 3.0);
      CHECK(signal.item<double>() == 1.0);
      for (size_t i = 0; i < sizes.size(); ++i) {
        INFO("tensor " << i);
        if (scatter && owner[i] != rank) {
          CHECK(!params[i].grad().defined());  // freed: its owner holds the sum
        } else {
          REQUIRE(params[i].grad().defined());
          CHECK(torch::equal(params[i].grad(), expected(i)));
        }
      }
    }
  }
}
