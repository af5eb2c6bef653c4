// memopt/io/pretrained.hpp — HuggingFace-style checkpoints of memopt::models::Llama: a
// folder with config.json (HF's LlamaConfig fields) and model.safetensors, or shards listed by
// model.safetensors.index.json (HF parameter names), as written by transformers'
// save_pretrained, tied embeddings, head_dim and scaled RoPE included (linear, dynamic, llama3:
// Llama 3.1 / 3.2). save_pretrained()/load_pretrained() round-trip a model (built straight in
// the dtype asked for); load_state_dict() loads any module strictly from a file or shards, a
// slice at a time, naming what is missing, unexpected or of the wrong shape.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/error.hpp"
#include "memopt/io/safetensors.hpp"
#include "memopt/io/shards.hpp"
#include "memopt/models/llama.hpp"

namespace memopt::io {

namespace detail {

/// HF's torch_dtype string ("float32", "bfloat16", …) for the dtypes save_pretrained writes.
inline const char* hf_dtype_name(torch::Dtype dtype) {
  switch (dtype) {
    case torch::kFloat32: return "float32";
    case torch::kBFloat16: return "bfloat16";
    case torch::kFloat16: return "float16";
    case torch::kFloat64: return "float64";
    default: return nullptr;
  }
}

/// LibTorch's default dtype, the one modules create their parameters in, set to `dtype` for the
/// guard's lifetime, as transformers' from_pretrained sets torch's around building a model.
/// Process-wide like torch.set_default_dtype: other threads' tensors made meanwhile get it too.
class DefaultDtypeGuard {
 public:
  explicit DefaultDtypeGuard(torch::Dtype dtype) : previous_(c10::get_default_dtype()) {
    c10::set_default_dtype(caffe2::TypeMeta::fromScalarType(dtype));
  }
  ~DefaultDtypeGuard() { c10::set_default_dtype(previous_); }
  DefaultDtypeGuard(const DefaultDtypeGuard&) = delete;
  DefaultDtypeGuard& operator=(const DefaultDtypeGuard&) = delete;

 private:
  caffe2::TypeMeta previous_;
};

/// Typed look-ups in a config.json object; every error names the file, the field and the value.
class ConfigFields {
 public:
  ConfigFields(std::string path, const nlohmann::json& json) : path_(std::move(path)), json_(json) {}

  /// The value at `key`, or nullptr when it is absent or null (HF writes null for "unset").
  const nlohmann::json* find(const char* key) const {
    auto it = json_.find(key);
    return it == json_.end() || it->is_null() ? nullptr : &*it;
  }

  /// A positive integer that must be present.
  int64_t required_int(const char* key) const {
    const auto* value = find(key);
    TORCH_CHECK(value != nullptr, where(key), " is missing. HINT: config.json needs vocab_size, hidden_size, "
                "num_hidden_layers and num_attention_heads; write it with memopt::io::write_llama_config or "
                "take it from the model's HF folder");
    return positive_int(key, *value);
  }

  /// A number that must be present; `hint` says what the field holds.
  double required_number(const char* key, const std::string& hint) const {
    TORCH_CHECK(find(key) != nullptr, where(key), " is missing. HINT: ", hint);
    return number_or(key, 0.0);
  }

  /// A positive integer, or `fallback` when absent.
  int64_t int_or(const char* key, int64_t fallback) const {
    const auto* value = find(key);
    return value ? positive_int(key, *value) : fallback;
  }

  double number_or(const char* key, double fallback) const {
    const auto* value = typed(key, &nlohmann::json::is_number, "a number");
    return value ? value->get<double>() : fallback;
  }

  bool bool_or(const char* key, bool fallback) const {
    const auto* value = typed(key, &nlohmann::json::is_boolean, "true or false");
    return value ? value->get<bool>() : fallback;
  }

  std::string string_or(const char* key, const std::string& fallback) const {
    const auto* value = typed(key, &nlohmann::json::is_string, "a string");
    return value ? value->get<std::string>() : fallback;
  }

  /// Fails when `key` is set to something memopt's Llama does not implement.
  void unsupported(const char* key, const nlohmann::json& seen, const char* hint) const {
    TORCH_CHECK(false, where(key), " is ", snippet(seen), ", which memopt::models::Llama does not support. HINT: ",
                hint);
  }

  std::string where(const char* key) const {
    return "memopt::io: config '" + path_ + "': field \"" + key + "\"";
  }

 private:
  static constexpr const char* kFixHint = "fix config.json (HF's LlamaConfig field types)";

  /// The value at `key` (nullptr when absent), which must pass `is_type`.
  const nlohmann::json* typed(const char* key, bool (nlohmann::json::*is_type)() const noexcept,
                              const char* type_name) const {
    const auto* value = find(key);
    TORCH_CHECK(!value || (value->*is_type)(), where(key), " must be ", type_name, " (got ", snippet(*value),
                "). HINT: ", kFixHint);
    return value;
  }

  int64_t positive_int(const char* key, const nlohmann::json& value) const {
    TORCH_CHECK(value.is_number_integer(), where(key), " must be an integer (got ", snippet(value), "). HINT: ",
                kFixHint);
    TORCH_CHECK(value.get<int64_t>() >= 1, where(key), " must be >= 1 (got ", snippet(value), "). HINT: ",
                kFixHint);
    return value.get<int64_t>();
  }

  std::string path_;
  const nlohmann::json& json_;
};

/// RoPE as transformers 5 reads it from config.json: the object under "rope_scaling"
/// (transformers 4) or, when that is absent, null or {}, "rope_parameters" (5); its "rope_type"
/// ("type" in older files; neither: default) and the fields that type needs; theta from the
/// object's "rope_theta", else the top-level one, else 10000. llama3's
/// original_max_position_embeddings defaults to max_position_embeddings, as in transformers.
inline std::pair<double, nn::RopeScaling> read_rope(const ConfigFields& fields, const std::string& path,
                                                    int64_t max_position_embeddings) {
  double theta = fields.number_or("rope_theta", 10000.0);
  const auto* scaling_json = fields.find("rope_scaling");
  const char* key = scaling_json != nullptr && *scaling_json != nlohmann::json::object() ? "rope_scaling"
                                                                                          : "rope_parameters";
  const auto* rope = fields.find(key);
  nn::RopeScaling scaling;
  if (fields.number_or("partial_rotary_factor", 1.0) != 1.0)
    fields.unsupported("partial_rotary_factor", *fields.find("partial_rotary_factor"), "memopt rotates whole heads");
  if (rope == nullptr) return {theta, scaling};
  TORCH_CHECK(rope->is_object(), fields.where(key), " must be an object (got ", snippet(*rope),
              "). HINT: {\"rope_theta\": 10000.0, \"rope_type\": \"default\"}");
  const ConfigFields rope_fields(path + " (" + key + ")", *rope);
  const std::string type = rope_fields.string_or("rope_type", rope_fields.string_or("type", "default"));
  if (type == "linear") {
    scaling.type(nn::RopeType::kLinear);
  } else if (type == "dynamic") {
    scaling.type(nn::RopeType::kDynamic);
  } else if (type == "llama3") {
    scaling.type(nn::RopeType::kLlama3);
  } else {
    TORCH_CHECK(type == "default", fields.where(key), ": rope_type \"", type, "\" is not one memopt implements (",
                snippet(*rope), "). HINT: memopt's RoPE implements the rope types default, linear, dynamic and "
                "llama3, as transformers' modeling_rope_utils.py computes them; yarn, longrope and others are not "
                "implemented");
  }
  if (rope_fields.number_or("partial_rotary_factor", 1.0) != 1.0)
    fields.unsupported(key, *rope, "memopt rotates whole heads (partial_rotary_factor 1)");
  const double rope_theta = rope_fields.number_or("rope_theta", theta);
  TORCH_CHECK(fields.find("rope_theta") == nullptr || rope_theta == theta, fields.where("rope_theta"), " is ", theta,
              " but ", key, ".rope_theta is ", rope_theta, ". HINT: keep one of them.");
  if (scaling.type() == nn::RopeType::kDefault) return {rope_theta, scaling};
  const std::string hint = std::string("rope_type \"") + type + "\" needs it; Llama 3.1 writes {\"rope_type\": "
                           "\"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
                           "\"original_max_position_embeddings\": 8192}, linear and dynamic need only factor";
  scaling.factor(rope_fields.required_number("factor", hint));
  if (scaling.type() == nn::RopeType::kLlama3) {
    scaling.low_freq_factor(rope_fields.required_number("low_freq_factor", hint))
        .high_freq_factor(rope_fields.required_number("high_freq_factor", hint))
        .original_max_position_embeddings(
            rope_fields.int_or("original_max_position_embeddings", max_position_embeddings));
  }
  return {rope_theta, scaling};
}

}  // namespace detail

/// HF config.json fields of `config` (LlamaForCausalLM), with the head count and FFN width
/// resolved. head_dim is written when set, a RoPE scaling as transformers 4's "rope_scaling"
/// (which transformers 5 reads too). The one memopt-only field, "causal", is written only when
/// false.
///   std::string text = memopt::io::to_json(config).dump(2);
inline nlohmann::json to_json(const models::LlamaConfig& config, torch::Dtype dtype = torch::kFloat32) {
  const char* dtype_name = detail::hf_dtype_name(dtype);
  TORCH_CHECK(dtype_name != nullptr, "memopt::io: to_json: torch_dtype ", dtype,
              " is not a floating type HF models use. HINT: pass torch::kFloat32, kBFloat16 or kFloat16");
  nlohmann::json json = {
      {"architectures", nlohmann::json::array({"LlamaForCausalLM"})},
      {"model_type", "llama"},
      {"vocab_size", config.vocab_size()},
      {"hidden_size", config.hidden_size()},
      {"num_hidden_layers", config.num_hidden_layers()},
      {"num_attention_heads", config.num_attention_heads()},
      {"num_key_value_heads", config.kv_heads()},
      {"intermediate_size", config.ffn_size()},
      {"max_position_embeddings", config.max_position_embeddings()},
      {"rope_theta", config.rope_theta()},
      {"rms_norm_eps", config.rms_norm_eps()},
      {"attention_dropout", config.dropout()},
      {"initializer_range", config.initializer_range()},
      {"hidden_act", "silu"},
      {"tie_word_embeddings", config.tie_word_embeddings()},
      {"torch_dtype", dtype_name},
  };
  if (config.head_dim() > 0) json["head_dim"] = config.head_dim();
  if (const auto& s = config.rope_scaling(); s.type() != nn::RopeType::kDefault) {
    json["rope_scaling"] = {{"rope_type", nn::rope_type_name(s.type())}, {"factor", s.factor()}};
    if (s.type() == nn::RopeType::kLlama3) {
      json["rope_scaling"]["low_freq_factor"] = s.low_freq_factor();
      json["rope_scaling"]["high_freq_factor"] = s.high_freq_factor();
      json["rope_scaling"]["original_max_position_embeddings"] = s.original_max_position_embeddings();
    }
  }
  if (!config.causal()) json["causal"] = false;
  return json;
}

/// Reads a HF config.json. Missing optional fields take HF's LlamaConfig defaults
/// (intermediate_size 11008, max_position_embeddings 2048, rms_norm_eps 1e-6, rope_theta
/// 10000, num_key_value_heads = num_attention_heads); vocab_size, hidden_size,
/// num_hidden_layers and num_attention_heads are required. "attention_dropout" becomes
/// LlamaConfig::dropout (which memopt also applies to residual branches); torch_dtype is
/// ignored. tie_word_embeddings and head_dim (any even width) are read; RoPE where either
/// transformers writes it: "rope_theta" and "rope_scaling" (4.x) or "rope_parameters" (5.x),
/// with the rope types default, linear, dynamic and llama3 (detail::read_rope). Other rope
/// types, biases and activations other than silu are rejected.
///   auto config = memopt::io::read_llama_config("checkpoints/tiny/config.json");
inline models::LlamaConfig read_llama_config(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "memopt::io: cannot open config '", path, "' (", std::strerror(errno),
              "). HINT: check the path; a HF model folder holds config.json next to model.safetensors");
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    TORCH_CHECK(false, "memopt::io: config '", path, "' is not valid JSON (", e.what(),
                "). HINT: fix or rewrite it with memopt::io::write_llama_config");
  }
  TORCH_CHECK(json.is_object(), "memopt::io: config '", path, "' must be a JSON object (got ",
              detail::snippet(json), "). HINT: fix or rewrite it with memopt::io::write_llama_config");
  const detail::ConfigFields fields(path, json);

  if (const std::string act = fields.string_or("hidden_act", "silu"); act != "silu")
    fields.unsupported("hidden_act", act, "memopt's SwiGLU uses silu");
  for (const char* bias : {"attention_bias", "mlp_bias"})
    if (fields.bool_or(bias, false)) fields.unsupported(bias, true, "memopt's projections have no bias");
  // transformers 5 moved rope_theta into rope_parameters; a theta read from neither would
  // silently fall back to 10000 and give wrong logits.
  const int64_t max_positions = fields.int_or("max_position_embeddings", 2048);
  const auto [rope_theta, rope_scaling] = detail::read_rope(fields, path, max_positions);
  // head_dim equal to hidden_size / num_attention_heads (transformers 5 writes it always) stays
  // implicit, so such configs write back as before.
  const int64_t hidden = fields.required_int("hidden_size"), heads = fields.required_int("num_attention_heads");
  int64_t head_dim = fields.int_or("head_dim", 0);
  if (hidden % heads == 0 && head_dim == hidden / heads) head_dim = 0;

  auto config = models::LlamaConfig()
                    .vocab_size(fields.required_int("vocab_size"))
                    .hidden_size(fields.required_int("hidden_size"))
                    .num_hidden_layers(fields.required_int("num_hidden_layers"))
                    .num_attention_heads(fields.required_int("num_attention_heads"))
                    .num_key_value_heads(fields.int_or("num_key_value_heads", 0))
                    .head_dim(head_dim)
                    .intermediate_size(fields.int_or("intermediate_size", 11008))
                    .max_position_embeddings(max_positions)
                    .rope_theta(rope_theta)
                    .rope_scaling(rope_scaling)
                    .tie_word_embeddings(fields.bool_or("tie_word_embeddings", false))
                    .rms_norm_eps(fields.number_or("rms_norm_eps", 1e-6))
                    .dropout(fields.number_or("attention_dropout", 0.0))
                    .initializer_range(fields.number_or("initializer_range", 0.02))
                    .causal(fields.bool_or("causal", true));
  try {
    config.validate();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "memopt::io: config '", path, "': ", error_message(e));
  }
  return config;
}

/// Writes `config` as a HF config.json at `path` (atomically).
///   memopt::io::write_llama_config(config, "checkpoints/tiny/config.json");
inline void write_llama_config(const models::LlamaConfig& config, const std::string& path,
                               torch::Dtype dtype = torch::kFloat32) {
  const std::string text = to_json(config, dtype).dump(2) + "\n";
  detail::write_atomically(path, "memopt::io: write_llama_config('" + path + "')", [&](std::FILE* file) {
    return std::fwrite(text.data(), 1, text.size(), file) == text.size();
  });
}

/// What load_state_dict() accepts.   LoadStateDictOptions().strict(false)
struct LoadStateDictOptions {
  using NameMap = std::map<std::string, std::string>;
  /// true: every parameter and buffer of the model must be in the file, and every tensor
  /// of the file in the model (except harmless extras such as rotary_emb.inv_freq).
  TORCH_ARG(bool, strict) = true;
  /// true: the model's token rows (embed_tokens.weight, lm_head.weight) may outnumber the
  /// file's, as after adding tokens to the tokenizer (transformers' resize_token_embeddings):
  /// the file's rows are copied and each new row is set to the mean of the file's rows, so
  /// new tokens start as an average token instead of noise.
  TORCH_ARG(bool, grow_vocab) = false;
  /// File tensors to pass over: not loaded, not counted as unexpected (load_pretrained: a tied
  /// checkpoint's lm_head.weight equal to its model.embed_tokens.weight).
  TORCH_ARG(std::vector<std::string>, skip) = {};
  /// Model tensor name -> the file tensor it is read from when the file lacks its own name
  /// (load_pretrained: a tied checkpoint holding lm_head.weight only, as transformers reads it).
  TORCH_ARG(NameMap, fallback) = {};
};

namespace detail {
/// The tensors whose first dimension is the vocabulary.
inline bool is_vocab_tensor(const std::string& name) {
  return name.ends_with("embed_tokens.weight") || name.ends_with("lm_head.weight");
}
}  // namespace detail

/// Copies the model's parameters and buffers from `file` (a SafetensorsFile or SafetensorsShards)
/// by name, each tensor straight from the mapping into the model's dtype and device, a slice at
/// a time, each slice's pages released once copied (copy_tensor): the file's pages never pile up
/// in the resident set. Shapes are all checked before anything is copied.
///   memopt::io::load_state_dict(*model, *memopt::io::SafetensorsFile::open("model.safetensors"));
///   memopt::io::load_state_dict(*model, memopt::io::SafetensorsShards::open_dir("checkpoints/llama"));
template <TensorSource Source>
void load_state_dict(torch::nn::Module& model, const Source& file, const LoadStateDictOptions& options = {}) {
  const std::string who = "memopt::io: load_state_dict from '" + file.path() + "'";
  std::vector<std::pair<std::string, torch::Tensor>> targets;
  for (const auto& item : model.named_parameters()) targets.emplace_back(item.key(), item.value());
  for (const auto& item : model.named_buffers()) targets.emplace_back(item.key(), item.value());

  // The file tensor each model tensor is read from: its own name, else options.fallback()'s.
  auto source_of = [&](const std::string& name) {
    const auto it = options.fallback().find(name);
    return file.contains(name) || it == options.fallback().end() ? name : it->second;
  };
  std::vector<std::string> missing, unexpected;
  std::set<std::string> known(options.skip().begin(), options.skip().end());
  for (const auto& [name, tensor] : targets) {
    known.insert(source_of(name));
    if (!file.contains(source_of(name))) missing.push_back(name);
  }
  for (const auto& name : file.names()) {
    const bool harmless = name.ends_with(".rotary_emb.inv_freq");  // HF recomputes it, so do we
    if (!known.count(name) && !harmless) unexpected.push_back(name);
  }
  if (options.strict()) {
    TORCH_CHECK(missing.empty(), who, ": the file lacks ", missing.size(), " of the model's ", targets.size(),
                " tensors: ", detail::name_list(missing),
                ". HINT: is this a LLaMA checkpoint with HF names (model.layers.N.self_attn.q_proj.weight, "
                "lm_head.weight)? Pass LoadStateDictOptions().strict(false) to load a subset");
    TORCH_CHECK(unexpected.empty(), who, ": the file holds ", unexpected.size(),
                " tensors the model does not have: ", detail::name_list(unexpected),
                ". HINT: check that config.json (num_hidden_layers, tie_word_embeddings) matches the "
                "weights, or pass LoadStateDictOptions().strict(false) to skip them");
  }
  for (const auto& [name, tensor] : targets) {
    if (!file.contains(source_of(name))) continue;
    const auto& shape = file.info(source_of(name)).shape;
    const bool grows = options.grow_vocab() && detail::is_vocab_tensor(name) && tensor.dim() == 2 &&
                       shape.size() == 2 && tensor.size(1) == shape[1] && tensor.size(0) > shape[0];
    TORCH_CHECK(grows || tensor.sizes() == torch::IntArrayRef(shape), who, ": tensor '", name, "' has shape ",
                torch::IntArrayRef(shape), " in the file but ", tensor.sizes(),
                " in the model. HINT: the model's config (config.json) does not match these weights",
                detail::is_vocab_tensor(name) && !options.grow_vocab()
                    ? "; if tokens were added to the tokenizer, pass LoadStateDictOptions().grow_vocab(true)"
                    : "");
  }

  torch::NoGradGuard no_grad;
  for (auto& [name, tensor] : targets) {
    const std::string from = source_of(name);
    if (!file.contains(from)) continue;
    const auto& shape = file.info(from).shape;
    if (tensor.sizes() == torch::IntArrayRef(shape)) {
      copy_tensor(file, from, tensor);
      continue;
    }
    const int64_t rows = shape[0];  // grow_vocab: (V_file, C) into (V_model, C)
    copy_tensor(file, from, tensor.narrow(0, 0, rows));
    const int64_t added = tensor.size(0) - rows;
    tensor.narrow(0, rows, added).copy_(file.get(from).to(torch::kFloat).mean(0, true).expand({added, -1}));
    file.release(from, 0, -1);
  }
}

/// What save_pretrained() writes.   SavePretrainedOptions().dtype(torch::kBFloat16).max_shard_bytes(2'000'000'000)
struct SavePretrainedOptions {
  /// The dtype of the parameters and floating buffers in the files (and config.json's torch_dtype).
  TORCH_ARG(torch::Dtype, dtype) = torch::kFloat32;
  /// Shards of at most this many bytes (transformers' max_shard_size: "50GB" by default in
  /// transformers 5, "5GB" in 4.x); one model.safetensors when the weights fit; 0: always one file.
  TORCH_ARG(int64_t, max_shard_bytes) = 50'000'000'000;
};

/// What load_pretrained() builds.   LoadPretrainedOptions().dtype(torch::kBFloat16)
struct LoadPretrainedOptions {
  /// The model's parameters (float32, bfloat16, float16 or float64): the model is built in it and
  /// each file tensor is converted once, as it is copied in.
  TORCH_ARG(torch::Dtype, dtype) = torch::kFloat32;
  TORCH_ARG(c10::Device, device) = torch::kCPU;
};

/// Writes `dir`/config.json and the weights (HF names, metadata {"format": "pt"}, parameters
/// and floating buffers cast to the options' dtype): model.safetensors, or shards and
/// model.safetensors.index.json over max_shard_bytes. Creates `dir`. `config` must be the one
/// the model was built with. A tied Llama lists its shared weight once, as
/// model.embed_tokens.weight, so no lm_head.weight is written (config.json: tie_word_embeddings).
///   memopt::io::save_pretrained(*model, model->config, "checkpoints/tiny", SavePretrainedOptions().dtype(torch::kBFloat16));
inline void save_pretrained(torch::nn::Module& model, const models::LlamaConfig& config, const std::string& dir,
                            const SavePretrainedOptions& options) {
  const torch::Dtype dtype = options.dtype();
  const std::string who = "memopt::io: save_pretrained('" + dir + "')";
  TORCH_CHECK(detail::hf_dtype_name(dtype) != nullptr, who, ": dtype ", dtype,
              " is not a floating type. HINT: pass torch::kFloat32, kBFloat16 or kFloat16");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TORCH_CHECK(!ec, who, ": cannot create the directory (", ec.message(), "). HINT: check the path and permissions");

  torch::NoGradGuard no_grad;
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& item : model.named_parameters()) tensors.emplace_back(item.key(), item.value().to(dtype));
  for (const auto& item : model.named_buffers()) {
    const auto& buffer = item.value();
    tensors.emplace_back(item.key(), buffer.is_floating_point() ? buffer.to(dtype) : buffer);
  }
  const std::filesystem::path root(dir);
  save_sharded(dir, tensors, {{"format", "pt"}}, options.max_shard_bytes());
  write_llama_config(config, (root / "config.json").string(), dtype);
}

/// The same with a dtype and transformers' default shard size.
///   memopt::io::save_pretrained(*model, model->config, "checkpoints/tiny", torch::kBFloat16);
inline void save_pretrained(torch::nn::Module& model, const models::LlamaConfig& config, const std::string& dir,
                            torch::Dtype dtype = torch::kFloat32) {
  save_pretrained(model, config, dir, SavePretrainedOptions().dtype(dtype));
}

/// The same for a Llama, with its own config.
///   memopt::io::save_pretrained(model, "checkpoints/tiny");
inline void save_pretrained(models::Llama& model, const std::string& dir, torch::Dtype dtype = torch::kFloat32) {
  save_pretrained(*model, model->config, dir, dtype);
}

/// How a checkpoint's weights load into a Llama built from `config` when config.json sets
/// tie_word_embeddings and the files hold lm_head.weight too, read as transformers 5 reads them:
/// the embedding from lm_head.weight when model.embed_tokens.weight is absent (fallback);
/// lm_head.weight passed over when equal to it (skip); `config` untied, with a warning naming
/// `who`, when not. Other checkpoints: `load` as given. Pages read to compare are released.
///   auto load = memopt::io::tied_checkpoint_options(weights, config, "gritlm: --init_model");
inline LoadStateDictOptions tied_checkpoint_options(const SafetensorsShards& weights, models::LlamaConfig& config,
                                                    const std::string& who, LoadStateDictOptions load = {}) {
  const std::string embed = "model.embed_tokens.weight", head = "lm_head.weight";
  if (!config.tie_word_embeddings() || !weights.contains(head)) return load;
  if (!weights.contains(embed)) {
    load.fallback({{embed, head}});
  } else if (const auto h = weights.get(head), table = weights.get(embed);
             h.sizes() == table.sizes() && torch::equal(h, table.to(h.scalar_type()))) {
    load.skip({head});
  } else {
    TORCH_WARN("memopt::io: ", who, ": config.json sets tie_word_embeddings but lm_head.weight differs from ", embed,
               ", so the model is loaded untied, as transformers does. HINT: set tie_word_embeddings to false in "
               "config.json to say so");
    config.tie_word_embeddings(false);
  }
  for (const std::string& read : {head, embed})  // read to compare: out of the resident set
    if (weights.contains(read)) weights.release(read);
  return load;
}

/// Builds a Llama from `dir`/config.json (float32 on the CPU unless the options say otherwise)
/// and loads its weights into it strictly: model.safetensors, or the shards
/// model.safetensors.index.json lists. The model is built straight in the options' dtype
/// (LibTorch's default dtype is set to it, process-wide, while its modules are made, as
/// transformers sets torch's), on the CPU, then moved to the device: no float32 copy of a bf16
/// model ever exists. The weights are copied in slice by slice from the mapping
/// (load_state_dict), so on the CPU the resident set grows by about the model's bytes
/// (docs/checkpoints.md, "Load cost"). A tied model reads model.embed_tokens.weight only (see
/// below for a tied checkpoint that holds lm_head.weight too). The model is returned in
/// training mode, like a freshly built one.
///   memopt::models::Llama model = memopt::io::load_pretrained("checkpoints/tiny");
///   auto bf16 = memopt::io::load_pretrained("checkpoints/llama", LoadPretrainedOptions().dtype(torch::kBFloat16));
inline models::Llama load_pretrained(const std::string& dir, const LoadPretrainedOptions& options = {}) {
  namespace fs = std::filesystem;
  const fs::path root(dir);
  const std::string config_path = (root / "config.json").string();
  const std::string weights_path = (root / "model.safetensors").string();
  const char* folder_hint = "pass a folder written by memopt::io::save_pretrained or transformers' save_pretrained";
  TORCH_CHECK(detail::hf_dtype_name(options.dtype()) != nullptr, "memopt::io: load_pretrained('", dir, "'): dtype ",
              options.dtype(), " is not a floating type. HINT: pass torch::kFloat32, kBFloat16 or kFloat16");
  TORCH_CHECK(fs::is_directory(root), "memopt::io: load_pretrained: '", dir, "' is not a directory. HINT: ",
              folder_hint);
  TORCH_CHECK(fs::exists(config_path), "memopt::io: load_pretrained: '", config_path, "' does not exist. HINT: ",
              folder_hint);
  if (!fs::exists(weights_path) && !fs::exists(root / "model.safetensors.index.json")) {
    const char* hint = fs::exists(root / "pytorch_model.bin")
                           ? "convert pytorch_model.bin to model.safetensors (safetensors.torch.save_file)"
                           : folder_hint;
    TORCH_CHECK(false, "memopt::io: load_pretrained: '", weights_path, "' does not exist (nor a sharded "
                "model.safetensors.index.json). HINT: ", hint);
  }
  models::LlamaConfig config = read_llama_config(config_path);
  const auto weights = SafetensorsShards::open_dir(dir);  // every shard validated before the model is built
  const LoadStateDictOptions load = tied_checkpoint_options(weights, config, "load_pretrained('" + dir + "')");
  models::Llama model = [&] {
    detail::DefaultDtypeGuard build_in(options.dtype());  // every parameter made in it, then initialized
    return models::Llama(config);
  }();
  model->to(options.device());
  load_state_dict(*model, weights, load);
  return model;
}

}  // namespace memopt::io
