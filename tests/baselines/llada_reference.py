#!/usr/bin/env python3
"""Reference values for tests/models/llada_test.cpp: the LLaDA formulas written the way
the LLaDA authors wrote them (ML-GSAI/LLaDA GUIDELINES.md and generate.py), run in
python3-torch on small fixed inputs.

Writes tests/baselines/llada_reference.pt, a plain dict of tensors (torch::pickle_load
reads a `torch.save(dict)` zip):
  loss/*        inputs: logits (B, L, V+1) float32, x0 (B, L), mask (B, L) bool, p (B, 1),
                prompt_lengths (B), teacher (B, L, V) float32, temperature, top_k, mask_id
                outputs: pretrain (GUIDELINES pre-training loss, ÷ B·L), sft (GUIDELINES
                SFT loss, ÷ B), sft_mask, kd_dense and kd_topk (sums, float64, written
                as plain per-position loops)
  fp/*          GUIDELINES forward_process after torch.manual_seed(fp/seed): noisy, mask, p
  fp_sft/*      the SFT forward process after torch.manual_seed(fp_sft/seed)
  toy/W, toy/U, toy/M
                float64 tables of a toy bidirectional "model":
                logits[b, i] = W[x[b, i]] + U[i] + sum_j M[x[b, j]]   (then float32)
  gen/prompt    (2, 4) int64, the prompts of every case
  gen/<case>/*  generate() of generate.py on the toy model: options (float64 [steps,
                gen_length, block_length, temperature, cfg_scale, seed]), the final tokens
                and the tokens after every step (trajectory (steps, B, L), int8)

Deterministic: inputs come from numpy's PCG64 with a fixed seed; sampling cases seed
torch's CPU generator with torch.manual_seed, which LibTorch's CPU generator reproduces.
Run with the Debian python3-torch:
  /usr/bin/python3 tests/baselines/llada_reference.py
"""
import pathlib

import numpy as np
import torch
import torch.nn.functional as F

SEED = 2024
B, L, V = 3, 8, 11  # teacher vocabulary V; the student adds the mask class
MASK_ID = V  # = 11, the student's extra class
TEMPERATURE = 2.0
TOP_K = 4
FP_SEED = 17


# ---- GUIDELINES.md, with the mask id as an argument instead of 126336 ----

def forward_process(input_ids, mask_id, eps=1e-3):
    b, l = input_ids.shape
    t = torch.rand(b, device=input_ids.device)
    p_mask = (1 - eps) * t + eps
    p_mask = p_mask[:, None].repeat(1, l)

    masked_indices = torch.rand((b, l), device=input_ids.device) < p_mask
    noisy_batch = torch.where(masked_indices, mask_id, input_ids)
    return noisy_batch, masked_indices, p_mask


def pretrain_loss(logits, input_ids, masked_indices, p_mask):
    token_loss = F.cross_entropy(logits[masked_indices], input_ids[masked_indices], reduction='none') \
        / p_mask[masked_indices]
    return token_loss.sum() / (input_ids.shape[0] * input_ids.shape[1])


def sft_forward(input_ids, prompt_lengths, mask_id):
    noisy_batch, _, p_mask = forward_process(input_ids, mask_id)
    token_positions = torch.arange(noisy_batch.shape[1]).expand(noisy_batch.size(0), noisy_batch.size(1))
    prompt_mask = token_positions < prompt_lengths.unsqueeze(1)
    noisy_batch[prompt_mask] = input_ids[prompt_mask]
    return noisy_batch, prompt_mask, p_mask


def sft_loss(logits, input_ids, noisy_batch, prompt_mask, p_mask, mask_id):
    prompt_mask = prompt_mask.to(torch.int64)
    answer_lengths = torch.sum((1 - prompt_mask), dim=-1, keepdim=True)
    answer_lengths = answer_lengths.repeat(1, noisy_batch.shape[1])
    masked_indices = noisy_batch == mask_id
    token_loss = F.cross_entropy(logits[masked_indices], input_ids[masked_indices], reduction='none') \
        / p_mask[masked_indices]
    return torch.sum(token_loss / answer_lengths[masked_indices]) / input_ids.shape[0]


# ---- distillation, one position at a time in float64 (no LLaDA reference exists) ----

def kd_sum(student, teacher, mask, p, temperature, top_k):
    """Σ over masked i >= 1 of KL(softmax(teacher[i-1]/T) ‖ softmax(student[i]/T))·T²/p."""
    total = torch.zeros((), dtype=torch.float64)
    vt = teacher.shape[-1]
    for b in range(student.shape[0]):
        for i in range(1, student.shape[1]):
            if not mask[b, i]:
                continue
            t_logits = teacher[b, i - 1].double() / temperature
            s_logp = F.log_softmax(student[b, i].double() / temperature, dim=-1)
            if top_k:
                # k + 1 bins: the teacher's exact top-k probabilities and the mass of the rest.
                t_logp_all = F.log_softmax(t_logits, dim=-1)
                t_logp, index = t_logp_all.topk(top_k)
                t_p = t_logp.exp()
                s_in = s_logp[index]
                rest = torch.ones_like(s_logp, dtype=torch.bool)
                rest[index] = False
                t_tail = (1 - t_p.sum()).clamp_min(0)
                s_tail = s_logp[rest].exp().sum()
                kl = (t_p * (t_logp - s_in)).sum()
                if t_tail > 0:
                    kl = kl + t_tail * (t_tail.log() - s_tail.log())
            else:
                t_p = F.softmax(t_logits, dim=-1)
                kl = F.kl_div(s_logp[:vt], t_p, reduction='sum')
            total = total + kl * temperature ** 2 / p[b, 0].double()
    return total


# ---- generate.py (low-confidence remasking), on a batch of prompts ----

def add_gumbel_noise(logits, temperature):
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand_like(logits, dtype=torch.float64)
    gumbel_noise = (- torch.log(noise)) ** temperature
    return logits.exp() / gumbel_noise


def get_num_transfer_tokens(mask_index, steps):
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base = mask_num // steps
    remainder = mask_num % steps
    num_transfer_tokens = torch.zeros(mask_num.size(0), steps, device=mask_index.device, dtype=torch.int64) + base
    for i in range(mask_num.size(0)):
        num_transfer_tokens[i, :remainder[i]] += 1
    return num_transfer_tokens


@torch.no_grad()
def generate(model, prompt, steps=128, gen_length=128, block_length=128, temperature=0.,
             cfg_scale=0., mask_id=126336, trajectory=None):
    # generate.py builds x with batch size 1; its later versions use prompt.shape[0].
    x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long)
    x[:, :prompt.shape[1]] = prompt.clone()
    prompt_index = (x != mask_id)

    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps = steps // num_blocks

    for num_block in range(num_blocks):
        block_mask_index = (x[:, prompt.shape[1] + num_block * block_length:
                              prompt.shape[1] + (num_block + 1) * block_length:] == mask_id)
        num_transfer_tokens = get_num_transfer_tokens(block_mask_index, steps)
        for i in range(steps):
            mask_index = (x == mask_id)
            if cfg_scale > 0.:
                un_x = x.clone()
                un_x[prompt_index] = mask_id
                x_ = torch.cat([x, un_x], dim=0)
                logits = model(x_)
                logits, un_logits = torch.chunk(logits, 2, dim=0)
                logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            else:
                logits = model(x)

            logits_with_noise = add_gumbel_noise(logits, temperature=temperature)
            x0 = torch.argmax(logits_with_noise, dim=-1)

            p = F.softmax(logits.to(torch.float64), dim=-1)
            x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
            x0_p[:, prompt.shape[1] + (num_block + 1) * block_length:] = -np.inf

            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -np.inf)

            transfer_index = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(confidence.shape[0]):
                _, select_index = torch.topk(confidence[j], k=num_transfer_tokens[j, i])
                transfer_index[j, select_index] = True
            x[transfer_index] = x0[transfer_index]
            if trajectory is not None:
                trajectory.append(x.clone())
    return x


GEN_CASES = {
    # name: (steps, gen_length, block_length, temperature, cfg_scale, seed)
    "greedy": (4, 10, 5, 0.0, 0.0, 0),          # 2 blocks, 2 steps each: 3 then 2 tokens
    "cfg": (4, 10, 5, 0.0, 1.5, 0),
    "one_block": (4, 10, 10, 0.0, 0.0, 0),      # 10 tokens in 4 steps: 3, 3, 2, 2
    "sampled": (6, 12, 4, 0.7, 0.0, 7),         # Gumbel-max noise from torch.manual_seed(7)
    "sampled_cfg": (6, 12, 4, 1.0, 0.5, 11),
}


def main():
    torch.set_num_threads(1)
    rng = np.random.default_rng(SEED)
    f32 = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float32))
    out = {}

    # ---- losses ----
    logits = f32(2.0 * rng.standard_normal((B, L, V + 1)))
    teacher = f32(3.0 * rng.standard_normal((B, L, V)))
    x0 = torch.from_numpy(rng.integers(0, V, size=(B, L))).to(torch.int64)
    mask = torch.from_numpy(rng.random((B, L)) < 0.5)
    mask[0, 0] = True  # position 0 masked: a diffusion/SFT term, no KD term
    mask[1, :] = True
    p = f32(rng.uniform(0.1, 1.0, size=(B, 1)))
    prompt_lengths = torch.tensor([2, 0, 5], dtype=torch.int64)

    pre = pretrain_loss(logits, x0, mask, p.repeat(1, L))
    prompt_mask = torch.arange(L)[None, :] < prompt_lengths[:, None]
    sft_mask = mask & ~prompt_mask
    noisy = torch.where(sft_mask, MASK_ID, x0)
    sft = sft_loss(logits, x0, noisy, prompt_mask, p.repeat(1, L), MASK_ID)
    kd_dense = kd_sum(logits, teacher, mask, p, TEMPERATURE, 0)
    kd_topk = kd_sum(logits, teacher, mask, p, TEMPERATURE, TOP_K)
    print(f"pretrain {pre.item():.6f}  sft {sft.item():.6f}  kd dense {kd_dense.item():.6f}  "
          f"kd top-{TOP_K} {kd_topk.item():.6f}")
    for name, value in dict(logits=logits, teacher=teacher, x0=x0, mask=mask, p=p,
                            prompt_lengths=prompt_lengths, pretrain=pre, sft=sft, sft_mask=sft_mask,
                            kd_dense=kd_dense, kd_topk=kd_topk).items():
        out[f"loss/{name}"] = value.contiguous()
    out["loss/temperature"] = torch.tensor(TEMPERATURE, dtype=torch.float64)
    out["loss/top_k"] = torch.tensor(TOP_K, dtype=torch.int64)
    out["loss/mask_id"] = torch.tensor(MASK_ID, dtype=torch.int64)

    # ---- the forward processes, on torch's seeded CPU generator ----
    torch.manual_seed(FP_SEED)
    fp_noisy, fp_mask, fp_p = forward_process(x0, MASK_ID)
    out.update({"fp/seed": torch.tensor(FP_SEED), "fp/noisy": fp_noisy, "fp/mask": fp_mask,
                "fp/p": fp_p[:, :1].contiguous()})
    torch.manual_seed(FP_SEED + 1)
    sft_noisy, _, sft_p = sft_forward(x0, prompt_lengths, MASK_ID)
    out.update({"fp_sft/seed": torch.tensor(FP_SEED + 1), "fp_sft/noisy": sft_noisy,
                "fp_sft/mask": sft_noisy == MASK_ID, "fp_sft/p": sft_p[:, :1].contiguous()})

    # ---- generate on the toy model ----
    VS = V + 1
    W = torch.from_numpy(rng.standard_normal((VS, VS)))
    W[:, MASK_ID] = -100.0  # like a trained student, the toy never predicts [MASK]
    U = torch.from_numpy(rng.standard_normal((16, VS)))  # positions < 16
    M = torch.from_numpy(0.3 * rng.standard_normal((VS, VS)))
    out.update({"toy/W": W, "toy/U": U, "toy/M": M})

    def toy_model(x):  # (B, L) -> (B, L, VS) float32
        return (W[x] + U[None, :x.shape[1]] + M[x].sum(1, keepdim=True)).float()

    prompt = torch.from_numpy(rng.integers(0, V, size=(2, 4))).to(torch.int64)
    for name, (steps, gen_length, block_length, temperature, cfg, seed) in GEN_CASES.items():
        torch.manual_seed(seed)
        trajectory = []
        tokens = generate(toy_model, prompt, steps=steps, gen_length=gen_length, block_length=block_length,
                          temperature=temperature, cfg_scale=cfg, mask_id=MASK_ID, trajectory=trajectory)
        print(f"gen/{name}: {tokens.tolist()}")
        out.update({f"gen/{name}/tokens": tokens,
                    f"gen/{name}/trajectory": torch.stack(trajectory).to(torch.int8),  # ids < 12: small file
                    f"gen/{name}/options": torch.tensor([steps, gen_length, block_length, temperature, cfg, seed],
                                                        dtype=torch.float64)})
    out["gen/prompt"] = prompt

    path = pathlib.Path(__file__).resolve().parent / "llada_reference.pt"
    torch.save(out, path)
    print(f"wrote {path} ({path.stat().st_size} bytes, {len(out)} tensors)")


if __name__ == "__main__":
    main()
