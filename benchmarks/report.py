#!/usr/bin/env python3
"""benchmarks/report.py — turns `scripts/bench` JSON lines into the README's markdown tables:
  trainer          one row per configuration, memopt next to the PyTorch eager peer, with
                   the ratios the suite printed
  distill          one row per strategy, with its ratios to the naive baseline
  distill_quality  one row per student: masked-token CE at three mask ratios
   scripts/bench trainer > r.jsonl && benchmarks/report.py r.jsonl"""
import json
import sys


def distill(lines):
    by_impl = {r["impl"]: r for r in lines}
    print("| strategy | peak tracked tensors | peak RSS | tokens/s | tracked vs none | RSS vs none | speed vs none |")
    print("|---|---|---|---|---|---|---|")
    for impl in ("none", "simple", "comprehensive", "comprehensive_fp32"):
        r, q = by_impl.get(impl), by_impl.get(f"ratio_{impl}_to_none")
        if not r:
            continue
        ratios = (f"**{q['peak_tracked_mib']:.2f}×** | **{q['peak_rss_mib']:.2f}×** | {q['tokens_per_s']:.2f}×"
                  if q else "1 | 1 | 1")
        print(f"| {impl} | {r['peak_tracked_mib']:.0f} MiB | {r['peak_rss_mib']:.0f} MiB | "
              f"{r['tokens_per_s']:.0f} | {ratios} |")


def distill_quality(lines):
    print("| student | KD | masked CE @ 0.15 | @ 0.5 | @ 0.85 | teacher perplexity |")
    print("|---|---|---|---|---|---|")
    for r in lines:
        kd = "none (α = 0)" if r["alpha"] == 0 else (
            f"α = {r['alpha']}, " + ("dense" if r["kd_top_k"] == 0 else f"top-{r['kd_top_k']} + tail"))
        print(f"| {r['impl']} | {kd} | {r['masked_ce_0.15']:.3f} | {r['masked_ce_0.5']:.3f} | "
              f"{r['masked_ce_0.85']:.3f} | {r['teacher_perplexity']:.0f} |")


def main(path):
    rows, order = {}, []
    overhead = None
    suites = {}
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if r.get("suite") in ("distill", "distill_quality"):
            suites.setdefault(r["suite"], []).append(r)
            continue
        if r["name"] == "overhead":
            overhead = r
            continue
        if r["name"] not in rows:
            rows[r["name"]] = {}
            order.append(r["name"])
        rows[r["name"]][r["impl"]] = r
    if "distill" in suites:
        distill(suites["distill"])
    if "distill_quality" in suites:
        distill_quality(suites["distill_quality"])
    if not order:
        return
    print("| configuration | memopt tok/s | PyTorch tok/s | ratio | memopt peak tracked | memopt peak RSS | PyTorch peak RSS | ratio | loss first → last (both) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in order:
        m, p, q = (rows[name].get(k) for k in ("memopt", "pytorch", "ratio"))
        if not (m and p and q):
            continue
        same = "same" if abs(m["loss_last"] - p["loss_last"]) < 1e-3 * abs(p["loss_last"]) else "differ"
        print(f"| {name} | {m['tokens_per_s']:.0f} | {p['tokens_per_s']:.0f} | **{q['tokens_per_s']:.2f}×** | "
              f"{m['peak_tracked_mib']:.0f} MiB | {m['peak_rss_mib']:.0f} MiB | {p['peak_rss_mib']:.0f} MiB | "
              f"**{q['peak_rss_mib']:.2f}×** | {m['loss_first']:.4f} → {m['loss_last']:.4f} ({same}) |")
    if overhead:
        print(f"\nTrainer step time / hand-written LibTorch loop: **{overhead['step_time']:.3f}×**")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/dev/stdin")
