// memopt/dist.hpp — data parallel training, opt-in: include this header (and link
// memopt::dist) and a Trainer started by torchrun as one of several ranks trains on
// dist::world(), summing gradients over the ranks (dist/step_sync.hpp), or with
// TrainerOptions::shard_params sharding parameters too (ZeRO-3, dist/zero3.hpp; alone, it offloads
// them: offload_params_dir, offload_params_host). Without it every
// Trainer trains on its own process. Also brings dist::world(), RankSlice and the collectives.
//   #include <memopt/memopt.hpp>
//   #include <memopt/dist.hpp>
//   auto& world = memopt::dist::world();   // rank(), size(), barrier(), ...
#pragma once

#include <memory>

#include "memopt/dist/data_parallel.hpp"
#include "memopt/dist/env.hpp"
#include "memopt/dist/step_sync.hpp"
#include "memopt/dist/world.hpp"
#include "memopt/dist/zero3.hpp"
#include "memopt/step_sync.hpp"

namespace memopt::dist::detail {
// Makes DataParallel what make_step_sync() builds in a job of several ranks (once per program).
inline const bool data_parallel_registered = [] {
  memopt::detail::data_parallel_factory() = [](const SyncOptions& options) -> std::unique_ptr<StepSync> {
    World& world = dist::world();
    if (options.shard_params) return std::make_unique<Zero3>(world, options);  // a world of one too: offload
    if (!world.distributed()) return std::make_unique<LocalSync>();
    return std::make_unique<DataParallel>(world, options);
  };
  return true;
}();
}  // namespace memopt::dist::detail
