#!/usr/bin/env python3
"""Reference values for tests/models/gritlm_test.cpp, written the way ContextualAI/gritlm's
training/model.py computes them (python3-torch):
  - pooling: mean of the hidden states over the positions of the attention mask with the
    instruction tokens zeroed (GritLM's encode + pooling('mean')), then
    torch.nn.functional.normalize(dim=-1)
  - contrastive loss: scores = q @ p.T / temperature, viewed (B, B*G), target arange(B) * G,
    CrossEntropyLoss(reduction='mean')

Writes tests/baselines/gritlm_reference.pt, a plain dict of tensors:
  hidden (n, T, C), attention (n, T) bool, instruction_lens (n)
  pooled (n, C)                 normalised mean-pooled embeddings
  q (B, D), p (B*G, D)          unnormalised inputs of the loss (they are normalised first)
  temperature, group_size       0-dim
  loss                          0-dim
  grad_q, grad_p                gradients of loss w.r.t. q and p (through the normalisation)

Run with the Debian python3-torch:  /usr/bin/python3 tests/baselines/gritlm_reference.py
"""
import pathlib

import torch

torch.manual_seed(2024)
out = {}

# ---- pooling: mask = attention with the instruction zeroed ----
n, T, C = 3, 7, 5
hidden = torch.randn(n, T, C, dtype=torch.float64)
lengths = torch.tensor([7, 5, 4])
instruction_lens = torch.tensor([2, 0, 3])
attention = torch.arange(T)[None, :] < lengths[:, None]
mask = attention.clone()
for i, l in enumerate(instruction_lens.tolist()):
    mask[i, :l] = False
summed = (hidden * mask[..., None].to(hidden.dtype)).sum(1)
pooled = summed / mask.sum(1, keepdim=True).to(hidden.dtype)
out["hidden"] = hidden.float()
out["attention"] = attention
out["instruction_lens"] = instruction_lens
out["pooled"] = torch.nn.functional.normalize(pooled, dim=-1).float()

# ---- contrastive loss ----
B, G, D, temperature = 3, 3, 6, 0.02
q = torch.randn(B, D, dtype=torch.float64, requires_grad=True)
p = torch.randn(B * G, D, dtype=torch.float64, requires_grad=True)
qn = torch.nn.functional.normalize(q, dim=-1)
pn = torch.nn.functional.normalize(p, dim=-1)
scores = torch.matmul(qn, pn.transpose(0, 1)) / temperature
scores = scores.view(qn.size(0), -1)
target = torch.arange(scores.size(0), dtype=torch.long) * (pn.size(0) // qn.size(0))
loss = torch.nn.CrossEntropyLoss(reduction="mean")(scores, target)
loss.backward()
out["q"], out["p"] = q.detach().float(), p.detach().float()
out["temperature"], out["group_size"] = torch.tensor(temperature), torch.tensor(G)
out["loss"] = loss.detach().float()
out["grad_q"], out["grad_p"] = q.grad.float(), p.grad.float()

path = pathlib.Path(__file__).with_suffix(".pt")
torch.save(out, path)
print(f"wrote {path}")
