#!/usr/bin/env python3
"""tests/models/hf_llama_reference.py OUT_DIR [MAX_SHARD_SIZE] — HF transformers' LlamaForCausalLM as
the reference for memopt's LLaMA (tests/models/llama_hf_test.cpp).

Builds a small LlamaForCausalLM from a LlamaConfig (no hub: nothing is downloaded) with grouped-
query attention (4 heads, 2 key/value heads), rope_theta 500000 and rms_norm_eps 1e-5, untied
embeddings, fp32, eager attention, seeded; writes it with save_pretrained to OUT_DIR/model (config.json
+ model.safetensors, what memopt's load_pretrained reads), runs one batch (2 x 12 tokens, the
first 3 targets of row 1 ignored), takes the summed cross-entropy over the kept targets (memopt's
loss_sum), backward, and writes OUT_DIR/reference.safetensors: inputs, targets, logits, loss,
grad.NAME for every parameter (HF names), and logits_bf16: the same model cast to bfloat16 on the
same inputs (the reference's own bf16 error). With MAX_SHARD_SIZE (e.g. 100KB) the model is saved
in shards with model.safetensors.index.json. Exit 2 with a HINT when transformers is missing.

tests/models/hf_llama_reference.py --load MODEL_DIR IN OUT: transformers' from_pretrained of a folder
memopt wrote; its logits on IN's "inputs" go to OUT as "logits".
"""
import copy
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


def load(model_dir, inputs_path, out_path):
    from safetensors.torch import load_file
    model = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager").float().eval()
    with torch.no_grad():
        logits = model(input_ids=load_file(inputs_path)["inputs"]).logits
    save_file({"logits": logits.contiguous()}, out_path)


def main(out, max_shard_size=None):
    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
                         attention_bias=False, mlp_bias=False, attention_dropout=0.0)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).float().train()
    if max_shard_size:
        model.save_pretrained(os.path.join(out, "model"), max_shard_size=max_shard_size)
    else:
        model.save_pretrained(os.path.join(out, "model"))

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
        tensors["grad." + name] = p.grad.detach().clone()
    with torch.no_grad():  # a copy: Module.to() would also cast the gradients kept above, in place
        tensors["logits_bf16"] = copy.deepcopy(model).to(torch.bfloat16)(input_ids=inputs).logits.float().contiguous()
    save_file(tensors, os.path.join(out, "reference.safetensors"))
    import transformers
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: loss {loss.item():.6f}, "
          f"{sum(1 for _ in model.parameters())} parameters")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--load":
        load(*sys.argv[2:])
    elif len(sys.argv) in (2, 3):
        main(*sys.argv[1:])
    else:
        sys.stderr.write(__doc__)
        sys.exit(2)
