// examples/common/device.hpp — `--device cpu|cuda[:N]` (and `--teacher_device`): the flag's value
// checked against this build's LibTorch and this machine before any data is read, so a GPU run
// asked for where there is none fails at start with what was found and a HINT. `cuda` with no
// index is cuda:LOCAL_RANK (torchrun's rank on this machine; 0 alone), and becomes the current GPU.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <memopt/detail/version.hpp>
#if MEMOPT_HAS_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace examples {

/// The device `flag` names, or an error naming `who`, `option`, the value and what is missing.
inline torch::Device parse_device(const std::string& flag, const char* who, const char* option = "--device") {
  std::optional<torch::Device> device;
  try {
    device.emplace(flag);
  } catch (const c10::Error&) {
  }
  TORCH_CHECK(device && (device->is_cpu() || device->is_cuda()), who, ": ", option, " must be cpu or cuda[:N] (got '",
              flag, "'). HINT: --device cuda:0 for the first GPU.");
  if (device->is_cpu()) return *device;
  TORCH_CHECK(MEMOPT_HAS_CUDA, who, ": ", option, " ", flag, ": this build's LibTorch ", TORCH_VERSION,
              " has no CUDA. HINT: build against a CUDA LibTorch (the pinned torch wheel is one: scripts/deps), or "
              "use ", option, " cpu.");
  TORCH_CHECK(torch::cuda::is_available(), who, ": ", option, " ", flag, ": no CUDA GPU is visible to this process "
              "(LibTorch ", TORCH_VERSION, " is a CUDA build). HINT: check nvidia-smi and CUDA_VISIBLE_DEVICES, or use ",
              option, " cpu.");
  const auto count = static_cast<int>(torch::cuda::device_count());
  TORCH_CHECK(!device->has_index() || device->index() < count, who, ": ", option, " ", flag, ": only ", count,
              " CUDA device(s) visible (cuda:0 .. cuda:", count - 1, "). HINT: pick one of those.");
  if (!device->has_index()) {  // torchrun: rank LOCAL_RANK of this machine takes its own GPU, as NCCL needs
    const char* local = std::getenv("LOCAL_RANK");
    const int index = local != nullptr ? std::atoi(local) : 0;
    TORCH_CHECK(index < count, who, ": ", option, " ", flag, " on local rank ", index, " (LOCAL_RANK) means cuda:",
                index, ", but only ", count, " CUDA device(s) are visible. HINT: start at most ", count,
                " rank(s) per machine (--nproc_per_node), one GPU each");
    device.emplace(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
#if MEMOPT_HAS_CUDA
  c10::cuda::set_device(device->index());  // what allocates on "cuda" without an index goes there too
#endif
  return *device;
}

}  // namespace examples
