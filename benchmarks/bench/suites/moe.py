"""The MoE suites (examples/02_moe, moe_lm; benchmarks/models/moe_bench.py makes the lines): moe,
moe_budget, moe_quality."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .. import lines as L
from ..core import LOAD, Context, load_average
from ..steps import Build, Corpus, Derive, Files, Run, Step


def helper(ctx: Context, *args: str) -> list[str]:
    return [ctx.python, ctx.script("benchmarks/models/moe_bench.py"), *args]


def helper_text(ctx: Context, *args: str) -> str:
    """moe_bench.py's output (its lines); a failure raises."""
    status, text = ctx.call(helper(ctx, *args), stdout="all")
    if status != 0:
        raise RuntimeError(f"moe_bench.py {args[0]} exited with status {status}")
    return text


def moe_run(ctx: Context, out: Path, args: list[str], line_args: tuple[str, ...] = (), **kw) -> Run:
    """One moe_lm run on the King James corpus (its summary in OUT/metrics.jsonl). line_args: SUITE NAME IMPL
    [KEY=VALUE...] of the moe_bench.py line that makes its JSON line after it (LOAD: the load average then)."""
    if line_args:
        full = ("line", *line_args[:3], str(out / "metrics.jsonl"), *line_args[3:])
        kw.setdefault("line", lambda _: helper_text(ctx, *(a.replace(LOAD, load_average(1)) for a in full)))
        kw.setdefault("made", ctx.shown(helper(ctx, *full)).replace(LOAD, "<load>"))
    # --grad_accum 1 first (the flags in args override it): the suites' figures were measured with it,
    # before moe_lm's default became the seed's 2.
    return Run([ctx.example("02_moe", "moe_lm"), "--data", str(ctx.corpus), "--output_dir", str(out),
                "--log_interval", "1000", "--grad_accum", "1", *args], output="log", remove=[out],
               log=f"moe_lm {' '.join(args)}: load average {LOAD} before the run",
               error=f"error: moe_lm {' '.join(args)} failed", **kw)


# ---- suite: moe ----
# The seed's before/after memory story per preset (moe-nano, moe-micro), effective batch 16 x 256
# tokens: original = one-hot dense dispatch, fp32 (--precision fp32: moe_lm's default, auto, may
# take bf16), no checkpointing, micro-batch 16; optimized =
# sort-based dispatch, bf16 autocast, recompute::EveryBlock, micro-batch 4 x accumulation 4.
# One process each, 3 steps (the first included); then ratio lines (optimized / original;
# target: memory <= 0.25). ~6 min on an idle 2-core machine (--quick: 1 step of 2 x 32 tokens).
MOE_SIZE = "--steps 3 --warmup 1 --seq_len 256 --eval_batches 0"
MOE_FLAGS = {"original": "--dispatch dense --precision fp32 --batch_size 16 --grad_accum 1",
             "optimized": "--dispatch sorted --mixed_precision --gradient_checkpointing --batch_size 4 --grad_accum 4"}
MOE_QUICK_SIZE = "--steps 1 --warmup 0 --seq_len 32 --eval_batches 0"
MOE_QUICK_FLAGS = {"original": "--dispatch dense --precision fp32 --batch_size 2 --grad_accum 1",
                   "optimized": "--dispatch sorted --mixed_precision --gradient_checkpointing --batch_size 1 --grad_accum 2"}


def moe(ctx: Context) -> list[Step]:
    work = ctx.build_dir / "bench-moe"
    size, flags = (MOE_QUICK_SIZE, MOE_QUICK_FLAGS) if ctx.quick else (MOE_SIZE, MOE_FLAGS)
    steps: list[Step] = [Corpus(), Build(["moe_lm"])]
    for preset in ("moe-nano", "moe-micro"):
        for impl, f in flags.items():
            out = work / f"{preset}-{impl}"
            steps.append(moe_run(ctx, out, ["--config", preset, *size.split(), *f.split()], key=f"{preset}-{impl}",
                                 line_args=("moe", preset, impl, f"flags={f}", f"load_avg_1m={LOAD}")))
        steps.append(Derive([f"{preset}-optimized", f"{preset}-original"], parsed=False, what="moe_bench.py ratio",
                            make=lambda a, b, preset=preset: helper_text(
                                ctx, "ratio", "moe", preset, "ratio_optimized_to_original", a, b)))
    return steps


# ---- suite: moe_budget ----
# The "settings for your memory size" table for moe-nano (seq 256), computed: per setting
# (sorted dispatch; fp32 | bf16 | fp32 + checkpointing | bf16 + checkpointing) two runs at
# micro-batch 4 and 16 give peak RSS = a + b x micro-batch ("fit" lines); for budgets of 2, 4,
# 8 and 16 GiB, the largest micro-batch per setting and the recommendation ("budget" lines:
# the fastest setting that fits the effective batch of 16 in one micro-batch, else the one with
# the largest micro-batch); then each recommendation is run at its micro-batch ("verified"
# lines: the measured peak RSS, within the budget or not; one over it runs again, smaller, by its
# measured cost per sequence). ~10 min (--quick: 2 budgets, tiny).
MOE_BUDGET_SETTINGS = {"fp32": "--precision fp32", "bf16": "--mixed_precision", "fp32_ckpt": "--precision fp32 --gradient_checkpointing",
                       "bf16_ckpt": "--mixed_precision --gradient_checkpointing"}
MOE_BUDGET = {"micros": ("4", "16"), "budgets": ("2", "4", "8", "16"),
              "common": "--steps 2 --warmup 1 --seq_len 256 --eval_batches 0"}
MOE_BUDGET_QUICK = {"micros": ("1", "2"), "budgets": ("2", "4"),
                    "common": "--steps 1 --warmup 0 --seq_len 32 --eval_batches 0"}
EFFECTIVE_BATCH = "16"


@dataclass
class BudgetVerify(Step):
    """moe_bench.py budget over the measurements, printed; then each budget's recommendation, run at its
    micro-batch (1 with --quick): a "verified" line with the measured peak RSS within the budget or not."""
    work: Path
    measurements: Path
    common: list[str]
    budgets: tuple[str, ...]

    def budget_args(self) -> tuple[str, ...]:
        return ("budget", str(self.measurements), EFFECTIVE_BATCH, *self.budgets)

    def run(self, ctx: Context, lines: dict[str, str]) -> bool:
        status, text = ctx.call(helper(ctx, *self.budget_args()), stdout="all")
        if status != 0:
            ctx.fail("error: moe_bench.py budget failed")
            return False
        ctx.emit(text)
        parsed = [json.loads(l) for l in text.splitlines() if l.startswith("{")]
        intercept = {f["setting"]: f["rss_intercept_mib"] for f in parsed if f.get("name") == "fit"}
        for budget in (b for b in parsed if b.get("name") == "budget"):
            micro, flags = budget["micro_batch"], budget["flags"]
            if not isinstance(micro, int) or micro < 1:
                continue
            gib, micro = str(budget["budget_gib"]), 1 if ctx.quick else micro
            # The straight line may underestimate far above its two points: a run over the budget is
            # scaled down by its measured per-sequence cost and run again (at most VERIFY_TRIES runs).
            for attempt in range(VERIFY_TRIES):
                out = self.work / f"verify-{gib}-{attempt}"
                verified = ("line", "moe_budget", "verified", flags or "fp32", str(out / "metrics.jsonl"),
                            f"budget_gib={gib}", f"micro_batch={micro}", f"attempt={attempt + 1}")
                moe_run(ctx, out, [*self.common, "--batch_size", str(micro), *flags.split()],
                        line=lambda _, v=verified, o=out: helper_text(ctx, *v, f"within_budget={within(o, gib)}")
                        ).run(ctx, lines)
                micro = corrected_micro(micro, L.last_number(out / "metrics.jsonl", "peak_rss_mib"), float(gib) * 1024,
                                        intercept.get(budget["recommended"], 0.0))
                if ctx.quick or micro is None:
                    break
        return True

    def show(self, ctx: Context) -> None:
        print(ctx.shown(helper(ctx, *self.budget_args())))
        print("# then per budget line with micro_batch >= 1 (--quick: run at micro-batch 1); a run over its budget"
              " runs again at MICRO_BATCH x (budget - a) / (peak - a), a the fit's intercept, up to"
              f" {VERIFY_TRIES} runs (attempt=N):")
        moe_run(ctx, self.work / "verify-GIB-N", [*self.common, "--batch_size", "MICRO_BATCH", "FLAGS"],
                line_args=("moe_budget", "verified", "FLAGS", "budget_gib=GIB", "micro_batch=MICRO_BATCH",
                           "attempt=N", "within_budget=true|false")).show(ctx)


VERIFY_TRIES = 3


def corrected_micro(micro: int, peak: str, budget_mib: float, intercept_mib: float) -> int | None:
    """The micro-batch to try next after a run at `micro` peaked at `peak` MiB: None when it fit (or
    nothing was measured); else `micro` scaled by (budget - a) / (peak - a), a the fit's intercept."""
    try:
        measured = float(peak)
    except ValueError:
        return None
    if measured <= budget_mib or measured <= intercept_mib:
        return None
    smaller = int(micro * (budget_mib - intercept_mib) / (measured - intercept_mib))
    return smaller if 1 <= smaller < micro else None


def within(out: Path, gib: str) -> str:
    """Whether the run's last peak_rss_mib is within GIB GiB: "true", "false" or "" (none found)."""
    peak = L.last_number(out / "metrics.jsonl", "peak_rss_mib")
    try:
        return "true" if float(peak) <= float(gib) * 1024 else "false"
    except ValueError:
        return ""


def moe_budget(ctx: Context) -> list[Step]:
    work, measurements = ctx.build_dir / "bench-moe-budget", ctx.build_dir / "bench-moe-budget.jsonl"
    plan = MOE_BUDGET_QUICK if ctx.quick else MOE_BUDGET
    common = plan["common"].split()
    steps: list[Step] = [Corpus(), Build(["moe_lm"]), Files(truncate=[measurements])]
    for setting, flags in MOE_BUDGET_SETTINGS.items():
        for micro in plan["micros"]:
            out = work / f"{setting}-{micro}"
            steps.append(moe_run(ctx, out, [*common, "--batch_size", micro, *flags.split()], tee=measurements,
                                 line_args=("moe_budget", "measurement", setting, f"setting={setting}",
                                            f"micro_batch={micro}", f"flags={flags}")))
    return steps + [BudgetVerify(work, measurements, common, plan["budgets"])]


# ---- suite: moe_quality ----
# MoE against the dense LLaMA with the same active parameters (SwiGLU width top_k x the
# expert's), moe-nano, the same init seed, batches and 200 steps (fp32, micro-batch 8 x 256):
# tokens/s and held-out perplexity (16 batches), one line each, then their ratio. ~9 min.
MOE_QUALITY = "--config moe-nano --steps 200 --warmup 10 --batch_size 8 --seq_len 256 --eval_batches 16"
MOE_QUALITY_QUICK = "--config moe-nano --steps 2 --warmup 1 --batch_size 2 --seq_len 32 --eval_batches 1"


def moe_quality(ctx: Context) -> list[Step]:
    work = ctx.build_dir / "bench-moe-quality"
    common = (MOE_QUALITY_QUICK if ctx.quick else MOE_QUALITY).split()
    steps: list[Step] = [Corpus(), Build(["moe_lm"])]
    for impl, extra in (("moe", []), ("dense", ["--dense"])):
        steps.append(moe_run(ctx, work / impl, [*common, *extra], key=impl,
                             line_args=("moe_quality", "moe-nano", impl, f"load_avg_1m={LOAD}")))
    return steps + [Derive(["moe", "dense"], L.moe_quality_ratio, "ratio_moe_to_dense")]
