#!/usr/bin/env python3
"""benchmarks/report.py — turns `scripts/bench trainer` JSON lines into the README's
markdown table: one row per configuration, memopt next to the PyTorch eager peer, with the
ratios the suite printed.   scripts/bench trainer > r.jsonl && benchmarks/report.py r.jsonl"""
import json
import sys


def main(path):
    rows, order = {}, []
    overhead = None
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if r["name"] == "overhead":
            overhead = r
            continue
        if r["name"] not in rows:
            rows[r["name"]] = {}
            order.append(r["name"])
        rows[r["name"]][r["impl"]] = r
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
