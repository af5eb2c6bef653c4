"""The load suite: memopt::io::load_pretrained of a bf16 checkpoint written by transformers, next to
transformers' own from_pretrained of it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..core import LOAD, Context, log
from ..steps import Build, Run, Step, Summary

# ---- suite: load ----
# A random LlamaForCausalLM (benchmarks/peer/load_peer.py generate: vocab 32000, hidden 768, 12 layers,
# 12 heads, FFN 2048, untied head: 134.1 M parameters, 268 MB) built in bf16 by transformers and written by
# its save_pretrained in 100 MB shards (under build-release/bench-load/, reused while its arguments match).
# Then, alternately, 3 rounds each, one process per load (so each peak RSS is its own): memopt
# (memopt_bench_load: load_pretrained with dtype bf16) and transformers (load_peer.py load:
# LlamaForCausalLM.from_pretrained(dir, dtype=torch.bfloat16)). Each line: the call's wall time (load_s),
# the call plus one read of every weight on one thread (ready_s: transformers 5 returns weights still
# mapped from the files, read on first use), the growth of the peak RSS over the RSS just before the call at both points,
# the checkpoint's bytes, memopt's random-init time (init_s). Last the summary line: each side's fastest
# round and highest peak, their ratios, and the target: memopt's peak RSS growth <= 1.1x the checkpoint's
# bytes. The page cache holds the files (written just before): warm loads. ~1 min on a 2-core machine,
# most of it Python importing transformers (--quick: a 3.7 M-parameter model, 1 round, ~20 s).
LOAD_MODEL = {"name": "llama-134m", "rounds": 3,
              "generate": "--vocab 32000 --hidden 768 --layers 12 --heads 12 --intermediate 2048 --max-shard-size 100MB"}
# --quick, a smoke test: 3.7 M parameters in 2 MB shards
LOAD_MODEL_QUICK = {"name": "llama-3m", "rounds": 1,
                    "generate": "--vocab 4096 --hidden 256 --layers 2 --heads 4 --intermediate 688 --max-shard-size 2MB"}
TARGET_PEAK_TO_CKPT = 1.1  # issue 26: memopt's peak RSS growth over the checkpoint's bytes
STAMP = "load_peer_generate.txt"  # load_peer.py's record of the arguments that made a folder


def peer(ctx: Context) -> list[str]:
    return [ctx.python, ctx.script("benchmarks/peer/load_peer.py")]


@dataclass
class GenerateCheckpoint(Step):
    """The checkpoint, (re)written by load_peer.py generate unless its folder was made with the same
    arguments; a failure ends the suite."""
    folder: Path
    args: list[str]

    def command(self, ctx: Context) -> list[str]:
        return [*peer(ctx), "generate", str(self.folder), *self.args]

    def current(self) -> bool:
        try:
            return (self.folder / STAMP).read_text().strip() == " ".join(self.args)
        except OSError:
            return False

    def run(self, ctx: Context, lines: dict[str, str]) -> bool:
        if self.current():
            return True
        log(f"load: generating {self.folder}")
        if ctx.call(self.command(ctx), stdout="log")[0] != 0:
            ctx.fail("error: could not generate the checkpoint")
            return False
        return True

    def show(self, ctx: Context) -> None:
        print(f"# unless {ctx.rel(str(self.folder / STAMP))} records the same arguments:")
        print(ctx.shown(self.command(ctx), suffix=" >&2"))


def load_summary(raw: Mapping[str, str], name: str) -> dict | None:
    """memopt over transformers: each side's fastest round (load_s, ready_s) and highest peak RSS growth."""
    lines = [json.loads(v) for v in raw.values()]
    memopt = [l for l in lines if l.get("impl") == "memopt"]
    theirs = [l for l in lines if l.get("impl") == "transformers"]
    if not memopt or not theirs:
        return None
    best = lambda ls, k: min(l[k] for l in ls)  # noqa: E731
    worst = lambda ls, k: max(l[k] for l in ls)  # noqa: E731
    ckpt = memopt[0]["ckpt_bytes"]
    m_peak, t_peak = worst(memopt, "ready_peak_rss_growth_bytes"), worst(theirs, "ready_peak_rss_growth_bytes")
    return {"suite": "load", "name": name, "impl": "ratio_memopt_to_transformers", "rounds": len(memopt),
            "ckpt_bytes": ckpt, "params": memopt[0]["params"],
            "memopt_load_s": round(best(memopt, "load_s"), 3), "transformers_load_s": round(best(theirs, "load_s"), 3),
            "memopt_ready_s": round(best(memopt, "ready_s"), 3),
            "transformers_ready_s": round(best(theirs, "ready_s"), 3),
            "memopt_init_s": round(best(memopt, "init_s"), 3),
            "load_s": round(best(memopt, "load_s") / best(theirs, "load_s"), 3),
            "ready_s": round(best(memopt, "ready_s") / best(theirs, "ready_s"), 3),
            "memopt_peak_rss_growth_bytes": m_peak, "transformers_peak_rss_growth_bytes": t_peak,
            "peak_rss_growth": round(m_peak / t_peak, 3),
            "memopt_peak_to_ckpt": round(m_peak / ckpt, 4), "transformers_peak_to_ckpt": round(t_peak / ckpt, 4),
            "same_weights": len({l["checksum"] for l in memopt + theirs}) == 1,
            "target_peak_to_ckpt": TARGET_PEAK_TO_CKPT, "met": m_peak <= TARGET_PEAK_TO_CKPT * ckpt}


def load(ctx: Context) -> list[Step]:
    plan = LOAD_MODEL_QUICK if ctx.quick else LOAD_MODEL
    folder = ctx.build_dir / "bench-load" / plan["name"]
    steps: list[Step] = [Build(["memopt_bench_load"]), GenerateCheckpoint(folder, plan["generate"].split())]
    for r in range(1, plan["rounds"] + 1):
        steps += [Run([ctx.bench("memopt_bench_load"), "--dir", str(folder), "--dtype", "bf16"], key=f"memopt#{r}",
                      log=f"load memopt round {r}: load average {LOAD} before the run",
                      error=f"error: memopt_bench_load --dir {folder} failed"),
                  Run([*peer(ctx), "load", str(folder), "--dtype", "bf16"], key=f"transformers#{r}",
                      log=f"load transformers round {r}: load average {LOAD} before the run",
                      error=f"error: load_peer.py load {folder} failed")]
    return steps + [Summary(lambda lines: [load_summary(lines, plan["name"])], "the ratio_memopt_to_transformers line")]
