#!/usr/bin/env bash
# Runs memopt_dist_tests as two (or RANKS) ranks on loopback (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as
# torchrun would set them, without torchrun), one thread each, sharing a scratch folder.
# Passes when every rank passes. Usage: dist_test.sh path/to/memopt_dist_tests [CATCH FILTER [RANKS]]
set -uo pipefail
bin="$1"
filter="${2:-[dist]}"
ranks="${3:-2}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
port=$(( 20000 + RANDOM % 30000 ))
for rank in $(seq 0 $((ranks - 1))); do
  RANK=$rank WORLD_SIZE=$ranks LOCAL_RANK=$rank MASTER_ADDR=127.0.0.1 MASTER_PORT=$port MEMOPT_TEST_DIR="$tmp" \
    OMP_NUM_THREADS=1 MEMOPT_DIST_TIMEOUT=60 timeout 600 "$bin" "$filter" > "$tmp/rank$rank.log" 2>&1 &
  pids[$rank]=$!
done
status=0
for rank in $(seq 0 $((ranks - 1))); do
  wait "${pids[$rank]}" || status=1
done
for rank in $(seq 0 $((ranks - 1))); do
  echo "---- rank $rank ----"
  if [ "$status" -ne 0 ]; then cat "$tmp/rank$rank.log"; else tail -n 3 "$tmp/rank$rank.log"; fi
done
exit "$status"
