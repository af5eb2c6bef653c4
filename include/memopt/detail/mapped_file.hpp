// memopt/detail/mapped_file.hpp — not API. A whole regular file mapped read-only (private),
// unmapped on destruction: what TokenShard and SafetensorsFile read through. Errors name
// the file and what it was meant to be, and end with the caller's HINT. release() drops
// pages already read from the process's resident set (a checkpoint copied into a model).
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include <c10/util/Exception.h>

namespace memopt::detail {

class MappedFile {
 public:
  /// Maps `path`. `prefix` ("memopt::data: ") and `what` ("token shard") name it in errors;
  /// `open_hint` ends the message when it cannot be opened. An empty file maps to nothing.
  MappedFile(const std::string& path, const char* prefix, const char* what, const char* open_hint) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    TORCH_CHECK(fd >= 0, prefix, "cannot open ", what, " '", path, "' (", std::strerror(errno), "). HINT: ",
                open_hint);
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      TORCH_CHECK(false, prefix, what, " '", path, "' is not a readable regular file. HINT: ", open_hint);
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ == 0) {
      ::close(fd);
      return;
    }
    void* map = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    const int map_errno = errno;
    ::close(fd);
    TORCH_CHECK(map != MAP_FAILED, prefix, "cannot memory-map ", what, " '", path, "' (", std::strerror(map_errno),
                "). HINT: check that the file system supports mmap");
    data_ = static_cast<const unsigned char*>(map);
  }
  MappedFile(MappedFile&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile& operator=(MappedFile&&) = delete;
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
  }

  const unsigned char* data() const { return data_; }
  size_t size() const { return size_; }

  /// What release() drops at least: 2 MiB, the largest page-cache folio x86-64 maps at once. A
  /// read of one mapped byte can map its whole folio (or the 64 KiB fault-around window), pages
  /// before it included, so a release of just the bytes read would leave those mapped.
  static constexpr size_t kReleaseBlock = size_t{2} << 20;

  /// Drops the pages holding bytes [offset, offset + length), widened to whole kReleaseBlock
  /// blocks of the file, from the process's resident set (madvise MADV_DONTNEED). The mapping is
  /// read-only and private, so no byte changes: a page touched again is read back from the file
  /// (the page cache).
  void release(size_t offset, size_t length) const {
    if (data_ == nullptr || length == 0 || offset >= size_) return;
    const size_t begin = offset / kReleaseBlock * kReleaseBlock;
    const size_t end = std::min(size_, (offset + length + kReleaseBlock - 1) / kReleaseBlock * kReleaseBlock);
    ::madvise(const_cast<unsigned char*>(data_) + begin, end - begin, MADV_DONTNEED);  // advice: failure is harmless
  }

 private:
  const unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace memopt::detail
