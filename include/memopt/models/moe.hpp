// memopt/models/moe.hpp — a Mixture-of-Experts language model: LLaMA blocks whose MLP is
// a MoE layer of E SwiGLU experts with top-k routing (Mixtral's layout and parameter
// names: model.layers.N.block_sparse_moe.gate / .experts.M.*).
//
// Routing, per token, in fp32 whatever the autocast: logits = gate(x) (optionally with
// Switch's multiplicative jitter on x while training), probs = softmax(logits), the k
// most probable experts are chosen and their probabilities renormalised to sum to 1
// (the gates).
//
// Capacity: each expert takes at most C = ceil(capacity_factor · k · tokens / E)
// assignments per forward; capacity_factor <= 0 is dropless. Priority (GShard's): every
// token's first choice before any token's second choice, and within a choice earlier
// tokens first (row-major over (B, T)). An assignment over capacity is dropped: it
// contributes nothing, the gates of the kept ones are not renormalised, and a token
// that lost all of its assignments leaves the layer as zero, so the residual carries it.
//
// Dispatch (MoeDispatch):
//   kSorted  — the k·N assignments are sorted by expert id (stable, so in priority
//              order), each expert runs on its contiguous slice of gathered tokens, and
//              the gated outputs are scatter-added back. Memory is linear in tokens: no
//              tensor of shape tokens × experts × capacity exists.
//   kDense   — GShard/Switch's one-hot dispatch and combine tensors (N, E, C), einsum in
//              and out: memory quadratic in tokens (C grows with N). The test reference
//              and the "original" of the memory benchmark.
//
// Losses, each averaged over the MoE layers:
//   load balancing (Switch): E · Σ_i f_i · P_i, f_i = the fraction of the k·N top-k
//     assignments routed to expert i (before capacity drops; Σ f = 1), P_i = the mean
//     router probability of expert i. It is 1 under uniform routing and at balance.
//   router z-loss (ST-MoE): mean over tokens of logsumexp(logits)².
// loss_sum() adds n_targets · (aux_loss_coef · lb + z_loss_coef · z) to the summed
// cross-entropy, so after the Trainer's division by the effective batch's targets the
// aux terms enter with their coefficients, token-weighted across micro-batches.
//
// A checkpointed block has one output tensor, so a block returns its hidden state and
// its router statistics packed in one flat tensor (MoeBlockOutput::pack/unpack): the
// aux losses then get their gradients under any recompute policy.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "memopt/batch.hpp"
#include "memopt/concepts.hpp"
#include "memopt/detail/autocast.hpp"
#include "memopt/detail/checkpoint_function.hpp"
#include "memopt/models/llama.hpp"
#include "memopt/nn/cross_entropy.hpp"
#include "memopt/nn/mlp.hpp"
#include "memopt/policies/recompute.hpp"

namespace memopt::models {

/// How tokens reach their experts (see the file comment).
enum class MoeDispatch { kSorted, kDense };

/// Options of one MoE layer.  MoeLayer(MoeLayerOptions(256, 512).num_experts(4).top_k(2))
struct MoeLayerOptions {
  MoeLayerOptions(int64_t hidden_size, int64_t intermediate_size)
      : hidden_size_(hidden_size), intermediate_size_(intermediate_size) {}
  TORCH_ARG(int64_t, hidden_size);
  /// Of each expert's SwiGLU.
  TORCH_ARG(int64_t, intermediate_size);
  TORCH_ARG(int64_t, num_experts) = 4;
  TORCH_ARG(int64_t, top_k) = 2;
  /// Assignments per expert = ceil(capacity_factor · top_k · tokens / num_experts); <= 0: dropless.
  TORCH_ARG(double, capacity_factor) = 1.25;
  /// Switch's jitter: while training the router sees x · U(1 − eps, 1 + eps); 0: off.
  TORCH_ARG(double, router_jitter) = 0.0;
  TORCH_ARG(MoeDispatch, dispatch) = MoeDispatch::kSorted;
  /// Recompute each expert's SwiGLU in backward (keeps only the expert's gathered input).
  TORCH_ARG(bool, checkpoint_experts) = false;

 public:
  /// Assignments an expert may take out of `tokens` tokens; 0 means no limit.
  int64_t capacity(int64_t tokens) const {
    if (!(capacity_factor_ > 0)) return 0;
    return static_cast<int64_t>(std::ceil(capacity_factor_ * static_cast<double>(top_k_ * tokens) /
                                          static_cast<double>(num_experts_)));
  }

  void validate() const {
    TORCH_CHECK(num_experts_ >= 1, "memopt::models::MoE: num_experts must be >= 1 (got ", num_experts_,
                "). HINT: moe-nano uses 4.");
    TORCH_CHECK(top_k_ >= 1 && top_k_ <= num_experts_, "memopt::models::MoE: top_k must lie in [1, num_experts = ",
                num_experts_, "] (got ", top_k_, "). HINT: 2 is usual; 1 is Switch routing.");
    TORCH_CHECK(std::isfinite(capacity_factor_), "memopt::models::MoE: capacity_factor must be a finite number (got ",
                capacity_factor_, "). HINT: 1.25 is usual; 0 or less means dropless.");
    TORCH_CHECK(router_jitter_ >= 0 && router_jitter_ < 1, "memopt::models::MoE: router_jitter must lie in [0, 1) (got ",
                router_jitter_, "). HINT: 0 turns it off; Switch used 0.01.");
    TORCH_CHECK(hidden_size_ >= 1 && intermediate_size_ >= 1,
                "memopt::models::MoE: hidden_size and intermediate_size must be >= 1 (got ", hidden_size_, " and ",
                intermediate_size_, ").");
  }
};

/// What the router decided for N tokens.
struct Routing {
  torch::Tensor logits;   // (N, E) fp32
  torch::Tensor probs;    // (N, E) fp32, softmax of the logits
  torch::Tensor experts;  // (N, k) int64, the chosen experts, most probable first
  torch::Tensor gates;    // (N, k) fp32, their probabilities renormalised to sum to 1
};

/// One MoE layer's output for N tokens.
struct MoeLayerOutput {
  torch::Tensor y;          // (N, C) in x's dtype; zero for a token that lost every assignment
  torch::Tensor lb_loss;    // 0-dim fp32: load-balancing loss (1 when balanced)
  torch::Tensor z_loss;     // 0-dim fp32: router z-loss
  torch::Tensor load;       // (E) fp32, no grad: fraction of the top-k assignments per expert
  torch::Tensor dropped;    // 0-dim fp32, no grad: fraction of the assignments over capacity
};

/// Router + experts. Input (N, C) tokens.
class MoeLayerImpl : public torch::nn::Cloneable<MoeLayerImpl> {
 public:
  explicit MoeLayerImpl(MoeLayerOptions options) : options(validated(options)) { reset(); }
  void reset() override {
    gate = register_module("gate", torch::nn::Linear(torch::nn::LinearOptions(options.hidden_size(),
                                                                              options.num_experts())
                                                         .bias(false)));
    experts = register_module("experts", torch::nn::ModuleList());
    for (int64_t e = 0; e < options.num_experts(); ++e)
      experts->push_back(nn::SwiGLU(nn::SwiGLUOptions(options.hidden_size(), options.intermediate_size())));
  }

  MoeLayerOutput forward(const torch::Tensor& x) { return forward(x, recompute::None{}); }

  /// x (N, C) -> MoeLayerOutput; recompute::Selective recomputes the experts' SwiGLU products.
  template <RecomputePolicy Recompute>
  MoeLayerOutput forward(const torch::Tensor& x, const Recompute& ckpt) {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == options.hidden_size(), "memopt::models::MoeLayer: input must be (N, ",
                options.hidden_size(), ") (got ", x.sizes(), ").");
    const Routing r = route(x);
    const int64_t N = x.size(0), E = options.num_experts(), k = options.top_k();
    auto slot_expert = r.experts.t().reshape({-1});                           // (k·N) slot s = rank · N + token
    auto counts = torch::bincount(slot_expert, {}, E);                        // (E) assignments per expert
    MoeLayerOutput out;
    out.y = options.dispatch() == MoeDispatch::kSorted ? dispatch_sorted(x, r, slot_expert, counts, ckpt)
                                                       : dispatch_dense(x, r, slot_expert, ckpt);  // (N, C)
    out.load = counts.to(torch::kFloat) / static_cast<double>(k * N);        // (E), sums to 1
    out.lb_loss = static_cast<double>(E) * (out.load * r.probs.mean(0)).sum();  // 0-dim
    out.z_loss = torch::logsumexp(r.logits, -1).square().mean();            // 0-dim
    const int64_t cap = options.capacity(N);
    out.dropped = cap > 0 ? (counts - counts.clamp_max(cap)).sum().to(torch::kFloat) / static_cast<double>(k * N)
                          : torch::zeros({}, torch::TensorOptions().device(x.device()));
    return out;
  }

  /// The router, in fp32 with autocast off.  x (N, C) -> Routing
  Routing route(const torch::Tensor& x) {
    memopt::detail::AutocastGuard fp32({x.device().type(), false, c10::kBFloat16});
    auto xr = x.to(torch::kFloat);  // (N, C)
    if (is_training() && options.router_jitter() > 0)
      xr = xr * torch::empty_like(xr).uniform_(1.0 - options.router_jitter(), 1.0 + options.router_jitter());
    Routing r;
    r.logits = torch::linear(xr, gate->weight.to(torch::kFloat));  // (N, E)
    r.probs = torch::softmax(r.logits, -1);                        // (N, E)
    auto [top_p, top_e] = r.probs.topk(options.top_k(), -1);       // (N, k) each, most probable first
    r.experts = top_e;
    r.gates = top_p / top_p.sum(-1, /*keepdim=*/true);  // (N, k)
    return r;
  }

  MoeLayerOptions options;
  torch::nn::Linear gate{nullptr};
  torch::nn::ModuleList experts{nullptr};

 private:
  static MoeLayerOptions validated(MoeLayerOptions o) {
    o.validate();
    return o;
  }

  // Sort the assignments by expert (stable: priority order within an expert), keep the
  // first `capacity` of each, gather their tokens, run each expert on its slice, scale by
  // the gates and scatter-add into the output.
  template <RecomputePolicy Recompute>
  torch::Tensor dispatch_sorted(const torch::Tensor& x, const Routing& r, const torch::Tensor& slot_expert,
                                const torch::Tensor& counts, const Recompute& ckpt) {
    const int64_t N = x.size(0), kN = slot_expert.size(0);
    auto order = std::get<1>(slot_expert.sort(/*stable=*/true, 0, false));        // (k·N) slots grouped by expert
    auto starts = counts.cumsum(0) - counts;                                      // (E) first sorted slot of each
    auto rank_in_expert = torch::arange(kN, order.options()) -
                          starts.index_select(0, slot_expert.index_select(0, order));  // (k·N)
    const int64_t cap = options.capacity(N);
    auto kept = cap > 0 ? order.masked_select(rank_in_expert < cap) : order;      // (M) kept slots, by expert
    auto kept_counts = (cap > 0 ? counts.clamp_max(cap) : counts).to(torch::kCPU).contiguous();  // (E) host sync
    auto tokens = kept.remainder(N);                                              // (M)
    auto gates = r.gates.t().reshape({-1}).index_select(0, kept);                 // (M) fp32
    auto xs = x.index_select(0, tokens);                                          // (M, C) gathered
    const auto* n_kept = kept_counts.data_ptr<int64_t>();
    const std::vector<int64_t> sizes(n_kept, n_kept + kept_counts.numel());
    auto slices = xs.split_with_sizes(sizes);  // its backward concatenates the slices' gradients
    std::vector<torch::Tensor> ys;
    for (int64_t e = 0; e < options.num_experts(); ++e)
      if (sizes[e] > 0) ys.push_back(run_expert(e, slices[e], ckpt));           // (n_e, C)
    auto y = (torch::cat(ys) * gates.unsqueeze(1)).to(x.scalar_type());          // (M, C)
    return torch::zeros_like(x).index_add(0, tokens, y);                          // (N, C)
  }

  // GShard's dense dispatch: one-hot (N, E, C) dispatch and combine tensors.
  template <RecomputePolicy Recompute>
  torch::Tensor dispatch_dense(const torch::Tensor& x, const Routing& r, const torch::Tensor& slot_expert,
                               const Recompute& ckpt) {
    const int64_t N = x.size(0), E = options.num_experts(), k = options.top_k();
    const int64_t cap = options.capacity(N) > 0 ? options.capacity(N) : N;
    auto mask = torch::one_hot(slot_expert, E);                                // (k·N, E) int64, priority order
    auto position = (mask.cumsum(0) - 1) * mask;                               // (k·N, E) place in its expert
    auto keep = mask * position.lt(cap);                                       // (k·N, E)
    auto place = torch::one_hot(position.sum(1).clamp_max(cap - 1), cap);     // (k·N, C)
    auto slot_dispatch = keep.to(x.scalar_type()).unsqueeze(2) * place.to(x.scalar_type()).unsqueeze(1);  // (k·N, E, C)
    auto dispatch = slot_dispatch.view({k, N, E, cap}).sum(0);                                  // (N, E, C)
    auto combine = (slot_dispatch * r.gates.t().reshape({-1, 1, 1})).view({k, N, E, cap}).sum(0);  // (N, E, C)
    auto expert_in = torch::einsum("nec,nd->ecd", {dispatch, x});              // (E, C, D)
    std::vector<torch::Tensor> outs;
    for (int64_t e = 0; e < E; ++e) outs.push_back(run_expert(e, expert_in[e], ckpt));  // (C, D)
    auto expert_out = torch::stack(outs);                                       // (E, C, D)
    return torch::einsum("nec,ecd->nd", {combine.to(expert_out.scalar_type()), expert_out}).to(x.scalar_type());
  }

  template <RecomputePolicy Recompute>
  torch::Tensor run_expert(int64_t e, const torch::Tensor& xe, const Recompute& ckpt) {
    auto expert = experts->ptr<nn::SwiGLUImpl>(e);
    if (!options.checkpoint_experts()) return expert->forward(xe, ckpt);
    return memopt::detail::checkpointed(
        [expert](const std::vector<torch::Tensor>& in) { return expert->forward(in[0]); }, {xe},
        memopt::detail::trainable(*expert));
  }
};
TORCH_MODULE(MoeLayer);

/// A MoE LM's size and options: the LLaMA parts (`base`: attention, norms, vocabulary,
/// layers) plus the MoE layer's. base.intermediate_size is each expert's SwiGLU width.
///   auto cfg = MoeConfig::preset("moe-nano", 4096);
struct MoeConfig {
  TORCH_ARG(LlamaConfig, base);
  TORCH_ARG(int64_t, num_experts) = 4;
  TORCH_ARG(int64_t, top_k) = 2;
  TORCH_ARG(double, capacity_factor) = 1.25;
  TORCH_ARG(double, router_jitter) = 0.0;
  /// Coefficient of the load-balancing loss (Switch: 0.01).
  TORCH_ARG(double, aux_loss_coef) = 0.01;
  /// Coefficient of the router z-loss (ST-MoE: 0.001).
  TORCH_ARG(double, z_loss_coef) = 0.001;
  TORCH_ARG(MoeDispatch, dispatch) = MoeDispatch::kSorted;
  TORCH_ARG(bool, checkpoint_experts) = false;

 public:
  /// The presets, smallest first:
  /// (parameters at vocab 4096, untied head; active = a token's: top-2 of the experts)
  ///   moe-nano   d256, 4 layers, 8 heads, 4 experts × SwiGLU 512, top-2   9.4 M,   6.3 M active
  ///   moe-micro  d384, 6 layers, 6 heads, 8 experts × SwiGLU 768, top-2   49.2 M, 17.3 M active
  ///   moe-mini   d512, 8 layers, 8 heads, 8 experts × SwiGLU 1024, top-2  113.3 M, 37.8 M active
  static MoeConfig preset(const std::string& name, int64_t vocab_size) {
    auto make = [&](int64_t dim, int64_t layers, int64_t heads, int64_t experts, int64_t ffn) {
      return MoeConfig()
          .base(LlamaConfig()
                    .vocab_size(vocab_size)
                    .hidden_size(dim)
                    .num_hidden_layers(layers)
                    .num_attention_heads(heads)
                    .intermediate_size(ffn)
                    .max_position_embeddings(1024))
          .num_experts(experts)
          .top_k(2);
    };
    if (name == "moe-nano") return make(256, 4, 8, 4, 512);
    if (name == "moe-micro") return make(384, 6, 6, 8, 768);
    if (name == "moe-mini") return make(512, 8, 8, 8, 1024);
    TORCH_CHECK(false, "memopt::models::MoeConfig: unknown preset '", name, "'. HINT: the presets are ",
                preset_names(), ".");
  }
  static std::string preset_names() { return "moe-nano, moe-micro, moe-mini"; }

  MoeLayerOptions layer_options() const {
    return MoeLayerOptions(base_.hidden_size(), base_.ffn_size())
        .num_experts(num_experts_)
        .top_k(top_k_)
        .capacity_factor(capacity_factor_)
        .router_jitter(router_jitter_)
        .dispatch(dispatch_)
        .checkpoint_experts(checkpoint_experts_);
  }

  /// The dense LLaMA with the same active parameters per token: SwiGLU width top_k × the expert's.
  LlamaConfig dense_equivalent() const { return LlamaConfig(base_).intermediate_size(top_k_ * base_.ffn_size()); }

  void validate() const {
    base_.validate();
    TORCH_CHECK(!base_.tie_word_embeddings(), "memopt::models::MoeConfig: MoeLM has its own lm_head (got base "
                "tie_word_embeddings true). HINT: set tie_word_embeddings(false); tying is models::Llama's.");
    layer_options().validate();
    TORCH_CHECK(aux_loss_coef_ >= 0 && z_loss_coef_ >= 0 && std::isfinite(aux_loss_coef_) &&
                    std::isfinite(z_loss_coef_),
                "memopt::models::MoeConfig: aux_loss_coef and z_loss_coef must be finite and >= 0 (got ",
                aux_loss_coef_, " and ", z_loss_coef_, "). HINT: 0.01 and 0.001 are usual.");
  }
};

/// This model's shape as the memory estimator and the planner see it (sorted dispatch only).
inline memory::ModelDesc describe(const MoeConfig& c) {
  TORCH_CHECK(c.dispatch() == MoeDispatch::kSorted, "memopt::models::describe(MoeConfig): the estimator models "
              "the sorted dispatch (got the dense one). HINT: estimate with MoeDispatch::kSorted; the dense "
              "dispatch adds (tokens, experts, capacity) one-hot tensors.");
  memory::ModelDesc d = describe(c.base());
  d.mlp_row_tiles = 1;  // the experts run whole (no SwiGLU row tiles)
  d.num_experts = c.num_experts();
  d.top_k = c.top_k();
  d.checkpoint_experts = c.checkpoint_experts();
  return d;
}

/// A block's output and router statistics, packed in one flat tensor (a checkpointed
/// block has one output): [ h (B·T·C) | lb_loss | z_loss | dropped | load (E) ].
struct MoeBlockOutput {
  torch::Tensor hidden;   // (B, T, C)
  torch::Tensor lb_loss;  // 0-dim
  torch::Tensor z_loss;   // 0-dim
  torch::Tensor dropped;  // 0-dim, no grad
  torch::Tensor load;     // (E), no grad

  static torch::Tensor pack(const torch::Tensor& hidden, const MoeLayerOutput& moe) {
    const auto dtype = hidden.scalar_type();
    return torch::cat({hidden.reshape({-1}), moe.lb_loss.reshape({1}).to(dtype), moe.z_loss.reshape({1}).to(dtype),
                       moe.dropped.reshape({1}).to(dtype), moe.load.to(dtype)});
  }
  static MoeBlockOutput unpack(const torch::Tensor& packed, c10::IntArrayRef hidden_shape) {
    const int64_t n = c10::multiply_integers(hidden_shape);
    auto stats = packed.narrow(0, n, packed.size(0) - n).to(torch::kFloat);  // (3 + E)
    return {packed.narrow(0, 0, n).view(hidden_shape), stats[0], stats[1], stats[2].detach(),
            stats.narrow(0, 3, stats.size(0) - 3).detach()};
  }
};

/// One MoE decoder block: h = x + attn(norm(x)); y = h + moe(norm(h)).
class MoeDecoderLayerImpl : public torch::nn::Cloneable<MoeDecoderLayerImpl> {
 public:
  explicit MoeDecoderLayerImpl(MoeConfig config) : config(config) { reset(); }
  void reset() override {
    const auto& base = config.base();
    self_attn = register_module("self_attn", nn::Attention(base.attention_options()));
    block_sparse_moe = register_module("block_sparse_moe", MoeLayer(config.layer_options()));
    input_layernorm =
        register_module("input_layernorm", nn::RMSNorm(base.norm_options()));
    post_attention_layernorm = register_module(
        "post_attention_layernorm", nn::RMSNorm(base.norm_options()));
  }

  /// x (B, T, C), cos/sin (T, D) -> MoeBlockOutput::pack(y (B, T, C), router statistics)
  template <RecomputePolicy Recompute>
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const Recompute& ckpt) {
    const double p = config.base().dropout();
    auto a = self_attn->forward(cheap_norm(ckpt, input_layernorm, x), cos, sin, ckpt);      // (B, T, C)
    auto h = x + torch::dropout(a, p, is_training());                                       // (B, T, C)
    auto normed = cheap_norm(ckpt, post_attention_layernorm, h);                            // (B, T, C)
    auto moe = block_sparse_moe->forward(normed.reshape({-1, normed.size(-1)}), ckpt);     // (B·T, C)
    auto y = h + torch::dropout(moe.y.view(h.sizes()), p, is_training());                  // (B, T, C)
    return MoeBlockOutput::pack(y, moe);
  }

  MoeConfig config;
  nn::Attention self_attn{nullptr};
  MoeLayer block_sparse_moe{nullptr};
  nn::RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};
TORCH_MODULE(MoeDecoderLayer);

/// Router statistics summed over forwards (MoeLM::take_stats() averages and resets).
struct MoeStats {
  int64_t forwards = 0;
  double lb_loss = 0;   // mean over layers and forwards
  double z_loss = 0;
  double dropped = 0;   // fraction of assignments over capacity
  std::vector<double> load;  // (E) fraction of assignments per expert, mean over layers
};

/// The MoE language model: model.embed_tokens, model.layers.N (MoE blocks), model.norm, lm_head.
///   memopt::models::MoeLM model(memopt::models::MoeConfig::preset("moe-nano", 4096));
///   auto loss = model->loss_sum(batch, memopt::recompute::EveryBlock{});  // CE sum + aux terms
class MoeLMImpl : public torch::nn::Cloneable<MoeLMImpl> {
 public:
  explicit MoeLMImpl(MoeConfig config) : config(config) {
    config.validate();
    reset();
  }
  void reset() override {
    const auto& base = config.base();
    model = register_module("model", std::make_shared<torch::nn::Module>());
    embed_tokens = model->register_module("embed_tokens", torch::nn::Embedding(base.vocab_size(), base.hidden_size()));
    layers = model->register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < base.num_hidden_layers(); ++i) layers->push_back(MoeDecoderLayer(config));
    norm = model->register_module("norm",
                                  nn::RMSNorm(base.norm_options()));
    lm_head = register_module(
        "lm_head", torch::nn::Linear(torch::nn::LinearOptions(base.hidden_size(), base.vocab_size()).bias(false)));
    torch::NoGradGuard no_grad;
    for (auto& item : named_parameters())
      if (item.value().dim() >= 2) item.value().normal_(0.0, base.initializer_range());
    reset_stats();
  }

  /// tokens (B, T) -> final hidden states (B, T, C), with the layers' mean aux losses.
  template <RecomputePolicy Recompute>
  MoeBlockOutput forward_hidden(const torch::Tensor& tokens, const Recompute& ckpt) {
    const auto& base = config.base();
    const int64_t T = tokens.size(1);
    base.check_seq_len(T, "memopt::models::MoeLM");
    auto [cos, sin] = nn::rope_tables(T, base.rope(), tokens.device());  // (T, D) each
    auto x = embed_tokens(tokens);                                        // (B, T, C)
    MoeBlockOutput sum;
    const auto L = static_cast<int64_t>(layers->size());
    for (int64_t i = 0; i < L; ++i) {
      auto layer = layers->ptr<MoeDecoderLayerImpl>(i);
      auto packed = ckpt.run_block(
          i, *layer,
          [layer, ckpt](const std::vector<torch::Tensor>& in) { return layer->forward(in[0], in[1], in[2], ckpt); },
          {x, cos, sin});
      auto block = MoeBlockOutput::unpack(packed, x.sizes());
      x = block.hidden;  // (B, T, C)
      sum.lb_loss = i == 0 ? block.lb_loss : sum.lb_loss + block.lb_loss;
      sum.z_loss = i == 0 ? block.z_loss : sum.z_loss + block.z_loss;
      sum.dropped = i == 0 ? block.dropped : sum.dropped + block.dropped;
      sum.load = i == 0 ? block.load : sum.load + block.load;
    }
    return {norm(x), sum.lb_loss / L, sum.z_loss / L, sum.dropped / L, sum.load / L};
  }

  /// tokens (B, T) -> logits (B, T, V)
  torch::Tensor forward(const torch::Tensor& tokens) { return lm_head(forward_hidden(tokens, recompute::None{}).hidden); }

  /// Σ cross-entropy over the batch's targets + n_targets · (aux_loss_coef · lb + z_loss_coef · z).
  /// Records the router statistics (take_stats()).
  template <RecomputePolicy Recompute>
  torch::Tensor loss_sum(const Batch& batch, const Recompute& ckpt) {
    auto out = forward_hidden(batch.inputs, ckpt);  // (B, T, C)
    record(out);
    const auto n = batch.num_targets().to(torch::kFloat);
    return cross_entropy_sum(out.hidden, batch.targets) +
           n * (config.aux_loss_coef() * out.lb_loss + config.z_loss_coef() * out.z_loss);
  }

  /// Σ cross-entropy alone (evaluation: no aux terms, no statistics recorded).
  torch::Tensor ce_sum(const Batch& batch) {
    return cross_entropy_sum(forward_hidden(batch.inputs, recompute::None{}).hidden, batch.targets);
  }

  /// The router statistics averaged over the forwards since the last call; resets them.
  MoeStats take_stats() {
    MoeStats s;
    s.forwards = forwards_;
    if (forwards_ > 0) {
      auto v = (stats_sum_ / static_cast<double>(forwards_)).cpu();  // (3 + E)
      s.lb_loss = v[0].item<double>();
      s.z_loss = v[1].item<double>();
      s.dropped = v[2].item<double>();
      for (int64_t e = 0; e < config.num_experts(); ++e) s.load.push_back(v[3 + e].item<double>());
    }
    reset_stats();
    return s;
  }

  MoeConfig config;
  std::shared_ptr<torch::nn::Module> model;
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  nn::RMSNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};

 private:
  // hidden (B, T, C), targets (B, T) -> Σ CE (fp32); chunked and fused with the head when
  // loss_chunk_size > 0 (no (B·T, V) logits).
  torch::Tensor cross_entropy_sum(const torch::Tensor& hidden, const torch::Tensor& targets) {
    auto h = hidden.reshape({-1, hidden.size(-1)});  // (B·T, C)
    auto t = targets.reshape({-1});                  // (B·T)
    if (config.base().loss_chunk_size() > 0)
      return nn::chunked_cross_entropy_sum(
          h, lm_head->weight, t,
          nn::ChunkedCrossEntropyOptions().chunk_size(config.base().loss_chunk_size()).ignore_index(kIgnoreIndex)
              .fused(config.base().fused_kernels()));
    return torch::nn::functional::cross_entropy(
        lm_head(h).to(torch::kFloat), t,
        torch::nn::functional::CrossEntropyFuncOptions().ignore_index(kIgnoreIndex).reduction(torch::kSum));
  }

  void record(const MoeBlockOutput& out) {
    auto v = torch::cat({out.lb_loss.detach().reshape({1}), out.z_loss.detach().reshape({1}),
                         out.dropped.reshape({1}), out.load});  // (3 + E), stays on the device
    stats_sum_ = stats_sum_.defined() ? stats_sum_ + v : v;
    forwards_ += 1;
  }
  void reset_stats() {
    stats_sum_ = torch::Tensor();
    forwards_ = 0;
  }

  torch::Tensor stats_sum_;
  int64_t forwards_ = 0;
};
TORCH_MODULE(MoeLM);

}  // namespace memopt::models
