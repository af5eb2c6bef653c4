// memopt/dist/zero3.hpp — dist::Zero3: ZeRO-3 (what PyTorch FSDP calls full sharding), the
// StepSync of a Trainer with TrainerOptions::shard_params(true). Parameters are grouped into
// units (dist/flat_param.hpp: FlatParam, Unit): each block the model runs through `ckpt.run_block`
// (the items of its outermost ModuleLists and Sequentials: LLaMA's layers), and the root (the rest:
// embedding, final norm, head). A unit's tensors of at least param_persistence_threshold
// elements (DeepSpeed's stage3_param_persistence_threshold) are concatenated per optimizer group
// into a FlatParam, padded to a multiple of the world size; rank r keeps elements
// [r·n, (r+1)·n) as the optimizer's parameter (fp32, or the precision policy's dtype with its
// fp32 master), with its gradient and optimizer state.
//   - Blocks: all-gathered (in the shard's dtype) before the forward and again in backward,
//     where a block is always recomputed (as under recompute::EveryBlock, dropout replayed), and
//     freed after each; the gradients are reduce-scattered onto the shards as the block's
//     backward ends. The next block's all-gather is started before a block computes (the one
//     after it in forward, the one before it in backward; depth 1), so it overlaps the compute.
//     Between uses a block's parameters are NaN placeholders of one element (a block run some
//     other way computes NaN, and sync_gradients names it).
//   - keep_gathered: a block stays whole from its first all-gather in a step until the
//     gradients are synced after the last micro-batch (FSDP2's reshard_after_forward=False and
//     set_reshard_after_backward(False)): one all-gather per block and step instead of two per
//     micro-batch, for the memory of every block's parameters whole during the step.
//   - gather_half (SyncOptions::matrix_gather_dtype, from an autocast precision): a block's
//     matrices are flats of their own, all-gathered in bf16 for its computation — what autocast
//     casts them to anyway — and its vectors (norms) in fp32; checkpoints and evaluation gather
//     the shards' dtype.
//   - Root: gathered when the step begins and released when its gradients, accumulated over
//     the micro-batches, are reduce-scattered after backward (as FSDP2 keeps its root unit
//     gathered from forward into backward). Outside step(), Trainer::with_full_weights.
//   - Tensors below the threshold (0 by default: none) stay whole on every rank with ZeRO-1
//     state (each rank steps the ones it owns and shares them: DataParallel::shard_state).
//   - offload_params_dir: the shards live in a file (dist/shard_file.hpp), read ahead of each
//     all-gather and dropped from memory after it and after the optimizer step.
//   - offload_params_host (a model on a GPU): the shards, their gradients and optimizer state
//     live in pinned host memory and the optimizer steps on the CPU (ZeRO-Offload); each
//     all-gather starts with the shard's copy to the GPU, each reduce-scatter ends with one back.
// In a world of one (no torchrun) it runs the same way, the collectives being copies: what
// offloads one process's parameters, to a file or from a GPU to the host.
// Per step and block: its parameters all-gathered twice and its gradients reduce-scattered
// once per micro-batch; the root's parameters and gradients once per step (docs/distributed.md).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "memopt/detail/autocast.hpp"
#include "memopt/detail/checkpoint_function.hpp"
#include "memopt/dist/flat_param.hpp"
#include "memopt/dist/shard_file.hpp"
#include "memopt/dist/step_sync.hpp"
#include "memopt/dist/world.hpp"

namespace memopt::dist {

namespace detail {

// A block's gathered parameters, released when the scope ends (also when it throws), unless the
// unit is kept whole for the step (keep_gathered).
class Gathered {
 public:
  explicit Gathered(Unit& unit) : unit_(&unit) { unit.gather(); }
  ~Gathered() { unit_->done(); }
  Gathered(const Gathered&) = delete;
  Gathered& operator=(const Gathered&) = delete;

 private:
  Unit* unit_;
};

struct UnitHolder : torch::CustomClassHolder {
  UnitHolder(Unit* u, BlockFn f) : unit(u), fn(std::move(f)) {}
  Unit* unit;
  BlockFn fn;
};

// A ZeRO-3 block as one autograd node. Inputs: the block's inputs, its replicated tensors,
// then its shards. Forward gathers, runs the block without keeping activations, frees;
// backward gathers, replays the forward (RNG, autocast), takes the gradients of the inputs,
// the replicated tensors and the gathered parameters, and reduce-scatters the latter onto
// the shards, whose gradients it returns.
struct UnitFunction : torch::autograd::Function<UnitFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, Unit* unit, const BlockFn& fn,
                               int64_t num_inputs, at::TensorList all) {
    std::vector<torch::Tensor> inputs(all.begin(), all.begin() + num_inputs);
    ctx->saved_data["unit"] = c10::IValue::make_capsule(c10::make_intrusive<UnitHolder>(unit, fn));
    ctx->saved_data["num_inputs"] = num_inputs;
    memopt::detail::save_replay_state(ctx);
    ctx->save_for_backward(all.vec());
    ++unit->runs;
    torch::Tensor output;
    {
      Gathered gathered(*unit);
      if (unit->next != nullptr) unit->next->prefetch();  // its all-gather overlaps this block
      memopt::detail::AutocastCacheOff no_cache;
      output = fn(inputs);
    }
    if (unit->next == nullptr && unit->backward_follows) unit->prefetch();  // the last block's backward is first
    return output;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto num_inputs = static_cast<size_t>(ctx->saved_data["num_inputs"].toInt());
    const auto holder = ctx->saved_data["unit"].toCapsule();
    Unit& unit = *static_cast<UnitHolder*>(holder.get())->unit;
    const BlockFn& fn = static_cast<UnitHolder*>(holder.get())->fn;
    const size_t num_shards = unit.flats.size();

    std::vector<torch::Tensor> inputs, wrt;
    std::vector<size_t> wrt_slot;  // the slot of each of wrt that is not a gathered parameter
    for (size_t i = 0; i + num_shards < saved.size(); ++i) {
      torch::Tensor t = saved[i];
      if (i < num_inputs) {
        t = saved[i].detach();
        t.requires_grad_(saved[i].requires_grad());
        inputs.push_back(t);
      }
      if (!t.requires_grad()) continue;
      wrt.push_back(t);
      wrt_slot.push_back(i);
    }
    Gathered gathered(unit);
    if (unit.prev != nullptr) unit.prev->prefetch();  // the next backward's all-gather overlaps this one
    for (const auto& f : unit.flats) wrt.insert(wrt.end(), f->params().begin(), f->params().end());
    torch::Tensor output;
    {
      memopt::detail::AutocastCacheOff no_cache;
      output = memopt::detail::replay(ctx, fn, inputs);
    }
    // Every rank reduce-scatters, so an unused output still takes part (as zeros).
    torch::Tensor grad = grad_outputs[0].defined() ? grad_outputs[0] : torch::zeros_like(output);
    const auto grads = torch::autograd::grad({output}, wrt, {grad}, /*retain_graph=*/false, /*create_graph=*/false,
                                             /*allow_unused=*/true);
    torch::autograd::variable_list result(saved.size());
    for (size_t k = 0; k < wrt_slot.size(); ++k) result[wrt_slot[k]] = grads[k];
    size_t at = wrt_slot.size();
    for (size_t f = 0; f < num_shards; ++f) {
      const size_t n = unit.flats[f]->params().size();
      const std::vector<torch::Tensor> mine(grads.begin() + static_cast<int64_t>(at),
                                            grads.begin() + static_cast<int64_t>(at + n));
      result[saved.size() - num_shards + f] = unit.flats[f]->reduce_scatter(mine);
      at += n;
    }
    result.insert(result.begin(), 3, torch::Tensor());  // unit, fn, num_inputs
    return result;
  }
};

}  // namespace detail

/// ZeRO-3 over `world` (see the top of this file); the rest of DataParallel (counts, signals,
/// checkpoint collectives, ZeRO-1 for the small tensors) as it is.
class Zero3 final : public DataParallel, private memopt::detail::BlockRunner {
 public:
  explicit Zero3(World& world, SyncOptions options = {}) : DataParallel(world, options) {
    TORCH_CHECK(options.param_persistence_threshold >= 0, "memopt::dist::Zero3: param_persistence_threshold must be "
                ">= 0 (got ", options.param_persistence_threshold, "). HINT: 0 shards every tensor");
  }
  ~Zero3() override {
    BlockRunner* self = this;
    memopt::detail::block_runner().compare_exchange_strong(self, nullptr);
  }
  Zero3(const Zero3&) = delete;
  Zero3& operator=(const Zero3&) = delete;

  bool sharded() const override { return true; }

  std::vector<torch::Tensor> setup(torch::nn::Module& model, const std::vector<torch::Tensor>& params,
                                   std::vector<torch::optim::OptimizerParamGroup>& groups) override {
    check_model(*world_, model);
    broadcast_module(*world_, model);
    std::map<const void*, size_t> group_of;
    for (size_t g = 0; g < groups.size(); ++g)
      for (const auto& p : groups[g].params()) group_of[p.unsafeGetTensorImpl()] = g;
    std::set<const void*> trainable;
    for (const auto& p : params) trainable.insert(p.unsafeGetTensorImpl());

    std::vector<torch::Tensor> small;  // below the threshold: whole everywhere, ZeRO-1 state
    std::vector<std::pair<size_t, FlatParam*>> shards;  // (group, flat)
    std::set<const void*> seen;
    // The tensors of `module` not seen yet: flat per group when large, else small. In a block
    // (replicated given) with gather_half, the matrices have flats of their own, gathered in 16 bits.
    const auto split = [&](torch::nn::Module& module, std::vector<torch::Tensor>* replicated) {
      const bool half = replicated != nullptr && options_.matrix_gather_dtype.has_value();
      std::vector<std::vector<torch::Tensor>> large(2 * groups.size());  // [2g]: vectors (or all), [2g+1]: matrices
      for (const auto& p : module.parameters()) {
        const void* id = p.unsafeGetTensorImpl();
        if (!trainable.count(id) || !seen.insert(id).second) continue;
        if (p.numel() >= options_.param_persistence_threshold) {
          large[2 * group_of.at(id) + (half && p.dim() >= 2 ? 1 : 0)].push_back(p);
        } else {
          small.push_back(p);
          if (replicated) replicated->push_back(p);
        }
      }
      std::vector<std::unique_ptr<FlatParam>> flats;
      for (size_t k = 0; k < large.size(); ++k) {
        if (large[k].empty()) continue;
        const auto dtype = k % 2 == 1 ? options_.matrix_gather_dtype : std::nullopt;
        flats.push_back(std::make_unique<FlatParam>(*world_, std::move(large[k]), dtype));
        shards.emplace_back(k / 2, flats.back().get());
      }
      return flats;
    };
    for (auto& [name, block] : blocks(model)) {
      auto unit = std::make_unique<Unit>();
      unit->name = name;
      unit->flats = split(*block, &unit->replicated);
      if (unit->flats.empty()) continue;  // nothing sharded: it runs as any block
      unit->keep = options_.keep_gathered;
      unit->release();
      by_block_[block] = unit.get();
      if (!units_.empty()) {
        units_.back()->next = unit.get();
        unit->prev = units_.back().get();
      }
      units_.push_back(std::move(unit));
    }
    root_.name = "root";
    root_.flats = split(model, nullptr);
    root_.release();

    if (!options_.offload_params_dir.empty()) {  // the shards into one file, region by region
      int64_t bytes = 0;
      for (auto& [g, flat] : shards) bytes += ShardFile::region_bytes(flat->shard_numel());
      file_ = std::make_unique<ShardFile>(options_.offload_params_dir, world_->rank(), bytes);
      int64_t offset = 0;
      for (auto& [g, flat] : shards) {
        flat->place(*file_, offset);
        offset += ShardFile::region_bytes(flat->shard_numel());
      }
    }
    if (options_.offload_params_host) {
      for (auto& [g, flat] : shards) {
        TORCH_CHECK(flat->device().is_cuda(), "memopt::dist::Zero3: offload_params_host keeps the shards of a model "
                    "on a GPU in pinned host memory, but this model is on ", flat->device(), ". HINT: on the CPU, "
                    "offload them to a file (offload_params_dir, --offload_params disk)");
        flat->place_host();
      }
    }
    std::vector<torch::Tensor> others = shard_state(small, groups);  // groups keep the small ones this rank owns
    for (auto& [g, flat] : shards) groups[g].params().push_back(flat->shard());
    std::erase_if(groups, [](const auto& group) { return group.params().empty(); });
    BlockRunner* none = nullptr;
    TORCH_CHECK(memopt::detail::block_runner().compare_exchange_strong(none, this),
                "memopt::dist::Zero3: another Trainer with shard_params(true) is alive in this process. "
                "HINT: train one ZeRO-3 model at a time");
    return others;
  }

  std::vector<torch::Tensor> flat_params() const override {
    std::vector<torch::Tensor> out;
    for (const auto& unit : units_)
      for (const auto& f : unit->flats) out.push_back(f->shard());
    for (const auto& f : root_.flats) out.push_back(f->shard());
    return out;
  }

  void gather_params() override {
    for_each_flat([](FlatParam& f) { f.place_again(); });  // offloaded: a cast may have moved a shard
    if (whole_) {  // after unshard(): each rank's shard from the parameters as they are, then freed
      for (auto& unit : units_) reshard_release(*unit);
      reshard_release(root_);
      whole_ = false;
    }
    root_.gather();
  }

  void share_params() override {
    DataParallel::share_params();
    for_each_flat([](FlatParam& f) { f.page_out(); });  // offloaded: the step wrote every shard
  }

  void unshard() override {
    if (whole_) return;
    for (auto& unit : units_) unit->gather_whole();  // in the shards' dtype (not gather_half's)
    root_.gather();
    whole_ = true;
  }

  int sync_gradients(torch::Tensor& loss_sum, int local_signal) override {
    for (auto& unit : units_) {
      unit->drop();     // a prefetch the model's order left unused
      if (unit->whole) unit->release();  // keep_gathered: whole since its first forward this step
      TORCH_CHECK(unit->runs > 0, "memopt::dist::Zero3: block '", unit->name, "' holds sharded parameters but ran "
                  "no forward through run_block this step, so it computed with NaN placeholders. HINT: run each "
                  "item of the model's ModuleList through ckpt.run_block (memopt::run_sequential does)");
      unit->runs = 0;
    }
    torch::NoGradGuard no_grad;
    for (auto& f : root_.flats) {  // its tensors' gradients, accumulated over the micro-batches, onto the shard
      std::vector<torch::Tensor> grads;
      for (const auto& p : f->params()) grads.push_back(p.grad());
      torch::Tensor summed = f->reduce_scatter(grads);
      for (auto p : f->params()) p.mutable_grad() = torch::Tensor();
      torch::Tensor shard = f->shard();
      if (shard.grad().defined()) {
        shard.mutable_grad().add_(summed);
      } else {
        shard.mutable_grad() = summed;
      }
    }
    root_.release();
    return DataParallel::sync_gradients(loss_sum, local_signal);
  }

  void with_full_weights(const std::function<void()>& f, bool write_back) override {
    if (whole_) return f();  // the parameters are the truth; the next step reshards from them
    struct ReleaseAll {  // every unit released when this ends (also when `f` throws), kept ones too
      Zero3* self;
      ~ReleaseAll() {
        for (auto& unit : self->units_) unit->release();
        self->root_.release();
      }
    } release_all{this};
    for (auto& unit : units_) unit->gather_whole();  // in the shards' dtype (not gather_half's)
    root_.gather();
    f();
    if (!write_back) return;
    for (auto& unit : units_)
      for (auto& flat : unit->flats) flat->reshard();
    for (auto& flat : root_.flats) flat->reshard();
  }

  /// The blocks of `model`: the items of its outermost ModuleLists and Sequentials, by name.
  static std::vector<std::pair<std::string, torch::nn::Module*>> blocks(torch::nn::Module& model) {
    std::vector<std::pair<std::string, torch::nn::Module*>> out;
    std::vector<std::string> inside;  // prefixes of the lists found
    for (const auto& item : model.named_modules()) {
      const std::string& name = item.key();
      const auto within = [&](const std::string& prefix) { return name.rfind(prefix + ".", 0) == 0; };
      if (std::any_of(inside.begin(), inside.end(), within)) continue;
      torch::nn::Module* m = item.value().get();
      if (dynamic_cast<torch::nn::ModuleListImpl*>(m) == nullptr && dynamic_cast<torch::nn::SequentialImpl*>(m) == nullptr)
        continue;
      inside.push_back(name);
      for (const auto& child : m->named_children()) out.emplace_back(name + "." + child.key(), child.value().get());
    }
    return out;
  }

 private:
  torch::Tensor run(torch::nn::Module& block, const BlockFn& fn, const std::vector<torch::Tensor>& inputs) override {
    const auto it = by_block_.find(&block);
    if (it == by_block_.end() || whole_) return {};
    Unit& unit = *it->second;
    unit.backward_follows = torch::GradMode::is_enabled();
    std::vector<torch::Tensor> all = inputs;
    all.insert(all.end(), unit.replicated.begin(), unit.replicated.end());
    for (const auto& f : unit.flats) all.push_back(f->shard());
    return detail::UnitFunction::apply(&unit, fn, static_cast<int64_t>(inputs.size()), at::TensorList(all));
  }

  template <class F>
  void for_each_flat(F&& f) {
    for (auto& unit : units_)
      for (auto& flat : unit->flats) f(*flat);
    for (auto& flat : root_.flats) f(*flat);
  }

  static void reshard_release(Unit& unit) {
    for (auto& flat : unit.flats) flat->reshard();
    unit.release();
  }

  std::vector<std::unique_ptr<Unit>> units_;  // in model order: every rank gathers in this order
  std::map<const torch::nn::Module*, Unit*> by_block_;
  Unit root_;  // the rest: whole from gather_params() to sync_gradients()
  bool whole_ = false;  // unshard() made every parameter whole (until the next step)
  std::unique_ptr<ShardFile> file_;  // offload_params_dir: the shards' file
};

}  // namespace memopt::dist
