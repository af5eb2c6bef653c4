// memopt/dist/shard_file.hpp — dist::ShardFile: a rank's ZeRO-3 parameter shards on disk
// (TrainerOptions::offload_params_dir), as ZeRO-Infinity keeps them on NVMe. One scratch file per
// rank, sized up front (4 bytes per shard element, whatever the dtype, page-aligned regions),
// mapped shared and read-write: a shard is an ordinary tensor over its region, so the all-gather
// reads it and the optimizer steps it in place. will_need() asks the kernel to read a region
// ahead (madvise WILLNEED: asynchronous); release() drops its pages from the process's memory
// (MADV_DONTNEED: a shared mapping keeps every byte, in the page cache or the file), so between
// uses the shards cost no resident memory and the kernel writes them out as memory runs short.
// The file is removed when the Trainer ends: checkpoints hold the weights.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

#include <torch/torch.h>

namespace memopt::dist {

class ShardFile {
 public:
  static constexpr int64_t kPage = 4096;

  /// The bytes a region of `numel` shard elements takes (any dtype up to 4 bytes), page-aligned.
  static int64_t region_bytes(int64_t numel) { return (numel * 4 + kPage - 1) / kPage * kPage; }

  /// Creates `dir`/params-rank<rank>.bin of `bytes` bytes (sparse) and maps it.
  ShardFile(const std::string& dir, int rank, int64_t bytes) : size_(static_cast<size_t>(bytes)) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    path_ = (std::filesystem::path(dir) / ("params-rank" + std::to_string(rank) + ".bin")).string();
    const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    TORCH_CHECK(fd >= 0, "memopt::dist::ShardFile: cannot create the parameter shard file '", path_, "' (",
                std::strerror(errno), "). HINT: point offload_params_dir (--offload_params_dir) at a writable folder");
    if (::ftruncate(fd, static_cast<off_t>(size_)) != 0) {
      const int err = errno;
      ::close(fd);
      TORCH_CHECK(false, "memopt::dist::ShardFile: cannot size '", path_, "' to ", bytes, " bytes (",
                  std::strerror(err), "). HINT: the offload folder needs that much free space");
    }
    void* map = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int map_errno = errno;
    ::close(fd);
    TORCH_CHECK(map != MAP_FAILED, "memopt::dist::ShardFile: cannot map '", path_, "' (", std::strerror(map_errno),
                "). HINT: the offload folder's file system must support shared mmap");
    data_ = static_cast<unsigned char*>(map);
  }
  ShardFile(const ShardFile&) = delete;
  ShardFile& operator=(const ShardFile&) = delete;
  ~ShardFile() {
    if (data_ != nullptr) ::munmap(data_, size_);
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }

  int64_t bytes() const { return static_cast<int64_t>(size_); }

  /// A tensor of `numel` elements of `dtype` over the region at `offset` (not owned: the file's).
  torch::Tensor tensor(int64_t offset, int64_t numel, c10::ScalarType dtype) const {
    TORCH_CHECK(offset >= 0 && offset + numel * static_cast<int64_t>(c10::elementSize(dtype)) <= bytes(),
                "memopt::dist::ShardFile: region [", offset, ", +", numel, " elements) is outside '", path_, "' (",
                bytes(), " bytes). HINT: this is a bug in the caller's layout");
    return torch::from_blob(data_ + offset, {numel}, torch::TensorOptions().dtype(dtype));
  }
  /// Whether `t`'s memory is in this file.
  bool holds(const torch::Tensor& t) const {
    const auto* p = static_cast<const unsigned char*>(t.data_ptr());
    return p >= data_ && p < data_ + size_;
  }

  void will_need(const torch::Tensor& t) const { advise(t, MADV_WILLNEED); }
  void release(const torch::Tensor& t) const { advise(t, MADV_DONTNEED); }

 private:
  // Advice on the whole pages `t` lies in (advice: a failure changes nothing but speed).
  void advise(const torch::Tensor& t, int advice) const {
    if (!holds(t)) return;
    const auto begin = static_cast<size_t>(static_cast<const unsigned char*>(t.data_ptr()) - data_) /
                       static_cast<size_t>(kPage) * static_cast<size_t>(kPage);
    const size_t end = static_cast<size_t>(static_cast<const unsigned char*>(t.data_ptr()) - data_) + t.nbytes();
    ::madvise(data_ + begin, end - begin, advice);
  }

  std::string path_;
  unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace memopt::dist
