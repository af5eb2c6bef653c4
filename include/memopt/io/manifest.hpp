// memopt/io/manifest.hpp — a checkpoint's manifest.json: which checkpoint a directory is and
// the size and XXH3-64 checksum of each of its files, written last, so a directory whose files
// all match it is a whole checkpoint (io/checkpoint.hpp writes and resolves them). Also the
// small file helpers the checkpoint writer shares: whole-file text I/O and fsync.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/io/safetensors.hpp"

namespace memopt::io {

/// manifest.json's "format" and "version".
inline constexpr const char* kCheckpointFormat = "memopt-checkpoint";
inline constexpr int kCheckpointVersion = 2;
/// The files every checkpoint holds besides manifest.json.
inline const std::vector<std::string>& checkpoint_files() {
  static const std::vector<std::string> files = {"model.safetensors", "trainer.pt", "state.json"};
  return files;
}

/// A file's size and XXH3-64 checksum (16 hex digits).
struct FileDigest {
  int64_t bytes = 0;
  std::string xxh3;
  bool operator==(const FileDigest&) const = default;
};
inline std::ostream& operator<<(std::ostream& out, const FileDigest& d) {
  return out << d.bytes << " bytes, xxh3 " << d.xxh3;
}

namespace detail {

/// Flushes `path` (a file or a directory) to the disk.
inline void fsync_path(const std::string& path, const std::string& who) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  TORCH_CHECK(fd >= 0, who, ": cannot open '", path, "' to sync it (", std::strerror(errno),
              "). HINT: check that the checkpoint directory is writable");
  const int rc = ::fsync(fd);
  const int sync_errno = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, who, ": fsync of '", path, "' failed (", std::strerror(sync_errno),
              "). HINT: check free disk space");
}

inline void write_text(const std::string& path, const std::string& text, const std::string& who) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  TORCH_CHECK(out.good(), who, ": writing '", path, "' failed. HINT: check free disk space");
}

inline std::string read_text(const std::string& path, const std::string& who) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), who, ": cannot read '", path, "'. HINT: check that it exists and is readable");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace detail

/// The size and XXH3-64 checksum of a file, read in 1 MiB pieces.
inline FileDigest digest_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "memopt::io: cannot read '", path, "' to checksum it. HINT: check that it exists");
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  std::vector<char> buffer(size_t{1} << 20);
  int64_t bytes = 0;
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const auto got = in.gcount();
    XXH3_64bits_update(state, buffer.data(), static_cast<size_t>(got));
    bytes += got;
  }
  const XXH64_hash_t hash = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return {bytes, fmt::format("{:016x}", hash)};
}

/// manifest.json: which checkpoint this is and what each of its files must be.
///   {"format": "memopt-checkpoint", "version": 2, "step": 120,
///    "files": {"model.safetensors": {"bytes": 21300000, "xxh3": "9c0f..."}, ...}}
struct Manifest {
  int64_t step = 0;
  std::map<std::string, FileDigest> files;

  std::string dump() const {
    nlohmann::json j = {{"format", kCheckpointFormat}, {"version", kCheckpointVersion}, {"step", step}};
    j["files"] = nlohmann::json::object();
    for (const auto& [name, d] : files) j["files"][name] = {{"bytes", d.bytes}, {"xxh3", d.xxh3}};
    return j.dump(2) + "\n";
  }

  /// Parses manifest.json's text; `path` names it in errors. Each malformed field is refused
  /// naming the field and the value seen, with a HINT (the fuzz target's entry point).
  static Manifest parse(const std::string& text, const std::string& path) {
    const std::string who = "memopt::io: checkpoint manifest '" + path + "'";
    const std::string hint = "HINT: the checkpoint is corrupt or was not written by memopt; resume from another one";
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, who, " is not valid JSON (", e.what(), "). ", hint);
    }
    TORCH_CHECK(j.is_object(), who, ": must be a JSON object (got ", io::detail::snippet(j), "). ", hint);
    auto field = [&](const nlohmann::json& obj, const char* key) -> const nlohmann::json& {
      TORCH_CHECK(obj.contains(key), who, ": the field \"", key, "\" is missing. ", hint);
      return obj.at(key);
    };
    TORCH_CHECK(field(j, "format") == kCheckpointFormat, who, ": \"format\" is ", io::detail::snippet(j["format"]),
                ", expected \"", kCheckpointFormat, "\". ", hint);
    TORCH_CHECK(field(j, "version") == kCheckpointVersion, who, ": \"version\" is ",
                io::detail::snippet(j["version"]), ", this memopt reads version ", kCheckpointVersion,
                ". HINT: resume with the memopt that wrote it");
    const auto& step = field(j, "step");
    TORCH_CHECK(step.is_number_integer() && step.get<int64_t>() >= 0, who,
                ": \"step\" must be an integer >= 0 (got ", io::detail::snippet(step), "). ", hint);
    Manifest m;
    m.step = step.get<int64_t>();
    const auto& files = field(j, "files");
    TORCH_CHECK(files.is_object(), who, ": \"files\" must be an object (got ", io::detail::snippet(files), "). ", hint);
    for (const auto& [name, entry] : files.items()) {
      TORCH_CHECK(!name.empty() && name.find_first_of(std::string("/\0", 2)) == std::string::npos && name != "." &&
                      name != "..",
                  who,
                  ": file name ", io::detail::snippet(nlohmann::json(name)), " is not a plain file name. ", hint);
      TORCH_CHECK(entry.is_object(), who, ": \"files\".\"", name, "\" must be an object (got ",
                  io::detail::snippet(entry), "). ", hint);
      const auto& bytes = field(entry, "bytes");
      TORCH_CHECK(bytes.is_number_integer() && bytes.get<int64_t>() >= 0, who, ": \"files\".\"", name,
                  "\".\"bytes\" must be an integer >= 0 (got ", io::detail::snippet(bytes), "). ", hint);
      const auto& hash = field(entry, "xxh3");
      TORCH_CHECK(hash.is_string() && hash.get<std::string>().size() == 16 &&
                      hash.get<std::string>().find_first_not_of("0123456789abcdef") == std::string::npos,
                  who, ": \"files\".\"", name, "\".\"xxh3\" must be 16 lowercase hex digits (got ",
                  io::detail::snippet(hash), "). ", hint);
      m.files[name] = {bytes.get<int64_t>(), hash.get<std::string>()};
    }
    for (const auto& name : checkpoint_files())
      TORCH_CHECK(m.files.count(name), who, ": \"files\" does not list \"", name, "\". ", hint);
    return m;
  }
};

/// Checks a checkpoint directory against its manifest: every listed file present, of the
/// listed size and checksum. Returns the manifest; throws naming the file that fails.
inline Manifest verify_checkpoint(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string who = "memopt::io: checkpoint '" + dir + "'";
  TORCH_CHECK(fs::is_directory(dir), who, " is not a directory. HINT: pass a step-N directory written by "
              "memopt (OUTPUT_DIR/checkpoints/step-N) or 'latest'");
  const std::string manifest_path = (fs::path(dir) / "manifest.json").string();
  TORCH_CHECK(fs::is_regular_file(manifest_path), who, ": manifest.json is missing. HINT: the save was "
              "interrupted or the directory was not written by memopt; resume from another checkpoint");
  Manifest m = Manifest::parse(detail::read_text(manifest_path, who), manifest_path);
  for (const auto& [name, expected] : m.files) {
    const std::string path = (fs::path(dir) / name).string();
    TORCH_CHECK(fs::is_regular_file(path), who, ": '", name, "' is missing. HINT: the checkpoint is incomplete; "
                "resume from another one");
    const FileDigest got = digest_file(path);
    TORCH_CHECK(got.bytes == expected.bytes, who, ": '", name, "' has ", got.bytes, " bytes, the manifest says ",
                expected.bytes, ". HINT: the file was truncated or changed; resume from another checkpoint");
    TORCH_CHECK(got.xxh3 == expected.xxh3, who, ": '", name, "' fails its checksum (xxh3 ", got.xxh3,
                ", the manifest says ", expected.xxh3, "). HINT: the file is corrupt; resume from another checkpoint");
  }
  return m;
}

}  // namespace memopt::io
