#!/usr/bin/env bash
# examples/00_llama_lm's memory planning end to end on a tiny generated Brown-format corpus:
# --estimate_only prints the estimate and trains nothing; explicit policy flags reach the
# Trainer instantiation they name; --policies auto with a memory budget picks a combination
# whose measured peak stays within the budget (10% estimator tolerance); an impossible budget
# is a clear error naming the smallest need; --calibrate measures the choice before the run;
# --finetune auto takes full fine-tuning, LoRA or QLoRA, the first that fits.
# Usage: llama_lm_planner_test.sh path/to/llama_lm path/to/memopt_prepare_corpus
set -uo pipefail
bin="$1"
prepare="$2"
source "$(dirname "$0")/lib.sh"

tiny_data "$prepare" "$tmp/data"
# The measured peak llama_lm prints at the end ("estimated peak X MiB, measured Y MiB").
run_measured() { sed -n 's/^estimated peak .* MiB, measured \([0-9.]*\) MiB.*/\1/p' <<<"$1"; }
tiny=(--data "$tmp/data" --layers 2 --dim 64 --heads 4 --seq_len 32 --max_seq_len 64 --micro_batch 8
      --steps 2 --warmup 1 --eval_batches 1 --sample_tokens 2 --threads 1 --log_interval 1)

# --estimate_only: the table, no training.
out=$("$bin" "${tiny[@]}" --recompute none --precision fp32 --estimate_only 2>&1)
if [ $? -ne 0 ] || ! grep -q "memory estimate" <<<"$out" || grep -q "held-out loss" <<<"$out"; then
  fail "estimate_only: $out"
else
  ok "estimate_only"
fi
full_mib=$(table_peak "$out")

# Explicit flags reach the instantiation they name, and the run trains.
out=$("$bin" "${tiny[@]}" --recompute selective --precision bf16-pure --accum 2 --optimizer_state int8 2>&1)
if [ $? -ne 0 ] || ! grep -q "trainer: Trainer<recompute::Selective, precision::Bf16Pure, accum::Runtime, state::Int8>" <<<"$out" \
   || ! grep -q "held-out loss after 2 steps" <<<"$out"; then
  fail "explicit flags: $out"
else
  ok "explicit flags"
fi

# --policies auto under half the unconstrained estimate: a plan, and a measured peak within budget (+10%).
budget=$(awk -v m="$full_mib" 'BEGIN { printf "%.1f", m / 2 }')
out=$("$bin" "${tiny[@]}" --policies auto --memory_budget "${budget}MiB" 2>&1)
within_budget "auto (unconstrained ${full_mib} MiB)" $? "$out" "$(run_measured "$out")" "$budget" 1.1 "^chose "

# --calibrate: the choice is measured by a real step before the run; the run's measured peak is
# within the budget with no tolerance (the calibrated choice was measured to fit), and the
# plan says what it measured. Without a budget, --calibrate is a clear error.
out=$("$bin" "${tiny[@]}" --policies auto --memory_budget "${budget}MiB" --calibrate 2>&1)
within_budget "calibrated auto" $? "$out" "$(run_measured "$out")" "$budget" 1.0 "^calibrated: .* measured by a real step"
out=$("$bin" "${tiny[@]}" --calibrate 2>&1)
if [ $? -ne 1 ] || ! grep -q -- "--calibrate measures the plan for a budget" <<<"$out" || ! grep -q HINT <<<"$out"; then
  fail "calibrate without a budget: $out"
else
  ok "calibrate without a budget: an error"
fi

# An impossible budget: exit 1, the smallest need, a HINT.
out=$("$bin" "${tiny[@]}" --policies auto --memory_budget 64KiB 2>&1)
if [ $? -ne 1 ] || ! grep -q "smallest need" <<<"$out" || ! grep -q "HINT" <<<"$out"; then
  fail "impossible budget: $out"
else
  ok "impossible budget: $(grep -o 'no policy combination.*' <<<"$out" | head -c 160)"
fi

# --finetune auto: the first of full fine-tuning, LoRA and QLoRA that fits. An impossible budget
# names each way's least need; a budget between LoRA's need and full's takes LoRA, which trains;
# a roomy one keeps full fine-tuning; without a budget, an error.
out=$("$bin" "${tiny[@]}" --policies auto --finetune auto --memory_budget 64KiB 2>&1)
need() { sed -n "s/.*no way to fine-tune fits .*[:;] $1 \([0-9.]*\) MiB.*/\1/p" <<<"$out"; }
full_need=$(need full); lora_need=$(need lora); qlora_need=$(need qlora)
if [ -n "$full_need" ] && [ -n "$lora_need" ] && [ -n "$qlora_need" ] && grep -q HINT <<<"$out" \
   && awk -v f="$full_need" -v l="$lora_need" -v q="$qlora_need" 'BEGIN { exit !(f > l && l > q) }'; then
  ok "--finetune auto, impossible budget: needs full $full_need > lora $lora_need > qlora $qlora_need MiB"
else
  fail "--finetune auto, impossible budget: $(tail -3 <<<"$out")"
fi
budget=$(awk -v l="$lora_need" -v f="$full_need" 'BEGIN { printf "%.3f", (l + f) / 2 }')
out=$("$bin" "${tiny[@]}" --policies auto --finetune auto --memory_budget "${budget}MiB" 2>&1)
if [ $? -eq 0 ] && grep -q "^chose lora fine-tuning" <<<"$out" && grep -q "^  \* lora" <<<"$out" \
   && grep -q "LoRA rank 16 alpha 32" <<<"$out" && grep -q "held-out loss after 2 steps" <<<"$out"; then
  ok "--finetune auto at ${budget} MiB: $(grep '^  \* lora' <<<"$out" | cut -c1-100)"
else
  fail "--finetune auto at ${budget} MiB: $(grep -A4 '^finetune:' <<<"$out") $(tail -3 <<<"$out")"
fi
out=$("$bin" "${tiny[@]}" --policies auto --finetune auto --memory_budget 1GiB --estimate_only 2>&1)
if [ $? -eq 0 ] && grep -q "^chose full fine-tuning" <<<"$out"; then
  ok "--finetune auto at 1 GiB: full fine-tuning"
else
  fail "--finetune auto at 1 GiB: $(grep -A4 '^finetune:' <<<"$out") $(tail -3 <<<"$out")"
fi
expect_failure "--finetune auto without a budget" "--finetune auto picks full, LoRA or QLoRA for a budget" \
  "$bin" "${tiny[@]}" --finetune auto
expect_failure "--finetune full with --lora" "--finetune full trains every weight, but --lora is 4" \
  "$bin" "${tiny[@]}" --finetune full --lora 4

finish
