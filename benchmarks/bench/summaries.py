"""The longer summaries (scripts/bench's heredocs, the same computation and keys): the planner's cost_model
line, the data suite's ratio lines and the dist suite's ratio lines. Each returns its lines as dicts."""
from __future__ import annotations

import json
import statistics
from typing import Mapping, Sequence


# ---- planner ----
def ranks(xs: Sequence[float]) -> list[float]:  # 1-based, ties share their mean rank
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    for i in order:
        tied = [p for p, j in enumerate(order) if xs[j] == xs[i]]
        r[i] = 1 + sum(tied) / len(tied)
    return r


def fastest(group: list[dict], time_key: str, mib_key: str, budget: float) -> dict | None:
    """The quickest by time_key of the rows within budget by mib_key."""
    fits = [r for r in group if r[mib_key] <= budget]
    return min(fits, key=lambda r: r[time_key]) if fits else None


def spearman(group: list[dict]) -> float | None:
    if len(group) < 3:
        return None
    return round(statistics.correlation(ranks([r["predicted_s_per_step"] for r in group]),
                                        ranks([r["measured_s_per_step"] for r in group])), 4)


def planner_summary(every: list[dict], budget_args: Sequence[str]) -> dict:
    """The "cost_model" line from the configurations' lines; budget_args: SHAPE:MiB, e.g. reference:200."""
    budgets = [b.split(":") for b in budget_args]
    rows = [r for r in every if not r["name"].startswith("large-")]  # the reference shape
    large = [r for r in every if r["name"].startswith("large-")]
    ratio = [r["predicted_s_per_step"] / r["measured_s_per_step"] for r in every]
    median = statistics.median(ratio)
    # The cost model only ranks (its machine figures are rough): its error is the spread of the ratio
    # around the median, not the distance of the ratio from 1.
    error = [abs(q / median - 1) for q in ratio]
    worst = max(range(len(every)), key=lambda i: error[i])
    out = {"suite": "planner", "name": "cost_model", "configurations": len(every), "spearman": spearman(every),
           "spearman_reference": spearman(rows), "spearman_large": spearman(large), "median_ratio": round(median, 4),
           "max_ratio_error": round(error[worst], 4), "max_ratio_error_at": every[worst]["name"], "budgets": []}
    for shape, mib in budgets:
        budget, group = float(mib), rows if shape == "reference" else large
        chosen = fastest(group, "predicted_s_per_step", "predicted_mib", budget)
        best = fastest(group, "measured_s_per_step", "measured_mib", budget)
        out["budgets"].append({
            "shape": shape, "budget_mib": budget, "fit": sum(r["measured_mib"] <= budget for r in group),
            "chosen": chosen and chosen["name"], "chosen_measured_s": chosen and round(chosen["measured_s_per_step"], 4),
            "chosen_measured_mib": chosen and round(chosen["measured_mib"], 1),
            "fastest": best and best["name"], "fastest_measured_s": best and round(best["measured_s_per_step"], 4),
            "regret": round(chosen["measured_s_per_step"] / best["measured_s_per_step"], 4) if chosen and best else None})
    return out


# ---- data ----
def data_summary(raw: Mapping[str, str]) -> list[dict]:
    """Loader tokens/s over the trainer's fastest consumption (target >= 10) and the RSS growth lines."""
    lines = {k: json.loads(v) for k, v in raw.items()}
    out: list[dict] = []
    emit = lambda d: out.append({"suite": "data", **d})  # noqa: E731
    # Against the trainer's fastest step (its highest consumption rate; the mean suffers more from a busy machine).
    trainer = lines["trainer"]["tokens_per_s_best"] if "trainer" in lines else None
    for w in (0, 1, 2) if trainer else ():
        l = lines.get("throughput-w%d" % w)
        if l:
            ratio = l["tokens_per_s"] / trainer
            emit({"name": "throughput_vs_consumption", "impl": "ratio", "workers": w,
                  "loader_tokens_per_s": round(l["tokens_per_s"]), "trainer_tokens_per_s_best": round(trainer, 1),
                  "ratio": round(ratio, 1), "target": 10, "met": ratio >= 10})
    s, g, a = lines.get("stream-small"), lines.get("stream-large"), lines.get("load_all-small")
    if s and g:
        d = {"name": "rss_growth", "impl": "ratio", "stream_gib": [s["corpus_gib"], g["corpus_gib"]],
             "stream_growth_mib": [round(s["rss_growth_mib"], 1), round(g["rss_growth_mib"], 1)],
             "large_to_small": round(g["rss_growth_mib"] / s["rss_growth_mib"], 3)}
        if a:
            d.update({"load_all_gib": a["corpus_gib"], "load_all_growth_mib": round(a["rss_growth_mib"], 1),
                      "load_all_to_stream": round(a["rss_growth_mib"] / s["rss_growth_mib"], 1)})
        b = lines.get("load_all-large")
        if b:
            d.update({"load_all_large_gib": b["corpus_gib"], "load_all_large_growth_mib": round(b["rss_growth_mib"], 1),
                      "load_all_large_to_stream": round(b["rss_growth_mib"] / g["rss_growth_mib"], 1)})
        d.update({"target_mib": 64, "met": max(s["rss_growth_mib"], g["rss_growth_mib"]) < 64})
        emit(d)
    return out


# ---- dist ----
def dist_config(l: Mapping) -> dict:
    return {"precision": l["precision"], "ranks": l["ranks"], "threads_per_rank": l.get("threads_per_rank", l.get("threads")),
            "sharded": l.get("sharded", False), "param_gather": l.get("param_gather"),
            "attention": l.get("attention"), "fused_kernels": l.get("fused_kernels")}


def shape(l: Mapping) -> str:
    """A line's model shape, e.g. "4x256" (layers x width)."""
    return f"{l.get('layers', '?')}x{l.get('dim', '?')}"


def dist_summary(raw: Mapping[str, str]) -> list[dict]:
    """dist_speedup, loss_curve, dist_vs_peer and optimizer_state_per_rank from the lines kept as
    CONFIGURATION#ROUND."""
    runs: dict[str, list] = {}  # configuration -> its runs' lines, round by round
    for key, line in raw.items():
        runs.setdefault(key.split("#")[0], []).append((int(key.split("#")[1]), json.loads(line)))
    runs = {k: [l for _, l in sorted(v, key=lambda x: x[0])] for k, v in runs.items()}
    lines = {k: v[-1] for k, v in runs.items()}
    out: list[dict] = []
    emit = lambda d: out.append({"suite": "dist", **d})  # noqa: E731

    def median_step(key: str) -> float:  # over every timed step of every round
        return statistics.median([t for l in runs[key] for t in l["step_ms_all"]])

    for base, keys in (("one", ("two", "two-zero1-broadcast", "two-zero1-allgather", "two-zero3", "two-zero3-disk",
                                "one-2threads")),
                       ("peer-one", ("peer-two", "peer-two-fsdp2")), ("fp32-one", ("fp32-two",)),
                       ("math-one", ("math-two",))):
        one = lines.get(base)
        for key in keys:
            two = lines.get(key)
            if not one or not two:
                continue
            # tokens/s from the median step of all rounds (the same global batch: a ratio of step times)
            speedup = median_step(base) / median_step(key)
            mean = (statistics.mean(l["tokens_per_s"] for l in runs[key]) /
                    statistics.mean(l["tokens_per_s"] for l in runs[base]))
            d = {"name": "dist_speedup", "impl": "ratio" if base != "peer-one" else "ratio_pytorch", **dist_config(two),
                 "tokens_per_s": round(speedup, 4), "tokens_per_s_mean": round(mean, 4),
                 "tokens_per_s_best": round(min(l["step_ms_min"] for l in runs[base]) /
                                            min(l["step_ms_min"] for l in runs[key]), 4),
                 "rounds": len(runs[key]),
                 "tokens_per_s_by_round": [round(t["tokens_per_s"] / o["tokens_per_s"], 4)
                                           for o, t in zip(runs[base], runs[key])]}
            if two["ranks"] > 1 and base in ("one", "math-one"):
                d.update({"target": 1.8, "met": speedup >= 1.8})
            emit(d)
            if two["ranks"] > 1:
                rel = [abs(a - b) / abs(b) for a, b in zip(two["losses"], one["losses"])]
                emit({"name": "loss_curve", "impl": d["impl"], **dist_config(two), "steps": len(rel),
                      "max_rel_diff": max(rel), "last_rel_diff": rel[-1]})
    if "two" in runs and "peer-two" in runs:  # 2 ranks: memopt's tokens/s over PyTorch DDP's
        emit({"name": "dist_vs_peer", "impl": "ratio", **dist_config(lines["two"]),
              "tokens_per_s": round(median_step("peer-two") / median_step("two"), 4),
              "tokens_per_s_one_rank": round(median_step("peer-one") / median_step("one"), 4) if "peer-one" in runs else None,
              "peer": lines["peer-two"].get("peer_data_parallel")})
    for plain, key in (("two", "two-zero1-broadcast"), ("two", "two-zero1-allgather"), ("two-l8", "two-zero1-l8")):
        whole, sharded = lines.get(plain), lines.get(key)
        if whole and sharded:
            emit({"name": "optimizer_state_per_rank", "impl": "ratio", **dist_config(sharded), "shape": shape(sharded),
                  "value": round(sharded["optimizer_state_mib_per_rank"] / whole["optimizer_state_mib_per_rank"], 4),
                  "tokens_per_s": round(median_step(plain) / median_step(key), 4),
                  "sharded_mib_ranks": sharded["optimizer_state_mib_ranks"],
                  "unsharded_mib_ranks": whole["optimizer_state_mib_ranks"],
                  "source": "tracker: live bytes added by the first step, after a barrier; the largest rank's"})
    for plain, zero3, target in (("two", "two-zero3", 0.55), ("two", "two-zero3-disk", 0.55), ("two", "two-zero3-keep", None),
                                 ("two", "two-zero3-half", None), ("three", "three-zero3", 0.37),
                                 ("two-l8", "two-zero3-l8", 0.55), ("two-l8", "two-zero3-disk-l8", 0.55),
                                 ("two-l8", "two-zero3-half-l8", None)):
        if plain in lines and zero3 in lines:  # model state: tracked bytes at the optimizer phase's peak
            state = lines[zero3]["model_state_mib_per_rank"] / lines[plain]["model_state_mib_per_rank"]
            d = {"name": "zero3_vs_ddp", "impl": "ratio", **dist_config(lines[zero3]), "zero": 3,
                 "shape": shape(lines[zero3]), "offload_params": lines[zero3].get("offload_params", "none"),
                 "state_per_rank": round(state, 4), "target_state": target,
                 "zero3_mib_ranks": lines[zero3]["model_state_mib_ranks"],
                 "ddp_mib_ranks": lines[plain]["model_state_mib_ranks"],
                 "peak_tracked": round(lines[zero3]["peak_tracked_mib"] / lines[plain]["peak_tracked_mib"], 4)}
            d["keep_gathered"] = lines[zero3].get("keep_gathered", False)
            d["gather_half"] = lines[zero3].get("gather_half", False)
            if lines[zero3]["ranks"] == 2:  # 3 ranks share 2 cores: no speed there
                tokens = median_step(plain) / median_step(zero3)
                d.update({"tokens_per_s": round(tokens, 4), "target_tokens_per_s": 0.8})
                if target is not None:  # the speed target is plain ZeRO-3's (offload trades speed for memory)
                    d["met"] = state <= target and (tokens >= 0.8 or d["offload_params"] != "none")
            else:
                d["met"] = state <= target
            emit(d)
    # against the peers of ZeRO-3: FSDP2 (the targets) and DeepSpeed ZeRO-3 (for reference)
    for zero3, peer, name, targets in (
            ("two-zero3", "peer-two-fsdp2", "zero3_vs_fsdp2", True),
            ("two-zero3-l8", "peer-two-fsdp2-l8", "zero3_vs_fsdp2", True),
            ("two-zero3", "peer-two-deepspeed3", "zero3_vs_deepspeed", False),
            ("two-zero3-l8", "peer-two-deepspeed3-l8", "zero3_vs_deepspeed", False)):
        if zero3 not in lines or peer not in lines:
            continue
        z, f = lines[zero3], lines[peer]
        rss, tokens = z["peak_rss_mib"] / f["peak_rss_mib"], median_step(peer) / median_step(zero3)
        d = {"name": name, "impl": "ratio", **dist_config(z), "zero": 3, "shape": shape(z),
             "peak_rss_mib": round(rss, 4), "tokens_per_s": round(tokens, 4), "peer": f.get("peer_data_parallel"),
             "model_state_mib_per_rank": [z["model_state_mib_per_rank"],
                                          f.get("model_state_bytes_per_rank", 0) / (1 << 20)],
             "loss_last": [z.get("loss_last"), f.get("loss_last")]}
        if targets:
            d.update({"targets": {"peak_rss_mib": 1.0, "tokens_per_s": 1.1}, "met": rss <= 1.0 and tokens >= 1.1})
        emit(d)
    return out
