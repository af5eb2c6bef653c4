#!/usr/bin/env python3
"""tools/parquet/parquet_to_jsonl.py — Parquet files with a text column as one JSONL file that
memopt reads (memopt-pretokenize, the streaming loader: one {"text": ...} object a line).

No C++ Parquet reader is packaged for this machine (Debian bookworm), so Parquet reaches memopt
through this conversion with PyPI's pyarrow (pinned in requirements.txt, in .venv). It streams
each file a record batch at a time, so memory stays at one batch whatever the file's size.

  .venv/bin/python3 tools/parquet/parquet_to_jsonl.py data/*.parquet --out data/train.jsonl
  .venv/bin/python3 tools/parquet/parquet_to_jsonl.py web.parquet --column content --nulls error --out web.jsonl

Rows whose text is null are skipped and counted (--nulls error stops at the first, naming it).
The output appears only when every input converted (written to OUT.tmp, then renamed).
Errors name the file, the column or row and the value seen, with a HINT; exit status 1.
"""
import argparse
import json
import os
import sys


class ConversionError(Exception):
    pass


def fail(message, hint):
    raise ConversionError(f"{message}. HINT: {hint}")


def open_parquet(path):
    import pyarrow.parquet as pq
    if not os.path.isfile(path):
        fail(f"'{path}' does not exist", "pass Parquet files (or a glob the shell expands)")
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for files that are not Parquet
        fail(f"'{path}' is not a readable Parquet file ({type(e).__name__}: {e})",
             "check that the file is complete and is Parquet (magic 'PAR1' at both ends)")


def convert_file(path, column, nulls, batch_rows, out):
    import pyarrow as pa
    parquet = open_parquet(path)
    schema = parquet.schema_arrow
    if column not in schema.names:
        fail(f"'{path}' has no column '{column}' (it has: {', '.join(schema.names) or 'none'})",
             "name the text column with --column")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        fail(f"'{path}': column '{column}' holds {kind}, not strings",
             "pass the column that holds each document's text with --column")
    docs = skipped = row = 0
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=[column]):
        for text in batch.column(0).to_pylist():
            if text is None:
                if nulls == "error":
                    fail(f"'{path}': row {row} of column '{column}' is null",
                         "use --nulls skip to leave such rows out (they are counted)")
                skipped += 1
            else:
                out.write(json.dumps({"text": text}, ensure_ascii=False))
                out.write("\n")
                docs += 1
            row += 1
    return docs, skipped


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="Parquet files, converted in the order given")
    ap.add_argument("--out", required=True, help="the JSONL file to write")
    ap.add_argument("--column", default="text", help="the column holding each document's text (default: text)")
    ap.add_argument("--nulls", choices=["skip", "error"], default="skip", help="rows whose text is null")
    ap.add_argument("--batch_rows", type=int, default=8192, help="rows read at a time")
    ap.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    args = ap.parse_args(argv)
    try:
        try:
            import pyarrow  # noqa: F401
        except ImportError as e:
            fail(f"pyarrow is not installed ({e})", "run scripts/deps (requirements.txt installs pyarrow into .venv) "
                 "and use .venv/bin/python3")
        if args.batch_rows < 1:
            fail(f"--batch_rows must be >= 1 (got {args.batch_rows})", "8192 is a good size")
        if os.path.exists(args.out) and not args.force:
            fail(f"--out '{args.out}' exists", "pass --force to overwrite it, or another --out")
        tmp = args.out + ".tmp"
        docs = skipped = 0
        try:
            with open(tmp, "w", encoding="utf-8") as out:
                for path in args.inputs:
                    d, s = convert_file(path, args.column, args.nulls, args.batch_rows, out)
                    docs, skipped = docs + d, skipped + s
            os.replace(tmp, args.out)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    except ConversionError as e:
        sys.stderr.write(f"error: parquet_to_jsonl: {e}\n")
        return 1
    print(f"parquet_to_jsonl: {docs} documents from {len(args.inputs)} file(s) into '{args.out}'"
          f" ({skipped} null row(s) skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
