// tests/policies/state_test.cpp — memopt/policies/state.hpp: the optimizer-state policies'
// descriptions match the state their optimizers hold, and for_each_adamw_moment visits each
// AdamW moment once (none before the first step), replacing it with what the function returns.
// The optimizers themselves: tests/optim/{adamw8bit,disk_adamw,step_in_backward}_test.cpp.
#include <catch2/catch.hpp>

#include <set>
#include <string>
#include <vector>

#include <memopt/memopt.hpp>

namespace {

// Two Linear layers' parameters and one AdamW step on a fixed gradient.
struct TwoLayers {
  torch::nn::Linear a{torch::nn::LinearOptions(8, 16)}, b{torch::nn::LinearOptions(16, 4)};
  std::vector<torch::Tensor> params() const {
    auto p = a->parameters();
    auto q = b->parameters();
    p.insert(p.end(), q.begin(), q.end());
    return p;
  }
  std::vector<int64_t> numels() const {
    std::vector<int64_t> n;
    for (const auto& p : params()) n.push_back(p.numel());
    return n;
  }
};

void one_step(torch::optim::Optimizer& optimizer, const std::vector<torch::Tensor>& params) {
  for (const auto& p : params) p.mutable_grad() = torch::full_like(p, 0.5);
  optimizer.step();
}

}  // namespace

TEST_CASE("for_each_adamw_moment visits both moments of each stepped parameter and stores the result",
          "[state]") {
  torch::manual_seed(0);
  TwoLayers net;
  const auto params = net.params();
  auto optimizer = memopt::state::Resident{}.make_optimizer({torch::optim::OptimizerParamGroup(params)},
                                                            torch::optim::AdamWOptions(1e-2));
  int calls = 0;
  auto count = [&](const torch::Tensor& m, const torch::Tensor&) {
    ++calls;
    return m;
  };
  memopt::state::for_each_adamw_moment(*optimizer, count);
  CHECK(calls == 0);  // no state before the first step

  one_step(*optimizer, params);
  std::set<const void*> seen;
  memopt::state::for_each_adamw_moment(*optimizer, [&](const torch::Tensor& m, const torch::Tensor& p) {
    CHECK(m.sizes() == p.sizes());
    seen.insert(p.unsafeGetTensorImpl());
    ++calls;
    return m.to(torch::kBFloat16);
  });
  CHECK(calls == 2 * static_cast<int>(params.size()));
  CHECK(seen.size() == params.size());
  // The replacement is stored: every moment is now bf16, with the values it had.
  memopt::state::for_each_adamw_moment(*optimizer, [](const torch::Tensor& m, const torch::Tensor&) {
    CHECK(m.scalar_type() == torch::kBFloat16);
    return m.to(torch::kFloat);
  });
  one_step(*optimizer, params);  // AdamW steps on the fp32 moments put back
  int64_t state_bytes = 0;
  memopt::state::for_each_adamw_moment(*optimizer, [&](const torch::Tensor& m, const torch::Tensor&) {
    CHECK(m.scalar_type() == torch::kFloat);
    state_bytes += m.numel() * static_cast<int64_t>(m.element_size());
    return m;
  });
  // state::Resident describes exactly the moments AdamW holds.
  CHECK(state_bytes == memopt::state::Resident::describe().resident(net.numels()));
}

TEST_CASE("the optimizer-state policies' flags are distinct, and say what the planner must know", "[state]") {
  namespace st = memopt::state;
  const std::vector<memopt::memory::StateDesc> all = {st::Resident::describe(), st::Int8::describe(),
                                                      st::Disk::describe(), st::PinnedHost::describe(),
                                                      st::StepInBackward::describe(),
                                                      st::StepInBackwardInt8::describe()};
  std::set<std::string> flags;
  for (const auto& d : all) flags.insert(d.flag);
  CHECK(flags.size() == all.size());
  CHECK(st::Resident::describe().flag == "resident");
  const std::vector<int64_t> numels = {1 << 16, 100};
  // 8-bit moments: about a quarter of AdamW's fp32 state for a large tensor; small ones stay fp32.
  CHECK(st::Int8::describe().resident(numels) < st::Resident::describe().resident(numels) / 3);
  CHECK(st::Int8::describe().resident({100}) == st::Resident::describe().resident({100}));
  // Off the device between steps: nothing resident, the whole state at the step, over the host link.
  CHECK(st::PinnedHost::describe().resident(numels) == 0);
  CHECK(st::PinnedHost::describe().step_state_bytes(numels) == st::Resident::describe().resident(numels));
  CHECK(st::PinnedHost::describe().needs_cuda);
  CHECK(st::Disk::describe().needs_cpu);
  CHECK(st::StepInBackward::describe().steps_in_backward);
  CHECK(st::StepInBackwardInt8::describe().steps_in_backward);
  CHECK(!st::Resident::describe().steps_in_backward);
}
