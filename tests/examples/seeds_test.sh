#!/usr/bin/env bash
# The seeds' command lines (docs/seeds.md quotes each one) run with memopt's examples as they
# are written, or fail at once with one error naming what differs and a HINT. Each command is
# taken verbatim, its program mapped to memopt's (python train_optimized.py -> llama_lm,
# python src/train.py -> moe_lm, ...), and run for 1 step: appended are only --max_steps 1 and
# the size of the evaluation (--eval_batches 1). The paths the seeds leave to the reader
# (/path/to/llama, your-dataset, a Hub dataset id) are tiny local stand-ins made here, in the
# working folder each command runs in; `./output` and `data/kjv` are relative to it.
# The test also checks that docs/seeds.md quotes every command it runs, so the two stay in step.
# Usage: seeds_test.sh LLAMA_LM LLAMA_TO_LLADA MOE_LM PREPARE_CORPUS PROJECT_ROOT
set -uo pipefail
llama_lm="$1"
llama_to_llada="$2"
moe_lm="$3"
prepare="$4"
root="$5"
source "$(dirname "$0")/lib.sh"
seeds_doc="$root/docs/seeds.md"

# ---- the working folder: data/kjv (the examples' default --data), and the seeds' datasets ----
work="$tmp/work"
mkdir -p "$work/data"
tiny_data "$prepare" "$work/data/kjv"
docs() {  # docs DIR: the tiny corpus's training text as JSONL, a folder as a downloaded dataset holds it
  mkdir -p "$1"
  sed 's/.*/{"text": "&"}/' "$work/data/kjv/train.txt" > "$1/train.jsonl"
}
docs "$work/your-dataset"
hub="$work/hub"  # the same working folder, plus the Hub dataset downloaded under its id
mkdir -p "$hub"
ln -s "$work/data" "$hub/data"
docs "$hub/skeskinen/TinyStories-Instruct-hf"

# quoted ORIGINAL: whether docs/seeds.md holds ORIGINAL (whitespace and line continuations aside).
flat() { tr '\n' ' ' | sed 's/\\ / /g; s/  */ /g'; }
quoted() { grep -qF -- "$(flat <<<"$1" | sed 's/^ //; s/ $//')" <(flat < "$seeds_doc"); }

# memopt_command ORIGINAL: ORIGINAL with its program replaced by memopt's (one word a line).
memopt_command() {
  local -a words
  read -r -a words <<<"$(flat <<<"$1")"
  case "${words[0]} ${words[1]}" in
    "python train_optimized.py" | "python train_model.py") printf '%s\n' "$llama_lm" ;;
    "python src/train.py") printf '%s\n' "$moe_lm" ;;
    "python src/train_distributed.py") printf '%s\n' "$root/scripts/launch" 2 "$moe_lm" ;;
    "python train_simple_strat.py") printf '%s\n' "$llama_to_llada" --strategy simple ;;
    "python train_all_strat.py") printf '%s\n' "$llama_to_llada" --strategy comprehensive ;;
    "./scripts/train_memory_optimized.sh "*) printf '%s\n' "$moe_lm" --train_memory_optimized; printf '%s\n' "${words[1]}" ;;
    *) echo "UNKNOWN"; return ;;
  esac
  printf '%s\n' "${words[@]:2}"
}

# seed NAME DIR EXPECT ORIGINAL [AS]: runs ORIGINAL's memopt command in DIR for 1 step (AS: ORIGINAL
# with the reader's paths replaced by this test's). EXPECT is "run" (exit 0 and a held-out
# evaluation) or a regex the one-line error must match (exit 1, HINT).
seed() {
  local name="$1" dir="$2" expect="$3" original="$4" as="${5:-$4}" out rc
  if ! quoted "$original"; then
    fail "$name: docs/seeds.md does not quote: $(flat <<<"$original")"
    return
  fi
  mapfile -t cmd < <(memopt_command "$as")
  if [ "${cmd[0]}" = UNKNOWN ]; then
    fail "$name: no memopt program for: $original"
    return
  fi
  local start=$SECONDS
  out=$(cd "$dir" && "${cmd[@]}" --max_steps 1 --eval_batches 1 2>&1 | tr -d '\0')  # samples may hold NULs
  rc=$?
  if [ "$expect" = run ]; then
    if [ "$rc" -eq 0 ] && grep -Eq "held-out (loss|masked-token CE)" <<<"$out"; then
      ok "$name runs ($((SECONDS - start)) s): $(grep -E -m1 'held-out (loss|masked-token CE)' <<<"$out" | tail -1 | cut -c1-70)"
    else
      fail "$name: exit $rc: $(tail -5 <<<"$out")"
    fi
  elif [ "$rc" -eq 1 ] && grep -Eq -- "$expect" <<<"$out" && grep -q HINT <<<"$out"; then
    ok "$name fails at once: $(grep -m1 -E -- "$expect" <<<"$out" | cut -c1-110)"
  else
    fail "$name: want exit 1 matching /$expect/ with a HINT, got exit $rc: $(tail -5 <<<"$out")"
  fi
}

# ---- 004: TinyStories streaming ----
quick_start='python train_optimized.py \
    --dataset-id skeskinen/TinyStories-Instruct-hf \
    --target-params 1000000 \
    --batch-size 16 \
    --gradient-accumulation-steps 4 \
    --use-streaming \
    --epochs 3'
seed "004 quick start, Hub id" "$work" "--dataset-id 'skeskinen/TinyStories-Instruct-hf' is not a local" "$quick_start"
seed "004 quick start, downloaded" "$hub" run "$quick_start"
seed "004 limited RAM" "$work" run 'python train_optimized.py \
    --dataset-id your-dataset \
    --batch-size 8 \
    --gradient-accumulation-steps 8 \
    --use-streaming \
    --use-mixed-precision \
    --use-8bit-optimizer \
    --shuffle-buffer-size 5000'
seed "004 medium RAM" "$work" run 'python train_optimized.py \
    --dataset-id your-dataset \
    --batch-size 32 \
    --gradient-accumulation-steps 4 \
    --use-streaming \
    --use-mixed-precision \
    --shuffle-buffer-size 10000'
seed "004 high RAM" "$work" run 'python train_optimized.py \
    --dataset-id your-dataset \
    --batch-size 64 \
    --gradient-accumulation-steps 2 \
    --use-streaming \
    --shuffle-buffer-size 50000'
seed "004 TPU" "$work" run 'python train_optimized.py \
    --dataset-id your-dataset \
    --batch-size 128 \
    --gradient-accumulation-steps 1 \
    --use-streaming \
    --use-mixed-precision \
    --shuffle-buffer-size 100000'
seed "004 migration, old script" "$hub" run 'python train_model.py \
    --dataset-id skeskinen/TinyStories-Instruct-hf \
    --batch-size 32 \
    --epochs 3'
seed "004 migration, new script" "$hub" run 'python train_optimized.py \
    --dataset-id skeskinen/TinyStories-Instruct-hf \
    --batch-size 32 \
    --use-streaming \
    --gradient-accumulation-steps 1 \
    --epochs 3'

# ---- 003: ParrotLM MoE ----
for flag in --gradient_checkpointing --mixed_precision "--batch_size 8" --monitor_memory; do
  seed "003 $flag" "$work" run "python src/train.py --config moe-nano $flag"
done
seed "003 memory-optimized script" "$work" run './scripts/train_memory_optimized.sh --config moe-nano --batch_size 8'
if [ -x "${TORCHRUN:-$root/.venv/bin/torchrun}" ]; then
  LAUNCH_LOG_DIR="$tmp/launch" seed "003 distributed" "$work" run 'python src/train_distributed.py --config moe-nano'
else
  echo "skip 1 003 distributed: no torchrun (scripts/deps core installs it)"
  skipped=$((skipped + 1))
fi

# ---- 000: LLaMA -> LLaDA distillation: a tiny Hugging Face teacher, its config as the student's ----
if hf_python 2 "000 runs (they need a Hugging Face checkpoint made with transformers)"; then
  hf_checkpoint "$tmp/llama" --text "$work/data/kjv/train.txt" --vocab 200
  # The student: the teacher's shape, bidirectional, its vocabulary + the mask token (a LLaDA config).
  mkdir -p "$tmp/llada"
  "$hf_py" -c "import json, sys
c = json.load(open(sys.argv[1])); c['vocab_size'] += 1; c['causal'] = False
json.dump(c, open(sys.argv[2], 'w'))" "$tmp/llama/config.json" "$tmp/llada/config.json"
  "$hf_py" -c "import pyarrow as pa, pyarrow.parquet as pq, sys
rows = [l.strip() for l in open(sys.argv[1]) if l.strip()]
pq.write_table(pa.table({'text': rows}), sys.argv[2])" "$work/data/kjv/train.txt" "$tmp/data.parquet"
  mkdir -p "$tmp/paths"
  ln -s "$tmp/llama" "$tmp/paths/llama"
  ln -s "$tmp/llada" "$tmp/paths/llada"
  ln -s "$tmp/data.parquet" "$tmp/paths/data.parquet"
  # The seeds' /path/to/... stand for the reader's paths: here they are this test's.
  simple='python train_simple_strat.py \
  --teacher_model /path/to/llama \
  --student_model /path/to/llada \
  --data_path /path/to/data.parquet \
  --output_dir ./output \
  --batch_size 4'
  comprehensive='python train_all_strat.py \
  --teacher_model /path/to/llama \
  --student_model /path/to/llada \
  --data_path /path/to/data.parquet \
  --output_dir ./output \
  --batch_size 4 \
  --gradient_accumulation_steps 4 \
  --weight_decay 0.01 \
  --warmup_steps 100'
  # The Python that wrote the Parquet file reads it for memopt (an absolute path: the runs cd).
  case "$hf_py" in
    */*) MEMOPT_PYTHON="$(cd "$(dirname "$hf_py")" && pwd)/$(basename "$hf_py")" ;;
    *) MEMOPT_PYTHON="$(command -v "$hf_py")" ;;
  esac
  export MEMOPT_PYTHON
  for name in simple comprehensive; do
    original="${!name}"
    seed "000 $name" "$work" run "$original" "${original//\/path\/to\//$tmp/paths/}"
  done
fi

# ---- 001: the LMCleaner allocator settings, in MEMOPT_ALLOC_CONF: a CPU run says they do nothing ----
out=$(cd "$work" && MEMOPT_ALLOC_CONF=expandable_segments:True,max_split_size_mb:64 "$llama_lm" --max_steps 1 \
      --eval_batches 1 --micro_batch 1 --seq_len 16 --layers 1 --dim 32 --heads 2 2>&1)
if [ $? -eq 0 ] && { has_gpu || grep -q "warning: the CUDA allocator settings 'expandable_segments:True,max_split_size_mb:64' do nothing here" <<<"$out"; }; then
  ok "001 CUDA allocator keys: $(has_gpu && echo applied || grep -m1 warning <<<"$out" | cut -c1-100)"
else
  fail "001 CUDA allocator keys: $(tail -5 <<<"$out")"
fi

finish
