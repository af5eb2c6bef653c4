#!/usr/bin/env python3
"""benchmarks/report.py — turns `scripts/bench` JSON lines into the markdown tables of README.md and docs/:
  trainer          one row per configuration, memopt next to the PyTorch 2.x peers (eager and
                   torch.compile), with the ratios the suite printed
  distill          one row per strategy, with its ratios to the naive baseline
  distill_quality  one row per student: masked-token CE at three mask ratios
  stack            one row per memory lever added, with its ratios to the fp32 baseline
  attention        one row per sequence length: math / SDPA / blockwise; the chunked loss
  adamw8bit        fp32 AdamW next to 8-bit AdamW
  allocator        one row per MEMOPT_ALLOC_CONF setting
  moe              per MoE preset: original (dense dispatch, fp32) and optimized, with ratios
  moe_budget       the memory fits per setting; per budget, the largest micro-batch per setting,
                   the recommendation and its measured peak RSS
  moe_quality      MoE next to the dense LLaMA with the same active parameters
  gritlm           GradCache against the plain step (memory, tokens/s, ratios to plain-64);
                   the data path with 0 and 2 worker threads
  estimator        per configuration: the estimator's predicted peak, the tracker's measured
                   peak of one real step, the error, the phase the peak falls in
  planner          per configuration: the cost model's s/step next to the measured one, and the
                   peaks; per budget, the planner's choice against the measured fastest (regret);
                   the Spearman rank correlation
   scripts/bench trainer > r.jsonl && benchmarks/report.py r.jsonl"""
import json
import sys


def distill(lines):
    by_impl = {r["impl"]: r for r in lines}
    print("| strategy | peak tracked tensors | peak RSS | tokens/s | tracked vs none | RSS vs none | speed vs none |")
    print("|---|---|---|---|---|---|---|")
    for impl in ("none", "simple", "comprehensive", "comprehensive_fp32", "comprehensive_levers"):
        r, q = by_impl.get(impl), by_impl.get(f"ratio_{impl}_to_none")
        if not r:
            continue
        ratios = (f"**{q['peak_tracked_mib']:.2f}×** | **{q['peak_rss_mib']:.2f}×** | {q['tokens_per_s']:.2f}×"
                  if q else "1 | 1 | 1")
        print(f"| {impl} | {r['peak_tracked_mib']:.0f} MiB | {r['peak_rss_mib']:.0f} MiB | "
              f"{r['tokens_per_s']:.0f} | {ratios} |")


def distill_quality(lines):
    print("| student | KD | masked CE @ 0.15 | @ 0.5 | @ 0.85 | teacher perplexity | peak tracked |")
    print("|---|---|---|---|---|---|---|")
    for r in lines:
        kd = "none (α = 0)" if r["alpha"] == 0 else (
            f"α = {r['alpha']}, " + ("dense" if r["kd_top_k"] == 0 else f"top-{r['kd_top_k']} + tail")
            + (", bf16 teacher" if r.get("teacher_precision") == "bf16" else ""))
        print(f"| {r['impl']} | {kd} | {r['masked_ce_0.15']:.3f} | {r['masked_ce_0.5']:.3f} | "
              f"{r['masked_ce_0.85']:.3f} | {r['teacher_perplexity']:.0f} | "
              f"{r.get('peak_tracked_mib', float('nan')):.0f} MiB |")


def stack(lines):
    rows = [r for r in lines if not r["name"].startswith("ratio_")]
    ratio = {r["name"][len("ratio_"):-len("_to_fp32")]: r for r in lines if r["name"].startswith("ratio_")}
    print("| row (lever added) | vocab | peak tracked | peak RSS | tokens/s | loss after the steps | "
          "optimizer state in RAM | tracked vs fp32 | RSS vs fp32 | speed vs fp32 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        q = ratio.get(r["name"])
        ratios = (f"**{q['peak_tracked_mib']:.2f}×** | {q['peak_rss_mib']:.2f}× | {q['tokens_per_s']:.2f}×"
                  if q else "1 | 1 | 1")
        print(f"| {r['name']} | {r['vocab']} | {r['peak_tracked_mib']:.0f} MiB | {r['peak_rss_mib']:.0f} MiB | "
              f"{r['tokens_per_s']:.0f} | {r['loss_last']:.4f} | {r['state_mib']:.0f} MiB | {ratios} |")


def attention(lines):
    by = {(r["name"], r["impl"], r.get("L", r.get("N"))): r for r in lines}
    print("| L | math: peak tracked | ms | ATen SDPA: peak tracked | ms | blockwise: peak tracked | ms | "
          "blockwise / math: memory | time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for L in sorted({r["L"] for r in lines if r["name"] == "attention"}):
        cells = []
        for impl in ("math", "sdpa", "blockwise"):
            r = by.get(("attention", impl, L))
            cells += ([f"{r['peak_tracked_mib']:.0f} MiB", f"{r['ms']:.0f}"] if r and "ms" in r else ["—", "—"])
        q = by.get(("attention", "ratio_blockwise_to_math", L))
        cells += [f"**{q['peak_tracked_mib']:.3f}×**", f"**{q['ms']:.2f}×**"] if q else ["—", "—"]
        print(f"| {L} | " + " | ".join(cells) + " |")
    ce = [r for r in lines if r["name"] == "cross_entropy" and not r["impl"].startswith("ratio")]
    if ce:
        print("\n| loss (N rows × V) | peak tracked | ms |")
        print("|---|---|---|")
        for r in ce:
            print(f"| {r['impl']} ({r['N']} × {r['V']}) | {r['peak_tracked_mib']:.0f} MiB | {r['ms']:.0f} |")


def adamw8bit(lines):
    print("| optimizer | loss (mean of the last 10 steps) | held-out loss | state | peak tracked | peak RSS |")
    print("|---|---|---|---|---|---|")
    for r in lines:
        if r["impl"].startswith("ratio"):
            continue
        print(f"| {r['impl']} | {r['loss_last']:.4f} | {r['val_loss']:.4f} | {r['state_mib']:.1f} MiB | "
              f"{r['peak_tracked_mib']:.0f} MiB | {r['peak_rss_mib']:.0f} MiB |")


def allocator(lines):
    print("| MEMOPT_ALLOC_CONF | peak tracked | peak RSS | tokens/s |")
    print("|---|---|---|---|")
    for r in lines:
        print(f"| `{r['impl']}` | {r['peak_tracked_mib']:.0f} MiB | {r['peak_rss_mib']:.0f} MiB | "
              f"{r['tokens_per_s']:.0f} |")


def moe(lines):
    by = {(r["name"], r["impl"]): r for r in lines}
    print("| preset | impl | settings | peak tracked | peak RSS | tokens/s | tracked vs original | "
          "RSS vs original | speed vs original |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in dict.fromkeys(r["name"] for r in lines):
        q = by.get((name, "ratio_optimized_to_original"))
        for impl in ("original", "optimized"):
            r = by.get((name, impl))
            if not r:
                continue
            ratios = (f"**{q['peak_tracked_mib']:.2f}×** | **{q['peak_rss_mib']:.2f}×** | {q['tokens_per_s']:.2f}×"
                      if q and impl == "optimized" else "1 | 1 | 1")
            print(f"| {name} ({r['params'] / 1e6:.1f} M) | {impl} | `{r['flags']}` | {r['peak_tracked_mib']:.0f} MiB | "
                  f"{r['peak_rss_mib']:.0f} MiB | {r['tokens_per_s']:.0f} | {ratios} |")


def moe_budget(lines):
    fits = [r for r in lines if r["name"] == "fit"]
    budgets = [r for r in lines if r["name"] == "budget"]
    verified = {r["budget_gib"]: r for r in lines if r["name"] == "verified"}
    settings = [f["setting"] for f in fits]
    print("| setting | flags | peak RSS ≈ | tracked per sequence | tokens/s (micro-batch 16) |")
    print("|---|---|---|---|---|")
    for f in fits:
        print(f"| {f['setting']} | `{f['flags'] or '(none)'}` | {f['rss_intercept_mib']:.0f} + "
              f"{f['rss_mib_per_sequence']:.1f} MiB × micro-batch | {f['tracked_mib_per_sequence']:.1f} MiB | "
              f"{f['tokens_per_s']:.0f} |")
    print()
    print("| budget | " + " | ".join(f"largest micro-batch: {s}" for s in settings) +
          " | recommended | micro-batch × accumulation | measured peak RSS |")
    print("|---|" + "---|" * len(settings) + "---|---|---|")
    for b in budgets:
        v = verified.get(b["budget_gib"])
        measured = (f"{v['peak_rss_mib']:.0f} MiB ({'fits' if v['within_budget'] else 'OVER'})" if v else "—")
        accum = f"{b['micro_batch']} × {b['grad_accum']}" if b["micro_batch"] else "does not fit"
        cap = b.get("max_micro_batch")
        largest = [b["largest_micro_batch"][s] for s in settings]
        print(f"| {b['budget_gib']} GiB | " + " | ".join(f"{n}+" if n == cap else str(n) for n in largest) +
              f" | {b['recommended']} (`{b['flags'] or 'no flags'}`) | {accum} | {measured} |")


def moe_quality(lines):
    print("| model | parameters | active per token | tokens/s | held-out loss | perplexity |")
    print("|---|---|---|---|---|---|")
    for r in lines:
        if r["impl"].startswith("ratio"):
            continue
        print(f"| {r['impl']} | {r['params'] / 1e6:.2f} M | {r['active_params'] / 1e6:.2f} M | {r['tokens_per_s']:.0f} | "
              f"{r['eval_loss']:.4f} | {r['perplexity']:.1f} |")


def gritlm(lines):
    ratios = {r["name"]: r for r in lines if r["impl"] == "ratio"}
    print("| configuration | peak tracked | peak RSS | tokens/s |")
    print("|---|---|---|---|")
    for r in lines:
        if r["impl"] != "ratio" and "peak_tracked_mib" in r:
            print(f"| {r['name']} | {r['peak_tracked_mib']:.0f} MiB | {r['peak_rss_mib']:.0f} MiB | {r['tokens_per_s']:.0f} |")
    g = ratios.get("gradcache-64-8_to_plain-64")
    if g:
        print(f"| gradcache-64-8 / plain-64 | **{g['peak_tracked_mib']:.2f}×** | **{g['peak_rss_mib']:.2f}×** | "
              f"{g['tokens_per_s']:.2f}× |")
    print()
    print("| data path | batches/s | texts/s | tokens/s |")
    print("|---|---|---|---|")
    for r in lines:
        if r["impl"] != "ratio" and "items_per_s" in r:
            print(f"| {r['workers']} workers | {r['batches_per_s']:.1f} | {r['items_per_s']:.0f} | {r['tokens_per_s']:.0f} |")
    d = ratios.get("data-workers-2_to_0")
    if d:
        print(f"| 2 / 0 workers | | {d['items_per_s']:.2f}× | {d['tokens_per_s']:.2f}× |")


def gritlm_quality(lines):
    print("| initial weights | retrieval top-1 before → after | MRR before → after | TF-IDF top-1 / MRR | "
          "generative perplexity before → after |")
    print("|---|---|---|---|---|")
    for r in lines:
        print(f"| {r['name']} | {r['retrieval_top1_before']:.3f} → {r['retrieval_top1_after']:.3f} | "
              f"{r['retrieval_mrr_before']:.3f} → {r['retrieval_mrr_after']:.3f} | "
              f"{r['tfidf_top1']:.3f} / {r['tfidf_mrr']:.3f} | "
              f"{r['perplexity_before']:.0f} → {r['perplexity_after']:.0f} |")


def estimator(lines):
    print("| configuration | policies | shape | predicted | measured | error |")
    print("|---|---|---|---|---|---|")
    for r in lines:
        print(f"| {r['name']} | {r['policies']} | {r['shape']} | {r['predicted_mib']:.1f} MiB | "
              f"{r['measured_mib']:.1f} MiB | {100 * r['error']:+.1f}% |")
    worst = max(abs(r["error"]) for r in lines)
    print(f"\n{len(lines)} configurations, largest error {100 * worst:.1f}%")


def planner(lines):
    rows = [r for r in lines if r["name"] != "cost_model"]
    print("| configuration | predicted s/step | measured s/step | predicted / measured | predicted / measured peak |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['predicted_s_per_step']:.3f} | {r['measured_s_per_step']:.3f} | "
              f"{r['predicted_s_per_step'] / r['measured_s_per_step']:.2f} | "
              f"{r['predicted_mib']:.0f} / {r['measured_mib']:.0f} MiB |")
    summary = next((r for r in lines if r["name"] == "cost_model"), None)
    if not summary:
        return
    print("\n| shape | budget | fit (measured) | planner's choice | its measured s/step, peak | measured fastest | s/step | "
          "regret |")
    print("|---|---|---|---|---|---|---|---|")
    for b in summary["budgets"]:
        chosen = "—"
        if b["chosen"]:
            over = "" if b["chosen_measured_mib"] <= b["budget_mib"] else " (OVER)"
            chosen = f"{b['chosen_measured_s']:.3f}, {b['chosen_measured_mib']:.0f} MiB{over}"
        fastest = f"{b['fastest_measured_s']:.3f}" if b["fastest"] else "—"
        regret = f"**{b['regret']:.2f}×**" if b["regret"] is not None else "—"
        print(f"| {b.get('shape', 'reference')} | {b['budget_mib']:g} MiB | {b['fit']} | {b['chosen'] or 'none fits'} | {chosen} | "
              f"{b['fastest'] or 'none fits'} | {fastest} | {regret} |")
    per_shape = "".join(f", {label} {summary[key]:.2f}" for key, label in
                        (("spearman_reference", "reference shape"), ("spearman_large", "8 × d512 shape"))
                        if summary.get(key) is not None)
    print(f"\n{summary['configurations']} configurations: Spearman rank correlation of predicted vs measured "
          f"s/step **{summary['spearman']:.2f}**{per_shape}; predicted / measured median {summary['median_ratio']:.2f}, "
          f"largest deviation from the median {100 * summary['max_ratio_error']:.0f}% "
          f"({summary['max_ratio_error_at']})")


RENDER = {"distill": distill, "distill_quality": distill_quality, "stack": stack, "attention": attention,
          "adamw8bit": adamw8bit, "allocator": allocator,
          "moe": moe, "moe_budget": moe_budget, "moe_quality": moe_quality, "gritlm": gritlm,
          "gritlm_quality": gritlm_quality, "estimator": estimator, "planner": planner}


def at_step(peer: dict, memopt: dict) -> float:
    """The peer's loss after as many steps as memopt took (torch.compile warms up one step more)."""
    n = memopt.get("warmup", 0) + memopt.get("steps", 0)
    losses = peer.get("losses", [])
    return losses[n - 1] if 0 < n <= len(losses) else peer["loss_last"]


def main(path):
    rows, order = {}, []
    overhead = None
    suites = {}
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if r.get("suite") in RENDER:
            suites.setdefault(r["suite"], []).append(r)
            continue
        if r["name"] == "overhead":
            overhead = r
            continue
        if r["name"] not in rows:
            rows[r["name"]] = {}
            order.append(r["name"])
        key = r["impl"] + (":" + r["peer"] if r["impl"] == "ratio" and "peer" in r else "")
        rows[r["name"]][key] = r
    for name, render in RENDER.items():
        if name in suites:
            render(suites[name])
    if not order:
        return
    first = next(iter(rows[order[0]].values()))
    print(f"LibTorch / PyTorch {first.get('torch_version', '?')}, CPU flags: {first.get('cpu_flags', '?')}\n")
    print("| configuration | memopt tok/s | eager tok/s | ratio | compile tok/s | ratio | memopt peak tracked "
          "| memopt peak RSS | eager peak RSS | ratio | compile peak RSS | loss first → last (memopt; peers) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in order:
        m, e, c = (rows[name].get(k) for k in ("memopt", "pytorch", "pytorch_compile"))
        qe, qc = rows[name].get("ratio:eager", rows[name].get("ratio")), rows[name].get("ratio:compile")
        if not (m and e and qe):
            continue
        peers = [x for x in (e, c) if x]
        same = "same" if all(abs(m["loss_last"] - at_step(x, m)) < 1e-3 * abs(m["loss_last"]) for x in peers) else "differ"
        ctok = f"{c['tokens_per_s']:.0f}" if c else "—"
        cq = f"**{qc['tokens_per_s']:.2f}×**" if qc else "—"
        crss = f"{c['peak_rss_mib']:.0f} MiB" if c else "—"
        print(f"| {name} | {m['tokens_per_s']:.0f} | {e['tokens_per_s']:.0f} | **{qe['tokens_per_s']:.2f}×** | {ctok} | {cq} | "
              f"{m['peak_tracked_mib']:.0f} MiB | {m['peak_rss_mib']:.0f} MiB | {e['peak_rss_mib']:.0f} MiB | "
              f"**{qe['peak_rss_mib']:.2f}×** | {crss} | {m['loss_first']:.4f} → {m['loss_last']:.4f} ({same}) |")
    if overhead:
        print(f"\nTrainer step time / hand-written LibTorch loop: **{overhead['step_time']:.3f}×**")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/dev/stdin")
