// memopt/io/safetensors.hpp — HuggingFace's safetensors format: an 8-byte little-endian
// header length N, N bytes of JSON giving each tensor's dtype, shape and byte range, then
// the raw little-endian data. save_safetensors() writes a file atomically; SafetensorsFile
// maps one read-only, validates every header field on open (each error names the file, the
// field and the value seen, with a HINT), hands out zero-copy views into the mapping and
// drops pages already read from the resident set (release).
#pragma once

#include <algorithm>
#include <bit>
#include <cerrno>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/detail/mapped_file.hpp"

namespace memopt::io {

/// Where one tensor lies in a safetensors file.   auto info = file->info("lm_head.weight");
struct TensorInfo {
  std::string dtype;                         // the file's name for it: "F32", "BF16", …
  torch::Dtype scalar_type = torch::kFloat;  // the LibTorch dtype get() returns
  std::vector<int64_t> shape;
  int64_t begin = 0;  // data_offsets[0], relative to the first byte after the header
  int64_t end = 0;    // data_offsets[1] (one past the last byte)
  int64_t nbytes() const { return end - begin; }
};

/// The largest JSON header accepted, as in the reference implementation (100 MB).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

/// What a validated safetensors header says (SafetensorsFile::parse_header).
struct SafetensorsHeader {
  uint64_t header_bytes = 0;                    // N, the JSON's length
  std::map<std::string, TensorInfo> infos;      // by name
  std::vector<std::string> names;               // by data offset
  std::map<std::string, std::string> metadata;  // "__metadata__"
};

namespace detail {

struct SafetensorsDtype {
  const char* name;
  torch::Dtype type;
  int64_t size;  // bytes per element
};

inline constexpr SafetensorsDtype kSafetensorsDtypes[] = {
    {"F64", torch::kFloat64, 8}, {"F32", torch::kFloat32, 4}, {"F16", torch::kFloat16, 2},
    {"BF16", torch::kBFloat16, 2}, {"I64", torch::kInt64, 8}, {"I32", torch::kInt32, 4},
    {"I16", torch::kInt16, 2},   {"I8", torch::kInt8, 1},     {"U8", torch::kUInt8, 1},
    {"BOOL", torch::kBool, 1}};

inline const SafetensorsDtype* find_dtype(std::string_view name) {
  for (const auto& d : kSafetensorsDtypes)
    if (name == d.name) return &d;
  return nullptr;
}

inline const SafetensorsDtype* find_dtype(torch::Dtype type) {
  for (const auto& d : kSafetensorsDtypes)
    if (type == d.type) return &d;
  return nullptr;
}

/// "F64, F32, …" for error messages.
inline std::string supported_dtypes() {
  std::string out;
  for (const auto& d : kSafetensorsDtypes) out += (out.empty() ? "" : ", ") + std::string(d.name);
  return out;
}

/// Appends `value` as compact JSON (as dump() writes it) to `out`, stopping once `out` holds
/// `limit` characters: each level of nesting writes a bracket before it descends, so the
/// recursion is at most `limit` deep however deeply the value nests.
inline void append_json(std::string& out, const nlohmann::json& value, size_t limit) {
  const auto dump = [](const nlohmann::json& v) {
    return v.dump(-1, ' ', true, nlohmann::json::error_handler_t::replace);
  };
  if (out.size() >= limit) return;
  if (value.is_array() || value.is_object()) {
    out += value.is_array() ? '[' : '{';
    bool first = true;
    for (auto it = value.begin(); it != value.end() && out.size() < limit; ++it, first = false) {
      if (!first) out += ',';
      if (value.is_object()) out += dump(it.key()) + ':';
      append_json(out, it.value(), limit);
    }
    out += value.is_array() ? ']' : '}';
  } else {
    out += dump(value);
  }
}

/// A JSON value as at most `max_chars` characters of text, for error messages. Only what is
/// shown is rendered: a header of 10^7 nested arrays costs no more than a short one (a
/// plain dump() would recurse once per level and overflow the stack).
inline std::string snippet(const nlohmann::json& value, size_t max_chars = 80) {
  std::string text;
  append_json(text, value, max_chars + 1);
  if (text.size() > max_chars) text = text.substr(0, max_chars) + "…";
  return text;
}

/// "'a', 'b', 'c' (+4 more)": the first `max_names` of `names`, for error messages.
inline std::string name_list(const std::vector<std::string>& names, size_t max_names = 5) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < max_names; ++i) out += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > max_names) out += " (+" + std::to_string(names.size() - max_names) + " more)";
  return out;
}

inline void check_little_endian(const char* who) {
  TORCH_CHECK(std::endian::native == std::endian::little, "memopt::io: ", who,
              " needs a little-endian host (safetensors data is little-endian). HINT: convert "
              "the file on a little-endian machine");
}

/// Writes `path` through `path + ".tmp"` and an atomic rename; `fill(FILE*)` returns
/// false when a write failed. `who` starts every error message.
template <class Fill>
inline void write_atomically(const std::string& path, const std::string& who, Fill&& fill) {
  const std::string tmp = path + ".tmp";
  std::FILE* file = std::fopen(tmp.c_str(), "wb");
  TORCH_CHECK(file != nullptr, who, ": cannot create '", tmp, "' (", std::strerror(errno),
              "). HINT: check that the directory exists and is writable");
  bool wrote = false;
  try {
    wrote = fill(file);
  } catch (...) {
    std::fclose(file);
    std::remove(tmp.c_str());
    throw;
  }
  const int write_errno = errno;
  const bool closed = std::fclose(file) == 0;
  if (!wrote || !closed) {
    std::remove(tmp.c_str());
    TORCH_CHECK(false, who, ": writing '", tmp, "' failed (", std::strerror(write_errno),
                "). HINT: check free disk space");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) std::remove(tmp.c_str());
  TORCH_CHECK(!ec, who, ": cannot rename '", tmp, "' to '", path, "' (", ec.message(),
              "). HINT: check that '", path, "' is not a directory and is writable");
}

}  // namespace detail

/// Writes `tensors` to `path` in the given order (each moved to the CPU and made
/// contiguous), with optional string metadata; the JSON header is padded with spaces to a
/// multiple of 8 bytes and the file appears atomically (written to `path + ".tmp"`, then
/// renamed). Names must be unique and non-empty; dtypes: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL.
///   memopt::io::save_safetensors("w.safetensors", {{"w", torch::ones({2, 3})}}, {{"format", "pt"}});
inline void save_safetensors(const std::string& path,
                             const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                             const std::map<std::string, std::string>& metadata = {}) {
  detail::check_little_endian("save_safetensors");
  const std::string who = "memopt::io: save_safetensors('" + path + "')";
  const std::string hint = ". HINT: give every tensor a unique, non-empty name";

  // ---- header: {"__metadata__": {...}, name: {dtype, shape, data_offsets}, ...} ----
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, tensor] = tensors[i];
    TORCH_CHECK(!name.empty(), who, ": tensor ", i, " has an empty name", hint);
    TORCH_CHECK(name != "__metadata__", who, ": tensor ", i,
                " is named '__metadata__', which the format reserves for metadata", hint);
    TORCH_CHECK(seen.insert(name).second, who, ": tensor name '", name, "' appears twice", hint);
    TORCH_CHECK(tensor.defined(), who, ": tensor '", name,
                "' is undefined. HINT: pass only defined tensors");
    TORCH_CHECK(tensor.layout() == torch::kStrided, who, ": tensor '", name, "' has layout ",
                tensor.layout(), ", safetensors stores dense tensors only. HINT: call .to_dense() first");
    const auto* dtype = detail::find_dtype(tensor.scalar_type());
    TORCH_CHECK(dtype != nullptr, who, ": tensor '", name, "' has dtype ", tensor.scalar_type(),
                ", which memopt cannot store (supported: ", detail::supported_dtypes(),
                "). HINT: convert it first, e.g. tensor.to(torch::kFloat32)");
    const uint64_t nbytes = static_cast<uint64_t>(tensor.numel()) * static_cast<uint64_t>(dtype->size);
    header[name] = {{"dtype", dtype->name},
                    {"shape", tensor.sizes().vec()},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, who, ": a tensor name or metadata string is not valid UTF-8 (", e.what(),
                "). HINT: use UTF-8 names and metadata");
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  TORCH_CHECK(text.size() <= kMaxSafetensorsHeaderBytes, who, ": the JSON header would take ",
              text.size(), " bytes, more than readers accept (", kMaxSafetensorsHeaderBytes,
              "). HINT: split the tensors over several files");

  // ---- file: u64 header length, header, then each tensor's bytes in order ----
  detail::write_atomically(path, who, [&](std::FILE* file) {
    unsigned char length[8];
    for (int b = 0; b < 8; ++b) length[b] = static_cast<unsigned char>(static_cast<uint64_t>(text.size()) >> (8 * b));
    if (std::fwrite(length, 1, 8, file) != 8) return false;
    if (std::fwrite(text.data(), 1, text.size(), file) != text.size()) return false;
    for (const auto& item : tensors) {
      const torch::Tensor cpu = item.second.detach().to(torch::kCPU).contiguous();
      const size_t nbytes = cpu.nbytes();
      if (nbytes > 0 && std::fwrite(cpu.data_ptr(), 1, nbytes, file) != nbytes) return false;
    }
    return true;
  });
}

/// The same for a module's named_parameters() or named_buffers(), or a name-ordered map.
///   memopt::io::save_safetensors("model.safetensors", model->named_parameters());
template <class Tensor>
  requires std::same_as<Tensor, torch::Tensor>
inline void save_safetensors(const std::string& path, const torch::OrderedDict<std::string, Tensor>& tensors,
                             const std::map<std::string, std::string>& metadata = {}) {
  std::vector<std::pair<std::string, torch::Tensor>> items;
  items.reserve(tensors.size());
  for (const auto& item : tensors) items.emplace_back(item.key(), item.value());
  save_safetensors(path, items, metadata);
}

template <class Tensor>
  requires std::same_as<Tensor, torch::Tensor>
inline void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                             const std::map<std::string, std::string>& metadata = {}) {
  save_safetensors(path, std::vector<std::pair<std::string, torch::Tensor>>(tensors.begin(), tensors.end()),
                   metadata);
}

/// A read-only, memory-mapped safetensors file, validated on open. get() returns views
/// into the mapping that keep it alive; share one file between threads freely.
///   auto file = memopt::io::SafetensorsFile::open("model.safetensors");
///   torch::Tensor w = file->get("lm_head.weight");   // zero-copy, read-only
class SafetensorsFile : public std::enable_shared_from_this<SafetensorsFile> {
  struct Key {
    explicit Key() = default;
  };

 public:
  /// Opens, maps and validates `path` (see validate() for what is checked).
  ///   auto file = memopt::io::SafetensorsFile::open("model.safetensors");
  static std::shared_ptr<const SafetensorsFile> open(const std::string& path) {
    detail::check_little_endian("SafetensorsFile");
    return std::make_shared<const SafetensorsFile>(Key{}, path);
  }

  /// Validates the `size` bytes of a whole safetensors file at `bytes` (see validate() for
  /// what is checked) as open() does; `path` names it in errors. The fuzz target's entry point.
  ///   auto header = memopt::io::SafetensorsFile::parse_header(bytes, size, "model.safetensors");
  static SafetensorsHeader parse_header(const unsigned char* bytes, uint64_t size, const std::string& path) {
    TORCH_CHECK(size >= 8, where(path), " holds ", size, " bytes, fewer than the 8-byte header length. HINT: ",
                kCorruptHint);
    SafetensorsHeader header;
    validate(header, bytes, size, path);
    return header;
  }

  /// Use open(): views from get() need the file to be held by a shared_ptr.
  SafetensorsFile(Key, std::string path)
      : path_(std::move(path)),
        file_(path_, "memopt::io: ", "safetensors file",
              "check the path of the .safetensors file") {
    map_ = file_.data();
    header_ = parse_header(map_, static_cast<uint64_t>(file_.size()), path_);
  }

  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  /// The path the file was opened from.
  const std::string& path() const { return path_; }

  /// Tensor names in file order (by data offset; zero-size tensors at one offset by name).
  ///   for (const auto& name : file->names()) std::cout << name << "\n";
  const std::vector<std::string>& names() const { return header_.names; }

  /// Whether the file holds a tensor called `name`.   if (file->contains("lm_head.weight")) …
  bool contains(const std::string& name) const { return header_.infos.count(name) != 0; }

  /// The "__metadata__" strings (empty when the file has none).
  ///   std::string format = file->metadata().at("format");
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }

  /// Dtype, shape and byte range of `name`; an error naming the file when it is absent.
  ///   auto shape = file->info("lm_head.weight").shape;
  const TensorInfo& info(const std::string& name) const {
    auto it = header_.infos.find(name);
    TORCH_CHECK(it != header_.infos.end(), where(), " has no tensor named '", name, "' (it holds ",
                header_.names.size(), " tensors: ", detail::name_list(header_.names),
                "). HINT: list the names with names()");
    return it->second;
  }

  /// Tensor `name` on the CPU. By default a zero-copy view into the read-only mapping that
  /// keeps this file mapped for as long as the tensor lives: it must NOT be written in
  /// place (the process would get SIGSEGV); pass copy = true for a tensor of its own.
  /// A tensor whose address is not a multiple of its element size is always copied.
  ///   torch::Tensor w = file->get("lm_head.weight");            // view
  ///   torch::Tensor m = file->get("lm_head.weight", /*copy=*/true);  // writable
  torch::Tensor get(const std::string& name, bool copy = false) const {
    const TensorInfo& t = info(name);
    const unsigned char* src = data() + t.begin;
    const auto options = torch::TensorOptions().dtype(t.scalar_type);
    const auto element = static_cast<uintptr_t>(c10::elementSize(t.scalar_type));
    if (copy || reinterpret_cast<uintptr_t>(src) % element != 0) {
      torch::Tensor out = torch::empty(t.shape, options);
      if (t.nbytes() > 0) std::memcpy(out.data_ptr(), src, static_cast<size_t>(t.nbytes()));
      return out;
    }
    return torch::from_blob(const_cast<unsigned char*>(src), t.shape, [keep = shared_from_this()](void*) {},
                            options);
  }

  /// Drops bytes [from, to) of tensor `name` (by default all of it) from the process's resident
  /// set once they have been read (MappedFile::release: widened to whole 2 MiB blocks, so some
  /// neighbours' pages go too); views stay valid and read the file again when touched.
  /// load_state_dict() releases each slice it copies, so the mapping does not add to peak RSS.
  ///   file->release("lm_head.weight");
  void release(const std::string& name, int64_t from = 0, int64_t to = -1) const {
    const TensorInfo& t = info(name);
    const int64_t end = to < 0 ? t.nbytes() : std::min(to, t.nbytes());
    if (from < end) file_.release(static_cast<size_t>(data() - map_ + t.begin + from), static_cast<size_t>(end - from));
  }

 private:
  static constexpr const char* kCorruptHint =
      "the file is truncated, corrupt or not safetensors; save it again (memopt::io::save_safetensors, "
      "or safetensors.torch.save_file in Python)";

  static std::string where(const std::string& path) { return "memopt::io: safetensors file '" + path + "'"; }
  std::string where() const { return where(path_); }
  const unsigned char* data() const { return map_ + 8 + header_.header_bytes; }

  /// Header length, JSON, each entry's fields and the layout of the data section, of the
  /// `size` (>= 8) bytes at `bytes`; fills `out`.
  static void validate(SafetensorsHeader& out, const unsigned char* bytes, uint64_t size, const std::string& path) {
    uint64_t header_bytes = 0;
    std::memcpy(&header_bytes, bytes, 8);  // little-endian host
    TORCH_CHECK(header_bytes > 0, where(path), " has a header length of 0. HINT: ", kCorruptHint);
    TORCH_CHECK(header_bytes <= kMaxSafetensorsHeaderBytes, where(path), " claims a header of ", header_bytes,
                " bytes, more than the ", kMaxSafetensorsHeaderBytes, "-byte limit. HINT: ", kCorruptHint);
    TORCH_CHECK(header_bytes <= size - 8, where(path), " claims a header of ", header_bytes,
                " bytes but holds only ", size - 8, " after the length field. HINT: ", kCorruptHint);
    out.header_bytes = header_bytes;
    const uint64_t data_bytes = size - 8 - header_bytes;

    nlohmann::json header;
    const char* text = reinterpret_cast<const char*>(bytes + 8);
    try {
      header = nlohmann::json::parse(text, text + header_bytes);
    } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range for 1e400
      TORCH_CHECK(false, where(path), ": the header is not valid JSON (", e.what(), "). HINT: ", kCorruptHint);
    }
    TORCH_CHECK(header.is_object(), where(path), ": the header must be a JSON object (got ",
                detail::snippet(header), "). HINT: ", kCorruptHint);

    for (const auto& [name, entry] : header.items()) {
      if (name == "__metadata__") {
        read_metadata(out, entry, path);
      } else {
        out.infos.emplace(name, read_entry(name, entry, data_bytes, path));
      }
    }
    check_layout(out, data_bytes, path);
  }

  static void read_metadata(SafetensorsHeader& out, const nlohmann::json& entry, const std::string& path) {
    if (entry.is_null()) return;
    TORCH_CHECK(entry.is_object(), where(path), ": \"__metadata__\" must be an object of strings (got ",
                detail::snippet(entry), "). HINT: ", kCorruptHint);
    for (const auto& [key, value] : entry.items()) {
      TORCH_CHECK(value.is_string(), where(path), ": \"__metadata__\" entry '", key, "' must be a string (got ",
                  detail::snippet(value), "). HINT: metadata maps strings to strings");
      out.metadata.emplace(key, value.get<std::string>());
    }
  }

  static TensorInfo read_entry(const std::string& name, const nlohmann::json& entry, uint64_t data_bytes,
                               const std::string& path) {
    const std::string at = where(path) + ": tensor '" + name + "'";
    TORCH_CHECK(entry.is_object(), at, " must be an object with dtype, shape and data_offsets (got ",
                detail::snippet(entry), "). HINT: ", kCorruptHint);
    auto field = [&](const char* key) -> const nlohmann::json& {
      auto it = entry.find(key);
      TORCH_CHECK(it != entry.end(), at, " has no \"", key, "\" field (entry: ", detail::snippet(entry),
                  "). HINT: every tensor needs dtype, shape and data_offsets; ", kCorruptHint);
      return *it;
    };
    TensorInfo info;

    const nlohmann::json& dtype = field("dtype");
    TORCH_CHECK(dtype.is_string(), at, ": \"dtype\" must be a string (got ", detail::snippet(dtype), "). HINT: ",
                kCorruptHint);
    info.dtype = dtype.get<std::string>();
    const auto* type = detail::find_dtype(info.dtype);
    TORCH_CHECK(type != nullptr, at, " has dtype \"", info.dtype, "\", which memopt does not read (supported: ",
                detail::supported_dtypes(), "). HINT: convert the tensor to a supported dtype before saving");
    info.scalar_type = type->type;

    const nlohmann::json& shape = field("shape");
    TORCH_CHECK(shape.is_array(), at, ": \"shape\" must be an array of integers (got ", detail::snippet(shape),
                "). HINT: ", kCorruptHint);
    uint64_t numel = 1;
    bool overflow = false;
    for (size_t i = 0; i < shape.size(); ++i) {
      const auto& dim = shape[i];
      TORCH_CHECK(dim.is_number_unsigned(), at, ": \"shape\" ", detail::snippet(shape), " has ",
                  detail::snippet(dim), " at index ", i, "; every dimension must be a non-negative integer. HINT: ",
                  kCorruptHint);
      const uint64_t d = dim.get<uint64_t>();
      overflow |= d > static_cast<uint64_t>(INT64_MAX) || __builtin_mul_overflow(numel, d, &numel);
      info.shape.push_back(static_cast<int64_t>(d));
    }
    uint64_t expected = 0;
    overflow |= __builtin_mul_overflow(numel, static_cast<uint64_t>(type->size), &expected);
    TORCH_CHECK(!overflow && expected <= data_bytes, at, " has shape ", detail::snippet(shape), " of ",
                overflow ? "more than 2^64" : std::to_string(expected), " bytes, larger than the ", data_bytes,
                "-byte data section. HINT: ", kCorruptHint);

    const nlohmann::json& offsets = field("data_offsets");
    TORCH_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                    offsets[1].is_number_unsigned(),
                at, ": \"data_offsets\" must be two non-negative integers [begin, end] (got ",
                detail::snippet(offsets), "). HINT: ", kCorruptHint);
    const uint64_t begin = offsets[0].get<uint64_t>();
    const uint64_t end = offsets[1].get<uint64_t>();
    TORCH_CHECK(begin <= end, at, " has data_offsets ", detail::snippet(offsets),
                " with begin > end. HINT: ", kCorruptHint);
    TORCH_CHECK(end <= data_bytes, at, " has data_offsets ", detail::snippet(offsets),
                " reaching past the end of the ", data_bytes, "-byte data section. HINT: ", kCorruptHint);
    TORCH_CHECK(end - begin == expected, at, " has data_offsets ", detail::snippet(offsets), " spanning ",
                end - begin, " bytes, but dtype ", info.dtype, " and shape ", detail::snippet(shape), " need ",
                expected, ". HINT: ", kCorruptHint);
    info.begin = static_cast<int64_t>(begin);
    info.end = static_cast<int64_t>(end);
    return info;
  }

  /// The tensors must tile the data section: no overlap, no hole, nothing left over.
  static void check_layout(SafetensorsHeader& out, uint64_t data_bytes, const std::string& path) {
    auto& names = out.names;
    for (const auto& item : out.infos) names.push_back(item.first);
    std::stable_sort(names.begin(), names.end(), [&](const std::string& a, const std::string& b) {
      const auto &x = out.infos.at(a), &y = out.infos.at(b);
      return std::pair(x.begin, x.end) < std::pair(y.begin, y.end);
    });
    int64_t covered = 0;  // bytes [0, covered) belong to the tensors so far
    for (size_t i = 0; i < names.size(); ++i) {
      const TensorInfo& t = out.infos.at(names[i]);
      TORCH_CHECK(t.begin >= covered, where(path), ": tensors '", names[i - 1], "' and '", names[i],
                  "' overlap (bytes ", t.begin, "..", covered, " of the data section). HINT: ", kCorruptHint);
      TORCH_CHECK(t.begin == covered, where(path), ": bytes ", covered, "..", t.begin,
                  " of the data section belong to no tensor (a hole before '", names[i],
                  "'). HINT: ", kCorruptHint);
      covered = t.end;
    }
    TORCH_CHECK(static_cast<uint64_t>(covered) == data_bytes, where(path), ": bytes ", covered, "..", data_bytes,
                " of the data section belong to no tensor (trailing bytes after the last tensor). HINT: ",
                kCorruptHint);
  }

  std::string path_;
  memopt::detail::MappedFile file_;
  const unsigned char* map_ = nullptr;
  SafetensorsHeader header_;
};

/// Every tensor of `path`, copied (writable, independent of the file).
///   auto tensors = memopt::io::load_safetensors("w.safetensors");   // name -> tensor
inline std::map<std::string, torch::Tensor> load_safetensors(const std::string& path) {
  auto file = SafetensorsFile::open(path);
  std::map<std::string, torch::Tensor> out;
  for (const auto& name : file->names()) out.emplace(name, file->get(name, /*copy=*/true));
  return out;
}

}  // namespace memopt::io
