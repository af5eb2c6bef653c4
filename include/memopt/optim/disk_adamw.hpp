// memopt/optim/disk_adamw.hpp — AdamW whose state (exp_avg, exp_avg_sq: 8 B/param) lives in
// a file, not in RAM: the step streams it through three chunk buffers, reading the next
// chunk and writing the previous one on I/O threads while the current one updates
// (DeepSpeed ZeRO-Infinity's NVMe offload of optimizer state, for CPU training). The
// resident set holds 3 chunks of state instead of all of it.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace memopt::optim {

/// Where and how DiskAdamW keeps its state.
///   memopt::optim::DiskAdamWOptions().directory("/mnt/nvme").chunk_elements(1 << 20)
struct DiskAdamWOptions {
  /// Folder of the state file; "" means $MEMOPT_OFFLOAD_DIR, else the system temp folder.
  /// The file is unlinked as soon as it is open: nothing is left behind, even after a crash.
  TORCH_ARG(std::string, directory) = "";
  /// Parameter elements per chunk; a chunk of state is 8 B × this (8 MiB by default).
  TORCH_ARG(int64_t, chunk_elements) = int64_t{1} << 20;
};

/// AdamW with LibTorch's exact update (decoupled weight decay, bias correction, eps after
/// the square root), its state in a file. CPU parameters only (the state is read into
/// host buffers; for CUDA training use state::PinnedHost).
///   memopt::optim::DiskAdamW opt(memopt::optim::single_group(params, adamw), adamw, {});
class DiskAdamW : public torch::optim::Optimizer {
 public:
  DiskAdamW(std::vector<torch::optim::OptimizerParamGroup> groups, const torch::optim::AdamWOptions& defaults,
            DiskAdamWOptions disk = {})
      : torch::optim::Optimizer(std::move(groups), std::make_unique<torch::optim::AdamWOptions>(defaults)),
        disk_(disk) {
    TORCH_CHECK(disk_.chunk_elements() >= 1, "memopt::optim::DiskAdamW: chunk_elements must be >= 1 (got ",
                disk_.chunk_elements(), "). HINT: 1 << 20 elements (8 MiB of state) per chunk.");
    int64_t offset = 0;
    for (auto& group : param_groups())
      for (auto& p : group.params()) {
        TORCH_CHECK(p.device().is_cpu() && p.scalar_type() == torch::kFloat && p.is_contiguous(),
                    "memopt::optim::DiskAdamW: parameters must be contiguous fp32 CPU tensors (got ", p.scalar_type(),
                    " on ", p.device(), "). HINT: for CUDA training use state::PinnedHost; for bf16 weights "
                    "use precision::Bf16Pure, whose fp32 masters the optimizer owns.");
        file_offset_.push_back(offset);
        steps_.push_back(0);
        offset += 2 * p.numel() * static_cast<int64_t>(sizeof(float));
      }
    file_bytes_ = offset;
    open_state_file();
    const int64_t chunk = std::min<int64_t>(disk_.chunk_elements(), std::max<int64_t>(1, max_numel()));
    for (auto& slot : slots_) slot.buf = torch::empty({2, chunk}, torch::kFloat);  // exp_avg, exp_avg_sq rows
  }

  ~DiskAdamW() override {
    for (auto& slot : slots_)
      if (slot.write.valid()) slot.write.wait();
    if (fd_ >= 0) ::close(fd_);
  }
  DiskAdamW(const DiskAdamW&) = delete;
  DiskAdamW& operator=(const DiskAdamW&) = delete;

  torch::Tensor step(LossClosure closure = nullptr) override {
    torch::NoGradGuard no_grad;
    torch::Tensor loss;
    if (closure) {
      torch::AutoGradMode enable_grad(true);
      loss = closure();
    }
    // ---- the work: every chunk of every parameter with a gradient, in file order ----
    std::vector<Item> items;
    size_t index = 0;
    for (size_t g = 0; g < param_groups().size(); ++g)
      for (auto& p : param_groups()[g].params()) {
        if (p.grad().defined()) {
          steps_[index] += 1;
          for (int64_t off = 0; off < p.numel(); off += chunk())
            items.push_back({g, index, p, off, std::min(chunk(), p.numel() - off)});
        }
        ++index;
      }
    if (items.empty()) return loss;

    // ---- pipeline: read item i+1 and write item i-1 while item i updates ----
    std::future<void> reading = read_async(items[0], slots_[0]);
    for (size_t i = 0; i < items.size(); ++i) {
      Slot& slot = slots_[i % 3];
      reading.get();  // item i's state is in slot
      if (i + 1 < items.size()) {
        Slot& next = slots_[(i + 1) % 3];
        if (next.write.valid()) next.write.get();  // item i-2 is on disk: its slot is free
        reading = read_async(items[i + 1], next);
      }
      update(items[i], slot);
      slot.write = write_async(items[i], slot);
    }
    for (auto& slot : slots_)
      if (slot.write.valid()) slot.write.get();  // every error surfaces here, in step()
    return loss;
  }

  /// Bytes of optimizer state in the file (2 × 4 B per parameter element).
  int64_t state_bytes_on_disk() const { return file_bytes_; }
  /// Bytes of state buffers in RAM (3 chunks).
  int64_t resident_state_bytes() const {
    int64_t n = 0;
    for (const auto& slot : slots_) n += slot.buf.nbytes();
    return n;
  }
  const std::string& path() const { return path_; }

  void save(torch::serialize::OutputArchive& archive) const override {
    size_t index = 0;
    for (const auto& group : param_groups())
      for (const auto& p : group.params()) {
        auto state = torch::empty({2, p.numel()}, torch::kFloat);
        read_exact(state.data_ptr<float>(), state.nbytes(), file_offset_[index]);
        archive.write("state_" + std::to_string(index), state);
        archive.write("step_" + std::to_string(index), torch::tensor(steps_[index]));
        ++index;
      }
  }
  void load(torch::serialize::InputArchive& archive) override {
    size_t index = 0;
    for (const auto& group : param_groups())
      for (const auto& p : group.params()) {
        torch::Tensor state, step;
        archive.read("state_" + std::to_string(index), state);
        archive.read("step_" + std::to_string(index), step);
        TORCH_CHECK(state.numel() == 2 * p.numel(), "memopt::optim::DiskAdamW: saved state ", index, " has ",
                    state.numel(), " values, the parameter needs ", 2 * p.numel(),
                    ". HINT: load a state saved by a DiskAdamW over the same parameters.");
        state = state.to(torch::kFloat).contiguous();
        write_exact(state.data_ptr<float>(), state.nbytes(), file_offset_[index]);
        steps_[index] = step.item<int64_t>();
        ++index;
      }
  }

 private:
  struct Item {
    size_t group;
    size_t index;     // the parameter's position in the file
    torch::Tensor param;
    int64_t offset;   // first element of the chunk
    int64_t count;    // elements in the chunk
  };
  struct Slot {
    torch::Tensor buf;  // (2, chunk) fp32
    std::future<void> write;
  };

  int64_t chunk() const { return slots_[0].buf.size(1); }

  int64_t max_numel() const {
    int64_t n = 0;
    for (const auto& group : param_groups())
      for (const auto& p : group.params()) n = std::max(n, p.numel());
    return n;
  }

  // exp_avg of element e of parameter i sits at file_offset_[i] + 4e, its exp_avg_sq 4·numel further.
  int64_t avg_at(const Item& it) const { return file_offset_[it.index] + it.offset * 4; }
  int64_t sq_at(const Item& it) const { return file_offset_[it.index] + (it.param.numel() + it.offset) * 4; }

  std::future<void> read_async(const Item& it, Slot& slot) const {
    float* avg = slot.buf[0].data_ptr<float>();
    float* sq = slot.buf[1].data_ptr<float>();
    const int64_t bytes = it.count * 4, a = avg_at(it), s = sq_at(it);
    return std::async(std::launch::async, [this, avg, sq, bytes, a, s] {
      read_exact(avg, bytes, a);
      read_exact(sq, bytes, s);
    });
  }

  std::future<void> write_async(const Item& it, Slot& slot) const {
    const float* avg = slot.buf[0].data_ptr<float>();
    const float* sq = slot.buf[1].data_ptr<float>();
    const int64_t bytes = it.count * 4, a = avg_at(it), s = sq_at(it);
    return std::async(std::launch::async, [this, avg, sq, bytes, a, s] {
      write_exact(avg, bytes, a);
      write_exact(sq, bytes, s);
      // Written pages need not stay cached: advise the kernel to drop them once clean.
      ::posix_fadvise(fd_, a, bytes, POSIX_FADV_DONTNEED);
      ::posix_fadvise(fd_, s, bytes, POSIX_FADV_DONTNEED);
    });
  }

  // LibTorch's AdamW update on one chunk.
  void update(const Item& it, Slot& slot) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(param_groups()[it.group].options());
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    TORCH_CHECK(!o.amsgrad(), "memopt::optim::DiskAdamW: amsgrad is not supported (got amsgrad true). "
                              "HINT: AdamWOptions().amsgrad(false).");
    const int64_t step = steps_[it.index];
    auto p = it.param.view(-1).narrow(0, it.offset, it.count);                                   // (n)
    auto g = it.param.grad().reshape(-1).narrow(0, it.offset, it.count).to(torch::kFloat);       // (n)
    auto m = slot.buf[0].narrow(0, 0, it.count);                                                 // (n)
    auto v = slot.buf[1].narrow(0, 0, it.count);                                                 // (n)
    if (o.weight_decay() != 0) p.mul_(1 - o.lr() * o.weight_decay());
    m.mul_(beta1).add_(g, 1 - beta1);
    v.mul_(beta2).addcmul_(g, g, 1 - beta2);
    const double bias1 = 1 - std::pow(beta1, step), bias2 = 1 - std::pow(beta2, step);
    auto denom = (v.sqrt() / std::sqrt(bias2)).add_(o.eps());
    p.addcdiv_(m, denom, -o.lr() / bias1);
  }

  void open_state_file() {
    std::string dir = disk_.directory();
    if (dir.empty()) {
      const char* env = std::getenv("MEMOPT_OFFLOAD_DIR");
      dir = env && *env ? env : std::filesystem::temp_directory_path().string();
    }
    std::string pattern = (std::filesystem::path(dir) / "memopt-adamw-state-XXXXXX").string();
    fd_ = ::mkstemp(pattern.data());
    TORCH_CHECK(fd_ >= 0, "memopt::optim::DiskAdamW: cannot create the state file in '", dir, "': ",
                std::strerror(errno), ". HINT: pass an existing, writable folder (DiskAdamWOptions::directory "
                "or MEMOPT_OFFLOAD_DIR) with ", file_bytes_ >> 20, " MiB free.");
    path_ = pattern;
    ::unlink(path_.c_str());  // the open descriptor keeps it; nothing is left behind
    TORCH_CHECK(::ftruncate(fd_, file_bytes_) == 0, "memopt::optim::DiskAdamW: cannot size the state file in '",
                dir, "' to ", file_bytes_, " bytes: ", std::strerror(errno), ". HINT: free disk space there.");
  }

  void read_exact(void* dst, int64_t bytes, int64_t offset) const {
    auto* p = static_cast<char*>(dst);
    while (bytes > 0) {
      const ssize_t n = ::pread(fd_, p, static_cast<size_t>(bytes), offset);
      TORCH_CHECK(n > 0 || (n < 0 && errno == EINTR), "memopt::optim::DiskAdamW: reading the state file '", path_,
                  "' at byte ", offset, " failed: ", n == 0 ? "unexpected end of file" : std::strerror(errno),
                  ". HINT: the state folder's disk must stay available during training.");
      if (n < 0) continue;
      p += n;
      bytes -= n;
      offset += n;
    }
  }

  void write_exact(const void* src, int64_t bytes, int64_t offset) const {
    const auto* p = static_cast<const char*>(src);
    while (bytes > 0) {
      const ssize_t n = ::pwrite(fd_, p, static_cast<size_t>(bytes), offset);
      TORCH_CHECK(n > 0 || (n < 0 && errno == EINTR), "memopt::optim::DiskAdamW: writing the state file '", path_,
                  "' at byte ", offset, " failed: ", n == 0 ? "no progress" : std::strerror(errno),
                  ". HINT: free disk space in the state folder; this step's update is incomplete, resume from "
                  "the last checkpoint.");
      if (n < 0) continue;
      p += n;
      bytes -= n;
      offset += n;
    }
  }

  DiskAdamWOptions disk_;
  std::vector<int64_t> file_offset_;  // per parameter, bytes
  std::vector<int64_t> steps_;        // per parameter: AdamW's step count
  int64_t file_bytes_ = 0;
  int fd_ = -1;
  std::string path_;
  Slot slots_[3];
};

}  // namespace memopt::optim
