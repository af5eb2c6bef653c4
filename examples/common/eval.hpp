// examples/common/eval.hpp — the held-out loss the language-model examples report: the mean
// next-token loss per target over the first batches of a held-out shard, read in order.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>

#include <torch/torch.h>

#include <memopt/batch.hpp>
#include <memopt/data/loader.hpp>

namespace examples {

/// sum(loss_sum(batch)) / sum(targets) over the first `max_batches` sequential (B, T) batches
/// of `shard` on `device`, without a graph, the model in eval mode (NaN when there are none).
///   double loss = examples::heldout_loss(*model, val, {8, 256}, 20, device,
///                                        [&](const memopt::Batch& b) { return model->loss_sum(b, ckpt); });
template <class LossSum>
double heldout_loss(torch::nn::Module& model, const std::shared_ptr<const memopt::data::TokenShard>& shard,
                    const memopt::data::LoaderOptions& shape, int64_t max_batches, const torch::Device& device,
                    LossSum&& loss_sum) {
  torch::NoGradGuard no_grad;
  model.eval();
  memopt::data::SequentialLoader loader(shard, shape);
  double sum = 0, count = 0;
  for (int64_t i = 0; i < max_batches && loader.has_next(); ++i) {
    const memopt::Batch batch = loader.next().to(device);  // (B, T)
    sum += loss_sum(batch).template item<double>();
    count += batch.num_targets().template item<double>();
  }
  model.train();
  return count > 0 ? sum / count : std::nan("");
}

}  // namespace examples
