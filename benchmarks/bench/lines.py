"""The JSON lines the suites make from their runs' output, and their ratio lines (the former `python -c`
snippets, jq filters and heredocs of scripts/bench; the same keys in the same order). Each returns a dict
or None (no line); a run's files are read here, the load average is read when the line is made."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Mapping

from .core import load_average

Json = Mapping  # a parsed JSON line


def summary(path: Path, marker: str = '"event":"summary"') -> dict:
    """The last line of a run's metrics.jsonl that contains `marker`."""
    found = [l for l in path.read_text().splitlines() if marker in l]
    if not found:
        raise ValueError(f"no summary line in {path}")
    return json.loads(found[-1])


def last_number(path: Path, key: str) -> str:
    """The last `"KEY":NUMBER` in a file (`grep -o | tail -n 1 | cut -d: -f2`); "" when there is none."""
    try:
        found = re.findall(f'"{key}":([0-9.]*)', path.read_text())
    except OSError:
        return ""
    return found[-1] if found else ""


# ---- trainer ----
def model_flops_per_token(t: Json) -> float:
    """A training step's model FLOPs per token for a trainer line: every weight but the input embedding (a
    lookup) costs 2 FLOPs forward and 2 for the input's gradient, a trainable one 2 more for its own
    gradient (LoRA's frozen base: 4, not 6); attention's QK^T and AV 12 x layers x seq x dim, halved for the
    causal mask where the kernel skips the masked blocks: SDPA's flash kernel (the peer's) and memopt's
    sdpa, flash, blockwise and auto; the math path computes them all (memopt lines from before --attention ran
    it). Recomputation is not model work: not counted."""
    matmul = t["params_m"] * 1e6 - t["vocab"] * t["dim"]
    trainable = min(t["trainable_m"] * 1e6, matmul)
    attention = t.get("attention") or ("math" if t.get("impl") in ("memopt", "hand") else "sdpa")
    return 4 * matmul + 2 * trainable + 12 * t["layers"] * t["seq"] * t["dim"] * (1 if attention == "math" else 0.5)


def with_mfu(raw: str) -> dict:
    """memopt_bench_trainer's or trainer_peer.py's line with `model_flops_per_token` and `mfu`: model FLOPs a
    second over its `gemm_gflops`, the model's widest GEMM timed in the same process and precision."""
    t = json.loads(raw)
    flops = model_flops_per_token(t)
    return {**t, "model_flops_per_token": flops, "mfu": round(flops * t["tokens_per_s"] / (t["gemm_gflops"] * 1e9), 4)}


def trainer_ratio(a: Json, b: Json) -> dict:  # memopt's line over a peer's
    return {"name": a.get("name"), "impl": "ratio", "peer": "compile" if b.get("impl") == "pytorch_compile" else "eager",
            "tokens_per_s": a["tokens_per_s"] / b["tokens_per_s"],
            "peak_rss_mib": a["peak_rss_mib"] / b["peak_rss_mib"],
            "tokens_per_s_best": b["step_ms_min"] / a["step_ms_min"],
            **({"mfu": a["mfu"], "peer_mfu": b.get("mfu")} if "mfu" in a else {}),
            **by_round(a, b),
            "torch_version": a.get("torch_version"), "cpu_flags": a.get("cpu_flags")}


def by_round(a: Json, b: Json) -> dict:
    """Two medians of as many alternating rounds (steps.Median): the count and each round's pair ratio."""
    ra, rb = a.get("tokens_per_s_rounds"), b.get("tokens_per_s_rounds")
    if not ra or not rb or len(ra) != len(rb):
        return {}
    return {"rounds": len(ra), "tokens_per_s_by_round": [round(x / y, 4) for x, y in zip(ra, rb)]}


def variant_ratio(a: Json, b: Json, impl: str) -> dict:  # a memopt line over the same run with one flag changed
    return {"name": a.get("name"), "impl": impl,
            "tokens_per_s": a["tokens_per_s"] / b["tokens_per_s"],
            "peak_tracked_mib": a["peak_tracked_mib"] / b["peak_tracked_mib"],
            "peak_rss_mib": a["peak_rss_mib"] / b["peak_rss_mib"],
            "loss_last_diff": abs(a["loss_last"] - b["loss_last"]),
            "torch_version": a.get("torch_version"), "cpu_flags": a.get("cpu_flags")}


def attention_kind_ratio(a: Json, b: Json) -> dict:  # over the same run with another --attention
    return variant_ratio(a, b, f"ratio_attention_{a.get('attention')}_to_{b.get('attention')}")


def fused_kernels_ratio(a: Json, b: Json) -> dict:  # --fused_kernels over the same run without
    return variant_ratio(a, b, "ratio_fused_kernels_to_composite")


# ---- bf16_gemm ----
def bf16_gemm_ratio(name: str, a: Json, b: Json) -> dict:  # one bf16_gemm configuration's line over another's
    tracked = ({"peak_tracked_mib": a["peak_tracked_mib"] / b["peak_tracked_mib"]}
               if a.get("peak_tracked_mib") and b.get("peak_tracked_mib") else {})
    return {**trainer_ratio(a, b), "suite": "bf16_gemm", "name": name, "shape": a.get("name"),
            "peer": "eager" if b.get("impl") == "pytorch" else "memopt", **tracked,
            "loss_last_diff": abs(a["loss_last"] - b["loss_last"])}


# ---- lora ----
def lora_ratio(name: str, a: Json, b: Json) -> dict:  # memopt's line over a peer's, or QLoRA's over full's
    keys = [k for k in ("peak_tracked_mib", "peak_rss_mib", "tokens_per_s") if a.get(k) and b.get(k)]
    return {"suite": "lora", "name": name, "impl": "ratio", "shape": a.get("name"),
            **{k: round(a[k] / b[k], 3) for k in keys}}


def overhead_ratio(a: Json, b: Json) -> dict:  # the Trainer's step time over the hand-written loop's
    return {"name": "overhead", "impl": "ratio", "step_time": a["step_ms"] / b["step_ms"]}


# ---- distill, distill_quality ----
def distill_line(impl: str, metrics: Path) -> dict:
    s = summary(metrics)
    return {"suite": "distill", "name": "distill", "impl": impl,
            "peak_tracked_mib": round(s["peak_tracked_mib"], 1), "peak_rss_mib": round(s["peak_rss_mib"], 1),
            "tokens_per_s": round(s["tokens_per_s"], 1), "steps": s["steps"], "load_avg_1m": float(load_average(1))}


def distill_ratio(a: Json, b: Json) -> dict:
    return {"suite": "distill", "name": "distill", "impl": "ratio_%s_to_none" % a["impl"],
            **{k: round(a[k] / b[k], 3) for k in ("peak_tracked_mib", "peak_rss_mib", "tokens_per_s")}}


def distill_quality_line(impl: str, metrics: Path) -> dict:
    s = summary(metrics, '"summary"')
    return {"suite": "distill_quality", "name": "distill_quality", "impl": impl, "alpha": s["alpha"],
            "kd_top_k": s["kd_top_k"], "teacher_precision": s.get("teacher_precision", "fp32"), "steps": s["steps"],
            **{k: round(s[k], 4) for k in ("masked_ce_0.15", "masked_ce_0.5", "masked_ce_0.85")},
            "teacher_perplexity": round(math.exp(s["teacher_loss"]), 1),
            "peak_tracked_mib": round(s["peak_tracked_mib"], 1), "peak_rss_mib": round(s["peak_rss_mib"], 1)}


# ---- adamw8bit, attention, stack, allocator ----
def adamw8bit_ratio(a: Json, b: Json) -> dict:  # 8-bit over fp32
    keys = ("loss_last", "val_loss", "state_mib", "peak_tracked_mib", "peak_rss_mib", "tokens_per_s", "optimizer_ms")
    return {"suite": "adamw8bit", "name": "adamw8bit", "impl": "ratio_adamw8bit_to_adamw", "steps": a["steps"],
            **{k: round(a[k] / b[k], 4) for k in keys},
            "loss_within_1pct": abs(a["loss_last"] / b["loss_last"] - 1) <= 0.01}


def attention_ratio(a: Json, b: Json, target: Mapping | None = None) -> dict | None:
    """The A/B ratio of peak and time (none when either was skipped); with a target, whether it was met."""
    if "skipped" in a or "skipped" in b:
        return None
    out = {"suite": "attention", "name": a["name"], "impl": "ratio_%s_to_%s" % (a["impl"], b["impl"])}
    out.update({k: a[k] for k in ("L", "N", "B", "dtype") if k in a})
    out.update({k: round(a[k] / b[k], 4) for k in ("peak_tracked_mib", "ms", "ms_min")})
    if target is not None:
        out["target"] = dict(target)
        out["met"] = out["peak_tracked_mib"] <= target["peak_tracked_mib"] and out["ms"] <= target["ms"]
    return out


def fused_ratio(a: Json, b: Json) -> dict:
    """A fused kernel over its ATen composite (nn/fused.hpp): time and peak, and whether it is faster (the target)."""
    peer = "memopt" if b["impl"].endswith("_fused") else "aten"  # the two fused nodes a fused one replaces
    out = {"suite": "fused", "name": a["name"], "impl": "ratio_%s_to_%s" % (a["impl"], b["impl"]), "peer": peer,
           **{k: a[k] for k in ("dtype", "rows", "width", "in", "N", "V") if k in a},
           **{k: round(a[k] / b[k], 4) for k in ("ms", "ms_min", "peak_tracked_mib")}}
    out["met"] = out["ms"] < 1.0
    return out


def stack_ratio(a: Json, b: Json) -> dict:  # a row over fp32
    return {"suite": "stack", "name": "ratio_%s_to_fp32" % a["name"],
            **{k: round(a[k] / b[k], 3) for k in ("peak_tracked_mib", "peak_rss_mib", "tokens_per_s")}}


def allocator_line(conf: str, line: str) -> dict:
    l = json.loads(line)
    return {"suite": "allocator", "name": "allocator", "impl": conf or "memopt default (preset:training)",
            **{k: round(l[k], 1) for k in ("peak_tracked_mib", "peak_rss_mib", "tokens_per_s")},
            "load_avg_1m": l["load_avg_1m"]}


# ---- moe_quality ----
def moe_quality_ratio(a: Json, b: Json) -> dict:  # the MoE over the dense LLaMA
    return {"suite": "moe_quality", "name": "moe-nano", "impl": "ratio_moe_to_dense",
            **{k: round(a[k] / b[k], 3) for k in ("tokens_per_s", "perplexity", "params", "active_params")}}


# ---- gritlm, gritlm_quality ----
def grit_line(suite: str, name: str, metrics: Path, *extra: str) -> dict:
    """A gritlm summary as a `suite` line; extra: KEY=VALUE (string values)."""
    s = summary(metrics, '"summary"')
    out = {"suite": suite, "name": name, "impl": "memopt"}
    for k in ("peak_tracked_mib", "peak_rss_mib", "tokens_per_s", "items_per_s", "batches_per_s"):
        if k in s:
            out[k] = round(s[k], 1)
    for k in ("retrieval_top1_before", "retrieval_top1_after", "retrieval_mrr_before", "retrieval_mrr_after",
              "tfidf_top1", "tfidf_mrr", "perplexity_before", "perplexity_after"):
        if s.get(k) is not None and "retrieval_top1_after" in s:
            out[k] = round(s[k], 4)
    for k in ("steps", "workers", "eval_queries"):
        if k in s:
            out[k] = s[k]
    for kv in extra:
        k, v = kv.split("=", 1)
        out[k] = v
    return out


def grit_ratio(name: str, a: Json, b: Json) -> dict:  # A / B per metric both have
    keys = [k for k in ("peak_tracked_mib", "peak_rss_mib", "tokens_per_s", "items_per_s") if k in a and k in b]
    return {"suite": "gritlm", "name": name, "impl": "ratio", **{k: round(a[k] / b[k], 3) for k in keys}}


# ---- estimator (GritLM through its example) ----
def estimator_grit_line(name: str, policies: str, predicted: str, measured: str) -> dict:
    p, m = float(predicted), float(measured)
    return {"suite": "estimator", "name": name, "predicted_mib": p, "measured_mib": m, "error": p / m - 1,
            "policies": policies, "shape": "gritlm l4-d256 (example defaults), King James pairs"}


# ---- data ----
def data_trainer_line(line: str) -> dict:
    """The trainer's consumption rate from memopt_bench_trainer's line."""
    t = json.loads(line)
    keys = ("tokens_per_s", "step_ms", "step_ms_min", "peak_rss_mib", "layers", "dim", "heads", "seq", "micro",
            "accum", "vocab", "precision", "recompute", "steps", "warmup", "threads", "load_avg_1m")
    best = t["micro"] * t["accum"] * t["seq"] / (t["step_ms_min"] / 1e3)  # the fastest step: the most demanding rate
    return {"suite": "data", "name": "trainer_consumption", "impl": "memopt_bench_trainer", "model": t["name"],
            "tokens_per_s_best": best, **{k: t[k] for k in keys}}
