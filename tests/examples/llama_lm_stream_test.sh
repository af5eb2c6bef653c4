#!/usr/bin/env bash
# examples/00_llama_lm on other data (--dataset), tested with child processes on a tiny
# generated corpus: streaming the same documents as text and as JSONL trains the same
# weights, byte for byte; a streamed run resumed from a mid-run checkpoint ends with the
# uninterrupted run's weights; --epochs ends training when the data runs out; loading the
# dataset whole trains too; --target-params prints the shape it chose; --init_model loads a
# Hugging Face checkpoint made here with transformers and evaluates as transformers does, and
# refuses data tokenized by another tokenizer, shape flags and a tokenizer larger than its
# embedding; bad data flags and records are errors naming the flag, file and line.
# Usage: llama_lm_stream_test.sh path/to/llama_lm path/to/memopt_prepare_corpus
set -uo pipefail
bin="$1"
prepare="$2"
source "$(dirname "$0")/lib.sh"

tiny_data "$prepare" "$tmp/data"
# The same documents as JSONL (the generated text has no quotes, backslashes or tabs).
sed 's/.*/{"id": 1, "text": "&"}/' "$tmp/data/train.txt" > "$tmp/train.jsonl"
job=(--data "$tmp/data" --layers 2 --dim 64 --heads 4 --seq_len 32 --micro_batch 4 --accum 2 --steps 8 --warmup 2
     --log_interval 1000 --eval_batches 1 --sample_tokens 1 --threads 1 --precision fp32 --recompute none
     --use-streaming --shuffle-buffer-size 64 --data-workers 2)
final() { echo "$1/checkpoints/step-00000008/model.safetensors"; }

"$bin" "${job[@]}" --dataset "$tmp/data/train.txt" --output_dir "$tmp/text" > "$tmp/text.log" 2>&1 \
  || fail "streaming text: $(tail -3 "$tmp/text.log")"
"$bin" "${job[@]}" --dataset "$tmp/train.jsonl" --output_dir "$tmp/jsonl" > "$tmp/jsonl.log" 2>&1 \
  || fail "streaming JSONL: $(tail -3 "$tmp/jsonl.log")"
if grep -q "streaming 1 file(s)" "$tmp/text.log" && cmp -s "$(final "$tmp/text")" "$(final "$tmp/jsonl")"; then
  ok "text and JSONL of the same documents stream the same batches (identical weights after 8 steps)"
else
  fail "text vs JSONL streams differ: $(grep -m1 streaming "$tmp/text.log")"
fi

# ---- resume mid-stream: a checkpoint at step 4, the step-8 one removed, resumed from 4 ----
"$bin" "${job[@]}" --dataset "$tmp/train.jsonl" --output_dir "$tmp/cut" --save_every 4 > /dev/null 2>&1
rm -rf "$tmp/cut/checkpoints/step-00000008"
out=$("$bin" "${job[@]}" --dataset "$tmp/train.jsonl" --output_dir "$tmp/cut" --save_every 4 --resume latest 2>&1)
if grep -q "resumed at step 4" <<<"$out" && grep -q '"kind": "StreamLoader"' "$tmp/cut/checkpoints/step-00000004/state.json" \
   && cmp -s "$(final "$tmp/jsonl")" "$(final "$tmp/cut")"; then
  ok "a streamed run resumed at step 4 ends with the uninterrupted run's weights"
else
  fail "streamed resume: $(tail -5 <<<"$out")"
fi

# ---- --epochs: the data runs out before --steps ----
out=$("$bin" "${job[@]}" --dataset "$tmp/train.jsonl" --output_dir "$tmp/epoch" --steps 100000 --epochs 1 2>&1)
if [ $? -eq 0 ] && grep -q "the data ran out at step" <<<"$out" && grep -q "held-out loss after" <<<"$out"; then
  ok "--epochs 1: $(grep -m1 'the data ran out' <<<"$out" | cut -c1-80)"
else
  fail "--epochs 1: $(tail -5 <<<"$out")"
fi

# ---- --epochs without --steps: the run is the epochs; a counting pass sets the schedule's length ----
unbounded=()
for ((i = 0; i < ${#job[@]}; i++)); do
  if [ "${job[i]}" = --steps ]; then i=$((i + 1)); else unbounded+=("${job[i]}"); fi
done
out=$("$bin" "${unbounded[@]}" --dataset "$tmp/train.jsonl" --output_dir "$tmp/epochs" --epochs 2 2>&1)
counted=$(sed -n 's/.*--epochs 2: \([0-9]*\) optimizer steps (counted.*/\1/p' <<<"$out")
ran=$(sed -n 's/^held-out loss after \([0-9]*\) steps.*/\1/p' <<<"$out")
if [ -n "$counted" ] && [ "$counted" -gt 8 ] && [ "$ran" = "$counted" ] && ! grep -q "the data ran out" <<<"$out"; then
  ok "--epochs 2 without --steps: $counted steps counted, $ran trained, the schedule spanning them"
else
  fail "--epochs without --steps: counted '$counted', ran '$ran': $(tail -5 <<<"$out")"
fi

# ---- streaming is the default with --dataset (TinyStories' train_optimized.py); --dataset-id is local ----
plain=()
for arg in "${unbounded[@]}"; do [ "$arg" = --use-streaming ] || plain+=("$arg"); done
out=$("$bin" "${plain[@]}" --dataset-id "$tmp/train.jsonl" --output_dir "$tmp/default" \
      --steps 2 2>&1)
if [ $? -eq 0 ] && grep -q "streaming 1 file(s)" <<<"$out" && grep -q "the seed's count: .* savings" <<<"$out"; then
  ok "--dataset-id streams by default: $(grep -m1 'streaming 1 file' <<<"$out" | cut -c1-90)"
else
  fail "streaming by default: $(tail -5 <<<"$out")"
fi

# ---- loaded whole, and --target-params ----
out=$("$bin" "${job[@]}" --use_streaming=false --dataset "$tmp/data/train.txt" --output_dir "$tmp/whole" \
      --target-params 60k 2>&1)
if [ $? -eq 0 ] && grep -q "loaded whole" <<<"$out" && grep -q -- "--target-params 6e+04 -> .* layers, d.*parameters" <<<"$out"; then
  ok "--dataset loaded whole; $(grep -m1 -- '--target-params' <<<"$out")"
else
  fail "loaded whole / --target-params: $(tail -5 <<<"$out")"
fi

# ---- CUDA (where a GPU is visible): the stream on the GPU under each precision ----
if has_gpu; then
  for setting in "fp32 none resident" "bf16 every int8" "fp16 selective resident" "bf16-pure every resident" \
                 "bf16 every pinned-host"; do
    read -r precision recompute state <<<"$setting"
    out=$("$bin" "${job[@]}" --dataset "$tmp/train.jsonl" --output_dir "$tmp/cuda_${precision}_${state}" --device cuda \
          --precision "$precision" --recompute "$recompute" --optimizer_state "$state" 2>&1)
    if [ $? -eq 0 ] && grep -q "held-out loss after" <<<"$out" && [ -s "$(final "$tmp/cuda_${precision}_${state}")" ]; then
      ok "cuda: $setting: $(grep -m1 'held-out loss after' <<<"$out" | cut -c1-60)"
    else
      fail "cuda: $setting: $(tail -5 <<<"$out")"
    fi
  done
else
  skip_runs 5 "--device cuda runs"
fi

# ---- --preserve_rng_state false: without dropout, checkpointing stays exact (the same weights) ----
"$bin" "${job[@]}" --dataset "$tmp/train.jsonl" --output_dir "$tmp/rng_on" --recompute every > /dev/null 2>&1
"$bin" "${job[@]}" --dataset "$tmp/train.jsonl" --output_dir "$tmp/rng_off" --recompute every \
  --preserve_rng_state false > "$tmp/rng_off.log" 2>&1
if [ -s "$(final "$tmp/rng_on")" ] && cmp -s "$(final "$tmp/rng_on")" "$(final "$tmp/rng_off")"; then
  ok "--preserve_rng_state false without dropout: the same weights after 8 checkpointed steps"
else
  fail "--preserve_rng_state false: $(tail -3 "$tmp/rng_off.log")"
fi

# ---- --init_model: a Hugging Face checkpoint (transformers' save_pretrained, a padded vocab_size)
# and its own tokenizer.json, made here; the training text from --dataset and the held-out text
# from DATA/val.txt, tokenized with it. Before training, the held-out loss is transformers' own on
# the same windows (fp32), which needs the same tokens and the same weights. ----
hf_job=(--data "$tmp/data" --seq_len 32 --micro_batch 4 --accum 1 --steps 1 --warmup 1 --log_interval 1000
        --eval_batches 1 --sample_tokens 8 --threads 1 --precision fp32 --recompute none)
if hf_python 5 "Hugging Face --init_model cases" &&
   hf_checkpoint "$tmp/hf" --text "$tmp/data/train.txt" --eval "$tmp/data/val.txt" --seq_len 32 --batch_size 4 --batches 1
then
  want=$(sed -n 's/^loss //p' "$tmp/hf.log")
  out=$("$bin" "${hf_job[@]}" --init_model "$tmp/hf" --dataset "$tmp/data/train.txt" --use-streaming \
        --output_dir "$tmp/hf_run" 2>&1)
  rc=$?
  got=$(sed -n 's/^held-out loss before training \([0-9.]*\) .*/\1/p' <<<"$out")
  if [ "$rc" -eq 0 ] && grep -q "tokenizer '$tmp/hf/tokenizer.json' (tokenizer.json, " <<<"$out" \
     && grep -q "initialised from $tmp/hf" <<<"$out" && grep -q "^sample: " <<<"$out" && close_to "$got" "$want" 1e-4; then
    ok "--init_model: held-out loss before training $got = transformers' $want on the same tokens (vocab 320, tokenizer 300 ids)"
  else
    fail "--init_model (rc $rc): held-out loss before training '$got', transformers' '$want': $(tail -8 <<<"$out")"
  fi
  expect_failure "init_model: DATA's shards with another tokenizer" "train.bin and val.bin hold the ids of .*tokenizer.model" \
    "$bin" "${hf_job[@]}" --init_model "$tmp/hf" --output_dir "$tmp/bad"
  expect_failure "init_model: a bare shard in --dataset with another tokenizer" \
    "train.bin' records its vocab_size but not the tokenizer" \
    "$bin" "${hf_job[@]}" --init_model "$tmp/hf" --dataset "$tmp/data/train.bin" --output_dir "$tmp/bad"
  expect_failure "init_model: shape flags" "--layers, --dim shape a model built here, but --init_model" \
    "$bin" "${hf_job[@]}" --init_model "$tmp/hf" --dataset "$tmp/data/train.txt" --layers 2 --dim 64 --output_dir "$tmp/bad"
  mkdir -p "$tmp/hf_small" && cp "$tmp/hf/"* "$tmp/hf_small/" &&
    sed -i -E 's/"vocab_size": *[0-9]+/"vocab_size": 64/' "$tmp/hf_small/config.json"
  expect_failure "init_model: vocab larger than the checkpoint's" \
    "tokenizer '.*hf_small/tokenizer.json' has [0-9]+ ids but --init_model .* embeds only 64" \
    "$bin" "${hf_job[@]}" --init_model "$tmp/hf_small" --dataset "$tmp/data/train.txt" --output_dir "$tmp/bad"
fi

# ---- bad input: the flag, file and line named, exit 1 ----
expect_error() {  # expect_error NAME PATTERN ARGS...
  local name="$1" pattern="$2"
  shift 2
  local out rc
  out=$("$bin" "${job[@]}" --output_dir "$tmp/bad" "$@" 2>&1)
  rc=$?
  if [ "$rc" -ne 0 ] && grep -q -- "$pattern" <<<"$out" && grep -q "HINT" <<<"$out"; then
    ok "$name: $(grep -m1 -o -- "$pattern.\{0,40\}" <<<"$out")"
  else
    fail "$name (exit $rc): $(tail -3 <<<"$out")"
  fi
}
expect_error "missing dataset" "does not exist" --dataset "$tmp/nope.txt"
expect_error "glob matching nothing" "matches no file" --dataset "$tmp/*.csv"
expect_error "wrong JSONL field" "train.jsonl:1: the record has no field \"content\"" --dataset "$tmp/train.jsonl" \
  --text_field content
printf '{"text": "ok"}\n{"text": \n' > "$tmp/broken.jsonl"
expect_error "broken JSONL line" "broken.jsonl:2: not valid JSON" --dataset "$tmp/broken.jsonl"
expect_error "--epochs without streaming" "--epochs and --stride shape a stream" --dataset "$tmp/train.jsonl" \
  --epochs 2 --use_streaming=false
expect_error "--split" "--split must be line or paragraph" --dataset "$tmp/train.jsonl" --split words
finish
