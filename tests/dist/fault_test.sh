#!/usr/bin/env bash
# Data-parallel faults and torchrun, with examples/00_llama_lm on a tiny generated corpus:
#   - a rank killed mid-run: the other exits with an error naming the lost rank, within 60 s;
#   - ZeRO-3 (--zero 3, shards offloaded to disk): a run ends with a whole model (evaluated,
#     sampled); its checkpoint resumed by one process is refused, naming both world sizes; host
#     offload of a CPU model is refused; a killed rank is named within 60 s as above, from
#     inside a block's collective;
#   - --zero auto: the planner picks ZeRO-3 where only it fits the budget, and the run trains
#     with it; without a budget, or with --calibrate, it is refused with a HINT;
#   - different model shapes on the ranks: both exit at start, naming the rank and the shapes;
#   - torchrun (scripts/launch) with LAUNCH_MAX_RESTARTS=1, --save_every and --resume latest:
#     a worker killed after a checkpoint is restarted with the others, the job resumes from the
#     last checkpoint and ends with the weights of an uninterrupted 2-rank run, byte for byte.
# Usage: fault_test.sh path/to/llama_lm path/to/memopt_prepare_corpus REPO_ROOT
set -uo pipefail
bin="$1"
prepare="$2"
root="$3"
source "$root/tests/examples/lib.sh"

tiny_data "$prepare" "$tmp/data"
job=(--data "$tmp/data" --layers 2 --dim 64 --heads 4 --seq_len 32 --micro_batch 4 --accum 2 --warmup 2
     --log_interval 1000 --eval_batches 1 --sample_tokens 1 --precision fp32 --checkpoint none)
port() { echo $(( 20000 + RANDOM % 30000 )); }
# rank R PORT ARGS...: one rank of a 2-rank job started by hand (the variables torchrun sets).
rank() {
  local r="$1" p="$2"
  shift 2
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$p MEMOPT_DIST_TIMEOUT=60 exec \
    "$bin" "$@"
}

# pair NAME ARGS...: a 2-rank job with ARGS (logs $tmp/NAME0.log and NAME1.log); sets rc0 and rc1.
pair() {
  local name="$1" p pid0
  shift
  p=$(port)
  rank 0 "$p" "${job[@]}" "$@" > "$tmp/${name}0.log" 2>&1 &
  pid0=$!
  (rank 1 "$p" "${job[@]}" "$@" > "$tmp/${name}1.log" 2>&1)
  rc1=$?
  wait "$pid0"
  rc0=$?
}

# killed NAME LABEL ARGS...: rank 1 of a job with ARGS is killed after it starts training; rank 0
# must exit with an error naming it within 60 s.
killed() {
  local name="$1" label="$2"
  shift 2
  local p pid0 pid1 rc start took
  p=$(port)
  rank 0 "$p" "${job[@]}" "$@" --steps 100000 --output_dir "$tmp/$name" > "$tmp/${name}0.log" 2>&1 &
  pid0=$!
  rank 1 "$p" "${job[@]}" "$@" --steps 100000 --output_dir "$tmp/$name" > "$tmp/${name}1.log" 2>&1 &
  pid1=$!
  until grep -q "^trainer:" "$tmp/${name}0.log" 2> /dev/null || ! kill -0 "$pid0" 2> /dev/null; do sleep 0.2; done
  sleep 2
  kill -9 "$pid1"
  start=$(date +%s)
  wait "$pid0"
  rc=$?
  took=$(( $(date +%s) - start ))
  if [ "$rc" -ne 0 ] && [ "$took" -le 60 ] && grep -q "lost rank(s): 1" "$tmp/${name}0.log"; then
    ok "${label}rank 1 killed: rank 0 exits $rc after ${took} s: $(grep -o 'memopt::dist: rank 0 of 2: .\{0,90\}' "$tmp/${name}0.log" | head -1)"
  else
    fail "${label}rank 1 killed: rank 0 exit $rc after ${took} s: $(tail -3 "$tmp/${name}0.log")"
  fi
}

# ---- a rank killed mid-run ----
killed kill ""

# ---- ZeRO-3: trains, ends whole; a rank killed mid-run is named (it blocks inside a block's all-gather) ----
z3=(--zero 3 --offload_params disk --offload_dir "$tmp/z3off" --steps 6 --save_every 3 --output_dir "$tmp/z3")
pair z3_ "${z3[@]}"
after=$(grep -o 'held-out loss after 6 steps [0-9.]*' "$tmp/z3_0.log")
if [ "$rc0" -eq 0 ] && [ "$rc1" -eq 0 ] && [ -n "$after" ] && grep -q "^sample:" "$tmp/z3_0.log"; then
  ok "--zero 3 --offload_params disk on 2 ranks: $after, a sample from the whole model after fit()"
else
  fail "--zero 3 run: exits $rc0 / $rc1: $(tail -3 "$tmp/z3_0.log")"
fi
# its checkpoint resumed by one process (ZeRO-3 alone): refused, naming both world sizes
if "$bin" "${job[@]}" "${z3[@]}" --resume latest > "$tmp/z3_one.log" 2>&1; then
  fail "--zero 3 checkpoint of 2 ranks resumed by 1: accepted"
elif grep -q "written by 2 rank(s), this run has 1. HINT" "$tmp/z3_one.log"; then
  ok "--zero 3 checkpoint of 2 ranks resumed by 1: refused ($(grep -o 'written by 2 rank.\{0,40\}' "$tmp/z3_one.log" | head -1))"
else
  fail "--zero 3 checkpoint of 2 ranks resumed by 1: $(tail -3 "$tmp/z3_one.log")"
fi
# host offload of a model on the CPU: refused at start, naming the device, with a HINT (disk)
if "$bin" "${job[@]}" --zero 3 --offload_params host --steps 1 --output_dir "$tmp/z3host" > "$tmp/z3host.log" 2>&1; then
  fail "--zero 3 --offload_params host on the CPU: accepted"
elif grep -q "offload_params_host .* this model is on cpu. HINT: .*offload_params disk" "$tmp/z3host.log"; then
  ok "--zero 3 --offload_params host on the CPU: refused with a HINT to offload to disk"
else
  fail "--zero 3 --offload_params host on the CPU: $(grep -m1 error "$tmp/z3host.log")"
fi
killed z3kill "--zero 3, " --zero 3

# ---- --zero auto: the planner weighs ZeRO-0, 1 and 3 on the ranks; 8 small blocks on 8-token rows
# (model state dominates): only ZeRO-3 fits 18 MiB, and the run trains with it ----
pair auto --layers 8 --dim 128 --seq_len 8 --micro_batch 2 --accum 1 --zero auto --memory_budget 18MiB --steps 2 \
  --output_dir "$tmp/auto"
if [ "$rc0" -eq 0 ] && [ "$rc1" -eq 0 ] && grep -q "^chose .* + ZeRO-3 (micro" "$tmp/auto0.log" \
   && grep -q "^plan: 3 candidates" "$tmp/auto0.log" && grep -q "^--zero 3 on 2 ranks" "$tmp/auto0.log"; then
  ok "--zero auto --memory_budget 18MiB on 2 ranks: $(grep -o '^chose .*(micro *[0-9]*)' "$tmp/auto0.log"), trained; $(grep -o 'estimated peak .*' "$tmp/auto0.log")"
else
  fail "--zero auto: exits $rc0 / $rc1: $(grep -E '^chose|error' "$tmp/auto0.log" "$tmp/auto1.log" | head -3)"
fi
if "$bin" "${job[@]}" --zero auto --steps 1 --output_dir "$tmp/auto1" > "$tmp/auto_nobudget.log" 2>&1; then
  fail "--zero auto without --memory_budget: accepted"
elif grep -q "zero auto picks the stage that fits --memory_budget (got no budget). HINT" "$tmp/auto_nobudget.log"; then
  ok "--zero auto without --memory_budget: refused with a HINT"
else
  fail "--zero auto without --memory_budget: $(grep -m1 error "$tmp/auto_nobudget.log")"
fi
if "$bin" "${job[@]}" --zero auto --memory_budget 1GiB --calibrate --steps 1 --output_dir "$tmp/auto1" \
     > "$tmp/auto_calibrate.log" 2>&1; then
  fail "--zero auto --calibrate: accepted"
elif grep -q "calibrate measures a step on this rank alone, not a sharded one (got --zero auto). HINT" \
     "$tmp/auto_calibrate.log"; then
  ok "--zero auto --calibrate: refused with a HINT"
else
  fail "--zero auto --calibrate: $(grep -m1 error "$tmp/auto_calibrate.log")"
fi

# ---- different shapes ----
p=$(port)
rank 0 "$p" "${job[@]}" --steps 4 --output_dir "$tmp/shape" > "$tmp/shape0.log" 2>&1 &
pid0=$!
(rank 1 "$p" "${job[@]}" --steps 4 --dim 128 --output_dir "$tmp/shape" > "$tmp/shape1.log" 2>&1)
rc1=$?
wait "$pid0"
rc0=$?
if [ "$rc0" -ne 0 ] && [ "$rc1" -ne 0 ] && grep -q "rank 1's model shapes differ from rank 0's" "$tmp/shape0.log" \
   && grep -q "HINT" "$tmp/shape1.log"; then
  ok "different shapes: both ranks stop at start ($(grep -o "rank 1's model shapes differ.\{0,60\}" "$tmp/shape0.log" | head -1))"
else
  fail "different shapes: exits $rc0 / $rc1: $(tail -3 "$tmp/shape0.log")"
fi

# ---- torchrun: restart after a killed worker, resume from the last checkpoint ----
if [ ! -x "${TORCHRUN:-$root/.venv/bin/torchrun}" ]; then
  echo "skip: ${TORCHRUN:-$root/.venv/bin/torchrun} missing (scripts/deps installs it)"
  finish
  exit $?
fi
export LAUNCH_LOG_DIR="$tmp/logs"
long=("${job[@]}" --steps 120 --save_every 10 --resume latest)
"$root/scripts/launch" 2 "$bin" "${long[@]}" --output_dir "$tmp/straight" > "$tmp/straight.log" 2>&1 \
  || fail "torchrun straight run: $(tail -5 "$tmp/straight.log")"
LAUNCH_MAX_RESTARTS=1 "$root/scripts/launch" 2 "$bin" "${long[@]}" --output_dir "$tmp/restart" > "$tmp/restart.log" 2>&1 &
launcher=$!
victim=""
until [ -n "$victim" ] || ! kill -0 "$launcher" 2> /dev/null; do
  if compgen -G "$tmp/restart/checkpoints/step-*[0-9]" > /dev/null; then
    for pid in $(pgrep -f -- "--output_dir $tmp/restart"); do
      if tr '\0' '\n' < "/proc/$pid/environ" 2> /dev/null | grep -qx "RANK=1"; then victim=$pid; fi
    done
  fi
  sleep 0.05
done
[ -n "$victim" ] && kill -9 "$victim"
wait "$launcher"
rc=$?
final=checkpoints/step-00000120/model.safetensors
if [ -n "$victim" ] && [ "$rc" -eq 0 ] && grep -q "resumed at step" "$tmp/restart.log" \
   && cmp -s "$tmp/straight/$final" "$tmp/restart/$final"; then
  ok "torchrun --max_restarts 1: worker killed, job $(grep -o 'resumed at step [0-9]*' "$tmp/restart.log" | head -1), same weights as the uninterrupted run"
else
  fail "torchrun restart (victim '$victim', exit $rc): $(grep -E 'resumed|error|Error' "$tmp/restart.log" | tail -5)"
fi
finish
