// memopt/io/peft.hpp — LoRA adapters in PEFT's format (PEFT 0.21.2's save_pretrained): a folder
// with adapter_model.safetensors, the adapter tensors under "base_model.model." + their module
// path (base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight), and adapter_config.json,
// LoraConfig's fields. save_adapter() writes one PEFT's PeftModel.from_pretrained loads onto the
// same base model; load_adapter() reads one PEFT wrote into a model whose memopt::nn::Linear
// layers carry adapters, checking every name and shape before it copies anything.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/io/json.hpp"
#include "memopt/io/safetensors.hpp"
#include "memopt/nn/linear.hpp"

namespace memopt::io {

/// What PEFT puts before a module path in an adapter file (PeftModel.base_model.model).
inline constexpr const char* kPeftPrefix = "base_model.model.";
/// The PEFT release whose adapter format save_adapter writes (its adapter_config.json's peft_version).
inline constexpr const char* kPeftVersion = "0.21.2";

namespace detail {

/// Where "lora_A." or "lora_B." starts in `name`, or npos: the adapter parameters PEFT saves.
inline size_t lora_part(const std::string& name) {
  const size_t a = name.rfind("lora_A."), b = name.rfind("lora_B.");
  if (a == std::string::npos) return b;
  return b == std::string::npos ? a : std::max(a, b);
}

/// The model's adapter parameters (names holding lora_A. or lora_B.), in named_parameters() order.
inline std::vector<std::pair<std::string, torch::Tensor>> lora_parameters(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : model.named_parameters())
    if (lora_part(item.key()) != std::string::npos) out.emplace_back(item.key(), item.value());
  return out;
}

/// Every memopt::nn::Linear of `model` with a LoRA adapter (itself included, path "") with its path.
template <class ModuleT>
auto lora_layers(ModuleT& model) {
  using Layer = std::conditional_t<std::is_const_v<ModuleT>, const nn::LinearImpl, nn::LinearImpl>;
  std::vector<std::pair<std::string, Layer*>> out;
  if (auto* self = dynamic_cast<Layer*>(&model); self && self->has_adapter()) out.emplace_back("", self);
  for (const auto& item : model.named_modules("", /*include_self=*/false))
    if (auto* layer = dynamic_cast<Layer*>(item.value().get()); layer && layer->has_adapter())
      out.emplace_back(item.key(), layer);
  return out;
}

/// Typed look-ups in an adapter_config.json object; each error names the file and the field.
struct AdapterConfigFields {
  std::string path;
  const nlohmann::json& json;

  std::string where(const char* key) const {
    return "memopt::io: adapter config '" + path + "': field \"" + key + "\"";
  }
  /// The value at `key`, or nullptr when it is absent or null (PEFT writes null for "unset").
  const nlohmann::json* find(const char* key) const {
    auto it = json.find(key);
    return it == json.end() || it->is_null() ? nullptr : &*it;
  }
  const nlohmann::json& required(const char* key) const {
    const auto* value = find(key);
    TORCH_CHECK(value != nullptr, where(key), " is missing. HINT: PEFT's LoraConfig writes peft_type, r, "
                "lora_alpha and target_modules; rewrite the config with PEFT's save_pretrained or "
                "memopt::io::save_adapter");
    return *value;
  }
  void expect(const char* key, bool ok, const nlohmann::json& value, const char* wanted) const {
    TORCH_CHECK(ok, where(key), " must be ", wanted, " (got ", snippet(value), "). HINT: fix adapter_config.json "
                "(PEFT's LoraConfig field types)");
  }
  /// Fails when `key` is set (not absent, null, false, empty or `plain`): a PEFT feature memopt lacks.
  void unsupported(const char* key, const nlohmann::json& plain, const char* hint) const {
    const auto* value = find(key);
    const bool off = value == nullptr || *value == false || *value == plain || (value->is_object() && value->empty()) ||
                     (value->is_array() && value->empty());
    TORCH_CHECK(off, where(key), " is ", snippet(*value), ", which memopt's LoRA does not implement. HINT: ", hint);
  }
};

}  // namespace detail

/// Writes `dir`/adapter_model.safetensors (every parameter whose name holds lora_A. or lora_B.,
/// in its dtype, named kPeftPrefix + its name, metadata {"format": "pt"}) and
/// `dir`/adapter_config.json (PEFT 0.21.2's LoraConfig fields: r, lora_alpha, lora_dropout and
/// use_rslora from `options`; target_modules the sorted last names of the adapted modules, "all-linear"
/// resolved as PEFT does before saving; base_model_name_or_path `base_model`, or null when empty;
/// task_type null). Creates `dir`. Every adapter must have been built with `options`' rank,
/// alpha and use_rslora, or the config would misdescribe it.
///   memopt::io::save_adapter("runs/lora", *model, lora_options, "meta-llama/Llama-3.2-1B");
inline void save_adapter(const std::string& dir, const torch::nn::Module& model, const nn::LoraOptions& options,
                         const std::string& base_model = "") {
  const std::string who = "memopt::io: save_adapter('" + dir + "')";
  options.check(who.c_str());
  for (const auto& [path, layer] : detail::lora_layers(model)) {
    const nn::LoraOptions& own = layer->lora_options();
    TORCH_CHECK(own.rank() == options.rank() && own.alpha() == options.alpha() &&
                    own.use_rslora() == options.use_rslora(),
                who, ": layer '", path, "' has rank ", own.rank(), ", alpha ", own.alpha(), ", use_rslora ",
                own.use_rslora() ? "true" : "false", " but the options say rank ", options.rank(), ", alpha ",
                options.alpha(), ", use_rslora ", options.use_rslora() ? "true" : "false",
                ". HINT: pass the options the layers were built with (layer->lora_options()); PEFT keeps one r and "
                "lora_alpha per adapter");
  }

  // ---- tensors: base_model.model.<module path>.lora_{A,B}.weight ----
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  std::set<std::string> targets;
  for (const auto& [name, tensor] : detail::lora_parameters(model)) {
    const size_t at = detail::lora_part(name);
    TORCH_CHECK(at > 0, who, ": '", name, "' is an adapter at the model's root, which PEFT cannot name. HINT: "
                "save the model that holds the adapted Linear (e.g. register_module(\"q_proj\", layer))");
    const std::string module = name.substr(0, at - 1);  // "layers.0.q_proj"
    targets.insert(module.substr(module.rfind('.') + 1));
    const bool is_a = name.compare(at, 7, "lora_A.") == 0;
    const int64_t rank = tensor.dim() == 2 ? tensor.size(is_a ? 0 : 1) : -1;
    TORCH_CHECK(rank == options.rank(), who, ": '", name, "' has shape ", tensor.sizes(), ", not rank ",
                options.rank(), ". HINT: pass the options the layers were built with (layer->lora_options())");
    tensors.emplace_back(kPeftPrefix + name, tensor.detach());
  }
  TORCH_CHECK(!tensors.empty(), who, ": the model has no LoRA parameters (no name holds lora_A. or lora_B.). "
              "HINT: add adapters first: memopt::lora::apply(model, LoraOptions()), or layer->add_adapter()");

  // ---- adapter_config.json: LoraConfig.to_dict() of a plain LoRA (keys sorted, as PEFT writes them) ----
  const double alpha = options.alpha();
  nlohmann::json config = {
      {"peft_type", "LORA"},
      {"peft_version", kPeftVersion},
      {"task_type", nullptr},
      {"base_model_name_or_path", base_model.empty() ? nlohmann::json(nullptr) : nlohmann::json(base_model)},
      {"revision", nullptr},
      {"inference_mode", true},
      {"r", options.rank()},
      {"lora_alpha", alpha == std::floor(alpha) && alpha < 1e15 ? nlohmann::json(static_cast<int64_t>(alpha))
                                                                : nlohmann::json(alpha)},
      {"lora_dropout", options.dropout()},
      {"use_rslora", options.use_rslora()},
      {"target_modules", std::vector<std::string>(targets.begin(), targets.end())},
      {"exclude_modules", nullptr},
      {"bias", "none"},
      {"lora_bias", false},
      {"fan_in_fan_out", false},
      {"init_lora_weights", true},
      {"use_dora", false},
      {"modules_to_save", nullptr},
      {"layers_to_transform", nullptr},
      {"layers_pattern", nullptr},
      {"rank_pattern", nlohmann::json::object()},
      {"alpha_pattern", nlohmann::json::object()},
  };
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TORCH_CHECK(!ec, who, ": cannot create the directory (", ec.message(), "). HINT: check the path and permissions");
  const std::filesystem::path root(dir);
  save_safetensors((root / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
  const std::string text = config.dump(2) + "\n";
  detail::write_atomically((root / "adapter_config.json").string(), who, [&](std::FILE* file) {
    return std::fwrite(text.data(), 1, text.size(), file) == text.size();
  });
}

/// Reads `dir`/adapter_config.json and copies every tensor of `dir`/adapter_model.safetensors into
/// the model's parameter of the same name (kPeftPrefix stripped; converted to its dtype and
/// device), strictly: every file tensor needs a parameter and every adapter parameter (lora_A.,
/// lora_B.) a tensor, of the same shape, all checked before anything is copied. Each adapted layer
/// then takes the config's alpha, lora_dropout, use_rslora and target_modules (set_lora_options), so
/// the model computes what PEFT does with this adapter. Returns those options (targets: the
/// config's list, or its one string, e.g. a regular expression, as a single entry). Refuses
/// configs using PEFT features memopt lacks (DoRA, rank_pattern, bias, modules_to_save, …).
///   memopt::nn::LoraOptions options = memopt::io::load_adapter("runs/lora", *model);
inline nn::LoraOptions load_adapter(const std::string& dir, torch::nn::Module& model) {
  namespace fs = std::filesystem;
  const fs::path root(dir);
  const std::string config_path = (root / "adapter_config.json").string();
  const std::string weights_path = (root / "adapter_model.safetensors").string();
  const char* folder_hint = "pass a folder written by memopt::io::save_adapter or PEFT's save_pretrained";
  TORCH_CHECK(fs::exists(config_path), "memopt::io: load_adapter: '", config_path, "' does not exist. HINT: ",
              folder_hint);
  TORCH_CHECK(fs::exists(weights_path), "memopt::io: load_adapter: '", weights_path, "' does not exist. HINT: ",
              fs::exists(root / "adapter_model.bin") ? "convert adapter_model.bin to safetensors "
                                                      "(PEFT's save_pretrained(safe_serialization=True))"
                                                    : folder_hint);

  // ---- adapter_config.json ----
  const nlohmann::json json = detail::read_json_object(
      config_path, "adapter config", "rewrite it with PEFT's save_pretrained or memopt::io::save_adapter");
  const detail::AdapterConfigFields fields{config_path, json};
  const auto& type = fields.required("peft_type");
  fields.expect("peft_type", type == "LORA", type, "\"LORA\" (memopt reads LoRA adapters only)");
  const auto& r = fields.required("r");
  fields.expect("r", r.is_number_integer() && r.get<int64_t>() >= 1, r, "an integer >= 1");
  const auto& alpha = fields.required("lora_alpha");
  fields.expect("lora_alpha", alpha.is_number() && alpha.get<double>() > 0, alpha, "a number > 0");
  const auto* dropout = fields.find("lora_dropout");
  if (dropout) fields.expect("lora_dropout", dropout->is_number(), *dropout, "a number in [0, 1)");
  const auto* rslora = fields.find("use_rslora");
  if (rslora) fields.expect("use_rslora", rslora->is_boolean(), *rslora, "true or false");
  const auto& target_json = fields.required("target_modules");
  std::vector<std::string> targets;
  if (target_json.is_string()) targets.push_back(target_json.get<std::string>());
  for (const auto& t : target_json.is_array() ? target_json : nlohmann::json::array()) {
    fields.expect("target_modules", t.is_string(), target_json, "a list of module names or one string");
    targets.push_back(t.get<std::string>());
  }
  fields.expect("target_modules", !targets.empty(), target_json, "a list of module names or one string");
  fields.unsupported("use_dora", false, "load a plain LoRA adapter (DoRA adds lora_magnitude_vector)");
  fields.unsupported("fan_in_fan_out", false, "fan_in_fan_out is for GPT-2's Conv1D weights, stored (in, out)");
  fields.unsupported("lora_bias", false, "train the adapter without lora_bias (lora_B has no bias in memopt)");
  fields.unsupported("bias", "none", "train the adapter with bias=\"none\" (no base biases in the adapter)");
  fields.unsupported("modules_to_save", nullptr, "the adapter also holds whole modules; train it without "
                     "modules_to_save");
  fields.unsupported("rank_pattern", nullptr, "memopt uses one rank per adapter");
  fields.unsupported("alpha_pattern", nullptr, "memopt uses one lora_alpha per adapter");
  auto options = nn::LoraOptions()
                     .rank(r.get<int64_t>())
                     .alpha(alpha.get<double>())
                     .dropout(dropout ? dropout->get<double>() : 0.0)
                     .use_rslora(rslora ? rslora->get<bool>() : false)
                     .targets(targets);
  options.check(("memopt::io: adapter config '" + config_path + "'").c_str());

  // ---- names and shapes, all before anything is copied ----
  const std::string who = "memopt::io: load_adapter from '" + weights_path + "'";
  const auto file = SafetensorsFile::open(weights_path);
  std::map<std::string, torch::Tensor> params;
  for (auto& [name, tensor] : detail::lora_parameters(model)) params.emplace(name, tensor);
  const std::string prefix = kPeftPrefix;
  std::vector<std::string> unexpected, missing;
  std::set<std::string> found;
  for (const auto& key : file->names()) {
    const std::string name = key.starts_with(prefix) ? key.substr(prefix.size()) : key;
    auto it = params.find(name);
    if (!key.starts_with(prefix) || it == params.end()) {
      unexpected.push_back(key);
      continue;
    }
    found.insert(name);
    const auto& shape = file->info(key).shape;
    TORCH_CHECK(it->second.sizes() == torch::IntArrayRef(shape), who, ": tensor '", key, "' has shape ",
                torch::IntArrayRef(shape), " in the file but '", name, "' has ", it->second.sizes(),
                " in the model. HINT: the adapter was trained on another base model or rank (its config says r = ",
                options.rank(), ")");
    const size_t at = detail::lora_part(name);
    const int64_t rank = shape.size() == 2 ? shape[name.compare(at, 7, "lora_A.") == 0 ? 0 : 1] : -1;
    TORCH_CHECK(rank == options.rank(), who, ": tensor '", key, "' has shape ", torch::IntArrayRef(shape),
                " but the config says r = ", options.rank(), ". HINT: adapter_config.json does not match "
                "adapter_model.safetensors; rewrite the config with the rank the adapter was trained with");
  }
  for (const auto& [name, tensor] : params)
    if (!found.count(name)) missing.push_back(name);
  TORCH_CHECK(unexpected.empty(), who, ": ", unexpected.size(), " of the file's ", file->names().size(),
              " tensors have no adapter parameter in the model: ", detail::name_list(unexpected),
              ". HINT: the adapter was trained on another base model or other target_modules (",
              detail::snippet(target_json), "); adapt those layers with memopt::lora::apply (a file name is "
              "\"base_model.model.\" + the model's parameter name)");
  TORCH_CHECK(missing.empty(), who, ": the file lacks ", missing.size(), " of the model's ", params.size(),
              " adapter parameters: ", detail::name_list(missing), ". HINT: the adapter was trained on another "
              "base model or other target_modules (", detail::snippet(target_json), ")");
  auto layers = detail::lora_layers(model);
  for (const auto& [path, layer] : layers)
    TORCH_CHECK(!layer->merged(), who, ": layer '", path, "' is merged. HINT: call unmerge() on it first");

  // ---- copy, then give every layer the config's scale ----
  {
    torch::NoGradGuard no_grad;
    for (const auto& name : file->names()) params.at(name.substr(prefix.size())).copy_(file->get(name));
  }
  for (auto& [path, layer] : layers)
    layer->set_lora_options(nn::LoraOptions(options).rank(layer->lora_options().rank()));
  return options;
}

}  // namespace memopt::io
