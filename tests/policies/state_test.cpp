// tests/policies/state_test.cpp — memopt/policies/state.hpp: the optimizer-state policies'
// descriptions match the state their optimizers hold, and for_each_adamw_moment visits each
// AdamW moment once (none before the first step), replacing it with what the function returns.
// The optimizers themselves: tests/optim/{adamw8bit,disk_adamw,step_in_backward}_test.cpp.
#include <catch2/catch.hpp>

#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <memopt/memopt.hpp>

#include "policies/fixtures.hpp"
#include "support.hpp"

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

TEST_CASE("CUDA: PinnedHost trains as Resident does, with no optimizer state on the GPU between steps",
          "[state][cuda]") {
  MEMOPT_REQUIRE_CUDA();
  namespace pf = memopt::test::policies;
  using memopt::precision::Fp32;
  using memopt::recompute::None;
  const torch::Device cuda(torch::kCUDA, 0);
  const auto resident = pf::weights_after<None, Fp32, memopt::state::Resident>(3, memopt::TrainerOptions(), {}, cuda);
  const auto pinned = pf::weights_after<None, Fp32, memopt::state::PinnedHost>(3, memopt::TrainerOptions(), {}, cuda);
  CHECK(pf::max_abs_diff(resident, pinned) <= 1e-6);

  // One step each; then the moments (read at once: the step returns with them on the host) and
  // the bytes the caching allocator holds for tensors.
  struct AfterStep {
    std::vector<torch::Tensor> moments;
    int64_t allocated = 0;
    int64_t params = 0;
  };
  auto after_step = [&]<class State>(std::type_identity<State>) {
    torch::manual_seed(11);
    memopt::models::Llama model(pf::tiny_llama(0.0));
    model->to(cuda);
    pf::ListLoader loader{{pf::random_batch(2, 16, 64, 21)}};
    memopt::Trainer<None, Fp32, memopt::accum::None, State> trainer(
        *model, memopt::TrainerOptions().lr(1e-2).warmup_steps(0).max_steps(2));
    REQUIRE(trainer.step(loader, [&](const pf::Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); })
                .stepped);
    AfterStep out;
    memopt::state::for_each_adamw_moment(trainer.optimizer(), [&](const torch::Tensor& m, const torch::Tensor&) {
      if constexpr (std::is_same_v<State, memopt::state::PinnedHost>) {
        CHECK(m.device().is_cpu());
        CHECK(m.is_pinned());
      } else {
        CHECK(m.is_cuda());
      }
      out.moments.push_back(m.to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true));
      return m;
    });
    torch::cuda::synchronize();
    out.allocated = memopt::memory::CudaMemory::now().at(0).allocated_bytes;
    for (const auto& p : model->parameters()) out.params += p.numel();
    return out;
  };
  const auto on_gpu = after_step(std::type_identity<memopt::state::Resident>{});
  const auto on_host = after_step(std::type_identity<memopt::state::PinnedHost>{});
  REQUIRE(on_gpu.moments.size() == on_host.moments.size());
  CHECK(pf::max_abs_diff(on_gpu.moments, on_host.moments) <= 1e-6);
  // The two fp32 moments, 8 B/param, left the GPU (the allocator rounds each block up to 512 B).
  const int64_t saved = on_gpu.allocated - on_host.allocated;
  INFO("allocated after a step: resident " << on_gpu.allocated << " B, pinned-host " << on_host.allocated
                                           << " B; parameters " << on_gpu.params);
  CHECK(saved >= 8 * on_gpu.params);
  CHECK(saved <= 8 * on_gpu.params + 512 * static_cast<int64_t>(on_gpu.moments.size()));
}

TEST_CASE("CUDA: Int8 keeps 8-bit moments on the GPU and steps as it does on the CPU", "[state][cuda]") {
  MEMOPT_REQUIRE_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  // Parameters of 64 x 128 and more: above AdamW8bit's 4096-element fp32 floor, so quantised.
  auto weights_after = [](torch::Device device) {
    torch::manual_seed(2);
    torch::nn::Linear a(torch::nn::LinearOptions(128, 64)), b(torch::nn::LinearOptions(64, 128));
    a->to(device);
    b->to(device);
    auto params = a->parameters();
    for (const auto& p : b->parameters()) params.push_back(p);
    auto optimizer = memopt::state::Int8{}.make_optimizer({torch::optim::OptimizerParamGroup(params)},
                                                          torch::optim::AdamWOptions(1e-2));
    const auto x = torch::randn({32, 128}).to(device);
    for (int s = 0; s < 3; ++s) {
      optimizer->zero_grad();
      b(torch::gelu(a(x))).pow(2).mean().backward();
      optimizer->step();
    }
    int64_t byte_state = 0;
    for (const auto& [key, state] : optimizer->state()) {
      const auto& s = static_cast<const memopt::optim::AdamW8bitParamState&>(*state);
      for (const auto& t : {s.exp_avg(), s.exp_avg_sq()})
        if (t.scalar_type() == torch::kByte && t.device() == device) byte_state += t.numel();
    }
    std::vector<torch::Tensor> out;
    for (const auto& p : params) out.push_back(p.detach().cpu());
    return std::pair{out, byte_state};
  };
  const auto [gpu, gpu_bytes] = weights_after(cuda);
  const auto [cpu, cpu_bytes] = weights_after(torch::kCPU);
  CHECK(gpu_bytes == cpu_bytes);
  CHECK(gpu_bytes >= 2 * (128 * 64 + 64 * 128));  // two 8-bit moments per quantised element
  // The same algorithm; a moment may round to the neighbouring 8-bit code on one device only.
  CHECK(memopt::test::policies::max_abs_diff(gpu, cpu) <= 1e-3);
}
