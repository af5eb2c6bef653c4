"""The training suites: trainer, distill, distill_quality, adamw8bit, stack, allocator."""
from __future__ import annotations

from functools import partial

from .. import lines as L
from ..core import LOAD, Context, env_patterns, env_rounds
from ..steps import Build, Corpus, Derive, Files, Log, Median, Run, Step
from .lora import fastest_precision

# ---- suite: trainer ----
# Per configuration: memopt's line, the peer's, their ratio (tokens_per_s from the mean step,
# tokens_per_s_best from the fastest step: steadier on a shared machine); after the small fp32 one, the
# Trainer's overhead against a hand-written LibTorch loop (a "hand" line and a ratio).
# Step counts keep the suite near 30 minutes on an idle 2-core machine (--quick: ~3).
# BENCH_TRAINER_ROUNDS=N (default 1) runs memopt and eager N times each, alternately, per configuration
# (torch.compile once): each is printed once, the round with the median tokens/s, with every round's
# (tokens_per_s_rounds), and the eager ratio from those two lines with each round's pair ratio
# (tokens_per_s_by_round). On a shared host, whose speed drifts by ±15% between runs minutes apart,
# that is what makes a ratio near a target checkable; N=3 takes the suite ~2.3 times as long.
# BENCH_TRAINER_CONFIGS=PATTERNS (comma-separated shell patterns over SIZE-PRECISION-RECOMPUTE, e.g.
# '*-fp32-*' or 'large-*-none'; default all 8) runs only those: on an AVX2-only CPU, whose bf16 eager and
# compiled peers take ~17x fp32's time (the large bf16 ones ~10 minutes a run), the fp32 half first.
TRAINER_SHAPES = {
    "small": "--layers 4 --dim 256 --heads 8 --seq 256 --micro 8 --accum 2 --vocab 4096",
    "large": "--layers 8 --dim 512 --heads 8 --seq 512 --micro 8 --accum 2 --vocab 4096",
}
# Timed steps; memopt's step on the idle 2-core AVX512-BF16 machine in the comments (on an
# AVX2-only CPU bf16 is many times slower than fp32: --quick first there).
TRAINER_STEPS = {
    "small-fp32": 5,  # ~1 s, ~1.3 s with checkpointing
    "small-bf16": 5,  # ~0.6 s, ~0.7 s
    "large-fp32": 2,  # ~12 s, ~16 s
    "large-bf16": 2,  # ~6 s, ~8 s
}
TRAINER_PEERS = ("pytorch", "pytorch_compile")  # PyTorch 2.x eager, then torch.compile (inductor)
# memopt's levers on top of the arguments it shares with the peers: the output head fused with the loss in
# chunks of 1024 rows (LlamaConfig::loss_chunk_size; no (B·T, V) logits, the same loss). On the 8 × d512 fp32
# shape, interleaved pairs on the AMX host: 5158 and 5281 ms a step against 5330 and 5408 with logits, peak
# RSS -127 MiB; in bf16 the same speed.
MEMOPT_LEVERS = ["--loss_chunk", "1024"]


def smoke(args: str) -> str:
    """--quick's size of a trainer-shape command line: one step of 2 x 2 rows, no warm-up."""
    return args.replace("--micro 8", "--micro 2", 1) + " --warmup 0 --steps 1"


def trainer_run(ctx: Context, impl: str, config: str, args: list[str]) -> Run:
    peer = ctx.script("benchmarks/peer/trainer_peer.py")
    if impl == "pytorch":
        cmd = [ctx.python, peer, *args]
    elif impl == "pytorch_compile":  # a second warm-up step: compiling takes the first
        cmd = [ctx.python, peer, "--compile", *args, *([] if ctx.quick else ["--warmup", "2"])]
    else:
        cmd = [ctx.bench("memopt_bench_trainer"), "--impl", impl, *args, *(MEMOPT_LEVERS if impl == "memopt" else [])]
    return Run(cmd, key=f"{config}/{impl}", log=f"{impl}: load average {LOAD} before the run",
               error=f"error: {impl} {' '.join(args)} failed", line=L.with_mfu, made="with mfu")


def compared_runs(ctx: Context, config: str, args: list[str], rounds: int) -> list[Step]:
    """memopt's and eager's runs of one configuration, kept as CONFIG/memopt and CONFIG/pytorch: one each, or
    `rounds` of each alternately (kept quietly as CONFIG/IMPL#R) and the median of each."""
    if rounds == 1:
        return [trainer_run(ctx, impl, config, args) for impl in ("memopt", "pytorch")]
    steps: list[Step] = []
    for r in range(1, rounds + 1):
        for impl in ("memopt", "pytorch"):
            run = trainer_run(ctx, impl, config, args)
            run.key, run.quiet = f"{config}/{impl}#{r}", True
            steps.append(run)
    return steps + [Median([f"{config}/{impl}#{r}" for r in range(1, rounds + 1)], f"{config}/{impl}")
                    for impl in ("memopt", "pytorch")]


TRAINER_CONFIGS = [f"{size}-{precision}-{recompute}" for size in TRAINER_SHAPES for precision in ("fp32", "bf16")
                   for recompute in ("none", "every")]


def trainer(ctx: Context) -> list[Step]:
    rounds = 1 if ctx.quick else env_rounds("BENCH_TRAINER_ROUNDS", 1)
    chosen = env_patterns("BENCH_TRAINER_CONFIGS", TRAINER_CONFIGS)
    steps: list[Step] = [Build(["memopt_bench_trainer"])]
    for size, shape in TRAINER_SHAPES.items():
        for precision in ("fp32", "bf16"):
            for recompute in ("none", "every"):
                if f"{size}-{precision}-{recompute}" not in chosen:
                    continue
                args = f"{shape} --precision {precision} --recompute {recompute}"
                if ctx.quick:  # smoke test: every configuration runs, one step of 2 × 2 rows, no warm-up
                    args = smoke(args)
                else:
                    args += f" --warmup 1 --steps {TRAINER_STEPS[f'{size}-{precision}']}"
                config = f"{size}-{precision}-{recompute}"
                steps += [Log(f"trainer {size} {precision} recompute={recompute}: {args}"),
                          *compared_runs(ctx, config, args.split(), rounds)]
                for impl in TRAINER_PEERS:
                    if impl != "pytorch":  # eager ran with memopt
                        steps.append(trainer_run(ctx, impl, config, args.split()))
                    steps.append(Derive([f"{config}/memopt", f"{config}/{impl}"], L.trainer_ratio, "ratio memopt / peer"))
                if config == "small-fp32-none":
                    # The Trainer's overhead: the same model and step in a hand-written LibTorch loop,
                    # run right after the Trainer so both see the same machine.
                    hand = args.replace("--precision fp32 --recompute none", "", 1).split()
                    steps += [Log(f"trainer overhead: a hand-written LibTorch loop, {size} fp32 no recompute"),
                              trainer_run(ctx, "hand", config, hand),
                              Derive([f"{config}/memopt", f"{config}/hand"], L.overhead_ratio, "overhead ratio")]
    return steps


# ---- suite: bf16_gemm ----
# A bf16-autocast Trainer step (the trainer suite's small shape) with its CPU GEMMs widened to fp32
# (memopt/bf16_gemm.hpp; MEMOPT_BF16_GEMM=fp32) and with LibTorch's bf16 kernels (=native), next to
# PyTorch eager's bf16 autocast step and memopt's fp32 step, one process each; ratios widened / each.
# Where the CPU has bf16 units (avx512_bf16, AMX) widening loses and auto keeps native; on an AVX2-only
# CPU native and the peer take ~1.5 min a step (--quick first there). ~10 min on an idle 2-core AVX2 EPYC.
BF16_GEMM_RUNS = {  # key: (impl, precision, MEMOPT_BF16_GEMM)
    "widened": ("memopt", "bf16", "fp32"),
    "native": ("memopt", "bf16", "native"),
    "pytorch": ("pytorch", "bf16", None),
    "fp32": ("memopt", "fp32", None),
}


def bf16_gemm(ctx: Context) -> list[Step]:
    shape = TRAINER_SHAPES["small"]
    if ctx.quick:
        shape = smoke(shape)
    else:
        shape += " --warmup 1 --steps 2"
    steps: list[Step] = [Build(["memopt_bench_trainer"])]
    for key, (impl, precision, mode) in BF16_GEMM_RUNS.items():
        run = trainer_run(ctx, impl, f"bf16_gemm/{key}", f"{shape} --precision {precision} --recompute none".split())
        run.key, run.env = key, ({"MEMOPT_BF16_GEMM": mode} if mode else {})
        steps += [Log(f"bf16_gemm {key}: {impl} {precision}" + (f", MEMOPT_BF16_GEMM={mode}" if mode else "")), run]
    steps += [Derive(["widened", other], partial(L.bf16_gemm_ratio, f"widened_vs_{other}"), f"ratio widened / {other}")
              for other in ("native", "pytorch", "fp32")]
    return steps


# ---- suite: profile ----
# Where a Trainer step's time goes: memopt_bench_trainer --profile on the trainer suite's two shapes
# (micro-batch 8 x accum 2, no recompute) in fp32 and in the precision `auto` picks here (one run where
# that is fp32): after the timed steps, one more under LibTorch's profiler; the line's "profile" holds
# its 15 ops of most self time, each with its share of that step's wall time, next to the line's mfu,
# and "profile_gemms" its 12 GEMM shapes of most self time with the GFLOP/s each ran at. Each runs with
# --attention auto (the default: SDPA, flash or blockwise, measured) and again with the math path (the
# (T, T) scores) for the before/after, next to PyTorch eager on the same machine, profiled the same way
# (torch.profiler); ratio lines auto / math and auto / eager. ~6 min on an idle 2-core machine (--quick: seconds).
def profile(ctx: Context) -> list[Step]:
    steps: list[Step] = [Build(["memopt_bench_trainer"])]
    for size, shape in TRAINER_SHAPES.items():
        for precision in dict.fromkeys(("fp32", fastest_precision())):
            args = f"{shape} --precision {precision} --recompute none"
            args = smoke(args) if ctx.quick else args + " --warmup 1 --steps 2"
            key = f"profile/{size}-{precision}"
            steps += [Log(f"profile {size} {precision}: {args} --profile (attention auto, then math; "
                          "fused kernels, then composites)"),
                      trainer_run(ctx, "memopt", key, [*args.split(), "--profile"]),
                      trainer_run(ctx, "memopt", f"{key}-math", [*args.split(), "--profile", "--attention", "math"]),
                      trainer_run(ctx, "memopt", f"{key}-composite", [*args.split(), "--profile", "--fused_kernels",
                                                                      "false"]),
                      trainer_run(ctx, "pytorch", key, [*args.split(), "--profile"]),
                      Derive([f"{key}/memopt", f"{key}-math/memopt"], L.attention_kind_ratio, "ratio attention auto / math"),
                      Derive([f"{key}/memopt", f"{key}-composite/memopt"], L.fused_kernels_ratio,
                             "ratio fused kernels / composites"),
                      Derive([f"{key}/memopt", f"{key}/pytorch"], L.trainer_ratio, "ratio memopt / eager")]
    return steps


# ---- suite: distill ----
# LLaMA -> LLaDA distillation (examples/01_llama_to_llada) under each strategy: the same
# teacher and student, the same effective batch (16 x 128 tokens; comprehensive takes it as
# 4 micro-batches of 4), one process each so peak RSS is its own. The teacher is a random
# init saved once (memory and speed do not depend on its weights). One line per strategy
# (impl: none | simple | comprehensive | comprehensive_fp32 | comprehensive_levers) from the
# run's metrics.jsonl summary, then the ratios of the others to none.
DISTILL_STRATEGIES = {
    "none": "--strategy none --batch_size 16 --gradient_accumulation_steps 1",
    "simple": "--strategy simple --batch_size 16 --gradient_accumulation_steps 1",
    "comprehensive": "--strategy comprehensive --batch_size 4 --gradient_accumulation_steps 4",
    # comprehensive_fp32: the same with fp32 compute, for CPUs without bf16 matmul hardware.
    "comprehensive_fp32": "--strategy comprehensive --batch_size 4 --gradient_accumulation_steps 4"
                          " --precision fp32",
    # comprehensive_levers: + memopt's opt-in levers the original lacks (sparse top-64 KD, a
    # bf16 teacher); distill_quality measures what they cost in held-out masked CE.
    "comprehensive_levers": "--strategy comprehensive --batch_size 4 --gradient_accumulation_steps 4"
                            " --kd_top_k 64 --teacher_precision bf16",
}


def distill(ctx: Context) -> list[Step]:
    bin_ = ctx.example("01_llama_to_llada", "llama_to_llada")
    work = ctx.build_dir / "bench-distill"
    common = [bin_, "--data_path", str(ctx.corpus), "--teacher_model", str(work / "teacher"), "--eval_batches", "0",
              "--samples", "0", "--log_interval", "1000"]
    steps: list[Step] = [
        Corpus(), Build(["llama_to_llada"]), Files(remove=[work], mkdir=[work]),
        Run([*common, "--train_teacher", "--teacher_steps", "0", "--max_steps", "0", "--output_dir", str(work / "init")],
            output="log", error="error: could not create the teacher", fatal=True)]
    max_steps = "1" if ctx.quick else "6"
    for impl, args in DISTILL_STRATEGIES.items():
        steps.append(Run([*common, *args.split(), "--max_steps", max_steps, "--warmup_steps", "1",
                          "--output_dir", str(work / impl)],
                         key=impl, output="log", log=f"distill {impl}: load average {LOAD} before the run",
                         error=f"error: distill {impl} failed", made=f"the {impl} line from its summary (metrics.jsonl)",
                         line=lambda _, impl=impl: L.distill_line(impl, work / impl / "metrics.jsonl")))
    steps += [Derive([impl, "none"], L.distill_ratio, f"ratio_{impl}_to_none") for impl in list(DISTILL_STRATEGIES)[1:]]
    return steps


# ---- suite: distill_quality ----
# The main job's student (comprehensive, alpha 0.5) with sparse KD from the teacher's top 64
# (the opt-in --kd_top_k 64), dense KD from a bf16 copy of the teacher (the opt-in
# --teacher_precision bf16), dense KD (the preset's) and no KD (alpha 0: diffusion loss only),
# all from one teacher trained here with the default flags: held-out masked-token
# cross-entropy at mask ratios 0.15 / 0.5 / 0.85, and the teacher's own held-out perplexity.
# One line per student (impl: kd_top64 | kd_dense_bf16_teacher | kd_dense | no_kd). ~19 min.
DISTILL_QUALITY_STUDENTS = {
    "kd_top64": "--train_teacher --alpha 0.5 --kd_top_k 64",  # the first run trains the teacher, the others reuse it
    "kd_dense_bf16_teacher": "--alpha 0.5 --kd_top_k 0 --teacher_precision bf16",
    "kd_dense": "--alpha 0.5 --kd_top_k 0",
    "no_kd": "--alpha 0",
}


def distill_quality(ctx: Context) -> list[Step]:
    bin_ = ctx.example("01_llama_to_llada", "llama_to_llada")
    work = ctx.build_dir / "bench-distill-quality"
    quick = "--teacher_steps 2 --max_steps 2 --eval_batches 1 --samples 0".split() if ctx.quick else []
    steps: list[Step] = [Corpus(), Build(["llama_to_llada"]), Files(remove=[work])]
    for impl, flags in DISTILL_QUALITY_STUDENTS.items():
        steps.append(Run([bin_, "--data_path", str(ctx.corpus), "--teacher_model", str(work / "teacher"),
                          *flags.split(), "--output_dir", str(work / impl), "--samples", "0", *quick],
                         output="log", log=f"distill_quality {impl} ({flags}): load average {LOAD}",
                         error=f"error: distill_quality {impl} failed", made=f"the {impl} line from its summary",
                         line=lambda _, impl=impl: L.distill_quality_line(impl, work / impl / "metrics.jsonl")))
    return steps


# ---- suite: adamw8bit ----
# fp32 AdamW (state::Resident) against 8-bit AdamW (state::Int8) training the bundled LM
# (LLaMA, 4 layers, d256, 8 heads, vocab 4096, 8 rows of 128 tokens) on the King James corpus: the
# same init and batches, 150 steps, one process each. One line per impl (loss_last: mean of the
# last 10 steps; val_loss: held-out), then the ratios of 8-bit to fp32 and whether loss_last
# is within 1% (the target). ~2.5 min per impl on an idle 2-core machine (--quick: 3 steps).
def adamw8bit(ctx: Context) -> list[Step]:
    steps = "3" if ctx.quick else "150"
    return [Corpus(), Build(["memopt_bench_adamw8bit"]),
            *(Run([ctx.bench("memopt_bench_adamw8bit"), "--impl", impl, "--steps", steps, "--data", str(ctx.corpus)],
                  key=impl, log=f"adamw8bit {impl}: load average {LOAD} before the run",
                  error=f"error: adamw8bit {impl} failed") for impl in ("adamw", "adamw8bit")),
            Derive(["adamw8bit", "adamw"], L.adamw8bit_ratio, "ratio_adamw8bit_to_adamw")]


# ---- suite: stack ----
# The memory levers stacked one per row on one LLaMA (8 layers x d512, seq 1024, vocab 4096;
# the ce_v32k rows: vocab 32000) trained on the King James corpus, the same init, batches and
# effective batch (2 x 1024 tokens) in every row, one process per row
# (benchmarks/stack_bench.cpp lists the rows). One line per row with name, peak_tracked_mib,
# peak_rss_mib, tokens_per_s, loss_last, then the ratios of each row to fp32. ~15 min.
STACK_ROWS = ("fp32", "bf16", "selective", "every_block", "mem_attention", "chunked_ce", "int8_state",
              "step_in_backward", "disk", "full", "full_fp32", "ce_v32k_full", "ce_v32k_chunked")


def stack(ctx: Context) -> list[Step]:
    size = "--layers 2 --dim 128 --seq 128 --steps 1 --warmup 0" if ctx.quick else "--steps 3 --warmup 1"
    offload = ctx.build_dir / "bench-stack"
    return [Corpus(), Build(["memopt_bench_stack"]), Files(mkdir=[offload]),
            *(Run([ctx.bench("memopt_bench_stack"), "--row", row, "--data", str(ctx.corpus / "train.bin"),
                   "--offload_dir", str(offload), *size.split()],
                  key=row, log=f"stack {row}: load average {LOAD} before the run", error=f"error: stack {row} failed")
              for row in STACK_ROWS),
            *(Derive([row, "fp32"], L.stack_ratio, f"ratio_{row}_to_fp32") for row in STACK_ROWS[1:])]


# ---- suite: allocator ----
# glibc malloc settings (MEMOPT_ALLOC_CONF, memory/allocator.hpp: glibc's defaults, memopt's
# default preset:training, and single keys over glibc's defaults) on the Trainer benchmark's
# LLaMA (8 layers x d512, seq 512, micro-batch 4, fp32): peak RSS and tokens/s per setting,
# one process each; the tracked tensor peak must not move (same tensors). ~3 min.
ALLOCATOR_CONFS = ("preset:glibc", "", "arena_max:1", "trim_threshold:0", "mmap_threshold:1MB",
                   "arena_max:2,trim_threshold:256MB,mmap_threshold:32MB")


def allocator(ctx: Context) -> list[Step]:
    args = ("--layers 2 --dim 128 --heads 4 --seq 64 --micro 2 --accum 1 --warmup 0 --steps 1" if ctx.quick else
            "--layers 8 --dim 512 --heads 8 --seq 512 --micro 4 --accum 1 --warmup 1 --steps 3")
    return [Build(["memopt_bench_trainer"]),
            *(Run([ctx.bench("memopt_bench_trainer"), *args.split()], env={"MEMOPT_ALLOC_CONF": conf},
                  log=f"allocator '{conf}': load average {LOAD} before the run",
                  error=f"error: allocator '{conf}' failed", line=partial(L.allocator_line, conf),
                  made=f"the allocator line, impl '{conf or 'memopt default (preset:training)'}'")
              for conf in ALLOCATOR_CONFS)]
