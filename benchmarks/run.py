#!/usr/bin/env python3
"""benchmarks/run.py — memopt's benchmark driver: runs the suites (benchmarks/bench/suites/, as data) and
prints one JSON object per line on stdout, each with torch_version and cpu_flags where it does not say
them itself; logs and progress go to stderr. Each configuration runs in its own process, so peak RSS is
its own; the benchmarks are built in Release (build-release/) by each suite as it starts.

Run it through scripts/bench, which installs the dependencies (scripts/deps core bench) and checks that
the peer's interpreter imports torch first:

    scripts/bench [--quick] [--dry-run] [SUITE]          SUITE: all (default) or one of SUITES below
    .venv/bin/python3 benchmarks/run.py [--quick] [--dry-run] [SUITE]   the same, without those checks

  --quick      a smoke test (BENCH_QUICK=1 does the same): tiny shapes, one step each
  --dry-run    prints on stdout, suite by suite, the commands the suites would run (builds and corpus
               preparation included) in shell syntax, paths relative to the repository root, and
               their derived lines as comments; builds and runs nothing, needs no torch. What earlier
               results decide (moe_budget's verified runs, dist's re-run of a disturbed timing) is said
               in comments.
  --check-args (first, used by scripts/bench) checks the arguments only: exit 2 on a mistake, else 0

Environment: BENCH_PYTHON (the peer's interpreter, default .venv/bin/python3), BENCH_QUICK=1,
BENCH_TRAINER_ROUNDS (trainer: memopt and eager alternately N times, their medians; default 1),
BENCH_TRAINER_CONFIGS (trainer: comma-separated shell patterns over its configurations, e.g. '*-fp32-*'),
BENCH_DIST_ROUNDS (dist, default 3), BENCH_IDLE_WAIT (dist, default 600 s), BENCH_DATA_LOAD_ALL_1GIB=0
(data: leaves out the 1 GiB load_all run). Exit status: 0 when every run succeeded; 1 when any failed
(their count is logged); 2 on an unknown option or suite; a failed build or corpus preparation ends the
run with its exit status.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from bench.core import Context, Emitter, SetupFailed, cpu_flags, env_patterns, env_rounds, log, torch_version
from bench.steps import run_steps
from bench.suites import SUITES
from bench.suites.training import TRAINER_CONFIGS

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Options:
    suite: str = "all"
    quick: bool = False
    dry_run: bool = False
    help: bool = False


class BadArguments(Exception):
    def __init__(self, message: str, show_usage: bool) -> None:
        super().__init__(message)
        self.show_usage = show_usage


def usage() -> None:
    print(f"usage: scripts/bench [--quick] [--dry-run] [SUITE]   SUITE: all {' '.join(SUITES)}", file=sys.stderr)


def parse(argv: list[str]) -> Options:
    """scripts/bench's arguments, in order: -h stops at once; the last word not an option is the suite."""
    opts = Options(quick=os.environ.get("BENCH_QUICK", "0") == "1")
    for arg in argv:
        if arg == "--quick":
            opts.quick = True
        elif arg == "--dry-run":
            opts.dry_run = True
        elif arg in ("-h", "--help"):
            opts.help = True
            return opts
        elif arg.startswith("-"):
            raise BadArguments(f"bench: error: unknown option '{arg}'", show_usage=True)
        else:
            opts.suite = arg
    for name, default in (("BENCH_TRAINER_ROUNDS", 1), ("BENCH_DIST_ROUNDS", 3)):
        try:
            env_rounds(name, default)
        except ValueError as e:
            raise BadArguments(str(e), show_usage=False) from None
    try:
        env_patterns("BENCH_TRAINER_CONFIGS", TRAINER_CONFIGS)
    except ValueError as e:
        raise BadArguments(str(e), show_usage=False) from None
    if opts.suite != "all" and opts.suite not in SUITES:
        raise BadArguments(f"bench: error: unknown suite '{opts.suite}'. HINT: the suites are: all {' '.join(SUITES)}",
                           show_usage=False)
    return opts


def selected(opts: Options) -> list[str]:
    return [name for name in SUITES if opts.suite in ("all", name)]


def dry_run(ctx: Context, opts: Options) -> int:
    print(f"# cd {ctx.root}   (paths below are relative to it; quick={int(ctx.quick)})")
    for name in selected(opts):
        print(f"# ---- suite: {name} ----")
        run_steps(ctx, SUITES[name](ctx))
    return 0


def run(ctx: Context, opts: Options) -> int:
    start = time.monotonic()
    try:
        version = torch_version(ctx.python)
    except (OSError, subprocess.CalledProcessError):
        print(f"bench: error: {ctx.python} cannot import torch. HINT: run scripts/deps bench, or set BENCH_PYTHON",
              file=sys.stderr)
        return 1
    # Every JSON line on stdout gets the platform it was measured on, where it does not say so itself.
    ctx.emit_line = Emitter(version, cpu_flags())
    for name in selected(opts):
        try:
            run_steps(ctx, SUITES[name](ctx))
        except SetupFailed as e:  # a build or the corpus: nothing after it can run
            log(f"error: {e}")
            return e.status
        except Exception as e:  # the driver's own bug: counted, the next suite still runs
            traceback.print_exc()
            ctx.fail(f"error: suite {name} stopped: {type(e).__name__}: {e}")
    seconds = int(time.monotonic() - start)
    if ctx.failures > 0:
        log(f"done in {seconds} s; {ctx.failures} run(s) FAILED")
        return 1
    log(f"done in {seconds} s")
    return 0


def main(argv: list[str]) -> int:
    check_only = bool(argv) and argv[0] == "--check-args"
    try:
        opts = parse(argv[1:] if check_only else argv)
    except BadArguments as e:
        print(e, file=sys.stderr)
        if e.show_usage:
            usage()
        return 2
    if check_only:
        return 0
    if opts.help:
        usage()
        return 0
    ctx = Context(root=ROOT, python=os.environ.get("BENCH_PYTHON") or str(ROOT / ".venv/bin/python3"),
                  quick=opts.quick, dry_run=opts.dry_run)
    try:
        return dry_run(ctx, opts) if opts.dry_run else run(ctx, opts)
    except KeyboardInterrupt:
        log("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
