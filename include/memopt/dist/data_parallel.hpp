// memopt/dist/data_parallel.hpp — the pieces of data-parallel training the Trainer uses
// when dist::world() has more than one rank:
//   - check_model + broadcast_module: the same parameter names and shapes on every rank
//     (else an error naming the rank and both shapes), then rank 0's weights everywhere;
//   - GradientSync: every gradient summed over the ranks in fp32 buckets of bucket_bytes
//     (Gloo in 1.13 has no bf16 all-reduce; bf16 gradients are widened and rounded back), once
//     per optimizer step, after the last micro-batch (accumulation steps communicate nothing);
//   - owners + ParamShare: ZeRO-1 — each rank keeps the optimizer state of the parameters it
//     owns (about 1/world of them, by size), steps those, and shares them after the step by
//     broadcast from each owner or by one all-gather of padded buffers (ParamGather);
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

namespace memopt::dist {

/// How updated parameters reach the other ranks after a sharded optimizer step.
enum class ParamGather {
  kBroadcast,  // each owner broadcasts its parameters (world broadcasts of 1/world of the bytes)
  kAllgather,  // one all-gather of every rank's parameters, padded to the largest share
};

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

/// Sums the gradients of `params` over the ranks in fp32 buckets (in place). Parameters
/// without a gradient on a rank count as zero; after sync() every parameter has one.
///   dist::GradientSync sync(world, params, 25 << 20);
///   sync.sync({loss_sum});   // + 0-dim values summed in the same collectives
class GradientSync {
 public:
  GradientSync(World& world, std::vector<torch::Tensor> params, int64_t bucket_bytes)
      : world_(&world), params_(std::move(params)) {
    TORCH_CHECK(bucket_bytes >= 4, "memopt::dist::GradientSync: bucket_bytes must be >= 4 (got ", bucket_bytes,
                "). HINT: 25 MiB buckets suit most models");
    int64_t used = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      const int64_t n = params_[i].numel();
      if (buckets_.empty() || (used > 0 && (used + n) * 4 > bucket_bytes)) {
        buckets_.push_back({});
        used = 0;
      }
      buckets_.back().members.push_back(i);
      buckets_.back().numel += n;
      used += n;
    }
  }

  /// Sums every gradient (and each 0-dim fp32 tensor of `extras`, in place) over the ranks.
  void sync(std::vector<torch::Tensor> extras = {}) {
    if (!world_->distributed()) return;
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> flats;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const bool last = b + 1 == buckets_.size();
      const int64_t n = buckets_[b].numel + (last ? static_cast<int64_t>(extras.size()) : 0);
      torch::Tensor flat = torch::empty({n}, params_.front().options().dtype(torch::kFloat));  // (n,) fp32
      int64_t at = 0;
      for (size_t i : buckets_[b].members) {
        const auto& p = params_[i];
        torch::Tensor slot = flat.narrow(0, at, p.numel());
        if (p.grad().defined()) {
          slot.copy_(p.grad().reshape({-1}));
        } else {
          slot.zero_();
        }
        at += p.numel();
      }
      if (last) {
        for (const auto& e : extras) flat.narrow(0, at++, 1).copy_(e.reshape({1}));
      }
      works.push_back(world_->all_reduce_sum_async(flat, "gradient all-reduce"));  // overlaps the next copy
      flats.push_back(flat);
    }
    for (size_t b = 0; b < buckets_.size(); ++b) {
      world_->wait("gradient all-reduce", works[b]);
      int64_t at = 0;
      for (size_t i : buckets_[b].members) {
        auto& p = params_[i];
        torch::Tensor summed = flats[b].narrow(0, at, p.numel()).view(p.sizes());
        if (p.grad().defined()) {
          p.mutable_grad().copy_(summed);
        } else {
          p.mutable_grad() = summed.to(p.scalar_type()).clone();
        }
        at += p.numel();
      }
      if (b + 1 == buckets_.size()) {
        for (auto& e : extras) e.copy_(flats[b].narrow(0, at++, 1).reshape(e.sizes()));
      }
    }
  }

  int64_t buckets() const { return static_cast<int64_t>(buckets_.size()); }

 private:
  struct Bucket {
    std::vector<size_t> members;
    int64_t numel = 0;
  };
  World* world_;
  std::vector<torch::Tensor> params_;
  std::vector<Bucket> buckets_;
};

/// The owning rank of each parameter: in order, each to the rank with the fewest elements so
/// far (ties: the lowest rank). The same on every rank.
inline std::vector<int> owners(const std::vector<torch::Tensor>& params, int world_size) {
  std::vector<int64_t> load(static_cast<size_t>(world_size), 0);
  std::vector<int> owner;
  for (const auto& p : params) {
    const auto r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner.push_back(r);
    load[static_cast<size_t>(r)] += p.numel();
  }
  return owner;
}

/// After a sharded step: each rank's updated parameters to every other rank.
class ParamShare {
 public:
  ParamShare(World& world, std::vector<torch::Tensor> params, std::vector<int> owner, ParamGather how)
      : world_(&world), params_(std::move(params)), owner_(std::move(owner)), how_(how) {
    bytes_.assign(static_cast<size_t>(world.size()), 0);
    for (size_t i = 0; i < params_.size(); ++i) bytes_[static_cast<size_t>(owner_[i])] += params_[i].nbytes();
  }

  void share() {
    if (!world_->distributed()) return;
    torch::NoGradGuard no_grad;
    if (how_ == ParamGather::kBroadcast) {
      for (int r = 0; r < world_->size(); ++r) {
        torch::Tensor flat = pack(r, bytes_[static_cast<size_t>(r)]);
        world_->broadcast(flat, r, "parameter broadcast (sharded optimizer)");
        if (r != world_->rank()) unpack(r, flat);
      }
      return;
    }
    const int64_t most = *std::max_element(bytes_.begin(), bytes_.end());
    const auto all = world_->all_gather(pack(world_->rank(), most), "parameter all-gather (sharded optimizer)");
    for (int r = 0; r < world_->size(); ++r)
      if (r != world_->rank()) unpack(r, all[static_cast<size_t>(r)]);
  }

 private:
  // Rank r's parameters as one byte buffer of `size` bytes (the tail is padding).
  torch::Tensor pack(int r, int64_t size) const {
    torch::Tensor flat = torch::zeros({size}, params_.front().options().dtype(torch::kByte));
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
  std::vector<int64_t> bytes_;
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
