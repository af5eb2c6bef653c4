// memopt/io/train_state.hpp — the training-state checkpoint behind `--resume PATH`: one
// directory holding model.safetensors (every parameter and buffer, LibTorch's names),
// trainer.pt (Trainer::save_state — optimizer state, step, loss scale, fp32 masters — plus
// the CPU random-number state) and meta.json (the caller's fields, e.g. its data position).
// The directory is replaced atomically. This is the basic form: no checksums, no keep-last-K.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/detail/checkpoint_function.hpp"
#include "memopt/io/safetensors.hpp"

namespace memopt::io {

/// meta.json's "format" and "version" of a training-state directory.
inline constexpr const char* kTrainStateFormat = "memopt-train-state";
inline constexpr int kTrainStateVersion = 1;

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

/// The model's parameters then its buffers, by LibTorch's names.
inline std::vector<std::pair<std::string, torch::Tensor>> named_state(torch::nn::Module& model) {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& item : model.named_parameters()) tensors.emplace_back(item.key(), item.value());
  for (const auto& item : model.named_buffers()) tensors.emplace_back(item.key(), item.value());
  return tensors;
}

}  // namespace detail

/// Writes the training state to the directory `dir`, replacing it atomically: everything is
/// written and synced in `dir`.tmp, the old `dir` moves to `dir`.old, `dir`.tmp becomes `dir`,
/// and `dir`.old is removed. `meta` holds the caller's fields (say, its data loader's position);
/// "format", "version" and "step" are added.
///   memopt::io::save_train_state("runs/a/last", *model, trainer, {{"shard", 3}, {"offset", 81920}});
template <class TrainerT>
void save_train_state(const std::string& dir, torch::nn::Module& model, const TrainerT& trainer,
                      const nlohmann::json& meta) {
  namespace fs = std::filesystem;
  const std::string who = "memopt::io: save_train_state('" + dir + "')";
  fs::path root(dir);
  if (!root.has_filename()) root = root.parent_path();  // "runs/last/" → "runs/last"
  const fs::path tmp(root.string() + ".tmp"), old(root.string() + ".old");
  nlohmann::json full = meta.is_null() ? nlohmann::json::object() : meta;
  TORCH_CHECK(full.is_object(), who, ": meta must be a JSON object (got ", detail::snippet(meta),
              "). HINT: pass {{\"key\", value}, ...}");
  std::error_code ec;
  fs::remove_all(tmp, ec);  // a stale one from an interrupted save
  fs::create_directories(tmp, ec);
  TORCH_CHECK(!ec, who, ": cannot create '", tmp.string(), "' (", ec.message(),
              "). HINT: check that the parent directory exists and is writable");

  // ---- model.safetensors, trainer.pt, meta.json, each synced ----
  save_safetensors((tmp / "model.safetensors").string(), detail::named_state(model), {{"format", "pt"}});

  torch::serialize::OutputArchive archive;
  trainer.save_state(archive);
  const auto rng = memopt::detail::RngState::capture();  // the CPU generator, read under its mutex
  archive.write("rng_cpu", rng.cpu);
#if MEMOPT_HAS_CUDA
  if (rng.cuda.defined()) archive.write("rng_cuda", rng.cuda);
#endif
  archive.save_to((tmp / "trainer.pt").string());

  full["format"] = kTrainStateFormat;
  full["version"] = kTrainStateVersion;
  full["step"] = trainer.steps_taken();
  const std::string meta_path = (tmp / "meta.json").string();
  {
    std::ofstream out(meta_path, std::ios::binary | std::ios::trunc);
    out << full.dump(2) << "\n";
    out.close();
    TORCH_CHECK(out.good(), who, ": writing '", meta_path, "' failed. HINT: check free disk space");
  }
  for (const char* name : {"model.safetensors", "trainer.pt", "meta.json"})
    detail::fsync_path((tmp / name).string(), who);
  detail::fsync_path(tmp.string(), who);

  // ---- swap: dir → dir.old, dir.tmp → dir, remove dir.old ----
  const bool replacing = fs::exists(root);
  if (replacing) {
    fs::remove_all(old, ec);
    fs::rename(root, old, ec);
    TORCH_CHECK(!ec, who, ": cannot move the previous checkpoint to '", old.string(), "' (", ec.message(),
                "). HINT: check permissions of the parent directory");
  }
  fs::rename(tmp, root, ec);
  TORCH_CHECK(!ec, who, ": cannot rename '", tmp.string(), "' to '", dir, "' (", ec.message(), "). HINT: ",
              replacing ? "the previous checkpoint is in '" + old.string() + "'" : std::string("check permissions"));
  detail::fsync_path(root.has_parent_path() ? root.parent_path().string() : ".", who);
  fs::remove_all(old, ec);  // also one left by an interrupted save
}

/// Restores a directory written by save_train_state into `model` (weights copied by name,
/// converted to each parameter's dtype and device) and into `trainer`, which must be built
/// over `model` with the options and policies of the saving run; restores the CPU random
/// state last. Returns meta.json (the caller restores its data position from it).
/// Checks the files, the format and every tensor's name and shape before changing anything.
///   auto meta = memopt::io::load_train_state("runs/a/last", *model, trainer);
template <class TrainerT>
nlohmann::json load_train_state(const std::string& dir, torch::nn::Module& model, TrainerT& trainer) {
  namespace fs = std::filesystem;
  const std::string who = "memopt::io: load_train_state('" + dir + "')";
  const fs::path root(dir);
  const std::string old = dir + ".old";
  TORCH_CHECK(fs::is_directory(root), who, ": '", dir, "' is not a directory. HINT: ",
              fs::is_directory(old) ? "a save was interrupted while replacing it; '" + old +
                                          "' holds the previous checkpoint: rename it to '" + dir + "'"
                                    : std::string("pass a directory written by memopt::io::save_train_state"));
  for (const char* name : {"meta.json", "model.safetensors", "trainer.pt"})
    TORCH_CHECK(fs::is_regular_file(root / name), who, ": '", (root / name).string(),
                "' is missing. HINT: the directory was not written by memopt::io::save_train_state "
                "(it writes meta.json, model.safetensors and trainer.pt)");

  // ---- meta.json: {"format": "memopt-train-state", "version": 1, "step": N, ...} ----
  const std::string meta_path = (root / "meta.json").string();
  nlohmann::json meta;
  try {
    std::ifstream in(meta_path, std::ios::binary);
    meta = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    TORCH_CHECK(false, who, ": '", meta_path, "' is not valid JSON (", e.what(),
                "). HINT: the file is corrupt; resume from another checkpoint");
  }
  const nlohmann::json format = meta.is_object() && meta.contains("format") ? meta["format"] : nlohmann::json();
  TORCH_CHECK(format == kTrainStateFormat, who, ": '", meta_path, "' has \"format\" ", detail::snippet(format),
              ", expected \"", kTrainStateFormat, "\". HINT: pass a directory written by memopt::io::save_train_state");
  const nlohmann::json version = meta.contains("version") ? meta["version"] : nlohmann::json();
  TORCH_CHECK(version == kTrainStateVersion, who, ": '", meta_path, "' has \"version\" ", detail::snippet(version),
              ", this memopt reads version ", kTrainStateVersion, ". HINT: resume with the memopt that wrote it");

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

  // ---- trainer.pt: read whole before any copy ----
  const std::string trainer_path = (root / "trainer.pt").string();
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
  return meta;
}

}  // namespace memopt::io
