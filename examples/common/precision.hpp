// examples/common/precision.hpp — `--precision auto|fp32|bf16|fp16` of moe_lm and gritlm (the
// seeds' `--mixed_precision` is its alias for bf16: policy_flags.hpp; fp16 on CUDA only): auto measures this device's
// bf16 and fp32 matmul (memopt/machine.hpp) and takes bf16 only where it is faster, or with
// --resume keeps the precision of the checkpoint it reads; the choice and why are printed at the
// top of the log.
#pragma once

#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>
#include <torch/torch.h>

#include <memopt/bf16_gemm.hpp>
#include <memopt/fp32_gemm.hpp>
#include <memopt/machine.hpp>

namespace examples {

/// `flag` is one of auto, fp32, bf16, and with `fp16_device` also fp16 (loss-scaled autocast),
/// which needs that device to be CUDA; an error naming `who` and the value otherwise (call it
/// with the other option checks, before any data is read).
inline void check_precision(const std::string& flag, const char* who, const torch::Device* fp16_device = nullptr) {
  if (fp16_device != nullptr && flag == "fp16") {
    TORCH_CHECK(fp16_device->is_cuda(), who, ": --precision fp16 needs a CUDA device (got --precision fp16 with "
                "--device ", fp16_device->str(), "). HINT: fp16 needs a CUDA device; on CPU use bf16 or auto.");
    return;
  }
  TORCH_CHECK(flag == "auto" || flag == "fp32" || flag == "bf16", who, ": --precision must be auto, fp32",
              fp16_device != nullptr ? ", bf16 or fp16" : " or bf16", " (got '", flag,
              "'). HINT: auto measures this machine's bf16 and fp32 matmul and picks the faster.");
}

/// On the CPU, chooses the GEMM kernels the Trainer's precision policy will (its prepare hook) and
/// prints which it measured faster: fp32 products on oneDNN's brgemm or LibTorch's
/// (memopt/fp32_gemm.hpp), and where `precision` (resolved: fp32, bf16, bf16-pure, ...) computes
/// in bf16, bf16 products at fp32 speed where this CPU has no bf16 units (memopt/bf16_gemm.hpp).
/// Each choice is made, and printed, once per process.
inline void enable_cpu_gemms(const std::string& precision, const torch::Device& device) {
  static bool fp32_said = false, bf16_said = false;
  if (!device.is_cpu()) return;
  if (!std::exchange(fp32_said, true)) fmt::print("{:>13}: {}\n", "fp32 GEMM", memopt::fp32_gemm::enable().reason);
  if (precision.rfind("bf16", 0) == 0 && !std::exchange(bf16_said, true))
    fmt::print("{:>13}: {}\n", "bf16 GEMM", memopt::bf16_gemm::enable().reason);
}

/// `flag` resolved on `device` (memopt::machine::resolve_precision: auto measures), except that
/// auto with `resumed` — the precision of the checkpoint --resume reads
/// (CheckpointFlags::saved_precision) — keeps that one: a resumed run keeps its Trainer, and auto
/// may measure otherwise on another CPU. The reason says what auto measured here when it differs.
inline memopt::machine::PrecisionChoice resolve_choice(const std::string& flag, const torch::Device& device,
                                                       const std::optional<std::string>& resumed = {}) {
  if (flag != "auto" || !resumed) return memopt::machine::resolve_precision(flag, device);
  const auto here = memopt::machine::choose_precision(device);
  std::string reason = "kept from the checkpoint --resume reads";
  if (here.precision != *resumed) reason += "; a new run here would take " + here.precision + ": " + here.reason;
  return {*resumed, reason};
}

/// `flag` (checked by check_precision with a device) resolved on `device`: fp16 as given, the
/// others by resolve_choice (auto measures, or keeps `resumed`'s), said at the top of the log
/// with the CPU GEMMs it enables: fp32 | bf16 | fp16.
inline std::string resolve_precision(const std::string& flag, const torch::Device& device, const char* who,
                                     const std::optional<std::string>& resumed = {}) {
  if (flag == "fp16") {
    fmt::print("{:>13}: fp16 (as given: autocast with dynamic loss scaling)\n", "precision");
    return "fp16";
  }
  check_precision(flag, who);
  const auto choice = resolve_choice(flag, device, resumed);
  fmt::print("{:>13}: {} ({})\n", "precision", choice.precision, choice.reason);
  enable_cpu_gemms(choice.precision, device);
  return choice.precision;
}

}  // namespace examples
