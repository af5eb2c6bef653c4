#!/usr/bin/env bash
# examples/02_moe end to end on a tiny generated Brown-format corpus (prepared by
# memopt_prepare_corpus): every policy combination and both dispatches train, evaluate and
# log router statistics; the dense equivalent trains; --grad_accum defaults to 2 (the seed's
# script); --train_memory_optimized (= --preset memory_optimized) turns on recompute every,
# precision auto and accumulation 2, explicit flags overriding it; --attention sdpa,
# --release_cache_every 1 and --memory_trace 1 run (the trace file written); a run stopped at
# step 2 and resumed (latest, or its output folder) ends with the same loss as an uninterrupted
# one; --estimate_only predicts the plain run's peak within 10%, and --policies auto keeps a run
# under a budget (--calibrate: strictly). Then bad input: each case must exit 1 (not crash) with
# a message naming the option and the value seen, and a HINT (--precision fp16 on the CPU included).
# Usage: moe_lm_test.sh path/to/moe_lm path/to/memopt_prepare_corpus
set -uo pipefail
bin="$1"
prepare="$2"
source "$(dirname "$0")/lib.sh"

# ---- a tiny corpus: 30 documents of word/tag lines, a 120-piece BPE model ----
tiny_data "$prepare" "$tmp/data"

small=(--seq_len 32 --eval_batches 1 --log_interval 1 --threads 1 --warmup 1)  # the run's size, no policy
tiny=("${small[@]}" --batch_size 2 --precision fp32)

last_out=""  # the output of the latest expect_run
expect_run() {  # expect_run NAME ARGS... : exit 0, a held-out loss, router statistics, a summary line
  local name="$1"
  shift
  if ! last_out=$("$bin" --data "$tmp/data" "${tiny[@]}" "$@" 2>&1); then
    fail "$name: exit code != 0. Output: $last_out"
  elif ! grep -q "held-out loss after" <<<"$last_out"; then
    fail "$name: no held-out loss in the output: $last_out"
  else
    ok "$name"
  fi
}
final_loss() { grep -o '"final_loss":[^,]*' "$1/metrics.jsonl" | tail -1; }

expect_run sorted_plain --output_dir "$tmp/plain" --steps 2
# --grad_accum's default is the seed's script's: 2 micro-batches of 2 sequences a step
if grep -q "accum::Runtime(2) .* effective batch 4 x 32 tokens" <<<"$last_out"; then
  ok "default --grad_accum 2: $(grep -m1 -o "accum::Runtime(2) .* effective batch 4 x 32 tokens" <<<"$last_out")"
else
  fail "default --grad_accum is not 2 (want accum::Runtime(2), effective batch 4 x 32): $last_out"
fi
if grep -q '"expert_load"' "$tmp/plain/metrics.jsonl" && grep -q '"event":"summary"' "$tmp/plain/metrics.jsonl" &&
   [ -s "$tmp/plain/checkpoints/step-00000002/model.safetensors" ] && [ -s "$tmp/plain/checkpoints/step-00000002/manifest.json" ]; then
  ok "metrics.jsonl has router statistics and a summary; the final checkpoint saved"
else
  fail "metrics.jsonl or checkpoints/ incomplete: $(cat "$tmp/plain/metrics.jsonl"; ls -R "$tmp/plain/checkpoints")"
fi
# the seeds' spellings, '-' or '_': --max-steps is --steps, --gradient-accumulation-steps is --grad_accum
expect_run sorted_all_levers --output_dir "$tmp/levers" --max-steps 2 --gradient_checkpointing --mixed_precision \
  --gradient-accumulation-steps 2 --checkpoint_experts --router_jitter 0.01 --monitor_memory
expect_run dense_dispatch_dropless --output_dir "$tmp/dense_dispatch" --steps 2 --dispatch dense \
  --capacity_factor 0 --num_experts 3 --top_k 1
expect_run dense_equivalent --output_dir "$tmp/dense" --steps 2 --dense

# one setting, one name: the seeds' --gradient_checkpointing --mixed_precision and the earlier
# --checkpoint are --recompute every --precision bf16
for spelling in "--recompute every --precision bf16" "--gradient_checkpointing --mixed_precision" \
                "--checkpoint every_block --mixed_precision" "--recompute every_block --precision bf16"; do
  # shellcheck disable=SC2086 # the spelling is several words
  out=$("$bin" --data "$tmp/data" "${tiny[@]}" --output_dir "$tmp/spelling" --estimate_only $spelling 2>&1)
  if grep -q "recompute=every precision=bf16 " <<<"$out"; then ok "spelling '$spelling': recompute=every precision=bf16"
  else fail "spelling '$spelling' did not select recompute=every precision=bf16: $out"; fi
done
# one setting: the later spelling wins, as with any option given twice
for pair in "--recompute none --gradient_checkpointing:recompute=every" "--gradient_checkpointing --recompute none:recompute=none" \
            "--precision fp32 --mixed_precision:precision=bf16" "--mixed_precision --precision fp32:precision=fp32"; do
  # shellcheck disable=SC2086 # the spelling is several words
  out=$("$bin" --data "$tmp/data" "${tiny[@]}" --output_dir "$tmp/spelling" --estimate_only ${pair%%:*} 2>&1)
  if grep -q "${pair##*:} " <<<"$out"; then ok "'${pair%%:*}': ${pair##*:}"
  else fail "'${pair%%:*}' should give ${pair##*:}: $out"; fi
done

# ---- the seed's "all memory optimizations" script: ./scripts/train_memory_optimized.sh --config
# moe-nano --batch_size 8 = --train_memory_optimized (no --precision here: the preset's auto decides) ----
out=$("$bin" --data "$tmp/data" "${small[@]}" --output_dir "$tmp/preset" --steps 2 --train_memory_optimized \
      --config moe-nano --batch_size 8 2>&1)
rc=$?
if [ "$rc" -eq 0 ] && grep -q "held-out loss after" <<<"$out" \
   && grep -q "preset memory_optimized: recompute every block, precision auto.*gradient accumulation 2; effective batch 8 x 2 = 16 sequences" <<<"$out" \
   && grep -Eq "policies: recompute::EveryBlock, precision::(Fp32|Bf16Autocast), state::Resident, accum::Runtime\(2\)" <<<"$out"; then
  ok "train_memory_optimized: $(grep -m1 "preset memory_optimized" <<<"$out")"
else
  fail "train_memory_optimized (rc $rc): want the preset line, recompute::EveryBlock and accum::Runtime(2): $out"
fi
# explicit flags override the preset (the plan line of --estimate_only names the policies)
out=$("$bin" --data "$tmp/data" "${small[@]}" --output_dir "$tmp/preset_override" --preset memory_optimized \
      --batch_size 2 --mixed_precision --grad_accum 1 --estimate_only 2>&1)
if grep -q "recompute=every precision=bf16 state=resident accum=1" <<<"$out" \
   && grep -q "preset memory_optimized: recompute every block (given: --precision bf16, --grad_accum 1)" <<<"$out"; then
  ok "preset overridden by --mixed_precision --grad_accum 1: recompute=every precision=bf16 accum=1"
else
  fail "--preset memory_optimized --mixed_precision --grad_accum 1 should give recompute=every precision=bf16 accum=1: $out"
fi

# ---- the memory flags every example shares: --attention, --release_cache_every, --memory_trace ----
expect_run attention_sdpa --output_dir "$tmp/sdpa" --steps 2 --attention sdpa
if grep -q "attention sdpa" <<<"$last_out"; then ok "--attention sdpa: the policies line says attention sdpa"
else fail "--attention sdpa: no 'attention sdpa' in the policies line: $last_out"; fi
expect_run release_cache --output_dir "$tmp/release" --steps 2 --release_cache_every 1
expect_run memory_trace --output_dir "$tmp/trace" --steps 2 --memory_trace 1
if [ -s "$tmp/trace/memory.trace.json" ] && grep -q '"traceEvents"' "$tmp/trace/memory.trace.json"; then
  ok "--memory_trace 1 wrote OUTPUT_DIR/memory.trace.json"
else
  fail "--memory_trace 1: no trace in $tmp/trace/memory.trace.json: $(ls "$tmp/trace")"
fi

# ---- --estimate_only: the table, no training; within 10% of the plain run's measured peak ----
out=$("$bin" --data "$tmp/data" "${tiny[@]}" --output_dir "$tmp/estimate" --estimate_only 2>&1)
rc=$?
predicted=$(table_peak "$out")
measured=$(run_peak "$tmp/plain")
if [ "$rc" -ne 0 ] || [ -z "$predicted" ] || [ -z "$measured" ] || grep -q "held-out loss" <<<"$out" \
   || ! ratio_between "$predicted" "$measured" 0.9 1.1; then
  fail "estimate_only: predicted '$predicted' MiB vs measured '$measured' MiB: $out"
else
  ok "estimate_only: predicted $predicted MiB, the plain run measured $measured MiB"
fi
# --policies auto under that estimate (+1 MiB: it is printed rounded): a plan, a run, a measured
# peak within the budget (+10%).
budget=$(awk -v p="$predicted" 'BEGIN { printf "%.1f", p + 1 }')
out=$("$bin" --data "$tmp/data" "${tiny[@]}" --output_dir "$tmp/auto" --steps 2 --policies auto \
      --memory_budget "${budget}MiB" 2>&1)
within_budget "policies auto" $? "$out" "$(run_peak "$tmp/auto")" "$budget" 1.1 "^chose "

# The same with --calibrate: the choice is measured by a real step first, so the run's peak
# stays within the budget with no tolerance.
out=$("$bin" --data "$tmp/data" "${tiny[@]}" --output_dir "$tmp/calibrated" --steps 2 --policies auto \
      --memory_budget "${budget}MiB" --calibrate 2>&1)
within_budget "calibrated auto" $? "$out" "$(run_peak "$tmp/calibrated")" "$budget" 1.0 "^calibrated: "

# ---- resume: 4 steps straight == 2 steps, then resumed to 4 ----
expect_run straight --output_dir "$tmp/straight" --steps 4
expect_run first_half --output_dir "$tmp/halves" --steps 2
expect_run resumed --output_dir "$tmp/halves" --steps 4 --resume latest
if [ -n "$(final_loss "$tmp/straight")" ] && [ "$(final_loss "$tmp/straight")" = "$(final_loss "$tmp/halves")" ]; then
  ok "resumed run ends with the uninterrupted run's loss ($(final_loss "$tmp/halves"))"
else
  fail "resume: $(final_loss "$tmp/straight") straight vs $(final_loss "$tmp/halves") resumed"
fi
# --resume OUTPUT_DIR: the run's output folder resolves to its newest good checkpoint
expect_run first_half_dir --output_dir "$tmp/halves_dir" --steps 2
expect_run resumed_from_output_dir --output_dir "$tmp/halves_dir" --steps 4 --resume "$tmp/halves_dir"
if grep -q "resumed at step 2 from .*halves_dir/checkpoints/step-00000002" <<<"$last_out" \
   && [ "$(final_loss "$tmp/straight")" = "$(final_loss "$tmp/halves_dir")" ]; then
  ok "--resume OUTPUT_DIR resumed at step 2 and ends with the uninterrupted run's loss"
else
  fail "--resume OUTPUT_DIR: $(final_loss "$tmp/straight") straight vs $(final_loss "$tmp/halves_dir") resumed: $last_out"
fi

# ---- CUDA (where a GPU is visible): both dispatches, every lever ----
if has_gpu; then
  expect_run cuda_sorted_all_levers --output_dir "$tmp/cuda_levers" --steps 2 --device cuda --gradient_checkpointing \
    --mixed_precision --grad_accum 2 --checkpoint_experts --router_jitter 0.01 --monitor_memory
  expect_run cuda_dense_dispatch --output_dir "$tmp/cuda_dense" --steps 2 --device cuda:0 --dispatch dense
  expect_run cuda_fp16 --output_dir "$tmp/cuda_fp16" --steps 2 --device cuda --precision fp16
  if grep -q "precision::Fp16Scaled" <<<"$last_out"; then ok "cuda: --precision fp16 trained with precision::Fp16Scaled"
  else fail "cuda: --precision fp16 did not run precision::Fp16Scaled: $last_out"; fi
  if grep -q '"cuda_peak_mib"' "$tmp/cuda_levers/metrics.jsonl"; then ok "cuda: metrics.jsonl has the caching allocator's peak"
  else fail "cuda: no cuda_peak_mib in $tmp/cuda_levers/metrics.jsonl: $(tail -2 "$tmp/cuda_levers/metrics.jsonl")"; fi
  expect_run cuda_pinned_host --output_dir "$tmp/cuda_pinned" --steps 2 --device cuda --optimizer_state pinned-host \
    --mixed_precision --gradient_checkpointing
  if grep -q "state::PinnedHost" <<<"$last_out"; then ok "cuda: --optimizer_state pinned-host trained with state::PinnedHost"
  else fail "cuda: --optimizer_state pinned-host did not run state::PinnedHost: $last_out"; fi
  expect_failure cuda_pinned_host_fp16 "no compiled Trainer has .*pinned-host" "$bin" --data "$tmp/data" "${tiny[@]}" \
    --output_dir "$tmp/err" --steps 1 --device cuda --optimizer_state pinned-host --precision fp16
else
  skip_runs 7 "--device cuda runs"
fi

# ---- bad input ----
expect_error() {  # expect_error NAME REGEX ARGS...
  local name="$1" regex="$2" data=(--data "$tmp/data")
  shift 2
  [[ " $* " == *" --data "* ]] && data=()
  expect_failure "$name" "$regex" "$bin" "${data[@]}" "${tiny[@]}" --output_dir "$tmp/err" --steps 1 "$@"
}

expect_error top_k_over_experts "top_k must lie in \[1, num_experts = 4\] \(got 5\)" --top_k 5
expect_error negative_experts "num_experts must be >= 1 \(got -2\)" --num_experts -2
expect_error capacity_nan "capacity_factor must be a finite number \(got nan\)" --capacity_factor nan
expect_error unknown_preset "unknown preset 'moe-huge'" --config moe-huge
expect_error bad_dispatch "dispatch must be sorted or dense \(got 'scatter'\)" --dispatch scatter
expect_error jitter_range "router_jitter must lie in \[0, 1\) \(got 1.5\)" --router_jitter 1.5
expect_error negative_aux "aux_loss_coef and z_loss_coef.*got -1" --aux_loss_coef -1
expect_error missing_state "$tmp/nowhere" --resume "$tmp/nowhere"
expect_error resume_other_settings "config.top_k: 0 in the checkpoint, 1 now" --resume "$tmp/halves/checkpoints/step-00000004" --top_k 1
expect_error missing_corpus "$tmp/none/train.bin" --data "$tmp/none"
expect_error bad_device "device must be cpu or cuda\[:N\] \(got 'tpu'\)" --device tpu
expect_error bad_precision "precision must be auto, fp32, bf16 or fp16 \(got 'fp8'\)" --precision fp8
expect_error fp16_on_cpu "--precision fp16 needs a CUDA device \(got --precision fp16 with --device cpu\).*HINT: fp16 needs a CUDA device; on CPU use bf16 or auto" \
  --precision fp16 --device cpu
expect_error pinned_host_on_cpu "pinned-host keeps AdamW's state in pinned host memory for training on a GPU \(got --device cpu\)" \
  --optimizer_state pinned-host --device cpu
expect_error bad_attention "attention must be math, blockwise, sdpa, flash or auto \(got 'fastest'\)" --attention fastest
expect_error negative_release "release_cache_every must be >= 0 \(got -1\)" --release_cache_every -1
if ! nvidia-smi -L > /dev/null 2>&1; then  # no GPU here: a CUDA run must stop at start, saying why
  expect_error cuda_without_gpu "device cuda: (no CUDA GPU is visible|this build's LibTorch .* has no CUDA)" --device cuda
fi

finish
