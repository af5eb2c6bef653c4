// tests/models/llama_hf_test.cpp — memopt's LLaMA against HF transformers' LlamaForCausalLM on the
// same weights: tests/models/hf_llama_reference.py builds one (GQA: 4 heads, 2 key/value heads;
// rope_theta 500000; rms_norm_eps 1e-5; untied embeddings), writes it with save_pretrained and
// its logits and every parameter's gradient of the summed cross-entropy; memopt loads the folder
// with io::load_pretrained and must reproduce them. Sharded checkpoints both ways (transformers'
// shards into memopt, memopt's into transformers' from_pretrained), and a bf16 load within the
// reference's own bf16 error. Then the configurations of published Llamas: a Llama 3.2-style
// model (tied embeddings, llama3 RoPE, GQA, head_dim 24 ≠ 64 / 4, in shards) both ways, and
// linear (in transformers 4's spelling) and dynamic RoPE, the latter past max_position_embeddings.
#include <catch2/catch.hpp>

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "support.hpp"

#include <memopt/batch.hpp>
#include <memopt/io/pretrained.hpp>
#include <memopt/io/safetensors.hpp>
#include <memopt/io/shards.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/policies/recompute.hpp>

using memopt::test::relative_diff;
using memopt::test::TempDir;

namespace {

// fp32 on both sides. Measured max |diff| / max |reference|: 0 on the logits and on every
// gradient (LibTorch 2.15 against PyTorch 2.15 on the CPU: the same kernels in the same order).
// 1e-5 leaves room for another BLAS or another LibTorch than the venv's (a reordered sum moves
// fp32 results by ~1e-7 relative) and still fails on real mistakes: a wrong rope_theta moves
// the logits by ~1e-2 relative (the second test).
constexpr double kRelTol = 1e-5;

struct Reference {
  std::string model_dir;
  std::shared_ptr<const memopt::io::SafetensorsFile> file;
};

/// Runs hf_llama_reference.py with `args` (FAIL with its output when it cannot).
void run_reference(const TempDir& dir, const std::string& args) {
  const std::string script = std::string(MEMOPT_TEST_BASELINES) + "/../models/hf_llama_reference.py";
  const std::string log = dir.file("reference.log");
  const int status = std::system(
      (std::string(MEMOPT_TEST_PYTHON) + " '" + script + "' " + args + " > '" + log + "' 2>&1").c_str());
  std::ifstream in(log);
  const std::string output((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  INFO(output);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    FAIL(MEMOPT_TEST_PYTHON << " could not build the transformers reference. HINT: run scripts/deps "
                               "(requirements.txt installs transformers into .venv)");
}

/// The reference model of `variant` (hf_llama_reference.py's VARIANTS) in `dir`/model, in
/// shards of `max_shard_size` (e.g. "100KB") if given.
Reference make_reference(const TempDir& dir, const std::string& variant = "gqa",
                         const std::string& max_shard_size = "") {
  std::string args = "'" + dir.path.string() + "' --variant " + variant;
  if (!max_shard_size.empty()) args += " --max-shard-size " + max_shard_size;
  run_reference(dir, args);
  return {dir.file("model"), memopt::io::SafetensorsFile::open(dir.file("reference.safetensors"))};
}

/// transformers' from_pretrained of the folder memopt wrote at `model_dir`, run on `inputs`.
struct Theirs {
  torch::Tensor logits;
  bool tied;
};
Theirs transformers_run(const TempDir& dir, const std::string& model_dir, const torch::Tensor& inputs) {
  memopt::io::save_safetensors(dir.file("inputs.safetensors"), {{"inputs", inputs}});
  run_reference(dir, "--load '" + model_dir + "' '" + dir.file("inputs.safetensors") + "' '" +
                         dir.file("theirs.safetensors") + "'");
  const auto theirs = memopt::io::SafetensorsFile::open(dir.file("theirs.safetensors"));
  return {theirs->get("logits", /*copy=*/true), theirs->get("tied").item<double>() == 1.0};
}

/// memopt's logits, loss and every parameter's gradient against the reference's.
void check_logits_and_gradients(memopt::models::Llama& model, const Reference& ref) {
  const memopt::Batch batch{ref.file->get("inputs"), ref.file->get("targets")};
  const torch::Tensor logits = model->forward(batch.inputs);  // (B, T, V)
  const double logits_diff = relative_diff(logits, ref.file->get("logits"));
  INFO("logits: max relative difference " << logits_diff);
  CHECK(logits_diff <= kRelTol);

  model->zero_grad();
  const torch::Tensor loss = model->loss_sum(batch, memopt::recompute::None{});
  CHECK(loss.item<double>() == Approx(ref.file->get("loss").item<double>()).epsilon(1e-6));
  loss.backward();
  int64_t compared = 0;
  double worst = 0;
  for (const auto& item : model->named_parameters()) {
    INFO(item.key());
    REQUIRE(item.value().grad().defined());
    const double diff = relative_diff(item.value().grad(), ref.file->get("grad." + item.key()));
    worst = std::max(worst, diff);
    CHECK(diff <= kRelTol);
    ++compared;
  }
  INFO("worst gradient: max relative difference " << worst);
  // Every HF gradient, no more (the other 5: inputs, targets, logits, loss, logits_bf16).
  CHECK(compared == static_cast<int64_t>(ref.file->names().size()) - 5);
  WARN("HF LlamaForCausalLM vs memopt: logits " << logits_diff << ", worst gradient " << worst
                                                << " (max |diff| / max |reference|)");
}

/// The logits of `ref`'s weights in a Llama built from `config` (to show a setting matters).
torch::Tensor logits_with(const memopt::models::LlamaConfig& config, const Reference& ref) {
  memopt::models::Llama model(config);
  memopt::io::load_state_dict(*model, memopt::io::SafetensorsShards::open_dir(ref.model_dir));
  torch::NoGradGuard no_grad;
  return model->forward(ref.file->get("inputs"));
}

}  // namespace

TEST_CASE("Llama equals transformers' LlamaForCausalLM: logits and every gradient (GQA, rope_theta 5e5)",
          "[llama][hf]") {
  TempDir dir("memopt_hf");
  const auto ref = make_reference(dir);
  memopt::models::Llama model = memopt::io::load_pretrained(ref.model_dir);
  REQUIRE(model->config.num_key_value_heads() == 2);
  REQUIRE(model->config.rope_theta() == 500000.0);  // from transformers 5's rope_parameters
  check_logits_and_gradients(model, ref);
}

TEST_CASE("the transformers comparison can fail: another rope_theta moves the logits", "[llama][hf]") {
  TempDir dir("memopt_hf");
  const auto ref = make_reference(dir);
  auto config = memopt::io::read_llama_config(ref.model_dir + "/config.json");
  memopt::models::Llama wrong(config.rope_theta(10000.0));
  memopt::io::load_state_dict(*wrong, *memopt::io::SafetensorsFile::open(ref.model_dir + "/model.safetensors"));
  torch::NoGradGuard no_grad;
  CHECK(relative_diff(wrong->forward(ref.file->get("inputs")), ref.file->get("logits")) > 100 * kRelTol);
}

TEST_CASE("sharded checkpoints: transformers' shards load in memopt, memopt's in transformers", "[llama][hf][io]") {
  TempDir dir("memopt_hf");
  const auto ref = make_reference(dir, "gqa", "100KB");  // ~320 KB of fp32 weights: 4 shards
  REQUIRE(std::filesystem::exists(ref.model_dir + "/model.safetensors.index.json"));
  CHECK(memopt::io::SafetensorsShards::open_dir(ref.model_dir).num_files() == 4);
  memopt::models::Llama model = memopt::io::load_pretrained(ref.model_dir);
  torch::NoGradGuard no_grad;
  const torch::Tensor inputs = ref.file->get("inputs");
  CHECK(relative_diff(model->forward(inputs), ref.file->get("logits")) <= kRelTol);

  // memopt writes 3+ shards and the index; transformers' from_pretrained reads them.
  memopt::io::save_pretrained(*model, model->config, dir.file("ours"),
                              memopt::io::SavePretrainedOptions().max_shard_bytes(100'000));
  CHECK(memopt::io::SafetensorsShards::open_dir(dir.file("ours")).num_files() >= 3);
  CHECK(relative_diff(transformers_run(dir, dir.file("ours"), inputs).logits, ref.file->get("logits")) <= kRelTol);
}

TEST_CASE("a bf16 load: bf16 weights, logits within transformers' own bf16 error", "[llama][hf][io]") {
  TempDir dir("memopt_hf");
  const auto ref = make_reference(dir);
  auto model = memopt::io::load_pretrained(ref.model_dir, memopt::io::LoadPretrainedOptions().dtype(torch::kBFloat16));
  for (const auto& p : model->parameters()) CHECK(p.scalar_type() == torch::kBFloat16);
  torch::NoGradGuard no_grad;
  const torch::Tensor logits = model->forward(ref.file->get("inputs")).to(torch::kFloat);
  const double ours = relative_diff(logits, ref.file->get("logits"));
  const double theirs = relative_diff(ref.file->get("logits_bf16"), ref.file->get("logits"));
  INFO("bf16 logits against fp32 ones, max |diff| / max |reference|: memopt " << ours << ", transformers " << theirs);
  CHECK(theirs > 0);      // bf16 does round: the comparison can fail
  CHECK(ours <= 2 * theirs);
  WARN("bf16 load: memopt " << ours << ", transformers " << theirs << " (relative to the fp32 logits)");
}

TEST_CASE("a Llama 3.2-style checkpoint: tied embeddings, llama3 RoPE, GQA, head_dim 24, in shards",
          "[llama][hf][io]") {
  TempDir dir("memopt_hf");
  const auto ref = make_reference(dir, "llama3", "100KB");  // ~340 KB of fp32 weights
  CHECK(memopt::io::SafetensorsShards::open_dir(ref.model_dir).num_files() >= 3);
  memopt::models::Llama model = memopt::io::load_pretrained(ref.model_dir);
  const auto& config = model->config;
  CHECK(config.tie_word_embeddings());
  CHECK(config.head_size() == 24);
  CHECK(config.kv_heads() == 2);
  CHECK(config.rope_theta() == 500000.0);
  CHECK(config.rope_scaling().type() == memopt::nn::RopeType::kLlama3);
  CHECK(config.rope_scaling().factor() == 8.0);
  CHECK(config.rope_scaling().original_max_position_embeddings() == 32);
  CHECK(model->lm_head->weight.is_same(model->model->embed_tokens->weight));
  const auto named = model->named_parameters();
  CHECK_FALSE(named.contains("lm_head.weight"));
  CHECK(named["model.layers.0.self_attn.q_proj.weight"].sizes() == torch::IntArrayRef({96, 64}));  // (H·D, C)
  CHECK(named["model.layers.0.self_attn.k_proj.weight"].sizes() == torch::IntArrayRef({48, 64}));  // (KV·D, C)
  CHECK(named["model.layers.0.self_attn.o_proj.weight"].sizes() == torch::IntArrayRef({64, 96}));  // (C, H·D)
  // The shared weight's gradient sums the embedding's and the head's, as transformers' does.
  check_logits_and_gradients(model, ref);

  // The scaling matters here: plain RoPE on the same weights is far off.
  CHECK(relative_diff(logits_with(memopt::models::LlamaConfig(config).rope_scaling({}), ref),
                      ref.file->get("logits")) > 100 * kRelTol);
}

TEST_CASE("memopt saves a tied Llama that transformers loads tied, with the same logits", "[llama][hf][io]") {
  TempDir dir("memopt_hf");
  const auto ref = make_reference(dir, "llama3");
  memopt::models::Llama model = memopt::io::load_pretrained(ref.model_dir);
  memopt::io::save_pretrained(*model, model->config, dir.file("ours"),
                              memopt::io::SavePretrainedOptions().max_shard_bytes(100'000));
  const auto ours = memopt::io::SafetensorsShards::open_dir(dir.file("ours"));
  CHECK(ours.num_files() >= 3);
  CHECK_FALSE(ours.contains("lm_head.weight"));  // one tensor, written once
  CHECK(ours.contains("model.embed_tokens.weight"));
  const auto json = nlohmann::json::parse(memopt::test::read_text(dir.file("ours/config.json")));
  CHECK(json["tie_word_embeddings"] == true);
  CHECK(json["head_dim"] == 24);
  CHECK(json["rope_scaling"]["rope_type"] == "llama3");

  const auto theirs = transformers_run(dir, dir.file("ours"), ref.file->get("inputs"));
  CHECK(theirs.tied);
  CHECK(relative_diff(theirs.logits, ref.file->get("logits")) <= kRelTol);
  // …and memopt reads back what it wrote, bit for bit.
  memopt::models::Llama back = memopt::io::load_pretrained(dir.file("ours"));
  torch::NoGradGuard no_grad;
  CHECK(torch::equal(back->forward(ref.file->get("inputs")), model->forward(ref.file->get("inputs"))));
}

TEST_CASE("linear RoPE (transformers 4's rope_scaling) and dynamic RoPE past max_position_embeddings",
          "[llama][hf][io]") {
  for (const auto& [variant, type] : {std::pair{"linear", memopt::nn::RopeType::kLinear},
                                      std::pair{"dynamic", memopt::nn::RopeType::kDynamic}}) {
    INFO(variant);
    TempDir dir("memopt_hf");
    const auto ref = make_reference(dir, variant);
    memopt::models::Llama model = memopt::io::load_pretrained(ref.model_dir);
    const auto& config = model->config;
    CHECK(config.rope_scaling().type() == type);
    CHECK(config.rope_theta() == 10000.0);
    const int64_t T = ref.file->get("inputs").size(1);
    if (type == memopt::nn::RopeType::kDynamic) {
      CHECK(config.rope_scaling().factor() == 2.0);
      REQUIRE(T > config.max_position_embeddings());  // 32 > 16: where dynamic scaling acts
    } else {
      CHECK(config.rope_scaling().factor() == 4.0);  // read from {"type": "linear", "factor": 4.0}
    }
    check_logits_and_gradients(model, ref);
    // Plain RoPE (room for T positions) on the same weights is far off.
    auto plain = memopt::models::LlamaConfig(config).rope_scaling({}).max_position_embeddings(T);
    CHECK(relative_diff(logits_with(plain, ref), ref.file->get("logits")) > 100 * kRelTol);
  }
}
