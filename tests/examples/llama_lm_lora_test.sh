#!/usr/bin/env bash
# examples/00_llama_lm fine-tunes a Hugging Face checkpoint with LoRA and QLoRA: --lora trains
# adapters on every Linear (14 layers of the tiny checkpoint) with the rest frozen, lowers the
# held-out loss, and saves the adapter in PEFT's format, which PEFT loads onto transformers' model
# of the same checkpoint and runs to memopt's held-out loss after training; --qlora does the same
# over NF4 base weights; where a GPU is visible, both again on it (QLoRA under bf16 autocast);
# --qlora without --lora and a target naming no layer are refused with a HINT.
# Usage: llama_lm_lora_test.sh path/to/llama_lm path/to/memopt_prepare_corpus
set -uo pipefail
bin="$1"
prepare="$2"
source "$(dirname "$0")/lib.sh"

tiny_data "$prepare" "$tmp/data"
job=(--data "$tmp/data" --dataset "$tmp/data/train.txt" --seq_len 32 --micro_batch 4 --accum 1 --steps 12
     --warmup 1 --lr 1e-2 --log_interval 1000 --eval_batches 2 --sample_tokens 4 --threads 1
     --recompute every --lora_targets all-linear --lora_dropout 0)
loss() { sed -n "s/^held-out loss $1 \([0-9.]*\) .*/\1/p" <<<"$2"; }

if hf_python 2 "LoRA and QLoRA fine-tunes of a Hugging Face checkpoint" &&
   hf_checkpoint "$tmp/hf" --text "$tmp/data/train.txt"
then
  runs=("lora cpu fp32" "qlora cpu fp32")
  # Where a GPU is visible: LoRA in fp32 and QLoRA under bf16 autocast on it, the same checks.
  if has_gpu; then runs+=("lora cuda fp32" "qlora cuda bf16"); else skip_runs 2 "--device cuda LoRA and QLoRA runs"; fi
  for run in "${runs[@]}"; do
    read -r mode device precision <<<"$run"
    flags=(--lora 4 --device "$device" --precision "$precision")
    [ "$mode" = qlora ] && flags+=(--qlora)
    [ "$device" = cpu ] || mode="${mode}_$device"
    out=$("$bin" "${job[@]}" "${flags[@]}" --init_model "$tmp/hf" --output_dir "$tmp/$mode" 2>&1)
    rc=$?
    before=$(loss "before training" "$out")
    after=$(sed -n 's/^held-out loss after [0-9]* steps \([0-9.]*\) .*/\1/p' <<<"$out")
    if [ "$rc" -eq 0 ] && grep -q "LoRA rank 4 alpha 8 on 14 layers" <<<"$out" \
       && { [[ "$mode" = lora* ]] || grep -q "Linear weights in NF4" <<<"$out"; } \
       && awk -v a="$after" -v b="$before" 'BEGIN { exit !(a < b - 0.05) }' \
       && [ -f "$tmp/$mode/adapter/adapter_model.safetensors" ] && [ -f "$tmp/$mode/adapter/adapter_config.json" ]; then
      ok "$run: held-out loss $before -> $after, adapter saved in PEFT's format"
    else
      fail "$run (rc $rc): held-out loss '$before' -> '$after': $(tail -8 <<<"$out")"
    fi
  done
  # PEFT loads the LoRA adapter onto transformers' model of the same checkpoint; B trained (non-zero).
  if "$hf_py" - "$tmp/hf" "$tmp/lora/adapter" > "$tmp/peft.log" 2>&1 <<'PY'
import sys
import torch
from peft import PeftModel
from transformers import LlamaForCausalLM
model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(sys.argv[1]), sys.argv[2])
b = [p for n, p in model.named_parameters() if "lora_B" in n]
assert len(b) == 14 and all(p.abs().max() > 0 for p in b), (len(b), [p.abs().max().item() for p in b])
print("peft loaded", len(b), "adapters")
PY
  then
    ok "PEFT's PeftModel.from_pretrained loads the adapter: $(tail -1 "$tmp/peft.log")"
  else
    fail "PEFT could not load the adapter: $(tail -5 "$tmp/peft.log")"
  fi
  expect_failure "--qlora without --lora" "--qlora quantises the frozen base of a LoRA fine-tune" \
    "$bin" "${job[@]}" --qlora --init_model "$tmp/hf" --output_dir "$tmp/bad"
  expect_failure "--lora_targets naming no layer" 'target "qkv" matches no Linear.*q_proj' \
    "$bin" "${job[@]}" --lora 4 --lora_targets qkv --init_model "$tmp/hf" --output_dir "$tmp/bad"
fi
finish
