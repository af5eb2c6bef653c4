// tests/memory/fixtures.hpp — what the report test and tests/callbacks_test.cpp share: a 2-block
// LLaMA over 128 tokens and a loader of its random (4, 32) batches.
#pragma once

#include <torch/torch.h>

#include <memopt/batch.hpp>
#include <memopt/models/llama.hpp>

namespace memopt::test::memory {

// A 2-block LLaMA over 128 tokens and its random (4, 32) batches: the Trainer tests' model.
inline memopt::models::Llama tiny_llama() {
  return memopt::models::Llama(memopt::models::LlamaConfig()
                                   .vocab_size(128)
                                   .hidden_size(32)
                                   .num_hidden_layers(2)
                                   .num_attention_heads(4)
                                   .max_position_embeddings(64));
}
struct TinyLoader {
  memopt::Batch next() {
    auto t = torch::randint(128, {4, 33});
    return {t.slice(1, 0, 32), t.slice(1, 1, 33)};
  }
};

}  // namespace memopt::test::memory
