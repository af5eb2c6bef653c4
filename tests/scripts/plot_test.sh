#!/usr/bin/env bash
# scripts/plot: a small metrics.jsonl becomes a PNG (the default name and an explicit one);
# bad input — a missing file, no "train" line, no gnuplot, no argument — exits non-zero
# with a message that ends with a HINT. Exits 77 (ctest: skipped) after the error cases
# when gnuplot is not installed.
# Usage: plot_test.sh path/to/scripts/plot
set -uo pipefail
plot="$1"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export XDG_CACHE_HOME="$tmp/cache"  # compile the driver afresh: the test sees the current plot.hpp
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }

expect_error() {  # expect_error NAME RC REGEX ARGS... (env vars before the call apply)
  local name="$1" want="$2" regex="$3"
  shift 3
  local out rc
  out=$("$plot" "$@" 2>&1)
  rc=$?
  if [ "$rc" -ne "$want" ]; then
    fail "$name: exit code $rc (want $want). Output: $out"
  elif ! grep -Eq "$regex" <<<"$out" || { [ "$want" -eq 1 ] && ! grep -q "HINT: " <<<"$out"; }; then
    fail "$name: output does not match /$regex/ (and a HINT): $out"
  else
    echo "ok   $name: $(head -c 200 <<<"$out")"
  fi
}

is_png() { [ "$(head -c 8 "$1" 2>/dev/null | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ]; }

# A run's file: a start line, train lines (one with a non-finite loss written as null, as
# nlohmann::json writes inf), a line cut by a crash, a summary.
{
  echo '{"event":"start","strategy":"x"}'
  for step in 5 10 15 20 25 30; do
    loss=$(awk -v s="$step" 'BEGIN { printf "%.4f", 2 + 6 * exp(-s / 12) }')
    echo "{\"event\":\"train\",\"step\":$step,\"max_steps\":30,\"loss\":$loss,\"tracked_mib\":$((40 + step)),\"peak_mib\":95.5,\"rss_mib\":$((300 + step)),\"peak_rss_mib\":340,\"skipped_steps\":0}"
  done
  echo '{"event":"train","step":32,"loss":null,"tracked_mib":70}'
  echo '{"event":"train","step":35,"lo'
  echo '{"event":"summary","steps":30}'
} > "$tmp/metrics.jsonl"
echo '{"event":"summary","steps":0}' > "$tmp/no_train.jsonl"

expect_error missing_file 1 "cannot read '.*nope.jsonl'" "$tmp/nope.jsonl"
expect_error no_train_lines 1 'has no "train" line' "$tmp/no_train.jsonl"
MEMOPT_GNUPLOT=/nonexistent/gnuplot expect_error no_gnuplot 1 "'/nonexistent/gnuplot' was not found.*gnuplot-nox" \
  "$tmp/metrics.jsonl" "$tmp/never.png"
[ -e "$tmp/never.png" ] && fail "no_gnuplot: a PNG was written"
expect_error no_argument 2 "usage: scripts/plot METRICS.jsonl"

if ! command -v gnuplot >/dev/null; then
  echo "SKIP the drawing: gnuplot is not installed. HINT: apt-get install gnuplot-nox (or scripts/deps core)"
  [ "$failures" -eq 0 ] && exit 77
  exit 1
fi

out=$("$plot" "$tmp/metrics.jsonl" 2>&1) || fail "default output: exit code $? ($out)"
grep -q "wrote $tmp/metrics.png (7 points, steps 5..32)" <<<"$out" || fail "default output: unexpected message: $out"
is_png "$tmp/metrics.png" && echo "ok   default output: $out" || fail "default output: $tmp/metrics.png is not a PNG"

mkdir -p "$tmp/out"
out=$("$plot" "$tmp/metrics.jsonl" "$tmp/out/loss and memory.png" 2>&1) || fail "explicit output: exit code $? ($out)"
is_png "$tmp/out/loss and memory.png" && echo "ok   explicit output (a name with spaces)" ||
  fail "explicit output: not a PNG ($out)"
expect_error output_folder_missing 1 "cannot write .*x.png.: the folder .*/no/such/dir. does not exist" \
  "$tmp/metrics.jsonl" "$tmp/no/such/dir/x.png"

[ "$failures" -eq 0 ] && echo "all scripts/plot cases passed" || echo "$failures scripts/plot case(s) failed"
[ "$failures" -eq 0 ]
