// memopt/io/shards.hpp — a checkpoint's weights as one set of named tensors, whether they are
// in one model.safetensors or split into shards by HF's model.safetensors.index.json:
//   {"metadata": {"total_size": 123, …}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors", …}}
// SafetensorsShards reads either (each shard mapped once, tensors as zero-copy views);
// copy_tensor() copies one into a model's tensor a slice at a time, releasing each slice's
// pages; save_sharded() writes either, as transformers' save_pretrained does for a max_shard_size.
#pragma once

#include <algorithm>
#include <cerrno>
#include <concepts>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/io/safetensors.hpp"

namespace memopt::io {

/// What load_state_dict() reads: named tensors, their shapes and dtypes, and a way to drop
/// the bytes of a tensor already read from the resident set (SafetensorsFile, SafetensorsShards).
template <class S>
concept TensorSource = requires(const S& s, const std::string& name, int64_t byte) {
  { s.path() } -> std::convertible_to<std::string>;
  { s.names() } -> std::convertible_to<std::vector<std::string>>;
  { s.contains(name) } -> std::convertible_to<bool>;
  { s.info(name) } -> std::convertible_to<TensorInfo>;
  { s.get(name) } -> std::convertible_to<torch::Tensor>;
  s.release(name, byte, byte);
};

/// The most bytes of a file tensor copy_tensor() reads before it releases them: one
/// MappedFile::kReleaseBlock, the unit a release drops.
inline constexpr int64_t kCopySliceBytes = int64_t{2} << 20;

/// Copies tensor `name` of `source` into `dst` (same shape; any dtype and device: copy_
/// converts each element), at most kCopySliceBytes of the file at a time, each slice released
/// (source.release) once copied: a load grows the resident set by `dst`, not by the file too.
/// A contiguous `dst` is filled slice by slice (a plain memcpy when it is on the CPU in the
/// file's dtype: one thread, no parallel region per slice); another is copied whole, then released.
///   memopt::io::copy_tensor(weights, "lm_head.weight", model->lm_head->weight);   // under NoGradGuard
template <TensorSource Source>
void copy_tensor(const Source& source, const std::string& name, const torch::Tensor& dst) {
  const torch::Tensor from = source.get(name);  // a view into the mapping (a copy when misaligned)
  if (!dst.is_contiguous()) {
    dst.copy_(from);
    source.release(name, 0, -1);
    return;
  }
  const torch::Tensor flat_from = from.reshape({-1}), flat_to = dst.view({-1});  // (numel) each
  const bool bytes = dst.is_cpu() && dst.scalar_type() == from.scalar_type();
  const int64_t element = static_cast<int64_t>(flat_from.element_size()), numel = flat_from.numel();
  const int64_t step = std::max<int64_t>(1, kCopySliceBytes / element);
  for (int64_t at = 0; at < numel; at += step) {
    const int64_t n = std::min(step, numel - at);
    if (bytes) {
      std::memcpy(static_cast<char*>(flat_to.data_ptr()) + at * element,
                  static_cast<const char*>(flat_from.data_ptr()) + at * element, static_cast<size_t>(n * element));
    } else {
      flat_to.narrow(0, at, n).copy_(flat_from.narrow(0, at, n));
    }
    source.release(name, at * element, (at + n) * element);
  }
}

/// The file names of HF shards: "model-00001-of-00003.safetensors".
inline std::string shard_file_name(size_t index, size_t count, const std::string& stem = "model") {
  return fmt::format("{}-{:05d}-of-{:05d}.safetensors", stem, index + 1, count);
}

/// The weights of a checkpoint folder: the shards its index lists, or its one file.
///   auto weights = memopt::io::SafetensorsShards::open_dir("checkpoints/llama");
///   torch::Tensor w = weights.get("lm_head.weight");   // a read-only view, like SafetensorsFile::get
class SafetensorsShards {
 public:
  /// `dir`/model.safetensors.index.json and its shards when the index exists, else `dir`/model.safetensors.
  static SafetensorsShards open_dir(const std::string& dir) {
    const std::filesystem::path root(dir);
    if (std::filesystem::exists(root / "model.safetensors.index.json"))
      return open_index((root / "model.safetensors.index.json").string());
    return single(SafetensorsFile::open((root / "model.safetensors").string()));
  }

  /// One file, as a source of the same kind.
  static SafetensorsShards single(std::shared_ptr<const SafetensorsFile> file) {
    SafetensorsShards out;
    out.path_ = file->path();
    out.names_ = file->names();
    for (const auto& name : out.names_) out.where_[name] = 0;
    out.files_.push_back(std::move(file));
    return out;
  }

  /// The shards an index lists, each opened and validated once. Every tensor of the weight_map
  /// must be in the shard it names; a shard's tensors the index does not list are not read.
  static SafetensorsShards open_index(const std::string& index_path) {
    const std::string who = "memopt::io: shard index '" + index_path + "'";
    const char* fix = "HINT: the index is model.safetensors.index.json as transformers' save_pretrained writes it "
                      "({\"metadata\": {...}, \"weight_map\": {\"tensor name\": \"shard file\"}}); download or "
                      "write it again";
    std::ifstream in(index_path);
    TORCH_CHECK(in.good(), who, " cannot be opened (", std::strerror(errno), "). ", fix);
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, who, " is not valid JSON (", e.what(), "). ", fix);
    }
    TORCH_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), who,
                " has no \"weight_map\" object (got ", detail::snippet(index), "). ", fix);
    const auto& map = index["weight_map"];
    TORCH_CHECK(!map.empty(), who, ": \"weight_map\" is empty. ", fix);

    SafetensorsShards out;
    out.path_ = index_path;
    std::map<std::string, std::vector<std::string>> by_shard;  // shard file -> its tensors, in index order
    for (const auto& [name, shard] : map.items()) {
      TORCH_CHECK(shard.is_string(), who, ": \"weight_map\".\"", name, "\" must be a shard file name (got ",
                  detail::snippet(shard), "). ", fix);
      const std::string file = shard.get<std::string>();
      const std::filesystem::path as_path(file);
      TORCH_CHECK(!file.empty() && as_path.filename() == as_path && file != "." && file != "..", who,
                  ": \"weight_map\".\"", name, "\" names '", file, "', which is not a file name in the index's "
                  "folder. HINT: shards sit next to the index; use plain file names");
      by_shard[file].push_back(name);
    }
    const std::filesystem::path folder = std::filesystem::path(index_path).parent_path();
    for (const auto& [file, names] : by_shard) {
      const std::string shard_path = (folder / file).string();
      TORCH_CHECK(std::filesystem::exists(shard_path), who, " lists shard '", file, "' (holding '", names.front(),
                  "' and ", names.size() - 1, " more tensor(s)), but '", shard_path, "' does not exist. HINT: "
                  "download every shard the index names into its folder");
      auto opened = SafetensorsFile::open(shard_path);
      for (const auto& name : names) {
        TORCH_CHECK(opened->contains(name), who, " puts tensor '", name, "' in shard '", file, "', which has no "
                    "such tensor (it holds ", opened->names().size(), "). HINT: the index and the shards come "
                    "from different saves; download or write them again together");
        out.where_[name] = out.files_.size();
      }
      out.files_.push_back(std::move(opened));
    }
    for (const auto& file : out.files_)  // shard order, then each shard's file order
      for (const auto& name : file->names())
        if (out.where_.count(name) && out.files_[out.where_.at(name)] == file) out.names_.push_back(name);
    return out;
  }

  /// The index file, or the one safetensors file.
  const std::string& path() const { return path_; }
  /// Every tensor name (shard by shard, in each shard's file order).
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  /// Dtype, shape and byte range of `name` in its shard; an error naming the index when it is absent.
  const TensorInfo& info(const std::string& name) const { return file_of(name).info(name); }
  /// Tensor `name` as SafetensorsFile::get returns it (a read-only view unless `copy`).
  torch::Tensor get(const std::string& name, bool copy = false) const { return file_of(name).get(name, copy); }
  /// Drops bytes [from, to) of `name` (by default all) from the resident set, as SafetensorsFile::release.
  void release(const std::string& name, int64_t from = 0, int64_t to = -1) const {
    file_of(name).release(name, from, to);
  }
  /// The files read: 1 for an unsharded checkpoint.
  size_t num_files() const { return files_.size(); }

 private:
  const SafetensorsFile& file_of(const std::string& name) const {
    auto it = where_.find(name);
    TORCH_CHECK(it != where_.end(), "memopt::io: '", path_, "' has no tensor named '", name, "' (it holds ",
                names_.size(), " tensors: ", detail::name_list(names_), "). HINT: list the names with names()");
    return *files_[it->second];
  }

  std::string path_;
  std::vector<std::shared_ptr<const SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // tensor -> index into files_
  std::vector<std::string> names_;
};

/// Writes `tensors` into `dir` as transformers' save_pretrained does: model.safetensors when
/// they fit in `max_shard_bytes` (0: no limit), else shards of at most that size (a tensor
/// larger than the limit gets a shard of its own), filled in order, named
/// model-0000i-of-0000n.safetensors, and model.safetensors.index.json. Files of an earlier save
/// in `dir` that would mislead a reader (the other layout's, or shards of another count) are
/// removed. Returns the files written, index last.
///   memopt::io::save_sharded("out/model", tensors, {{"format", "pt"}}, 2'000'000'000);
inline std::vector<std::string> save_sharded(const std::string& dir,
                                             const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                                             const std::map<std::string, std::string>& metadata,
                                             int64_t max_shard_bytes) {
  const std::string who = "memopt::io: save_sharded('" + dir + "')";
  TORCH_CHECK(max_shard_bytes >= 0, who, ": max_shard_bytes must be >= 0 (got ", max_shard_bytes,
              "). HINT: 0 writes one file");
  std::vector<std::vector<size_t>> shards(1);
  int64_t in_shard = 0, total = 0, parameters = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t bytes = static_cast<int64_t>(tensors[i].second.nbytes());
    if (max_shard_bytes > 0 && in_shard > 0 && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += bytes;
    total += bytes;
    parameters += tensors[i].second.numel();
  }
  namespace fs = std::filesystem;
  const fs::path root(dir);
  std::vector<std::string> keep, written;
  if (shards.size() == 1) {
    keep.push_back("model.safetensors");
  } else {
    for (size_t s = 0; s < shards.size(); ++s) keep.push_back(shard_file_name(s, shards.size()));
    keep.push_back("model.safetensors.index.json");
  }
  // An earlier save's files: model.safetensors, the index, model-*-of-*.safetensors.
  static const std::regex kShard(R"(model-\d{5}-of-\d{5}\.safetensors)");
  if (fs::is_directory(root))
    for (const auto& entry : fs::directory_iterator(root)) {
      const std::string name = entry.path().filename().string();
      const bool ours = name == "model.safetensors" || name == "model.safetensors.index.json" ||
                        std::regex_match(name, kShard);
      if (ours && std::find(keep.begin(), keep.end(), name) == keep.end()) fs::remove(entry.path());
    }
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    std::vector<std::pair<std::string, torch::Tensor>> part;
    for (size_t i : shards[s]) {
      part.push_back(tensors[i]);
      weight_map[tensors[i].first] = keep[s];
    }
    const std::string path = (root / keep[s]).string();
    save_safetensors(path, part, metadata);
    written.push_back(path);
  }
  if (shards.size() > 1) {
    const nlohmann::ordered_json index = {{"metadata", {{"total_parameters", parameters}, {"total_size", total}}},
                                          {"weight_map", weight_map}};
    const std::string text = index.dump(2) + "\n";
    const std::string path = (root / "model.safetensors.index.json").string();
    detail::write_atomically(path, who, [&](std::FILE* file) {
      return std::fwrite(text.data(), 1, text.size(), file) == text.size();
    });
    written.push_back(path);
  }
  return written;
}

}  // namespace memopt::io
