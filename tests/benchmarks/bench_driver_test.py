"""tests/benchmarks/bench_driver_test.py — benchmarks/run.py (scripts/bench's driver) without running a
benchmark: argument parsing, the torch_version/cpu_flags annotation, the ratio lines' keys and order,
failure counting with fake runs, and --dry-run of every suite (full and --quick). Standard library only.
Run: python3 tests/benchmarks/bench_driver_test.py"""
import contextlib
import io
import json
import subprocess
import tempfile
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import run as R
from bench import core, lines as L, summaries as S, steps as ST
from bench.suites import dist as D, SUITES
from pathlib import Path

# argument parsing, as the bash loop did
assert R.parse(["--quick", "trainer"]).suite == "trainer"
assert R.parse(["a"*0 or "dist", "trainer"]).suite == "trainer"  # the last word wins
assert R.parse(["-h", "--bogus"]).help
for bad, usage in ((["--bogus"], True), (["bogus"], False), (["-"], True), ([""], False)):
    try: R.parse(bad); raise SystemExit("no error")
    except R.BadArguments as e: assert e.show_usage == usage, bad
assert list(SUITES) == "trainer bf16_gemm profile distill distill_quality adamw8bit lora attention fused stack allocator moe moe_budget moe_quality gritlm gritlm_quality estimator planner data tokenizer dist collectives load".split()

# annotation (jq's //=): appended when missing, null or false; kept otherwise; non-objects unchanged
a = core.annotate
assert a('{"x":1}', "2.15", "avx2") == '{"x":1,"torch_version":"2.15","cpu_flags":"avx2"}'
assert a('{"torch_version":null,"x":1.0,"cpu_flags":"none"}', "t", "c") == '{"torch_version":"t","x":1.0,"cpu_flags":"none"}'
assert a('{"torch_version":false,"cpu_flags":0}', "t", "c") == '{"torch_version":"t","cpu_flags":0}'
assert a("not json", "t", "c") == "not json" and a("[1]", "t", "c") == "[1]" and a("", "t", "c") == ""
assert a('{"s":"×"}', "t", "c") == '{"s":"×","torch_version":"t","cpu_flags":"c"}'
assert core.last_line("a\nb\n") == "b" and core.last_line("a\n\n") == "" and core.last_line("") == "" and core.last_line("a\nb") == "b"

# trainer ratio: the jq filter's keys and order
m = {"name": "n", "impl": "memopt", "tokens_per_s": 2.0, "peak_rss_mib": 4.0, "step_ms_min": 1.0, "step_ms": 3.0, "torch_version": "2.15.0"}
p = {"name": "n", "impl": "pytorch_compile", "tokens_per_s": 1.0, "peak_rss_mib": 8.0, "step_ms_min": 2.0, "step_ms": 6.0}
r = L.trainer_ratio(m, p)
assert list(r) == ["name", "impl", "peer", "tokens_per_s", "peak_rss_mib", "tokens_per_s_best", "torch_version", "cpu_flags"]
assert r["peer"] == "compile" and r["tokens_per_s_best"] == 2.0
assert a(core.dumps(r), "tv", "cf") == '{"name":"n","impl":"ratio","peer":"compile","tokens_per_s":2.0,"peak_rss_mib":0.5,"tokens_per_s_best":2.0,"torch_version":"2.15.0","cpu_flags":"cf"}'
assert L.overhead_ratio(m, p) == {"name": "overhead", "impl": "ratio", "step_time": 0.5}
# attention ratio with target, skipped lines
x = {"name": "attn", "impl": "blockwise", "L": 4096, "peak_tracked_mib": 1.0, "ms": 1.0, "ms_min": 1.0}
y = {"name": "attn", "impl": "math", "L": 4096, "peak_tracked_mib": 20.0, "ms": 1.0, "ms_min": 2.0}
r = L.attention_ratio(x, y, target={"peak_tracked_mib": 0.1, "ms": 1.2})
assert list(r) == ["suite", "name", "impl", "L", "peak_tracked_mib", "ms", "ms_min", "target", "met"] and r["met"] and r["impl"] == "ratio_blockwise_to_math"
assert L.attention_ratio({**x, "skipped": True}, y) is None
assert L.allocator_line("", '{"peak_tracked_mib":1.04,"peak_rss_mib":2,"tokens_per_s":3.33,"load_avg_1m":0.5}')["impl"] == "memopt default (preset:training)"

# planner summary on synthetic rows
rows = [{"name": n, "predicted_s_per_step": p, "measured_s_per_step": q, "predicted_mib": pm, "measured_mib": mm}
        for n, p, q, pm, mm in (("a", 1, 2, 100, 110), ("b", 2, 3, 150, 140), ("c", 3, 5, 300, 310), ("large-a", 4, 4, 600, 650))]
s = S.planner_summary(rows, ["reference:200", "large:700"])
assert s["spearman_reference"] == 1.0 and s["budgets"][0]["chosen"] == "a" and s["budgets"][1]["regret"] == 1.0

# dist: the run key spliced in after "suite"
assert D.with_run("two#1", '{"suite":"dist","x":1}') == '{"suite":"dist","run":"two#1","x":1}'
assert D.with_run("two#1", '{"x":1}') == '{"suite":"dist","run":"two#1","x":1}'
one = lambda t, ranks: json.dumps({"precision": "bf16", "ranks": ranks, "threads": 1, "tokens_per_s": t, "step_ms_min": 1000 / t,
                                   "step_ms_all": [1000 / t], "losses": [1.0, 2.0], "optimizer_state_mib_per_rank": 10.0 / ranks,
                                   "optimizer_state_mib_ranks": [1]})
out = S.dist_summary({"one#1": one(100, 1), "two#1": one(190, 2), "one#2": one(100, 1), "two#2": one(190, 2)})
assert [o["name"] for o in out] == ["dist_speedup", "loss_curve"] and out[0]["rounds"] == 2 and out[0]["met"]
state = lambda t, ranks, mib, rss=100.0: json.dumps({**json.loads(one(t, ranks)), "model_state_mib_per_rank": mib,
                                                     "model_state_mib_ranks": [mib], "peak_tracked_mib": mib,
                                                     "peak_rss_mib": rss})
out = S.dist_summary({"two#1": state(200, 2, 100.0), "two-zero3#1": state(180, 2, 50.0, 90.0),
                      "peer-two-fsdp2#1": state(150, 2, 50.0, 120.0), "three#1": state(10, 3, 100.0),
                      "three-zero3#1": state(10, 3, 40.0), "peer-two-deepspeed3#1": state(90, 2, 60.0, 180.0)})
z = {(o["name"], o["ranks"]): o for o in out}
assert z["zero3_vs_ddp", 2]["state_per_rank"] == 0.5 and z["zero3_vs_ddp", 2]["tokens_per_s"] == 0.9 and z["zero3_vs_ddp", 2]["met"]
assert z["zero3_vs_ddp", 3]["state_per_rank"] == 0.4 and not z["zero3_vs_ddp", 3]["met"] and "tokens_per_s" not in z["zero3_vs_ddp", 3]
assert z["zero3_vs_fsdp2", 2]["peak_rss_mib"] == 0.75 and z["zero3_vs_fsdp2", 2]["tokens_per_s"] == 1.2 and z["zero3_vs_fsdp2", 2]["met"]
assert z["zero3_vs_deepspeed", 2]["peak_rss_mib"] == 0.5 and z["zero3_vs_deepspeed", 2]["tokens_per_s"] == 2.0
assert "met" not in z["zero3_vs_deepspeed", 2]  # a reference, no target

# a suite's steps against canned process results (no process runs): failures, kept lines, derived lines
printed = []
ctx = core.Context(root=ROOT, python="py", quick=True, dry_run=False, emit_line=printed.append)
shape = '"params_m":3.0,"trainable_m":3.0,"vocab":1000,"dim":1000,"layers":2,"seq":100,"gemm_gflops":100'
canned = {"memopt": (0, '{"name":"n","impl":"memopt","tokens_per_s":2000,"peak_rss_mib":4,"step_ms_min":1,"step_ms":3,' + shape + '}'),
          "pytorch": (0, '{"name":"n","impl":"pytorch","tokens_per_s":1000,"peak_rss_mib":8,"step_ms_min":2,"step_ms":6,' + shape + '}'),
          "pytorch_compile": (1, ""), "hand": (0, "not json")}
def fake_call(cmd, env=None, stdout="last"):
    impl = "pytorch_compile" if "--compile" in cmd else "pytorch" if cmd[0] == "py" else cmd[cmd.index("--impl") + 1]
    return canned[impl]
ctx.call = fake_call
steps = [s for s in SUITES["trainer"](ctx) if not isinstance(s, ST.Build)][:8]  # small fp32 none: memopt, peers, hand
with contextlib.redirect_stderr(io.StringIO()) as err:
    ST.run_steps(ctx, steps)
assert ctx.failures == 2, ctx.failures  # compile exited 1, hand printed no JSON
assert [json.loads(l)["impl"] for l in printed] == ["memopt", "pytorch", "ratio"], printed
# mfu: 2 M weights past the 1 M-entry embedding, all trainable (6 FLOPs each) + attention 12 x 2 x 100 x 1000
# = 14.4 MFLOP a token (a memopt line without "attention": the math path, every masked score computed); at
# 2000 tokens/s over a 100 GFLOP/s GEMM: 0.288. The peer's SDPA skips the masked half: 13.2 MFLOP, at half
# the rate 0.132.
got = [json.loads(l) for l in printed]
assert got[0]["model_flops_per_token"] == 14.4e6 and got[0]["mfu"] == 0.288 and got[1]["mfu"] == 0.132, got
assert (got[2]["mfu"], got[2]["peer_mfu"]) == (0.288, 0.132), got[2]
assert L.model_flops_per_token({**got[0], "trainable_m": 0.5}) == 4 * 2e6 + 2 * 0.5e6 + 2.4e6  # LoRA: a frozen base
for kind, attention in (("math", 2.4e6), ("sdpa", 1.2e6), ("blockwise", 1.2e6), ("flash", 1.2e6), ("auto", 1.2e6)):
    assert L.model_flops_per_token({**got[0], "attention": kind}) == 12e6 + attention, kind
assert "error: pytorch_compile --layers 4" in err.getvalue() and "error: hand --layers 4" in err.getvalue()
assert "memopt: load average " in err.getvalue()

# BENCH_TRAINER_ROUNDS=3: memopt and eager alternate three times, kept quietly; each is printed once, the
# round with the median tokens/s, and the ratio carries each round's pair ratio
import os
os.environ["BENCH_TRAINER_ROUNDS"] = "3"
try:
    seen, speeds = [], {"memopt": iter([2000, 1500, 2500]), "pytorch": iter([1000, 1400, 1200])}
    def round_call(cmd, env=None, stdout="last"):
        impl = "pytorch_compile" if "--compile" in cmd else "pytorch" if cmd[0] == "py" else cmd[cmd.index("--impl") + 1]
        seen.append(impl)
        if impl not in speeds:
            return (1, "")
        t = next(speeds[impl])
        return (0, json.dumps({"name": "n", "impl": impl, "tokens_per_s": t, "peak_rss_mib": 4, "step_ms_min": 1e6 / t,
                               "step_ms": 1e6 / t, **json.loads("{" + shape + "}")}))
    printed.clear()
    ctx2 = core.Context(root=ROOT, python="py", quick=False, dry_run=False, emit_line=printed.append)
    ctx2.call = round_call
    steps = [s for s in SUITES["trainer"](ctx2) if not isinstance(s, ST.Build)]
    steps = steps[:next(i for i, s in enumerate(steps) if isinstance(s, ST.Run) and "--compile" in s.cmd) + 1]
    with contextlib.redirect_stderr(io.StringIO()):
        ST.run_steps(ctx2, steps)
    assert seen == ["memopt", "pytorch"] * 3 + ["pytorch_compile"], seen
    got = [json.loads(l) for l in printed]
    assert [g["impl"] for g in got] == ["memopt", "pytorch", "ratio"], got
    assert got[0]["tokens_per_s"] == 2000 and got[0]["tokens_per_s_rounds"] == [2000, 1500, 2500], got[0]
    assert got[1]["tokens_per_s"] == 1200 and got[1]["rounds"] == 3, got[1]
    assert got[2]["tokens_per_s"] == 2000 / 1200 and got[2]["tokens_per_s_by_round"] == [2.0, 1.0714, 2.0833], got[2]
    os.environ["BENCH_TRAINER_ROUNDS"] = "two"
    assert R.main(["--check-args", "trainer"]) == 2
finally:
    del os.environ["BENCH_TRAINER_ROUNDS"]

# BENCH_TRAINER_CONFIGS: shell patterns pick configurations; one that matches none is a usage error naming it
def trainer_logs():
    c = core.Context(root=ROOT, python="py", quick=False, dry_run=False, emit_line=printed.append)
    return [s.message.split(":")[0] for s in SUITES["trainer"](c) if isinstance(s, ST.Log) and s.message.startswith("trainer ")]
assert len(trainer_logs()) == 9  # 8 configurations and the hand-written loop's overhead run
try:
    os.environ["BENCH_TRAINER_CONFIGS"] = "*-fp32-*, large-bf16-every"
    assert trainer_logs() == ["trainer small fp32 recompute=none", "trainer overhead", "trainer small fp32 recompute=every",
                              "trainer large fp32 recompute=none", "trainer large fp32 recompute=every",
                              "trainer large bf16 recompute=every"], trainer_logs()
    assert R.main(["--check-args", "trainer"]) == 0
    os.environ["BENCH_TRAINER_CONFIGS"] = "*-fp32-*,huge"
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert R.main(["--check-args", "trainer"]) == 2
    assert "BENCH_TRAINER_CONFIGS: 'huge' matches no configuration" in err.getvalue(), err.getvalue()
    assert "small-fp32-none" in err.getvalue() and "HINT" in err.getvalue()
finally:
    del os.environ["BENCH_TRAINER_CONFIGS"]
print("all unit checks passed")


# ---- part 2: suites with fake runs ----
from pathlib import Path
from bench import core, lines as L, summaries as S, steps as ST
from bench.suites import SUITES, moe as M

tmp = Path(tempfile.mkdtemp())
(tmp / "bench-distill" / "none").mkdir(parents=True)
summ = {"event": "summary", "peak_tracked_mib": 10.04, "peak_rss_mib": 20.06, "tokens_per_s": 30.05, "steps": 1}
for impl in ("none", "simple", "comprehensive", "comprehensive_fp32"):
    (tmp / "bench-distill" / impl).mkdir(parents=True, exist_ok=True)
printed = []
ctx = core.Context(root=ROOT, python="py", quick=True, dry_run=False, emit_line=printed.append)
ctx.build_dir  # property; point it at tmp
core.Context.build_dir = property(lambda self: tmp)
calls = []
def fake_call(cmd, env=None, stdout="last"):
    calls.append(cmd)
    out = Path(cmd[cmd.index("--output_dir") + 1])
    if out.name == "init": return 0, ""
    out.mkdir(parents=True, exist_ok=True)
    if out.name != "simple":  # simple leaves no summary: its line cannot be made
        (out / "metrics.jsonl").write_text('{"event":"step"}\n' + json.dumps({**summ, "tokens_per_s": 30.05 * (2 if out.name == "none" else 1)}, separators=(",", ":")) + "\n")
    return (1 if out.name == "comprehensive_fp32" else 0), ""
ctx.call = fake_call
steps = [s for s in SUITES["distill"](ctx) if not isinstance(s, (ST.Build, ST.Corpus))]
with contextlib.redirect_stderr(io.StringIO()) as err:
    ST.run_steps(ctx, steps)
got = [json.loads(l) for l in printed]
assert [g["impl"] for g in got] == ["none", "comprehensive", "comprehensive_levers", "ratio_comprehensive_to_none",
                                   "ratio_comprehensive_levers_to_none"], got
assert list(got[0]) == ["suite", "name", "impl", "peak_tracked_mib", "peak_rss_mib", "tokens_per_s", "steps", "load_avg_1m"]
assert got[3]["tokens_per_s"] == 0.501 and ctx.failures == 2, (got, ctx.failures)
e = err.getvalue()
assert "error: distill simple failed" in e and "error: distill comprehensive_fp32 failed" in e and "FileNotFoundError" in e, e

# a fatal run ends the suite
printed.clear(); ctx.failures = 0
ctx.call = lambda cmd, env=None, stdout="last": (3, "")
with contextlib.redirect_stderr(io.StringIO()) as err:
    ST.run_steps(ctx, steps)
assert ctx.failures == 1 and "could not create the teacher" in err.getvalue() and not printed

# within_budget, last number
(tmp / "v").mkdir()
(tmp / "v" / "metrics.jsonl").write_text('{"peak_rss_mib":100.5}\n{"peak_rss_mib":2048.5,"x":1}\n')
assert M.within(tmp / "v", "2") == "false" and M.within(tmp / "v", "4") == "true" and M.within(tmp / "w", "2") == ""
# a verified run over its budget: the next micro-batch scales the per-sequence part (intercept 500)
assert M.corrected_micro(62, "4548.7", 4096.0, 500.0) == 55  # 62 x 3596 / 4048.7
assert M.corrected_micro(62, "4000", 4096.0, 500.0) is None and M.corrected_micro(62, "", 4096.0, 500.0) is None
assert M.corrected_micro(1, "9000", 4096.0, 500.0) is None  # nothing smaller to try

# a derived line that raises is a failure, not a crash
ctx.failures = 0
with contextlib.redirect_stderr(io.StringIO()):
    ST.Derive(["a", "b"], lambda a, b: a["x"] / b["x"], "boom").run(ctx, {"a": '{"x":1}', "b": '{"x":0}'})
assert ctx.failures == 1

# tee and kept line
lines = {}
ctx.call = lambda cmd, env=None, stdout="last": (0, '{"name":"none-fp32"}')
ST.Run(["x"], key="k", tee=tmp / "t.jsonl").run(ctx, lines)
assert (tmp / "t.jsonl").read_text() == '{"name":"none-fp32"}\n' and lines["k"] == '{"name":"none-fp32"}'

# data summary
d = S.data_summary({"trainer": json.dumps({"tokens_per_s_best": 1000.0}),
                    "throughput-w2": json.dumps({"tokens_per_s": 20000.0}),
                    "stream-small": json.dumps({"corpus_gib": 0.25, "rss_growth_mib": 10.0}),
                    "stream-large": json.dumps({"corpus_gib": 1.0, "rss_growth_mib": 11.0})})
assert [x["name"] for x in d] == ["throughput_vs_consumption", "rss_growth"] and d[0]["met"] and d[1]["met"]

# load summary: each side's fastest round and highest peak, the 1.1x target, the same weights on both sides
from bench.suites import load as LD
def load_line(impl, s, peak, checksum=1.0):
    return json.dumps({"impl": impl, "ckpt_bytes": 100, "params": 50, "load_s": s, "ready_s": 2 * s, "init_s": 0.5,
                       "ready_peak_rss_growth_bytes": peak, "checksum": checksum})
d = LD.load_summary({"memopt#1": load_line("memopt", 2.0, 104), "transformers#1": load_line("transformers", 1.0, 105),
                     "memopt#2": load_line("memopt", 1.0, 108), "transformers#2": load_line("transformers", 2.0, 100)}, "x")
assert d["load_s"] == 1.0 and d["ready_s"] == 1.0 and d["rounds"] == 2, d
assert d["memopt_peak_to_ckpt"] == 1.08 and d["peak_rss_growth"] == 1.029 and d["met"] and d["same_weights"], d
d = LD.load_summary({"memopt#1": load_line("memopt", 1.0, 111, 2.0), "transformers#1": load_line("transformers", 1.0, 100)}, "x")
assert not d["met"] and not d["same_weights"], d
assert LD.load_summary({"memopt#1": load_line("memopt", 1.0, 100)}, "x") is None  # transformers' runs failed
# the generated checkpoint is reused while its stamp records the same options
g = LD.GenerateCheckpoint(tmp / "ckpt", ["--vocab", "8"])
assert not g.current()
(tmp / "ckpt").mkdir()
(tmp / "ckpt" / LD.STAMP).write_text("--vocab 8\n")
assert g.current() and not LD.GenerateCheckpoint(tmp / "ckpt", ["--vocab", "9"]).current()
print("more unit checks passed")

# ---- every Derive reads lines its suite's Runs make (a key that no Run makes drops the ratio silently) ----
for quick in (False, True):
    c = core.Context(root=ROOT, python="py", quick=quick, dry_run=True, emit_line=lambda _: None)
    for name, suite in SUITES.items():
        suite_steps = suite(c)
        made = {s.key for s in suite_steps if isinstance(s, ST.Run)}
        for s in suite_steps:
            if isinstance(s, ST.Derive):
                assert set(s.keys) <= made, (name, quick, s.what, sorted(set(s.keys) - made))

# ---- every suite's --dry-run, full and --quick: prints commands, exits 0 ----
for extra in ([], ["--quick"]):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--dry-run", *extra, "all"],
                         capture_output=True, text=True, check=True).stdout
    for suite in ("trainer", "attention", "dist", "collectives"):
        assert f"# ---- suite: {suite} ----" in out, (extra, suite)
print("bench_driver_test: all checks passed")
