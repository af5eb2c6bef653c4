// memopt/io/pretrained.hpp — HuggingFace-style checkpoints of memopt::models::Llama: a
// folder with config.json (HF's LlamaConfig fields: io/hf_config.hpp) and model.safetensors,
// or shards listed by model.safetensors.index.json (HF parameter names), as written by
// transformers' save_pretrained, tied embeddings, head_dim and scaled RoPE included (linear,
// dynamic, llama3: Llama 3.1 / 3.2). save_pretrained()/load_pretrained() round-trip a model
// (built straight in the dtype asked for); load_state_dict() loads any module strictly from a
// file or shards, a slice at a time, naming what is missing, unexpected or of the wrong shape.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/io/hf_config.hpp"
#include "memopt/io/safetensors.hpp"
#include "memopt/io/shards.hpp"
#include "memopt/models/llama.hpp"

namespace memopt::io {

namespace detail {

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

}  // namespace detail

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
