// memopt/io/checkpoint.hpp — training-state checkpoints: everything a run needs to go on as
// if it had never stopped, written so that a crash at any moment leaves the previous one
// loadable. One checkpoint is a directory step-NNNNNNNN/ holding model.safetensors (the
// parameters that train, the buffers but NF4 base weights; the frozen rest is fingerprinted
// in state.json, so a resume onto another base is refused), trainer.pt (Trainer::save_state:
// optimizer state of any offload policy, step, loss scale, fp32 masters; the CPU/CUDA random
// states), state.json (the options and run settings a resume must match, the data loader's
// position, the caller's fields) and manifest.json (size and XXH3-64 checksum of each file,
// written last: io/manifest.hpp).
// CheckpointManager writes each one in step-N.tmp/, fsyncs it, renames it into place, keeps
// the last K, and resolves "latest" to the newest one whose checksums hold.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/detail/checkpoint_function.hpp"
#include "memopt/io/manifest.hpp"
#include "memopt/io/safetensors.hpp"
#include "memopt/nn/linear.hpp"

namespace memopt::io {

namespace detail {

/// Whether a buffer of `module` is frozen state: a quantised memopt::nn::Linear's NF4 codes and
/// scales (its frozen base weight). Other buffers (a user model's running statistics) train.
inline bool frozen_buffers(const torch::nn::Module& module) {
  const auto* linear = dynamic_cast<const nn::LinearImpl*>(&module);
  return linear != nullptr && linear->quantized();
}

/// The model's state a checkpoint holds, by LibTorch's names: the parameters that require grad,
/// then the buffers that are not frozen (`frozen` false); or the rest (`frozen` true): the
/// parameters that train not (a LoRA model's base) and the NF4 base weights, which training
/// leaves as it found them and the run rebuilds from its pretrained model.
inline std::vector<std::pair<std::string, torch::Tensor>> named_state(torch::nn::Module& model, bool frozen = false) {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& item : model.named_parameters())
    if (item.value().requires_grad() != frozen) tensors.emplace_back(item.key(), item.value());
  for (const auto& module : model.named_modules()) {
    if (frozen_buffers(*module.value()) != frozen) continue;
    const std::string prefix = module.key().empty() ? "" : module.key() + ".";
    for (const auto& item : module.value()->named_buffers(/*recurse=*/false))
      tensors.emplace_back(prefix + item.key(), item.value());
  }
  return tensors;
}

/// A fingerprint of the frozen state (named_state(model, true)): each tensor's shape, dtype and
/// the XXH3-64 of up to 4096 of its elements, evenly spaced. A checkpoint records it, and a
/// resume onto another base (another --init_model, another quantisation) is refused by it.
inline nlohmann::json frozen_fingerprint(torch::nn::Module& model) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [name, tensor] : named_state(model, /*frozen=*/true)) {
    const torch::Tensor flat = tensor.detach().reshape({-1});
    const int64_t step = std::max<int64_t>(1, flat.numel() / 4096);
    const torch::Tensor sample = flat.slice(0, 0, flat.numel(), step).contiguous().cpu();
    const uint64_t hash = XXH3_64bits(sample.data_ptr(), sample.numel() * sample.element_size());
    out[name] = {{"shape", tensor.sizes().vec()}, {"dtype", c10::toString(tensor.scalar_type())},
                 {"sample_xxh3", fmt::format("{:016x}", hash)}};
  }
  return out;
}

/// "step-00000120" → 120; anything else (a .tmp, another file) → -1.
inline int64_t step_of(const std::string& name) {
  constexpr std::string_view kPrefix = "step-";
  if (name.size() <= kPrefix.size() || name.compare(0, kPrefix.size(), kPrefix) != 0) return -1;
  int64_t step = 0;
  for (size_t i = kPrefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || step > (INT64_MAX - 9) / 10) return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

}  // namespace detail

/// The Trainer's state (optimizer, step, loss scale, masters) and this process's random
/// states as one archive at `path` (trainer.pt; a rank's optimizer shard, trainer-rankN.pt).
template <class TrainerT>
void write_trainer_file(const std::string& path, const TrainerT& trainer) {
  torch::serialize::OutputArchive archive;
  trainer.save_state(archive);
  const auto rng = memopt::detail::RngState::capture();  // the CPU generator, read under its mutex
  archive.write("rng_cpu", rng.cpu);
#if MEMOPT_HAS_CUDA
  if (rng.cuda.defined()) archive.write("rng_cuda", rng.cuda);
#endif
  archive.save_to(path);
}

/// Writes a checkpoint's files into the (new, empty) directory `dir`: model.safetensors,
/// trainer.pt (the Trainer's state and the random states), state.json (`state`, plus
/// "step"), then manifest.json with their sizes and checksums; each file is fsync'ed.
/// Not atomic by itself: CheckpointManager::save writes into a temporary directory.
template <class TrainerT>
void write_checkpoint(const std::string& dir, torch::nn::Module& model, const TrainerT& trainer,
                      nlohmann::json state, const std::vector<std::string>& extra_files = {}) {
  namespace fs = std::filesystem;
  const std::string who = "memopt::io: write_checkpoint('" + dir + "')";
  const fs::path root(dir);
  save_safetensors((root / "model.safetensors").string(), detail::named_state(model), {{"format", "pt"}});

  write_trainer_file((root / "trainer.pt").string(), trainer);

  state["step"] = trainer.steps_taken();
  state["frozen"] = detail::frozen_fingerprint(model);
  detail::write_text((root / "state.json").string(), state.dump(2) + "\n", who);

  Manifest manifest;
  manifest.step = trainer.steps_taken();
  std::vector<std::string> files = checkpoint_files();
  files.insert(files.end(), extra_files.begin(), extra_files.end());  // e.g. other ranks' optimizer shards
  for (const auto& name : files) {
    detail::fsync_path((root / name).string(), who);
    manifest.files[name] = digest_file((root / name).string());
  }
  detail::write_text((root / "manifest.json").string(), manifest.dump(), who);
  detail::fsync_path((root / "manifest.json").string(), who);
  detail::fsync_path(root.string(), who);
}

/// state.json of a checkpoint directory (not verified: see verify_checkpoint).
inline nlohmann::json read_checkpoint_state(const std::string& dir) {
  const std::string who = "memopt::io: checkpoint '" + dir + "'";
  const std::string state_path = (std::filesystem::path(dir) / "state.json").string();
  nlohmann::json state;
  try {
    state = nlohmann::json::parse(detail::read_text(state_path, who));
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, who, ": '", state_path, "' is not valid JSON (", e.what(),
                "). HINT: the file is corrupt; resume from another checkpoint");
  }
  TORCH_CHECK(state.is_object(), who, ": '", state_path, "' must hold a JSON object (got ",
              io::detail::snippet(state), "). HINT: resume from another checkpoint");
  return state;
}

/// Reads a checkpoint into `model` (weights copied by name, converted to each parameter's
/// dtype and device) and `trainer` (built over `model` with the policies of the saving run);
/// restores the random states last. Verifies the checksums first unless `verify` is false
/// (the caller just did); checks every tensor's name and shape and reads trainer.pt whole
/// before changing anything. Returns state.json.
template <class TrainerT>
nlohmann::json read_checkpoint(const std::string& dir, torch::nn::Module& model, TrainerT& trainer,
                               bool verify = true, const std::string& trainer_file = "trainer.pt") {
  namespace fs = std::filesystem;
  const std::string who = "memopt::io: checkpoint '" + dir + "'";
  if (verify) verify_checkpoint(dir);
  const fs::path root(dir);
  nlohmann::json state = read_checkpoint_state(dir);

  // ---- model.safetensors: the same names and shapes as the model, checked before any copy ----
  auto file = SafetensorsFile::open((root / "model.safetensors").string());
  auto targets = detail::named_state(model);
  std::set<std::string> known;
  for (const auto& [name, tensor] : targets) {
    known.insert(name);
    TORCH_CHECK(file->contains(name), who, ": '", file->path(), "' has no tensor '", name,
                "', which the model has. HINT: build the model with the configuration of the run that saved it");
    const auto& shape = file->info(name).shape;
    TORCH_CHECK(tensor.sizes() == torch::IntArrayRef(shape), who, ": tensor '", name, "' has shape ",
                torch::IntArrayRef(shape), " in '", file->path(), "' but ", tensor.sizes(),
                " in the model. HINT: build the model with the configuration of the run that saved it");
  }
  for (const auto& name : file->names())
    TORCH_CHECK(known.count(name), who, ": '", file->path(), "' holds tensor '", name,
                "', which the model lacks. HINT: build the model with the configuration of the run that saved it");

  // ---- the frozen state: the same base as the run that saved it ----
  if (state.contains("frozen")) {
    const nlohmann::json mine = detail::frozen_fingerprint(model);
    for (const auto& [name, print] : state["frozen"].items())
      TORCH_CHECK(mine.contains(name) && mine[name] == print, who, ": the frozen tensor '", name, "' ",
                  mine.contains(name) ? "differs from" : "is missing in the model but was in",
                  " the run that saved it (", print.dump(), mine.contains(name) ? " there, " + mine[name].dump() +
                  " here" : "", "). HINT: a checkpoint holds what trains; rebuild the frozen base as that run did "
                  "(the same --init_model, LoRA targets and quantisation) before resuming");
    for (const auto& [name, print] : mine.items())
      TORCH_CHECK(state["frozen"].contains(name), who, ": the model's frozen tensor '", name, "' was not frozen in "
                  "the run that saved it. HINT: resume with that run's LoRA / QLoRA settings");
  }

  // ---- trainer.pt: read whole before any copy ----
  const std::string trainer_path = (root / trainer_file).string();
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(trainer_path);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, who, ": cannot read '", trainer_path, "' (", e.what_without_backtrace(),
                "). HINT: the file is corrupt; resume from another checkpoint");
  }
  memopt::detail::RngState rng;
  TORCH_CHECK(archive.try_read("rng_cpu", rng.cpu), who, ": '", trainer_path,
              "' has no \"rng_cpu\" entry. HINT: the file is incomplete; resume from another checkpoint");
#if MEMOPT_HAS_CUDA
  archive.try_read("rng_cuda", rng.cuda);
#endif

  // ---- restore: weights, trainer state, then the random state ----
  {
    torch::NoGradGuard no_grad;
    for (auto& [name, tensor] : targets) tensor.copy_(file->get(name));  // dtype/device converting
  }
  trainer.load_state(archive);
  rng.restore();
  return state;
}

/// The checkpoints of one run: DIR/step-NNNNNNNN/, the last `keep_last` kept.
///   memopt::io::CheckpointManager ckpts("runs/a/checkpoints", 3);
///   ckpts.save(step, [&](const std::string& tmp) { memopt::io::write_checkpoint(tmp, model, trainer, state); });
///   std::string dir = ckpts.resolve("latest");   // "" when there is none yet
class CheckpointManager {
 public:
  CheckpointManager(std::string dir, int64_t keep_last) : dir_(std::move(dir)), keep_last_(keep_last) {
    TORCH_CHECK(!dir_.empty(), "memopt::io::CheckpointManager: the directory is empty. HINT: pass where the "
                "checkpoints go, e.g. OUTPUT_DIR/checkpoints");
    TORCH_CHECK(keep_last_ >= 1, "memopt::io::CheckpointManager: keep_last must be >= 1 (got ", keep_last_,
                "). HINT: 3 keeps the last three checkpoints");
  }

  const std::string& dir() const { return dir_; }

  /// The directory of step `step`'s checkpoint.
  std::string path_of(int64_t step) const {
    return (std::filesystem::path(dir_) / fmt::format("step-{:08d}", step)).string();
  }

  /// Writes step `step`'s checkpoint: `write(tmp_dir)` fills step-N.tmp/, which is synced and
  /// renamed to step-N/ (an older step-N/ is replaced: it moves aside first and goes last);
  /// then all but the newest keep_last checkpoints are removed. Returns step-N/'s path.
  template <class Write>
  std::string save(int64_t step, Write&& write) const {
    namespace fs = std::filesystem;
    const std::string final_dir = path_of(step);
    const std::string who = "memopt::io: saving checkpoint '" + final_dir + "'";
    const fs::path tmp(final_dir + ".tmp"), old(final_dir + ".old");
    std::error_code ec;
    fs::create_directories(dir_, ec);
    TORCH_CHECK(!ec, who, ": cannot create '", dir_, "' (", ec.message(), "). HINT: check that it is writable");
    fs::remove_all(tmp, ec);  // one left by an interrupted save
    fs::create_directories(tmp, ec);
    TORCH_CHECK(!ec, who, ": cannot create '", tmp.string(), "' (", ec.message(), "). HINT: check permissions");
    write(tmp.string());
    const bool replacing = fs::exists(final_dir);
    if (replacing) {
      fs::remove_all(old, ec);
      fs::rename(final_dir, old, ec);
      TORCH_CHECK(!ec, who, ": cannot move the previous '", final_dir, "' aside (", ec.message(),
                  "). HINT: check permissions");
    }
    fs::rename(tmp, final_dir, ec);
    TORCH_CHECK(!ec, who, ": cannot rename '", tmp.string(), "' (", ec.message(), "). HINT: check permissions");
    detail::fsync_path(dir_, who);
    fs::remove_all(old, ec);
    prune();
    return final_dir;
  }

  /// Complete checkpoints (step-N directories; not .tmp/.old), newest first.
  std::vector<std::pair<int64_t, std::string>> list() const {
    namespace fs = std::filesystem;
    std::vector<std::pair<int64_t, std::string>> found;
    std::error_code ec;
    if (!fs::is_directory(dir_, ec)) return found;
    for (const auto& entry : fs::directory_iterator(dir_, ec)) {
      const int64_t step = detail::step_of(entry.path().filename().string());
      if (step >= 0 && entry.is_directory()) found.emplace_back(step, entry.path().string());
    }
    std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    return found;
  }

  /// "latest": the newest checkpoint that verifies; ones that fail are skipped, each with its
  /// reason appended to `refused`; "" when the directory holds none yet. Throws when some exist
  /// and none verifies. A run's output folder (OUTPUT_DIR, holding checkpoints/) or another
  /// checkpoints folder resolves the same way, to its newest good checkpoint. Any other spec is a
  /// checkpoint directory, verified (refused with the reason and the newest good one as a HINT).
  /// `verify` false: no checksums are read, "latest" is the newest checkpoint listed (a quick look
  /// at a run's state.json before the resume proper, which verifies).
  std::string resolve(const std::string& spec, std::vector<std::string>* refused = nullptr, bool verify = true) const {
    if (spec == "latest") {
      const auto all = list();
      std::vector<std::string> reasons;
      for (const auto& [step, path] : all) {
        std::string why = verify ? failure(path) : "";
        if (why.empty()) {
          if (refused) refused->insert(refused->end(), reasons.begin(), reasons.end());
          return path;
        }
        reasons.push_back(std::move(why));
      }
      std::string why;
      for (const auto& r : reasons) why += "\n  " + r;
      TORCH_CHECK(all.empty(), "memopt::io: no checkpoint in '", dir_, "' passes its checks:", why,
                  "\nHINT: start a new run (in another output directory), or resume from a copy of a good checkpoint");
      return "";
    }
    // A run's output folder (holding checkpoints/) or a checkpoints folder: its newest good one.
    namespace fs = std::filesystem;
    if (!fs::exists(fs::path(spec) / "manifest.json")) {
      for (const fs::path& inner : {fs::path(spec) / "checkpoints", fs::path(spec)}) {
        const CheckpointManager run(inner.string(), keep_last_);
        if (fs::is_directory(inner) && !run.list().empty()) return run.resolve("latest", refused, verify);
      }
    }
    const std::string why = verify ? failure(spec) : "";
    if (!why.empty()) {
      std::string good;
      for (const auto& [step, path] : list()) {
        if (good.empty() && path != spec && failure(path).empty()) good = path;
      }
      TORCH_CHECK(false, why,
                  good.empty() ? std::string() : "\nHINT: the newest checkpoint that passes is '" + good +
                                                     "' (--resume latest picks it)");
    }
    return spec;
  }

 private:
  // Why verify_checkpoint(path) refuses it; "" when it passes.
  static std::string failure(const std::string& path) {
    try {
      verify_checkpoint(path);
      return "";
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
  }

  void prune() const {
    std::error_code ec;
    const auto all = list();
    for (size_t i = static_cast<size_t>(keep_last_); i < all.size(); ++i) std::filesystem::remove_all(all[i].second, ec);
  }

  std::string dir_;
  int64_t keep_last_;
};

/// The differences between the settings a checkpoint was written with and the current ones,
/// key by key ("lr: 0.001 in the checkpoint, 0.002 now"); keys in `ignore` may differ.
inline std::vector<std::string> setting_differences(const nlohmann::json& saved, const nlohmann::json& now,
                                                    const std::set<std::string>& ignore = {},
                                                    const std::string& prefix = "") {
  std::vector<std::string> out;
  if (!saved.is_object() || !now.is_object()) {
    if (saved != now)
      out.push_back(fmt::format("{}: {} in the checkpoint, {} now", prefix.empty() ? "settings" : prefix,
                                saved.dump(), now.dump()));
    return out;
  }
  std::set<std::string> keys;
  for (const auto& [k, v] : saved.items()) keys.insert(k);
  for (const auto& [k, v] : now.items()) keys.insert(k);
  for (const auto& key : keys) {
    if (ignore.count(key)) continue;
    const std::string name = prefix.empty() ? key : prefix + "." + key;
    const nlohmann::json a = saved.contains(key) ? saved[key] : nlohmann::json("(absent)");
    const nlohmann::json b = now.contains(key) ? now[key] : nlohmann::json("(absent)");
    if (a.is_object() && b.is_object()) {
      auto nested = setting_differences(a, b, {}, name);
      out.insert(out.end(), nested.begin(), nested.end());
    } else if (a != b) {
      out.push_back(fmt::format("{}: {} in the checkpoint, {} now", name, a.dump(), b.dump()));
    }
  }
  return out;
}

}  // namespace memopt::io
