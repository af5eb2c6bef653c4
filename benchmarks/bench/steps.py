"""What a suite is made of: a list of steps, run in order. Each step runs (returning False to end its suite)
or, under --dry-run, shows the commands it would run. A suite keeps its runs' JSON lines by key (`lines`)
for the steps that derive lines from them (ratios, summaries)."""
from __future__ import annotations

import json
import shutil
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence, Union

from .core import LOAD, Context, dumps, load_average, log

Line = Union[str, Mapping, None]  # a JSON line as text or as a dict; None: no line


class Step:
    def run(self, ctx: Context, lines: dict[str, str]) -> bool:
        raise NotImplementedError

    def show(self, ctx: Context) -> None:
        raise NotImplementedError


def run_steps(ctx: Context, steps: Iterable[Step]) -> None:
    lines: dict[str, str] = {}
    for step in steps:
        if ctx.dry_run:
            step.show(ctx)
        elif not step.run(ctx, lines):
            return


def as_text(line: Line) -> str | None:
    return line if line is None or isinstance(line, str) else dumps(line)


@dataclass
class Log(Step):
    """A log line on stderr; LOAD in it becomes the load average. --dry-run shows it as a comment."""
    message: str

    def run(self, ctx: Context, lines: dict[str, str]) -> bool:
        log(self.message.replace(LOAD, load_average()))
        return True

    def show(self, ctx: Context) -> None:
        print(f"# {ctx.rel(self.message.replace(LOAD, '<load>'))}")


@dataclass
class Build(Step):
    targets: Sequence[str]

    def run(self, ctx: Context, lines: dict[str, str]) -> bool:
        ctx.build(self.targets)
        return True

    def show(self, ctx: Context) -> None:
        ctx.build(self.targets)  # under --dry-run, Context.build shows its commands


@dataclass
class Corpus(Step):
    """The King James corpus under data/kjv (Context.corpus_data), unless every file of `unless` exists."""
    unless: Sequence[Path] = ()

    def run(self, ctx: Context, lines: dict[str, str]) -> bool:
        if not (self.unless and all(p.is_file() for p in self.unless)):
            ctx.corpus_data()
        return True

    def show(self, ctx: Context) -> None:
        if self.unless:
            print(f"# unless {' and '.join(ctx.rel(str(p)) for p in self.unless)} exist:")
        ctx.corpus_data()


@dataclass
class Require(Step):
    """Ends the suite, a failure, when `path` is missing."""
    path: Path
    error: str

    def run(self, ctx: Context, lines: dict[str, str]) -> bool:
        if self.path.is_file():
            return True
        ctx.fail(self.error)
        return False

    def show(self, ctx: Context) -> None:
        print(f"# the suite ends, a failure, when {ctx.rel(str(self.path))} is missing")


@dataclass
class Files(Step):
    """rm -rf `remove`, then mkdir -p `mkdir`, then `: > truncate`."""
    remove: Sequence[Path] = ()
    mkdir: Sequence[Path] = ()
    truncate: Sequence[Path] = ()

    def run(self, ctx: Context, lines: dict[str, str]) -> bool:
        for p in self.remove:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        for p in self.mkdir:
            p.mkdir(parents=True, exist_ok=True)
        for p in self.truncate:
            p.write_text("")
        return True

    def show(self, ctx: Context) -> None:
        for verb, paths in (("rm -rf", self.remove), ("mkdir -p", self.mkdir), (": >", self.truncate)):
            if paths:
                print(f"{verb} {' '.join(ctx.rel(str(p)) for p in paths)}")


@dataclass
class Run(Step):
    """One process. Its JSON line: with output "last", the last line of its stdout (a failure unless the
    process exits 0 and the line starts with "{"); with "log", its stdout goes to stderr and `line` makes
    the JSON line (from the run's files), if any; with "stream", every stdout line is printed as it comes.
    `line`, when given, turns the captured line into the one printed (None: none). The printed line is kept
    as lines[key]. A failure is logged (`error`) and counted; a `fatal` one ends the suite."""
    cmd: Sequence[str]
    key: str | None = None
    log: str | None = None            # logged before the run (LOAD: the load average)
    error: str = "error: a run failed"
    env: Mapping[str, str] = field(default_factory=dict)
    output: str = "last"              # last | log | stream | all (the whole stdout, for helpers)
    line: Callable[[str], Line] | None = None
    remove: Sequence[Path] = ()       # rm -rf before the run
    tee: Path | None = None           # the line is also appended to this file
    fatal: bool = False
    made: str = ""                    # --dry-run: how `line` makes the printed line
    quiet: bool = False               # kept, not printed (one round of several: Median prints one)

    def run(self, ctx: Context, lines: dict[str, str]) -> bool:
        if self.log:
            log(self.log.replace(LOAD, load_average()))
        Files(remove=self.remove).run(ctx, lines)
        status, captured = ctx.call(self.cmd, self.env, self.output)
        ok = status == 0 and (self.output != "last" or captured.startswith("{"))
        text = None
        if ok:
            try:
                text = as_text(self.line(captured) if self.line else captured if self.output != "log" else None)
            except Exception as e:  # the bash helpers' failures: a line that could not be made
                log(f"{type(e).__name__}: {e}")
                ok = False
        if not ok:
            ctx.fail(self.error)
            return not self.fatal
        if text is not None and self.output != "stream" and not self.quiet:
            ctx.emit(text)
        if text is not None and self.tee:
            with self.tee.open("a") as f:
                f.write(text + "\n")
        if text is not None and self.key:
            lines[self.key] = text
        return True

    def show(self, ctx: Context) -> None:
        if self.remove:
            Files(remove=self.remove).show(ctx)
        print(ctx.shown(self.cmd, self.env, {"last": " | tail -n 1", "log": " >&2"}.get(self.output, "")))
        if self.quiet:
            print(f"#   -> kept as {self.key}, not printed")
        elif self.made or self.tee:
            tee = f" | tee -a {ctx.rel(str(self.tee))}" if self.tee else ""
            print(f"#   -> {ctx.rel(self.made) or 'the line'}{tee}")


@dataclass
class Derive(Step):
    """A line from kept lines (a ratio): make(*the lines of `keys`, parsed), printed when all of them ran."""
    keys: Sequence[str]
    make: Callable[..., Line]
    what: str
    parsed: bool = True               # False: make gets the lines' text

    def run(self, ctx: Context, lines: dict[str, str]) -> bool:
        if all(lines.get(k) for k in self.keys):
            args = [json.loads(lines[k]) if self.parsed else lines[k] for k in self.keys]
            guarded(ctx, self.what, lambda: self.make(*args))
        return True

    def show(self, ctx: Context) -> None:
        print(f"#   -> {self.what}, from {' and '.join(self.keys)}")


@dataclass
class Median(Step):
    """Of the kept lines `keys` (one configuration's rounds, run quietly between its peer's), the one with
    the median `by` (the lower one of an even count), printed and kept as `key`, with "rounds" and each
    round's value ("tokens_per_s_rounds") added: drift in the machine's speed between rounds moves the
    median less than any one run."""
    keys: Sequence[str]
    key: str
    by: str = "tokens_per_s"

    def run(self, ctx: Context, lines: dict[str, str]) -> bool:
        got = [json.loads(lines[k]) for k in self.keys if lines.get(k)]
        if got:
            median = sorted(got, key=lambda line: line[self.by])[(len(got) - 1) // 2]
            text = dumps({**median, "rounds": len(got), f"{self.by}_rounds": [line[self.by] for line in got]})
            ctx.emit(text)
            lines[self.key] = text
        return True

    def show(self, ctx: Context) -> None:
        print(f"#   -> the median by {self.by} of {', '.join(self.keys)}, kept as {self.key}")


@dataclass
class Summary(Step):
    """Lines from every kept line (or from files): make(lines) returns the JSON lines to print."""
    make: Callable[[dict[str, str]], Iterable[Line]]
    what: str

    def run(self, ctx: Context, lines: dict[str, str]) -> bool:
        guarded(ctx, self.what, lambda: list(self.make(lines)))
        return True

    def show(self, ctx: Context) -> None:
        print(f"#   -> {self.what}")


def guarded(ctx: Context, what: str, make: Callable[[], Line | list[Line]]) -> None:
    """Prints what make() returns; an exception is logged and counted as a failure."""
    try:
        out = make()
    except Exception:
        traceback.print_exc()
        ctx.fail(f"error: {what} failed")
        return
    for line in out if isinstance(out, list) else [out]:
        if line is not None:
            ctx.emit(as_text(line))
