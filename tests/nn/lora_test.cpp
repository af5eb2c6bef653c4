// tests/nn/lora_test.cpp — memopt/nn/lora.hpp, memopt/nn/linear.hpp's adapter and memopt/io/peft.hpp:
// a memopt::nn::Linear with an adapter starts as its base Linear (B zero, A within
// Kaiming-uniform's bound, the base weight shared and frozen); on a toy model its output, loss, adapter gradients and delta weights equal PEFT 0.21.2's in fp32,
// with rsLoRA and without (tests/baselines/lora_reference.py, run with the tests' Python; skipped
// without peft); adapters round-trip both ways between save_adapter/load_adapter and PEFT's
// save_pretrained/PeftModel.from_pretrained; merge/unmerge; dropout in training only; and each
// bad option, layer and adapter folder is refused naming the value or file with a HINT.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memopt/io/peft.hpp>
#include <memopt/io/safetensors.hpp>
#include <memopt/nn/lora.hpp>

#include "python_reference.hpp"
#include "support.hpp"

using memopt::nn::Linear;
using memopt::nn::LinearImpl;
using memopt::nn::LoraOptions;
using memopt::test::max_abs_diff;

namespace {

constexpr int64_t kDim = 8, kH = 12, kO = 6, kLayers = 2, kRank = 4;

using Tensors = std::vector<std::pair<std::string, torch::Tensor>>;

bool is_adapter(const std::string& name) {
  return name.find("lora_A.") != std::string::npos || name.find("lora_B.") != std::string::npos;
}

// The toy model of lora_reference.py: layers.N.q_proj (C -> H, no bias) and layers.N.v_proj
// (H -> C, bias) adapted, head (C -> O, bias) not; x = x + v_proj(tanh(q_proj(x))), then head(x).
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const LoraOptions& options) {
    q_proj = register_module("q_proj", Linear(torch::nn::LinearOptions(kDim, kH).bias(false), options));
    v_proj = register_module("v_proj", Linear(torch::nn::LinearOptions(kH, kDim), options));
  }
  Linear q_proj{nullptr}, v_proj{nullptr};
};
TORCH_MODULE(Block);

struct ToyImpl : torch::nn::Module {
  explicit ToyImpl(const LoraOptions& options) {
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < kLayers; ++i) layers->push_back(Block(options));
    head = register_module("head", torch::nn::Linear(kDim, kO));
  }
  torch::Tensor forward(torch::Tensor x) {  // (B, T, C) -> (B, T, O)
    for (const auto& module : *layers) {
      auto& block = *module->as<BlockImpl>();
      x = x + block.v_proj(torch::tanh(block.q_proj(x)));
    }
    return head(x);
  }
  torch::nn::ModuleList layers{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Toy);

// A toy whose weights come from `seed` alone (the same base weights whatever the options' rank):
// base N(0, 0.2²), A uniform within Kaiming's bound 1/√in, B N(0, 0.1²) (non-zero, so every
// gradient is), outputs of size ~1 so that 1e-6 is a few fp32 ulps.
Toy make_toy(const LoraOptions& options, uint64_t seed) {
  Toy toy(options);
  auto gen = at::detail::createCPUGenerator(seed);
  torch::NoGradGuard no_grad;
  for (auto& item : toy->named_parameters()) {
    torch::Tensor& p = item.value();
    if (item.key().find("lora_A.") != std::string::npos) {
      const double bound = 1 / std::sqrt(static_cast<double>(p.size(1)));
      p.copy_(torch::rand(p.sizes(), gen) * (2 * bound) - bound);
    } else {
      p.copy_(torch::randn(p.sizes(), gen) * (is_adapter(item.key()) ? 0.1 : 0.2));
    }
  }
  return toy;
}

torch::Tensor input(uint64_t seed) {  // (2, 5, C)
  auto gen = at::detail::createCPUGenerator(seed);
  return torch::randn({2, 5, kDim}, gen) * 0.5;
}

// Every Linear of `model` with its path ("layers.0.q_proj").
std::vector<std::pair<std::string, LinearImpl*>> lora_layers(torch::nn::Module& model) {
  std::vector<std::pair<std::string, LinearImpl*>> out;
  for (const auto& item : model.named_modules("", /*include_self=*/false))
    if (auto* layer = dynamic_cast<LinearImpl*>(item.value().get())) out.emplace_back(item.key(), layer);
  return out;
}

// J/x and J/<parameter> for each parameter (base only, unless `adapter`).
void add_job(Tensors& tensors, const std::string& job, torch::nn::Module& model, const torch::Tensor& x,
             bool adapter) {
  tensors.emplace_back(job + "/x", x);
  for (const auto& item : model.named_parameters())
    if (adapter || !is_adapter(item.key())) tensors.emplace_back(job + "/" + item.key(), item.value().detach());
}

// Skips the case (counted) when the tests' Python cannot run the reference (peft, safetensors).
bool skipped_without_peft() {
  if (memopt::test::python_imports("peft, safetensors")) return false;
  memopt::test::skip_case(std::string(MEMOPT_TEST_PYTHON) + " cannot import peft and safetensors (HINT: run scripts/deps)");
  return true;
}

// Writes the jobs and their tensors with memopt's safetensors writer, runs lora_reference.py, opens its output.
std::shared_ptr<const memopt::io::SafetensorsFile> run_reference(const memopt::test::TempDir& dir,
                                                                 const nlohmann::json& jobs, const Tensors& tensors) {
  memopt::io::save_safetensors(dir.file("in.safetensors"), tensors, {{"jobs", jobs.dump()}});
  return memopt::test::run_reference_script(dir, "lora_reference.py", "peft");
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(memopt::test::read_text(path)); }

void write_json(const std::string& path, const nlohmann::json& json) { memopt::test::write_text(path, json.dump(2)); }

// A copy of the adapter folder `from` at `to`.
void copy_adapter(const std::string& from, const std::string& to) {
  namespace fs = std::filesystem;
  fs::create_directories(to);
  for (const char* name : {"adapter_config.json", "adapter_model.safetensors"})
    fs::copy_file(fs::path(from) / name, fs::path(to) / name, fs::copy_options::overwrite_existing);
}

}  // namespace

TEST_CASE("A LoRA Linear starts as its base Linear: B zero, A within Kaiming-uniform's bound, the weight shared, frozen",
          "[nn][lora]") {
  torch::manual_seed(28);
  torch::nn::Linear base(torch::nn::LinearOptions(kDim, kH));
  Linear lora(base, LoraOptions().rank(kRank));

  // PEFT's names without base_model.model. and .default: the base's own, then the adapter's.
  const auto params = lora->named_parameters();
  REQUIRE(params.keys() == std::vector<std::string>({"weight", "bias", "lora_A.weight", "lora_B.weight"}));
  CHECK(params["lora_A.weight"].sizes() == torch::IntArrayRef({kRank, kDim}));
  CHECK(params["lora_B.weight"].sizes() == torch::IntArrayRef({kH, kRank}));
  CHECK(lora->in_features() == kDim);
  CHECK(lora->out_features() == kH);

  // The base weight and bias are the Linear's own tensors, frozen there too; A and B train.
  CHECK(lora->weight.is_same(base->weight));
  CHECK(lora->weight.data_ptr() == base->weight.data_ptr());
  CHECK(lora->bias.is_same(base->bias));
  CHECK_FALSE(base->weight.requires_grad());
  CHECK_FALSE(base->bias.requires_grad());
  CHECK(lora->lora_A->weight.requires_grad());
  CHECK(lora->lora_B->weight.requires_grad());

  // B = 0; A ~ U(-1/√in, 1/√in) (kaiming_uniform_ with a = √5: gain √(2 / 6) · √(3 / in)).
  CHECK(torch::count_nonzero(lora->lora_B->weight).item<int64_t>() == 0);
  const double bound = 1 / std::sqrt(static_cast<double>(kDim));
  CHECK(lora->lora_A->weight.abs().max().item<double>() <= bound);
  CHECK(lora->lora_A->weight.abs().max().item<double>() > bound / 2);
  Linear wide(torch::nn::LinearOptions(256, 512).bias(false), LoraOptions().rank(16));
  const torch::Tensor a = wide->lora_A->weight.to(torch::kDouble);  // 4096 draws from U(-1/16, 1/16)
  CHECK(a.abs().max().item<double>() <= 1.0 / 16);
  CHECK(a.abs().max().item<double>() > 0.99 / 16);
  CHECK(std::abs(a.mean().item<double>()) < 0.003);
  CHECK(a.var().item<double>() == Approx(1.0 / (3 * 256)).epsilon(0.1));
  CHECK_FALSE(wide->bias.defined());
  CHECK(wide->named_parameters().size() == 3);

  // At init the adapter adds exactly 0: the base Linear's output (ATen's linear, as Python's).
  const torch::Tensor x = torch::randn({3, 5, kDim});
  CHECK(torch::equal(lora(x), torch::linear(x, base->weight, base->bias)));
  CHECK(max_abs_diff(lora(x), base(x)) <= 1e-6);
  CHECK(lora->scale() == 4.0);  // alpha 16 / rank 4
  CHECK(LoraOptions().rank(4).alpha(16).use_rslora(true).scale() == 8.0);  // 16 / √4
  CHECK(LoraOptions().rank(8).alpha(16).scale() == 2.0);

  // Only the adapter gets gradients.
  lora(x).sum().backward();
  CHECK_FALSE(base->weight.grad().defined());
  CHECK(lora->lora_A->weight.grad().defined());

  // A bf16 base keeps its dtype; the adapter is fp32 (PEFT's autocast_adapter_dtype) and the output bf16.
  torch::nn::Linear half(torch::nn::LinearOptions(kDim, kH));
  half->to(torch::kBFloat16);
  Linear lora16(half, LoraOptions().rank(kRank));
  CHECK(lora16->weight.scalar_type() == torch::kBFloat16);
  CHECK(lora16->lora_A->weight.scalar_type() == torch::kFloat);
  CHECK(lora16(x.to(torch::kBFloat16)).scalar_type() == torch::kBFloat16);

  // PEFT's suffix match for targets.
  const LoraOptions targets;
  CHECK(targets.targets_module("model.layers.0.self_attn.q_proj"));
  CHECK(targets.targets_module("v_proj"));
  CHECK_FALSE(targets.targets_module("model.layers.0.self_attn.xq_proj"));
  CHECK_FALSE(targets.targets_module("model.layers.0.self_attn.k_proj"));
  CHECK(LoraOptions().targets({"all-linear"}).targets_module("model.layers.0.mlp.down_proj"));
}

TEST_CASE("A LoRA Linear's output, loss and adapter gradients equal PEFT 0.21.2's in fp32, with rsLoRA and without",
          "[nn][lora][peft]") {
  if (skipped_without_peft()) return;
  memopt::test::TempDir dir("memopt_lora_test");
  const torch::Tensor x = input(1);
  std::map<std::string, Toy> toys;
  nlohmann::json jobs = nlohmann::json::array();
  Tensors tensors;
  for (const bool rslora : {false, true}) {
    const std::string name = rslora ? "rslora" : "lora";
    const auto options = LoraOptions().rank(kRank).alpha(6).use_rslora(rslora);
    toys.emplace(name, make_toy(options, 2));
    add_job(tensors, name, *toys.at(name), x, /*adapter=*/true);
    jobs.push_back(
        nlohmann::json{{"name", name}, {"mode", "forward"}, {"r", kRank}, {"lora_alpha", 6}, {"use_rslora", rslora}});
  }
  const auto ref = run_reference(dir, jobs, tensors);

  for (auto& [name, toy] : toys) {
    INFO(name);
    auto get = [&, name = name](const std::string& key) { return ref->get(name + "/" + key, /*copy=*/true); };
    const torch::Tensor y = toy(x);  // (2, 5, O)
    const torch::Tensor loss = y.pow(2).mean();
    loss.backward();
    CHECK(max_abs_diff(y, get("y")) <= 1e-6);
    CHECK(max_abs_diff(loss, get("loss")) <= 1e-6);
    int64_t grads = 0;
    for (const auto& item : toy->named_parameters()) {
      if (!is_adapter(item.key())) continue;
      INFO(item.key());
      REQUIRE(item.value().grad().defined());
      CHECK(item.value().grad().abs().max().item<double>() > 1e-4);  // B != 0: A's gradient too
      CHECK(max_abs_diff(item.value().grad(), get("grad/" + item.key())) <= 1e-6);
      ++grads;
    }
    CHECK(grads == 4 * kLayers);
    const auto layers = lora_layers(*toy);
    REQUIRE(layers.size() == 2 * kLayers);
    for (const auto& [path, layer] : layers) {
      INFO(path);
      CHECK_FALSE(layer->weight.grad().defined());
      CHECK(layer->scale() == get("scaling/" + path).item<double>());  // 6 / 4, or 6 / √4
      CHECK(max_abs_diff(layer->delta_weight(), get("delta/" + path)) <= 1e-6);
    }
    CHECK(lora_layers(*toy).front().second->scale() == (name == "rslora" ? 3.0 : 1.5));

    // Merged, as PEFT's merge_adapter: the same output without the adapter's matmuls.
    torch::NoGradGuard no_grad;
    for (const auto& [path, layer] : layers) layer->merge();
    const torch::Tensor merged = toy(x);
    CHECK(max_abs_diff(merged, get("y_merged")) <= 1e-6);
    CHECK(max_abs_diff(merged, y) <= 1e-5);
    for (const auto& [path, layer] : layers) layer->unmerge();
    CHECK(max_abs_diff(toy(x), y) <= 1e-6);
  }
}

TEST_CASE("save_adapter writes what PEFT loads, and load_adapter reads what PEFT's save_pretrained wrote",
          "[nn][lora][peft]") {
  if (skipped_without_peft()) return;
  memopt::test::TempDir dir("memopt_lora_test");
  const torch::Tensor x = input(3);
  const auto options = LoraOptions().rank(kRank).alpha(6).use_rslora(true).dropout(0.05);
  Toy mine = make_toy(options, 4);
  mine->eval();
  const std::string ours = dir.file("memopt_adapter"), theirs = dir.file("peft_adapter");
  memopt::io::save_adapter(ours, *mine, options, "memopt/toy");

  // ---- what save_adapter wrote: PEFT's names and LoraConfig fields ----
  const auto file = memopt::io::SafetensorsFile::open(ours + "/adapter_model.safetensors");
  std::set<std::string> names(file->names().begin(), file->names().end()), expected;
  for (int64_t i = 0; i < kLayers; ++i)
    for (const std::string module : {"q_proj", "v_proj"})
      for (const std::string ab : {"lora_A", "lora_B"})
        expected.insert("base_model.model.layers." + std::to_string(i) + "." + module + "." + ab + ".weight");
  CHECK(names == expected);
  CHECK(file->metadata().at("format") == "pt");
  CHECK(file->info("base_model.model.layers.1.v_proj.lora_B.weight").shape == std::vector<int64_t>({kDim, kRank}));
  CHECK(torch::equal(file->get("base_model.model.layers.0.q_proj.lora_A.weight"),
                     mine->layers[0]->as<BlockImpl>()->q_proj->lora_A->weight));
  const nlohmann::json config = read_json(ours + "/adapter_config.json");
  CHECK(config.at("peft_type") == "LORA");
  CHECK(config.at("r") == kRank);
  CHECK(config.at("lora_alpha").is_number_integer());
  CHECK(config.at("lora_alpha") == 6);
  CHECK(config.at("lora_dropout") == 0.05);
  CHECK(config.at("use_rslora") == true);
  CHECK(config.at("target_modules") == nlohmann::json({"q_proj", "v_proj"}));
  CHECK(config.at("base_model_name_or_path") == "memopt/toy");
  CHECK(config.at("bias") == "none");
  CHECK(config.at("fan_in_fan_out") == false);
  CHECK(config.at("init_lora_weights") == true);
  CHECK(config.at("inference_mode") == true);
  CHECK(config.at("modules_to_save").is_null());
  CHECK(config.at("task_type").is_null());

  // ---- PEFT both ways: from_pretrained on memopt's folder, save_pretrained of its own ----
  nlohmann::json jobs = nlohmann::json::array();
  jobs.push_back(nlohmann::json{{"name", "load"}, {"mode", "load"}, {"dir", ours}});
  jobs.push_back(nlohmann::json{{"name", "save"}, {"mode", "save"}, {"dir", theirs}, {"r", kRank}, {"lora_alpha", 10},
                                {"use_rslora", false}, {"lora_dropout", 0.1}, {"seed", 7}});
  Tensors tensors;
  add_job(tensors, "load", *mine, x, /*adapter=*/false);
  add_job(tensors, "save", *mine, x, /*adapter=*/false);
  const auto ref = run_reference(dir, jobs, tensors);

  torch::NoGradGuard no_grad;
  CHECK(max_abs_diff(mine(x), ref->get("load/y")) <= 1e-6);
  CHECK(ref->get("load/scaling/layers.1.v_proj").item<double>() == 3.0);  // 6 / √4: use_rslora read back

  Toy from_peft = make_toy(LoraOptions().rank(kRank), 4);  // the same base weights; alpha 16, other A and B
  const LoraOptions loaded = memopt::io::load_adapter(theirs, *from_peft);
  CHECK(loaded.rank() == kRank);
  CHECK(loaded.alpha() == 10);
  CHECK_FALSE(loaded.use_rslora());
  CHECK(loaded.dropout() == Approx(0.1));
  CHECK(std::set<std::string>(loaded.targets().begin(), loaded.targets().end()) ==
        std::set<std::string>({"q_proj", "v_proj"}));
  for (const auto& [path, layer] : lora_layers(*from_peft)) {
    INFO(path);
    CHECK(layer->scale() == 2.5);  // the config's 10 / 4, not the 16 / 4 it was built with
    CHECK(layer->lora_options().dropout() == Approx(0.1));
  }
  for (const auto& item : from_peft->named_parameters())
    if (is_adapter(item.key())) CHECK(torch::equal(item.value(), ref->get("save/lora/" + item.key())));
  from_peft->eval();
  CHECK(max_abs_diff(from_peft(x), ref->get("save/y")) <= 1e-6);

  // memopt to memopt: the same numbers.
  Toy again = make_toy(options, 5);  // other weights; the base then copied from mine
  for (const auto& item : mine->named_parameters())
    if (!is_adapter(item.key())) again->named_parameters()[item.key()].copy_(item.value());
  memopt::io::load_adapter(ours, *again);
  again->eval();
  CHECK(torch::equal(again(x), mine(x)));
}

TEST_CASE("A LoRA Linear merge folds scale times B·A into the weight, unmerge takes it out, each once", "[nn][lora]") {
  torch::manual_seed(29);
  torch::nn::Linear base(torch::nn::LinearOptions(kDim, kH));
  Linear lora(base, LoraOptions().rank(kRank).alpha(6));
  {
    torch::NoGradGuard no_grad;
    lora->lora_B->weight.normal_(0, 0.1);
  }
  const torch::Tensor w0 = lora->weight.detach().clone(), x = torch::randn({3, 5, kDim});
  const torch::Tensor y = lora(x).detach();
  const torch::Tensor delta = lora->delta_weight();  // (out, in)
  REQUIRE(delta.sizes() == torch::IntArrayRef({kH, kDim}));
  CHECK(max_abs_diff(delta, lora->lora_B->weight.matmul(lora->lora_A->weight) * 1.5) <= 1e-7);

  void* storage = lora->weight.data_ptr();
  lora->merge();
  CHECK(lora->merged());
  CHECK(lora->weight.data_ptr() == storage);                     // in place
  CHECK(torch::equal(base->weight, lora->weight));               // the wrapped Linear's weight too
  CHECK(torch::equal(lora->weight, w0 + delta));                 // fp32 weight: the fp32 sum
  CHECK(torch::equal(lora(x), torch::linear(x, lora->weight, lora->bias)));  // the adapter skipped
  CHECK(max_abs_diff(lora(x), y) <= 1e-5);
  memopt::test::require_error([&] { lora->merge(); }, "memopt::nn::Linear", {"already merged", "unmerge()"});
  memopt::test::require_error([&] { lora->set_lora_options(LoraOptions().rank(kRank).alpha(8)); },
                              "memopt::nn::Linear::set_lora_options", {"merged", "unmerge()"});

  lora->unmerge();
  CHECK_FALSE(lora->merged());
  CHECK(max_abs_diff(lora->weight, w0) <= 1e-6);
  CHECK(max_abs_diff(lora(x), y) <= 1e-6);
  memopt::test::require_error([&] { lora->unmerge(); }, "memopt::nn::Linear", {"not merged", "merge() first"});

  // A bf16 weight: the sum in fp32, rounded once to bf16.
  torch::nn::Linear half(torch::nn::LinearOptions(kDim, kH).bias(false));
  half->to(torch::kBFloat16);
  Linear lora16(half, LoraOptions().rank(kRank).alpha(6));
  {
    torch::NoGradGuard no_grad;
    lora16->lora_B->weight.normal_(0, 0.1);
  }
  const torch::Tensor h0 = lora16->weight.detach().clone();
  lora16->merge();
  CHECK(lora16->weight.scalar_type() == torch::kBFloat16);
  CHECK(torch::equal(lora16->weight, (h0.to(torch::kFloat) + lora16->delta_weight()).to(torch::kBFloat16)));
}

TEST_CASE("A LoRA Linear drops the adapter's input in training only, never the base path", "[nn][lora]") {
  torch::manual_seed(30);
  torch::nn::Linear base(torch::nn::LinearOptions(kDim, kH));
  Linear lora(base, LoraOptions().rank(kRank).alpha(8).dropout(0.5));
  const torch::Tensor x = torch::randn({4, 16, kDim});
  const torch::Tensor plain = torch::linear(x, lora->weight, lora->bias);
  CHECK(torch::equal(lora(x), plain));  // B = 0: dropout or not, the base output
  {
    torch::NoGradGuard no_grad;
    lora->lora_B->weight.normal_(0, 0.1);
  }
  const torch::Tensor adapter = lora->lora_B(lora->lora_A(x)) * lora->scale();
  lora->eval();
  CHECK(max_abs_diff(lora(x), plain + adapter) <= 1e-6);
  lora->train();
  CHECK(max_abs_diff(lora(x), plain + adapter) > 1e-3);
}

TEST_CASE("LoRA options, layers and adapter folders are refused with the value or file and a HINT", "[nn][lora]") {
  torch::nn::Linear base(torch::nn::LinearOptions(kDim, kH));
  auto rejects = [&](const LoraOptions& options, const std::vector<std::string>& parts) {
    memopt::test::require_error([&] { (void)Linear(base, options); }, "memopt::nn::Linear", parts);
  };
  rejects(LoraOptions().rank(0), {"rank must be >= 1", "(got 0)"});
  rejects(LoraOptions().rank(-3), {"rank must be >= 1", "(got -3)"});
  rejects(LoraOptions().rank(9), {"rank 9 exceeds min(in 8, out 12) = 8", "low-rank", "rank <= 8"});
  rejects(LoraOptions().dropout(1.5), {"dropout must be in [0, 1)", "(got 1.5)"});
  rejects(LoraOptions().dropout(-0.1), {"dropout must be in [0, 1)", "(got -0.1)"});
  rejects(LoraOptions().alpha(0), {"alpha must be a positive number", "(got 0)"});
  rejects(LoraOptions().alpha(std::numeric_limits<double>::quiet_NaN()), {"alpha must be a positive number", "nan"});
  rejects(LoraOptions().targets({}), {"targets are empty", "all-linear"});
  memopt::test::require_error([] { LoraOptions().rank(0).check("memopt::models::Llama"); }, "memopt::models::Llama",
                              {"rank must be >= 1"});
  memopt::test::require_error([] { (void)Linear(torch::nn::Linear(nullptr), LoraOptions()); },
                              "memopt::nn::Linear", {"empty"});

  // ---- save_adapter ----
  memopt::test::TempDir dir("memopt_lora_test");
  const auto options = LoraOptions().rank(kRank).alpha(6);
  Toy toy = make_toy(options, 6);
  const std::string good = dir.file("good");
  memopt::io::save_adapter(good, *toy, options);
  memopt::test::require_error(
      [&] { memopt::io::save_adapter(dir.file("x"), *toy, LoraOptions().rank(kRank).alpha(32)); },
      "memopt::io: save_adapter", {"layer 'layers.0.q_proj' has rank 4, alpha 6", "alpha 32", "layer->lora_options()"});
  memopt::test::require_error([&] { memopt::io::save_adapter(dir.file("x"), *toy, LoraOptions().rank(0)); },
                              "memopt::io: save_adapter", {"rank must be >= 1"});
  memopt::test::require_error([&] { memopt::io::save_adapter(dir.file("x"), *base, options); },
                              "memopt::io: save_adapter", {"no LoRA parameters", "memopt::lora::apply"});
  Linear root(torch::nn::LinearOptions(kDim, kH), options);
  memopt::test::require_error([&] { memopt::io::save_adapter(dir.file("x"), *root, options); },
                              "memopt::io: save_adapter", {"'lora_A.weight'", "root", "register_module"});

  // ---- load_adapter: tensors ----
  auto load = [&](const std::string& folder, torch::nn::Module& model, const std::vector<std::string>& parts,
                  const std::string& prefix = "memopt::io: load_adapter") {
    memopt::test::require_error([&] { memopt::io::load_adapter(folder, model); }, prefix, parts);
  };
  Toy rank2 = make_toy(LoraOptions().rank(2), 6);
  load(good, *rank2, {"adapter_model.safetensors", "tensor 'base_model.model.layers.0.q_proj.lora_A.weight' has shape "
                      "[4, 8] in the file but 'layers.0.q_proj.lora_A.weight' has [2, 8] in the model",
                      "another base model or rank"});

  Toy target = make_toy(options, 8);
  std::map<std::string, torch::Tensor> before;
  for (const auto& item : target->named_parameters()) before.emplace(item.key(), item.value().clone());
  const std::string missing = dir.file("missing"), extra = dir.file("extra");
  copy_adapter(good, missing);
  auto cut = memopt::io::load_safetensors(missing + "/adapter_model.safetensors");
  cut.erase("base_model.model.layers.1.v_proj.lora_B.weight");
  memopt::io::save_safetensors(missing + "/adapter_model.safetensors", cut);
  load(missing, *target, {"adapter_model.safetensors", "lacks 1 of the model's 8 adapter parameters",
                          "'layers.1.v_proj.lora_B.weight'", "another base model"});
  copy_adapter(good, extra);
  auto more = memopt::io::load_safetensors(extra + "/adapter_model.safetensors");
  more.emplace("base_model.model.layers.2.q_proj.lora_A.weight", torch::zeros({kRank, kDim}));
  memopt::io::save_safetensors(extra + "/adapter_model.safetensors", more);
  load(extra, *target, {"1 of the file's 9 tensors have no adapter parameter", "'base_model.model.layers.2.q_proj."
                        "lora_A.weight'", "target_modules"});
  for (const auto& item : target->named_parameters())  // nothing copied before every check passed
    CHECK(torch::equal(item.value(), before.at(item.key())));

  // ---- load_adapter: the config ----
  auto with_config = [&](const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    const std::string folder = dir.file(name);
    copy_adapter(good, folder);
    nlohmann::json config = read_json(folder + "/adapter_config.json");
    edit(config);
    write_json(folder + "/adapter_config.json", config);
    return folder;
  };
  const std::string config_prefix = "memopt::io: adapter config '";
  load(with_config("no_r", [](nlohmann::json& c) { c.erase("r"); }), *target,
       {"adapter_config.json", "field \"r\" is missing"}, config_prefix);
  load(with_config("null_alpha", [](nlohmann::json& c) { c["lora_alpha"] = nullptr; }), *target,
       {"field \"lora_alpha\" is missing"}, config_prefix);
  load(with_config("string_r", [](nlohmann::json& c) { c["r"] = "four"; }), *target,
       {"field \"r\" must be an integer >= 1", "\"four\""}, config_prefix);
  load(with_config("negative_alpha", [](nlohmann::json& c) { c["lora_alpha"] = -1; }), *target,
       {"field \"lora_alpha\" must be a number > 0", "(got -1)"}, config_prefix);
  load(with_config("ia3", [](nlohmann::json& c) { c["peft_type"] = "IA3"; }), *target,
       {"field \"peft_type\" must be \"LORA\"", "\"IA3\""}, config_prefix);
  load(with_config("targets", [](nlohmann::json& c) { c["target_modules"] = {1, 2}; }), *target,
       {"field \"target_modules\" must be a list of module names"}, config_prefix);
  load(with_config("dropout", [](nlohmann::json& c) { c["lora_dropout"] = 1.5; }), *target,
       {"adapter_config.json", "dropout must be in [0, 1)", "(got 1.5)"}, config_prefix);
  load(with_config("dora", [](nlohmann::json& c) { c["use_dora"] = true; }), *target,
       {"field \"use_dora\" is true", "does not implement", "lora_magnitude_vector"}, config_prefix);
  load(with_config("bias", [](nlohmann::json& c) { c["bias"] = "all"; }), *target,
       {"field \"bias\" is \"all\"", "does not implement"}, config_prefix);
  load(with_config("pattern", [](nlohmann::json& c) { c["rank_pattern"] = {{"v_proj", 8}}; }), *target,
       {"field \"rank_pattern\"", "one rank per adapter"}, config_prefix);
  load(with_config("r2", [](nlohmann::json& c) { c["r"] = 2; }), *target,
       {"adapter_model.safetensors", "has shape [4, 8] but the config says r = 2", "does not match"});
  const std::string bad_json = with_config("bad_json", [](nlohmann::json&) {});
  memopt::test::write_text(bad_json + "/adapter_config.json", "{\"r\": 4,");
  load(bad_json, *target, {"is not valid JSON"}, config_prefix);

  // ---- load_adapter: files and state ----
  const std::string no_config = with_config("no_config", [](nlohmann::json&) {});
  std::filesystem::remove(no_config + "/adapter_config.json");
  load(no_config, *target, {"adapter_config.json' does not exist", "save_pretrained"});
  const std::string no_weights = with_config("no_weights", [](nlohmann::json&) {});
  std::filesystem::remove(no_weights + "/adapter_model.safetensors");
  load(no_weights, *target, {"adapter_model.safetensors' does not exist"});
  lora_layers(*target).back().second->merge();
  load(good, *target, {"layer 'layers.1.v_proj' is merged", "unmerge()"});
  lora_layers(*target).back().second->unmerge();
  CHECK_NOTHROW(memopt::io::load_adapter(good, *target));
}
