// memopt/data/source_files.hpp — the files a stream's sources name: files, directories (their
// text, JSONL, Parquet and token-shard files, recursively, hidden ones left out; or their
// index.json alone), glob patterns (glob(3)) and memopt-pretokenize indexes, each sorted by path,
// with what each file holds and its size. data/source.hpp reads documents from them.
#pragma once

#include <glob.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace memopt::data {

/// What a file holds.
enum class SourceKind { kText, kJsonl, kShard, kParquet };

/// One file of a stream.
struct SourceFile {
  std::string path;
  SourceKind kind = SourceKind::kText;
  int64_t bytes = 0;
};

namespace detail {

inline constexpr const char* kSourceExtensionsHint =
    "a directory is read for its *.txt, *.text, *.jsonl, *.ndjson, *.parquet, *.bin files (or its index.json)";

inline bool has_glob_chars(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

inline SourceKind kind_of(const std::filesystem::path& path) {
  const std::string ext = path.extension().string();
  if (ext == ".jsonl" || ext == ".ndjson") return SourceKind::kJsonl;
  if (ext == ".bin") return SourceKind::kShard;
  if (ext == ".parquet") return SourceKind::kParquet;
  return SourceKind::kText;
}

/// The shards a memopt-pretokenize index.json names, in order (relative to its folder).
inline std::vector<SourceFile> index_shards(const std::filesystem::path& index) {
  std::ifstream in(index);
  TORCH_CHECK(in.good(), "memopt::data: cannot read index '", index.string(), "'. HINT: check the path");
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  const bool ok = !j.is_discarded() && j.is_object() && j.value("format", "") == "memopt-token-shards" &&
                  j.contains("shards") && j["shards"].is_array();
  TORCH_CHECK(ok, "memopt::data: '", index.string(), "' is not a memopt-pretokenize index (expected a JSON object "
              "with \"format\": \"memopt-token-shards\" and a \"shards\" array). HINT: pass the index.json that "
              "memopt-pretokenize wrote, or the shards themselves");
  std::vector<SourceFile> out;
  for (const auto& shard : j["shards"]) {
    TORCH_CHECK(shard.is_object() && shard.contains("file") && shard["file"].is_string(), "memopt::data: index '",
                index.string(), "': a shard entry is ", shard.dump(), " (expected {\"file\": NAME, ...}). HINT: "
                "re-run memopt-pretokenize");
    const auto path = index.parent_path() / shard["file"].get<std::string>();
    out.push_back({path.string(), SourceKind::kShard, 0});
  }
  TORCH_CHECK(!out.empty(), "memopt::data: index '", index.string(), "' lists no shards. HINT: re-run "
              "memopt-pretokenize on a corpus with at least one document");
  return out;
}

inline void add_file(std::vector<SourceFile>& out, const std::filesystem::path& path) {
  if (path.extension() == ".json") {
    for (auto& f : index_shards(path)) out.push_back(std::move(f));
    return;
  }
  out.push_back({path.string(), kind_of(path), 0});
}

inline std::vector<std::filesystem::path> directory_files(const std::filesystem::path& dir) {
  if (std::filesystem::exists(dir / "index.json")) return {dir / "index.json"};
  std::vector<std::filesystem::path> files;
  for (auto it = std::filesystem::recursive_directory_iterator(dir); it != std::filesystem::recursive_directory_iterator(); ++it) {
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    const std::string ext = it->path().extension().string();
    const bool wanted = ext == ".txt" || ext == ".text" || ext == ".jsonl" || ext == ".ndjson" || ext == ".bin" ||
                        ext == ".parquet";
    if (it->is_regular_file() && wanted) files.push_back(it->path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace detail

/// The files `specs` name (files, directories, globs, index.json), in order, with their
/// sizes. Each spec must match at least one file; errors name the spec.
///   auto files = memopt::data::resolve_sources({"corpus/*.jsonl", "extra.txt"});
inline std::vector<SourceFile> resolve_sources(const std::vector<std::string>& specs) {
  TORCH_CHECK(!specs.empty(), "memopt::data: no data source given. HINT: pass files, directories or globs such as "
              "'corpus/*.txt'");
  std::vector<SourceFile> out;
  for (const auto& spec : specs) {
    const size_t before = out.size();
    if (detail::has_glob_chars(spec) && !std::filesystem::exists(spec)) {
      glob_t g{};
      const int rc = ::glob(spec.c_str(), GLOB_ERR, nullptr, &g);
      std::vector<std::filesystem::path> matches;
      for (size_t i = 0; rc == 0 && i < g.gl_pathc; ++i) matches.emplace_back(g.gl_pathv[i]);
      ::globfree(&g);
      TORCH_CHECK(rc == 0 || rc == GLOB_NOMATCH, "memopt::data: reading the pattern '", spec,
                  "' failed (glob error ", rc, "). HINT: check that its folders exist and are readable");
      std::sort(matches.begin(), matches.end());
      for (const auto& m : matches) {
        if (std::filesystem::is_directory(m)) {
          for (const auto& f : detail::directory_files(m)) detail::add_file(out, f);
        } else {
          detail::add_file(out, m);
        }
      }
    } else if (std::filesystem::is_directory(spec)) {
      for (const auto& f : detail::directory_files(spec)) detail::add_file(out, f);
    } else {
      TORCH_CHECK(std::filesystem::exists(spec), "memopt::data: data source '", spec,
                  "' does not exist. HINT: pass a file, a directory or a glob such as 'corpus/*.jsonl'");
      detail::add_file(out, spec);
    }
    TORCH_CHECK(out.size() > before, "memopt::data: data source '", spec, "' matches no file. HINT: ",
                detail::kSourceExtensionsHint, "; check the pattern");
  }
  for (auto& f : out) {
    std::error_code ec;
    f.bytes = static_cast<int64_t>(std::filesystem::file_size(f.path, ec));
    TORCH_CHECK(!ec, "memopt::data: cannot read the size of '", f.path, "' (", ec.message(),
                "). HINT: check that it is a readable file");
  }
  return out;
}

}  // namespace memopt::data
