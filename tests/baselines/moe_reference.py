#!/usr/bin/env python3
"""Reference values for tests/models/moe_test.cpp: one MoE layer (router + E SwiGLU
experts, top-k routing, capacity) written token by token in python3-torch, with no
sorting and no dispatch tensors, following the rules documented in
include/memopt/models/moe.hpp:
  - router in fp32: probs = softmax(x Wᵀ); the top-k experts, gates = their probs / sum
  - capacity C = ceil(cf · k · N / E) (cf <= 0: none); assignments are admitted in the
    order (rank, token): every first choice before any second choice
  - an assignment over capacity contributes nothing (gates not renormalised)
  - lb = E · Σ f_i P_i with f_i = assignments to i / (k · N) before drops, P_i = mean prob
  - z = mean over tokens of logsumexp(logits)²

Writes tests/baselines/moe_reference.pt, a plain dict of tensors:
  config/<field>          0-dim tensors: hidden, ffn, experts, top_k
  param/<name>            gate.weight, experts.<e>.{gate,up,down}_proj.weight
  x, upstream             (N, C): the input and the gradient fed to y
  <case>/y                (N, C) for case in {drop, dropless} (capacity_factor 0.5 / 0)
  <case>/lb, <case>/z, <case>/dropped   0-dim
  <case>/load             (E)
  <case>/grad/x, <case>/grad/<param>
                          gradients of (y · upstream).sum() + lb + z
  <case>/capacity_factor  0-dim
  drop/all_dropped        (N) bool: tokens that lost every assignment

Run with the Debian python3-torch:  /usr/bin/python3 tests/baselines/moe_reference.py
"""
import math
import pathlib

import numpy as np
import torch
import torch.nn.functional as F

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 16, 24, 4, 2, 24
CASES = {"drop": 0.5, "dropless": 0.0}
SEED = 4321


def swiglu(x, p, e):
    pre = f"experts.{e}."
    return F.linear(F.silu(F.linear(x, p[pre + "gate_proj.weight"])) * F.linear(x, p[pre + "up_proj.weight"]),
                    p[pre + "down_proj.weight"])


def moe(x, p, capacity_factor):
    N = x.shape[0]
    logits = F.linear(x, p["gate.weight"])
    probs = torch.softmax(logits, -1)
    top_p, top_e = probs.topk(TOP_K, -1)
    gates = top_p / top_p.sum(-1, keepdim=True)
    cap = math.ceil(capacity_factor * TOP_K * N / EXPERTS) if capacity_factor > 0 else N * TOP_K
    taken = [0] * EXPERTS
    rows = [[] for _ in range(N)]
    kept_slots = 0
    for r in range(TOP_K):
        for n in range(N):
            e = int(top_e[n, r])
            if taken[e] < cap:
                taken[e] += 1
                kept_slots += 1
                rows[n].append(gates[n, r] * swiglu(x[n:n + 1], p, e)[0])
    y = torch.stack([torch.stack(r).sum(0) if r else torch.zeros(HIDDEN) for r in rows])
    counts = torch.bincount(top_e.reshape(-1), minlength=EXPERTS).float()
    load = counts / (TOP_K * N)
    lb = EXPERTS * (load * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    dropped = torch.tensor(1.0 - kept_slots / (TOP_K * N))
    all_dropped = torch.tensor([len(r) == 0 for r in rows])
    partly = sum(1 for r in rows if len(r) == 1)
    return y, lb, z, dropped, load, all_dropped, partly


def main():
    torch.set_num_threads(1)
    rng = np.random.Generator(np.random.PCG64(SEED))

    def normal(*shape, std=1.0):
        return torch.tensor(rng.normal(0.0, std, size=shape), dtype=torch.float32)

    params = {"gate.weight": normal(EXPERTS, HIDDEN, std=0.5)}
    for e in range(EXPERTS):
        params[f"experts.{e}.gate_proj.weight"] = normal(FFN, HIDDEN, std=0.3)
        params[f"experts.{e}.up_proj.weight"] = normal(FFN, HIDDEN, std=0.3)
        params[f"experts.{e}.down_proj.weight"] = normal(HIDDEN, FFN, std=0.3)
    x = normal(TOKENS, HIDDEN)
    upstream = normal(TOKENS, HIDDEN)

    out = {"config/hidden": torch.tensor(HIDDEN), "config/ffn": torch.tensor(FFN),
           "config/experts": torch.tensor(EXPERTS), "config/top_k": torch.tensor(TOP_K),
           "x": x, "upstream": upstream}
    for name, value in params.items():
        out["param/" + name] = value
    for case, cf in CASES.items():
        leaves = {name: value.clone().requires_grad_(True) for name, value in params.items()}
        xl = x.clone().requires_grad_(True)
        y, lb, z, dropped, load, all_dropped, partly = moe(xl, leaves, cf)
        ((y * upstream).sum() + lb + z).backward()
        if case == "drop":
            assert all_dropped.any() and partly > 0, "the drop case must drop whole tokens and single assignments"
            out["drop/all_dropped"] = all_dropped
        else:
            assert float(dropped) == 0.0
        out[f"{case}/capacity_factor"] = torch.tensor(cf, dtype=torch.float64)
        out[f"{case}/y"] = y.detach()
        out[f"{case}/lb"] = lb.detach()
        out[f"{case}/z"] = z.detach()
        out[f"{case}/dropped"] = dropped.float()
        out[f"{case}/load"] = load
        out[f"{case}/grad/x"] = xl.grad
        for name, leaf in leaves.items():
            out[f"{case}/grad/{name}"] = leaf.grad
    path = pathlib.Path(__file__).with_name("moe_reference.pt")
    torch.save(out, path)
    print(f"wrote {path} ({len(out)} tensors)")


if __name__ == "__main__":
    main()
