// tests/concepts_test.cpp — memopt/concepts.hpp: every policy memopt ships satisfies its concept
// (RecomputePolicy, PrecisionPolicy, AccumPolicy, StatePolicy) and describes itself with its
// kind's description (hooks::Describes); the optional hooks are present exactly where documented
// (RunCheap: Selective; PrepareGrads: Bf16Pure and Fp16Scaled; MasterGroups and CastWeights:
// Bf16Pure; SkipStep and SkipsOnLocalGrads: Fp16Scaled; SavesState: Bf16Pure and Fp16Scaled;
// RunsMicroBatch: GradCache; StepsInBackward: StepInBackward); a hand-written policy with every
// required hook satisfies its concept and one lacking any single hook (or with the wrong return
// type or constness) does not. At run time: the names and flags the policies report, and their
// descriptions agree with their hooks.
#include <catch2/catch.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memopt/concepts.hpp>
#include <memopt/memopt.hpp>
#include <memopt/memory/policy_desc.hpp>

namespace {

namespace hooks = memopt::hooks;
namespace recompute = memopt::recompute;
namespace precision = memopt::precision;
namespace accum = memopt::accum;
namespace state = memopt::state;
using memopt::memory::DtypeDesc;
using memopt::memory::RecomputeDesc;
using memopt::memory::SplitDesc;
using memopt::memory::StateDesc;

// ---- the shipped policies satisfy their concepts ----
static_assert(memopt::RecomputePolicy<recompute::None>);
static_assert(memopt::RecomputePolicy<recompute::EveryBlock>);
static_assert(memopt::RecomputePolicy<recompute::EveryNth<2>>);
static_assert(memopt::RecomputePolicy<recompute::Selective>);

static_assert(memopt::PrecisionPolicy<precision::Fp32>);
static_assert(memopt::PrecisionPolicy<precision::Bf16Autocast>);
static_assert(memopt::PrecisionPolicy<precision::Bf16Pure>);
static_assert(memopt::PrecisionPolicy<precision::Fp16Scaled>);

static_assert(memopt::AccumPolicy<accum::None>);
static_assert(memopt::AccumPolicy<accum::Fixed<4>>);
static_assert(memopt::AccumPolicy<accum::Runtime>);
static_assert(memopt::AccumPolicy<accum::GradCache>);

static_assert(memopt::StatePolicy<state::Resident>);
static_assert(memopt::StatePolicy<state::Int8>);
static_assert(memopt::StatePolicy<state::Disk>);
static_assert(memopt::StatePolicy<state::PinnedHost>);
static_assert(memopt::StatePolicy<state::StepInBackward>);
static_assert(memopt::StatePolicy<state::StepInBackwardInt8>);

// ... and no policy of one kind passes for another kind
static_assert(!memopt::RecomputePolicy<precision::Fp32>);
static_assert(!memopt::PrecisionPolicy<recompute::None>);
static_assert(!memopt::AccumPolicy<state::Resident>);
static_assert(!memopt::StatePolicy<accum::None>);

// ---- each describes itself with its kind's description, and only that ----
static_assert(hooks::Describes<recompute::None, RecomputeDesc>);
static_assert(hooks::Describes<recompute::EveryBlock, RecomputeDesc>);
static_assert(hooks::Describes<recompute::EveryNth<2>, RecomputeDesc>);
static_assert(hooks::Describes<recompute::Selective, RecomputeDesc>);
static_assert(!hooks::Describes<recompute::None, StateDesc>);

static_assert(hooks::Describes<precision::Fp32, DtypeDesc>);
static_assert(hooks::Describes<precision::Bf16Autocast, DtypeDesc>);
static_assert(hooks::Describes<precision::Bf16Pure, DtypeDesc>);
static_assert(hooks::Describes<precision::Fp16Scaled, DtypeDesc>);
static_assert(!hooks::Describes<precision::Fp32, RecomputeDesc>);

static_assert(hooks::Describes<accum::None, SplitDesc>);
static_assert(hooks::Describes<accum::Fixed<4>, SplitDesc>);
static_assert(hooks::Describes<accum::Runtime, SplitDesc>);
static_assert(hooks::Describes<accum::GradCache, SplitDesc>);
static_assert(!hooks::Describes<accum::None, DtypeDesc>);

static_assert(hooks::Describes<state::Resident, StateDesc>);
static_assert(hooks::Describes<state::Int8, StateDesc>);
static_assert(hooks::Describes<state::Disk, StateDesc>);
static_assert(hooks::Describes<state::PinnedHost, StateDesc>);
static_assert(hooks::Describes<state::StepInBackward, StateDesc>);
static_assert(hooks::Describes<state::StepInBackwardInt8, StateDesc>);
static_assert(!hooks::Describes<state::Resident, SplitDesc>);

// ---- optional hooks, exactly where documented ----
// Recompute: run_cheap only in Selective.
static_assert(hooks::RunCheap<recompute::Selective>);
static_assert(!hooks::RunCheap<recompute::None>);
static_assert(!hooks::RunCheap<recompute::EveryBlock>);
static_assert(!hooks::RunCheap<recompute::EveryNth<2>>);

// Precision: Bf16Pure turns bf16 gradients into fp32 master gradients and keeps the masters;
// Fp16Scaled unscales, backs off on a skipped step and decides skips from local gradients;
// both have state to save. Fp32 and Bf16Autocast have none of these.
static_assert(hooks::PrepareGrads<precision::Bf16Pure>);
static_assert(hooks::PrepareGrads<precision::Fp16Scaled>);
static_assert(!hooks::PrepareGrads<precision::Fp32>);
static_assert(!hooks::PrepareGrads<precision::Bf16Autocast>);

static_assert(hooks::MasterGroups<precision::Bf16Pure>);
static_assert(hooks::CastWeights<precision::Bf16Pure>);
static_assert(!hooks::MasterGroups<precision::Fp32>);
static_assert(!hooks::MasterGroups<precision::Bf16Autocast>);
static_assert(!hooks::MasterGroups<precision::Fp16Scaled>);
static_assert(!hooks::CastWeights<precision::Fp32>);
static_assert(!hooks::CastWeights<precision::Bf16Autocast>);
static_assert(!hooks::CastWeights<precision::Fp16Scaled>);

static_assert(hooks::SkipStep<precision::Fp16Scaled>);
static_assert(hooks::SkipsOnLocalGrads<precision::Fp16Scaled>);
static_assert(!hooks::SkipStep<precision::Fp32>);
static_assert(!hooks::SkipStep<precision::Bf16Autocast>);
static_assert(!hooks::SkipStep<precision::Bf16Pure>);
static_assert(!hooks::SkipsOnLocalGrads<precision::Fp32>);
static_assert(!hooks::SkipsOnLocalGrads<precision::Bf16Autocast>);
static_assert(!hooks::SkipsOnLocalGrads<precision::Bf16Pure>);

static_assert(hooks::SavesState<precision::Bf16Pure>);
static_assert(hooks::SavesState<precision::Fp16Scaled>);
static_assert(!hooks::SavesState<precision::Fp32>);
static_assert(!hooks::SavesState<precision::Bf16Autocast>);
// (no recompute, accumulation or state policy has state of its own to save)
static_assert(!hooks::SavesState<recompute::Selective>);
static_assert(!hooks::SavesState<accum::Runtime>);
static_assert(!hooks::SavesState<state::Int8>);
static_assert(!hooks::SavesState<state::Disk>);

// Accum: only GradCache runs the micro-batch itself.
static_assert(hooks::RunsMicroBatch<accum::GradCache>);
static_assert(!hooks::RunsMicroBatch<accum::None>);
static_assert(!hooks::RunsMicroBatch<accum::Fixed<4>>);
static_assert(!hooks::RunsMicroBatch<accum::Runtime>);

// State: only StepInBackward (and its 8-bit form) steps inside backward.
static_assert(hooks::StepsInBackward<state::StepInBackward>);
static_assert(hooks::StepsInBackward<state::StepInBackwardInt8>);
static_assert(!hooks::StepsInBackward<state::Resident>);
static_assert(!hooks::StepsInBackward<state::Int8>);
static_assert(!hooks::StepsInBackward<state::Disk>);
static_assert(!hooks::StepsInBackward<state::PinnedHost>);

// ---- hand-written policies: all required hooks, or one missing ----
// Recompute
struct MyRecompute {
  torch::Tensor run_block(int64_t, torch::nn::Module&, const memopt::BlockFn& fn,
                          const std::vector<torch::Tensor>& inputs) const {
    return fn(inputs);
  }
};
struct NoRunBlock {
  torch::Tensor run(const memopt::BlockFn& fn, const std::vector<torch::Tensor>& inputs) const { return fn(inputs); }
};
struct RunBlockNotConst {  // the Trainer holds its recompute policy const
  torch::Tensor run_block(int64_t, torch::nn::Module&, const memopt::BlockFn& fn,
                          const std::vector<torch::Tensor>& inputs) {
    return fn(inputs);
  }
};
struct RunBlockWrongType {  // returns the inputs, not one tensor
  std::vector<torch::Tensor> run_block(int64_t, torch::nn::Module&, const memopt::BlockFn&,
                                       const std::vector<torch::Tensor>& inputs) const {
    return inputs;
  }
};
static_assert(memopt::RecomputePolicy<MyRecompute>);
static_assert(!hooks::RunCheap<MyRecompute>);
static_assert(!memopt::RecomputePolicy<NoRunBlock>);
static_assert(!memopt::RecomputePolicy<RunBlockNotConst>);
static_assert(!memopt::RecomputePolicy<RunBlockWrongType>);

// Precision
struct MyPrecision {
  struct Guard {};
  Guard autocast(c10::DeviceType) const { return {}; }
  void backward(const torch::Tensor& loss) const { loss.backward(); }
  bool step(torch::optim::Optimizer& optimizer) const {
    optimizer.step();
    return true;
  }
};
struct NoAutocast {
  void backward(const torch::Tensor& loss) const { loss.backward(); }
  bool step(torch::optim::Optimizer& optimizer) const {
    optimizer.step();
    return true;
  }
};
struct NoBackward {
  struct Guard {};
  Guard autocast(c10::DeviceType) const { return {}; }
  bool step(torch::optim::Optimizer& optimizer) const {
    optimizer.step();
    return true;
  }
};
struct NoStep {
  struct Guard {};
  Guard autocast(c10::DeviceType) const { return {}; }
  void backward(const torch::Tensor& loss) const { loss.backward(); }
};
struct StepReturnsNothing {  // step() must say whether it stepped
  struct Guard {};
  Guard autocast(c10::DeviceType) const { return {}; }
  void backward(const torch::Tensor& loss) const { loss.backward(); }
  void step(torch::optim::Optimizer& optimizer) const { optimizer.step(); }
};
static_assert(memopt::PrecisionPolicy<MyPrecision>);
static_assert(!hooks::PrepareGrads<MyPrecision> && !hooks::SkipStep<MyPrecision> && !hooks::SavesState<MyPrecision>);
static_assert(!memopt::PrecisionPolicy<NoAutocast>);
static_assert(!memopt::PrecisionPolicy<NoBackward>);
static_assert(!memopt::PrecisionPolicy<NoStep>);
static_assert(!memopt::PrecisionPolicy<StepReturnsNothing>);
static_assert(hooks::Autocast<NoStep> && hooks::Backward<NoStep> && !hooks::Step<NoStep>);  // the one missing hook named

// Accum
struct MyAccum {
  int64_t micro_steps() const { return 2; }
};
struct NoMicroSteps {
  int64_t steps() const { return 2; }
};
struct MicroStepsAsText {
  std::string micro_steps() const { return "2"; }
};
static_assert(memopt::AccumPolicy<MyAccum>);
static_assert(!hooks::RunsMicroBatch<MyAccum>);
static_assert(!memopt::AccumPolicy<NoMicroSteps>);
static_assert(!memopt::AccumPolicy<MicroStepsAsText>);

// State
struct MyState {
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                          const torch::optim::AdamWOptions& options) const {
    return std::make_unique<torch::optim::AdamW>(std::move(groups), options);
  }
  void before_step(torch::optim::Optimizer&) const {}
  void after_step(torch::optim::Optimizer&) const {}
};
struct NoMakeOptimizer {
  void before_step(torch::optim::Optimizer&) const {}
  void after_step(torch::optim::Optimizer&) const {}
};
struct NoBeforeStep {
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                          const torch::optim::AdamWOptions& options) const {
    return std::make_unique<torch::optim::AdamW>(std::move(groups), options);
  }
  void after_step(torch::optim::Optimizer&) const {}
};
struct NoAfterStep {
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                          const torch::optim::AdamWOptions& options) const {
    return std::make_unique<torch::optim::AdamW>(std::move(groups), options);
  }
  void before_step(torch::optim::Optimizer&) const {}
};
struct MakesNoOptimizer {  // make_optimizer must give an optimizer
  int make_optimizer(std::vector<torch::optim::OptimizerParamGroup>, const torch::optim::AdamWOptions&) const {
    return 0;
  }
  void before_step(torch::optim::Optimizer&) const {}
  void after_step(torch::optim::Optimizer&) const {}
};
static_assert(memopt::StatePolicy<MyState>);
static_assert(!hooks::StepsInBackward<MyState>);
static_assert(!memopt::StatePolicy<NoMakeOptimizer>);
static_assert(!memopt::StatePolicy<NoBeforeStep>);
static_assert(!memopt::StatePolicy<NoAfterStep>);
static_assert(!memopt::StatePolicy<MakesNoOptimizer>);
static_assert(hooks::MakeOptimizer<NoAfterStep> && hooks::BeforeStep<NoAfterStep> && !hooks::AfterStep<NoAfterStep>);

// Optional hooks: a flag must be true, and saving state takes both halves.
struct StepsLater : MyState {
  static constexpr bool kStepsInBackward = false;
};
struct StepsNow : MyState {
  static constexpr bool kStepsInBackward = true;
};
static_assert(!hooks::StepsInBackward<StepsLater>);
static_assert(hooks::StepsInBackward<StepsNow>);
static_assert(memopt::StatePolicy<StepsNow>);

struct SavesAndLoads : MyPrecision {
  void save_state(torch::serialize::OutputArchive&) const {}
  void load_state(torch::serialize::InputArchive&) {}
};
struct SavesOnly : MyPrecision {
  void save_state(torch::serialize::OutputArchive&) const {}
};
struct SavesNotConst : MyPrecision {  // save_state is called on a const policy
  void save_state(torch::serialize::OutputArchive&) {}
  void load_state(torch::serialize::InputArchive&) {}
};
static_assert(hooks::SavesState<SavesAndLoads>);
static_assert(!hooks::SavesState<SavesOnly>);
static_assert(!hooks::SavesState<SavesNotConst>);

// describe() must give its kind's description.
struct DescribedRecompute : MyRecompute {
  static RecomputeDesc describe() { return {.flag = "mine"}; }
};
struct DescribedWrongKind : MyRecompute {
  static StateDesc describe() { return {.flag = "mine"}; }
};
static_assert(hooks::Describes<DescribedRecompute, RecomputeDesc>);
static_assert(!hooks::Describes<MyRecompute, RecomputeDesc>);
static_assert(!hooks::Describes<DescribedWrongKind, RecomputeDesc>);

}  // namespace

TEST_CASE("The shipped policies' names, flags and hooks agree", "[concepts]") {
  SECTION("recompute") {
    CHECK(recompute::None::name() == "recompute::None");
    CHECK(recompute::EveryBlock::name() == "recompute::EveryBlock");
    CHECK(recompute::EveryNth<2>::name() == "recompute::EveryNth<2>");
    CHECK(recompute::Selective::name() == "recompute::Selective");
    CHECK(recompute::None::describe().flag == "none");
    CHECK(recompute::EveryBlock::describe().flag == "every");
    CHECK(recompute::EveryNth<2>::describe().flag == "every-2");
    CHECK(recompute::Selective::describe().flag == "selective");
    // only the policy with run_cheap describes recomputed cheap parts
    CHECK(recompute::Selective::describe().cheap_parts);
    CHECK_FALSE(recompute::None::describe().cheap_parts);
    CHECK_FALSE(recompute::EveryBlock::describe().cheap_parts);
    CHECK_FALSE(recompute::EveryNth<2>::describe().cheap_parts);
  }
  SECTION("precision") {
    CHECK(precision::Fp32::name() == "precision::Fp32");
    CHECK(precision::Bf16Autocast::name() == "precision::Bf16Autocast");
    CHECK(precision::Bf16Pure::name() == "precision::Bf16Pure");
    CHECK(precision::Fp16Scaled::name() == "precision::Fp16Scaled");
    CHECK(precision::Fp32::describe().flag == "fp32");
    CHECK(precision::Bf16Autocast::describe().flag == "bf16");
    CHECK(precision::Bf16Pure::describe().flag == "bf16-pure");
    CHECK(precision::Fp16Scaled::describe().flag == "fp16");
    // only the policy with master weights (MasterGroups) describes 16-bit weights
    CHECK(precision::Bf16Pure::describe().half_weights);
    CHECK_FALSE(precision::Fp32::describe().half_weights);
    CHECK_FALSE(precision::Bf16Autocast::describe().half_weights);
    CHECK_FALSE(precision::Fp16Scaled::describe().half_weights);
  }
  SECTION("accum") {
    CHECK(accum::None::name() == "accum::None");
    CHECK(accum::Fixed<4>::name() == "accum::Fixed<4>");
    CHECK(accum::Runtime::name() == "accum::Runtime");
    CHECK(accum::GradCache::name() == "accum::GradCache");
    CHECK(accum::None::describe().flag == "none");
    CHECK(accum::Fixed<4>::describe().flag == "fixed-4");
    CHECK(accum::Runtime::describe().flag == "micro-batches");
    CHECK(accum::None{}.micro_steps() == 1);
    CHECK(accum::Fixed<4>{}.micro_steps() == 4);
    CHECK(accum::Runtime(3).micro_steps() == 3);
    CHECK(accum::None::describe().fixed_steps == 1);
    CHECK(accum::Fixed<4>::describe().fixed_steps == 4);
    CHECK(accum::Runtime::describe().fixed_steps == 0);  // from TrainerOptions::accum_steps
    // only the policy that runs the micro-batch itself (RunsMicroBatch) describes a grad cache
    CHECK(accum::GradCache::describe().grad_cache);
    CHECK_FALSE(accum::Runtime::describe().grad_cache);
  }
  SECTION("state") {
    CHECK(state::Resident::name() == "state::Resident");
    CHECK(state::Int8::name() == "state::Int8");
    CHECK(state::Disk::name() == "state::Disk");
    CHECK(state::PinnedHost::name() == "state::PinnedHost");
    CHECK(state::StepInBackward::name() == "state::StepInBackward");
    CHECK(state::StepInBackwardInt8::name() == "state::StepInBackwardInt8");
    CHECK(state::Resident::describe().flag == "resident");
    CHECK(state::Int8::describe().flag == "int8");
    CHECK(state::Disk::describe().flag == "disk");
    CHECK(state::PinnedHost::describe().flag == "pinned-host");
    CHECK(state::StepInBackward::describe().flag == "step-in-backward");
    // only the policies with kStepsInBackward (StepsInBackward) describe stepping in backward
    CHECK(state::StepInBackward::describe().steps_in_backward);
    CHECK(state::StepInBackwardInt8::describe().steps_in_backward);
    CHECK_FALSE(state::Resident::describe().steps_in_backward);
    CHECK_FALSE(state::Int8::describe().steps_in_backward);
    CHECK_FALSE(state::Disk::describe().steps_in_backward);
    CHECK_FALSE(state::PinnedHost::describe().steps_in_backward);
  }
}
