"""The data suite: memopt::data::StreamLoader against the trainer's consumption and a load-it-whole loader."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .. import lines as L
from ..core import LOAD, Context, log
from ..steps import Build, Corpus, Derive, Require, Run, Step, Summary
from ..summaries import data_summary

# ---- suite: data ----
# memopt::data::StreamLoader (data/stream.hpp: B 8, T 256, shuffle buffer 1000, one epoch, on-the-fly
# SentencePiece tokenization) on text corpora generated from the King James lines (each pass over them in a
# new seeded order; under build-release/bench-data/, reused while their size matches), one process
# per run so each peak RSS is its own. First the timings: the trainer's consumption rate on the
# reference model (memopt_bench_trainer: 4 x d256, seq 256, 8 x 2 rows, vocab 4096, bf16, checkpoint
# every; its fastest step counts), then tokens/s with 0, 1 and 2 tokenizer workers (the 0.25 GiB
# corpus, its first 20M tokens); then RSS growth over the process before its loader while
# streaming the 0.25 GiB and 1 GiB corpora whole (2 workers), and for the seed's load-it-whole
# loader (every document in memory, tokenized into one id vector, then int64 tensors of every
# window) on both. Last the ratio lines: loader tokens/s over the trainer's (target >= 10) and RSS
# growth (target: < 64 MiB, the same at 0.25 and 1 GiB). ~10 min on a 2-core machine, most of it the
# 1 GiB runs (load_all there peaks near 8.2 GiB RSS; BENCH_DATA_LOAD_ALL_1GIB=0 leaves it out:
# ~6 min); --quick: 4 and 8 MiB corpora, ~1 min.
DATA = {"small_bytes": 1 << 28, "large_bytes": 1 << 30, "cap": "20000000",
        "trainer": "--layers 4 --dim 256 --heads 8 --seq 256 --micro 8 --accum 2 --vocab 4096 --precision bf16"
                   " --recompute every --warmup 1 --steps 3"}
# --quick, a smoke test: 4 and 8 MiB corpora, 1M tokens, one trainer step
DATA_QUICK = {"small_bytes": 4 << 20, "large_bytes": 8 << 20, "cap": "1000000",
              "trainer": "--layers 4 --dim 256 --heads 8 --seq 256 --micro 2 --accum 1 --vocab 4096 --precision bf16"
                         " --recompute every --warmup 0 --steps 1"}


def corpus_path(ctx: Context, size: int) -> Path:
    return ctx.build_dir / "bench-data" / f"kjv-{size >> 20}MiB.txt"


@dataclass
class GenerateCorpora(Step):
    """The generated corpora, (re)written when missing or of another size; a failure ends the suite."""
    sizes: tuple[int, ...]

    def command(self, ctx: Context, size: int) -> list[str]:
        return [ctx.bench("memopt_bench_data"), "--mode", "generate", "--bytes", str(size),
                "--out", str(corpus_path(ctx, size)), "--source", str(ctx.corpus / "train.txt")]

    def run(self, ctx: Context, lines: dict[str, str]) -> bool:
        for size in self.sizes:
            path = corpus_path(ctx, size)
            if path.is_file() and path.stat().st_size == size:
                continue
            log(f"data: generating {path}")
            if ctx.call(self.command(ctx, size), stdout="log")[0] != 0:
                ctx.fail("error: could not generate the corpora")
                return False
        return True

    def show(self, ctx: Context) -> None:
        for size in self.sizes:
            print(f"# unless {ctx.rel(str(corpus_path(ctx, size)))} has {size} bytes:")
            print(ctx.shown(self.command(ctx, size), suffix=" >&2"))


def data_run(ctx: Context, key: str, args: list[str]) -> Run:
    return Run([ctx.bench("memopt_bench_data"), "--tokenizer", str(ctx.corpus / "tokenizer.model"), *args], key=key,
               log=f"data {key}: load average {LOAD} before the run",
               error=f"error: memopt_bench_data {' '.join(args)} failed")


def data(ctx: Context) -> list[Step]:
    plan = DATA_QUICK if ctx.quick else DATA
    small, large = (str(corpus_path(ctx, plan[k])) for k in ("small_bytes", "large_bytes"))
    trainer = plan["trainer"].split()
    steps: list[Step] = [
        Corpus(unless=[ctx.corpus / "train.txt", ctx.corpus / "tokenizer.model"]),
        Require(ctx.corpus / "train.txt", f"error: {ctx.corpus}/train.txt is missing. HINT: rm data/kjv/val.bin, then "
                                          "scripts/bench data (memopt_prepare_corpus writes it)"),
        Build(["memopt_bench_data", "memopt_bench_trainer"]),
        GenerateCorpora((plan["small_bytes"], plan["large_bytes"])),
        # The timing-sensitive runs first (a short minute), the long RSS runs after: start the suite on an idle
        # machine and the timings are taken while it still is; RSS does not depend on load.
        Run([ctx.bench("memopt_bench_trainer"), *trainer], key="trainer",
            log=f"data: the trainer's consumption rate ({' '.join(trainer)}): load average {LOAD}",
            error=f"error: memopt_bench_trainer {' '.join(trainer)} failed", line=L.data_trainer_line,
            made="the trainer_consumption line")]
    steps += [data_run(ctx, f"throughput-w{w}", ["--mode", "stream", "--data", small, "--workers", w,
                                                 "--max_tokens", plan["cap"]]) for w in ("0", "1", "2")]
    steps += [data_run(ctx, "stream-small", ["--mode", "stream", "--data", small, "--workers", "2"]),
              data_run(ctx, "stream-large", ["--mode", "stream", "--data", large, "--workers", "2"]),
              data_run(ctx, "load_all-small", ["--mode", "load_all", "--data", small, "--layout", "tensors"])]
    if (os.environ.get("BENCH_DATA_LOAD_ALL_1GIB") or "1") == "1":
        steps.append(data_run(ctx, "load_all-large", ["--mode", "load_all", "--data", large, "--layout", "tensors"]))
    return steps + [Summary(data_summary, "the throughput_vs_consumption and rss_growth lines")]


# ---- suite: tokenizer ----
# memopt::data::Tokenizer (data/hf_tokenizer.hpp) next to HF tokenizers (Rust, from Python's
# encode_batch) on the same tokenizer.json files and text: two 32000-id tokenizers trained by
# benchmarks/peer/tokenizer_peer.py on the King James lines (llama3: byte-level BPE with Llama 3's
# split regex; llama2: SentencePiece-style Metaspace BPE with byte fallback; under
# build-release/bench-data/tok/), encoding a generated 64 MiB corpus (--quick: 4 MiB) one line a
# document, with 1 and 2 threads. Each line: MB/s of input, tokens and a checksum of the ids; the
# ratio lines divide memopt's MB/s by HF's and say whether both produced the same ids.
TOKENIZER = {"bytes": 64 << 20}
TOKENIZER_QUICK = {"bytes": 4 << 20}


def tokenizer(ctx: Context) -> list[Step]:
    plan = TOKENIZER_QUICK if ctx.quick else TOKENIZER
    text = str(corpus_path(ctx, plan["bytes"]))
    folder = ctx.build_dir / "bench-data" / "tok"
    peer = [ctx.python, ctx.script("benchmarks/peer/tokenizer_peer.py")]
    steps: list[Step] = [
        Corpus(unless=[ctx.corpus / "train.txt"]),
        Require(ctx.corpus / "train.txt", f"error: {ctx.corpus}/train.txt is missing. HINT: rm data/kjv/val.bin, then "
                                          "scripts/bench tokenizer (memopt_prepare_corpus writes it)"),
        Build(["memopt_bench_data", "memopt_bench_tokenizer"]),
        GenerateCorpora((plan["bytes"],)),
        Run([*peer, "make", str(folder), str(ctx.corpus / "train.txt")], output="log",
            log="tokenizer: training the 32000-id tokenizers (once)", error="error: tokenizer_peer.py make failed")]
    for kind in ("llama3", "llama2"):
        for threads in ("1", "2"):
            key = f"{kind}-t{threads}"
            steps += [Run([ctx.bench("memopt_bench_tokenizer"), "--tokenizer", str(folder / kind), "--text", text,
                           "--threads", threads], key=f"{key}/memopt",
                          log=f"tokenizer {key}: load average {LOAD} before the run",
                          error=f"error: memopt_bench_tokenizer {key} failed"),
                      Run([*peer, "encode", str(folder / kind), text, threads], key=f"{key}/hf",
                          error=f"error: tokenizer_peer.py encode {key} failed"),
                      Derive([f"{key}/memopt", f"{key}/hf"], tokenizer_ratio, "ratio memopt / HF tokenizers")]
    return steps


def tokenizer_ratio(a: dict, b: dict) -> dict:
    return {"suite": "tokenizer", "name": Path(a["tokenizer"]).name, "impl": "ratio", "peer": "hf_tokenizers",
            "threads": a["threads"], "mb_per_s": a["mb_per_s"] / b["mb_per_s"],
            "same_ids": a["tokens"] == b["tokens"] and a["checksum"] == b["checksum"],
            "cpu_flags": a.get("cpu_flags")}
