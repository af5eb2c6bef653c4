// memopt/lora.hpp — LoRA and QLoRA over a whole model, as PEFT's get_peft_model and
// bitsandbytes' load_in_4bit do: apply() freezes every parameter and puts a LoRA adapter
// (memopt/nn/lora.hpp) on each memopt::nn::Linear whose path the targets name; quantize() holds
// the frozen Linear weights in NF4 (memopt/nn/nf4.hpp). The model keeps its types and Hugging
// Face names; the Trainer, the optimizer and gradient clipping see the adapters alone, because
// they take the parameters that require grad.
//   memopt::lora::quantize(*model);                                        // QLoRA's base
//   memopt::lora::apply(*model, memopt::nn::LoraOptions().rank(16).alpha(32).targets({"all-linear"}));
#pragma once

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "memopt/nn/linear.hpp"

namespace memopt::lora {

/// Every memopt::nn::Linear of `model` with its path ("model.layers.0.self_attn.q_proj"), in
/// named_modules() order (the model itself, if it is one, as "").
inline std::vector<std::pair<std::string, nn::LinearImpl*>> linear_layers(torch::nn::Module& model) {
  std::vector<std::pair<std::string, nn::LinearImpl*>> out;
  for (const auto& item : model.named_modules())
    if (auto* layer = dynamic_cast<nn::LinearImpl*>(item.value().get())) out.emplace_back(item.key(), layer);
  return out;
}

/// The paths of the layers with an adapter.
inline std::vector<std::string> adapted(torch::nn::Module& model) {
  std::vector<std::string> out;
  for (const auto& [path, layer] : linear_layers(model))
    if (layer->has_adapter()) out.push_back(path);
  return out;
}

/// Parameters that train and that do not, each counted once (a tied tensor once); NF4 weights
/// count as frozen parameters of their numel, as PEFT's print_trainable_parameters counts them.
struct ParameterCounts {
  int64_t trainable = 0;
  int64_t total = 0;
};

inline ParameterCounts count_parameters(torch::nn::Module& model) {
  ParameterCounts counts;
  std::set<const void*> seen;
  for (const auto& p : model.parameters()) {
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    counts.total += p.numel();
    if (p.requires_grad()) counts.trainable += p.numel();
  }
  for (const auto& [path, layer] : linear_layers(model))
    if (layer->quantized()) counts.total += layer->nf4().numel;
  return counts;
}

namespace detail {

/// The last parts of `paths` ("q_proj", "lm_head"), sorted, for an error's list of candidates.
inline std::string module_names(const std::vector<std::string>& paths) {
  std::set<std::string> names;
  for (const auto& path : paths) names.insert(path.substr(path.rfind('.') + 1));
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

/// Whether `path` is a model's output layer, which "all-linear" leaves out as PEFT does.
inline bool output_layer(const std::string& path) {
  return path == "lm_head" || path.ends_with(".lm_head");
}

}  // namespace detail

/// PEFT's get_peft_model for LoRA: freezes every parameter of `model` (requires_grad false) and
/// adds an adapter (nn::Linear::add_adapter: PEFT's initialisation, scale alpha / rank or
/// alpha / √rank) to each memopt::nn::Linear whose path options.targets() name: a target is the
/// path or its last dot-separated parts ("q_proj" or "self_attn.q_proj"); "all-linear" takes every
/// memopt::nn::Linear but the output layer (lm_head). Returns the adapted paths. Each target must
/// match a memopt::nn::Linear; the error lists the candidates. Quantised layers (quantize()) take
/// adapters the same way: QLoRA.
///   auto paths = memopt::lora::apply(*model, memopt::nn::LoraOptions().rank(8).targets({"q_proj", "v_proj"}));
inline std::vector<std::string> apply(torch::nn::Module& model, const nn::LoraOptions& options) {
  const char* who = "memopt::lora::apply";
  options.check(who);
  std::vector<std::string> linear_paths, other_paths;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const bool linear = dynamic_cast<nn::LinearImpl*>(item.value().get()) != nullptr;
    (linear ? linear_paths : other_paths).push_back(item.key());
  }
  for (const auto& target : options.targets()) {
    if (target == "all-linear") continue;
    const nn::LoraOptions one = nn::LoraOptions(options).targets({target});
    bool matched = false;
    for (const auto& path : linear_paths) matched = matched || one.targets_module(path);
    if (matched) continue;
    for (const auto& path : other_paths)
      TORCH_CHECK(!one.targets_module(path), who, ": target \"", target, "\" names '", path, "', a ",
                  model.named_modules()[path]->name(), ", which takes no adapter. HINT: LoRA adapts memopt::nn::Linear "
                  "layers: ", detail::module_names(linear_paths), " (an output layer such as lm_head stays dense)");
    TORCH_CHECK(false, who, ": target \"", target, "\" matches no Linear layer of the model. HINT: name one of: ",
                detail::module_names(linear_paths), " (or \"all-linear\"); a target is a module's last name or a "
                "dotted tail of its path, e.g. \"q_proj\" or \"self_attn.q_proj\"");
  }
  const auto& targets = options.targets();
  const bool all = std::find(targets.begin(), targets.end(), "all-linear") != targets.end();
  std::vector<nn::LinearImpl*> chosen;
  std::vector<std::string> paths;
  for (const auto& [path, layer] : linear_layers(model)) {
    if (path.empty() || (all && detail::output_layer(path)) || (!all && !options.targets_module(path))) continue;
    TORCH_CHECK(!layer->has_adapter(), who, ": '", path, "' already has an adapter. HINT: apply LoRA once per model");
    nn::detail::check_lora_shape(layer->out_features(), layer->in_features(), options,
                                 ("memopt::lora::apply: layer '" + path + "'").c_str());
    chosen.push_back(layer);
    paths.push_back(path);
  }
  TORCH_CHECK(!chosen.empty(), who, ": no Linear layer to adapt (targets ", detail::module_names(options.targets()),
              "). HINT: the model has no memopt::nn::Linear layers but its output layer");
  for (auto& p : model.parameters()) p.requires_grad_(false);
  for (auto* layer : chosen) layer->add_adapter(options);
  return paths;
}

/// bitsandbytes' load_in_4bit for QLoRA: holds the weight of every memopt::nn::Linear (the output
/// layer, a torch::nn::Linear in memopt's models, stays dense) in NF4, one layer at a time, so
/// the model's peak is its size plus one layer's dense weight; the dense weights are freed as
/// each goes (unless something else holds them). Returns the bytes the weights took before
/// minus after. Call it before apply() or after, not on merged layers.
///   int64_t saved = memopt::lora::quantize(*model);   // Llama 8x512: 100 MB of fp32 -> 13 MB
inline int64_t quantize(torch::nn::Module& model, const nn::Nf4Options& nf4 = {}) {
  int64_t saved = 0;
  for (const auto& [path, layer] : linear_layers(model)) {
    if (layer->quantized()) continue;
    const int64_t before = layer->base_nbytes();
    layer->quantize(nf4);
    saved += before - layer->base_nbytes();
  }
  return saved;
}

/// Folds every adapter into its dense weight (nn::Linear::merge), for inference or export.
inline void merge(torch::nn::Module& model) {
  for (const auto& [path, layer] : linear_layers(model))
    if (layer->has_adapter() && !layer->merged()) layer->merge();
}

/// Takes every merged adapter out again (nn::Linear::unmerge).
inline void unmerge(torch::nn::Module& model) {
  for (const auto& [path, layer] : linear_layers(model))
    if (layer->has_adapter() && layer->merged()) layer->unmerge();
}

}  // namespace memopt::lora
