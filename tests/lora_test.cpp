// tests/lora_test.cpp — memopt/lora.hpp on whole models: apply() adapts the Linear layers the
// targets name ("all-linear" without lm_head), freezes the rest and leaves the output as it was;
// quantize() and QuantizeOnInit hold the base in NF4 with the dequantised model's exact logits;
// on transformers' LlamaForCausalLM with PEFT (tests/models/hf_llama_reference.py --lora, skipped
// without peft) the loss and every adapter gradient match within 1e-6, with dropout off and with
// dropout on under the same masks; the Trainer steps the adapters alone; a checkpoint holds them
// alone and a resume is bit for bit, LoRA and QLoRA, and refuses another base; bad targets and
// ranks are refused naming the value and the candidates with a HINT; on a GPU (CUDA:) LoRA and
// QLoRA give the CPU's loss and adapter gradients and NF4 codes quantise as on the CPU.
#include <catch2/catch.hpp>

#include <sys/wait.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <memopt/io/checkpoint.hpp>
#include <memopt/io/peft.hpp>
#include <memopt/io/pretrained.hpp>
#include <memopt/io/safetensors.hpp>
#include <memopt/lora.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/trainer.hpp>

#include "io/fixtures.hpp"
#include "python_reference.hpp"
#include "support.hpp"

namespace fs = std::filesystem;

using memopt::nn::LoraOptions;
using memopt::test::relative_diff;
using memopt::test::require_error;

namespace {

memopt::models::LlamaConfig small_llama() {
  return memopt::models::LlamaConfig()
      .vocab_size(64)
      .hidden_size(32)
      .intermediate_size(48)
      .num_hidden_layers(2)
      .num_attention_heads(4)
      .num_key_value_heads(2)
      .max_position_embeddings(32);
}

torch::Tensor tokens(uint64_t seed) {  // (2, 12)
  auto gen = at::detail::createCPUGenerator(seed);
  return torch::randint(64, {2, 12}, gen);
}

std::vector<std::string> trainable_names(torch::nn::Module& model) {
  std::vector<std::string> out;
  for (const auto& item : model.named_parameters())
    if (item.value().requires_grad()) out.push_back(item.key());
  return out;
}

}  // namespace

TEST_CASE("lora::apply adapts the named Linear layers, freezes the rest and starts from the base's output",
          "[lora]") {
  torch::manual_seed(281);
  memopt::models::Llama model(small_llama());
  const torch::Tensor x = tokens(1);
  const torch::Tensor before = model->forward(x).detach();
  const auto dense = memopt::lora::count_parameters(*model);
  CHECK(dense.trainable == dense.total);

  const auto paths =
      memopt::lora::apply(*model, LoraOptions().rank(4).alpha(8).targets({"q_proj", "self_attn.v_proj"}));
  CHECK(paths == std::vector<std::string>({"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
                                           "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"}));
  CHECK(memopt::lora::adapted(*model) == paths);
  CHECK(torch::equal(model->forward(x), before));  // B = 0: exactly the base model

  // Only lora_A / lora_B train: 2 layers x (q: 4·(32+32), v: 4·(32+16)).
  const auto names = trainable_names(*model);
  REQUIRE(names.size() == 8);
  for (const auto& name : names) CHECK(name.find(".lora_") != std::string::npos);
  const auto counts = memopt::lora::count_parameters(*model);
  CHECK(counts.trainable == 2 * (4 * (32 + 32) + 4 * (32 + 16)));
  CHECK(counts.total == dense.total + counts.trainable);
  CHECK_FALSE(model->lm_head->weight.requires_grad());
  CHECK_FALSE(model->model->embed_tokens->weight.requires_grad());

  // all-linear: the 7 Linears of each block, never lm_head.
  torch::manual_seed(281);
  memopt::models::Llama every(small_llama());
  const auto all = memopt::lora::apply(*every, LoraOptions().rank(4).targets({"all-linear"}));
  CHECK(all.size() == 14);
  for (const auto& path : all) CHECK(path.find("lm_head") == std::string::npos);

  // merge() folds every adapter in, unmerge() takes it out (B made non-zero first).
  {
    torch::NoGradGuard no_grad;
    for (auto& item : every->named_parameters())
      if (item.key().find("lora_B") != std::string::npos) item.value().normal_(0, 0.05);
  }
  every->eval();
  const torch::Tensor adapted = every->forward(x).detach();
  CHECK(relative_diff(adapted, before) > 1e-3);
  memopt::lora::merge(*every);
  CHECK(relative_diff(every->forward(x), adapted) <= 1e-5);
  memopt::lora::unmerge(*every);
  CHECK(relative_diff(every->forward(x), adapted) <= 1e-6);
}

TEST_CASE("lora::apply refuses targets, ranks and repeats naming the value and the candidates", "[lora]") {
  memopt::models::Llama model(small_llama());
  require_error([&] { memopt::lora::apply(*model, LoraOptions().targets({"qproj"})); }, "memopt::lora::apply",
                {"target \"qproj\" matches no Linear",
                 "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"});
  require_error([&] { memopt::lora::apply(*model, LoraOptions().targets({"lm_head"})); }, "memopt::lora::apply",
                {"names 'lm_head'", "takes no adapter", "q_proj"});
  require_error([&] { memopt::lora::apply(*model, LoraOptions().targets({"embed_tokens"})); },
                "memopt::lora::apply", {"'model.embed_tokens'", "takes no adapter"});
  require_error([&] { memopt::lora::apply(*model, LoraOptions().rank(0)); }, "memopt::lora::apply",
                {"rank must be >= 1", "(got 0)"});
  require_error([&] { memopt::lora::apply(*model, LoraOptions().rank(20).targets({"k_proj"})); },
                "memopt::lora::apply: layer 'model.layers.0.self_attn.k_proj'", {"rank 20 exceeds min(in 32, out 16)"});
  CHECK(trainable_names(*model).size() == static_cast<size_t>(model->parameters().size()));  // nothing changed
  memopt::lora::apply(*model, LoraOptions());
  require_error([&] { memopt::lora::apply(*model, LoraOptions()); }, "memopt::lora::apply",
                {"already has an adapter", "once"});
}

TEST_CASE("lora::quantize and QuantizeOnInit hold the base in NF4 with the dequantised model's logits", "[lora]") {
  torch::manual_seed(282);
  memopt::models::Llama model(small_llama());
  const auto dense = memopt::lora::count_parameters(*model);
  const int64_t saved = memopt::lora::quantize(*model);
  // 2 blocks x 7 Linears of 32·(16·2 + 32·2) + 3·32·48 weights; NF4 at 0.5159 B per weight.
  const int64_t linear = 2 * (32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 48);
  CHECK(saved == Approx(linear * (4 - 0.5159)).epsilon(0.01));
  CHECK(memopt::lora::count_parameters(*model).total == dense.total);
  CHECK_FALSE(model->named_parameters().contains("model.layers.0.self_attn.q_proj.weight"));
  CHECK(model->named_buffers().contains("model.layers.0.self_attn.q_proj.weight_nf4"));

  // The same weights dequantised into a dense model: the same logits, bit for bit (fp32).
  memopt::models::Llama deq(small_llama());
  {
    torch::NoGradGuard no_grad;
    const auto params = model->named_parameters();
    for (auto& item : deq->named_parameters()) {
      if (params.contains(item.key())) {
        item.value().copy_(params[item.key()]);
        continue;
      }
      const std::string path = item.key().substr(0, item.key().rfind('.'));
      item.value().copy_(model->named_modules()[path]->as<memopt::nn::Linear>()->dequantized_weight(torch::kFloat));
    }
  }
  const torch::Tensor x = tokens(2);
  CHECK(torch::equal(model->forward(x), deq->forward(x)));

  // QLoRA: adapters over the NF4 base train; dX flows through the frozen NF4 layers.
  memopt::lora::apply(*model, LoraOptions().rank(4).targets({"all-linear"}));
  model->loss_sum({x, tokens(3)}, memopt::recompute::EveryBlock{}).backward();
  for (const auto& item : model->named_parameters()) {
    INFO(item.key());
    CHECK(item.value().grad().defined() == (item.key().find(".lora_") != std::string::npos));
  }

  // Built under QuantizeOnInit: no dense Linear weight ever held at once, the same layout.
  memopt::models::Llama lazy{nullptr};
  {
    memopt::nn::QuantizeOnInit nf4;
    lazy = memopt::models::Llama(small_llama());
  }
  CHECK(memopt::lora::count_parameters(*lazy).total == dense.total);
  CHECK(lazy->named_buffers().size() == deq->named_buffers().size() + 14 * 4);
  CHECK(memopt::models::Llama(small_llama())->named_buffers().is_empty());  // the guard is gone
  require_error([] { memopt::nn::QuantizeOnInit bad(memopt::nn::Nf4Options().blocksize(48)); },
                "memopt::nn::QuantizeOnInit", {"blocksize", "48"});
}

TEST_CASE("LoRA on a Llama equals PEFT on transformers' LlamaForCausalLM, dropout off and on", "[lora][hf]") {
  if (!memopt::test::python_imports("peft, transformers, safetensors")) {
    WARN("skipped: " << MEMOPT_TEST_PYTHON << " lacks peft or transformers. HINT: run scripts/deps");
    return;
  }
  memopt::test::TempDir dir("memopt_lora_hf");
  const std::string script = std::string(MEMOPT_TEST_BASELINES) + "/../models/hf_llama_reference.py";
  const std::string log = dir.file("reference.log");
  const int status = std::system((std::string(MEMOPT_TEST_PYTHON) + " '" + script + "' '" + dir.path.string() +
                                  "' --lora > '" + log + "' 2>&1").c_str());
  INFO(memopt::test::read_text(log));
  REQUIRE((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  const auto ref = memopt::io::SafetensorsFile::open(dir.file("reference.safetensors"));

  memopt::models::Llama model = memopt::io::load_pretrained(dir.file("model"));
  const auto options = LoraOptions().rank(4).alpha(8).dropout(0.25).targets({"all-linear"});
  CHECK(memopt::lora::apply(*model, options).size() == 14);
  const LoraOptions loaded = memopt::io::load_adapter(dir.file("adapter"), *model);
  CHECK(loaded.dropout() == Approx(0.25));
  const memopt::Batch batch{ref->get("inputs"), ref->get("targets")};

  for (const std::string mode : {"off", "on"}) {
    INFO("dropout " << mode);
    model->train(mode == "on");
    model->zero_grad();
    torch::manual_seed(99);  // the reference's seed before its forward: the same dropout masks
    const torch::Tensor loss = model->loss_sum(batch, memopt::recompute::None{});
    CHECK(loss.item<double>() == Approx(ref->get(mode + ".loss").item<double>()).epsilon(1e-6));
    loss.backward();
    int64_t compared = 0;
    double worst = 0;
    for (const auto& item : model->named_parameters()) {
      if (!item.value().requires_grad()) continue;
      INFO(item.key());
      REQUIRE(item.value().grad().defined());
      const double diff = relative_diff(item.value().grad(), ref->get(mode + ".grad." + item.key()));
      worst = std::max(worst, diff);
      CHECK(diff <= 1e-6);
      ++compared;
    }
    CHECK(compared == 28);
    WARN("PEFT vs memopt LoRA, dropout " << mode << ": worst adapter gradient " << worst
                                         << " (max |diff| / max |ref|)");
  }
}

namespace {

using memopt::test::io::CountingLoader;

/// The tiny checkpoint-test Llama from `seed`, LoRA on q_proj and v_proj (QLoRA: its Linears in NF4 first).
memopt::models::Llama adapted_llama(uint64_t seed, bool qlora) {
  torch::manual_seed(seed);
  memopt::models::Llama model(memopt::test::io::tiny_config());
  if (qlora) memopt::lora::quantize(*model);
  memopt::lora::apply(*model, LoraOptions().rank(4).alpha(8).dropout(0.1));
  return model;
}

}  // namespace

TEST_CASE("a LoRA or QLoRA run steps the adapters alone, checkpoints them alone and resumes bit for bit",
          "[lora][checkpoint]") {
  for (const bool qlora : {false, true}) {
    INFO((qlora ? "QLoRA" : "LoRA"));
    memopt::test::TempDir dir("memopt_lora_resume");
    using memopt::test::io::fit;
    using memopt::test::io::options;

    memopt::models::Llama straight = adapted_llama(7, qlora);
    const auto base_before = memopt::io::detail::frozen_fingerprint(*straight);
    std::vector<torch::Tensor> frozen_before;
    for (const auto& [name, t] : memopt::io::detail::named_state(*straight, /*frozen=*/true))
      frozen_before.push_back(t.clone());
    memopt::Trainer<> straight_trainer(*straight, options());
    CountingLoader straight_loader;
    CHECK(fit(straight, straight_trainer, straight_loader).steps == 6);
    size_t i = 0;
    for (const auto& [name, t] : memopt::io::detail::named_state(*straight, /*frozen=*/true)) {
      INFO(name);
      CHECK(torch::equal(t, frozen_before.at(i++)));  // the base never moves
    }
    CHECK(memopt::io::detail::frozen_fingerprint(*straight) == base_before);

    memopt::models::Llama first = adapted_llama(7, qlora);
    memopt::Trainer<> first_trainer(*first, options(dir.file("ckpt")).save_every(3));
    CountingLoader first_loader;
    const auto stopped = fit(first, first_trainer, first_loader, /*signal_at=*/4);
    REQUIRE(stopped.stop_signal == SIGTERM);
    const auto file = memopt::io::SafetensorsFile::open(stopped.checkpoint + "/model.safetensors");
    CHECK(file->names().size() == 8);  // 2 layers x (q, v) x (lora_A, lora_B): no base weight
    for (const auto& name : file->names()) CHECK(name.find(".lora_") != std::string::npos);

    memopt::models::Llama resumed = adapted_llama(7, qlora);
    torch::manual_seed(99);  // another random state: the resume restores it
    memopt::Trainer<> resumed_trainer(*resumed, options(dir.file("ckpt")).save_every(3));
    CountingLoader resumed_loader;
    REQUIRE(resumed_trainer.resume("latest", resumed_loader));
    CHECK(fit(resumed, resumed_trainer, resumed_loader).steps == 2);
    memopt::test::io::check_same_weights(straight, resumed);

    // Another base (seed 8) under the same adapters is refused.
    memopt::models::Llama other = adapted_llama(8, qlora);
    memopt::Trainer<> other_trainer(*other, options(dir.file("ckpt")).save_every(3));
    CountingLoader other_loader;
    require_error([&] { other_trainer.resume("latest", other_loader); }, "memopt::io: checkpoint",
                  {"frozen tensor", "differs", "--init_model"});
  }
}

TEST_CASE("CUDA: LoRA and QLoRA on the GPU give the CPU's loss and adapter gradients, NF4 codes unchanged",
          "[lora][cuda]") {
  MEMOPT_REQUIRE_CUDA();
  const torch::Device cuda(torch::kCUDA, 0);
  // fp32 on both devices (TF32 off, LibTorch's default); the GPU sums in other orders.
  constexpr double kTolerance = 1e-5;
  for (const bool qlora : {false, true}) {
    INFO((qlora ? "QLoRA" : "LoRA"));
    auto make = [&] {
      torch::manual_seed(283);
      memopt::models::Llama model(small_llama());
      if (qlora) memopt::lora::quantize(*model);
      memopt::lora::apply(*model, LoraOptions().rank(4).targets({"all-linear"}));
      torch::NoGradGuard no_grad;
      for (auto& item : model->named_parameters())
        if (item.key().find("lora_B") != std::string::npos) item.value().normal_(0, 0.05);
      return model;
    };
    memopt::models::Llama cpu = make();
    memopt::models::Llama gpu = make();
    gpu->to(cuda);
    for (const auto& item : gpu->named_buffers()) {
      INFO(item.key());
      CHECK(item.value().device() == cuda);
      if (item.key().ends_with("weight_nf4")) CHECK(item.value().scalar_type() == torch::kByte);
    }
    for (const auto& item : gpu->named_parameters()) CHECK(item.value().device() == cuda);

    const torch::Tensor x = tokens(4), y = tokens(5);
    const torch::Tensor cpu_loss = cpu->loss_sum({x, y}, memopt::recompute::EveryBlock{});
    const torch::Tensor gpu_loss = gpu->loss_sum({x.to(cuda), y.to(cuda)}, memopt::recompute::EveryBlock{});
    CHECK(relative_diff(gpu_loss.cpu(), cpu_loss) <= kTolerance);
    cpu_loss.backward();
    gpu_loss.backward();
    const auto cpu_params = cpu->named_parameters();
    for (const auto& item : gpu->named_parameters()) {
      INFO(item.key());
      REQUIRE(item.value().grad().defined() == (item.key().find(".lora_") != std::string::npos));
      if (item.value().grad().defined())
        CHECK(relative_diff(item.value().grad().cpu(), cpu_params[item.key()].grad()) <= kTolerance);
    }
  }

  // Quantised on the GPU: the CPU's codes bit for bit; the scales within fp32 rounding (the
  // double quantisation's mean sums in another order).
  torch::manual_seed(284);
  const torch::Tensor w = torch::randn({96, 80});
  const auto on_cpu = memopt::nn::quantize_nf4(w);
  const auto on_gpu = memopt::nn::quantize_nf4(w.to(cuda));
  REQUIRE(on_gpu.packed.device() == cuda);
  CHECK(torch::equal(on_gpu.packed.cpu(), on_cpu.packed));
  CHECK(relative_diff(on_gpu.dequantize(torch::kFloat).cpu(), on_cpu.dequantize(torch::kFloat)) <= 1e-6);
}
