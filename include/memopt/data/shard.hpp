// memopt/data/shard.hpp — token shards: a flat file of token ids with a 64-byte header,
// written once (atomically) by write_shard(), or streamed by ShardWriter, and read through a
// read-only memory map by TokenShard, so a training run touches only the windows it
// samples. Every file is validated on open (magic, version, width, length, token ids <
// vocab) and each error names the file, the value seen and what to do about it.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include <torch/torch.h>

#include "memopt/detail/mapped_file.hpp"

namespace memopt::data {

// ---- file format (little-endian) ----------------------------------------------------
// offset  size  field
//      0     8  magic "MEMOPTTK"
//      8     4  u32 version (= 1)
//     12     4  u32 bytes_per_token (2: uint16 ids, 4: uint32 ids)
//     16     8  u64 token count
//     24     8  u64 vocab_size (every id is < vocab_size)
//     32    32  zero
//     64     …  count ids, bytes_per_token each
inline constexpr char kShardMagic[8] = {'M', 'E', 'M', 'O', 'P', 'T', 'T', 'K'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr int64_t kShardHeaderBytes = 64;

namespace detail {

/// What to do when a shard is bad; names the tools that rebuild the bundled corpus.
inline constexpr const char* kRebuildShardHint =
    "rebuild the shard (for data/kjv: re-run scripts/demo, or "
    "memopt_prepare_corpus --force)";

template <class T>
inline void store_le(unsigned char* dst, T value) {
  for (size_t b = 0; b < sizeof(T); ++b) dst[b] = static_cast<unsigned char>(value >> (8 * b));
}

template <class T>
inline T load_le(const unsigned char* src) {
  T value;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(&value, src, sizeof(T));
  } else {
    value = 0;
    for (size_t b = 0; b < sizeof(T); ++b) value |= static_cast<T>(src[b]) << (8 * b);
  }
  return value;
}

/// Bytes as text, non-printable ones as \xNN (for error messages).
inline std::string printable(const unsigned char* bytes, size_t n) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = bytes[i];
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

/// Copies `len` ids of width T starting at `src` into int64 `dst`.
template <class T>
inline void widen_le(const unsigned char* src, int64_t len, int64_t* dst) {
  if constexpr (std::endian::native == std::endian::little) {
    const T* typed = reinterpret_cast<const T*>(src);  // the map is page-aligned; 64 | header
    std::copy(typed, typed + len, dst);
  } else {
    for (int64_t i = 0; i < len; ++i) dst[i] = load_le<T>(src + i * sizeof(T));
  }
}

}  // namespace detail

/// The bytes of a shard holding `tokens` (header + ids). `name` only labels errors.
/// Ids are stored as uint16 when vocab_size <= 65536, else as uint32.
inline std::vector<unsigned char> encode_shard(const std::string& name, const std::vector<int32_t>& tokens,
                                               int64_t vocab_size) {
  TORCH_CHECK(vocab_size >= 1 && vocab_size <= (int64_t{1} << 32),
              "memopt::data: shard '", name, "': vocab_size must be in [1, 2^32] (got ",
              vocab_size, "). HINT: pass the tokenizer's vocab_size()");
  for (size_t i = 0; i < tokens.size(); ++i) {
    TORCH_CHECK(tokens[i] >= 0 && tokens[i] < vocab_size, "memopt::data: shard '", name,
                "': token id ", tokens[i], " at position ", i, " is outside [0, vocab_size ",
                vocab_size, "). HINT: encode with the tokenizer whose vocab_size you pass");
  }
  const uint32_t width = vocab_size <= 65536 ? 2 : 4;
  const size_t count = tokens.size();
  std::vector<unsigned char> bytes(static_cast<size_t>(kShardHeaderBytes) + count * width, 0);
  std::memcpy(bytes.data(), kShardMagic, sizeof(kShardMagic));
  detail::store_le<uint32_t>(bytes.data() + 8, kShardVersion);
  detail::store_le<uint32_t>(bytes.data() + 12, width);
  detail::store_le<uint64_t>(bytes.data() + 16, count);
  detail::store_le<uint64_t>(bytes.data() + 24, static_cast<uint64_t>(vocab_size));
  unsigned char* body = bytes.data() + kShardHeaderBytes;
  for (size_t i = 0; i < count; ++i) {
    if (width == 2) {
      detail::store_le<uint16_t>(body + 2 * i, static_cast<uint16_t>(tokens[i]));
    } else {
      detail::store_le<uint32_t>(body + 4 * i, static_cast<uint32_t>(tokens[i]));
    }
  }
  return bytes;
}

/// Writes `tokens` as a shard at `path` (via `path + ".tmp"`, then an atomic rename).
///   memopt::data::write_shard("data/kjv/train.bin", ids, tokenizer.vocab_size());
inline void write_shard(const std::string& path, const std::vector<int32_t>& tokens,
                        int64_t vocab_size) {
  const std::vector<unsigned char> bytes = encode_shard(path, tokens, vocab_size);
  const std::string tmp = path + ".tmp";
  std::FILE* file = std::fopen(tmp.c_str(), "wb");
  TORCH_CHECK(file != nullptr, "memopt::data: cannot create '", tmp, "' (",
              std::strerror(errno), "). HINT: check that the directory exists and is writable");
  const bool wrote = std::fwrite(bytes.data(), 1, bytes.size(), file) == bytes.size();
  const bool closed = std::fclose(file) == 0;
  if (!wrote || !closed) {
    std::remove(tmp.c_str());
    TORCH_CHECK(false, "memopt::data: writing '", tmp, "' failed after ", bytes.size(),
                " bytes were asked for. HINT: check free disk space");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) std::remove(tmp.c_str());
  TORCH_CHECK(!ec, "memopt::data: cannot rename '", tmp, "' to '", path, "' (", ec.message(),
              "). HINT: check that '", path, "' is not a directory and is writable");
}

/// Streams token ids into a shard at `path` without holding them: the ids go to
/// `path + ".tmp"` as they come (uint16 when vocab_size <= 65536, else uint32, as
/// encode_shard writes them); close() writes the count into the header, syncs the file and
/// renames it into place, so a reader finds the whole shard or none. Destroyed without
/// close() (an error, an exception unwinding), it removes the .tmp.
///   memopt::data::ShardWriter out("corpus/shard-00000.bin", tokenizer.vocab_size());
///   out.append(tokenizer.encode("The jury said."));   // any number of times
///   out.close();                                      // now corpus/shard-00000.bin exists
class ShardWriter {
 public:
  ShardWriter(std::string path, int64_t vocab_size) : path_(std::move(path)), tmp_(path_ + ".tmp"), vocab_size_(vocab_size) {
    TORCH_CHECK(vocab_size >= 1 && vocab_size <= (int64_t{1} << 32), "memopt::data::ShardWriter: shard '", path_,
                "': vocab_size must be in [1, 2^32] (got ", vocab_size, "). HINT: pass the tokenizer's vocab_size()");
    width_ = vocab_size <= 65536 ? 2 : 4;
    file_ = std::fopen(tmp_.c_str(), "wb");
    TORCH_CHECK(file_ != nullptr, "memopt::data::ShardWriter: cannot create '", tmp_, "' (", std::strerror(errno),
                "). HINT: check that the directory exists and is writable");
    std::setvbuf(file_, nullptr, _IOFBF, size_t{1} << 20);
    unsigned char header[kShardHeaderBytes];
    fill_header(header);  // count 0 until close()
    write(header, sizeof(header));
  }

  ~ShardWriter() { discard(); }
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  /// Appends `ids` (each in [0, vocab_size)); a bad id is an error and nothing of `ids` is written.
  void append(std::span<const int32_t> ids) {
    check_open("append to");
    for (size_t i = 0; i < ids.size(); ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < vocab_size_, "memopt::data::ShardWriter: shard '", path_, "': token id ",
                  ids[i], " at position ", count_ + static_cast<int64_t>(i), " is outside [0, vocab_size ", vocab_size_,
                  "). HINT: encode with the tokenizer whose vocab_size you pass");
    }
    buffer_.resize(ids.size() * width_);
    for (size_t i = 0; i < ids.size(); ++i) {
      if (width_ == 2) {
        detail::store_le<uint16_t>(buffer_.data() + 2 * i, static_cast<uint16_t>(ids[i]));
      } else {
        detail::store_le<uint32_t>(buffer_.data() + 4 * i, static_cast<uint32_t>(ids[i]));
      }
    }
    write(buffer_.data(), buffer_.size());
    count_ += static_cast<int64_t>(ids.size());
  }
  void append(const std::vector<int32_t>& ids) { append(std::span<const int32_t>(ids)); }

  /// Writes the count into the header, syncs the file and renames it to path(); the shard
  /// is complete when this returns. Nothing may be appended afterwards.
  void close() {
    check_open("close");
    unsigned char header[kShardHeaderBytes];
    fill_header(header);
    if (std::fflush(file_) != 0 || ::fseeko(file_, 0, SEEK_SET) != 0) fail("writing");
    write(header, sizeof(header));
    if (std::fflush(file_) != 0) fail("writing");
    if (::fsync(::fileno(file_)) != 0) fail("syncing");
    const bool closed = std::fclose(file_) == 0;
    file_ = nullptr;
    if (!closed) fail("closing");
    std::error_code ec;
    std::filesystem::rename(tmp_, path_, ec);
    if (ec) std::remove(tmp_.c_str());
    TORCH_CHECK(!ec, "memopt::data::ShardWriter: cannot rename '", tmp_, "' to '", path_, "' (", ec.message(),
                "). HINT: check that '", path_, "' is not a directory and is writable");
    closed_ = true;
    // The rename is durable once the directory is synced (best effort: some file systems refuse).
    std::string dir = std::filesystem::path(path_).parent_path().string();
    const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
      ::fsync(fd);
      ::close(fd);
    }
  }

  /// Ids appended so far.
  int64_t size() const { return count_; }
  /// 2 (uint16) or 4 (uint32), from vocab_size.
  int64_t bytes_per_token() const { return static_cast<int64_t>(width_); }
  int64_t vocab_size() const { return vocab_size_; }
  /// The shard's final path (the ids go to path() + ".tmp" until close()).
  const std::string& path() const { return path_; }
  /// Whether close() has completed.
  bool closed() const { return closed_; }

 private:
  void fill_header(unsigned char* header) const {
    std::memset(header, 0, kShardHeaderBytes);
    std::memcpy(header, kShardMagic, sizeof(kShardMagic));
    detail::store_le<uint32_t>(header + 8, kShardVersion);
    detail::store_le<uint32_t>(header + 12, static_cast<uint32_t>(width_));
    detail::store_le<uint64_t>(header + 16, static_cast<uint64_t>(count_));
    detail::store_le<uint64_t>(header + 24, static_cast<uint64_t>(vocab_size_));
  }

  void check_open(const char* what) const {
    TORCH_CHECK(file_ != nullptr, "memopt::data::ShardWriter: cannot ", what, " shard '", path_, "': it is ",
                closed_ ? "closed" : "discarded after a failed write", ". HINT: open a new ShardWriter");
  }

  void write(const unsigned char* bytes, size_t n) {
    if (n > 0 && std::fwrite(bytes, 1, n, file_) != n) fail("writing");
  }

  // Removes the .tmp and reports what failed.
  [[noreturn]] void fail(const char* what) {
    const std::string reason = std::strerror(errno);
    discard();
    TORCH_CHECK(false, "memopt::data::ShardWriter: ", what, " '", tmp_, "' failed after ", count_, " tokens (", reason,
                "). HINT: check free disk space and that the directory is writable");
  }

  void discard() noexcept {
    if (file_ != nullptr) std::fclose(file_);
    file_ = nullptr;
    if (!closed_) std::remove(tmp_.c_str());
  }

  std::string path_, tmp_;
  int64_t vocab_size_ = 0;
  size_t width_ = 2;
  std::FILE* file_ = nullptr;
  int64_t count_ = 0;
  bool closed_ = false;
  std::vector<unsigned char> buffer_;
};

/// What a shard's 64-byte header says.
struct ShardHeader {
  int64_t bytes_per_token = 0;  // 2 or 4
  int64_t tokens = 0;           // ids after the header
  int64_t vocab_size = 0;       // every id is < vocab_size
};

/// Parses and checks the header of a shard of `file_bytes` bytes whose first
/// min(file_bytes, 64) bytes are at `bytes`: magic, version, width, a token count that
/// matches the file size exactly, vocab_size in [1, 2^32]. Each failure names `name`, the
/// value seen and how to rebuild. A pure function (the fuzz target fuzz/shard_header_fuzz.cpp).
///   auto header = memopt::data::parse_shard_header(first64, file_size, "train.bin");
inline ShardHeader parse_shard_header(const unsigned char* bytes, int64_t file_bytes, const std::string& name) {
  TORCH_CHECK(file_bytes >= kShardHeaderBytes, "memopt::data: token shard '", name, "' holds ", file_bytes,
              " bytes, fewer than its ", kShardHeaderBytes, "-byte header. HINT: ", detail::kRebuildShardHint);
  TORCH_CHECK(std::memcmp(bytes, kShardMagic, sizeof(kShardMagic)) == 0,
              "memopt::data: '", name, "' is not a memopt token shard (magic '",
              detail::printable(bytes, sizeof(kShardMagic)), "', expected 'MEMOPTTK'). HINT: ",
              detail::kRebuildShardHint);
  const uint32_t version = detail::load_le<uint32_t>(bytes + 8);
  TORCH_CHECK(version == kShardVersion, "memopt::data: token shard '", name,
              "' has format version ", version, ", this memopt reads version ", kShardVersion,
              ". HINT: ", detail::kRebuildShardHint, " with this version of memopt");
  const uint32_t width = detail::load_le<uint32_t>(bytes + 12);
  TORCH_CHECK(width == 2 || width == 4, "memopt::data: token shard '", name,
              "' has bytes_per_token ", width, " (expected 2 or 4). HINT: ", detail::kRebuildShardHint);
  const uint64_t count = detail::load_le<uint64_t>(bytes + 16);
  const uint64_t body_bytes = static_cast<uint64_t>(file_bytes - kShardHeaderBytes);
  TORCH_CHECK(count <= body_bytes / width && count * width == body_bytes,
              "memopt::data: token shard '", name, "' is ", file_bytes,
              " bytes but its header promises ", count, " tokens of ", width, " bytes (",
              kShardHeaderBytes, " + ", count, " * ", width,
              " bytes): the file is truncated or corrupt. HINT: ", detail::kRebuildShardHint);
  const uint64_t vocab = detail::load_le<uint64_t>(bytes + 24);
  TORCH_CHECK(vocab >= 1 && vocab <= (uint64_t{1} << 32), "memopt::data: token shard '", name,
              "' has vocab_size ", vocab, " (expected 1 .. 2^32). HINT: ", detail::kRebuildShardHint);
  return {static_cast<int64_t>(width), static_cast<int64_t>(count), static_cast<int64_t>(vocab)};
}

/// A read-only, memory-mapped token shard, validated on open. Share it between loaders.
///   auto shard = memopt::data::TokenShard::open("data/kjv/train.bin");
///   torch::Tensor ids = shard->window(0, 129);   // (129,) int64
class TokenShard {
 public:
  /// Opens and validates `path` (header, length, every id < vocab_size).
  ///   auto shard = memopt::data::TokenShard::open("data/kjv/val.bin");
  static std::shared_ptr<const TokenShard> open(const std::string& path) {
    return std::make_shared<const TokenShard>(path);
  }

  /// A shard held in memory: text tokenized on the fly, no file. `name` labels errors.
  ///   auto shard = memopt::data::TokenShard::from_tokens("train.txt", ids, tokenizer.vocab_size());
  static std::shared_ptr<const TokenShard> from_tokens(std::string name, const std::vector<int32_t>& tokens,
                                                       int64_t vocab_size) {
    std::vector<unsigned char> bytes = encode_shard(name, tokens, vocab_size);
    return std::make_shared<const TokenShard>(std::move(name), std::move(bytes));
  }

  /// Adopts the bytes of a shard (as encode_shard makes them) and validates them.
  TokenShard(std::string name, std::vector<unsigned char> bytes)
      : path_(std::move(name)), owned_(std::move(bytes)) {
    bytes_ = static_cast<int64_t>(owned_.size());
    TORCH_CHECK(bytes_ >= kShardHeaderBytes, "memopt::data: token shard '", path_, "' holds ", bytes_,
                " bytes, fewer than its ", kShardHeaderBytes, "-byte header. HINT: build it with encode_shard");
    map_ = owned_.data();
    validate();
  }

  explicit TokenShard(std::string path) : path_(std::move(path)) {
    file_.emplace(path_, "memopt::data: ", "token shard",
                  "check the path; for data/kjv run scripts/fetch_corpus, then memopt_prepare_corpus (or scripts/demo)");
    bytes_ = static_cast<int64_t>(file_->size());
    TORCH_CHECK(bytes_ >= kShardHeaderBytes, "memopt::data: token shard '", path_, "' holds ", bytes_,
                " bytes, fewer than its ", kShardHeaderBytes, "-byte header. HINT: ", detail::kRebuildShardHint);
    map_ = file_->data();
    validate();
  }

  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;
  ~TokenShard() = default;

  /// Number of tokens.   int64_t n = shard->size();
  int64_t size() const { return size_; }
  /// The vocab_size recorded by the writer (every id is below it).
  int64_t vocab_size() const { return vocab_size_; }
  /// The largest id present (-1 for an empty shard).
  int64_t max_token_id() const { return max_token_id_; }
  /// 2 (uint16) or 4 (uint32).
  int64_t bytes_per_token() const { return width_; }
  /// The path the shard was opened from.
  const std::string& path() const { return path_; }

  /// The id at position i.   int64_t first = shard->at(0);
  int64_t at(int64_t i) const {
    TORCH_CHECK(i >= 0 && i < size_, "memopt::data: index ", i, " is outside token shard '",
                path_, "' of ", size_, " tokens. HINT: use an index in [0, size())");
    const unsigned char* p = body() + i * width_;
    return width_ == 2 ? int64_t{detail::load_le<uint16_t>(p)}
                       : int64_t{detail::load_le<uint32_t>(p)};
  }

  /// Copies ids [start, start+len) into `dst` (len int64 values), without bounds slack.
  ///   shard->copy_to(0, 129, row.data_ptr<int64_t>());
  void copy_to(int64_t start, int64_t len, int64_t* dst) const {
    check_range(start, len);
    if (width_ == 2) {
      detail::widen_le<uint16_t>(body() + start * 2, len, dst);
    } else {
      detail::widen_le<uint32_t>(body() + start * 4, len, dst);
    }
  }

  /// Ids [start, start+len) as a fresh (len,) int64 tensor.
  ///   torch::Tensor w = shard->window(1000, 257);
  torch::Tensor window(int64_t start, int64_t len) const {
    check_range(start, len);
    torch::Tensor out = torch::empty({len}, torch::kLong);  // (len,)
    copy_to(start, len, out.data_ptr<int64_t>());
    return out;
  }

  /// Fails unless a model with `model_vocab` embeddings can take every id of this shard.
  ///   shard->check_vocab(model_options.vocab_size());
  void check_vocab(int64_t model_vocab) const {
    if (vocab_size_ <= model_vocab) return;
    const std::string detail =
        max_token_id_ >= model_vocab
            ? c10::str("token id ", max_token_id_, " >= model vocab ", model_vocab)
            : c10::str("its largest token id is ", max_token_id_);
    TORCH_CHECK(false, "memopt::data: token shard '", path_, "' was written for vocab_size ",
                vocab_size_, " but the model has vocab ", model_vocab, " (", detail,
                "). HINT: build the model with vocab_size >= ", vocab_size_,
                " (the tokenizer's vocab_size()), or re-encode the data with the model's "
                "tokenizer");
  }

 private:
  const unsigned char* body() const { return map_ + kShardHeaderBytes; }

  void check_range(int64_t start, int64_t len) const {
    TORCH_CHECK(start >= 0 && len >= 0 && start <= size_ - len, "memopt::data: window [", start,
                ", ", start, "+", len, ") is outside token shard '", path_, "' of ", size_,
                " tokens. HINT: keep start >= 0 and start + len <= size()");
  }

  void validate() {
    const ShardHeader header = parse_shard_header(map_, bytes_, path_);
    width_ = header.bytes_per_token;
    size_ = header.tokens;
    vocab_size_ = header.vocab_size;

    // One pass over the ids: the first one >= vocab_size is an error, the largest is kept.
    int64_t max_id = -1;
    for (int64_t i = 0; i < size_; ++i) {
      const unsigned char* p = body() + i * width_;
      const int64_t id = width_ == 2 ? int64_t{detail::load_le<uint16_t>(p)}
                                     : int64_t{detail::load_le<uint32_t>(p)};
      if (id >= vocab_size_) {
        TORCH_CHECK(false, "memopt::data: token shard '", path_, "' holds token id ", id,
                    " at position ", i, ", >= its vocab_size ", vocab_size_,
                    ". HINT: the file is corrupt or was written with the wrong vocab_size; ",
                    detail::kRebuildShardHint);
      }
      max_id = std::max(max_id, id);
    }
    max_token_id_ = max_id;
  }

  std::string path_;
  std::optional<memopt::detail::MappedFile> file_;  // open(): the mapping
  std::vector<unsigned char> owned_;        // from_tokens(): the bytes
  const unsigned char* map_ = nullptr;
  int64_t bytes_ = 0;
  int64_t width_ = 0;
  int64_t size_ = 0;
  int64_t vocab_size_ = 0;
  int64_t max_token_id_ = -1;
};

}  // namespace memopt::data
