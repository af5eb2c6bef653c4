"""The GritLM suites (examples/03_gritlm): gritlm, gritlm_quality."""
from __future__ import annotations

from pathlib import Path

from .. import lines as L
from ..core import LOAD, Context, load_average
from ..steps import Build, Corpus, Derive, Files, Log, Run, Step


def grit_run(ctx: Context, suite: str, work: Path, name: str, args: list[str], key: str | None = None) -> Run:
    """One gritlm run on the King James corpus; its line (lines.grit_line) from its summary."""
    out = work / name
    return Run([ctx.example("03_gritlm", "gritlm"), "--data", str(ctx.corpus), "--raw", str(ctx.root / "data/raw/kjv"),
                "--output_dir", str(out), *args], key=key, output="log", remove=[out],
               log=f"gritlm {name} {' '.join(args)}: load average {LOAD} before the run",
               error=f"error: gritlm {name} failed", made=f"the {suite} line {name} from its summary",
               line=lambda _: L.grit_line(suite, name, out / "metrics.jsonl", f"flags={' '.join(args)}",
                                          f"load_avg_1m={load_average(1)}"))


# ---- suite: gritlm ----
# GradCache against the plain step (examples/03_gritlm on the King James pairs, 4 layers d256,
# group size 2, 8 generative sequences a batch, 6 steps, fp32): gradcache-64-8 = 64 queries in
# chunks of 8, plain-64 = the same batch in one backward, plain-8 = the batch that fits the
# chunk's memory without GradCache (8 times fewer negatives); one process each, then the ratio
# gradcache-64-8 / plain-64. Then the data path alone (tokenize, bucket, collate; 200 batches of
# 64 queries) with 0 and 2 worker threads, and their ratio. ~3 min (--quick: tiny).
GRITLM = {"common": "--steps 6 --warmup 1 --group_size 2 --gen_batch_size 8 --eval_queries 0 --eval_gen 0"
                    " --log_interval 1000",
          "flags": {"gradcache-64-8": "--batch_size 64 --grad_cache_chunk 8", "plain-64": "--batch_size 64",
                    "plain-8": "--batch_size 8"},
          "data_steps": "200"}
GRITLM_QUICK = {"common": "--steps 1 --warmup 0 --group_size 2 --gen_batch_size 2 --eval_queries 0 --eval_gen 0"
                          " --layers 1 --hidden_size 32 --heads 2",
                "flags": {"gradcache-64-8": "--batch_size 4 --grad_cache_chunk 2", "plain-64": "--batch_size 4",
                          "plain-8": "--batch_size 2"},
                "data_steps": "5"}
GRITLM_DATA = "--data_only --steps {steps} --batch_size 64 --group_size 2 --gen_batch_size 8 --prefetch 4"


def gritlm(ctx: Context) -> list[Step]:
    work, plan = ctx.build_dir / "bench-gritlm", GRITLM_QUICK if ctx.quick else GRITLM
    steps: list[Step] = [Corpus(), Build(["gritlm"])]
    steps += [grit_run(ctx, "gritlm", work, name, [*plan["common"].split(), *flags.split()], key=name)
              for name, flags in plan["flags"].items()]
    steps.append(Derive(["gradcache-64-8", "plain-64"], lambda a, b: L.grit_ratio("gradcache-64-8_to_plain-64", a, b),
                        "gradcache-64-8_to_plain-64"))
    data = GRITLM_DATA.format(steps=plan["data_steps"]).split()
    steps += [grit_run(ctx, "gritlm", work, f"data-workers-{w}", [*data, "--workers", w], key=f"data-workers-{w}")
              for w in ("0", "2")]
    return steps + [Derive(["data-workers-2", "data-workers-0"],
                           lambda a, b: L.grit_ratio("data-workers-2_to_0", a, b), "data-workers-2_to_0")]


# ---- suite: gritlm_quality ----
# Held-out retrieval (top-1 and MRR of 256 held-out queries against their 256 positives, next to
# TF-IDF over the same texts) and generative perplexity (64 held-out continuations), before and
# after 300 steps of 32 queries x 2 passages + 4 generative sequences (GradCache chunks of 8,
# lr 5e-4, tau 0.05), from random weights ("scratch") and from a LLaMA first trained for 400
# steps on the King James shards by the main job's example ("teacher-init", --init_model, vocabulary
# grown by the 3 format symbols). One line per run. ~40 min (--quick: tiny).
GRITLM_QUALITY = {"teacher": "--teacher_steps 400",
                  "common": "--steps 300 --warmup 15 --batch_size 32 --grad_cache_chunk 8 --group_size 2"
                            " --gen_batch_size 4 --lr 5e-4 --temperature 0.05 --log_interval 50"}
GRITLM_QUALITY_QUICK = {"teacher": "--teacher_steps 1 --layers 1 --dim 32 --heads 2 --batch_size 2 --seq_len 32",
                        "common": "--steps 1 --warmup 0 --batch_size 4 --grad_cache_chunk 2 --group_size 2"
                                  " --gen_batch_size 2 --layers 1 --hidden_size 32 --heads 2 --eval_queries 8"
                                  " --eval_gen 2"}


def gritlm_quality(ctx: Context) -> list[Step]:
    work, plan = ctx.build_dir / "bench-gritlm-quality", GRITLM_QUALITY_QUICK if ctx.quick else GRITLM_QUALITY
    teacher, common = plan["teacher"].split(), plan["common"].split()
    return [Corpus(), Build(["gritlm", "llama_to_llada"]),
            Log(f"gritlm_quality: the initial LLaMA ({' '.join(teacher)}): load average {LOAD}"),
            Files(remove=[work / "teacher"]),
            Run([ctx.example("01_llama_to_llada", "llama_to_llada"), "--train_teacher", *teacher, "--max_steps", "0",
                 "--samples", "0", "--teacher_model", str(work / "teacher"), "--data_path", str(ctx.corpus),
                 "--output_dir", str(work / "teacher-run")], output="log", error="error: the initial LLaMA failed",
                fatal=True),
            grit_run(ctx, "gritlm_quality", work, "scratch", common),
            grit_run(ctx, "gritlm_quality", work, "teacher-init", [*common, "--init_model", str(work / "teacher")])]
