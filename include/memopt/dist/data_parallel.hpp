// memopt/dist/data_parallel.hpp — the pieces of data-parallel training dist::DataParallel
// (dist/step_sync.hpp) gives the Trainer when dist::world() has more than one rank:
//   - check_model + broadcast_module: the same parameter names and shapes on every rank
//     (else an error naming the rank and both shapes), then rank 0's weights everywhere;
//   - GradientSync: every gradient summed over the ranks in fp32 buckets of bucket_bytes
//     (bf16 gradients are widened and rounded back: Gloo's bf16 all-reduce is 0.73x the time
//     but 4.7e-3 off the fp32 sum, docs/distributed.md), once
//     per optimizer step, after the last micro-batch (accumulation steps communicate nothing):
//     all-reduced, or with a sharded optimizer reduce-scattered onto each tensor's owner;
//   - owners + ParamShare + clip_grad_norm_: ZeRO-1 — each rank keeps the optimizer state of
//     the parameters it owns (1/world of the elements, give or take the largest tensor), clips
//     by the global norm, steps those, and shares them after the step by broadcast from each
//     owner or by one all-gather of padded buffers (ParamGather);
//   - RankSlice: rank r's rows of a loader every rank runs identically, so the ranks together
//     see exactly the batch one process would.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memopt/dist/world.hpp>
#include <memopt/optim/clip.hpp>
#include <memopt/step_sync.hpp>  // ParamGather

namespace memopt::dist {

/// Fails on every rank unless all ranks have the same parameter and buffer names, shapes
/// and dtypes, naming the first difference.
inline void check_model(World& world, const torch::nn::Module& model) {
  if (!world.distributed()) return;
  std::string shapes;
  for (const auto& item : model.named_parameters())
    shapes += item.key() + " " + c10::str(item.value().sizes()) + " " + c10::toString(item.value().scalar_type()) + ";";
  for (const auto& item : model.named_buffers()) shapes += item.key() + " " + c10::str(item.value().sizes()) + ";";
  world.check_same("model shapes", shapes);
}

/// Rank 0's parameters and floating-point buffers on every rank (as bytes: any dtype).
inline void broadcast_module(World& world, torch::nn::Module& model) {
  if (!world.distributed()) return;
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> tensors;
  for (const auto& p : model.parameters()) tensors.push_back(p);
  for (const auto& b : model.buffers())
    if (b.is_floating_point()) tensors.push_back(b);
  for (auto& t : tensors) {
    torch::Tensor flat = t.detach().contiguous();
    torch::Tensor bytes = flat.reshape({-1}).view(torch::kByte);
    world.broadcast(bytes, 0, "broadcast of the initial weights");
    if (!flat.is_same(t)) t.detach().copy_(flat);
  }
}

/// The owning rank of each parameter for a sharded optimizer state: largest first, each to
/// the rank with the fewest elements so far (ties: the lower rank, then the earlier tensor), so
/// the shares differ by at most the largest tensor. The same on every rank.
inline std::vector<int> owners(const std::vector<torch::Tensor>& params, int world_size) {
  std::vector<size_t> order(params.size());
  std::iota(order.begin(), order.end(), size_t{0});
  const auto larger = [&](size_t a, size_t b) { return params[a].numel() > params[b].numel(); };
  std::stable_sort(order.begin(), order.end(), larger);
  std::vector<int64_t> load(static_cast<size_t>(world_size), 0);
  std::vector<int> owner(params.size(), 0);
  for (size_t i : order) {
    const auto r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[i] = r;
    load[static_cast<size_t>(r)] += params[i].numel();
  }
  return owner;
}

/// Sums the gradients of `params` over the ranks in fp32 buckets of about bucket_bytes (in
/// place; a parameter without a gradient on a rank counts as zero), once per optimizer step.
///  - no owners: one all-reduce per bucket; after sync() every parameter has the sum.
///  - owners (ZeRO-1, from owners()): a reduce-scatter by tensor — one all-to-all per bucket
///    sends each gradient to its owner only, which sums the world's copies; the other ranks'
///    copies are freed. Half an all-reduce's traffic, and the gradients held for the optimizer
///    step shrink to the owned ones.
/// 0-dim fp32 `extras` (the loss, a stop signal) are summed onto every rank either way.
///   dist::GradientSync sync(world, params, 25 << 20);            // or (..., owners(params, n))
///   sync.sync({loss_sum});
class GradientSync {
 public:
  GradientSync(World& world, std::vector<torch::Tensor> params, int64_t bucket_bytes, std::vector<int> owner = {})
      : world_(&world), params_(std::move(params)), owner_(std::move(owner)),
        options_(params_.empty() ? torch::TensorOptions() : params_.front().options()) {
    TORCH_CHECK(bucket_bytes >= 4, "memopt::dist::GradientSync: bucket_bytes must be >= 4 (got ", bucket_bytes,
                "). HINT: 25 MiB buckets suit most models");
    TORCH_CHECK(owner_.empty() || owner_.size() == params_.size(), "memopt::dist::GradientSync: ", owner_.size(),
                " owners for ", params_.size(), " parameters. HINT: pass dist::owners(params, world.size())");
    int64_t used = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      const int64_t n = params_[i].numel();
      if (buckets_.empty() || (used > 0 && (used + n) * 4 > bucket_bytes)) {
        buckets_.push_back({});
        buckets_.back().owned.resize(owner_.empty() ? 0 : static_cast<size_t>(world.size()));
        used = 0;
      }
      buckets_.back().members.push_back(i);
      if (!owner_.empty()) buckets_.back().owned[static_cast<size_t>(owner_[i])].push_back(i);
      used += n;
    }
    if (buckets_.empty()) buckets_.push_back({{}, std::vector<std::vector<size_t>>(owner_.empty() ? 0 : world.size())});
  }

  /// Sums the gradients (onto every rank, or onto their owners) and each of `extras` (onto every rank).
  void sync(std::vector<torch::Tensor> extras = {}) {
    if (!world_->distributed()) return;
    torch::NoGradGuard no_grad;
    const auto ex = static_cast<int64_t>(extras.size());
    std::vector<torch::Tensor> results;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const std::vector<torch::Tensor> none;
      const auto& tail = b + 1 == buckets_.size() ? extras : none;  // the extras ride in the last bucket
      if (owner_.empty()) {
        torch::Tensor flat = empty_fp32(numel(buckets_[b].members) + ex);  // (n + extras,) summed in place
        pack(flat, buckets_[b].members, tail);
        works.push_back(world_->all_reduce_sum_async(flat, "gradient all-reduce"));  // overlaps the next copy
        results.push_back(flat);
        continue;
      }
      std::vector<int64_t> split;  // rank r's part: the gradients it owns, then the extras
      for (const auto& members : buckets_[b].owned) split.push_back(numel(members) + static_cast<int64_t>(tail.size()));
      torch::Tensor flat = empty_fp32(std::accumulate(split.begin(), split.end(), int64_t{0}));  // (n + world·extras,)
      int64_t at = 0;
      for (size_t r = 0; r < split.size(); ++r) {
        pack(flat.narrow(0, at, split[r]), buckets_[b].owned[r], tail);
        at += split[r];
        if (static_cast<int>(r) == world_->rank()) continue;
        for (size_t i : buckets_[b].owned[r]) params_[i].mutable_grad() = torch::Tensor();  // sent: its owner sums it
      }
      const std::vector<int64_t> mine(split.size(), split[static_cast<size_t>(world_->rank())]);
      torch::Tensor received = empty_fp32(world_->size() * mine.front());  // (world, mine + extras) flat
      works.push_back(world_->all_to_all_async(received, flat, mine, split, "gradient reduce-scatter"));
      results.push_back(received);
    }
    for (size_t b = 0; b < buckets_.size(); ++b) {
      world_->wait(owner_.empty() ? "gradient all-reduce" : "gradient reduce-scatter", works[b]);
      const std::vector<size_t>* members = &buckets_[b].members;
      torch::Tensor summed = results[b];  // (n [+ extras],)
      if (!owner_.empty()) {
        members = &buckets_[b].owned[static_cast<size_t>(world_->rank())];
        summed = results[b].view({world_->size(), -1}).sum(0);  // (mine [+ extras],) the ranks' copies, summed
      }
      int64_t at = unpack(*members, summed);
      if (b + 1 == buckets_.size())
        for (auto& e : extras) e.copy_(summed.narrow(0, at++, 1).reshape(e.sizes()));
    }
  }

  int64_t buckets() const { return static_cast<int64_t>(buckets_.size()); }

 private:
  struct Bucket {
    std::vector<size_t> members;             // parameter indices, in order
    std::vector<std::vector<size_t>> owned;  // with owners: members by owning rank
  };

  int64_t numel(const std::vector<size_t>& members) const {
    int64_t n = 0;
    for (size_t i : members) n += params_[i].numel();
    return n;
  }
  torch::Tensor empty_fp32(int64_t n) const {
    return torch::empty({n}, options_.dtype(torch::kFloat));
  }

  // The gradients of `members` (zeros where undefined), then `extras`, into `flat`.
  void pack(torch::Tensor flat, const std::vector<size_t>& members, const std::vector<torch::Tensor>& extras) const {
    int64_t at = 0;
    for (size_t i : members) {
      const auto& p = params_[i];
      torch::Tensor slot = flat.narrow(0, at, p.numel());
      if (p.grad().defined()) {
        slot.copy_(p.grad().reshape({-1}));
      } else {
        slot.zero_();
      }
      at += p.numel();
    }
    for (const auto& e : extras) flat.narrow(0, at++, 1).copy_(e.reshape({1}));
  }

  // The sums in `flat` into the gradients of `members`; returns where the extras begin.
  int64_t unpack(const std::vector<size_t>& members, const torch::Tensor& flat) {
    int64_t at = 0;
    for (size_t i : members) {
      auto& p = params_[i];
      torch::Tensor summed = flat.narrow(0, at, p.numel()).view(p.sizes());
      if (p.grad().defined()) {
        p.mutable_grad().copy_(summed);
      } else {
        p.mutable_grad() = summed.to(p.scalar_type()).clone();
      }
      at += p.numel();
    }
    return at;
  }

  World* world_;
  std::vector<torch::Tensor> params_;
  std::vector<int> owner_;
  torch::TensorOptions options_;  // the parameters' device
  std::vector<Bucket> buckets_;
};

/// Clips the global L2 norm of gradients that the ranks hold in parts (each the owned ones of
/// a reduce-scattered step) to `max_norm` (<= 0: measure only): one all-reduce of a squared
/// norm. Returns the global norm before clipping (0-dim fp32), the same on every rank.
inline torch::Tensor clip_grad_norm_(World& world, const std::vector<torch::Tensor>& owned, double max_norm) {
  torch::NoGradGuard no_grad;
  torch::Tensor squared = optim::grad_norms(owned).square().sum();  // 0-dim fp32, this rank's part
  world.all_reduce_sum({squared}, "gradient norm all-reduce");
  torch::Tensor norm = squared.sqrt();
  optim::clip_grads_to_(owned, norm, max_norm);
  return norm;
}

/// After a sharded step: each rank's updated parameters to every other rank.
class ParamShare {
 public:
  ParamShare(World& world, std::vector<torch::Tensor> params, std::vector<int> owner, ParamGather how)
      : world_(&world), params_(std::move(params)), owner_(std::move(owner)), how_(how) {}

  void share() {
    if (!world_->distributed() || params_.empty()) return;
    torch::NoGradGuard no_grad;
    std::vector<int64_t> bytes(static_cast<size_t>(world_->size()), 0);  // each rank's (Bf16Pure made them bf16)
    for (size_t i = 0; i < params_.size(); ++i) bytes[static_cast<size_t>(owner_[i])] += params_[i].nbytes();
    if (how_ == ParamGather::kBroadcast) {
      for (int r = 0; r < world_->size(); ++r) {
        torch::Tensor flat = pack(r, bytes[static_cast<size_t>(r)]);
        world_->broadcast(flat, r, "parameter broadcast (sharded optimizer)");
        if (r != world_->rank()) unpack(r, flat);
      }
      return;
    }
    const int64_t most = *std::max_element(bytes.begin(), bytes.end());
    const auto all = world_->all_gather(pack(world_->rank(), most), "parameter all-gather (sharded optimizer)");
    for (int r = 0; r < world_->size(); ++r)
      if (r != world_->rank()) unpack(r, all[static_cast<size_t>(r)]);
  }

 private:
  // Rank r's parameters as one byte buffer of `size` bytes (the tail is padding).
  torch::Tensor pack(int r, int64_t size) const {
    torch::Tensor flat = torch::empty({size}, params_.front().options().dtype(torch::kByte));
    int64_t at = 0;
    if (r != world_->rank()) return flat;  // receives
    for (size_t i = 0; i < params_.size(); ++i) {
      if (owner_[i] != r) continue;
      const int64_t n = static_cast<int64_t>(params_[i].nbytes());
      flat.narrow(0, at, n).copy_(params_[i].detach().contiguous().reshape({-1}).view(torch::kByte));
      at += n;
    }
    return flat;
  }
  void unpack(int r, const torch::Tensor& flat) {
    int64_t at = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (owner_[i] != r) continue;
      const int64_t n = static_cast<int64_t>(params_[i].nbytes());
      params_[i].detach().reshape({-1}).view(torch::kByte).copy_(flat.narrow(0, at, n));
      at += n;
    }
  }

  World* world_;
  std::vector<torch::Tensor> params_;
  std::vector<int> owner_;
  ParamGather how_;
};

/// Rank r's share of the rows of each batch of `loader`, which every rank runs the same way
/// (same data, same seed): the ranks together see exactly its batches. Rows split as
/// tensor_split does (sizes differ by at most one). Forwards state()/load_state() and
/// has_next() so checkpoints and finite streams work as with the loader itself.
///   memopt::data::RandomWindowLoader global(shard, LoaderOptions(micro * world.size(), T));
///   memopt::dist::RankSlice loader(global, world.rank(), world.size());
template <class L>
class RankSlice {
 public:
  RankSlice(L& loader, int rank, int world_size) : loader_(&loader), rank_(rank), world_(world_size) {
    TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "memopt::dist::RankSlice: rank ", rank,
                " is outside world size ", world_size, ". HINT: pass dist::world().rank() and size()");
  }
  auto next() {
    auto batch = loader_->next();
    TORCH_CHECK(batch.rows() >= world_, "memopt::dist::RankSlice: a batch of ", batch.rows(), " rows cannot give each of ",
                world_, " ranks one. HINT: make the loader's batch at least the world size (micro-batch x ranks)");
    return batch.split(world_)[static_cast<size_t>(rank_)];
  }
  nlohmann::json state() const
    requires requires(const L& l) { l.state(); }
  {
    return loader_->state();
  }
  void load_state(const nlohmann::json& s)
    requires requires(L& l, const nlohmann::json& j) { l.load_state(j); }
  {
    loader_->load_state(s);
  }
  bool has_next(int64_t n)
    requires requires(L& l, int64_t k) { l.has_next(k); }
  {
    return loader_->has_next(n);
  }

 private:
  L* loader_;
  int rank_, world_;
};

}  // namespace memopt::dist
