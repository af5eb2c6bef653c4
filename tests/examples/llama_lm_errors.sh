#!/usr/bin/env bash
# Bad input to examples/00_llama_lm: each case must exit 1 (not crash) with a message
# that names the file or option and the value seen, and ends with a HINT.
# Usage: llama_lm_errors.sh path/to/llama_lm
set -uo pipefail
bin="$1"
source "$(dirname "$0")/lib.sh"

expect_error() {  # expect_error NAME REGEX ARGS...
  local name="$1" regex="$2"
  shift 2
  expect_failure "$name" "$regex" "$bin" "$@"
}

# A 64-byte shard header: magic, version 1, 2 bytes/token, COUNT tokens, VOCAB.
header() {  # header MAGIC COUNT VOCAB
  printf '%s' "$1"
  printf '\x01\x00\x00\x00\x02\x00\x00\x00'
  printf "$(printf '\\x%02x' $(( $2 & 255 )) $(( ($2 >> 8) & 255 )))\x00\x00\x00\x00\x00\x00"
  printf "$(printf '\\x%02x' $(( $3 & 255 )) $(( ($3 >> 8) & 255 )))\x00\x00\x00\x00\x00\x00"
  head -c 32 /dev/zero
}

mkdir -p "$tmp/truncated" "$tmp/magic" "$tmp/bigid"
{ header MEMOPTTK 1000 4096; head -c 100 /dev/zero; } > "$tmp/truncated/train.bin"
{ header NOTASHRD 10 4096; head -c 20 /dev/zero; } > "$tmp/magic/train.bin"
{ header MEMOPTTK 2 100; printf '\x05\x00\xc8\x00'; } > "$tmp/bigid/train.bin"   # token 200 >= vocab 100

expect_error missing_corpus "$tmp/nowhere/train.bin" --data "$tmp/nowhere"
expect_error truncated_shard "$tmp/truncated/train.bin" --data "$tmp/truncated"
expect_error wrong_magic "$tmp/magic/train.bin.*magic" --data "$tmp/magic"
expect_error token_id_beyond_vocab "$tmp/bigid/train.bin.*200" --data "$tmp/bigid"
expect_error zero_accum_micro_batch "micro_batch.*got 0" --micro_batch 0 --data "$tmp/nowhere"
expect_error negative_lr "lr must be > 0 \(got -0.1\)" --lr -0.1 --data "$tmp/nowhere"
expect_error zero_steps "max_steps.*got 0" --steps 0 --data "$tmp/nowhere"
expect_error zero_seq_len "seq_len.*got 0" --seq_len 0 --data "$tmp/nowhere"
expect_error seq_len_beyond_model "seq_len 4096 exceeds.*512" --seq_len 4096 --data "$tmp/nowhere"
expect_error bad_recompute "recompute.*every-x" --recompute every-x --data "$tmp/nowhere"
expect_error bad_precision "precision.*fp8" --precision fp8 --data "$tmp/nowhere"
expect_error bad_optimizer_state "optimizer_state.*nvme" --optimizer_state nvme --data "$tmp/nowhere"
expect_error pinned_host_on_cpu "pinned-host keeps AdamW's state in pinned host memory for training on a GPU" \
  --optimizer_state pinned-host --data "$tmp/nowhere"
expect_error bad_memory_budget "memory_budget.*4XB" --memory_budget 4XB --data "$tmp/nowhere"
expect_error bad_policies "policies.*sometimes" --policies sometimes --data "$tmp/nowhere"
expect_error negative_save_every "save_every must be >= 0 \(got -2\)" --save_every -2 --data "$tmp/nowhere"
expect_error zero_keep_checkpoints "keep_checkpoints must be >= 1 \(got 0\)" --keep_checkpoints 0 --data "$tmp/nowhere"
expect_error negative_max_skips "max_consecutive_skips must be >= 0 \(got -1\)" --max_skips -1 --data "$tmp/nowhere"
expect_error bad_device "device must be cpu or cuda\[:N\] \(got 'tpu'\)" --device tpu --data "$tmp/nowhere"
if ! nvidia-smi -L > /dev/null 2>&1; then  # no GPU here: a CUDA run must stop at start, saying why
  expect_error cuda_without_gpu "device cuda:1: (no CUDA GPU is visible|this build's LibTorch .* has no CUDA)" \
    --device cuda:1 --data "$tmp/nowhere"
fi

finish
