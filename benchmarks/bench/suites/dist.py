"""The distributed suites: dist (data-parallel training, memopt against PyTorch DDP) and collectives (Gloo)."""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..core import Context, env_rounds, last_line, load_average, log
from ..steps import Build, Files, Run, Step, Summary
from ..summaries import dist_summary

# ---- suite: dist ----
# Data-parallel training (dist/data_parallel.hpp through the Trainer; memopt_bench_dist, one
# process per rank started as torchrun would on loopback: RANK, WORLD_SIZE, MASTER_ADDR, a random
# MASTER_PORT, OMP_NUM_THREADS=1) on the reference LLaMA (4 x d256, 8 heads, seq 256, vocab 4096;
# the King James shard when data/kjv/train.bin exists, else random tokens; memopt's model with
# SDPA, as the peers', and its fused RMSNorm/RoPE/SwiGLU kernels), bf16 autocast +
# recompute::EveryBlock, 1 intra-op thread per rank, the same global batch everywhere: 1 rank
# trains micro-batches of 8 rows x accum 2, 2 ranks 4 rows each of every 8-row micro-batch
# (RankSlice). Configurations: 1 rank; 2 ranks; 2 ranks with ZeRO-1 (broadcast, all-gather), with ZeRO-3
# (and once each: its parameter shards offloaded to a file, blocks kept whole within a step, matrices
# gathered in bf16),
# in BENCH_DIST_ROUNDS rounds (default 3) so that drift in the machine's speed hits all alike;
# the peer, PyTorch eager (benchmarks/peer/trainer_peer.py) on 1 rank and on 2 ranks with
# DistributedDataParallel (Gloo, 25 MB buckets overlapping backward, no_sync; LCG tokens) and with
# FSDP2 (fully_shard per block + root) and DeepSpeed ZeRO-3 (on the CPU), the peers of ZeRO-3; then,
# for context, 1 rank x 2 threads, fp32 at 1 and 2 ranks (a tight loss-curve check), and DDP and
# ZeRO-3 on 3 ranks (6-row micro-batches; memory only: 3 ranks on 2 cores), 1 and 2 ranks with the
# math attention and the ATen composites (math-one, math-two: how far the data-parallel overhead
# alone keeps 2 ranks from 2x, where the step is slower); last the 8 x 512
# shape (8 layers, d512, seq 512) at 2 ranks: DDP, ZeRO-1, ZeRO-3 (also with its shards on disk, and
# with bf16 gathers), FSDP2 and DeepSpeed, 6 timed steps.
# Rank 0 prints each run's line ("run": configuration#round; rank logs under
# build-release/bench-dist/). Ratio lines: dist_speedup (tokens/s over 1 rank x 1 thread's, from
# the median step over all rounds' timed steps; also from the means, the fastest steps and each
# round; target >= 1.8 for 2 ranks; impl ratio_pytorch: the peer's own), dist_vs_peer (memopt's
# 2-rank tokens/s over DDP's, and 1 rank's over 1 rank's), loss_curve (the largest
# relative difference of the per-step losses from 1 rank's), optimizer_state_per_rank
# (sharded / unsharded tracker bytes, the largest rank's, with tokens/s; both shapes),
# zero3_vs_ddp (model state per rank: tracked bytes at the optimizer phase's peak, and tokens/s;
# targets <= 0.55 at 2 ranks, <= 0.37 at 3, tokens/s >= 0.8 for ZeRO-3 without offload),
# zero3_vs_fsdp2 (peak RSS <= 1.0, tokens/s >= 1.1) and zero3_vs_deepspeed
# (no target), each per shape. Timings need an idle machine: before
# each configuration the suite waits (up to BENCH_IDLE_WAIT seconds, default 600; not with
# --quick) until other processes keep fewer than 0.15 CPUs busy, and each line says how many CPUs
# other processes kept busy while it was timed (other_cpus_busy; load_avg_1m counts the ranks
# themselves); a configuration disturbed by >= 0.15 CPUs of other work runs once more. ~20 min
# on an idle 2-core machine (--quick: ~30 s once built; DeepSpeed builds its CPU ops once, ~1 min).
DIST = {"model": "--layers 4 --dim 256 --heads 8 --seq 256 --vocab 4096 --micro 8 --accum 2",
        "bf16": "--precision bf16 --recompute every --warmup 2 --steps 30",  # ~1.3 s a step on 1 rank
        "fp32": "--precision fp32 --recompute every --warmup 2 --steps 10",  # ~2 s
        "large": "--layers 8 --dim 512 --heads 8 --seq 512 --vocab 4096 --micro 8 --accum 2",
        "large_steps": {"--warmup": "1", "--steps": "6"}}
# --quick, a smoke test: every configuration, a tiny shape, 2 steps
DIST_QUICK = {"model": "--layers 2 --dim 64 --heads 4 --seq 32 --vocab 4096 --micro 4 --accum 2",
              "bf16": "--precision bf16 --recompute every --warmup 1 --steps 1",
              "fp32": "--precision fp32 --recompute every --warmup 1 --steps 1",
              "large": "--layers 2 --dim 64 --heads 4 --seq 64 --vocab 4096 --micro 4 --accum 2",
              "large_steps": {"--warmup": "1", "--steps": "1"}}
MATH = ["--attention", "math", "--fused_kernels", "false"]  # the model without memopt's kernels
BUSY = 0.15  # CPUs kept busy by other processes that make a timing disturbed
ATTEMPTS = 3  # another port when one was taken; once more when other work disturbed the timing


def nproc() -> int:
    """nproc(1): the CPUs this process may use, or OMP_NUM_THREADS, capped by OMP_THREAD_LIMIT."""
    def positive(name: str) -> int:
        value = os.environ.get(name, "").split(",")[0].strip()
        return int(value) if value.isdigit() and int(value) > 0 else 0
    n = positive("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))
    return min(n, positive("OMP_THREAD_LIMIT") or n)


def busy_cpus(seconds: float) -> float:
    """How many CPUs were busy over the next `seconds` (/proc/stat: all but idle and iowait), e.g. 0.03."""
    def sample() -> list[int]:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    a = sample()
    time.sleep(seconds)
    d = [y - x for x, y in zip(a, sample())]
    busy, total = sum(d) - d[3] - d[4], sum(d)
    return round(nproc() * busy / total if total > 0 else 0, 2)


def wait_for_idle() -> None:
    """Waits (up to BENCH_IDLE_WAIT seconds, default 600) until other work leaves the CPUs."""
    waited, limit = 0, int(os.environ.get("BENCH_IDLE_WAIT") or 600)
    while (busy := busy_cpus(3)) >= BUSY:
        if waited >= limit:
            log(f"dist: warning: {busy:.2f} CPUs still busy after {waited} s; timing anyway (other_cpus_busy in "
                "the line says how much)")
            return
        if waited == 0:
            log(f"dist: {busy:.2f} CPUs busy with other work; waiting up to {limit} s for them to go idle")
        time.sleep(7)
        waited += 10


@dataclass
class DistLaunch(Step):
    """One configuration: RANKS processes started as torchrun would; rank 0's line (with "run": KEY) kept as
    lines[KEY]. Up to 3 attempts; a timing disturbed by other work runs once more (not with --quick), and
    if that run fails the disturbed line is kept (it says so)."""
    key: str
    ranks: int
    threads: int
    args: list[str]
    model: list[str] = field(default_factory=list)
    data: list[str] = field(default_factory=list)

    def program(self, ctx: Context) -> list[str]:
        if self.key.startswith("peer-"):  # PyTorch's DistributedDataParallel (LCG tokens)
            return [ctx.python, ctx.script("benchmarks/peer/trainer_peer.py")]
        return [ctx.bench("memopt_bench_dist"), *self.data]

    def rank(self, ctx: Context, rank: int, port: str) -> tuple[dict[str, str], list[str]]:
        env = {"OMP_NUM_THREADS": str(self.threads)}  # one rank: no WORLD_SIZE, a world of one
        if self.ranks > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(self.ranks), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=port)
        return env, ["timeout", "--foreground", "900", *self.program(ctx), "--threads", str(self.threads),
                     *self.model, *self.args]

    def logs(self, ctx: Context, rank: int) -> tuple[Path, Path]:
        base = ctx.build_dir / "bench-dist" / f"{self.key}.rank{rank}"
        return base.with_name(base.name + ".out"), base.with_name(base.name + ".err")

    def launch(self, ctx: Context) -> tuple[bool, str]:
        """One attempt: (whether every rank succeeded and rank 0 printed a JSON line, that line with "run")."""
        port = str(random.randrange(20000, 50000))
        log(f"dist {self.key}: {self.ranks} rank(s) x {self.threads} thread(s); load average {load_average()}")
        procs, ok = [], True
        for rank in range(self.ranks):
            env, cmd = self.rank(ctx, rank, port)
            out, err = self.logs(ctx, rank)
            with out.open("w") as o, err.open("w") as e:
                try:
                    procs.append(subprocess.Popen(cmd, env={**os.environ, **env}, stdout=o, stderr=e))
                except OSError as exc:
                    e.write(f"{cmd[0]}: {exc.strerror}\n")
                    ok = False
        ok = all([p.wait() == 0 for p in procs]) and ok
        raw = last_line(self.logs(ctx, 0)[0].read_text(errors="replace"))
        return ok and raw.startswith("{"), with_run(self.key, raw)

    def run(self, ctx: Context, lines: dict[str, str]) -> bool:
        kept = ""
        for attempt in range(1, ATTEMPTS + 1):
            if not ctx.quick:
                wait_for_idle()
            ok, line = self.launch(ctx)
            if ok:
                err = self.logs(ctx, 0)[1].read_text(errors="replace").splitlines()
                for step_line in [l for l in err if re.match(r"  .* step [0-9]+", l)][-2:]:
                    print(step_line, file=sys.stderr, flush=True)
                found = re.search(r'.*"other_cpus_busy":([0-9.e+-]*)', line)
                disturbed = found.group(1) if found else ""
                if not ctx.quick and not kept and number(disturbed) >= BUSY:
                    log(f"dist {self.key}: other processes kept {disturbed} CPUs busy while it was timed; running it again")
                    kept = line
                    continue
                break
            for rank in range(self.ranks):
                log(f"dist {self.key}: rank {rank} failed (attempt {attempt}); the end of its stderr:")
                for err_line in self.logs(ctx, rank)[1].read_text(errors="replace").splitlines()[-5:]:
                    print(err_line, file=sys.stderr, flush=True)
        else:
            if not kept:  # disturbed, and the second run failed: keep the first (its line says so)
                ctx.fail(f"error: dist {self.key} failed")
                return True
            line = kept
        ctx.emit(line)
        lines[self.key] = line
        return True

    def show(self, ctx: Context) -> None:
        print(f"# dist {self.key}: {self.ranks} rank(s) x {self.threads} thread(s)" +
              ("" if ctx.quick else f"; first waits for fewer than {BUSY} busy CPUs, once more when disturbed"))
        for rank in range(self.ranks):
            env, cmd = self.rank(ctx, rank, "PORT")
            out, err = self.logs(ctx, rank)
            print(ctx.shown(cmd, env, f" > {ctx.rel(str(out))} 2> {ctx.rel(str(err))} &"))


def with_run(key: str, raw: str) -> str:
    """Rank 0's line with "run": KEY after its "suite" (which configuration, which round), as text."""
    return '{"suite":"dist","run":"%s",%s' % (key, raw.replace('"suite":"dist",', "", 1).removeprefix("{"))


def number(text: str) -> float:
    """awk's reading of a number: 0 when there is none."""
    try:
        return float(text)
    except ValueError:
        return 0.0


def dist(ctx: Context) -> list[Step]:
    plan = DIST_QUICK if ctx.quick else DIST
    train = ctx.corpus / "train.bin"
    common = {"model": plan["model"].split(), "data": ["--data", str(train)] if train.is_file() else []}
    bf16, fp32 = plan["bf16"].split(), plan["fp32"].split()
    rounds = 1 if ctx.quick else env_rounds("BENCH_DIST_ROUNDS", 3)
    steps: list[Step] = [Build(["memopt_bench_dist"]), Files(mkdir=[ctx.build_dir / "bench-dist"])]
    for r in range(1, rounds + 1):  # rounds interleave the compared runs: drift hits all
        steps += [DistLaunch(f"one#{r}", 1, 1, bf16, **common), DistLaunch(f"two#{r}", 2, 1, bf16, **common),
                  DistLaunch(f"two-zero1-broadcast#{r}", 2, 1, [*bf16, "--sharded", "--param_gather", "broadcast"],
                             **common),
                  DistLaunch(f"two-zero1-allgather#{r}", 2, 1, [*bf16, "--sharded", "--param_gather", "allgather"],
                             **common),
                  DistLaunch(f"two-zero3#{r}", 2, 1, [*bf16, "--zero", "3"], **common)]
    steps += [DistLaunch("two-zero3-disk#1", 2, 1,  # the shards offloaded to a file
                         [*bf16, "--zero", "3", "--offload_dir", str(ctx.build_dir / "bench-dist" / "offload")], **common),
              DistLaunch("two-zero3-keep#1", 2, 1, [*bf16, "--zero", "3", "--keep_gathered"], **common),
              DistLaunch("two-zero3-half#1", 2, 1, [*bf16, "--zero", "3", "--gather_half"], **common)]
    steps += [DistLaunch("peer-one#1", 1, 1, bf16, **common),  # the peer: PyTorch eager, DDP on 2 ranks
              DistLaunch("peer-two#1", 2, 1, bf16, **common),
              DistLaunch("peer-two-fsdp2#1", 2, 1, [*bf16, "--fsdp2"], **common),  # the peers of ZeRO-3
              DistLaunch("peer-two-deepspeed3#1", 2, 1, [*bf16, "--deepspeed"], **common),
              DistLaunch("one-2threads#1", 1, 2, bf16, **common),
              # the same at 1 and 2 ranks with the math attention and the ATen composites: a slower step,
              # against which the data-parallel overhead weighs less (the scaling the kernels cost)
              DistLaunch("math-one#1", 1, 1, [*bf16, *MATH], **common),
              DistLaunch("math-two#1", 2, 1, [*bf16, *MATH], **common),
              DistLaunch("fp32-one#1", 1, 1, fp32, **common), DistLaunch("fp32-two#1", 2, 1, fp32, **common)]
    # 3 ranks (more than the cores: memory only, their tokens/s mean nothing): 6-row micro-batches
    three = {**common, "model": [("6" if i > 0 and common["model"][i - 1] == "--micro" else a)
                                 for i, a in enumerate(common["model"])]}
    steps += [DistLaunch("three#1", 3, 1, bf16, **three), DistLaunch("three-zero3#1", 3, 1, [*bf16, "--zero", "3"], **three)]
    # the 8 x 512 shape at 2 ranks: DDP, ZeRO-3 and its peers, fewer steps (~5 s a step)
    large = {**common, "model": plan["large"].split()}
    short = [a if i == 0 or bf16[i - 1] not in ("--steps", "--warmup") else plan["large_steps"][bf16[i - 1]]
             for i, a in enumerate(bf16)]
    steps += [DistLaunch("two-l8#1", 2, 1, short, **large),
              DistLaunch("two-zero1-l8#1", 2, 1, [*short, "--sharded", "--param_gather", "broadcast"], **large),
              DistLaunch("two-zero3-l8#1", 2, 1, [*short, "--zero", "3"], **large),
              DistLaunch("two-zero3-disk-l8#1", 2, 1,
                         [*short, "--zero", "3", "--offload_dir", str(ctx.build_dir / "bench-dist" / "offload")], **large),
              DistLaunch("two-zero3-half-l8#1", 2, 1, [*short, "--zero", "3", "--gather_half"], **large),
              DistLaunch("peer-two-fsdp2-l8#1", 2, 1, [*short, "--fsdp2"], **large),
              DistLaunch("peer-two-deepspeed3-l8#1", 2, 1, [*short, "--deepspeed"], **large)]
    return steps + [Summary(dist_summary, "dist_speedup, loss_curve, dist_vs_peer, optimizer_state_per_rank, "
                                          "zero3_vs_ddp, zero3_vs_fsdp2, zero3_vs_deepspeed")]


# ---- suite: collectives ----
# What LibTorch 2.x's Gloo offers against what memopt's gradient sum uses
# (benchmarks/dist/gloo_collectives.py, 2 ranks on loopback, one intra-op thread each, a 21 MB
# fp32 buffer: the dist suite's LLaMA): all-reduce (replicated), all-to-all + local sum
# (ZeRO-1: shares of uneven size), reduce_scatter_tensor (equal shares only), and an all-reduce
# in bf16 (half the bytes, with its rounding error against fp32). ~1 min.
def collectives(ctx: Context) -> list[Step]:
    steps = "--warmup 0 --steps 2 --numel 65536" if ctx.quick else "--warmup 3 --steps 20"
    return [Run([ctx.python, ctx.script("benchmarks/dist/gloo_collectives.py"), "--ranks", "2", *steps.split()],
                output="stream", error="error: gloo_collectives.py failed")]
