// examples/common/tokenizer.hpp — which tokenizer an example uses, and whether DATA's
// pre-tokenized shards were made with it.
#pragma once

#include <filesystem>
#include <string>
#include <system_error>

#include <memopt/data/tokenizer.hpp>
#include <memopt/io/manifest.hpp>

namespace examples {

/// --tokenizer (`flag`) when given, else the start model's folder `model_dir` when it holds
/// tokenizer.json or tokenizer.model, else `data`/tokenizer.model.
///   examples::tokenizer_path(a.tokenizer, a.init_model, a.data)
inline std::string tokenizer_path(const std::string& flag, const std::string& model_dir, const std::string& data) {
  namespace fs = std::filesystem;
  if (!flag.empty()) return flag;
  if (!model_dir.empty() && (fs::exists(fs::path(model_dir) / "tokenizer.json") ||
                             fs::exists(fs::path(model_dir) / "tokenizer.model")))
    return model_dir;
  return data + "/tokenizer.model";
}

/// Whether the tokenizer at `path` (a file or a folder) made `data`'s shards: the file it reads
/// has `data`/tokenizer.model's bytes (a copy counts: a shard records only its vocab_size).
inline bool is_data_tokenizer(const std::string& path, const std::string& data) {
  namespace fs = std::filesystem;
  const fs::path model = fs::path(data) / "tokenizer.model";
  if (!fs::is_regular_file(model)) return false;
  const fs::path file = memopt::data::tokenizer_file(path);
  std::error_code ec;
  if (fs::equivalent(file, model, ec)) return true;
  return fs::is_regular_file(file) && fs::file_size(file) == fs::file_size(model) &&
         memopt::io::digest_file(file.string()).xxh3 == memopt::io::digest_file(model.string()).xxh3;
}

}  // namespace examples
