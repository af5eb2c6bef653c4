// memopt/kernel_choices.hpp — the kernels this process chose by measuring: how CPU bf16 GEMMs
// run (bf16_gemm::enable(): LibTorch's kernel or widened to fp32), how fp32 ones run
// (fp32_gemm::enable(): LibTorch's or blocked on brgemm) and which kernel attention_auto runs on
// each shape (SDPA, flash or blockwise). Each is picked by timing on the machine as it
// is loaded at that moment, and the candidates differ in the last bits of their results: on a
// 2-core AVX512-BF16 EPYC the native bf16 GEMM measured 224–440 GFLOP/s and the widened one
// 159–195 between processes under load, close enough for a busy moment to flip the choice.
// A checkpoint keeps them (capture(), state.json's "kernels"), and a resume on the same kind of
// CPU runs them again (restore()) instead of measuring: the resumed run's results are bitwise
// those of a run that never stopped (scripts/killtest), however the load moved the probes. On
// another CPU kind the resumed run measures for itself (the old kernels would give other bits
// there anyway) and restore() says so.
//
//   nlohmann::json k = memopt::kernel_choices::capture();  // {"cpu", "bf16_gemm", "fp32_gemm", "attention"}
//   std::string note = memopt::kernel_choices::restore(k, "resume");  // for the log ("" if nothing to say)
#pragma once

#include <algorithm>
#include <array>
#include <iterator>
#include <cstdint>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/bf16_gemm.hpp"
#include "memopt/fp32_gemm.hpp"
#include "memopt/nn/attention_choice.hpp"
#include "memopt/runtime.hpp"

namespace memopt::kernel_choices {

namespace detail {

// The floating dtypes an attention shape can have, by c10::toString's name.
inline c10::ScalarType dtype_named(const std::string& name, const std::string& who) {
  for (auto t : {c10::kFloat, c10::kBFloat16, c10::kHalf, c10::kDouble})
    if (name == c10::toString(t)) return t;
  TORCH_CHECK(false, who, ": the checkpoint's kernels name the dtype '", name, "' for an attention shape; this "
              "build knows Float, BFloat16, Half and Double. HINT: state.json's \"kernels\" is damaged; delete that "
              "entry to let the resumed run measure its kernels again");
}

inline nlohmann::json shape_json(const nn::AttentionShape& s) {
  return {{"device", c10::DeviceTypeName(s.device, /*lower_case=*/true)},
          {"device_index", s.device_index},
          {"dtype", c10::toString(s.dtype)},
          {"autocast", c10::toString(s.autocast)},
          {"bhkv", {s.batch, s.heads, s.kv_heads}},
          {"lengths", {s.q_len, s.kv_len}},
          {"head_dim", s.head_dim},
          {"causal", s.causal},
          {"padded", s.padded},
          {"strides", {s.q_strides, s.k_strides, s.v_strides}},
          {"blocks", {s.q_block, s.kv_block}}};
}

inline nn::AttentionShape shape_of(const nlohmann::json& j, const std::string& who) {
  nn::AttentionShape s;
  try {
    s.device = c10::Device(j.at("device").get<std::string>()).type();
    s.device_index = j.at("device_index").get<c10::DeviceIndex>();
    s.dtype = dtype_named(j.at("dtype").get<std::string>(), who);
    s.autocast = dtype_named(j.at("autocast").get<std::string>(), who);
    const auto bhkv = j.at("bhkv").get<std::array<int64_t, 3>>();
    s.batch = bhkv[0], s.heads = bhkv[1], s.kv_heads = bhkv[2];
    const auto lengths = j.at("lengths").get<std::array<int64_t, 2>>();
    s.q_len = lengths[0], s.kv_len = lengths[1];
    s.head_dim = j.at("head_dim").get<int64_t>();
    s.causal = j.at("causal").get<bool>();
    s.padded = j.at("padded").get<bool>();
    const auto strides = j.at("strides").get<std::array<std::array<int64_t, 4>, 3>>();
    s.q_strides = strides[0], s.k_strides = strides[1], s.v_strides = strides[2];
    const auto blocks = j.at("blocks").get<std::array<int64_t, 2>>();
    s.q_block = blocks[0], s.kv_block = blocks[1];
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, who, ": an attention shape in the checkpoint's kernels is malformed (", e.what(), "; got ",
                j.dump(), "). HINT: state.json's \"kernels\" is damaged; delete that entry to let the resumed run "
                "measure its kernels again");
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, who, ": an attention shape in the checkpoint's kernels names an unknown device (",
                e.what_without_backtrace(), "; got ", j.dump(), "). HINT: delete state.json's \"kernels\" entry");
  }
  return s;
}

}  // namespace detail

/// This process's measured choices: the CPU kind they were measured on, the bf16 and fp32 GEMM
/// modes (each when its enable() has run) and attention_auto's kernel per shape.
inline nlohmann::json capture() {
  nlohmann::json out = {{"cpu", memopt::cpu_kind()}, {"attention", nlohmann::json::array()}};
  if (bf16_gemm::enabled()) out["bf16_gemm"] = bf16_gemm::mode_name(bf16_gemm::mode());
  if (fp32_gemm::enabled()) out["fp32_gemm"] = fp32_gemm::mode_name(fp32_gemm::mode());
  for (const auto& [shape, choice] : nn::attention_choices())
    out["attention"].push_back({{"shape", detail::shape_json(shape)}, {"kind", nn::attention_kind_name(choice.kind)}});
  return out;
}

/// Runs the choices `saved` (capture()'s JSON) from now on in this process, when they were
/// measured on this CPU kind: the bf16 and fp32 GEMM modes (each where it is enabled here) and each
/// attention shape's kernel (flash only where it runs here). Returns a line for the log where
/// that overrides what this process measured (its GEMM modes) or where nothing is restored
/// (another CPU kind: the run measures its own), "" otherwise. A malformed entry is an error
/// naming `who` and the value.
inline std::string restore(const nlohmann::json& saved, const std::string& who) {
  TORCH_CHECK(saved.is_object(), who, ": the checkpoint's \"kernels\" must be a JSON object (got ", saved.dump(),
              "). HINT: state.json is damaged; delete its \"kernels\" entry to let the run measure again");
  const std::string cpu = saved.value("cpu", std::string("?"));
  if (cpu != memopt::cpu_kind())
    return "the checkpoint's kernels were measured on a " + cpu + " CPU, this one is " + memopt::cpu_kind() +
           ": measuring them again (results differ from an unbroken run's in the last bits)";
  std::string note;
  // A GEMM mode: `key`'s value must name one of `modes` as `name_of` spells it; applied with `set`.
  const auto gemm = [&](const char* key, bool enabled, auto current, auto set, auto name_of, auto modes) {
    if (!saved.contains(key) || !enabled) return;
    const auto& value = saved[key];
    const auto name = value.is_string() ? value.get<std::string>() : value.dump();
    const auto found = std::find_if(modes.begin(), modes.end(), [&](auto m) { return name == name_of(m); });
    TORCH_CHECK(found != modes.end(), who, ": the checkpoint's kernels give ", key, " '", name, "'; it must be ",
                name_of(modes.front()), " or ", name_of(modes.back()),
                ". HINT: state.json is damaged; delete its \"kernels\" entry");
    if (*found != current)
      note += std::string(note.empty() ? "" : "; ") + key + " " + name + ", as the run that saved the checkpoint " +
              "measured (this process chose " + name_of(current) + "): a resumed run computes as an unbroken one";
    set(*found);
  };
  gemm("bf16_gemm", bf16_gemm::enabled(), bf16_gemm::mode(), bf16_gemm::set_mode, bf16_gemm::mode_name,
       std::array{bf16_gemm::Mode::Native, bf16_gemm::Mode::Fp32Compute});
  gemm("fp32_gemm", fp32_gemm::enabled(), fp32_gemm::mode(), fp32_gemm::set_mode, fp32_gemm::mode_name,
       std::array{fp32_gemm::Mode::Native, fp32_gemm::Mode::Blocked});
  for (const auto& entry : saved.value("attention", nlohmann::json::array())) {
    TORCH_CHECK(entry.is_object() && entry.contains("shape") && entry.contains("kind") && entry["kind"].is_string(),
                who, ": an attention entry of the checkpoint's kernels must hold \"shape\" and \"kind\" (got ",
                entry.dump(), "). HINT: state.json is damaged; delete its \"kernels\" entry");
    const auto shape = detail::shape_of(entry["shape"], who);
    const auto kind = nn::parse_attention_kind(entry["kind"].get<std::string>(), who + ": kernels.attention.kind");
    TORCH_CHECK(kind == nn::AttentionKind::kSdpa || kind == nn::AttentionKind::kFlash ||
                    kind == nn::AttentionKind::kBlockwise,
                who, ": the checkpoint's kernels give attention '", nn::attention_kind_name(kind), "' for ",
                shape.str(), "; attention_auto chooses sdpa, flash or blockwise. HINT: delete state.json's "
                "\"kernels\" entry");
    if (kind == nn::AttentionKind::kFlash &&
        !nn::flash_supported(shape.device, shape.autocast, shape.head_dim, false, shape.padded))
      continue;  // measured again on its first call here
    nn::remember_attention(shape, kind);
  }
  return note;
}

}  // namespace memopt::kernel_choices
