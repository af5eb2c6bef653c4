"""The fine-tuning suite: lora (full fine-tuning, LoRA and QLoRA, memopt next to PEFT and PEFT +
bitsandbytes)."""
from __future__ import annotations

from .. import lines as L
from ..core import LOAD, Context, cpu_flags
from ..steps import Build, Derive, Log, Run, Step

# ---- suite: lora ----
# Per shape, in one run: full fine-tuning, LoRA (rank 16 on the 7 Linears of every block, alpha 32)
# and QLoRA (the same adapters over NF4 base weights), each by memopt (benchmarks/trainer_bench.cpp
# --finetune) and by its peer (benchmarks/peer/trainer_peer.py --finetune: PyTorch eager, PEFT,
# PEFT + bitsandbytes' Linear4bit), all with checkpointing, in the precision the CPU computes fastest
# (bf16 autocast where it has avx512_bf16 or amx_bf16, else fp32); one process each. memopt runs its
# chunked output projection + loss (--loss_chunk 1024: no (B*T, V) logits), as torchtune's recipes
# chunk theirs; the peer keeps PyTorch's whole logits. LoRA and QLoRA run LORA_REPEATS times each,
# memopt and peer interleaved (one machine's drift falls on both). Then the ratio lines:
# lora_vs_peft and qlora_vs_peft (memopt / peer: peak_rss_mib, and tokens_per_s of the median runs)
# and qlora_vs_full (memopt's QLoRA / its full fine-tuning: peak_tracked_mib, peak_rss_mib).
# Last, a Llama-2-7B-shaped model (32 layers, d4096, 32 heads, SwiGLU 11008, vocab 32000) takes 2
# QLoRA steps of 256 tokens (micro-batch 1), built under QuantizeOnInit: each Linear weight NF4 as
# soon as it exists, never the whole model in fp32 (memopt only: the peer would build it in fp32,
# 27 GB). ~18 min on an idle 2-core AVX2 machine in fp32, 9.5 on an AMX one in bf16 (--quick: tiny
# shapes, one step, one run each).
LORA_SHAPES = {
    "l8-d512": "--layers 8 --dim 512 --heads 8 --seq 512 --micro 4 --accum 1 --vocab 4096 --warmup 1 --steps 3",
    "l12-d1024": "--layers 12 --dim 1024 --heads 16 --seq 256 --micro 2 --accum 1 --vocab 32000 --warmup 1 --steps 2",
}
LORA_QUICK = {"l2-d128": "--layers 2 --dim 128 --heads 4 --seq 64 --micro 2 --accum 1 --vocab 512 --warmup 0 --steps 1"}
LLAMA2_7B = ("--layers 32 --dim 4096 --heads 32 --ffn 11008 --vocab 32000 --seq 256 --micro 1 --accum 1"
             " --warmup 0 --steps 2")
LORA_COMMON = "--recompute every --lora_rank 16 --lora_targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
MEMOPT_ONLY = "--loss_chunk 1024"
# Per shape and precision, memopt's full and QLoRA rows only: the SwiGLU in row tiles, each
# recomputed (no (B, T, F) kept), where the MLP's backward sets QLoRA's peak (8 x d512): 4 in bf16,
# 8 in fp32 (activations twice as large). At 12 x d1024 the loss's forward sets it and tiles would
# only cost time; LoRA rows run untiled (their frozen fp32 weights are cast again per tile).
MEMOPT_TILES = {"l8-d512": {"bf16": 4, "fp32": 8}}
LORA_REPEATS = 3  # runs of each LoRA / QLoRA row; run-to-run noise here is about ±10%


def fastest_precision() -> str:
    """bf16 autocast where the CPU has bf16 matmul instructions, else fp32 (bf16 is many times slower there)."""
    flags = cpu_flags().split()
    return "bf16" if "avx512_bf16" in flags or "amx_bf16" in flags else "fp32"


def lora_run(ctx: Context, impl: str, shape: str, finetune: str, args: list[str], run: int = 0) -> Run:
    flags = [*args, "--finetune", finetune]
    precision = args[args.index("--precision") + 1]
    tiles = MEMOPT_TILES.get(shape, {}).get(precision, 0) if finetune in ("full", "qlora") else 0
    tiles = ["--mlp_tiles", str(tiles)] if tiles else []
    cmd = ([ctx.bench("memopt_bench_trainer"), *flags, *MEMOPT_ONLY.split(), *tiles] if impl == "memopt"
           else [ctx.python, ctx.script("benchmarks/peer/trainer_peer.py"), *flags])
    what = f"lora {shape} {finetune} {impl}" + (f" (run {run + 1})" if run else "")
    return Run(cmd, key=f"{shape}/{finetune}/{impl}" + (f"/{run}" if run else ""), log=f"{what}: load average {LOAD}",
               error=f"error: {what} failed", line=lambda raw, r=run: {**L.with_mfu(raw), "run": r + 1},
               made="with mfu and its run number")


def median_run(*lines: dict) -> dict:
    """The run of median tokens_per_s among repeated runs of one row (the upper middle of an even count)."""
    return sorted(lines, key=lambda t: t["tokens_per_s"])[len(lines) // 2]


def lora(ctx: Context) -> list[Step]:
    precision = fastest_precision()
    steps: list[Step] = [Build(["memopt_bench_trainer"]),
                         Log(f"lora: precision {precision} (cpu_flags {cpu_flags()}), {LORA_COMMON}")]
    for shape, dims in (LORA_QUICK if ctx.quick else LORA_SHAPES).items():
        args = [*dims.split(), *LORA_COMMON.split(), "--precision", precision]
        repeats = 1 if ctx.quick else LORA_REPEATS
        steps += [lora_run(ctx, impl, shape, "full", args) for impl in ("memopt", "pytorch")]
        for finetune in ("lora", "qlora"):
            steps += [lora_run(ctx, impl, shape, finetune, args, run)
                      for run in range(repeats) for impl in ("memopt", "pytorch")]
        for finetune in ("lora", "qlora"):
            keys = {impl: [f"{shape}/{finetune}/{impl}" + (f"/{run}" if run else "") for run in range(repeats)]
                    for impl in ("memopt", "pytorch")}
            steps.append(Derive([*keys["memopt"], *keys["pytorch"]],
                                lambda *t, f=finetune, n=repeats: {
                                    **L.lora_ratio(f"{f}_vs_peft", median_run(*t[:n]), median_run(*t[n:])), "runs": n},
                                f"{finetune}_vs_peft (median runs)"))
        steps.append(Derive([f"{shape}/qlora/memopt", f"{shape}/full/memopt"],
                            lambda a, b: L.lora_ratio("qlora_vs_full", a, b), "qlora_vs_full"))
    if not ctx.quick:
        steps += [Log("lora: a Llama-2-7B-shaped model, QLoRA, 2 steps (memopt only)"),
                  lora_run(ctx, "memopt", "llama2-7b", "qlora", [*LLAMA2_7B.split(), *LORA_COMMON.split(),
                                                                 "--precision", precision])]
    return steps
