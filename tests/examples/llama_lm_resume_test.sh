#!/usr/bin/env bash
# examples/00_llama_lm never loses a run, tested with child processes on a tiny generated
# corpus: SIGTERM mid-run finishes the step, writes a checkpoint and exits 0, and
# --resume latest ends with the uninterrupted run's weights, byte for byte; a second SIGINT
# exits at once (130); kill -9 during a checkpoint write leaves the previous one to resume
# from; a corrupt newest checkpoint is refused and the previous one used;
# --resume latest with no checkpoint starts anew; resuming with other settings names them;
# --precision auto with --resume keeps the checkpoint's precision.
# Usage: llama_lm_resume_test.sh path/to/llama_lm path/to/memopt_prepare_corpus
set -uo pipefail
bin="$1"
prepare="$2"
source "$(dirname "$0")/lib.sh"

tiny_data "$prepare" "$tmp/data"
job=(--data "$tmp/data" --layers 2 --dim 64 --heads 4 --seq_len 32 --micro_batch 4 --accum 2 --dropout 0.1
     --steps 60 --warmup 2 --log_interval 1000 --eval_batches 1 --sample_tokens 1 --threads 1 --precision fp32)
final() { echo "$1/checkpoints/step-00000060/model.safetensors"; }
# wait_for_checkpoint DIR PID: until DIR/checkpoints holds a complete one (or PID ended).
wait_for_checkpoint() {
  until compgen -G "$1/checkpoints/step-*[0-9]" > /dev/null || ! kill -0 "$2" 2> /dev/null; do sleep 0.01; done
}

"$bin" "${job[@]}" --output_dir "$tmp/straight" > "$tmp/straight.log" 2>&1 || fail "straight run: $(tail -3 "$tmp/straight.log")"

# ---- SIGTERM: finish the step, checkpoint, exit 0; then resume to the end ----
"$bin" "${job[@]}" --output_dir "$tmp/term" --save_every 5 > "$tmp/term.log" 2>&1 &
pid=$!
wait_for_checkpoint "$tmp/term" "$pid"
kill -TERM "$pid"
wait "$pid"
rc=$?
saved=$(sed -n 's/.*SIGTERM after step \([0-9]*\): checkpoint \(.*\); continue.*/\2/p' "$tmp/term.log")
if [ "$rc" -eq 0 ] && [ -n "$saved" ] && [ -f "$saved/manifest.json" ] && grep -q '"reason": "SIGTERM"' "$saved/state.json" \
   && ! grep -q "held-out loss after" "$tmp/term.log"; then
  ok "SIGTERM: exit 0 with a checkpoint ($(basename "$saved"), reason SIGTERM)"
else
  fail "SIGTERM: exit $rc, checkpoint '$saved': $(tail -5 "$tmp/term.log")"
fi
out=$("$bin" "${job[@]}" --output_dir "$tmp/term" --save_every 5 --resume latest 2>&1)
if [ $? -eq 0 ] && grep -q "resumed at step" <<<"$out" && cmp -s "$(final "$tmp/straight")" "$(final "$tmp/term")"; then
  ok "resumed after SIGTERM: $(grep -o 'resumed at step [0-9]*' <<<"$out"); final weights byte for byte the straight run's"
else
  fail "resume after SIGTERM: $out"
fi

# ---- a second SIGINT exits at once, without a checkpoint (steps of ~0.5 s: the second comes mid-step) ----
"$bin" "${job[@]}" --output_dir "$tmp/int" --save_every 1 --steps 100000 --dim 256 --layers 4 --seq_len 128 \
  --micro_batch 8 > "$tmp/int.log" 2>&1 &
pid=$!
wait_for_checkpoint "$tmp/int" "$pid"
kill -INT "$pid"
# The second only once the first was handled (two pending SIGINTs would merge into one).
until grep -q "memopt: SIGINT: finishing this step" "$tmp/int.log" || ! kill -0 "$pid" 2> /dev/null; do sleep 0.01; done
kill -INT "$pid"
wait "$pid"
rc=$?
if [ "$rc" -eq 130 ] && grep -q "second SIGINT" "$tmp/int.log"; then
  ok "second SIGINT: exit 130 at once"
else
  fail "second SIGINT: exit $rc: $(tail -3 "$tmp/int.log")"
fi

# ---- kill -9 while a checkpoint is being written: the previous one is used, nothing lost ----
big=(--dim 256 --layers 4 --seq_len 128 --micro_batch 8 --steps 6)  # checkpoints of ~60 MB: writes take a while
"$bin" "${job[@]}" "${big[@]}" --output_dir "$tmp/big_straight" > "$tmp/big_straight.log" 2>&1 \
  || fail "big straight run: $(tail -3 "$tmp/big_straight.log")"
"$bin" "${job[@]}" "${big[@]}" --output_dir "$tmp/big" --save_every 1 > "$tmp/big.log" 2>&1 &
pid=$!
until compgen -G "$tmp/big/checkpoints/step-00000002.tmp" > /dev/null || ! kill -0 "$pid" 2> /dev/null; do sleep 0.002; done
kill -9 "$pid" 2> /dev/null
wait "$pid" 2> /dev/null
if [ -d "$tmp/big/checkpoints/step-00000002.tmp" ] && [ ! -d "$tmp/big/checkpoints/step-00000002" ]; then
  out=$("$bin" "${job[@]}" "${big[@]}" --output_dir "$tmp/big" --save_every 1 --resume latest 2>&1)
  if [ $? -eq 0 ] && grep -q "resumed at step 1 " <<<"$out" \
     && cmp -s "$tmp/big_straight/checkpoints/step-00000006/model.safetensors" "$tmp/big/checkpoints/step-00000006/model.safetensors"; then
    ok "kill -9 during the step-2 checkpoint write: resumed from step 1, final weights byte for byte the same"
  else
    fail "resume after a kill during a write: $out"
  fi
else
  fail "kill during a checkpoint write: the kill did not land in the write ($(ls "$tmp/big/checkpoints"))"
fi

# ---- a corrupt newest checkpoint is refused, the previous one used ----
mkdir -p "$tmp/corrupt"
cp -r "$tmp/term/checkpoints" "$tmp/corrupt/"
newest=$(ls -d "$tmp/corrupt/checkpoints"/step-* | tail -1)
printf 'XXXX' | dd of="$newest/model.safetensors" bs=1 seek=300 conv=notrunc status=none
out=$("$bin" "${job[@]}" --output_dir "$tmp/corrupt" --resume "$tmp/corrupt/checkpoints/step-00000060" 2>&1)
if [ $? -eq 1 ] && grep -q "fails its checksum" <<<"$out" && grep -q "HINT" <<<"$out"; then
  ok "a named corrupt checkpoint is refused with a HINT"
else
  fail "named corrupt checkpoint: $out"
fi
out=$("$bin" "${job[@]}" --output_dir "$tmp/corrupt" --resume latest --steps 60 2>&1)
if [ $? -eq 0 ] && grep -q "refused a checkpoint.*fails its checksum" <<<"$out" && grep -q "resumed at step 55" <<<"$out" \
   && cmp -s "$(final "$tmp/straight")" "$(final "$tmp/corrupt")"; then
  ok "corrupt newest checkpoint refused; resumed at step 55 and ended byte for byte the same"
else
  fail "corrupt checkpoint: $out"
fi

# ---- latest with nothing saved yet starts anew; other settings are named ----
out=$("$bin" "${job[@]}" --output_dir "$tmp/fresh" --steps 2 --resume latest 2>&1)
if [ $? -eq 0 ] && grep -q "no checkpoint in .* yet: starting at step 0" <<<"$out"; then
  ok "resume latest with no checkpoint starts at step 0"
else
  fail "resume latest, nothing saved: $out"
fi
out=$("$bin" "${job[@]}" --output_dir "$tmp/term" --resume latest --lr 0.01 --layers 3 2>&1)
if [ $? -eq 1 ] && grep -q "lr: 0.002 in the checkpoint, 0.01 now" <<<"$out" && grep -q "config.layers: 2 in the checkpoint, 3 now" <<<"$out"; then
  ok "resume with other settings names them"
else
  fail "resume with other settings: $out"
fi
out=$("$bin" "${job[@]}" --output_dir "$tmp/term" --resume "$tmp/nowhere" 2>&1)
if [ $? -eq 1 ] && grep -q "nowhere' is not a directory" <<<"$out" && grep -q HINT <<<"$out"; then
  ok "resume from a missing directory: a clear error"
else
  fail "resume from a missing directory: $out"
fi

# ---- --precision auto with --resume keeps the checkpoint's precision, whatever auto measures here ----
"$bin" "${job[@]}" --output_dir "$tmp/bf16" --steps 2 --precision bf16 > "$tmp/bf16.log" 2>&1 \
  || fail "bf16 run: $(tail -3 "$tmp/bf16.log")"
for run in "term fp32 60" "bf16 bf16 2"; do
  read -r name precision step <<<"$run"
  out=$("$bin" "${job[@]}" --output_dir "$tmp/$name" --resume latest --steps $((step + 1)) --precision auto 2>&1)
  if [ $? -eq 0 ] && grep -q "precision: $precision (kept from the checkpoint --resume reads" <<<"$out" \
     && grep -q "resumed at step $step " <<<"$out"; then
    ok "--precision auto resumes a $precision checkpoint in $precision ($(grep -o 'precision: .*' <<<"$out" | cut -c1-90))"
  else
    fail "--precision auto, resuming a $precision checkpoint: $out"
  fi
done

finish
