# tests/examples/lib.sh — sourced by the example tests (after `set -uo pipefail`): a temporary
# folder $tmp removed at exit, pass/fail counters (ok, fail, finish), tiny corpora in the
# Brown corpus's and the King James text's formats for memopt_prepare_corpus, readers of
# memory figures, and tiny Hugging Face checkpoints (hf_python, hf_checkpoint).
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
passed=0

fail() { echo "FAIL $1"; failures=$((failures + 1)); }
ok() { echo "ok   $1"; passed=$((passed + 1)); }
skipped=0
finish() {  # the summary line; the exit status of the script
  echo "$passed passed, $failures failed, $skipped skipped"
  [ "$failures" -eq 0 ]
}
# has_gpu: whether a CUDA GPU is visible (the --device cuda runs need one).
has_gpu() { nvidia-smi -L > /dev/null 2>&1; }
# skip_runs N WHAT: N runs not made (counted in the summary line), and why.
skip_runs() { echo "skip $1 $2: no GPU visible"; skipped=$((skipped + $1)); }

# hf_python N WHAT: sets hf_py to a Python with torch, transformers and tokenizers, which the
# Hugging Face cases need (hf_checkpoint.py makes their checkpoint): $MEMOPT_TEST_PYTHON, else the
# repository's .venv, else python3 on PATH. Without one it prints a skip line for the N runs WHAT,
# counts them as skipped and returns 1.
hf_python() {
  local candidate
  for candidate in "${MEMOPT_TEST_PYTHON:-}" "$(dirname "${BASH_SOURCE[0]}")/../../.venv/bin/python3" python3; do
    if [ -n "$candidate" ] && "$candidate" -c "import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ('torch', 'transformers', 'tokenizers', 'safetensors')))" > /dev/null 2>&1
    then
      hf_py="$candidate"
      return 0
    fi
  done
  echo "skip $1 $2: no Python with torch, transformers and tokenizers (set MEMOPT_TEST_PYTHON)"
  skipped=$((skipped + $1))
  return 1
}
# hf_checkpoint OUT ARGS...: hf_checkpoint.py OUT ARGS... (a tiny Hugging Face Llama folder with its
# tokenizer.json) with $hf_py; its output in OUT.log. Fails the test (FAIL line, returns 1) when it fails.
hf_checkpoint() {
  local out="$1"
  shift
  if ! "$hf_py" "$(dirname "${BASH_SOURCE[0]}")/hf_checkpoint.py" "$out" "$@" > "$out.log" 2>&1; then
    fail "hf_checkpoint.py could not make $out: $(tail -3 "$out.log")"
    return 1
  fi
}
# close_to X Y TOL: whether |X - Y| <= TOL (decimals; false when either is empty).
close_to() { [ -n "$1" ] && [ -n "$2" ] && awk -v x="$1" -v y="$2" -v t="$3" 'BEGIN { d = x - y; if (d < 0) d = -d; exit !(d <= t) }'; }

# expect_failure NAME REGEX CMD...: CMD exits 1, and its output matches REGEX and carries a HINT
# (the rule for bad input); the ok line quotes the first line naming an error.
expect_failure() {
  local name="$1" regex="$2" out rc
  shift 2
  out=$("$@" 2>&1)
  rc=$?
  if [ "$rc" -ne 1 ]; then
    fail "$name: exit code $rc (want 1). Output: $out"
  elif ! grep -Eq -e "$regex" <<<"$out" || ! grep -q "HINT" <<<"$out"; then
    fail "$name: output does not match /$regex/ and HINT: $out"
  else
    ok "$name: $({ grep -m1 -i error <<<"$out" || head -n1 <<<"$out"; } | head -c 160)"
  fi
}

# table_peak TEXT: the figure of the "  peak N MiB" line of a memory estimate table.
table_peak() { sed -n 's/^  peak *\([0-9.]*\) MiB.*/\1/p' <<<"$1"; }
# run_peak DIR: the last peak_tracked_mib in DIR/metrics.jsonl.
run_peak() { grep -o '"peak_tracked_mib":[0-9.]*' "$1/metrics.jsonl" 2>/dev/null | tail -1 | cut -d: -f2; }
# ratio_between X REF LOW HIGH: whether LOW·REF <= X <= HIGH·REF (decimals).
ratio_between() { awk -v x="$1" -v r="$2" -v lo="$3" -v hi="$4" 'BEGIN { exit !(x >= lo * r && x <= hi * r) }'; }

# within_budget NAME RC OUTPUT MEASURED BUDGET TOLERANCE PATTERN: a planned run — exit 0, a line
# matching PATTERN ("^chose ", "^calibrated: "), a measured peak (MiB) at most TOLERANCE × BUDGET.
within_budget() {
  local name="$1" rc="$2" out="$3" measured="$4" budget="$5" tolerance="$6" pattern="$7"
  if [ "$rc" -ne 0 ] || ! grep -q "$pattern" <<<"$out" || [ -z "$measured" ] \
     || ! ratio_between "$measured" "$budget" 0 "$tolerance"; then
    fail "$name under $budget MiB: measured '$measured': $out"
  else
    ok "$name under $budget MiB: $(grep -m1 "$pattern" <<<"$out" | head -c 120); measured $measured MiB"
  fi
}

# Writes files c<genre><NN> of tab-indented word/tag sentences; the same arguments give the
# same bytes.
#   brown_corpus DIR GENRES DOCS WORDS OFFSET
#     GENRES: genre letters ("a" or "a b c"); DOCS: documents per genre (named 01, 02, …); WORDS: words per
#     sentence (20 sentences a document); OFFSET: added to every word index.
# brown_words holds the 16 words it draws from.
brown_words=(the quick brown fox jumps over a lazy dog while memory models train tokens fast slow)
brown_corpus() {
  local dir="$1" genres="$2" docs="$3" nwords="$4" offset="$5" g f l w line
  mkdir -p "$dir"
  for g in $genres; do
    for f in $(seq -f %02g 1 "$docs"); do
      for l in $(seq 1 20); do
        line=""
        for w in $(seq 1 "$nwords"); do line+="${brown_words[$(( (10#$f * 7 + l * 3 + w * 5 + offset) % 16 ))]}/nn "; done
        printf '\t%s./.\n' "$line"
      done > "$dir/c$g$f"
    done
  done
}

# Writes DIR/kjv.txt in `bible -f`'s format ("Ge1:1 the quick fox ... ."): for each book, chapters
# 1..CHAPTERS of verses 1..VERSES of WORDS words; the same arguments give the same bytes.
#   kjv_corpus DIR BOOKS CHAPTERS VERSES WORDS OFFSET
#     BOOKS: book abbreviations ("Ge Exo 1Sm"); OFFSET: added to every word index.
# The words are brown_words's.
kjv_corpus() {
  local dir="$1" books="$2" chapters="$3" verses="$4" nwords="$5" offset="$6" b=0 book c v w line
  mkdir -p "$dir"
  for book in $books; do
    b=$((b + 1))
    for c in $(seq 1 "$chapters"); do
      for v in $(seq 1 "$verses"); do
        line=""
        for w in $(seq 1 "$nwords"); do line+=" ${brown_words[$(( (b * 11 + c * 7 + v * 3 + w * 5 + offset) % 16 ))]}"; done
        printf '%s%d:%d%s.\n' "$book" "$c" "$v" "$line"
      done
    done
  done > "$dir/kjv.txt"
}

# tiny_data PREPARE DIR: brown_corpus's 30 documents of genre a, prepared by PREPARE
# (memopt_prepare_corpus) into DIR (token shards + a 120-piece tokenizer); the test stops
# with a FAIL line when that fails.
tiny_data() {
  brown_corpus "$tmp/raw" a 30 8 0
  if ! "$1" --corpus brown --raw "$tmp/raw" --out "$2" --vocab 120 --heldout_every 5 > /dev/null 2>&1; then
    echo "FAIL memopt_prepare_corpus could not prepare the test corpus"
    exit 1
  fi
}
