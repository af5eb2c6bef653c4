#!/usr/bin/env python3
"""Reference values for tests/models/llama_test.cpp: a LLaMA written from scratch in
python3-torch (HuggingFace LlamaForCausalLM's maths and parameter names, no
transformers), run in float32 on a small seeded model and a fixed batch.

Writes tests/baselines/llama_reference.pt, a plain dict of tensors (torch::pickle_load
reads a `torch.save(dict)` zip; an OrderedDict would not load):
  config/<field>            0-dim tensors: the LlamaConfig to build in C++
  param/<name>              every parameter, HF names (model.layers.0.self_attn.q_proj.weight, ...)
  inputs, targets           (B, T) int64; targets hold -100 where no loss is taken
  logits                    (B, T, V) float32, causal model
  loss_sum, loss_mean       0-dim float32: sum / mean of CE over targets != -100
  num_targets               0-dim int64
  grad/<name>               d(loss_sum / num_targets)/d(param), every parameter
  bidir/logits, bidir/loss_sum, bidir/grad/<name>
                            the same weights with bidirectional attention (a LLaDA
                            student); grads for a subset only, to keep the file small
  generate/prompt, generate/tokens
                            greedy continuation of a prompt (prompt + new tokens)

Deterministic: weights and data come from numpy's PCG64 with a fixed seed, and torch
runs on one thread. Run with the Debian python3-torch:
  /usr/bin/python3 tests/baselines/llama_reference.py
"""
import math
import pathlib

import numpy as np
import torch
import torch.nn.functional as F

CONFIG = dict(
    vocab_size=61,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped: each KV head serves 2 query heads
    intermediate_size=40,  # explicit, unlike LLaMA's rule (which gives 128 here)
    max_position_embeddings=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
)
BATCH, SEQ = 2, 16
SEED = 1234
GENERATE_NEW_TOKENS = 8
# bidir/grad/<name> is stored for these only: they see every layer's attention.
BIDIR_GRADS = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
               "model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight")


def parameter_shapes(c):
    """HF LlamaForCausalLM parameter names and shapes, in registration order."""
    C, V, F_ = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    H, KV = c["num_attention_heads"], c["num_key_value_heads"]
    D = C // H
    shapes = {"model.embed_tokens.weight": (V, C)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (H * D, C)
        shapes[p + "self_attn.k_proj.weight"] = (KV * D, C)
        shapes[p + "self_attn.v_proj.weight"] = (KV * D, C)
        shapes[p + "self_attn.o_proj.weight"] = (C, H * D)
        shapes[p + "mlp.gate_proj.weight"] = (F_, C)
        shapes[p + "mlp.up_proj.weight"] = (F_, C)
        shapes[p + "mlp.down_proj.weight"] = (C, F_)
        shapes[p + "input_layernorm.weight"] = (C,)
        shapes[p + "post_attention_layernorm.weight"] = (C,)
    shapes["model.norm.weight"] = (C,)
    shapes["lm_head.weight"] = (V, C)
    return shapes


def make_parameters(c, rng):
    """Matrices ~ N(0, 0.02); norm weights ~ 1 + N(0, 0.2) so that they matter."""
    params = {}
    for name, shape in parameter_shapes(c).items():
        if len(shape) == 1:
            values = 1.0 + 0.2 * rng.standard_normal(shape)
        else:
            values = 0.02 * rng.standard_normal(shape)
        params[name] = torch.from_numpy(values.astype(np.float32))
    return params


# ---- the model, HF style (modeling_llama.py), as functions of a parameter dict ----

def rms_norm(x, weight, eps):
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def rotary_cos_sin(seq_len, dim, base, dtype):
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    t = torch.arange(seq_len, dtype=inv_freq.dtype)
    freqs = torch.einsum("i,j->ij", t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)  # (T, D) each


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden, n_rep):
    b, kv, t, d = hidden.shape
    if n_rep == 1:
        return hidden
    hidden = hidden[:, :, None, :, :].expand(b, kv, n_rep, t, d)
    return hidden.reshape(b, kv * n_rep, t, d)


def self_attention(x, p, prefix, cos, sin, c, causal):
    bsz, q_len, _ = x.shape
    H, KV = c["num_attention_heads"], c["num_key_value_heads"]
    D = c["hidden_size"] // H
    q = F.linear(x, p[prefix + "q_proj.weight"]).view(bsz, q_len, H, D).transpose(1, 2)
    k = F.linear(x, p[prefix + "k_proj.weight"]).view(bsz, q_len, KV, D).transpose(1, 2)
    v = F.linear(x, p[prefix + "v_proj.weight"]).view(bsz, q_len, KV, D).transpose(1, 2)
    cos, sin = cos[None, None], sin[None, None]  # (1, 1, T, D)
    q = (q * cos) + (rotate_half(q) * sin)
    k = (k * cos) + (rotate_half(k) * sin)
    k = repeat_kv(k, H // KV)
    v = repeat_kv(v, H // KV)
    scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(D)  # (B, H, T, T)
    if causal:  # HF's additive mask: the dtype's minimum above the diagonal
        mask = torch.full((q_len, q_len), torch.finfo(scores.dtype).min, dtype=scores.dtype).triu(1)
        scores = scores + mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(bsz, q_len, H * D)
    return F.linear(out, p[prefix + "o_proj.weight"])


def mlp(x, p, prefix):
    gate = F.linear(x, p[prefix + "gate_proj.weight"])
    up = F.linear(x, p[prefix + "up_proj.weight"])
    return F.linear(F.silu(gate) * up, p[prefix + "down_proj.weight"])


def forward(p, input_ids, c, causal):
    """input_ids (B, T) -> logits (B, T, V)"""
    T = input_ids.shape[1]
    eps = c["rms_norm_eps"]
    h = F.embedding(input_ids, p["model.embed_tokens.weight"])
    cos, sin = rotary_cos_sin(T, c["hidden_size"] // c["num_attention_heads"], c["rope_theta"], h.dtype)
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        residual = h
        h = rms_norm(h, p[pre + "input_layernorm.weight"], eps)
        h = residual + self_attention(h, p, pre + "self_attn.", cos, sin, c, causal)
        residual = h
        h = rms_norm(h, p[pre + "post_attention_layernorm.weight"], eps)
        h = residual + mlp(h, p, pre + "mlp.")
    h = rms_norm(h, p["model.norm.weight"], eps)
    return F.linear(h, p["lm_head.weight"])


def loss_and_grads(params, inputs, targets, c, causal):
    leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
    logits = forward(leaves, inputs, c, causal)
    flat = logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))
    loss_sum = F.cross_entropy(flat, targets.reshape(-1),
                               ignore_index=-100, reduction="sum")  # in fp32, or fp64 for the check
    num_targets = (targets != -100).sum()
    (loss_sum / num_targets).backward()
    grads = {n: t.grad.detach().clone() for n, t in leaves.items()}
    return logits.detach(), loss_sum.detach(), num_targets, grads


def greedy(params, prompt, c, new_tokens):
    """Returns the tokens and the smallest top-1 / top-2 logit gap seen (ties would be fragile)."""
    ids = prompt.tolist()
    min_gap = float("inf")
    with torch.no_grad():
        for _ in range(new_tokens):
            context = torch.tensor(ids[-c["max_position_embeddings"]:])[None]
            last = forward(params, context, c, causal=True)[0, -1]
            top2 = last.topk(2).values
            min_gap = min(min_gap, float(top2[0] - top2[1]))
            ids.append(int(last.argmax()))
    return torch.tensor(ids, dtype=torch.int64), min_gap


def main():
    torch.set_num_threads(1)
    c = CONFIG
    rng = np.random.default_rng(SEED)
    params = make_parameters(c, rng)
    inputs = torch.from_numpy(rng.integers(0, c["vocab_size"], size=(BATCH, SEQ))).to(torch.int64)
    targets = torch.from_numpy(rng.integers(0, c["vocab_size"], size=(BATCH, SEQ))).to(torch.int64)
    targets[0, :3] = -100  # a prompt that takes no loss
    targets[1, 7] = -100
    targets[1, -2:] = -100  # padding

    logits, loss_sum, num_targets, grads = loss_and_grads(params, inputs, targets, c, causal=True)
    b_logits, b_loss_sum, _, b_grads = loss_and_grads(params, inputs, targets, c, causal=False)
    prompt = torch.tensor([3, 14, 15, 9, 26], dtype=torch.int64)
    tokens, min_gap = greedy(params, prompt, c, GENERATE_NEW_TOKENS)

    # The float32 noise floor, for choosing the C++ tolerances: the same model in float64.
    params64 = {n: t.double() for n, t in params.items()}
    logits64, loss64, _, grads64 = loss_and_grads(params64, inputs, targets, c, causal=True)
    print(f"loss_sum {loss_sum.item():.6f}  mean {(loss_sum / num_targets).item():.6f}  "
          f"num_targets {num_targets.item()}")
    print(f"fp32 vs fp64: logits max abs {(logits.double() - logits64).abs().max().item():.3e}  "
          f"loss_sum abs {abs(loss_sum.item() - loss64.item()):.3e}  "
          f"grads max abs {max((grads[n].double() - grads64[n]).abs().max().item() for n in grads):.3e}")
    print(f"grad magnitudes: min of per-tensor max abs {min(g.abs().max().item() for g in grads.values()):.3e}")
    print(f"causal vs bidir logits max abs {(logits - b_logits).abs().max().item():.3e}")
    print(f"greedy tokens {tokens.tolist()}  smallest top-2 logit gap {min_gap:.3e}")

    out = {}
    for field, value in c.items():
        dtype = torch.float64 if isinstance(value, float) else torch.int64
        out[f"config/{field}"] = torch.tensor(value, dtype=dtype)
    for name, t in params.items():
        out[f"param/{name}"] = t.contiguous()
    out["inputs"] = inputs.contiguous()
    out["targets"] = targets.contiguous()
    out["logits"] = logits.contiguous()
    out["loss_sum"] = loss_sum
    out["loss_mean"] = loss_sum / num_targets
    out["num_targets"] = num_targets
    for name, g in grads.items():
        out[f"grad/{name}"] = g.contiguous()
    out["bidir/logits"] = b_logits.contiguous()
    out["bidir/loss_sum"] = b_loss_sum
    for name in BIDIR_GRADS:
        out[f"bidir/grad/{name}"] = b_grads[name].contiguous()
    out["generate/prompt"] = prompt
    out["generate/tokens"] = tokens

    path = pathlib.Path(__file__).resolve().parent / "llama_reference.pt"
    torch.save(out, path)
    print(f"wrote {path} ({path.stat().st_size} bytes, {len(out)} tensors)")


if __name__ == "__main__":
    main()
