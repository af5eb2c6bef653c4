// memopt/dist/gather.hpp — every rank's rows of a tensor, differentiably: in-batch negatives
// that span the ranks of a data-parallel job (GritLM's cross-rank gather of embeddings).
//   all_gather_with_grad(world, local)    (Σ_r N_r, ...) every rank's rows, in rank order
//   gather_rows_with_grad(world, local)   the same, with where this rank's rows begin
//   gathered_contrastive_loss(world, q, p, τ)
//                                         models::contrastive_loss with every rank's passages
// Backward: rank s's loss L_s reads every rank's rows, so the gradient of Σ_s L_s with respect
// to rank r's rows is the sum over s of what each L_s sends them: one all-reduce of the
// (Σ N, ...) incoming gradient, then r's slice. A data-parallel Trainer divides each rank's loss
// by the global target count and sums the parameter gradients over the ranks
// (dist/step_sync.hpp): with data::GritBatch (num_targets 1) that is the ranks' mean loss, and
// with equal rows per rank the parameters get the gradient of the global batch's mean loss.
// Rules: both directions are collectives, so every rank gathers the same number of times in the
// same order, and every rank backpropagates through the gathered rows or none does. Ranks may
// hold different N: the sizes travel first (one small all-gather), rows are padded to the
// largest N. CPU bf16/fp16 rows travel as fp32 (Gloo; see World::all_reduce_sum).
//   auto all = memopt::dist::all_gather_with_grad(memopt::dist::world(), passages);  // (Σ N, D)
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "memopt/dist/world.hpp"

namespace memopt::dist {

/// Every rank's rows in rank order, and where this rank's begin.
struct GatheredRows {
  torch::Tensor rows;           // (Σ_r N_r, ...)
  int64_t begin = 0;            // this rank's first row in `rows`
  std::vector<int64_t> counts;  // N_r of each rank
};

namespace detail {

// `t` as it travels: contiguous, CPU bf16/fp16 widened to fp32. `copy`: never `t`'s own storage.
inline torch::Tensor on_wire(const torch::Tensor& t, bool copy = false) {
  const bool widen = !t.is_cuda() && (t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf);
  return t.to(widen ? torch::kFloat : t.scalar_type(), /*non_blocking=*/false, copy).contiguous();
}

// The forward gathers (padded to the largest N, cut back to counts[r]); the backward all-reduces
// the gradient and returns this rank's slice. `world`, `begin` and N ride in saved_data (the
// World as an address: an IValue holds no raw pointer).
class AllGatherRows : public torch::autograd::Function<AllGatherRows> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& local, World* world,
                               const std::vector<int64_t>& counts, int64_t begin) {
    ctx->saved_data["world"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(world));
    ctx->saved_data["begin"] = begin;
    ctx->saved_data["count"] = local.size(0);
    const int64_t most = *std::max_element(counts.begin(), counts.end());
    if (most == 0) return local.clone();  // no rows anywhere: nothing to send
    torch::Tensor send = on_wire(local);  // (N, ...)
    if (send.size(0) < most) {
      auto pad = send.sizes().vec();
      pad[0] = most - send.size(0);
      send = torch::cat({send, send.new_zeros(pad)});  // (most, ...)
    }
    std::vector<torch::Tensor> parts = world->all_gather(send, "all_gather_with_grad");  // world × (most, ...)
    for (size_t r = 0; r < parts.size(); ++r) parts[r] = parts[r].narrow(0, 0, counts[r]);
    return torch::cat(parts).to(local.scalar_type());  // (Σ N, ...)
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* world = reinterpret_cast<World*>(static_cast<intptr_t>(ctx->saved_data["world"].toInt()));
    const torch::Tensor& grad = grads.at(0);            // (Σ N, ...) this rank's loss's
    torch::Tensor sum = on_wire(grad, /*copy=*/true);  // summed in place: not the engine's buffer
    world->all_reduce_sum({sum}, "all_gather_with_grad backward");
    torch::Tensor mine = sum.narrow(0, ctx->saved_data["begin"].toInt(), ctx->saved_data["count"].toInt());
    return {mine.to(grad.scalar_type()), torch::Tensor(), torch::Tensor(), torch::Tensor()};  // (N, ...)
  }
};

}  // namespace detail

/// Every rank's rows of `local` (N_r, ...), concatenated in rank order, differentiable (see
/// the file comment); the rows after dim 0 and the dtype must match on every rank. A world of
/// one returns `local` itself. One all-gather of the sizes, one of the rows; backward one all-reduce.
inline GatheredRows gather_rows_with_grad(World& world, const torch::Tensor& local) {
  TORCH_CHECK(local.defined() && local.dim() >= 1, "memopt::dist::all_gather_with_grad: `local` must be a tensor of "
              "rows, (N, ...) (got ", local.defined() ? "a 0-dim tensor" : "an undefined tensor",
              "). HINT: unsqueeze(0) a single row");
  if (!world.distributed()) return {local, 0, {local.size(0)}};
  // ---- the sizes first: N, and what must agree (dims, elements per row, dtype) ----
  const auto sizes = local.sizes();
  const int64_t per_row = c10::multiply_integers(sizes.begin() + 1, sizes.end());
  const torch::Tensor mine =  // (4,) on the CPU: Gloo
      torch::tensor({local.size(0), local.dim(), per_row, static_cast<int64_t>(local.scalar_type())}, torch::kLong);
  const std::vector<torch::Tensor> all = world.all_gather(mine, "all_gather_with_grad sizes");
  auto describe = [](const torch::Tensor& t) {
    return c10::str(t[1].item<int64_t>(), " dims, ", t[2].item<int64_t>(), " elements per row, ",
                    static_cast<c10::ScalarType>(t[3].item<int64_t>()));
  };
  GatheredRows out;
  for (int r = 0; r < world.size(); ++r) {
    const torch::Tensor& theirs = all[static_cast<size_t>(r)];
    TORCH_CHECK(torch::equal(theirs.narrow(0, 1, 3), mine.narrow(0, 1, 3)), "memopt::dist::all_gather_with_grad: rank ",
                r, "'s rows have ", describe(theirs), ", rank ", world.rank(), "'s ", describe(mine), " (", sizes,
                "). HINT: every rank must gather rows of the same width and dtype (e.g. its embeddings in fp32)");
    out.counts.push_back(theirs[0].item<int64_t>());
    if (r < world.rank()) out.begin += out.counts.back();
  }
  out.rows = detail::AllGatherRows::apply(local, &world, out.counts, out.begin);  // (Σ N, ...)
  return out;
}

/// gather_rows_with_grad(world, local).rows: (Σ_r N_r, ...) every rank's rows in rank order.
inline torch::Tensor all_gather_with_grad(World& world, const torch::Tensor& local) {
  return gather_rows_with_grad(world, local).rows;
}

/// GritLM's contrastive loss (the computation of models::contrastive_loss) with every rank's
/// passages as in-batch negatives: this rank's q (B, D) against the gathered p (Σ_r B_r·G, D),
/// scores q pᵀ / τ, the target of query i its own positive at row begin + i·G, cross-entropy
/// averaged over this rank's queries. Queries are not gathered: GritLM scores queries against
/// passages only. A world of one gives models::contrastive_loss(q, p, τ).
///   auto loss = memopt::dist::gathered_contrastive_loss(memopt::dist::world(), q, p, 0.02);
inline torch::Tensor gathered_contrastive_loss(World& world, const torch::Tensor& q, const torch::Tensor& p,
                                               double temperature) {
  const int64_t B = q.size(0);
  TORCH_CHECK(B >= 1 && p.size(0) % B == 0, "memopt::dist::gathered_contrastive_loss: passages must be a whole "
              "number of groups per query (got ", B, " queries and ", p.size(0), " passages). HINT: each query needs "
              "group_size passages.");
  const GatheredRows all = gather_rows_with_grad(world, p.to(torch::kFloat));    // (Σ B_r·G, D)
  auto scores = torch::matmul(q.to(torch::kFloat), all.rows.t()) / temperature;  // (B, Σ B_r·G)
  auto target =                                                                   // (B,)
      torch::arange(B, torch::TensorOptions().dtype(torch::kLong).device(q.device())) * (p.size(0) / B) + all.begin;
  return torch::nn::functional::cross_entropy(scores, target);  // 0-dim, mean over this rank's queries
}

}  // namespace memopt::dist
