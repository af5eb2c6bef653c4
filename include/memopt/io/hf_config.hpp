// memopt/io/hf_config.hpp — a Hugging Face LlamaConfig's config.json and
// memopt::models::LlamaConfig, both ways: the fields transformers' save_pretrained writes
// (head_dim, tied embeddings, RoPE scaling in transformers 4's "rope_scaling" and 5's
// "rope_parameters": linear, dynamic, llama3), HF's defaults for what is missing, and errors
// naming the file, the field and the value for what memopt cannot run. io/pretrained.hpp reads
// and writes the weights beside it.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/error.hpp"
#include "memopt/io/safetensors.hpp"
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

}  // namespace memopt::io
