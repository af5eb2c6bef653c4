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
# (bf16 autocast where it has avx512_bf16 or amx_bf16, else fp32); one process each. Then the ratio
# lines: lora_vs_peft and qlora_vs_peft (memopt / peer: peak_rss_mib, tokens_per_s) and
# qlora_vs_full (memopt's QLoRA / its full fine-tuning: peak_tracked_mib, peak_rss_mib).
# Last, a Llama-2-7B-shaped model (32 layers, d4096, 32 heads, SwiGLU 11008, vocab 32000) takes 2
# QLoRA steps of 256 tokens (micro-batch 1), built under QuantizeOnInit: each Linear weight NF4 as
# soon as it exists, never the whole model in fp32 (memopt only: the peer would build it in fp32,
# 27 GB). ~25 min on an idle 2-core machine (--quick: tiny shapes, one step).
LORA_SHAPES = {
    "l8-d512": "--layers 8 --dim 512 --heads 8 --seq 512 --micro 4 --accum 1 --vocab 4096 --warmup 1 --steps 3",
    "l12-d1024": "--layers 12 --dim 1024 --heads 16 --seq 256 --micro 2 --accum 1 --vocab 32000 --warmup 1 --steps 2",
}
LORA_QUICK = {"l2-d128": "--layers 2 --dim 128 --heads 4 --seq 64 --micro 2 --accum 1 --vocab 512 --warmup 0 --steps 1"}
LLAMA2_7B = ("--layers 32 --dim 4096 --heads 32 --ffn 11008 --vocab 32000 --seq 256 --micro 1 --accum 1"
             " --warmup 0 --steps 2")
LORA_COMMON = "--recompute every --lora_rank 16 --lora_targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def fastest_precision() -> str:
    """bf16 autocast where the CPU has bf16 matmul instructions, else fp32 (bf16 is many times slower there)."""
    flags = cpu_flags().split()
    return "bf16" if "avx512_bf16" in flags or "amx_bf16" in flags else "fp32"


def lora_run(ctx: Context, impl: str, shape: str, finetune: str, args: list[str]) -> Run:
    flags = [*args, "--finetune", finetune]
    cmd = ([ctx.bench("memopt_bench_trainer"), *flags] if impl == "memopt"
           else [ctx.python, ctx.script("benchmarks/peer/trainer_peer.py"), *flags])
    return Run(cmd, key=f"{shape}/{finetune}/{impl}", log=f"lora {shape} {finetune} {impl}: load average {LOAD}",
               error=f"error: lora {shape} {finetune} {impl} failed", line=L.with_mfu, made="with mfu")


def lora(ctx: Context) -> list[Step]:
    precision = fastest_precision()
    steps: list[Step] = [Build(["memopt_bench_trainer"]),
                         Log(f"lora: precision {precision} (cpu_flags {cpu_flags()}), {LORA_COMMON}")]
    for shape, dims in (LORA_QUICK if ctx.quick else LORA_SHAPES).items():
        args = [*dims.split(), *LORA_COMMON.split(), "--precision", precision]
        for finetune in ("full", "lora", "qlora"):
            steps += [lora_run(ctx, impl, shape, finetune, args) for impl in ("memopt", "pytorch")]
        for finetune in ("lora", "qlora"):
            steps.append(Derive([f"{shape}/{finetune}/memopt", f"{shape}/{finetune}/pytorch"],
                                lambda a, b, f=finetune: L.lora_ratio(f"{f}_vs_peft", a, b), f"{finetune}_vs_peft"))
        steps.append(Derive([f"{shape}/qlora/memopt", f"{shape}/full/memopt"],
                            lambda a, b: L.lora_ratio("qlora_vs_full", a, b), "qlora_vs_full"))
    if not ctx.quick:
        steps += [Log("lora: a Llama-2-7B-shaped model, QLoRA, 2 steps (memopt only)"),
                  lora_run(ctx, "memopt", "llama2-7b", "qlora", [*LLAMA2_7B.split(), *LORA_COMMON.split(),
                                                                 "--precision", precision])]
    return steps
