"""The context a suite runs in: paths, --quick and --dry-run, the failure count, the JSON lines on stdout
(each annotated with the platform it was measured on), child processes, the Release build and the corpus."""
from __future__ import annotations

import fnmatch
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

# The CPU features a line reports (memopt::cpu_flags()'s list), in /proc/cpuinfo's order.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
LOAD = "{load}"  # in a log message: the 1, 5 and 15 minute load averages when it is logged


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def load_average(fields: int = 3) -> str:
    """The first `fields` of /proc/loadavg, e.g. "0.16 1.18 1.28" (`cut -d' ' -f1-3`)."""
    return " ".join(Path("/proc/loadavg").read_text().split(" ")[:fields])


def cpu_flags() -> str:
    """The CPU_FLAGS the first CPU has, space-separated; "none" when it has none of them."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((l for l in f if l.startswith("flags")), "")
    except OSError:
        line = ""
    return " ".join(w for w in line.rstrip("\n").split(" ") if w in CPU_FLAGS) or "none"


def torch_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], stdout=subprocess.PIPE,
                         text=True, check=True)
    return out.stdout.strip()


def env_rounds(name: str, default: int) -> int:
    """A rounds count from the environment variable `name` (unset or empty: `default`): a positive integer,
    else a ValueError naming the variable and the value, with a HINT."""
    text = os.environ.get(name) or str(default)
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"bench: error: {name} must be a positive integer (got {text!r}). HINT: 3 runs the compared "
                         "runs three times, alternately, and reports their medians")
    return int(text)


def env_patterns(name: str, names: Sequence[str]) -> list[str]:
    """The names among `names` that the comma-separated shell patterns in the environment variable `name`
    match (unset or empty: all of them), else a ValueError naming the variable, the pattern that matches
    none, and the names, with a HINT."""
    text = os.environ.get(name, "")
    patterns = [p.strip() for p in text.split(",") if p.strip()] or ["*"]
    for p in patterns:
        if not fnmatch.filter(names, p):
            raise ValueError(f"bench: error: {name}: {p!r} matches no configuration. HINT: the configurations are "
                             f"{' '.join(names)}; shell patterns such as '*-fp32-*' pick several")
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


def annotate(raw: str, torch_version: str, flags: str) -> str:
    """A stdout line as jq's `.torch_version //= $tv | .cpu_flags //= $cf` leaves it: a JSON object gets
    the keys it lacks (or has as null or false) at its end; any other line passes unchanged."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(obj, dict):
        return raw
    for key, value in (("torch_version", torch_version), ("cpu_flags", flags)):
        if obj.get(key) is None or obj.get(key) is False:
            obj[key] = value
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def last_line(text: str) -> str:
    """`| tail -n 1` inside `$(...)`: the last line, "" when the output is empty or ends in an empty line."""
    if text.endswith("\n"):
        text = text[:-1]
    return text.rsplit("\n", 1)[-1]


class SetupFailed(Exception):
    """A set-up command (a build, the corpus) failed: the run ends with its exit status, as `set -e` did."""

    def __init__(self, cmd: Sequence[str], status: int) -> None:
        super().__init__(f"{shlex.join(cmd)} failed (exit status {status})")
        self.status = status if status >= 0 else 128 - status  # killed by a signal: 128 + its number, as bash


@dataclass
class Context:
    root: Path                # the repository
    python: str               # the peer's interpreter (BENCH_PYTHON, default .venv/bin/python3)
    quick: bool               # --quick / BENCH_QUICK=1: a smoke test
    dry_run: bool             # --dry-run: print the commands, run nothing
    emit_line: Callable[[str], None] = print  # prints one annotated line on stdout
    failures: int = 0
    configured: bool = False  # --dry-run: the configure step was shown already

    @property
    def build_dir(self) -> Path:
        return self.root / "build-release"

    @property
    def corpus(self) -> Path:  # the King James corpus, tokenized (train.bin, val.bin, tokenizer.model)
        return self.root / "data" / "kjv"

    def bench(self, target: str) -> str:
        return str(self.build_dir / "benchmarks" / target)

    def example(self, directory: str, target: str) -> str:
        return str(self.build_dir / "examples" / directory / target)

    def script(self, path: str) -> str:
        return str(self.root / path)

    def fail(self, message: str) -> None:
        log(message)
        self.failures += 1

    def emit(self, text: str | Mapping) -> None:
        """Prints a line (or a multi-line text, or a dict as JSON) on stdout, annotated."""
        if not isinstance(text, str):
            text = dumps(text)
        for raw in text.rstrip("\n").split("\n"):
            self.emit_line(raw)

    # ---- showing commands (--dry-run) ----
    def rel(self, arg: str) -> str:
        return arg.replace(f"{self.root}/", "")

    def shown(self, cmd: Sequence[str], env: Mapping[str, str] | None = None, suffix: str = "") -> str:
        """cmd as a shell line (ENV=... first), paths under the repository relative to it."""
        words = [f"{k}={shlex.quote(self.rel(v))}" for k, v in (env or {}).items()]
        words += [shlex.quote(self.rel(str(a))) for a in cmd]
        return " ".join(words) + suffix

    # ---- child processes ----
    def call(self, cmd: Sequence[str], env: Mapping[str, str] | None = None, stdout: str = "last") -> tuple[int, str]:
        """Runs cmd (its stderr on ours) and returns (exit status, output): stdout "last": its stdout's last
        line; "all": its whole stdout, trailing newlines dropped; "log": its stdout goes to our stderr ("");
        "stream": each stdout line is printed (annotated) as it comes, and the text returned;
        "merged": its stdout and stderr together (`2>&1`). A command that cannot start fails with 127."""
        sys.stdout.flush()
        full_env = {**os.environ, **env} if env else None
        pipe = subprocess.PIPE
        try:
            if stdout == "stream":
                kept = []
                with subprocess.Popen(cmd, env=full_env, stdout=pipe, text=True, errors="replace") as proc:
                    for raw in proc.stdout:
                        self.emit(raw.rstrip("\n"))
                        kept.append(raw)
                return proc.returncode, "".join(kept).rstrip("\n")
            out = subprocess.run(cmd, env=full_env, text=True, errors="replace",
                                 stdout=sys.stderr if stdout == "log" else pipe,
                                 stderr=subprocess.STDOUT if stdout == "merged" else None)
        except OSError as e:
            log(f"{cmd[0]}: {e.strerror}")
            return 127, ""
        text = out.stdout or ""
        return out.returncode, last_line(text) if stdout == "last" else text.rstrip("\n")

    def setup(self, cmd: Sequence[str]) -> None:
        """A set-up command, its output on stderr; its failure ends the run (SetupFailed)."""
        if self.dry_run:
            print(self.shown(cmd, suffix=" >&2"))
            return
        status, _ = self.call(cmd, stdout="log")
        if status != 0:
            raise SetupFailed(cmd, status)

    # ---- the Release build and the corpus ----
    def build(self, targets: Sequence[str]) -> None:
        """cmake --build build-release --target TARGETS -j2, (re)configured first when there is no cache or
        one that left the benchmarks out."""
        cache = self.build_dir / "CMakeCache.txt"
        try:
            has_benchmarks = any(l.startswith("MEMOPT_BUILD_BENCHMARKS:BOOL=ON") for l in cache.open())
        except OSError:
            has_benchmarks = False
        if not has_benchmarks and not (self.dry_run and self.configured):
            self.configured = True
            if not self.dry_run:
                log(f"configuring {self.build_dir} (Release)")
            self.setup(["cmake", "-S", str(self.root), "-B", str(self.build_dir), "-G", "Ninja",
                        "-DCMAKE_BUILD_TYPE=Release", "-DMEMOPT_BUILD_TESTS=OFF", "-DMEMOPT_BUILD_BENCHMARKS=ON"])
        if not self.dry_run:
            log(f"building {' '.join(targets)}")
        self.setup(["cmake", "--build", str(self.build_dir), "--target", *targets, "-j2"])

    def corpus_data(self) -> None:
        """The King James corpus tokenized under data/kjv (train.bin, val.bin, tokenizer.model)."""
        self.setup([self.script("scripts/deps"), "data"])
        self.setup([self.script("scripts/fetch_corpus")])
        self.build(["memopt_prepare_corpus"])
        prepare = [self.example("prepare_corpus", "memopt_prepare_corpus"), "--raw", str(self.root / "data/raw/kjv"),
                   "--out", str(self.corpus)]
        if self.dry_run:
            print(f"[ -f {self.rel(str(self.corpus / 'val.bin'))} ] || {self.shown(prepare, suffix=' >&2')}")
        elif not (self.corpus / "val.bin").is_file():
            self.setup(prepare)


@dataclass
class Emitter:
    """Prints stdout's lines, annotated with the platform they were measured on, one flush per line."""
    torch_version: str
    cpu_flags: str
    stream: object = field(default=sys.stdout)

    def __call__(self, raw: str) -> None:
        print(annotate(raw, self.torch_version, self.cpu_flags), file=self.stream, flush=True)
