#!/usr/bin/env bash
# memopt-pretokenize's command line: bad flags and bad input exit non-zero with a message that
# names the flag or file (and, for memopt's own errors, a HINT); a JSONL + text corpus becomes
# >= 3 shards, byte-identical for --workers 1 and 3, with a progress line on stderr (a line when
# stderr is not a terminal, a bar redrawn in place when it is) and a summary line on stdout; an
# existing --out needs --force. Exits 77 (ctest: skipped) after the cases that need no tokenizer
# when data/kjv/tokenizer.model is missing (scripts/demo makes it).
# Usage: pretokenize_test.sh path/to/memopt-pretokenize REPOSITORY_ROOT
set -uo pipefail
bin="$1"
root="$2"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }

expect_error() {  # expect_error NAME REGEX ARGS...: exit code != 0, output matches REGEX
  local name="$1" regex="$2"
  shift 2
  local out rc
  out=$("$bin" "$@" 2>&1)
  rc=$?
  if [ "$rc" -eq 0 ]; then
    fail "$name: exit code 0. Output: $out"
  elif ! grep -Eq -- "$regex" <<<"$out"; then
    fail "$name: output does not match /$regex/: $out"
  else
    echo "ok   $name: $(head -c 200 <<<"$out")"
  fi
}
expect_hint() {  # like expect_error, and exit code 1 with "error: ... HINT: ..."
  local name="$1" regex="$2"
  shift 2
  local out rc
  out=$("$bin" "$@" 2>&1)
  rc=$?
  if [ "$rc" -ne 1 ] || ! grep -Eq -- "$regex" <<<"$out" || ! grep -q "^error: .*HINT: " <<<"$out"; then
    fail "$name: exit code $rc (want 1), output should match /$regex/ with a HINT: $out"
  else
    echo "ok   $name: $(head -c 200 <<<"$out")"
  fi
}

printf 'a line\n' >"$tmp/a.txt"
expect_error "no arguments" "sources|--tokenizer|required"
expect_error "--split bogus" "split" "$tmp/a.txt" --tokenizer x --out "$tmp/o" --split bogus
expect_hint "missing tokenizer" "--tokenizer '$tmp/nope.model' does not exist" "$tmp/a.txt" --tokenizer "$tmp/nope.model" --out "$tmp/o"
[ -e "$tmp/o" ] && fail "a failed run created --out"

model="$root/data/kjv/tokenizer.model"
if [ ! -f "$model" ]; then
  echo "skip: $model is missing (scripts/demo makes it); the cases below need a tokenizer"
  [ "$failures" -eq 0 ] && exit 77
  exit 1
fi

# ---- a corpus: 3 JSONL files and a text file cut from data/kjv/val.txt ----
mkdir -p "$tmp/corpus"
head -n 600 "$root/data/kjv/val.txt" | python3 -c '
import json, sys
lines = sys.stdin.read().splitlines()
for part in range(3):
    with open(sys.argv[1] + "/part-%d.jsonl" % part, "w") as f:
        for i, line in enumerate(lines[part * 150:(part + 1) * 150]):
            f.write(json.dumps({"id": i, "text": line}) + "\n")
' "$tmp/corpus"
sed -n '451,600p' "$root/data/kjv/val.txt" >"$tmp/corpus/rest.txt"

printf '\n  \n\n' >"$tmp/blank.txt"
expect_hint "no document in the sources" "no (non-blank )?document" "$tmp/blank.txt" --tokenizer "$model" --out "$tmp/o"
[ -e "$tmp/o/index.json" ] && fail "a run without documents wrote index.json"

run() {  # run OUT WORKERS [ARGS...]: stdout to OUT.stdout, stderr to OUT.stderr
  local out="$1" workers="$2"
  shift 2
  "$bin" "$tmp/corpus" --tokenizer "$model" --out "$out" --shard_tokens 5000 --block_documents 16 \
    --workers "$workers" "$@" >"$out.stdout" 2>"$out.stderr"
}
run "$tmp/w1" 1 || fail "--workers 1: exit code $? ($(cat "$tmp/w1.stderr"))"
run "$tmp/w3" 3 || fail "--workers 3: exit code $? ($(cat "$tmp/w3.stderr"))"
shards=$(ls "$tmp/w1"/shard-*.bin 2>/dev/null | wc -l)
[ "$shards" -ge 3 ] || fail "expected >= 3 shards, got $shards"
for f in "$tmp/w1"/shard-*.bin "$tmp/w1/index.json"; do
  cmp -s "$f" "$tmp/w3/$(basename "$f")" || fail "$(basename "$f") differs between --workers 1 and 3"
done
[ "$(ls "$tmp/w3" | wc -l)" -eq "$(ls "$tmp/w1" | wc -l)" ] || fail "--workers 1 and 3 wrote different files"
echo "ok   $shards shards, byte-identical for --workers 1 and 3"
summary=$(cat "$tmp/w3.stdout")
if grep -Eq "^memopt-pretokenize: 600 documents, [0-9]+ tokens, $shards shards in [0-9.]+ s \([0-9]+ tokens/s" <<<"$summary"; then
  echo "ok   summary: $summary"
else
  fail "summary line: '$summary'"
fi
if grep -Eq "^\[#+\] 100\.0% \| [0-9.]+/[0-9.]+ MB \| 600 documents \| [0-9]+ tokens \| [0-9.]+ MB/s \| ETA" "$tmp/w3.stderr"; then
  echo "ok   progress (not a terminal): $(tail -n 1 "$tmp/w3.stderr")"
else
  fail "progress line on stderr: '$(cat "$tmp/w3.stderr")'"
fi
python3 - "$tmp/w1/index.json" "$shards" <<'EOF' || fail "index.json fields"
import json, sys
index = json.load(open(sys.argv[1]))
assert index["format"] == "memopt-token-shards" and index["version"] == 1, index
assert len(index["tokenizer_xxh3"]) == 16 and int(index["tokenizer_xxh3"], 16) >= 0
assert index["documents"] == 600 and len(index["shards"]) == int(sys.argv[2])
assert sum(s["tokens"] for s in index["shards"]) == index["tokens"]
assert sum(s["documents"] for s in index["shards"]) == index["documents"]
assert [s["file"] for s in index["shards"]] == ["shard-%05d.bin" % i for i in range(len(index["shards"]))]
assert len(index["sources"]) == 4 and index["sources"][-1].endswith("rest.txt")
EOF

# ---- an existing --out, --force, --quiet ----
expect_hint "existing --out" "exists and is not empty.*--force" "$tmp/corpus" --tokenizer "$model" --out "$tmp/w1"
run "$tmp/w1" 2 --force --quiet || fail "--force: exit code $? ($(cat "$tmp/w1.stderr"))"
[ -s "$tmp/w1.stderr" ] && fail "--quiet printed on stderr: $(cat "$tmp/w1.stderr")"
cmp -s "$tmp/w1/index.json" "$tmp/w3/index.json" || fail "--force wrote another index.json"
echo "ok   --force --quiet"

# ---- bad input ----
touch "$tmp/file"
expect_hint "unwritable --out" "cannot create --out '$tmp/file/out'" "$tmp/corpus" --tokenizer "$model" --out "$tmp/file/out"
printf '{"text": "one"}\n{"text": "two"}\n{"body": "three"}\n' >"$tmp/bad.jsonl"
expect_hint "JSONL record without the field" "bad.jsonl:3: the record has no field \"text\"" "$tmp/bad.jsonl" --tokenizer "$model" --out "$tmp/bad"
[ -e "$tmp/bad/index.json" ] && fail "a failed run wrote index.json"
expect_hint "a shard as a source" "already a token shard" "$tmp/w1" --tokenizer "$model" --out "$tmp/again"
expect_hint "--shard_tokens 0" "--shard_tokens must be >= 1" "$tmp/corpus" --tokenizer "$model" --out "$tmp/z" --shard_tokens 0

# ---- on a terminal (script(1) gives it one): the bar is redrawn in place ----
if command -v script >/dev/null; then
  script -qec "'$bin' '$tmp/corpus' --tokenizer '$model' --out '$tmp/tty' --workers 2" /dev/null >"$tmp/tty.log" 2>&1
  if grep -q $'\r\[#' "$tmp/tty.log" && grep -q $'\x1b\[K' "$tmp/tty.log"; then
    echo "ok   progress on a terminal: redrawn with \\r and erase-to-end-of-line"
  else
    fail "progress on a terminal: $(od -c "$tmp/tty.log" | head -5)"
  fi
fi

[ "$failures" -eq 0 ] && echo "pretokenize_test: all passed"
[ "$failures" -eq 0 ]
