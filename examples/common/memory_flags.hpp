// examples/common/memory_flags.hpp — the memory levers every example spells alike, besides the
// policies (policy_flags.hpp):
//   --attention math|blockwise|sdpa|flash|auto   which attention the model runs (memopt/nn/attention.hpp)
//   --release_cache_every N           every N steps, on every rank (after a barrier when data
//                                     parallel), give freed memory back: malloc_trim on CPU, the
//                                     CUDA caching allocator's cache in CUDA builds (0: never)
//   --mlp_tiles N                     a LLaMA block's SwiGLU in N row tiles, each recomputed in
//                                     backward (LlamaConfig::mlp_row_tiles; 1: whole)
//   --preserve_rng_state true|false   checkpointed blocks save and replay the RNG state (true;
//                                     false skips it: exact only for a model without dropout)
#pragma once

#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include <memopt/callbacks.hpp>
#include <memopt/dist.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/trainer_options.hpp>

namespace examples {

struct MemoryFlags {
  std::string attention = "math";
  int64_t release_cache_every = 0;
  bool preserve_rng_state = true;
  int64_t mlp_tiles = 1;

  /// Adds the flags; `release_default` is the example's default of --release_cache_every.
  void add_to(CLI::App& app, int64_t release_default = 0) {
    release_cache_every = release_default;
    app.add_option("--attention", attention,
                   "math: (B, H, T, T) scores, dropout allowed | blockwise: memory linear in T | sdpa: LibTorch's "
                   "scaled_dot_product_attention (its flash / memory-efficient kernels where they apply) | flash: "
                   "memopt's brgemm flash attention (CPU; sdpa elsewhere) | auto: the fastest of sdpa, flash and "
                   "blockwise on each shape, measured on its first step")
        ->capture_default_str();
    app.add_option("--release_cache_every", release_cache_every,
                   "steps between releases of freed memory on every rank (malloc_trim; CUDA builds: "
                   "empty_cache), after a barrier when data parallel (0: never)")
        ->capture_default_str();
    app.add_option("--mlp_tiles", mlp_tiles,
                   "a LLaMA block's SwiGLU over its rows (B*T) in this many tiles, each recomputed in backward: no "
                   "(B, T, ffn) activation kept, one tile's held in backward, for one more pass of its matmuls")
        ->capture_default_str();
    app.add_option("--preserve_rng_state", preserve_rng_state,
                   "checkpointed blocks save the RNG state and replay it in the recompute, so dropout draws the "
                   "same masks (PyTorch's preserve_rng_state); false skips the save: exact only without dropout")
        ->capture_default_str();
  }

  /// `options` with --preserve_rng_state.
  memopt::TrainerOptions options(memopt::TrainerOptions options) const {
    return options.preserve_rng_state(preserve_rng_state);
  }

  /// --attention as the model's AttentionKind; an error naming `who` and the value otherwise.
  memopt::nn::AttentionKind attention_kind(const char* who) const {
    return memopt::nn::parse_attention_kind(attention, std::string(who) + ": --attention");
  }

  /// Both flags' values, checked before any data is read: an error naming `who` and the value.
  void check(const char* who) const {
    (void)attention_kind(who);
    TORCH_CHECK(release_cache_every >= 0, who, ": --release_cache_every must be >= 0 (got ", release_cache_every,
                "). HINT: 10 releases every 10 steps; 0 never");
    TORCH_CHECK(mlp_tiles >= 1, who, ": --mlp_tiles must be >= 1 (got ", mlp_tiles,
                "). HINT: 1 runs the MLP whole; 4 or 8 keep a quarter or an eighth of its activations");
  }

  /// `config` with --attention and --mlp_tiles applied (checked, naming `who`).
  memopt::models::LlamaConfig apply(memopt::models::LlamaConfig config, const char* who) const {
    check(who);
    return config.attention_kind(attention_kind(who)).mlp_row_tiles(mlp_tiles);
  }

  /// Adds the cache release to `trainer` when asked: on every rank, with a barrier before the
  /// release when the job has several ranks (so no rank frees while another still reduces).
  template <class TrainerT>
  void attach(TrainerT& trainer, const char* who) const {
    check(who);
    if (release_cache_every == 0) return;
    auto& world = memopt::dist::world();
    std::function<void()> barrier;
    if (world.distributed()) barrier = [&world] { world.barrier("release cache"); };
    trainer.add_callback(std::make_shared<memopt::callbacks::ReleaseCache>(release_cache_every, std::move(barrier)));
  }
};

}  // namespace examples
