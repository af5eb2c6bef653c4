// tests/loop_types_test.cpp — memopt/loop_types.hpp: next_batches draws n batches in the
// loader's order, count_targets and count_tokens add up the batches' targets and positions,
// LossSum forwards to the model's loss_sum, and the concepts accept the types that have what
// the loop calls and refuse those that lack a piece.
#include <catch2/catch.hpp>

#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memopt/batch.hpp>
#include <memopt/loop_types.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/policies/recompute.hpp>

namespace {

// Batch k: (2, 3) inputs all k; targets k too, with the first k positions ignored (k <= 6).
struct CountingSource {
  int64_t next_index = 0;
  memopt::Batch next() {
    const int64_t k = next_index++;
    auto targets = torch::full({2, 3}, k, torch::kLong);
    targets.view({-1}).narrow(0, 0, k).fill_(memopt::kIgnoreIndex);
    return {torch::full({2, 3}, k, torch::kLong), targets};
  }
};

// A batch type of its own, with what the loop needs.
struct OwnBatch {
  int64_t n = 0;
  OwnBatch to(const c10::Device&) const { return *this; }
  torch::Tensor num_targets() const { return torch::tensor(n); }
  int64_t num_tokens() const { return 10 * n; }
};
struct NoTokens {  // lacks num_tokens()
  NoTokens to(const c10::Device&) const { return *this; }
  torch::Tensor num_targets() const { return torch::tensor(0); }
};
struct OwnLoader {
  OwnBatch next() { return {}; }
};
struct IntLoader {
  int next() { return 0; }
};
struct Resumable {
  memopt::Batch next();
  nlohmann::json state() const;
  void load_state(const nlohmann::json&);
};
struct StateOnly {  // no load_state()
  nlohmann::json state() const;
};
struct MutableState {  // state() is not const
  nlohmann::json state();
  void load_state(const nlohmann::json&);
};
struct Finite {
  bool has_next(int64_t n) const;
};

static_assert(memopt::TrainingBatch<memopt::Batch>);
static_assert(memopt::TrainingBatch<OwnBatch>);
static_assert(!memopt::TrainingBatch<NoTokens>);
static_assert(!memopt::TrainingBatch<int>);
static_assert(memopt::BatchSource<CountingSource>);
static_assert(memopt::BatchSource<OwnLoader>);
static_assert(!memopt::BatchSource<IntLoader>);          // next() gives no TrainingBatch
static_assert(!memopt::BatchSource<const CountingSource>);  // next() changes the loader
static_assert(!memopt::BatchSource<OwnBatch>);
static_assert(std::is_same_v<memopt::batch_of<OwnLoader>, OwnBatch>);
static_assert(memopt::ResumableSource<Resumable>);
static_assert(!memopt::ResumableSource<StateOnly>);
static_assert(!memopt::ResumableSource<MutableState>);
static_assert(!memopt::ResumableSource<CountingSource>);
static_assert(memopt::FiniteSource<Finite>);
static_assert(!memopt::FiniteSource<CountingSource>);
static_assert(memopt::SplittableBatch<memopt::Batch>);
static_assert(!memopt::SplittableBatch<OwnBatch>);
static_assert(memopt::LossFunction<memopt::LossSum<memopt::models::Llama>, memopt::recompute::EveryBlock>);

// A model holder whose loss_sum says what it was given: 1000 × the batch's first input plus
// 1 for recompute::None, 2 for recompute::EveryBlock.
struct FakeModel {
  int64_t calls = 0;
  template <class Recompute>
  torch::Tensor loss_sum(const memopt::Batch& b, const Recompute&) {
    ++calls;
    const double policy = std::is_same_v<Recompute, memopt::recompute::None> ? 1 : 2;
    return torch::tensor(1000.0 * b.inputs.view({-1})[0].item<double>() + policy);
  }
};

}  // namespace

TEST_CASE("next_batches draws n batches in the loader's order, count_targets and count_tokens add them up",
          "[loop]") {
  CountingSource loader;
  loader.next_index = 1;
  const auto batches = memopt::next_batches(loader, 3, torch::kCPU);  // batches 1, 2, 3
  REQUIRE(batches.size() == 3);
  CHECK(loader.next_index == 4);
  for (int64_t i = 0; i < 3; ++i) {
    CHECK(torch::equal(batches[static_cast<size_t>(i)].inputs, torch::full({2, 3}, i + 1, torch::kLong)));
    CHECK(batches[static_cast<size_t>(i)].inputs.device() == torch::Device(torch::kCPU));
  }
  // Batch k has 6 - k targets: 5 + 4 + 3.
  const torch::Tensor targets = memopt::count_targets(batches, torch::kCPU);
  CHECK(targets.dim() == 0);
  CHECK(targets.scalar_type() == torch::kFloat);
  CHECK(targets.item<double>() == 12.0);
  CHECK(memopt::count_tokens(batches) == 18);  // 3 × (2, 3), padding included
  CHECK(memopt::next_batches(loader, 0, torch::kCPU).empty());
  CHECK(loader.next_index == 4);

  // A batch type of the user's own.
  const std::vector<OwnBatch> own{{2}, {5}};
  CHECK(memopt::count_targets(own, torch::kCPU).item<double>() == 7.0);
  CHECK(memopt::count_tokens(own) == 70);
}

TEST_CASE("LossSum calls the model's loss_sum with the batch and the recompute policy", "[loop]") {
  auto model = std::make_shared<FakeModel>();
  const memopt::LossSum<std::shared_ptr<FakeModel>> loss{&model};
  CountingSource loader;
  loader.next_index = 3;
  const auto batch = loader.next();
  CHECK(loss(batch, memopt::recompute::None{}).item<double>() == 3001.0);
  CHECK(loss(batch, memopt::recompute::EveryBlock{}).item<double>() == 3002.0);
  CHECK(model->calls == 2);
}
