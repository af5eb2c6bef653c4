// memopt/policies/accum.hpp — gradient accumulation policies: how many micro-batches
// make one optimizer step. The Trainer divides every micro-batch's loss sum by the
// number of targets of the whole effective batch, so N micro-batches give the gradient
// of one big batch even when their target counts differ (padding, masked prompts).
// GradCache splits what cannot be split that way — a contrastive batch, whose rows are
// each other's negatives — by caching the loss's gradient with respect to the embeddings.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include "memopt/concepts.hpp"
#include "memopt/detail/checkpoint_function.hpp"  // RngState
#include "memopt/memory/policy_desc.hpp"
#include "memopt/memory/tracker.hpp"

namespace memopt::accum {

/// One micro-batch per step.
struct None {
  static std::string name() { return "accum::None"; }
  static memory::SplitDesc describe() { return {.flag = "none", .fixed_steps = 1}; }
  static constexpr int64_t micro_steps() { return 1; }
};

/// N micro-batches per step, fixed at compile time.
///   memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::Fixed<4>>
template <int64_t N>
struct Fixed {
  static std::string name() { return "accum::Fixed<" + std::to_string(N) + ">"; }
  static_assert(N >= 1, "memopt::accum::Fixed<N>: N must be >= 1 micro-batch per step");
  static memory::SplitDesc describe() { return {.flag = "fixed-" + std::to_string(N), .fixed_steps = N}; }
  static constexpr int64_t micro_steps() { return N; }
};

/// N micro-batches per step, chosen at run time (TrainerOptions::accum_steps).
struct Runtime {
  static std::string name() { return "accum::Runtime"; }
  static memory::SplitDesc describe() { return {.flag = "micro-batches"}; }
  explicit Runtime(int64_t n = 1) : n_(n) {
    TORCH_CHECK(n >= 1, "memopt::accum::Runtime: accumulation steps must be >= 1 (got ", n,
                "). HINT: pass --accum 1 or more.");
  }
  int64_t micro_steps() const { return n_; }

 private:
  int64_t n_;
};

/// Options of GradCache.  accum::GradCache(accum::GradCacheOptions().chunk_size(8))
struct GradCacheOptions {
  /// Rows per encoder chunk (and per chunk of the generative part).
  TORCH_ARG(int64_t, chunk_size) = 8;
  /// GritLM's split_emb instead of chunks: see GradCache.
  TORCH_ARG(bool, split_emb) = false;
  /// Batches (each a whole contrastive batch) accumulated per optimizer step.
  TORCH_ARG(int64_t, micro_steps) = 1;
};

/// Gradient cache (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under
/// Memory Limited Setup"), for a loss satisfying memopt::RepresentationLoss. Per batch:
///   1. the part without a cache (GritLM's generative loss) runs chunk by chunk, forward
///      and backward, each chunk its share of the loss;
///   2. every role's representations are computed chunk by chunk WITHOUT a graph, and the
///      random-number state before each chunk is kept;
///   3. the representation loss is computed on them and differentiated with respect to the
///      representations only (the cache: one (rows, D) tensor per role);
///   4. each chunk runs again WITH a graph from its saved random state (same dropout masks)
///      and backpropagates  sum(representations · cached gradient).
/// The parameter gradients equal those of one backward through the whole batch with the
/// same dropout masks; activations live for one chunk at a time: memory follows the chunk
/// size, not the batch size. The cost is a second encoder forward.
///
/// split_emb (GritLM's --split_emb) instead runs whole roles: a graph-less pass over every
/// role but the last, then the last role with a graph (the others' representations
/// detached), backward; then each earlier role again with a graph from its saved random
/// state, the others detached, backward. The gradients are the same; activations live for
/// one role at a time (GritLM: the passages, then the queries) for one extra forward per
/// earlier role. The generative part still runs in chunks of chunk_size.
///
///   memopt::Trainer<memopt::recompute::None, memopt::precision::Fp32, memopt::accum::GradCache>
///       trainer(model, options, memopt::accum::GradCache(memopt::accum::GradCacheOptions().chunk_size(8)));
class GradCache {
 public:
  static std::string name() { return "accum::GradCache"; }
  static constexpr bool kRunsMicroBatch = true;
  static memory::SplitDesc describe() { return {.flag = "grad-cache", .grad_cache = true}; }

  explicit GradCache(GradCacheOptions options = {}) : options_(options) {
    TORCH_CHECK(options_.chunk_size() >= 1, "memopt::accum::GradCache: chunk_size must be >= 1 (got ",
                options_.chunk_size(), "). HINT: 8 rows per chunk is a good start; the batch size is the upper end.");
    TORCH_CHECK(options_.micro_steps() >= 1, "memopt::accum::GradCache: micro_steps must be >= 1 (got ",
                options_.micro_steps(), "). HINT: 1 takes one contrastive batch per optimizer step.");
  }
  int64_t micro_steps() const { return options_.micro_steps(); }
  const GradCacheOptions& options() const { return options_; }

  /// One batch's forward and backward (see the class comment); returns its loss × scale, detached.
  template <class B, class F, class C, class P>
  torch::Tensor forward_backward(const B& batch, F& fn, const C& ckpt, P& precision, c10::DeviceType device,
                                 const torch::Tensor& scale) const {
    static_assert(RepresentationLoss<F, B, C>,
                  "memopt::accum::GradCache: the loss function must split into stages (roles, rows, encode, "
                  "rep_loss, gen_rows, gen_loss): see memopt::RepresentationLoss in concepts.hpp");
    torch::Tensor loss = generative_part(batch, fn, ckpt, precision, device, scale);  // 0-dim, detached
    loss = loss + (options_.split_emb() ? split_roles(batch, fn, ckpt, precision, device, scale)
                                        : cached_chunks(batch, fn, ckpt, precision, device, scale));
    memory::Tracker::instance().set_phase(memory::Phase::kForward);
    return loss;
  }

 private:
  struct Chunk {
    int64_t role, begin, end;
    detail::RngState rng;  // before the graph-less pass
  };

  template <class B, class F, class C, class P>
  torch::Tensor generative_part(const B& batch, F& fn, const C& ckpt, P& precision, c10::DeviceType device,
                                const torch::Tensor& scale) const {
    auto& tracker = memory::Tracker::instance();
    torch::Tensor loss = torch::zeros({}, scale.options());
    const int64_t rows = fn.gen_rows(batch);
    for (int64_t begin = 0; begin < rows; begin += options_.chunk_size()) {
      const int64_t end = std::min(begin + options_.chunk_size(), rows);
      tracker.set_phase(memory::Phase::kForward);
      torch::Tensor part;
      {
        auto autocast = precision.autocast(device);
        part = fn.gen_loss(batch, begin, end, ckpt).to(torch::kFloat) * scale;  // 0-dim, this chunk's share
      }
      tracker.set_phase(memory::Phase::kBackward);
      precision.backward(part);
      loss += part.detach();
    }
    return loss;
  }

  // Steps 2-4 of the class comment.
  template <class B, class F, class C, class P>
  torch::Tensor cached_chunks(const B& batch, F& fn, const C& ckpt, P& precision, c10::DeviceType device,
                              const torch::Tensor& scale) const {
    auto& tracker = memory::Tracker::instance();
    const int64_t roles = fn.roles(batch);
    if (roles == 0) return torch::zeros({}, scale.options());  // a generative-only batch
    // ---- 2. representations without a graph, the random state of each chunk kept ----
    tracker.set_phase(memory::Phase::kForward);
    std::vector<Chunk> chunks;
    std::vector<torch::Tensor> reps(static_cast<size_t>(roles));  // (rows, D) each, fp32
    {
      torch::NoGradGuard no_grad;
      for (int64_t role = 0; role < roles; ++role) {
        std::vector<torch::Tensor> parts;
        const int64_t rows = fn.rows(batch, role);
        TORCH_CHECK(rows >= 1, "memopt::accum::GradCache: role ", role, " of the batch has no rows (got ", rows,
                    "). HINT: a contrastive batch needs at least one query and one passage.");
        for (int64_t begin = 0; begin < rows; begin += options_.chunk_size()) {
          const int64_t end = std::min(begin + options_.chunk_size(), rows);
          chunks.push_back({role, begin, end, detail::RngState::capture()});
          auto autocast = precision.autocast(device);
          parts.push_back(fn.encode(batch, role, begin, end, ckpt).to(torch::kFloat));  // (end − begin, D)
        }
        reps[static_cast<size_t>(role)] = torch::cat(parts).requires_grad_(true);      // (rows, D)
      }
    }
    const detail::RngState after_first_pass = detail::RngState::capture();
    // ---- 3. the loss on the cached representations; its gradient w.r.t. them is the cache ----
    torch::Tensor rep_loss = fn.rep_loss(batch, reps).to(torch::kFloat) * scale;  // 0-dim
    const std::vector<torch::Tensor> cache = torch::autograd::grad({rep_loss}, reps);  // (rows, D) each
    // ---- 4. each chunk again with a graph, from its random state; backward its cached gradient ----
    for (const Chunk& chunk : chunks) {
      chunk.rng.restore();
      tracker.set_phase(memory::Phase::kForward);
      torch::Tensor surrogate;
      {
        auto autocast = precision.autocast(device);
        torch::Tensor emb = fn.encode(batch, chunk.role, chunk.begin, chunk.end, ckpt).to(torch::kFloat);  // (n, D)
        const auto& grad = cache[static_cast<size_t>(chunk.role)];
        surrogate = (emb * grad.narrow(0, chunk.begin, chunk.end - chunk.begin)).sum();  // 0-dim
      }
      tracker.set_phase(memory::Phase::kBackward);
      precision.backward(surrogate);
    }
    after_first_pass.restore();  // the RNG moves on as after one pass over the batch
    return rep_loss.detach();
  }

  // split_emb (see the class comment).
  template <class B, class F, class C, class P>
  torch::Tensor split_roles(const B& batch, F& fn, const C& ckpt, P& precision, c10::DeviceType device,
                            const torch::Tensor& scale) const {
    auto& tracker = memory::Tracker::instance();
    const int64_t roles = fn.roles(batch);
    if (roles == 0) return torch::zeros({}, scale.options());  // a generative-only batch
    std::vector<torch::Tensor> reps(static_cast<size_t>(roles));
    std::vector<detail::RngState> rng(static_cast<size_t>(roles));
    auto encode = [&](int64_t role) {  // the whole role, (rows, D) fp32
      auto autocast = precision.autocast(device);
      return fn.encode(batch, role, 0, fn.rows(batch, role), ckpt).to(torch::kFloat);
    };
    // ---- every role but the last without a graph, in order, random states kept ----
    tracker.set_phase(memory::Phase::kForward);
    {
      torch::NoGradGuard no_grad;
      for (int64_t role = 0; role + 1 < roles; ++role) {
        rng[static_cast<size_t>(role)] = detail::RngState::capture();
        reps[static_cast<size_t>(role)] = encode(role);
      }
    }
    // ---- then each role with a graph, the others detached: the last first, as it follows in order ----
    torch::Tensor first_loss;
    detail::RngState after_pass;
    for (int64_t role = roles - 1; role >= 0; --role) {
      if (role + 1 < roles) rng[static_cast<size_t>(role)].restore();
      tracker.set_phase(memory::Phase::kForward);
      std::vector<torch::Tensor> inputs = reps;
      inputs[static_cast<size_t>(role)] = encode(role);  // (rows, D) with a graph
      if (role == roles - 1) after_pass = detail::RngState::capture();
      torch::Tensor loss = fn.rep_loss(batch, inputs).to(torch::kFloat) * scale;  // 0-dim
      tracker.set_phase(memory::Phase::kBackward);
      precision.backward(loss);
      reps[static_cast<size_t>(role)] = inputs[static_cast<size_t>(role)].detach();
      if (!first_loss.defined()) first_loss = loss.detach();
    }
    after_pass.restore();
    return first_loss;
  }

  GradCacheOptions options_;
};

}  // namespace memopt::accum
