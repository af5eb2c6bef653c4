#!/usr/bin/env python3
"""benchmarks/peer/load_peer.py — the transformers side of scripts/bench load (benchmarks/io/load_bench.cpp):
writes the checkpoint both load, and measures transformers' own load of it the way memopt_bench_load
measures memopt's.

  load_peer.py generate OUT [--vocab N --hidden N --layers N --heads N --intermediate N --max-shard-size S]
      a random LlamaForCausalLM (seeded, untied head) built in bf16 and written by save_pretrained in
      shards of at most S ("100MB"); written to OUT.tmp, then renamed to OUT
  load_peer.py load DIR [--dtype bf16|fp16|fp32]
      LlamaForCausalLM.from_pretrained(DIR, dtype=...) in this process, one JSON line on stdout with
      memopt_bench_load's keys: wall time of the call (load_s) and of the call plus one read of every
      weight on one thread (ready_s), the growth of the peak RSS over the RSS just before the call at both points
      (the peak reset first, /proc/self/clear_refs), the checkpoint's bytes (every .safetensors file)

Imports (torch, transformers, the Llama model code) happen before the measurement, as LibTorch is
loaded before memopt's. transformers 5 returns parameters that are still views of the mapped files
(copy-on-write): its call reads almost nothing, and the weights become resident when first read,
hence ready_s and ready_peak_rss_growth_bytes, the point where both libraries hold the whole model.
"""
import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

DTYPES = ("bf16", "fp16", "fp32")
STAMP = "load_peer_generate.txt"  # in a generated folder: the options that made it, as given


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def checkpoint_bytes(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.iterdir() if p.suffix == ".safetensors"]
    return sum(p.stat().st_size for p in files), len(files)


def torch_dtype(name: str):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def generate(args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         intermediate_size=args.intermediate, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp, max_shard_size=args.max_shard_size)
    (tmp / STAMP).write_text(" ".join(args.options) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"load_peer: wrote {out}: {params} parameters, {checkpoint_bytes(out)[0]} bytes of safetensors",
          file=sys.stderr)


def load(args: argparse.Namespace) -> None:
    import torch
    import transformers
    from transformers import LlamaForCausalLM

    folder = Path(args.dir)
    ckpt, files = checkpoint_bytes(folder)
    if files == 0:
        sys.exit(f"load_peer: {folder} holds no .safetensors file. HINT: run load_peer.py generate first")
    dtype = torch_dtype(args.dtype)

    # ---- the load: RSS from here ----
    reset_peak_rss()
    before = rss_bytes()
    start = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype)
    load_s = time.perf_counter() - start
    peak_growth = peak_rss_bytes() - before
    growth = rss_bytes() - before
    # ---- every weight read once: transformers 5 leaves them mapped from the file until first use.
    # One thread, as memopt_bench_load reads them (a parallel region per tensor is slow on a busy machine) ----
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.no_grad():
        checksum = sum(float(p.sum()) for p in model.parameters())
    torch.set_num_threads(threads)
    ready_s = time.perf_counter() - start
    ready_peak_growth = peak_rss_bytes() - before

    params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    wrong = [n for n, p in model.named_parameters() if p.dtype != dtype]
    if wrong:
        sys.exit(f"load_peer: {wrong[0]} is not {dtype}")
    print(json.dumps({
        "suite": "load", "name": folder.name, "impl": "transformers", "dtype": args.dtype,
        "params": params, "param_bytes": param_bytes, "ckpt_bytes": ckpt, "ckpt_files": files,
        "load_s": load_s, "ready_s": ready_s, "rss_before_bytes": before, "load_peak_rss_growth_bytes": peak_growth,
        "load_rss_growth_bytes": growth, "ready_peak_rss_growth_bytes": ready_peak_growth,
        "peak_to_ckpt": ready_peak_growth / ckpt, "checksum": checksum,
        "threads": threads, "transformers_version": transformers.__version__,
        "torch_version": torch.__version__, "load_avg_1m": os.getloadavg()[0],
    }, separators=(",", ":")))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="load_peer.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="write a random bf16 LlamaForCausalLM checkpoint")
    g.add_argument("out")
    g.add_argument("--vocab", type=int, default=32000)
    g.add_argument("--hidden", type=int, default=768)
    g.add_argument("--layers", type=int, default=12)
    g.add_argument("--heads", type=int, default=12)
    g.add_argument("--intermediate", type=int, default=2048)
    g.add_argument("--max-shard-size", default="100MB")
    l = sub.add_parser("load", help="time transformers' from_pretrained of a folder")
    l.add_argument("dir")
    l.add_argument("--dtype", choices=DTYPES, default="bf16")
    args = parser.parse_args(argv)
    args.options = argv[2:]  # generate: the options after OUT, for the stamp
    generate(args) if args.command == "generate" else load(args)


if __name__ == "__main__":
    main(sys.argv[1:])
