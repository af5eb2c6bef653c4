#!/usr/bin/env python3
"""tests/models/hf_llama_reference.py OUT_DIR [--max-shard-size SIZE] [--variant NAME] — HF transformers'
LlamaForCausalLM as the reference for memopt's LLaMA (tests/models/llama_hf_test.cpp).

Builds a small LlamaForCausalLM from a LlamaConfig (no hub: nothing is downloaded), fp32, eager
attention, seeded; writes it with save_pretrained to OUT_DIR/model (config.json + model.safetensors,
what memopt's load_pretrained reads), runs one batch (2 rows, the first 3 targets of row 1 ignored),
takes the summed cross-entropy over the kept targets (memopt's loss_sum), backward, and writes
OUT_DIR/reference.safetensors: inputs, targets, logits, loss, grad.NAME for every parameter (HF
names: a tied model has no lm_head.weight), and logits_bf16: the same model cast to bfloat16 on the
same inputs (the reference's own bf16 error). With --max-shard-size (e.g. 100KB) the model is saved
in shards with model.safetensors.index.json. The variants (VARIANTS below):
  gqa      4 heads, 2 key/value heads, rope_theta 500000, rms_norm_eps 1e-5, untied; 12 tokens
  llama3   Llama 3.2-style: the same heads of head_dim 24 (not 64 / 4), tied embeddings, rope_type
           llama3 (factor 8, low/high_freq_factor 1/4, original_max_position_embeddings 32, so
           each of llama3's three frequency bands has frequencies); 40 tokens
  linear   rope_type linear, factor 4; config.json rewritten in transformers 4's spelling
           ("rope_scaling": {"type": "linear", …} and a top-level rope_theta); 20 tokens
  dynamic  rope_type dynamic, factor 2, max_position_embeddings 16; 32 tokens, past it
With --lora (the gqa variant): PEFT's get_peft_model puts LoRA adapters on every Linear but lm_head
(r 4, lora_alpha 8, lora_dropout 0.25, target_modules "all-linear"), lora_B drawn N(0, 0.1²) so that
every gradient is non-zero, and saves them (save_pretrained) in OUT_DIR/adapter; reference.safetensors
then holds inputs, targets and, for MODE "off" (eval: no dropout) and "on" (train: dropout, after
torch.manual_seed(99)), MODE.loss and MODE.grad.NAME for every adapter parameter under memopt's
names (model.layers.0.self_attn.q_proj.lora_A.weight: PEFT's without base_model.model. and .default).
Exit 2 with a HINT when transformers (or, with --lora, peft) is missing.

tests/models/hf_llama_reference.py --load MODEL_DIR IN OUT: transformers' from_pretrained of a folder
memopt wrote; its logits on IN's "inputs" go to OUT as "logits", and "tied" (1 when lm_head.weight
is model.embed_tokens.weight, else 0).

tests/models/hf_llama_reference.py --rope CASES_JSON OUT: transformers' LlamaRotaryEmbedding for each
case of CASES_JSON (a list of {"name", "head_dim", "max_position_embeddings", "seq_len",
"rope_parameters"}), run on positions 0 … seq_len - 1 as LlamaModel runs it: NAME.cos and NAME.sin
(seq_len, head_dim) and NAME.inv_freq, its inverse frequencies after that forward (dynamic RoPE
updates them for sequences longer than max_position_embeddings).
"""
import argparse
import copy
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
except ImportError as e:
    sys.stderr.write(f"hf_llama_reference.py: {e}. HINT: run scripts/deps (requirements.txt: transformers)\n")
    sys.exit(2)

IGNORE_INDEX = -100

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, hidden_act="silu",
              attention_bias=False, mlp_bias=False, attention_dropout=0.0)

# name -> (LlamaConfig arguments over COMMON, tokens per row)
VARIANTS = {
    "gqa": (dict(rope_theta=500000.0, tie_word_embeddings=False), 12),
    "llama3": (dict(head_dim=24, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 32}), 40),
    "linear": (dict(tie_word_embeddings=False, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                "factor": 4.0}), 20),
    "dynamic": (dict(tie_word_embeddings=False, max_position_embeddings=16,
                     rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), 32),
}


def load(model_dir, inputs_path, out_path):
    model = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager").float().eval()
    with torch.no_grad():
        logits = model(input_ids=load_file(inputs_path)["inputs"]).logits
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    save_file({"logits": logits.contiguous(), "tied": torch.tensor([1.0 if tied else 0.0])}, out_path)


def rope(cases_path, out_path):
    tensors = {}
    with open(cases_path) as f:
        cases = json.load(f)
    for case in cases:
        config = LlamaConfig(vocab_size=8, hidden_size=2 * case["head_dim"], num_attention_heads=2,
                             head_dim=case["head_dim"], max_position_embeddings=case["max_position_embeddings"],
                             rope_parameters=dict(case["rope_parameters"]))
        rotary = LlamaRotaryEmbedding(config)
        positions = torch.arange(case["seq_len"]).unsqueeze(0)  # (1, T), as LlamaModel passes them
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # (1, T, D) each
        tensors[case["name"] + ".cos"] = cos[0].contiguous()
        tensors[case["name"] + ".sin"] = sin[0].contiguous()
        tensors[case["name"] + ".inv_freq"] = rotary.inv_freq.detach().clone()
    save_file(tensors, out_path)


def to_transformers4_spelling(config_path):
    """config.json as transformers 4 wrote it: rope_scaling with "type", rope_theta at the top."""
    with open(config_path) as f:
        config = json.load(f)
    rope_parameters = config.pop("rope_parameters")
    config["rope_theta"] = rope_parameters.pop("rope_theta")
    rope_parameters["type"] = rope_parameters.pop("rope_type")
    config["rope_scaling"] = rope_parameters
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def lora_reference(model, out, inputs, targets):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        sys.stderr.write(f"hf_llama_reference.py: {e}. HINT: run scripts/deps (requirements.txt: peft)\n")
        sys.exit(2)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.25, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    peft_model.save_pretrained(os.path.join(out, "adapter"))
    tensors = {"inputs": inputs, "targets": targets}
    for mode in ("off", "on"):
        peft_model.train(mode == "on")
        peft_model.zero_grad()
        torch.manual_seed(99)
        logits = peft_model(input_ids=inputs).logits  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                               reduction="sum")
        loss.backward()
        tensors[mode + ".loss"] = loss.detach().reshape(1)
        for name, p in peft_model.named_parameters():
            if p.requires_grad:
                memopt_name = name.removeprefix("base_model.model.").replace(".default.", ".")
                tensors[mode + ".grad." + memopt_name] = p.grad.detach().clone()
    save_file(tensors, os.path.join(out, "reference.safetensors"))
    import peft
    print(f"peft {peft.__version__}, torch {torch.__version__}: LoRA loss off {tensors['off.loss'].item():.6f}, "
          f"on {tensors['on.loss'].item():.6f}")


def main(out, max_shard_size, variant, lora=False):
    torch.manual_seed(1234)
    overrides, T = VARIANTS[variant]
    config = LlamaConfig(**{**COMMON, **overrides})
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).float().train()
    model_dir = os.path.join(out, "model")
    if max_shard_size:
        model.save_pretrained(model_dir, max_shard_size=max_shard_size)
    else:
        model.save_pretrained(model_dir)
    if variant == "linear":
        to_transformers4_spelling(os.path.join(model_dir, "config.json"))

    tokens = torch.randint(0, config.vocab_size, (2, T + 1), generator=torch.Generator().manual_seed(7))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].clone()
    targets[1, :3] = IGNORE_INDEX
    if lora:
        return lora_reference(model, out, inputs, targets)
    logits = model(input_ids=inputs).logits  # (B, T, V)
    loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    loss.backward()
    tensors = {"inputs": inputs, "targets": targets, "logits": logits.detach().contiguous(),
               "loss": loss.detach().reshape(1)}
    for name, p in model.named_parameters():  # a tied weight once, as model.embed_tokens.weight
        tensors["grad." + name] = p.grad.detach().clone()
    with torch.no_grad():  # a copy: Module.to() would also cast the gradients kept above, in place
        tensors["logits_bf16"] = copy.deepcopy(model).to(torch.bfloat16)(input_ids=inputs).logits.float().contiguous()
    save_file(tensors, os.path.join(out, "reference.safetensors"))
    import transformers
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: variant {variant}, "
          f"loss {loss.item():.6f}, {sum(1 for _ in model.parameters())} parameters")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--load":
        load(*sys.argv[2:])
    elif len(sys.argv) == 4 and sys.argv[1] == "--rope":
        rope(*sys.argv[2:])
    else:
        parser = argparse.ArgumentParser(usage=__doc__)
        parser.add_argument("out")
        parser.add_argument("--max-shard-size", default=None)
        parser.add_argument("--variant", choices=sorted(VARIANTS), default="gqa")
        parser.add_argument("--lora", action="store_true")
        args = parser.parse_args()
        main(args.out, args.max_shard_size, args.variant, args.lora)
