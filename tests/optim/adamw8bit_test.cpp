// Tests for include/memopt/optim/adamw8bit.hpp and state::Int8: the state's bytes,
// equivalence with torch::optim::AdamW (one step exactly, training closely), the fused CPU
// kernel against the tensor path, save/load, the Trainer with 8-bit state, and bad options
// rejected with the value and a HINT. The maps and block-wise quantisation: quantize_test.cpp.
#include <catch2/catch.hpp>

#include <cmath>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include <memopt/memopt.hpp>
#include <memopt/optim/adamw8bit.hpp>

#include "optim/fixtures.hpp"
#include "support.hpp"

using namespace memopt::test::optim;  // NOLINT: the fixtures of the optimizer tests

namespace {

using memopt::optim::AdamW8bit;
using memopt::optim::AdamW8bitParamState;
using memopt::optim::kQuantBlockSize;

struct Problem {  // a fixed regression: y = tanh(x W1) W2 + noise, a 2-layer MLP to fit it
  torch::Tensor x, y;
  Problem() {
    auto gen = at::detail::createCPUGenerator(5);
    x = torch::randn({512, 64}, gen);
    y = torch::tanh(x.mm(torch::randn({64, 96}, gen) / 8)).mm(torch::randn({96, 32}, gen)) +
        0.01 * torch::randn({512, 32}, gen);
  }
};

torch::nn::Sequential make_mlp(uint64_t seed) {
  torch::manual_seed(static_cast<int64_t>(seed));
  return torch::nn::Sequential(torch::nn::Linear(64, 128), torch::nn::Tanh(), torch::nn::Linear(128, 32));
}

// Two groups as memopt's param_groups makes them: decay on matrices, none on biases.
std::vector<torch::optim::OptimizerParamGroup> mlp_groups(torch::nn::Sequential& net,
                                                          const torch::optim::AdamWOptions& o) {
  std::vector<torch::Tensor> matrices, biases;
  for (auto& p : net->parameters()) (p.dim() >= 2 ? matrices : biases).push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(matrices, std::make_unique<torch::optim::AdamWOptions>(o));
  groups.emplace_back(biases, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(o).weight_decay(0)));
  return groups;
}

double train_step(torch::nn::Sequential& net, torch::optim::Optimizer& opt, const Problem& problem) {
  opt.zero_grad();
  torch::Tensor loss = torch::mse_loss(net->forward(problem.x), problem.y);
  loss.backward();
  opt.step();
  return loss.item<double>();
}

double max_param_diff(torch::nn::Sequential& a, torch::nn::Sequential& b) {
  double d = 0;
  auto pa = a->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) d = std::max(d, (pa[i] - pb[i]).abs().max().item<double>());
  return d;
}

}  // namespace

TEST_CASE("8-bit state takes 2 B/param + 4 B per 256-element block per moment + the step", "[adamw8bit]") {
  // Sizes: a partial last block, whole blocks, a 2-D matrix, and one under min_8bit_size.
  std::vector<torch::Tensor> params{torch::randn({5000}), torch::randn({20 * kQuantBlockSize}),
                                    torch::randn({64, 80}), torch::randn({100})};
  for (auto& p : params) p.set_requires_grad(true);
  AdamW8bit opt(params, torch::optim::AdamWOptions(1e-3));
  CHECK(opt.state_bytes() == 0);  // created lazily, as torch::optim::AdamW
  for (auto& p : params) p.mutable_grad() = torch::randn_like(p);
  opt.step();

  int64_t counted = 0, formula = 0;
  for (const auto& p : params) {
    REQUIRE(opt.param_state(p) != nullptr);
    const AdamW8bitParamState& s = *opt.param_state(p);
    const int64_t n = p.numel();
    for (const auto* t : {&s.exp_avg(), &s.exp_avg_sq(), &s.exp_avg_absmax(), &s.exp_avg_sq_absmax()})
      if (t->defined()) counted += static_cast<int64_t>(t->nbytes());
    counted += static_cast<int64_t>(sizeof(int64_t));  // the step counter
    if (n >= 4096) {
      CHECK(s.quantized());
      CHECK(s.exp_avg().scalar_type() == torch::kByte);
      CHECK(s.exp_avg_sq_absmax().scalar_type() == torch::kFloat);
      formula += 2 * n + 2 * 4 * ((n + 255) / 256) + 8;
    } else {
      CHECK_FALSE(s.quantized());
      formula += 2 * 4 * n + 8;
    }
  }
  CHECK(counted == formula);
  CHECK(opt.state_bytes() == formula);
  CHECK(formula == (2 * 5000 + 8 * 20) + (2 * 5120 + 8 * 20) + (2 * 5120 + 8 * 20) + 800 + 4 * 8);
}

TEST_CASE("fp32_params keep fp32 moments whatever their size", "[adamw8bit]") {
  std::vector<torch::Tensor> params{torch::randn({64, 128}, torch::requires_grad()),
                                    torch::randn({64, 128}, torch::requires_grad())};
  AdamW8bit opt(params, torch::optim::AdamWOptions(1e-3), memopt::optim::AdamW8bitOptions().fp32_params({params[1]}));
  for (auto& p : params) p.mutable_grad() = torch::randn_like(p);
  opt.step();
  CHECK(opt.param_state(params[0])->quantized());
  CHECK_FALSE(opt.param_state(params[1])->quantized());
  CHECK(opt.state_bytes() == (2 * 8192 + 8 * 32 + 8) + (8 * 8192 + 8));
}

TEST_CASE("one step equals torch::optim::AdamW, training stays close to it", "[adamw8bit]") {
  const Problem problem;
  auto ref_net = make_mlp(3), net = make_mlp(3);
  const auto options = torch::optim::AdamWOptions(1e-4).betas({0.9, 0.95}).weight_decay(0.1);
  torch::optim::AdamW ref(mlp_groups(ref_net, options), options);
  AdamW8bit opt(mlp_groups(net, options), options);
  // The first step starts from zero moments, which 8 bits hold exactly: the same update.
  train_step(ref_net, ref, problem);
  train_step(net, opt, problem);
  CHECK(max_param_diff(ref_net, net) <= 1e-7);
  // Later steps read quantised moments: the parameters drift by a small fraction of how far they moved (L2).
  auto start = make_mlp(3);
  for (int i = 0; i < 19; ++i) {
    train_step(ref_net, ref, problem);
    train_step(net, opt, problem);
  }
  double moved_sq = 0, drift_sq = 0;
  for (size_t i = 0; i < net->parameters().size(); ++i) {
    moved_sq += (ref_net->parameters()[i] - start->parameters()[i]).pow(2).sum().item<double>();
    drift_sq += (ref_net->parameters()[i] - net->parameters()[i]).pow(2).sum().item<double>();
  }
  INFO("moved " << std::sqrt(moved_sq) << ", drift " << std::sqrt(drift_sq) << " max " << max_param_diff(ref_net, net));
  CHECK(std::sqrt(drift_sq) < 0.05 * std::sqrt(moved_sq));
}

TEST_CASE("the fused CPU kernel steps as the tensor path (the path of other devices)", "[adamw8bit]") {
  const Problem problem;
  auto a = make_mlp(9), b = make_mlp(9);
  const auto options = torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(0.1);
  AdamW8bit fused(mlp_groups(a, options), options);
  AdamW8bit tensors(mlp_groups(b, options), options, memopt::optim::AdamW8bitOptions().fused_cpu(false).chunk_size(1024));
  for (int i = 0; i < 3; ++i) {
    train_step(a, fused, problem);
    train_step(b, tensors, problem);
  }
  CHECK(max_param_diff(a, b) <= 1e-6);
  int64_t codes = 0, differ = 0;
  for (size_t i = 0; i < a->parameters().size(); ++i) {
    const AdamW8bitParamState& x = *fused.param_state(a->parameters()[i]);
    const AdamW8bitParamState& y = *tensors.param_state(b->parameters()[i]);
    if (!x.quantized()) continue;
    codes += 2 * x.exp_avg().numel();
    differ += (x.exp_avg() != y.exp_avg()).sum().item<int64_t>() + (x.exp_avg_sq() != y.exp_avg_sq()).sum().item<int64_t>();
    CHECK(torch::allclose(x.exp_avg_absmax(), y.exp_avg_absmax(), 1e-5, 0));
  }
  INFO(differ << " of " << codes << " codes differ (float rounding at a boundary)");
  CHECK(codes == 2 * (64 * 128 + 128 * 32));
  CHECK(differ <= codes / 1000);

  // Enough blocks for every thread, partial last blocks, parameters split between threads.
  auto gen = at::detail::createCPUGenerator(11);
  std::vector<torch::Tensor> x{torch::randn({70001}, gen), torch::randn({300, 401}, gen), torch::randn({5000}, gen)};
  std::vector<torch::Tensor> y;
  for (auto& t : x) {
    y.push_back(t.clone().requires_grad_());
    t.requires_grad_();
  }
  AdamW8bit fused_x(x, options);
  AdamW8bit tensors_y(y, options, memopt::optim::AdamW8bitOptions().fused_cpu(false));
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < x.size(); ++i) {
      x[i].mutable_grad() = torch::randn(x[i].sizes(), gen) * std::pow(10.0, -step);
      y[i].mutable_grad() = x[i].grad().clone();
    }
    fused_x.step();
    tensors_y.step();
  }
  for (size_t i = 0; i < x.size(); ++i) {
    CHECK((x[i] - y[i]).abs().max().item<double>() <= 1e-6);
    const auto& sx = *fused_x.param_state(x[i]);
    const auto& sy = *tensors_y.param_state(y[i]);
    CHECK((sx.exp_avg() != sy.exp_avg()).sum().item<int64_t>() <= x[i].numel() / 1000);
    CHECK((sx.exp_avg_sq() != sy.exp_avg_sq()).sum().item<int64_t>() <= x[i].numel() / 1000);
  }
}

TEST_CASE("AdamW8bit converges like AdamW on a small regression: 200 steps, final loss within 1.2x", "[adamw8bit]") {
  const Problem problem;
  auto ref_net = make_mlp(4), net = make_mlp(4);
  const auto options = torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(0.01);
  torch::optim::AdamW ref(mlp_groups(ref_net, options), options);
  AdamW8bit opt(mlp_groups(net, options), options);
  const double first = train_step(ref_net, ref, problem);
  train_step(net, opt, problem);
  double ref_loss = 0, loss = 0;
  for (int i = 1; i < 200; ++i) {
    ref_loss = train_step(ref_net, ref, problem);
    loss = train_step(net, opt, problem);
  }
  INFO("first " << first << ", AdamW " << ref_loss << ", AdamW8bit " << loss);
  CHECK(ref_loss < 0.05 * first);
  CHECK(loss < 1.2 * ref_loss);
  CHECK(loss > ref_loss / 1.2);
}

TEST_CASE("save, load into a fresh optimizer: the next step is identical", "[adamw8bit]") {
  const Problem problem;
  auto net = make_mlp(6);
  const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  AdamW8bit opt(mlp_groups(net, options), options);
  for (int i = 0; i < 3; ++i) train_step(net, opt, problem);

  std::stringstream bytes;
  {
    torch::serialize::OutputArchive archive;
    opt.save(archive);
    archive.save_to(bytes);
  }
  auto twin = make_mlp(0);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < twin->parameters().size(); ++i) twin->parameters()[i].copy_(net->parameters()[i]);
  }
  AdamW8bit loaded(mlp_groups(twin, options), options);
  {
    torch::serialize::InputArchive archive;
    archive.load_from(bytes);
    loaded.load(archive);
  }
  CHECK(loaded.state_bytes() == opt.state_bytes());
  train_step(net, opt, problem);
  train_step(twin, loaded, problem);
  CHECK(max_param_diff(net, twin) == 0.0);
  for (size_t i = 0; i < net->parameters().size(); ++i) {
    const AdamW8bitParamState& a = *opt.param_state(net->parameters()[i]);
    const AdamW8bitParamState& b = *loaded.param_state(twin->parameters()[i]);
    CHECK(a.step() == b.step());
    CHECK(torch::equal(a.exp_avg(), b.exp_avg()));
    CHECK(torch::equal(a.exp_avg_sq(), b.exp_avg_sq()));
  }
}

TEST_CASE("AdamW8bit loads torch::optim::AdamW's state and quantises its large moments", "[adamw8bit]") {
  const Problem problem;
  auto ref_net = make_mlp(8);
  const auto options = torch::optim::AdamWOptions(1e-3);
  torch::optim::AdamW ref(mlp_groups(ref_net, options), options);
  for (int i = 0; i < 3; ++i) train_step(ref_net, ref, problem);
  auto net = make_mlp(0);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < net->parameters().size(); ++i) net->parameters()[i].copy_(ref_net->parameters()[i]);
  }
  AdamW8bit opt(mlp_groups(net, options), options);
  std::stringstream bytes;
  torch::serialize::OutputArchive out;
  ref.save(out);
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  opt.load(in);
  int64_t quantized = 0;
  for (const auto& item : opt.state()) quantized += static_cast<const AdamW8bitParamState&>(*item.second).quantized();
  CHECK(quantized == 2);  // the two matrices; the biases keep fp32
  std::vector<torch::Tensor> start_params;
  for (const auto& p : ref_net->parameters()) start_params.push_back(p.detach().clone());
  train_step(ref_net, ref, problem);
  train_step(net, opt, problem);
  auto ref_params = ref_net->parameters(), params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) {  // the step taken differs by a few % of its size
    const double err = (params[i] - ref_params[i]).norm().item<double>();
    const double moved = (ref_params[i] - start_params[i]).norm().item<double>();
    INFO("param " << i << " err " << err << " moved " << moved);
    CHECK(err < 0.05 * moved);
  }
}

TEST_CASE("Trainer with state::Int8 trains a small LLaMA with 8-bit state", "[adamw8bit][trainer]") {
  torch::manual_seed(0);
  memopt::models::Llama model(small_llama());
  ListLoader loader{{random_batch(4, 16, 128, 1), random_batch(4, 16, 128, 2)}};
  memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::None, memopt::state::Int8>
      trainer(*model, memopt::TrainerOptions().lr(3e-3).max_steps(30).log_interval(10).warmup_steps(2));
  auto loss_fn = [&](const memopt::Batch& b, const auto& ckpt) { return model->loss_sum(b, ckpt); };
  const double first = trainer.step(loader, loss_fn).loss.item<double>();
  const auto result = trainer.fit(loader, loss_fn);
  CHECK(result.final_loss < first * 0.8);

  auto* opt = dynamic_cast<AdamW8bit*>(&trainer.optimizer());
  REQUIRE(opt != nullptr);
  int64_t params = 0, fp32_state = 0;
  for (const auto& p : model->parameters()) {
    params += p.numel();
    fp32_state += 8 * p.numel() + 8;  // what torch::optim::AdamW would hold
  }
  INFO(params << " parameters, 8-bit state " << opt->state_bytes() << " B, fp32 state " << fp32_state << " B");
  CHECK(opt->state_bytes() < fp32_state / 3);
}

TEST_CASE("bad AdamW8bit options fail with the option, the value and a HINT", "[adamw8bit]") {
  using memopt::test::require_error;
  const std::string who = "memopt::optim::AdamW8bit";
  std::vector<torch::Tensor> params{torch::zeros({8}, torch::requires_grad())};
  auto make = [&](torch::optim::AdamWOptions o, memopt::optim::AdamW8bitOptions q = {}) {
    return [=] { AdamW8bit opt(params, o, q); };
  };
  require_error(make(torch::optim::AdamWOptions(-0.5)), who, {"lr must be >= 0", "(got -0.5)"});
  require_error(make(torch::optim::AdamWOptions().betas({1.0, 0.95})), who, {"betas", "(got 1, 0.95)"});
  require_error(make(torch::optim::AdamWOptions().betas({0.9, -0.1})), who, {"betas", "(got 0.9, -0.1)"});
  require_error(make(torch::optim::AdamWOptions().eps(-1)), who, {"eps", "(got -1)"});
  require_error(make(torch::optim::AdamWOptions().weight_decay(-0.1)), who, {"weight_decay", "(got -0.1)"});
  require_error(make(torch::optim::AdamWOptions().amsgrad(true)), who, {"amsgrad"});
  require_error(make({}, memopt::optim::AdamW8bitOptions().chunk_size(1000)), who, {"chunk_size", "(got 1000)"});
  require_error(make({}, memopt::optim::AdamW8bitOptions().min_8bit_size(-1)), who, {"min_8bit_size", "(got -1)"});

  AdamW8bit opt(params, torch::optim::AdamWOptions(1e-3));
  opt.param_groups()[0].options().set_lr(-2);  // a bad schedule is caught at the step
  params[0].mutable_grad() = torch::ones({8});
  require_error([&] { opt.step(); }, who, {"param group 0", "lr must be >= 0", "(got -2)"});
}
