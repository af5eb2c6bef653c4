// memopt/dist/grit_loss.hpp — GritLM's loss (models/gritlm.hpp) with in-batch negatives that
// span the ranks of a data-parallel job: what a Trainer trains a GritLM with, whole or in
// accum::GradCache's stages.
// With several ranks, rep_loss scores this rank's queries (B, C) against every rank's passages
// (N·B·G, C), gathered with their gradient (dist/gather.hpp), so with the Trainer's mean over
// ranks the loss and gradient are those of one process on the global batch. GradCache
// differentiates rep_loss with respect to its cached representations: the gather's backward
// makes that cache the global loss's gradient too. In a world of one every call is the model's.
//   memopt::dist::GatheredGritLoss loss{model, &memopt::dist::world()};
//   trainer.fit(loader, loss);
#pragma once

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "memopt/data/grit.hpp"
#include "memopt/dist/gather.hpp"
#include "memopt/dist/world.hpp"
#include "memopt/models/gritlm.hpp"

namespace memopt::dist {

struct GatheredGritLoss {
  models::GritLM model;
  World* world;

  int64_t roles(const data::GritBatch& b) const { return model->roles(b); }
  int64_t rows(const data::GritBatch& b, int64_t role) const { return model->rows(b, role); }
  template <class Recompute>
  torch::Tensor encode(const data::GritBatch& b, int64_t role, int64_t begin, int64_t end, const Recompute& ckpt) {
    return model->encode(b, role, begin, end, ckpt);  // (end − begin, C)
  }
  /// reps[0] (B, C) this rank's queries, reps[1] (B·G, C) its passages.
  torch::Tensor rep_loss(const data::GritBatch& b, const std::vector<torch::Tensor>& reps) const {
    if (!world->distributed()) return model->rep_loss(b, reps);
    return gathered_contrastive_loss(*world, reps.at(0), reps.at(1), model->options.temperature());
  }
  int64_t gen_rows(const data::GritBatch& b) const { return model->gen_rows(b); }
  template <class Recompute>
  torch::Tensor gen_loss(const data::GritBatch& b, int64_t begin, int64_t end, const Recompute& ckpt) {
    return model->gen_loss(b, begin, end, ckpt);
  }
  /// The whole loss, in GritLMImpl::operator()'s order (generative, then representations).
  template <class Recompute>
  torch::Tensor operator()(const data::GritBatch& b, const Recompute& ckpt) {
    return model->loss_with(b, ckpt, [this](const data::GritBatch& batch, const std::vector<torch::Tensor>& reps) {
      return rep_loss(batch, reps);
    });
  }
};

}  // namespace memopt::dist
