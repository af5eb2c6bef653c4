#!/usr/bin/env python3
"""tests/models/hf_llama_reference.py OUT_DIR — HF transformers' LlamaForCausalLM as the reference
for memopt's LLaMA (tests/models/llama_hf_test.cpp).

Builds a small LlamaForCausalLM from a LlamaConfig (no hub: nothing is downloaded) with grouped-
query attention (4 heads, 2 key/value heads), rope_theta 500000 and rms_norm_eps 1e-5, untied
embeddings, fp32, eager attention, seeded; writes it with save_pretrained to OUT_DIR/model (config.json
+ model.safetensors, what memopt's load_pretrained reads), runs one batch (2 x 12 tokens, the
first 3 targets of row 1 ignored), takes the summed cross-entropy over the kept targets (memopt's
loss_sum), backward, and writes OUT_DIR/reference.safetensors: inputs, targets, logits, loss and
grad.NAME for every parameter (HF names). Exit 2 with a HINT when transformers is missing.
"""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as e:
    sys.stderr.write(f"hf_llama_reference.py: {e}. HINT: run scripts/deps (requirements.txt: transformers)\n")
    sys.exit(2)

IGNORE_INDEX = -100


def main(out):
    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
                         attention_bias=False, mlp_bias=False, attention_dropout=0.0)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).float().train()
    model.save_pretrained(os.path.join(out, "model"), safe_serialization=True)

    tokens = torch.randint(0, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(7))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].clone()
    targets[1, :3] = IGNORE_INDEX
    logits = model(input_ids=inputs).logits  # (B, T, V)
    loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    loss.backward()
    tensors = {"inputs": inputs, "targets": targets, "logits": logits.detach().contiguous(),
               "loss": loss.detach().reshape(1)}
    for name, p in model.named_parameters():
        tensors["grad." + name] = p.grad.contiguous()
    save_file(tensors, os.path.join(out, "reference.safetensors"))
    import transformers
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: loss {loss.item():.6f}, "
          f"{sum(1 for _ in model.parameters())} parameters")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write(__doc__)
        sys.exit(2)
    main(sys.argv[1])
