// memopt/dist/step_sync.hpp — dist::DataParallel: the StepSync (step_sync.hpp) of a Trainer
// in a job of several ranks. Each rank trains on its own rows of the global batch; after
// the last micro-batch the gradients are summed over the ranks (all-reduce, or with
// shard_optimizer_state a reduce-scatter onto each tensor's owner: ZeRO-1), the global
// gradient norm is clipped, and a sharded step shares the updated parameters. Counts,
// stop signals and running out of data are agreed by all ranks, so they stop together.
#pragma once

#include <atomic>
#include <csignal>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "memopt/dist/data_parallel.hpp"
#include "memopt/dist/world.hpp"
#include "memopt/step_sync.hpp"

namespace memopt::dist {

/// Data parallel training over `world` (dist::world(): the job torchrun started).
class DataParallel : public StepSync {
 public:
  /// options.bucket_bytes is checked by GradientSync when setup() builds it.
  explicit DataParallel(World& world, SyncOptions options = {}) : world_(&world), options_(options) {}

  int rank() const override { return world_->rank(); }
  int size() const override { return world_->size(); }
  bool sharded() const override { return param_share_ != nullptr; }

  std::vector<torch::Tensor> setup(torch::nn::Module& model, const std::vector<torch::Tensor>& params,
                                   std::vector<torch::optim::OptimizerParamGroup>& groups) override {
    check_model(*world_, model);      // the same names and shapes everywhere, or an error naming the rank
    broadcast_module(*world_, model);  // rank 0's initial weights on every rank
    if (!options_.shard_optimizer_state) {
      grad_sync_ = std::make_unique<GradientSync>(*world_, params, options_.bucket_bytes);  // all-reduce
      return {};
    }
    std::vector<torch::Tensor> others = shard_state(params, groups);
    std::erase_if(groups, [](const auto& group) { return group.params().empty(); });
    TORCH_CHECK(!groups.empty(), "memopt::Trainer: rank ", world_->rank(), " owns no parameter (", params.size(),
                " tensors over ", world_->size(), " ranks). HINT: use fewer ranks or shard_optimizer_state(false)");
    return others;
  }

  // One 4-byte all-reduce: with finite streamed data dealt by rank, one rank runs dry first;
  // alone, it would start the end-of-run checkpoint while the others wait in the next step.
  bool any(bool local, const char* what) override {
    torch::Tensor any = torch::scalar_tensor(local ? 1.0F : 0.0F, torch::kFloat);
    world_->all_reduce_sum({any}, what);
    return any.item<float>() > 0;
  }

  void sum_counts(torch::Tensor& num_targets, int64_t& tokens) override {
    torch::Tensor counts = torch::stack({num_targets.to(torch::kCPU, torch::kDouble),
                                         torch::scalar_tensor(static_cast<double>(tokens), torch::kDouble)});
    world_->all_reduce_sum({counts}, "target count all-reduce");
    num_targets = counts[0].to(num_targets.device(), torch::kFloat);
    tokens = static_cast<int64_t>(counts[1].item<double>());
  }

  int sync_gradients(torch::Tensor& loss_sum, int local_signal) override {
    torch::Tensor signal = torch::scalar_tensor(static_cast<float>(local_signal), loss_sum.options());
    grad_sync_->sync({loss_sum, signal});
    return signal.item<float>() > 0 ? (local_signal != 0 ? local_signal : SIGTERM) : 0;
  }

  torch::Tensor clip_grad_norm_(const std::vector<torch::Tensor>& params, double max_norm) override {
    return sharded() ? dist::clip_grad_norm_(*world_, params, max_norm) : optim::clip_grad_norm_(params, max_norm);
  }

  void share_params() override {
    if (param_share_) param_share_->share();
  }

  void barrier(const char* what) override { world_->barrier(what); }

  // Through the store: rank 0 reads every other rank's entry. The store outlives this
  // Trainer, so each call's keys carry the process's call count (the same on every rank): a
  // later Trainer's "checkpoint/3" must not read an earlier one's.
  nlohmann::json gather(const nlohmann::json& mine, const std::string& key) override {
    static std::atomic<int64_t> calls{0};
    const std::string prefix = fmt::format("{}#{}", key, calls++);
    if (world_->rank() != 0) {
      world_->store_set(fmt::format("{}/{}", prefix, world_->rank()), mine.dump());
      return nullptr;
    }
    nlohmann::json all = nlohmann::json::array({mine});
    for (int r = 1; r < world_->size(); ++r)
      all.push_back(nlohmann::json::parse(world_->store_get(fmt::format("{}/{}", prefix, r))));
    return all;
  }

 protected:
  // ZeRO-1 for `params`: each rank steps the ones it owns (owners()) and receives only their
  // gradient sums; each group of `groups` keeps this rank's (maybe none). Returns the others.
  std::vector<torch::Tensor> shard_state(const std::vector<torch::Tensor>& params,
                                         std::vector<torch::optim::OptimizerParamGroup>& groups) {
    const std::vector<int> owner = owners(params, world_->size());
    grad_sync_ = std::make_unique<GradientSync>(*world_, params, options_.bucket_bytes, owner);  // reduce-scatter
    std::set<const void*> mine;
    std::vector<torch::Tensor> others;
    for (size_t i = 0; i < params.size(); ++i) {
      if (owner[i] == world_->rank()) {
        mine.insert(params[i].unsafeGetTensorImpl());
      } else {
        others.push_back(params[i]);
      }
    }
    for (auto& group : groups) std::erase_if(group.params(), [&](const auto& p) { return !mine.count(p.unsafeGetTensorImpl()); });
    param_share_ = std::make_unique<ParamShare>(*world_, params, owner, options_.param_gather);
    return others;
  }

  World* world_;
  SyncOptions options_;
  std::unique_ptr<GradientSync> grad_sync_;  // the gradient all-reduce / reduce-scatter
  std::unique_ptr<ParamShare> param_share_;  // sharded optimizer state: parameters after the step
};

}  // namespace memopt::dist
