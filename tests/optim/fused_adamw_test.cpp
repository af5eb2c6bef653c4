// tests/optim/fused_adamw_test.cpp — memopt/optim/fused_adamw.hpp: FusedAdamW (state::Resident's
// optimizer) gives LibTorch AdamW's update (two groups, weight decay on and off, parameters that
// skip a step), keeps AdamW's state so each loads the other's, runs one kernel pass without
// temporaries, and falls back to AdamW's step for amsgrad.
#include <catch2/catch.hpp>

#include <cstdint>
#include <sstream>
#include <vector>

#include <torch/torch.h>

#include <memopt/memory/tracker.hpp>
#include <memopt/optim/fused_adamw.hpp>

#include "support.hpp"

using memopt::test::max_abs_diff;

namespace {

struct Run {
  std::vector<torch::Tensor> params;
  std::vector<torch::optim::OptimizerParamGroup> groups() const {
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(std::vector<torch::Tensor>{params[0], params[1]},
                   std::make_unique<torch::optim::AdamWOptions>(
                       torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(0.1)));
    g.emplace_back(std::vector<torch::Tensor>{params[2]},
                   std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(3e-3).weight_decay(0)));
    return g;
  }
};

// Three parameters (a matrix, a vector, a bias-like row) from one seed.
Run make_params() {
  torch::manual_seed(7);
  return {{torch::randn({33, 17}).requires_grad_(), torch::randn({17}).requires_grad_(),
           torch::randn({5, 9}).requires_grad_()}};
}

// `steps` steps of `opt` with the gradients a fixed generator draws; parameter 1 has none at step 2.
void train(torch::optim::Optimizer& opt, const std::vector<torch::Tensor>& params, int steps, uint64_t seed = 3) {
  auto gen = at::detail::createCPUGenerator(seed);
  for (int s = 0; s < steps; ++s) {
    for (size_t i = 0; i < params.size(); ++i) {
      auto g = torch::randn(params[i].sizes(), gen);
      params[i].mutable_grad() = (s == 2 && i == 1) ? torch::Tensor() : g;
    }
    opt.step();
  }
}

std::vector<torch::Tensor> detached(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

double max_rel_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, max_abs_diff(a[i], b[i]) / b[i].abs().max().item<double>());
  return d;
}

}  // namespace

TEST_CASE("FusedAdamW gives LibTorch AdamW's update", "[optim][adamw]") {
  Run plain = make_params(), fused = make_params();
  torch::optim::AdamW reference(plain.groups(), torch::optim::AdamWOptions(1e-2));
  memopt::optim::FusedAdamW opt(fused.groups(), torch::optim::AdamWOptions(1e-2));
  train(reference, plain.params, 6);
  train(opt, fused.params, 6);
  // The kernel interpolates the first moment where AdamW multiplies and adds: last-bit roundings.
  const double diff = max_rel_diff(detached(fused.params), detached(plain.params));
  INFO("max relative difference " << diff);
  CHECK(diff <= 1e-6);
  // The state is AdamW's: the skipped step is not counted.
  const auto& s = static_cast<const torch::optim::AdamWParamState&>(
      *opt.state().at(memopt::detail::optimizer_state_key(opt.state(), fused.params[1])));
  CHECK(s.step() == 5);
  const auto& r = static_cast<const torch::optim::AdamWParamState&>(
      *reference.state().at(memopt::detail::optimizer_state_key(reference.state(), plain.params[1])));
  CHECK(max_abs_diff(s.exp_avg_sq(), r.exp_avg_sq()) <= 1e-6 * r.exp_avg_sq().abs().max().item<double>());
  // The comparison can fail: other gradients give other weights.
  Run other = make_params();
  memopt::optim::FusedAdamW other_opt(other.groups(), torch::optim::AdamWOptions(1e-2));
  train(other_opt, other.params, 6, /*seed=*/4);
  CHECK(max_rel_diff(detached(other.params), detached(plain.params)) > 1e-3);
}

TEST_CASE("FusedAdamW saves AdamW's state: each loads the other's and steps on alike", "[optim][adamw]") {
  Run a = make_params();
  memopt::optim::FusedAdamW fused(a.groups(), torch::optim::AdamWOptions(1e-2));
  train(fused, a.params, 3);
  std::stringstream saved;
  {
    torch::serialize::OutputArchive archive;
    fused.save(archive);
    archive.save_to(saved);
  }
  Run b{detached(a.params)};
  for (auto& p : b.params) p.requires_grad_();
  torch::optim::AdamW plain(b.groups(), torch::optim::AdamWOptions(1e-2));
  {
    torch::serialize::InputArchive archive;
    archive.load_from(saved);
    plain.load(archive);
  }
  train(fused, a.params, 2, /*seed=*/9);
  train(plain, b.params, 2, /*seed=*/9);
  CHECK(max_rel_diff(detached(a.params), detached(b.params)) <= 1e-6);
}

TEST_CASE("FusedAdamW's step makes no temporaries, and amsgrad runs AdamW's step", "[optim][adamw]") {
  auto& tracker = memopt::memory::Tracker::instance();
  Run run = make_params();
  run.params[0] = torch::randn({512, 512}).requires_grad_();
  memopt::optim::FusedAdamW opt(run.groups(), torch::optim::AdamWOptions(1e-2));
  train(opt, run.params, 1);  // creates the state
  for (auto& p : run.params) p.mutable_grad() = torch::randn(p.sizes());
  tracker.reset_peaks();
  const int64_t before = tracker.live_bytes();
  opt.step();
  INFO("peak above live: " << tracker.peak_bytes() - before << " B");
  CHECK(tracker.peak_bytes() - before < 512 * 512 * 4);  // LibTorch's AdamW: two of the largest parameter

  Run plain = make_params(), fused = make_params();
  auto ams = [](Run& r) {
    auto groups = r.groups();
    for (auto& g : groups) static_cast<torch::optim::AdamWOptions&>(g.options()).amsgrad(true);
    return groups;
  };
  torch::optim::AdamW reference(ams(plain), torch::optim::AdamWOptions(1e-2));
  memopt::optim::FusedAdamW fallback(ams(fused), torch::optim::AdamWOptions(1e-2));
  train(reference, plain.params, 3);
  train(fallback, fused.params, 3);
  CHECK(max_rel_diff(detached(fused.params), detached(plain.params)) == 0);
}
