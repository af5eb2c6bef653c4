// tests/memory/model_desc_test.cpp — memopt/memory/model_desc.hpp: a ModelDesc's parameter
// tensors are the built model's, one by one in registration order (LLaMA with grouped KV heads,
// a mixture of experts), its head and KV widths are the attention's, and its forward FLOPs per
// token are twice the matmul weights a token meets plus the attention's 4·T·C per layer.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include <memopt/memory/model_desc.hpp>
#include <memopt/models/llama.hpp>
#include <memopt/models/moe.hpp>

namespace {

std::vector<int64_t> numels_of(torch::nn::Module& model) {
  std::vector<int64_t> out;
  for (const auto& p : model.parameters()) out.push_back(p.numel());
  return out;
}

memopt::models::LlamaConfig gqa_config() {
  return memopt::models::LlamaConfig()
      .vocab_size(50)
      .hidden_size(24)
      .num_hidden_layers(2)
      .num_attention_heads(6)
      .num_key_value_heads(2)
      .intermediate_size(40)
      .max_position_embeddings(16);
}

}  // namespace

TEST_CASE("parameter_numels lists the built model's tensors in order: LLaMA with GQA and MoE", "[memory][model_desc]") {
  memopt::models::Llama llama(gqa_config());
  const auto desc = memopt::models::describe(gqa_config());
  CHECK(desc.parameter_numels() == numels_of(*llama));
  CHECK(desc.head_dim() == 4);   // 24 / 6
  CHECK(desc.kv_dim() == 8);     // 2 KV heads of 4
  CHECK(desc.ffn_rows() == 1);
  CHECK(desc.parameter_numels().front() == 50 * 24);  // embed_tokens, then the blocks
  CHECK(desc.parameter_numels()[2] == 24 * 8);        // k_proj: (KV · D, C)

  const auto moe_config = memopt::models::MoeConfig().base(gqa_config()).num_experts(3).top_k(2);
  memopt::models::MoeLM moe(moe_config);
  const auto moe_desc = memopt::models::describe(moe_config);
  CHECK(moe_desc.parameter_numels() == numels_of(*moe));
  CHECK(moe_desc.ffn_rows() == 2);
  int64_t count = 0;
  for (const auto& p : moe->parameters()) count += p.numel();
  CHECK(moe_desc.num_parameters() == count);
}

TEST_CASE("parameter_numels of a tied LLaMA with head_dim set: the shared weight once, heads D wide",
          "[memory][model_desc]") {
  const auto config = gqa_config().head_dim(10).tie_word_embeddings(true);  // 6 heads of 10, not 24 / 6
  memopt::models::Llama llama(config);
  const auto desc = memopt::models::describe(config);
  CHECK(desc.parameter_numels() == numels_of(*llama));
  CHECK(desc.head_dim() == 10);
  CHECK(desc.q_dim() == 60);
  CHECK(desc.kv_dim() == 20);
  CHECK(desc.parameter_numels()[1] == 60 * 24);  // q_proj: (H · D, C)
  const auto untied = memopt::models::describe(memopt::models::LlamaConfig(config).tie_word_embeddings(false));
  CHECK(untied.num_parameters() - desc.num_parameters() == 50 * 24);  // lm_head's (V, C), counted once when tied
  // Attention FLOPs follow the heads' width: q, o and 4·T·H·D per layer.
  CHECK(untied.forward_flops_per_token(8) - memopt::models::describe(gqa_config()).forward_flops_per_token(8) ==
        2 * (2 * (2 * 24 * 36 + 2 * 24 * 12) + 4.0 * 8 * 36));  // q+o: 36 more rows, k+v: 12
}

TEST_CASE("forward_flops_per_token: 2 per matmul weight a token meets, plus 4·T·C of attention per layer",
          "[memory][model_desc]") {
  // By hand: C 8, 2 heads of 4, 1 KV head, F 12, V 10, 2 layers, T 5. Per layer: q 64, k 32,
  // v 32, o 64, gate/up/down 3 · 96 = 288 weights: 2 · 480 + 4 · 5 · 8 = 1120; the head 2 · 80.
  memopt::memory::ModelDesc d;
  d.vocab_size = 10;
  d.hidden_size = 8;
  d.num_layers = 2;
  d.num_heads = 2;
  d.num_kv_heads = 1;
  d.ffn_size = 12;
  CHECK(d.forward_flops_per_token(5) == 2 * 1120 + 160);
  // A mixture of 4 experts, top-2: two experts' 288 each and a router of 8 · 4 per layer.
  d.num_experts = 4;
  d.top_k = 2;
  CHECK(d.forward_flops_per_token(5) == 2 * (2 * (192 + 576 + 32) + 160) + 160);

  // From a built LLaMA: 2 × every matrix but the embedding (a look-up, not a matmul).
  memopt::models::Llama llama(gqa_config());
  double matmul_weights = 0;
  for (const auto& item : llama->named_parameters())
    if (item.value().dim() == 2 && item.key() != "model.embed_tokens.weight")
      matmul_weights += static_cast<double>(item.value().numel());
  const int64_t T = 16;
  const double attention = 2.0 * 4.0 * T * 24;  // 2 layers of QKᵀ and PV over T keys
  CHECK(memopt::models::describe(gqa_config()).forward_flops_per_token(T) == 2 * matmul_weights + attention);
}
