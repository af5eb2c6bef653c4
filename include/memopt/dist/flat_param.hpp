// memopt/dist/flat_param.hpp — ZeRO-3's storage (dist/zero3.hpp): FlatParam, a unit's tensors of
// one optimizer group as one flat parameter sharded over the ranks (this rank keeps 1/world of
// the elements, in memory, in a file or in pinned host memory), and Unit, a block's or the
// root's flat parameters with their prefetched all-gathers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "memopt/dist/shard_file.hpp"
#include "memopt/dist/world.hpp"

namespace memopt::dist {

/// Tensors of one unit and one optimizer group as one flat parameter, sharded over the ranks:
/// this rank keeps shard() (its 1/world of the elements, zero padded at the end); gather() and
/// bind() make the tensors whole views of one buffer, release() frees them again.
class FlatParam {
 public:
  /// `compute_dtype`: what gather() makes the tensors for the block's computation (empty: the
  /// shard's dtype; gather_half: bf16); gather(false) always gives the shard's.
  FlatParam(World& world, std::vector<torch::Tensor> params, std::optional<c10::ScalarType> compute_dtype = {})
      : world_(&world), params_(std::move(params)), device_(params_.front().device()), compute_dtype_(compute_dtype) {
    int64_t numel = 0;
    for (const auto& p : params_) {
      offsets_.push_back(numel);
      numel += p.numel();
    }
    shard_numel_ = (numel + world.size() - 1) / world.size();
    torch::NoGradGuard no_grad;
    shard_ = torch::zeros({shard_numel_}, params_.front().options());
    reshard();
    shard_.requires_grad_(true);
  }

  /// This rank's elements: what the optimizer steps.
  const torch::Tensor& shard() const { return shard_; }
  const std::vector<torch::Tensor>& params() const { return params_; }
  int64_t padded_numel() const { return shard_numel_ * world_->size(); }

  /// An all-gather under way: `full` is every rank's shard once `work` is done.
  struct Pending {
    torch::Tensor full;
    c10::intrusive_ptr<c10d::Work> work;
  };

  /// Starts gathering every rank's shard, in rank order: the tensors' elements (padded_numel(),
  /// in the compute dtype for the block's computation, else the shard's).
  Pending start_gather(bool compute = true) const {
    const auto dtype = compute && compute_dtype_ ? *compute_dtype_ : shard_.scalar_type();
    torch::Tensor full = torch::empty({padded_numel()}, on_device().dtype(dtype));
    torch::Tensor mine = shard_.detach().to(device_, dtype, /*non_blocking=*/true);  // offloaded: to the GPU
    return {full, world_->all_gather_into_async(full, mine, "ZeRO-3 parameter all-gather")};
  }
  torch::Tensor finish(const Pending& pending) const {
    world_->wait("ZeRO-3 parameter all-gather", pending.work);
    return pending.full;
  }

  /// The tensors become views of `full` (gather()'s), keeping their identity.
  void bind(const torch::Tensor& full) {
    for (size_t i = 0; i < params_.size(); ++i)
      params_[i].set_data(full.narrow(0, offsets_[i], params_[i].numel()).view(params_[i].sizes()));
  }

  /// The tensors become NaN placeholders of their shape holding one element.
  void release() {
    const auto nan = torch::full({}, std::numeric_limits<double>::quiet_NaN(), on_device());
    for (auto& p : params_) p.set_data(nan.expand(p.sizes()));
  }

  /// The sums over the ranks of this rank's elements of `grads` (one per tensor, undefined:
  /// zeros), in the shard's dtype: summed in fp32, as an all-to-all of the padded chunks.
  torch::Tensor reduce_scatter(const std::vector<torch::Tensor>& grads) const {
    torch::NoGradGuard no_grad;
    torch::Tensor flat = torch::zeros({padded_numel()}, on_device().dtype(torch::kFloat));
    for (size_t i = 0; i < params_.size(); ++i)
      if (grads[i].defined()) flat.narrow(0, offsets_[i], params_[i].numel()).copy_(grads[i].reshape({-1}));
    torch::Tensor received = torch::empty_like(flat);  // (world, n): every rank's copy of my chunk
    const std::vector<int64_t> split(static_cast<size_t>(world_->size()), shard_numel_);
    world_->wait("ZeRO-3 gradient reduce-scatter",
                 world_->all_to_all_async(received, flat, split, split, "ZeRO-3 gradient reduce-scatter"));
    return received.view({world_->size(), shard_numel_}).sum(0).to(shard_.device(), shard_.scalar_type());
  }

  /// Offload to host (a model on a GPU): the shard moves to pinned host memory, keeping its
  /// identity; again whenever something gave it other memory (Bf16Pure's cast to bf16).
  void place_host() {
    host_ = true;
    if (shard_.is_pinned()) return;
    move_to(torch::empty({shard_numel_}, shard_.options().device(torch::kCPU).pinned_memory(true)));
  }

  /// Offload to disk: the shard moves into its region of `file` (at `offset`, room for 4 bytes an
  /// element), keeping its identity; again whenever something gave it other memory (Bf16Pure's
  /// cast to bf16).
  void place(ShardFile& file, int64_t offset) {
    file_ = &file;
    offset_ = offset;
    if (file.holds(shard_)) return;
    move_to(file.tensor(offset, shard_numel_, shard_.scalar_type()));
    file.release(shard_);
  }
  void place_again() {
    if (file_ != nullptr) place(*file_, offset_);
    if (host_) place_host();
  }
  /// Offloaded: asks for the shard's pages ahead of use, or drops them from memory after.
  void will_need() const {
    if (file_ != nullptr) file_->will_need(shard_);
  }
  void page_out() const {
    if (file_ != nullptr) file_->release(shard_);
  }
  int64_t shard_numel() const { return shard_numel_; }
  /// Where the model's tensors compute (the shard may live elsewhere: offloaded).
  const torch::Device& device() const { return device_; }

  /// shard() ← this rank's elements of the tensors as they are now (a resume loaded them).
  void reshard() {
    torch::NoGradGuard no_grad;
    const int64_t lo = world_->rank() * shard_numel_;
    const int64_t hi = lo + shard_numel_;
    for (size_t i = 0; i < params_.size(); ++i) {
      const int64_t begin = std::max(lo, offsets_[i]);
      const int64_t end = std::min(hi, offsets_[i] + params_[i].numel());
      if (begin >= end) continue;
      shard_.detach().narrow(0, begin - lo, end - begin)
          .copy_(params_[i].detach().reshape({-1}).narrow(0, begin - offsets_[i], end - begin));
    }
  }

 private:
  // The shard's elements copied into `memory`, which becomes its storage (its identity kept).
  void move_to(torch::Tensor memory) {
    torch::NoGradGuard no_grad;
    memory.copy_(shard_.detach());
    shard_.set_data(memory);
  }
  torch::TensorOptions on_device() const { return shard_.options().device(device_).requires_grad(false); }

  World* world_;
  std::vector<torch::Tensor> params_;  // the model's tensors, in order
  torch::Device device_;               // theirs
  std::optional<c10::ScalarType> compute_dtype_;  // what they are gathered in for computing
  std::vector<int64_t> offsets_;       // where each starts in the flat order
  int64_t shard_numel_ = 0;
  torch::Tensor shard_;
  ShardFile* file_ = nullptr;  // offloaded: the file its shard lives in, at offset_
  int64_t offset_ = 0;
  bool host_ = false;          // offloaded to pinned host memory
};

/// A unit (a block the model runs through run_block, or the root): its flat parameters, and
/// its trainable tensors below the persistence threshold (whole on every rank).
struct Unit {
  std::string name;
  std::vector<std::unique_ptr<FlatParam>> flats;
  std::vector<torch::Tensor> replicated;
  Unit* next = nullptr;  // the block after it in the model (its forward prefetches that one)
  Unit* prev = nullptr;  // the block before it (its backward prefetches that one)
  int64_t runs = 0;      // forwards since the last gradient sync
  bool backward_follows = false;                 // the run under way records a graph
  bool keep = false;    // stays whole from its first gather until release() (SyncOptions::keep_gathered)
  bool whole = false;   // its tensors are whole now
  std::vector<FlatParam::Pending> pending;      // a prefetched all-gather, one per flat

  /// Starts the all-gather (a prefetch) unless one is under way or the tensors are whole.
  void prefetch() {
    if (whole || !pending.empty()) return;
    for (auto& f : flats) f->will_need();  // offloaded: read ahead while the other ranks start
    for (auto& f : flats) pending.push_back(f->start_gather());
  }
  /// The tensors whole: the prefetched all-gather, or one now.
  void gather() {
    if (whole) return;
    prefetch();
    for (size_t i = 0; i < flats.size(); ++i) {
      flats[i]->bind(flats[i]->finish(pending[i]));
      flats[i]->page_out();  // offloaded: the shard was read; its pages leave memory
    }
    pending.clear();
    whole = true;
  }
  void release() {
    for (auto& f : flats) f->release();
    whole = false;
  }
  /// After a use: released, unless it is kept whole for the rest of the step.
  void done() {
    if (!keep) release();
  }
  /// The tensors whole in the shards' dtype (for checkpoints and evaluation; not a prefetch's).
  void gather_whole() {
    drop();
    for (auto& f : flats) f->bind(f->finish(f->start_gather(/*compute=*/false)));
    whole = true;
  }
  /// Waits for and frees a prefetch nobody used (the shards are about to change).
  void drop() {
    for (size_t i = 0; i < pending.size(); ++i) flats[i]->finish(pending[i]);
    pending.clear();
  }
};

}  // namespace memopt::dist
