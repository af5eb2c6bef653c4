// tests/optim/fixtures.hpp — what the AdamW8bit and quantisation tests share: a small LLaMA whose
// matrices are large enough for 8-bit state, random batches and a loader replaying them (the
// policy tests' own).
#pragma once

#include <memopt/memopt.hpp>

#include "policies/fixtures.hpp"

namespace memopt::test::optim {

using memopt::test::policies::ListLoader;
using memopt::test::policies::random_batch;

// A LLaMA whose matrices reach min_8bit_size (64 x 64 = 4096), so most state is 8-bit.
inline memopt::models::LlamaConfig small_llama() {
  return memopt::models::LlamaConfig()
      .vocab_size(128)
      .hidden_size(64)
      .num_hidden_layers(2)
      .num_attention_heads(4)
      .max_position_embeddings(32);
}

}  // namespace memopt::test::optim
