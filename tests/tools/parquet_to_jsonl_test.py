#!/usr/bin/env python3
"""tests/tools/parquet_to_jsonl_test.py SCRIPT — tools/parquet/parquet_to_jsonl.py: Parquet files
written here by pyarrow (several row groups, Unicode, emoji, CJK, newlines and tabs inside a
document, an empty document, nulls, a large_string column) become JSONL whose records are the
column's strings in order, each a line memopt's JSONL reader takes ({"text": ...}); nulls are
skipped and counted, or refused with --nulls error; a missing column, a non-string column, a
file that is not Parquet, a missing file and an existing --out each exit 1 naming what is wrong
with a HINT, and leave no output behind.
"""
import json
import os
import subprocess
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq

SCRIPT = sys.argv[1]
failures = 0


def check(ok, what):
    global failures
    print(("ok   " if ok else "FAIL ") + what)
    failures += 0 if ok else 1


def run(*args):
    p = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def expect_error(name, args, parts, out=None):
    rc, text = run(*args)
    good = rc == 1 and "HINT: " in text and all(p in text for p in parts)
    check(good and (out is None or not os.path.exists(out)), f"{name}: exit {rc}: {text.strip()[:200]}")


with tempfile.TemporaryDirectory() as tmp:
    first = ["In the beginning", "über naïve café", "emoji 🙂👍 and 中文字符", "", "two\nlines\tand a tab",
             None, "quote \" and backslash \\"]
    second = [f"document {i}" for i in range(25)]
    a, b = os.path.join(tmp, "a.parquet"), os.path.join(tmp, "b.parquet")
    pq.write_table(pa.table({"id": list(range(len(first))), "text": first}), a, row_group_size=3)
    pq.write_table(pa.table({"text": pa.array(second, type=pa.large_string())}), b, row_group_size=10)
    out = os.path.join(tmp, "out.jsonl")

    rc, text = run(a, b, "--out", out, "--batch_rows", "4")
    records = [json.loads(line) for line in open(out, encoding="utf-8")] if rc == 0 else []
    want = [t for t in first if t is not None] + second
    check(rc == 0 and [r["text"] for r in records] == want and all(list(r) == ["text"] for r in records),
          f"two files, 5 row groups, batches of 4: {len(records)} records equal the column in order")
    check("31 documents from 2 file(s)" in text and "1 null row(s) skipped" in text, f"summary: {text.strip()}")
    raw = open(out, encoding="utf-8").read()
    check(raw.count("\n") == len(want) and "🙂" in raw, "one record a line (newlines escaped), UTF-8 kept as is")

    expect_error("an existing --out", [a, "--out", out], ["--out", "exists", "--force"])
    rc, _ = run(a, "--out", out, "--force")
    check(rc == 0 and sum(1 for _ in open(out)) == len([t for t in first if t is not None]), "--force overwrites")

    bad_out = os.path.join(tmp, "bad.jsonl")
    expect_error("--nulls error", [a, "--out", bad_out, "--nulls", "error"], [a, "row 5", "'text'", "null"], bad_out)
    expect_error("missing column", [a, "--out", bad_out, "--column", "content"],
                 [a, "no column 'content'", "id, text", "--column"], bad_out)
    expect_error("non-string column", [a, "--out", bad_out, "--column", "id"], [a, "'id'", "int64"], bad_out)
    not_parquet = os.path.join(tmp, "c.parquet")
    open(not_parquet, "w").write("text,id\nhello,1\n")
    expect_error("not Parquet", [a, not_parquet, "--out", bad_out], [not_parquet, "not a readable Parquet"], bad_out)
    expect_error("missing file", [os.path.join(tmp, "none.parquet"), "--out", bad_out], ["none.parquet",
                 "does not exist"], bad_out)
    check(not os.path.exists(bad_out + ".tmp"), "no .tmp left behind")

print(f"parquet_to_jsonl: {failures} failure(s)")
sys.exit(1 if failures else 0)
