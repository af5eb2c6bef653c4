#!/usr/bin/env python3
"""scripts/bench's helper for the MoE suites (moe, moe_budget, moe_quality): turns moe_lm's
summary lines (OUT/metrics.jsonl) into the suites' JSON lines and fits the memory budgets.

  moe_bench.py line SUITE NAME IMPL METRICS_JSONL [KEY=VALUE...]   one result line
  moe_bench.py ratio SUITE NAME IMPL LINE_A LINE_B                 LINE_A / LINE_B per metric
  moe_bench.py budget MEASUREMENTS_JSONL EFFECTIVE_BATCH GIB...    the budget table (see fit_budgets)
"""
import json
import math
import sys

METRICS = ("peak_tracked_mib", "peak_rss_mib", "tokens_per_s")
MAX_MICRO = 512  # the budget table's largest micro-batch (sequences): beyond it, say "512+"


def emit(obj):
    print(json.dumps(obj, separators=(",", ":")))


def summary(path):
    lines = [json.loads(l) for l in open(path) if '"event":"summary"' in l]
    if not lines:
        sys.exit(f"moe_bench: no summary line in {path}. HINT: did the run finish?")
    return lines[-1]


def parse_value(v):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def line(suite, name, impl, path, *extra):
    s = summary(path)
    out = {"suite": suite, "name": name, "impl": impl}
    out.update({k: round(s[k], 1) for k in METRICS})
    for k in ("steps", "params", "active_params"):
        out[k] = s[k]
    if s.get("eval_loss") is not None:
        out["eval_loss"] = round(s["eval_loss"], 4)
        out["perplexity"] = round(s["perplexity"], 2)
    for kv in extra:
        k, v = kv.split("=", 1)
        out[k] = parse_value(v)
    emit(out)


def ratio(suite, name, impl, a, b):
    a, b = json.loads(a), json.loads(b)
    emit({"suite": suite, "name": name, "impl": impl, **{k: round(a[k] / b[k], 3) for k in METRICS}})


def fit_budgets(path, effective_batch, budgets):
    """Per setting, two measured runs (micro-batches m1 < m2) give peak RSS = a + b * micro.
    For each budget: the largest micro-batch per setting whose predicted peak RSS fits, and the
    recommendation: the fastest setting (tokens/s at m2) that fits the effective batch in one
    micro-batch, else the setting with the largest micro-batch (accumulation makes up the rest).
    Micro-batches are capped at MAX_MICRO."""
    runs = [json.loads(l) for l in open(path) if l.strip()]
    fits = {}
    for r in runs:
        fits.setdefault(r["setting"], []).append(r)
    models = {}
    for setting, rs in fits.items():
        rs.sort(key=lambda r: r["micro_batch"])
        lo, hi = rs[0], rs[-1]
        slope = (hi["peak_rss_mib"] - lo["peak_rss_mib"]) / (hi["micro_batch"] - lo["micro_batch"])
        models[setting] = {"intercept": lo["peak_rss_mib"] - slope * lo["micro_batch"], "slope": slope,
                           "tokens_per_s": hi["tokens_per_s"], "flags": hi["flags"],
                           "tracked_slope": (hi["peak_tracked_mib"] - lo["peak_tracked_mib"]) /
                           (hi["micro_batch"] - lo["micro_batch"])}
        emit({"suite": "moe_budget", "name": "fit", "setting": setting, "flags": hi["flags"],
              "rss_intercept_mib": round(models[setting]["intercept"], 1), "rss_mib_per_sequence": round(slope, 2),
              "tracked_mib_per_sequence": round(models[setting]["tracked_slope"], 2),
              "tokens_per_s": round(hi["tokens_per_s"], 1)})
    for gib in budgets:
        budget = gib * 1024.0
        largest = {}
        for setting, m in models.items():
            # A slope <= 0 (noise at tiny sizes) measures no growth: the cap applies.
            micro = math.floor((budget - m["intercept"]) / m["slope"]) if m["slope"] > 0 else MAX_MICRO
            largest[setting] = min(max(micro, 0), MAX_MICRO) if budget > m["intercept"] else 0
        one_step = [s for s in models if largest[s] >= effective_batch]
        if one_step:
            best = max(one_step, key=lambda s: models[s]["tokens_per_s"])
        else:
            best = max(models, key=lambda s: largest[s])
        micro = largest[best]
        emit({"suite": "moe_budget", "name": "budget", "budget_gib": gib, "max_micro_batch": MAX_MICRO,
              "largest_micro_batch": largest, "recommended": best, "flags": models[best]["flags"],
              "micro_batch": micro, "grad_accum": max(1, math.ceil(effective_batch / micro)) if micro else None,
              "predicted_peak_rss_mib": round(models[best]["intercept"] + models[best]["slope"] * micro, 1)})


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
    cmd, args = argv[1], argv[2:]
    if cmd == "line":
        line(*args)
    elif cmd == "ratio":
        ratio(*args)
    elif cmd == "budget":
        fit_budgets(args[0], int(args[1]), [int(g) if float(g).is_integer() else float(g) for g in args[2:]])
    else:
        sys.exit(f"moe_bench: unknown command '{cmd}'. HINT: line, ratio or budget.")


if __name__ == "__main__":
    main(sys.argv)
