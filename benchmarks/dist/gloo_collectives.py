#!/usr/bin/env python3
"""benchmarks/dist/gloo_collectives.py — what LibTorch 2.x's Gloo offers against what memopt
does, on the gradient sum of data parallel training: N ranks on loopback (torch.multiprocessing),
one flat fp32 buffer of --numel elements (default 5.31 M: the 4-layer d256 LLaMA of the dist
suite, 21 MB), median wall time of --steps calls after --warmup:

  all_reduce        fp32 all-reduce (memopt's replicated path)
  all_to_all_sum    all_to_all_single of every rank's shares + a local sum over ranks
                    (memopt's ZeRO-1 gradient path: shares of uneven size, owners by tensor)
  reduce_scatter    reduce_scatter_tensor of equal shares (Gloo has it since 2.x; equal
                    chunks only, so memopt would have to own by slices, not whole tensors)
  all_reduce_bf16   the same all-reduce on a bf16 copy (half the bytes; rounding the sum)

One JSON line per collective, with torch_version, cpu_flags, load_avg_1m and the ratio to
all_reduce. Run: .venv/bin/python3 benchmarks/dist/gloo_collectives.py --ranks 2
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peer"))
from trainer_peer import cpu_flags  # noqa: E402  (memopt::cpu_flags()'s list)


def timed(fn, warmup, steps):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), min(times)


def worker(rank, args, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    n, world = args.numel - args.numel % args.ranks, args.ranks
    grads = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    share = n // world
    results = {}

    def all_reduce():
        buf = grads.clone()
        dist.all_reduce(buf)
        return buf

    def all_to_all_sum():
        out = torch.empty(n)
        dist.all_to_all_single(out, grads)
        return out.view(world, share).sum(0)

    def reduce_scatter():
        out = torch.empty(share)
        dist.reduce_scatter_tensor(out, grads)
        return out

    def all_reduce_bf16():
        buf = grads.to(torch.bfloat16)
        dist.all_reduce(buf)
        return buf.float()

    # The same sums: each rank's share of the all-reduce equals its reduce-scatter output.
    full = all_reduce()
    mine = full.narrow(0, rank * share, share)
    for name, fn in (("all_to_all_sum", all_to_all_sum), ("reduce_scatter", reduce_scatter)):
        err = (fn() - mine).abs().max().item()
        assert err <= 1e-4 * mine.abs().max().item(), f"{name}: max |diff| {err}"
    bf16_err = ((all_reduce_bf16() - full).abs().max() / full.abs().max()).item()

    for name, fn in (("all_reduce", all_reduce), ("all_to_all_sum", all_to_all_sum),
                     ("reduce_scatter", reduce_scatter), ("all_reduce_bf16", all_reduce_bf16)):
        results[name] = timed(fn, args.warmup, args.steps)
    if rank == 0:
        queue.put((results, bf16_err, n))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--numel", type=int, default=5_310_720)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, port, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results, bf16_err, n = queue.get(timeout=600)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"gloo_collectives: a rank exited with {p.exitcode}")
    base = results["all_reduce"][0]
    for name, (ms, ms_min) in results.items():
        line = {"suite": "collectives", "name": f"gloo-{args.ranks}ranks-{n * 4 / 1e6:.0f}MB", "impl": name,
                "ranks": args.ranks, "numel": n, "ms": round(ms, 3), "ms_min": round(ms_min, 3),
                "ratio_to_all_reduce": round(ms / base, 3), "torch_version": torch.__version__,
                "cpu_flags": cpu_flags(), "load_avg_1m": os.getloadavg()[0]}
        if name == "all_reduce_bf16":
            line["max_rel_error_vs_fp32"] = bf16_err
        print(json.dumps(line, separators=(",", ":")), flush=True)


if __name__ == "__main__":
    main()
