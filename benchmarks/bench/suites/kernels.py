"""The kernel and model suites: attention, fused, estimator, planner."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from .. import lines as L
from ..core import LOAD, Context, log
from ..steps import Build, Corpus, Derive, Files, Run, Step, Summary
from ..summaries import planner_summary
from .lora import fastest_precision

# ---- suite: attention ----
# One forward+backward of causal attention (B=1, H=8, D=64, fp32) at L = 512 … 8192 on the
# math path, ATen's SDPA (LibTorch 2.x: the CPU flash kernel), memopt's blockwise path and
# memopt's brgemm flash attention (nn/attention_flash.hpp), one process each so each peak is its
# own; math prints a "skipped" line where it would need more than 8 GiB. Then the LM loss
# (N=4096 rows, C=512, V=32000) with the full logits and chunked. Ratio lines: blockwise/math
# per L (at L=4096 with the targets, peak <= 0.1x and time <= 1.2x), blockwise/sdpa and
# flash/sdpa per L, ce_chunked/ce_full; and flash/sdpa at the trainer suite's large shape (B 8, L 512)
# in fp32 and, where the CPU has bf16 units, in bf16. ~3.5 min on an idle 2-core machine
# (--quick: L 512 and 1024, one step each).
ATTENTION_LENGTHS = (512, 1024, 2048, 4096, 8192)
ATTENTION_STEPS = {  # untimed + timed passes; quiet 2-core math-path figures per pass in comments
    512: "--warmup 1 --steps 3", 1024: "--warmup 1 --steps 3", 2048: "--warmup 1 --steps 3",  # <= ~1.5 s
    4096: "--warmup 1 --steps 2",                                                             # ~5 s
    8192: "--warmup 0 --steps 1",                                                             # ~20 s, ~6 GiB
}
# The linear-memory kernels take a warm-up pass at 8192 too (~2 s each): a first pass times
# one-off costs (oneDNN generates flash's brgemm kernels per shape, per thread: +1.3 s there).
LINEAR_AT_8192 = "--warmup 1 --steps 1"
ATTENTION_TARGET = {4096: {"peak_tracked_mib": 0.1, "ms": 1.2}}  # blockwise / math
QUICK_STEPS = "--warmup 0 --steps 1"
TRAINER_SHAPE = "--L 512 --batch 8 --heads 8 --head_dim 64"  # the trainer suite's large shape (quick: 2 rows)


def attention_run(ctx: Context, key: str, args: list[str]) -> Run:
    return Run([ctx.bench("memopt_bench_attention"), *args], key=key,
               log=f"attention {' '.join(args)}: load average {LOAD} before the run",
               error=f"error: memopt_bench_attention {' '.join(args)} failed")


def attention(ctx: Context) -> list[Step]:
    steps: list[Step] = [Build(["memopt_bench_attention"])]
    for n in ATTENTION_LENGTHS[:2] if ctx.quick else ATTENTION_LENGTHS:
        def passes(impl: str) -> list[str]:
            if ctx.quick:
                return QUICK_STEPS.split()
            return (LINEAR_AT_8192 if n == 8192 and impl != "math" else ATTENTION_STEPS[n]).split()
        steps += [attention_run(ctx, f"{impl}-{n}", ["--impl", impl, "--L", str(n), *passes(impl)])
                  for impl in ("math", "sdpa", "blockwise", "flash")]
        steps += [Derive([f"blockwise-{n}", f"math-{n}"], partial(L.attention_ratio, target=ATTENTION_TARGET.get(n)),
                         "ratio_blockwise_to_math" + (" with its target" if n in ATTENTION_TARGET else "")),
                  Derive([f"blockwise-{n}", f"sdpa-{n}"], L.attention_ratio,  # LibTorch 2.x: SDPA's CPU flash kernel
                         "ratio_blockwise_to_sdpa"),
                  Derive([f"flash-{n}", f"sdpa-{n}"], L.attention_ratio, "ratio_flash_to_sdpa")]
    # The trainer suite's large shape, 8 rows: flash against SDPA in fp32 and in the precision `auto` picks
    # (bf16 where the CPU has bf16 units; there SDPA's bf16 backward is the slow part).
    shape = TRAINER_SHAPE.replace("--batch 8", "--batch 2") if ctx.quick else TRAINER_SHAPE
    for dtype in dict.fromkeys(("fp32", fastest_precision())):
        keys = [f"{impl}-b8-{dtype}" for impl in ("flash", "sdpa")]
        steps += [attention_run(ctx, key, ["--impl", key.split("-")[0], "--dtype", dtype, *shape.split(),
                                           *(QUICK_STEPS if ctx.quick else ATTENTION_STEPS[512]).split()])
                  for key in keys]
        steps.append(Derive(keys, L.attention_ratio, f"ratio_flash_to_sdpa at B 8, {dtype}"))
    passes = "--warmup 0 --steps 1 --rows 512" if ctx.quick else "--warmup 1 --steps 2"
    steps += [attention_run(ctx, impl, ["--impl", impl, *passes.split()]) for impl in ("ce_full", "ce_chunked")]
    return steps + [Derive(["ce_chunked", "ce_full"], L.attention_ratio, "ratio_ce_chunked_to_ce_full")]


# ---- suite: fused ----
# nn/fused.hpp's kernels next to their ATen composites: forward + backward of RMSNorm (an fp32
# weight, as in training), of SwiGLU's silu(g)·u, of RoPE on q and k, of the residual
# dropout-add (p 0.1; nn/fused_dropout.hpp) and of that add with the RMSNorm after it
# (nn/fused_add_norm.hpp; also against the two fused nodes it replaces), at the trainer suite's
# two shapes (2048 rows: 8 × 256 and 4 × 512 tokens; C 256 / 512, F 704 / 1408, 8 heads of
# 32 / 64), fp32 and bf16, and the chunked loss's softmax rows (N 2048, C 512, V 4096). One
# process per kernel, impl and dtype; a ratio line each (fused / composite; the target: ms < 1).
# Then QLoRA's NF4 matmul, tiled against the whole weight, and an fp32 linear layer's GEMMs on
# LibTorch's kernel and on fp32_gemm's blocked one. ~2.5 min (--quick: 256 rows).
FUSED_SHAPES = ((256, 704), (512, 1408))


def fused(ctx: Context) -> list[Step]:
    steps: list[Step] = [Build(["memopt_bench_attention"])]
    rows, passes = ("256", "--warmup 1 --steps 2") if ctx.quick else ("2048", "--warmup 3 --steps 20")
    for dim, ffn in FUSED_SHAPES:
        for dtype in ("fp32", "bf16"):
            for kernel, width in (("rms_norm", f"--hidden {dim}"), ("swiglu", f"--ffn {ffn}"),
                                  ("rope", f"--heads 8 --head_dim {dim // 8}"), ("dropout_add", f"--hidden {dim}"),
                                  ("add_rms_norm", f"--hidden {dim}")):
                impls = (kernel, f"{kernel}_fused") + (("add_rms_norm_pair_fused",) if kernel == "add_rms_norm" else ())
                keys = []
                for impl in impls:
                    key = f"{impl}-{dtype}-{dim}"
                    args = ["--impl", impl, "--dtype", dtype, "--rows", rows, *width.split(), *passes.split()]
                    steps.append(attention_run(ctx, key, args))
                    keys.append(key)
                steps.append(Derive([keys[1], keys[0]], L.fused_ratio, f"ratio_{kernel}_fused_to_{kernel}"))
                if len(keys) == 3:  # one node against the two fused nodes it replaces
                    steps.append(Derive([keys[1], keys[2]], L.fused_ratio, f"ratio_{kernel}_fused_to_pair"))
    # The chunked loss's softmax (V 4096 as the trainer suite's, chunks of 1024 rows).
    ce = ["--rows", rows, "--hidden", "512", "--vocab", "4096", *passes.split()]
    steps += [attention_run(ctx, impl, ["--impl", impl, *ce]) for impl in ("ce_chunked", "ce_chunked_fused")]
    steps.append(Derive(["ce_chunked_fused", "ce_chunked"], L.fused_ratio, "ratio_ce_chunked_fused_to_ce_chunked"))
    # QLoRA's base matmul (nn/qlora.hpp): the whole NF4 weight dequantised, or tiles of
    # kNf4TileBytes, forward + dX, at the lora suite's shapes (an MLP projection of the 8 × 512
    # and 12 × 1024 LLaMAs; the 7B shape's down_proj, 11008 -> 4096) in fp32 and bf16.
    for tokens, d_in, d_out in ((2048, 512, 1408), (512, 1024, 2816), (256, 11008, 4096)):
        nf4_passes = ("--warmup 0 --steps 1" if ctx.quick else "--warmup 1 --steps 5").split()
        for dtype in ("fp32", "bf16"):
            keys = []
            for impl in ("nf4_linear", "nf4_linear_fused"):
                key = f"{impl}-{dtype}-{d_in}x{d_out}"
                args = ["--impl", impl, "--dtype", dtype, "--rows", str(256 if ctx.quick else tokens),
                        "--hidden", str(d_in), "--ffn", str(d_out), *nf4_passes]
                steps.append(attention_run(ctx, key, args))
                keys.append(key)
            steps.append(Derive(keys[::-1], L.fused_ratio, "ratio_nf4_linear_fused_to_nf4_linear"))
    # An fp32 linear layer's three GEMMs (forward, dX, dW) on LibTorch's kernel and on fp32_gemm's
    # blocked one, at the 8 x d512 trainer's shapes: a micro-batch's 4096 rows through the q
    # (512 -> 512), gate (512 -> 1408) and down (1408 -> 512) projections, and a loss chunk's 1024
    # rows through the 4096-word head.
    linear_passes = ("--warmup 0 --steps 1" if ctx.quick else "--warmup 2 --steps 10").split()
    for tokens, d_in, d_out in ((4096, 512, 512), (4096, 512, 1408), (4096, 1408, 512), (1024, 512, 4096)):
        keys = []
        for impl in ("linear", "linear_blocked"):
            key = f"{impl}-{d_in}x{d_out}"
            args = ["--impl", impl, "--rows", str(256 if ctx.quick else tokens), "--hidden", str(d_in),
                    "--ffn", str(d_out), *linear_passes]
            steps.append(attention_run(ctx, key, args))
            keys.append(key)
        steps.append(Derive(keys[::-1], L.fused_ratio, "ratio_linear_blocked_to_linear"))
    return steps


# ---- suite: estimator ----
# memory/estimator.hpp's predicted peak next to the tracker's measured peak of one real step
# (after a warm-up step), one process per configuration, spanning the policies on the
# Trainer benchmark's reference LLaMA (4 × d256, seq 256, micro-batch 8, vocab 4096), two
# larger shapes, the moe-nano MoE LM and LLaMA → LLaDA distillation steps (a same-shape
# teacher; the demo's "comprehensive" settings, and dense KD). Tensor bytes do not depend on load or timing. ~4 min (--quick: seconds).
def estimator_configs(quick: bool) -> list[tuple[str, str]]:
    ref = "--layers 4 --dim 256 --heads 8 --seq 256 --micro 8 --vocab 4096"
    large = "--layers 8 --dim 512 --heads 8 --seq 512 --micro 4 --vocab 4096"
    gqa = "--layers 6 --dim 384 --heads 6 --kv_heads 2 --seq 384 --micro 6 --vocab 8192"
    if quick:  # smoke test: every configuration, tiny shapes
        ref = "--layers 2 --dim 64 --heads 4 --seq 32 --micro 2 --vocab 256"
        large = ref
        gqa = ref.replace("--heads 4", "--heads 4 --kv_heads 2", 1)
    moe = f"{ref} --experts 4 --ffn 512"  # moe-nano (models/moe.hpp, sorted dispatch, top-2)
    return [
        ("ref-fp32", ref),
        ("ref-every", f"{ref} --recompute every"),
        ("ref-every-2", f"{ref} --recompute every-2"),
        ("ref-selective", f"{ref} --recompute selective"),
        ("ref-bf16", f"{ref} --precision bf16"),
        ("ref-bf16-every-int8", f"{ref} --precision bf16 --recompute every --optimizer_state int8"),
        ("ref-bf16pure-accum2", f"{ref} --precision bf16-pure --accum 2"),
        ("ref-bf16-selective-disk", f"{ref} --precision bf16 --recompute selective --optimizer_state disk"),
        ("ref-blockwise-chunked", f"{ref} --attention blockwise --loss_chunk 512"),
        ("ref-dropout", f"{ref} --dropout 0.1"),
        ("large-fp32", large),
        ("large-bf16-every", f"{large} --precision bf16 --recompute every"),
        ("gqa-every-2-int8", f"{gqa} --recompute every-2 --optimizer_state int8"),
        ("moe-nano-fp32", moe),
        ("moe-nano-bf16-every", f"{moe} --precision bf16 --recompute every"),
        ("moe-nano-checkpoint-experts", f"{moe} --checkpoint_experts"),
        ("distill-comprehensive", f"{ref} --kd_top_k 64 --precision bf16 --recompute every --teacher_bf16"),
        ("distill-dense-kd", f"{ref} --kd_top_k 0"),
    ]


# GritLM through its example (a GritBatch step): --estimate_only next to a 2-step run's
# tracked peak on the King James pairs. The estimate takes the batcher's maximum lengths, the run
# real (shorter, length-bucketed) texts: the estimate is an upper bound there.
ESTIMATOR_GRIT = (("gritlm-gradcache-32-8", "--batch_size 32 --grad_cache_chunk 8"), ("gritlm-plain-8", "--batch_size 8"),
                  ("gritlm-plain-8-every", "--batch_size 8 --gradient_checkpointing"))


@dataclass
class EstimatorGrit(Step):
    """gritlm --estimate_only's "  peak N MiB" next to the tracked peak of a 2-step run: one estimator line."""
    name: str
    policies: str

    def commands(self, ctx: Context) -> tuple[str, list[str], list[str], Path]:
        gargs = (f"{self.policies} --group_size 2 --gen_batch_size 4 --data {ctx.corpus} "
                 f"--raw {ctx.root / 'data/raw/kjv'}")
        grit, out = ctx.example("03_gritlm", "gritlm"), ctx.build_dir / "bench-estimator-grit"
        return (gargs, [grit, *gargs.split(), "--estimate_only"],
                [grit, *gargs.split(), "--steps", "2", "--eval_queries", "0", "--eval_gen", "0", "--output_dir", str(out)],
                out)

    def run(self, ctx: Context, lines: dict[str, str]) -> bool:
        gargs, estimate, measure, out = self.commands(ctx)
        log(f"estimator {self.name}: {gargs}")
        _, text = ctx.call(estimate, stdout="merged")  # its exit status is not looked at: no peak line is the error
        found = re.findall(r"^  peak *([0-9.]*) MiB", text, flags=re.M)
        predicted = found[0] if found else ""
        Files(remove=[out]).run(ctx, lines)
        ctx.call(measure, stdout="log")  # `|| true`: a failed run leaves no measured peak
        measured = L.last_number(out / "metrics.jsonl", "peak_tracked_mib")
        if predicted and measured:
            ctx.emit(L.estimator_grit_line(self.name, self.policies, predicted, measured))
        else:
            ctx.fail(f"error: estimator {self.name} failed")
        return True

    def show(self, ctx: Context) -> None:
        _, estimate, measure, out = self.commands(ctx)
        print(ctx.shown(estimate, suffix=" 2>&1 | sed -n 's/^  peak *\\([0-9.]*\\) MiB.*/\\1/p'"))
        Files(remove=[out]).show(ctx)
        print(ctx.shown(measure, suffix=" >&2 || true"))
        print(f"#   -> the estimator line {self.name}: that peak, and the last peak_tracked_mib of its metrics.jsonl")


def estimator(ctx: Context) -> list[Step]:
    steps: list[Step] = [Build(["memopt_bench_estimator"])]
    for name, args in estimator_configs(ctx.quick):
        steps.append(Run([ctx.bench("memopt_bench_estimator"), "--name", name, *args.split()],
                         log=f"estimator {name}: {args}", error=f"error: estimator {name} failed"))
    if not ctx.quick:
        steps += [Corpus(), Build(["gritlm"]), *(EstimatorGrit(name, policies) for name, policies in ESTIMATOR_GRIT)]
    return steps


# ---- suite: planner ----
# planner.hpp's cost model (step_seconds) next to measured step times: on the reference LLaMA
# (4 × d256, seq 256, vocab 4096), 8 sequences per optimizer step, one process per
# configuration (memopt_bench_estimator --time_steps 3: a warm-up step, the memory-measured
# step, then 3 timed steps): recompute {none, every, selective} × precision {fp32, bf16} ×
# optimizer state {resident, int8} at micro-batch 8, and the micro-batch's effect (every at 2 × 4 and 4 × 2,
# none at 4 × 2); then a shape the machine figures were not fitted on (8 × d512, seq 512, 4
# sequences per step: recompute × precision at micro-batch 4, two smaller micro-batches). One
# line per configuration (predicted/measured s/step and MiB), then a "cost_model" line: the
# Spearman rank correlation of predicted vs measured s/step (all, and per shape), the
# median and the worst of their ratio, and per budget and shape the configuration the planner would
# choose (fastest predicted among those predicted to fit) against the measured fastest of those
# measured to fit, with the regret (measured time chosen / fastest). Timings need an idle
# machine: the load average goes in every line. 5 steps per process, ~5 minutes on an idle
# 2-core machine (--quick: tiny shapes, one timed step; under a minute once built).
PLANNER_REF = "--layers 4 --dim 256 --heads 8 --seq 256 --vocab 4096"
PLANNER_LARGE = "--layers 8 --dim 512 --heads 8 --seq 512 --vocab 4096"
# Budgets between the predicted peaks: every ≤ 182 MiB; selective, none at 4 × 2 ≤ 295; none ≤ 413;
# large: every ≤ 602, none at 1 × 4 761, none ≤ 1446.
PLANNER_BUDGETS = ("reference:200", "reference:340", "reference:450", "large:700", "large:1000")
# --quick, a smoke test: every configuration, tiny shapes, one timed step
PLANNER_QUICK_REF = "--layers 2 --dim 64 --heads 4 --seq 32 --vocab 256"
PLANNER_QUICK_LARGE = "--layers 2 --dim 96 --heads 4 --seq 48 --vocab 256"
PLANNER_QUICK_BUDGETS = ("reference:3.5", "reference:4.5", "reference:6", "large:5", "large:8")


# A name's optimizer-state part -> the flag value (names keep their earlier "none").
STATE_FLAG = {"none": "resident", "int8": "int8"}


def planner_configs(ref: str, large: str) -> list[tuple[str, str]]:
    """NAME, FLAGS: 8 sequences per step in each; NAME: recompute-precision-state-micro×accum."""
    configs = [(f"{c}-{p}-{o}-8x1", f"{ref} --recompute {c} --precision {p} --optimizer_state {STATE_FLAG[o]} --micro 8 --accum 1")
               for c in ("none", "every", "selective") for p in ("fp32", "bf16") for o in ("none", "int8")]
    configs += [("every-fp32-none-2x4", f"{ref} --recompute every --micro 2 --accum 4"),
                ("every-fp32-none-4x2", f"{ref} --recompute every --micro 4 --accum 2"),
                ("none-fp32-none-4x2", f"{ref} --micro 4 --accum 2")]
    configs += [(f"large-{c}-{p}-none-4x1", f"{large} --recompute {c} --precision {p} --micro 4")
                for c in ("none", "every") for p in ("fp32", "bf16")]
    return configs + [("large-every-fp32-none-2x2", f"{large} --recompute every --micro 2 --accum 2"),
                      ("large-none-bf16-none-1x4", f"{large} --precision bf16 --micro 1 --accum 4")]


def planner_cost_model(path: Path, budgets: tuple[str, ...]) -> list[dict]:
    """The "cost_model" line from the configurations' lines in `path` (none when it is empty)."""
    text = path.read_text() if path.is_file() else ""
    if not text:
        return []
    return [planner_summary([json.loads(l) for l in text.splitlines()], budgets)]


def planner(ctx: Context) -> list[Step]:
    lines = ctx.build_dir / "bench-planner.jsonl"
    ref, large, time_steps, budgets = ((PLANNER_QUICK_REF, PLANNER_QUICK_LARGE, "1", PLANNER_QUICK_BUDGETS) if ctx.quick
                                       else (PLANNER_REF, PLANNER_LARGE, "3", PLANNER_BUDGETS))
    return [Build(["memopt_bench_estimator"]), Files(truncate=[lines]),
            *(Run([ctx.bench("memopt_bench_estimator"), "--name", name, *flags.split(), "--time_steps", time_steps],
                  log=f"planner {name}: load average {LOAD} before the run", error=f"error: planner {name} failed",
                  tee=lines) for name, flags in planner_configs(ref, large)),
            Summary(lambda _: planner_cost_model(lines, budgets),
                    f"the cost_model line from {lines.name} (budgets {' '.join(budgets)})")]
