#!/usr/bin/env bash
# examples/01_llama_to_llada end to end on a tiny generated corpus (a SentencePiece BPE
# model trained here, text tokenized on the fly): every strategy trains, evaluates, samples
# and saves; a saved student loads back as --student_model; a run of 2 steps resumed to 4
# (--resume latest) ends with the student of 4 steps in one go; a Hugging Face teacher made here
# with transformers brings its tokenizer.json, its held-out loss is transformers' own, and the
# student's vocabulary is its padded vocab_size + 1. comprehensive is the original's list (dense KD,
# an fp32 teacher; TF32 and cuDNN benchmarking, applied on CUDA only); memopt's levers
# (--kd_top_k, --teacher_precision or its alias --teacher_dtype, --attention,
# --release_cache_every) opt in, and metrics.jsonl's start line shows each. Then bad input: each
# case must exit 1 (not crash) with a message naming the file/option and the value seen, and a HINT.
# Usage: llama_to_llada_test.sh path/to/llama_to_llada
set -uo pipefail
bin="$1"
source "$(dirname "$0")/lib.sh"

# ---- a tiny corpus: 600 generated lines, a 96-piece BPE model ----
mkdir -p "$tmp/data"
words=(the quick brown fox jumps over a lazy dog while memory models train tokens fast slow)
for i in $(seq 1 600); do
  echo "${words[$((i % 16))]} ${words[$((i * 7 % 16))]} ${words[$((i * 3 % 16))]} ${words[$((i * 5 % 16))]} ${words[$((i * 11 % 16))]}."
done > "$tmp/data/train.txt"
head -n 60 "$tmp/data/train.txt" > "$tmp/data/val.txt"
if ! spm_train --input="$tmp/data/train.txt" --model_prefix="$tmp/data/tokenizer" --model_type=bpe \
     --vocab_size=96 --hard_vocab_limit=false --character_coverage=1.0 --num_threads=1 --minloglevel=2 \
     > /dev/null 2>&1; then
  echo "FAIL spm_train could not build the test tokenizer (apt-get install sentencepiece)"
  exit 1
fi

base=(--data_path "$tmp/data" --layers 1 --dim 32 --heads 2 --max_seq_len 64 --seq_len 16 --batch_size 2
      --teacher_steps 2 --max_steps 2 --log_interval 1 --eval_batches 1 --samples 1 --prompt_tokens 4
      --gen_length 8 --sample_steps 8 --block_length 4 --threads 1)
tiny=("${base[@]}" --data_format text)

expect_run() {  # expect_run NAME ARGS... : exit 0, the evaluation and the saved student
  local name="$1" out
  shift
  if ! out=$("$bin" "${tiny[@]}" "$@" 2>&1); then
    fail "$name: exit code != 0. Output: $out"
  elif ! grep -q "held-out masked-token CE" <<<"$out" || ! grep -q "^student: " <<<"$out"; then
    fail "$name: no evaluation or sample in the output: $out"
  else
    ok "$name"
  fi
}

expect_run teacher_and_simple --train_teacher --teacher_model "$tmp/teacher" --output_dir "$tmp/simple" \
  --strategy simple
for f in teacher/config.json teacher/model.safetensors simple/student/config.json simple/student/model.safetensors; do
  [ -s "$tmp/$f" ] || fail "missing $f after a run"
done
if grep -q '"event":"summary"' "$tmp/simple/metrics.jsonl" && grep -q '"diffusion_loss"' "$tmp/simple/metrics.jsonl"; then
  ok "metrics.jsonl has log and summary lines"
else
  fail "metrics.jsonl lacks log or summary lines: $(cat "$tmp/simple/metrics.jsonl")"
fi
expect_run none --teacher_model "$tmp/teacher" --output_dir "$tmp/none" --strategy none

# ---- checkpoints: 4 distillation steps straight == 2, then --resume latest to 4 (both phases;
# strategy simple: a constant learning rate, so --max_steps 2 and 4 share their first steps) ----
expect_run straight_4 --train_teacher --teacher_model "$tmp/t4" --output_dir "$tmp/d4" --strategy simple \
  --max_steps 4
expect_run first_2 --train_teacher --teacher_model "$tmp/t2" --output_dir "$tmp/d2" --strategy simple \
  --max_steps 2
out=$("$bin" "${tiny[@]}" --train_teacher --teacher_model "$tmp/t2" --output_dir "$tmp/d2" --strategy simple \
      --max_steps 4 --resume latest 2>&1)
if [ $? -eq 0 ] && grep -q "teacher: resumed at step 2" <<<"$out" && grep -q "llama_to_llada: resumed at step 2" <<<"$out" \
   && cmp -s "$tmp/d4/checkpoints/step-00000004/model.safetensors" "$tmp/d2/checkpoints/step-00000004/model.safetensors" \
   && cmp -s "$tmp/d4/student/model.safetensors" "$tmp/d2/student/model.safetensors"; then
  ok "resume latest: the teacher's and the student's trainings resumed at step 2; the student byte for byte the straight run's"
else
  fail "resume latest: $out"
fi
out=$("$bin" "${tiny[@]}" --teacher_model "$tmp/teacher" --output_dir "$tmp/estimate" --strategy comprehensive \
      --kd_top_k 8 --estimate_only 2>&1)
if [ $? -ne 0 ] || ! grep -q "teacher + targets" <<<"$out" || ! grep -q "^  peak " <<<"$out" \
   || grep -q "held-out" <<<"$out" || [ -e "$tmp/estimate/metrics.jsonl" ]; then
  fail "estimate_only: $out"
else
  ok "estimate_only: $(grep '^  peak ' <<<"$out")"
fi
predicted=$(table_peak "$out")
budget=$(awk -v p="$predicted" 'BEGIN { printf "%.2f", p + 0.05 }')
out=$("$bin" "${tiny[@]}" --teacher_model "$tmp/teacher" --output_dir "$tmp/auto" --strategy comprehensive \
      --kd_top_k 8 --policies auto --memory_budget "${budget}MiB" 2>&1)
within_budget "policies auto" $? "$out" "$(run_peak "$tmp/auto")" "$budget" 1.1 "^chose "
expect_run comprehensive_sparse_kd --teacher_model "$tmp/teacher" --output_dir "$tmp/comp" \
  --strategy comprehensive --gradient_accumulation_steps 2 --kd_top_k 8 --cfg_scale 1 --temperature 0.5
expect_run student_from_checkpoint --teacher_model "$tmp/teacher" --output_dir "$tmp/again" \
  --student_model "$tmp/simple/student" --strategy simple --alpha 0

# ---- the presets are the originals' lists; memopt's levers opt in ----
# expect_start NAME DIR WANT REGEXES ARGS...: a 2-step run from $tmp/teacher into DIR (expect_run's
# checks) whose metrics.jsonl start line holds every "key":value of WANT (space-separated), whose
# summary says 2 steps, and whose output has a line matching each line of REGEXES (grep -E).
expect_start() {
  local name="$1" dir="$2" want="$3" regexes="$4" out start kv regex
  shift 4
  if ! out=$("$bin" "${tiny[@]}" --teacher_model "$tmp/teacher" --output_dir "$dir" "$@" 2>&1); then
    fail "$name: exit code != 0. Output: $out"
    return
  fi
  start=$(grep '"event":"start"' "$dir/metrics.jsonl" 2>/dev/null | tail -1)
  for kv in $want; do
    if ! grep -qF -e "$kv" <<<"$start"; then
      fail "$name: the start line lacks $kv: $start"
      return
    fi
  done
  if ! grep '"event":"summary"' "$dir/metrics.jsonl" 2>/dev/null | grep -q '"steps":2[,}]'; then
    fail "$name: no summary of 2 steps in $dir/metrics.jsonl: $(cat "$dir/metrics.jsonl" 2>/dev/null)"
    return
  elif ! grep -q "held-out masked-token CE" <<<"$out"; then
    fail "$name: no evaluation in the output: $out"
    return
  fi
  while IFS= read -r regex; do
    if ! grep -Eq -e "$regex" <<<"$out"; then
      fail "$name: no line matching /$regex/: $out"
      return
    fi
  done <<<"$regexes"
  ok "$name: $(grep -m1 -E -e "$(head -n1 <<<"$regexes")" <<<"$out" | head -c 160)"
}

# comprehensive: dense KD, an fp32 teacher; TF32 and cuDNN benchmarking on, said not to apply on the CPU
expect_start comprehensive_is_the_original "$tmp/comp_orig" \
  '"strategy":"comprehensive" "kd_top_k":0 "teacher_precision":"fp32" "attention":"math" "release_cache_every":10 "tf32":true "cudnn_benchmark":true' \
  '^student: .*teacher fp32 inference-mode, KD top-k 0 \(dense\)
^cuda: tf32 true, cudnn benchmark true: CUDA only, not applied' --strategy comprehensive
expect_start opt_in_sparse_kd_bf16_teacher "$tmp/opt_in" \
  '"kd_top_k":8 "teacher_precision":"bf16" "tf32":false "cudnn_benchmark":true' \
  '^student: .*teacher bf16 inference-mode, KD top-k 8 \(sparse\)' \
  --strategy comprehensive --kd_top_k 8 --teacher_precision bf16 --tf32 false
expect_start teacher_dtype_alias_later_wins "$tmp/alias" '"teacher_precision":"bf16"' \
  '^student: .*teacher bf16 inference-mode' --strategy simple --teacher_precision fp32 --teacher_dtype bf16
expect_start attention_sdpa "$tmp/sdpa" '"attention":"sdpa"' '^student: .*attention sdpa' \
  --strategy simple --attention sdpa
expect_start release_cache_every_step "$tmp/release" '"strategy":"none" "release_cache_every":1' \
  '^student: .*cache release every 1 steps' --strategy none --release_cache_every 1

# ---- CUDA (where a GPU is visible): student on the GPU, teacher on the CPU, and both on the GPU ----
if has_gpu; then
  expect_run cuda_student_cpu_teacher --teacher_model "$tmp/teacher" --output_dir "$tmp/cuda_split" \
    --device cuda --teacher_device cpu
  expect_run cuda_both --teacher_model "$tmp/teacher" --output_dir "$tmp/cuda_both" --device cuda:0
  expect_run cuda_comprehensive_bf16 --teacher_model "$tmp/teacher" --output_dir "$tmp/cuda_comp" --device cuda \
    --strategy comprehensive --gradient_accumulation_steps 2 --kd_top_k 8 --mixed_precision
  expect_start cuda_comprehensive_tf32_cudnn_benchmark "$tmp/cuda_tf32" '"tf32":true "cudnn_benchmark":true' \
    '^cuda: tf32 true, cudnn benchmark true$' --device cuda --strategy comprehensive
  expect_start cuda_pinned_host "$tmp/cuda_pinned" '"strategy":"simple"' '^student: .*optimizer state pinned-host' \
    --device cuda --strategy simple --optimizer_state pinned-host
else
  skip_runs 5 "--device cuda runs"
fi

# ---- a Hugging Face teacher (transformers' save_pretrained, vocab_size padded past its tokenizer's)
# with its own tokenizer.json, made here: the default data follows the tokenizer (text tokenized
# now: this DATA has no .bin shards at all), the teacher's held-out loss is transformers' own on the
# same windows, and the student's vocabulary is the teacher's + the mask token ----
if hf_python 4 "Hugging Face teacher cases" &&
   hf_checkpoint "$tmp/hf" --text "$tmp/data/train.txt" --eval "$tmp/data/val.txt" --seq_len 16 --batch_size 2 --batches 1
then
  want=$(sed -n 's/^loss //p' "$tmp/hf.log")
  out=$("$bin" "${base[@]}" --teacher_model "$tmp/hf" --output_dir "$tmp/hf_run" --strategy comprehensive \
        --kd_top_k 8 --precision fp32 --teacher_precision fp32 2>&1)
  rc=$?
  got=$(grep -o '"teacher_loss":[^,}]*' "$tmp/hf_run/metrics.jsonl" 2>/dev/null | tail -1 | cut -d: -f2)
  student_vocab=$(grep -o '"vocab_size": *[0-9]*' "$tmp/hf_run/student/config.json" 2>/dev/null | grep -o '[0-9]*$')
  if [ "$rc" -eq 0 ] && grep -q "tokenizer: '$tmp/hf/tokenizer.json' (tokenizer.json, 300 ids); data: text, tokenized now" <<<"$out" \
     && grep -q "^student: " <<<"$out" && [ "$student_vocab" = 321 ] && close_to "$got" "$want" 1e-4; then
    ok "Hugging Face teacher: its tokenizer, text data; teacher loss $got = transformers' $want; student vocab 320 + 1"
  else
    fail "Hugging Face teacher (rc $rc): teacher loss '$got', transformers' '$want', student vocab '$student_vocab': $(tail -8 <<<"$out")"
  fi
  expect_failure "Hugging Face teacher: --data_format shards" "data_format shards reads .* but this run's tokenizer is" \
    "$bin" "${base[@]}" --teacher_model "$tmp/hf" --output_dir "$tmp/e_hf" --data_format shards
  expect_failure "Hugging Face teacher: --tokenizer DATA's (its shards, the default then, are missing here)" \
    "$tmp/data/train.bin" "$bin" "${base[@]}" --teacher_model "$tmp/hf" --output_dir "$tmp/e_hf" \
    --tokenizer "$tmp/data/tokenizer.model"
  mkdir -p "$tmp/hf_small" && cp "$tmp/hf/"* "$tmp/hf_small/" &&
    sed -i -E 's/"vocab_size": *[0-9]+/"vocab_size": 64/' "$tmp/hf_small/config.json"
  expect_failure "Hugging Face teacher: a tokenizer larger than its embedding" \
    "vocab_size 64 but the tokenizer '.*hf_small/tokenizer.json' has 300 ids" \
    "$bin" "${base[@]}" --teacher_model "$tmp/hf_small" --output_dir "$tmp/e_hf"
fi

# ---- bad input ----
expect_error() {  # expect_error NAME REGEX ARGS...
  local name="$1" regex="$2"
  shift 2
  expect_failure "$name" "$regex" "$bin" "${tiny[@]}" "$@"
}

expect_error missing_teacher "$tmp/nowhere.*config.json" --teacher_model "$tmp/nowhere" --output_dir "$tmp/e1"
expect_error pinned_host_on_cpu "pinned-host keeps AdamW's state in pinned host memory for training on a GPU \(got --device cpu\)" \
  --teacher_model "$tmp/teacher" --output_dir "$tmp/e_pinned" --optimizer_state pinned-host

mkdir -p "$tmp/wrongvocab"
cp "$tmp/teacher/model.safetensors" "$tmp/wrongvocab/"
sed -E 's/"vocab_size": *[0-9]+/"vocab_size": 50/' "$tmp/teacher/config.json" > "$tmp/wrongvocab/config.json"
expect_error teacher_vocab_mismatch "vocab_size 50 but the tokenizer .* has [0-9]+ ids" --teacher_model "$tmp/wrongvocab" \
  --output_dir "$tmp/e2"

mkdir -p "$tmp/renamed"
cp "$tmp/teacher/config.json" "$tmp/renamed/"
sed 's/lm_head\.weight/lm_head.wEIGHT/' "$tmp/teacher/model.safetensors" > "$tmp/renamed/model.safetensors"
expect_error checkpoint_names "lm_head" --teacher_model "$tmp/renamed" --output_dir "$tmp/e3"

mkdir -p "$tmp/short"
cp "$tmp/data/tokenizer.model" "$tmp/short/"
echo "the fox." > "$tmp/short/train.txt"
cp "$tmp/short/train.txt" "$tmp/short/val.txt"
expect_error corpus_too_short "train.txt.*shorter than one sequence" --teacher_model "$tmp/teacher" \
  --output_dir "$tmp/e4" --data_path "$tmp/short"

expect_error zero_accum "gradient_accumulation_steps.*got 0" --teacher_model "$tmp/teacher" --output_dir "$tmp/e5" \
  --gradient_accumulation_steps 0
sed -E 's/"vocab_size": *[0-9]+/"vocab_size": 5/' "$tmp/teacher/config.json" > "$tmp/student.json"
expect_error student_vocab "student_model.*vocab_size 5" --teacher_model "$tmp/teacher" --output_dir "$tmp/e6" \
  --student_model "$tmp/student.json"
expect_error missing_shards "data/train.bin" --teacher_model "$tmp/teacher" --output_dir "$tmp/e7" \
  --data_format shards
expect_error bad_device "device must be cpu or cuda\[:N\] \(got 'tpu'\)" --teacher_model "$tmp/teacher" \
  --output_dir "$tmp/e8" --device tpu
expect_error bad_teacher_device "teacher_device must be cpu or cuda\[:N\] \(got 'gpu'\)" \
  --teacher_model "$tmp/teacher" --output_dir "$tmp/e9" --teacher_device gpu
expect_error bad_attention "attention must be math, blockwise, sdpa, flash or auto \(got 'bogus'\)" \
  --teacher_model "$tmp/teacher" --output_dir "$tmp/e11" --attention bogus
expect_error negative_release_cache_every "release_cache_every must be >= 0 \(got -1\)" \
  --teacher_model "$tmp/teacher" --output_dir "$tmp/e12" --release_cache_every -1
if ! nvidia-smi -L > /dev/null 2>&1; then  # no GPU here: a CUDA run must stop at start, saying why
  expect_error cuda_without_gpu "teacher_device cuda: (no CUDA GPU is visible|this build's LibTorch .* has no CUDA)" \
    --teacher_model "$tmp/teacher" --output_dir "$tmp/e10" --teacher_device cuda
fi

finish
