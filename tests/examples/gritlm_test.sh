#!/usr/bin/env bash
# examples/03_gritlm end to end on a tiny generated Brown-format corpus (3 genres, prepared by
# memopt_prepare_corpus) and a King James-format one (3 books, hard negatives from other chapters
# of the same book): plain, GradCache, split_emb and checkpointed bf16 runs train and
# evaluate; --attention sdpa and blockwise train, step 1's loss within 1e-4 of math's;
# --release_cache_every 1 runs; --workers defaults to auto (1 thread for this data, said so);
# the number of data workers does not change the result; the data-path timer runs;
# --memory_trace writes a Chrome trace; a run resumed from a checkpoint ends bit for bit as the
# one that wrote it; the saved model (with its tokenizer) loads with --init_model and evaluates as it
# ended; a Hugging Face checkpoint made here with transformers loads with its tokenizer.json, its
# embedding grown by the format symbols' mean rows; users' JSONL data trains,
# with malformed lines skipped (counted) or fatal (file:line); 2 ranks (started by hand, as
# torchrun would) on batches of 2 queries have step 1's loss and gradient norm of one process on
# the global batch of 4, plain and with GradCache (in-batch negatives gathered across ranks). Then
# bad input: each case must exit 1 (not crash) with a message naming the flag and the value
# seen, and a HINT.
# Usage: gritlm_test.sh path/to/gritlm path/to/memopt_prepare_corpus
set -uo pipefail
bin="$1"
prepare="$2"
source "$(dirname "$0")/lib.sh"

# ---- a tiny corpus: 3 genres x 8 documents of 20 word/tag sentences, a 120-piece BPE model ----
brown_corpus "$tmp/raw" "a b c" 8 9 1
if ! "$prepare" --corpus brown --raw "$tmp/raw" --out "$tmp/data" --vocab 120 --heldout_every 4 > /dev/null 2>&1; then
  echo "FAIL memopt_prepare_corpus could not prepare the test corpus"
  exit 1
fi

tiny=(--data "$tmp/data" --raw "$tmp/raw" --heldout_every 4 --hidden_size 32 --layers 1 --heads 2 --batch_size 4 --gen_batch_size 2
      --query_max_len 64 --passage_max_len 64 --gen_max_len 192 --eval_queries 8 --eval_gen 4 --threads 1
      --warmup 1 --log_interval 1 --steps 2 --precision fp32)

expect_run() {  # expect_run NAME ARGS... : exit 0, before/after evaluation, a summary line (output: $last_out)
  local name="$1" out
  shift
  out=$("$bin" "${tiny[@]}" "$@" 2>&1)
  local rc=$?
  last_out="$out"
  if [ "$rc" -ne 0 ]; then
    fail "$name: exit code != 0. Output: $out"
  elif ! grep -q "after 2 steps: held-out retrieval top-1" <<<"$out" || ! grep -q "padding" <<<"$out" ||
       ! grep -q "TF-IDF baseline" <<<"$out"; then
    fail "$name: no evaluation or data line in the output: $out"
  else
    ok "$name"
  fi
}
final_loss() { grep -o '"final_loss":[^,]*' "$1/metrics.jsonl" | tail -1; }
# first DIR FIELD: FIELD (loss, grad_norm) of DIR/metrics.jsonl's first train line (step 1, before any update).
first() { grep '"event":"train"' "$1/metrics.jsonl" 2> /dev/null | head -1 | grep -o "\"$2\":[^,}]*" | cut -d: -f2; }
# rel_close X Y REL: whether |X - Y| <= REL·|Y| (decimals; false when either is empty).
rel_close() {
  [ -n "$1" ] && [ -n "$2" ] && awk -v x="$1" -v y="$2" -v r="$3" 'BEGIN { d = x - y; if (d < 0) d = -d; if (y < 0) y = -y
    exit !(d <= r * y) }'
}

expect_run plain --output_dir "$tmp/plain"
expect_run gradcache --output_dir "$tmp/gc" --grad_cache_chunk 2

# ---- the King James format: 3 books x 6 chapters of 20 verses; chapters 4, 8, 12, 16 held out ----
kjv_corpus "$tmp/kjv_raw" "Ge Exo 1Sm" 6 20 9 1
if ! "$prepare" --raw "$tmp/kjv_raw" --out "$tmp/kjv_data" --vocab 120 --heldout_every 4 > /dev/null 2>&1; then
  fail "memopt_prepare_corpus could not prepare the King James-format test corpus"
fi
# the text file itself as --raw (the folder works as well: the bad-input cases below use it)
if out=$("$bin" "${tiny[@]}" --output_dir "$tmp/kjv" --data "$tmp/kjv_data" --raw "$tmp/kjv_raw/kjv.txt" 2>&1) &&
   grep -q "after 2 steps: held-out retrieval top-1" <<<"$out" &&
   grep -q "data: King James Bible (14 train / 4 held-out documents): " <<<"$out"; then
  ok "kjv: trains and evaluates on 14 train / 4 held-out chapters ($(grep -m1 -o '[0-9]* contrastive / [0-9]* generative train records' <<<"$out"))"
else
  fail "kjv: $out"
fi

# ---- checkpoints: a GradCache run resumed from another run's step-1 checkpoint ends as that run did ----
expect_run gc_saving --output_dir "$tmp/gc_saving" --grad_cache_chunk 2 --save_every 1
out=$("$bin" "${tiny[@]}" --output_dir "$tmp/gc_resumed" --grad_cache_chunk 2 \
      --resume "$tmp/gc_saving/checkpoints/step-00000001" 2>&1)
if [ $? -eq 0 ] && grep -q "gritlm: resumed at step 1" <<<"$out" \
   && cmp -s "$tmp/gc_saving/checkpoints/step-00000002/model.safetensors" "$tmp/gc_resumed/checkpoints/step-00000002/model.safetensors"; then
  ok "resume from step 1 (GradCache, prefetched batches): step 2's weights byte for byte the uninterrupted run's"
else
  fail "resume: $out"
fi
# --estimate_only: the table at the maximum lengths, no training; an upper bound of the
# GradCache run's measured peak (its texts are shorter than the maxima), within 2x of it.
out=$("$bin" "${tiny[@]}" --output_dir "$tmp/estimate" --grad_cache_chunk 2 --estimate_only 2>&1)
rc=$?
predicted=$(table_peak "$out")
measured=$(run_peak "$tmp/gc")
if [ "$rc" -ne 0 ] || [ -z "$predicted" ] || [ -z "$measured" ] || grep -q "retrieval" <<<"$out" \
   || ! ratio_between "$predicted" "$measured" 0.9 2; then
  fail "estimate_only: predicted '$predicted' MiB, the GradCache run measured '$measured' MiB: $out"
else
  ok "estimate_only: predicted $predicted MiB at the maximum lengths, the GradCache run measured $measured MiB"
fi
# --policies auto for a budget between the GradCache estimate and the plain one: a plan over
# checkpointing, precision and GradCache chunk (the batch is never split: its loss is the
# in-batch contrastive loss), a run whose measured peak stays within the budget (the estimate
# is at the maximum lengths: an upper bound).
plain=$(table_peak "$("$bin" "${tiny[@]}" --output_dir "$tmp/estimate" --estimate_only 2>&1)")
budget=$(awk -v g="$predicted" -v p="$plain" 'BEGIN { printf "%.1f", (g + p) / 2 }')
out=$("$bin" "${tiny[@]}" --output_dir "$tmp/auto" --policies auto --memory_budget "${budget}MiB" 2>&1)
within_budget "policies auto (plain estimate $plain MiB)" $? "$out" "$(run_peak "$tmp/auto")" "$budget" 1.0 "^chose "
# --finetune auto: an impossible budget names each way's least need (full > LoRA); LoRA's need
# takes LoRA, a roomy budget full fine-tuning; without a budget, an error.
out=$("$bin" "${tiny[@]}" --output_dir "$tmp/finetune" --finetune auto --memory_budget 64KiB --estimate_only 2>&1)
need() { sed -n "s/.*no way to fine-tune fits .*[:;] $1 \([0-9.]*\) MiB.*/\1/p" <<<"$out"; }
full_need=$(need full); lora_need=$(need lora)
if [ -n "$full_need" ] && [ -n "$lora_need" ] && awk -v f="$full_need" -v l="$lora_need" 'BEGIN { exit !(f > l) }'; then
  ok "--finetune auto, impossible budget: needs full $full_need > lora $lora_need MiB"
else
  fail "--finetune auto, impossible budget: $(tail -3 <<<"$out")"
fi
for spec in "1GiB full" "$(awk -v l="$lora_need" 'BEGIN { printf "%.3f", l + 0.01 }')MiB lora"; do
  read -r fb want <<<"$spec"
  out=$("$bin" "${tiny[@]}" --output_dir "$tmp/finetune" --finetune auto --memory_budget "$fb" --estimate_only 2>&1)
  if [ $? -eq 0 ] && grep -q "^chose $want fine-tuning" <<<"$out" && grep -q "^  \* $want" <<<"$out"; then
    ok "--finetune auto at $fb: $(grep "^  \* $want" <<<"$out" | cut -c1-90)"
  else
    fail "--finetune auto at $fb (want $want): $(grep -A4 '^finetune:' <<<"$out") $(tail -3 <<<"$out")"
  fi
done
expect_failure "--finetune auto without a budget" "--finetune auto picks full, LoRA or QLoRA for a budget" \
  "$bin" "${tiny[@]}" --output_dir "$tmp/err" --finetune auto
expect_run split_emb --output_dir "$tmp/split" --grad_cache_chunk 2 --split_emb
ckpt_bf16=(--grad_cache_chunk 3 --gradient_checkpointing --mixed_precision)
expect_run ckpt_bf16_gradcache --output_dir "$tmp/ckpt" "${ckpt_bf16[@]}"
# Its estimate (at the maximum lengths) bounds its measured peak: the bf16 GEMM speed probe a
# bf16 Trainer runs when built (3 MiB at 512^3, more than this model's step) is not counted.
out=$("$bin" "${tiny[@]}" --output_dir "$tmp/estimate" "${ckpt_bf16[@]}" --estimate_only 2>&1)
within_budget "ckpt_bf16_gradcache's estimate" $? "$out" "$(run_peak "$tmp/ckpt")" "$(table_peak "$out")" 1.0 "^  peak "
expect_run accum_token_loss --output_dir "$tmp/accum" --grad_accum 2 --gen_loss_type token --no_bucket
expect_run workers_0 --output_dir "$tmp/w0" --workers 0
expect_run workers_3 --output_dir "$tmp/w3" --workers 3 --prefetch 2
expect_run release_cache --output_dir "$tmp/release" --release_cache_every 1
# --attention: the same model through LibTorch's SDPA or the blockwise kernel (padding masked in
# the bidirectional embedding pass). Step 1's loss comes before any update: equal to math's but for
# fp32 summation order, times 1/temperature = 50 in the scores.
for kind in sdpa blockwise; do
  if out=$("$bin" "${tiny[@]}" --output_dir "$tmp/$kind" --attention "$kind" 2>&1) && grep -q "after 2 steps" <<<"$out" &&
     grep -q "; attention $kind" <<<"$out" && rel_close "$(first "$tmp/$kind" loss)" "$(first "$tmp/plain" loss)" 1e-4; then
    ok "--attention $kind trains; step 1's loss $(first "$tmp/$kind" loss), math's $(first "$tmp/plain" loss)"
  else
    fail "--attention $kind: step 1's loss '$(first "$tmp/$kind" loss)' vs math's '$(first "$tmp/plain" loss)': $out"
  fi
done
a=$(final_loss "$tmp/plain" | cut -d: -f2)
b=$(final_loss "$tmp/gc" | cut -d: -f2)
if [ -n "$a" ] && [ -n "$b" ] && awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-5 * (a > 1 ? a : 1)) }'
then
  ok "GradCache trains like the whole batch ($(final_loss "$tmp/gc"))"
else
  fail "GradCache: $(final_loss "$tmp/gc") vs plain $(final_loss "$tmp/plain")"
fi
if [ "$(final_loss "$tmp/w0")" = "$(final_loss "$tmp/w3")" ] && [ -n "$(final_loss "$tmp/w0")" ]; then
  ok "0 and 3 data workers give the same run ($(final_loss "$tmp/w0"))"
else
  fail "workers: $(final_loss "$tmp/w0") with 0 vs $(final_loss "$tmp/w3") with 3"
fi
# the memory timeline of the first step, as a Chrome trace
if out=$("$bin" "${tiny[@]}" --output_dir "$tmp/trace" --memory_trace 1 --grad_cache_chunk 2 2>&1) &&
   check=$(python3 - "$tmp/trace/memory.trace.json" <<'PY' 2>&1
import json, sys
events = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if "ts" in e]
ts = [e["ts"] for e in events]
assert ts == sorted(ts), "timestamps go back"
counters = [e for e in events if e["ph"] == "C"]
slices = {e["name"] for e in events if e["ph"] == "X"}
assert len(counters) > 100 and {"forward", "backward", "optimizer"} <= slices, (len(counters), slices)
print(f"{len(counters)} memory points, slices {sorted(slices)}")
PY
); then
  ok "--memory_trace writes an ordered Chrome trace ($check)"
else
  fail "memory_trace: ${check:-} $out"
fi

# the saved model continues: its held-out numbers before training are the first run's after
field() { grep -o "\"$2\":[^,]*" "$1/metrics.jsonl" | tail -1 | cut -d: -f2; }
if out=$("$bin" "${tiny[@]}" --output_dir "$tmp/cont" --init_model "$tmp/plain/model" 2>&1) &&
   grep -q "gritlm: pretrained ($tmp/plain/model) LLaMA 1 layers, d32" <<<"$out" &&
   [ -n "$(field "$tmp/plain" retrieval_mrr_after)" ] &&
   [ "$(field "$tmp/plain" retrieval_mrr_after)" = "$(field "$tmp/cont" retrieval_mrr_before)" ] &&
   [ "$(field "$tmp/plain" perplexity_after)" = "$(field "$tmp/cont" perplexity_before)" ]; then
  ok "--init_model continues from the saved model (MRR $(field "$tmp/cont" retrieval_mrr_before), perplexity $(field "$tmp/cont" perplexity_before))"
else
  fail "init_model: plain after MRR $(field "$tmp/plain" retrieval_mrr_after) ppl $(field "$tmp/plain" perplexity_after), continued before MRR $(field "$tmp/cont" retrieval_mrr_before) ppl $(field "$tmp/cont" perplexity_before). Output: $out"
fi
if [ -s "$tmp/plain/model/tokenizer.model" ] && cmp -s "$tmp/plain/model/tokenizer.model" "$tmp/data/tokenizer.model"; then
  ok "the saved model folder holds its tokenizer (--init_model reads it)"
else
  fail "no tokenizer.model (DATA's) in $tmp/plain/model: $(ls "$tmp/plain/model")"
fi

# ---- --init_model from a Hugging Face checkpoint (tied embeddings, vocab_size = its tokenizer.json's),
# made here with transformers: its tokenizer is the default, the 3 format symbols get new rows, each
# the mean of the checkpoint's rows. At --lr 1e-9 two steps move no weight by more than ~1e-8, so
# the saved model is the checkpoint, its embedding grown by those rows, still tied, with its tokenizer. ----
if hf_python 2 "Hugging Face --init_model cases" && hf_checkpoint "$tmp/hf" --text "$tmp/data/train.txt" --pad_to 1 --tied
then
  out=$("$bin" "${tiny[@]}" --output_dir "$tmp/hf_run" --init_model "$tmp/hf" --lr 1e-9 2>&1)
  rc=$?
  if [ "$rc" -eq 0 ] && grep -q "tokenizer '$tmp/hf/tokenizer.json' (tokenizer.json, [0-9]* ids + 3 format symbols); .* grown to" <<<"$out" &&
     check=$("$hf_py" - "$tmp/hf" "$tmp/hf_run/model" <<'PY' 2>&1
import json, sys
import torch
from safetensors.torch import load_file
ck, out = sys.argv[1], sys.argv[2]
a, b = load_file(ck + "/model.safetensors"), load_file(out + "/model.safetensors")
config = json.load(open(out + "/config.json"))
embed = "model.embed_tokens.weight"
V = a[embed].shape[0]
assert set(a) == set(b) and "lm_head.weight" not in b, sorted(set(a) ^ set(b))
assert config["tie_word_embeddings"] and config["vocab_size"] == V + 3 == b[embed].shape[0], (config, V)
assert torch.allclose(b[embed][:V], a[embed], rtol=0, atol=1e-6), "the checkpoint's rows moved"
mean = a[embed].mean(0, keepdim=True).expand(3, -1)
assert torch.allclose(b[embed][V:], mean, rtol=0, atol=1e-6), (b[embed][V:, :4], mean[:, :4])
for name in a:
    assert torch.allclose(a[name], b[name][:a[name].shape[0]], rtol=0, atol=1e-6), name
assert open(ck + "/tokenizer.json", "rb").read() == open(out + "/tokenizer.json", "rb").read(), "tokenizer.json"
print(f"{len(a)} tensors as loaded, embedding {V} -> {V + 3} rows (new rows = the mean)")
PY
); then
    ok "--init_model from a Hugging Face checkpoint: $check"
  else
    fail "--init_model from a Hugging Face checkpoint (rc $rc): ${check:-} $(tail -8 <<<"$out")"
  fi
  mkdir -p "$tmp/hf_small" && cp "$tmp/hf/"* "$tmp/hf_small/" &&
    sed -i -E 's/"vocab_size": *[0-9]+/"vocab_size": 64/' "$tmp/hf_small/config.json"
  expect_failure "--init_model: a tokenizer larger than the checkpoint's embedding" \
    "has vocab_size 64 but the tokenizer '.*hf_small/tokenizer.json' has [0-9]+ pieces" \
    "$bin" "${tiny[@]}" --output_dir "$tmp/err" --init_model "$tmp/hf_small"
fi

mkdir -p "$tmp/other_vocab" && cp "$tmp/plain/model/model.safetensors" "$tmp/other_vocab/" &&
  sed 's/"vocab_size": *[0-9]*/"vocab_size": 100/' "$tmp/plain/model/config.json" > "$tmp/other_vocab/config.json"
# --workers auto (the default): 1 per 2000 train records, at least 1 — this corpus's few hundred give 1
if out=$("$bin" "${tiny[@]}" --output_dir "$tmp/dataonly_auto" --data_only 2>&1) &&
   grep -q "data: --workers auto -> 1 batch-building thread (1 per 2000 of the [0-9]* train records" <<<"$out" &&
   grep -q "data path: 2 batches, 1 workers" <<<"$out"; then
  ok "--workers auto by default: $(grep -m1 -o 'workers auto -> .*' <<<"$out" | head -c 120)"
else
  fail "workers auto: $out"
fi
if out=$("$bin" "${tiny[@]}" --output_dir "$tmp/dataonly" --data_only --workers 2 2>&1) &&
   grep -q "data path: 2 batches, 2 workers" <<<"$out" && grep -q '"batches_per_s"' "$tmp/dataonly/metrics.jsonl"; then
  ok "data_only times the data path"
else
  fail "data_only: $out"
fi

# ---- users' JSONL: a malformed line is skipped and counted, or fatal with file:line ----
{
  for i in 1 2 3 4 5 6 7 8 9 10; do  # query i and its positive share word i (the corpus's words; digits are unknown)
    printf '{"query": "%s %s slow", "pos": "%s train tokens", "neg": ["models fast %s"], "instruction": "Find the next part"}\n' \
      "${brown_words[$i]}" "${brown_words[$i]}" "${brown_words[$i]}" "${brown_words[$((i + 1))]}"
  done
  printf '{"query": "a line without a positive", "neg": ["x"]}\n'
} > "$tmp/embed.jsonl"
for i in 1 2 3 4 5 6; do printf '{"prompt": "Continue: the quick %s", "answer": "brown fox %s."}\n' "$i" "$i"; done > "$tmp/gen.jsonl"
if out=$("$bin" "${tiny[@]}" --output_dir "$tmp/jsonl" --embed_jsonl "$tmp/embed.jsonl" --gen_jsonl "$tmp/gen.jsonl" \
           --heldout_embed_jsonl "$tmp/embed.jsonl" --heldout_gen_jsonl "$tmp/gen.jsonl" 2>&1) &&
   grep -q "1 malformed lines skipped (first: $tmp/embed.jsonl:11: " <<<"$out" && grep -q "after 2 steps" <<<"$out" &&
   [ "$(field "$tmp/jsonl" tfidf_top1)" = "1.0" ]; then
  ok "JSONL data trains; the malformed line is skipped and reported; TF-IDF finds each query's shared word (top-1 $(field "$tmp/jsonl" tfidf_top1))"
else
  fail "JSONL skip (TF-IDF MRR $(field "$tmp/jsonl" tfidf_mrr)): $out"
fi

# ---- data parallel: 2 ranks of --batch_size 2 against one process of --batch_size 4 on the same
# records: contrastive-only JSONL data (the generative loss is a per-rank token mean), --no_bucket
# (batch b holds records [bB, (b+1)B) of the epoch's order: rank r's first batch, b = r, is the
# one process's rows [2r, 2r + 2)). Each rank scores its queries against both ranks' passages, so
# step 1's loss and gradient norm are the one process's, up to fp32 summation order; without the
# gather each query would see 4 passages instead of 8 (a loss ~log 2 lower at the start).
dp=(--embed_jsonl "$tmp/embed.jsonl" --heldout_embed_jsonl "$tmp/embed.jsonl" --no_bucket --eval_gen 0)
two_ranks() {  # two_ranks OUT ARGS...: both ranks on loopback (the variables torchrun sets); logs OUT.rank{0,1}.log
  local out="$1" port=$(( 20000 + RANDOM % 30000 )) pid rc
  shift
  RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port MEMOPT_DIST_TIMEOUT=60 \
    "$bin" "$@" --output_dir "$out" > "$out.rank1.log" 2>&1 &
  pid=$!
  RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port MEMOPT_DIST_TIMEOUT=60 \
    "$bin" "$@" --output_dir "$out" > "$out.rank0.log" 2>&1
  rc=$?
  wait "$pid" || rc=1
  return "$rc"
}
"$bin" "${tiny[@]}" "${dp[@]}" --batch_size 4 --output_dir "$tmp/dp_one" > "$tmp/dp_one.log" 2>&1 ||
  fail "data parallel: the one-process run on 4 queries failed: $(tail -3 "$tmp/dp_one.log")"
for chunk in 0 1; do
  run="$tmp/dp_chunk$chunk"
  if two_ranks "$run" "${tiny[@]}" "${dp[@]}" --batch_size 2 --grad_cache_chunk "$chunk" &&
     grep -q "in-batch negatives from all 2 ranks: each query against 8 passages" "$run.rank0.log" &&
     rel_close "$(first "$run" loss)" "$(first "$tmp/dp_one" loss)" 1e-5 &&
     rel_close "$(first "$run" grad_norm)" "$(first "$tmp/dp_one" grad_norm)" 1e-4; then
    ok "2 ranks x 2 queries (--grad_cache_chunk $chunk): step 1's loss $(first "$run" loss), grad norm $(first "$run" grad_norm): one process's on 4 queries"
  else
    fail "2 ranks (--grad_cache_chunk $chunk): loss '$(first "$run" loss)' vs '$(first "$tmp/dp_one" loss)', grad norm '$(first "$run" grad_norm)' vs '$(first "$tmp/dp_one" grad_norm)': $(tail -5 "$run.rank0.log") $(tail -5 "$run.rank1.log")"
  fi
done

# ---- CUDA (where a GPU is visible): plain, and GradCache with checkpointing and bf16 ----
if has_gpu; then
  expect_run cuda_plain --output_dir "$tmp/cuda_plain" --device cuda
  expect_run cuda_ckpt_bf16_gradcache --output_dir "$tmp/cuda_ckpt" --device cuda:0 --grad_cache_chunk 3 \
    --gradient_checkpointing --mixed_precision
  expect_run cuda_fp16_gradcache --output_dir "$tmp/cuda_fp16" --device cuda --grad_cache_chunk 3 --precision fp16
  if grep -q "precision::Fp16Scaled" <<<"$last_out"; then ok "cuda: --precision fp16 trained with precision::Fp16Scaled"
  else fail "cuda: --precision fp16 did not run precision::Fp16Scaled: $last_out"; fi
  expect_run cuda_pinned_host --output_dir "$tmp/cuda_pinned" --device cuda --optimizer_state pinned-host \
    --mixed_precision --gradient_checkpointing
  if grep -q "state::PinnedHost" <<<"$last_out"; then ok "cuda: --optimizer_state pinned-host trained with state::PinnedHost"
  else fail "cuda: --optimizer_state pinned-host did not run state::PinnedHost: $last_out"; fi
else
  skip_runs 6 "--device cuda runs"
fi

# ---- bad input ----
expect_error() {  # expect_error NAME REGEX ARGS...
  local name="$1" regex="$2"
  shift 2
  expect_failure "$name" "$regex" "$bin" "${tiny[@]}" --output_dir "$tmp/err" "$@"
}

expect_error jsonl_fatal "embed.jsonl:11: .*pos" --embed_jsonl "$tmp/embed.jsonl" --on_bad_line fatal
expect_error bad_on_bad_line "on_bad_line must be skip or fatal \(got 'ignore'\)" --on_bad_line ignore
expect_error zero_batch "batch_size must be >= 1 \(got 0\)" --batch_size 0
expect_error negative_chunk "grad_cache_chunk must be >= 0 \(got -1\)" --grad_cache_chunk -1
expect_error split_without_chunk "split_emb needs --grad_cache_chunk" --split_emb
expect_error gen_loss_type "gen_loss_type must be mixed or token \(got 'avg'\)" --gen_loss_type avg
expect_error temperature "temperature must be a positive number \(got 0\)" --temperature 0
expect_error bad_policies "policies must be fixed or auto \(got 'best'\)" --policies best
expect_error bad_budget "memory_budget must be a positive size .*got '12parsecs'" --memory_budget 12parsecs
expect_error split_emb_auto "split_emb fixes GradCache's layout" --grad_cache_chunk 2 --split_emb --policies auto
expect_error impossible_budget "no policy combination fits .*smallest chunk" --policies auto --memory_budget 1KiB
expect_error negative_workers "workers must be >= 0 \(got -1\)" --workers -1
expect_error workers_word "workers must be auto or a number of threads \(got 'many'\)" --workers many
expect_error bad_attention "attention must be math, blockwise, sdpa, flash or auto \(got 'fastest'\)" --attention fastest
expect_error negative_release "release_cache_every must be >= 0 \(got -1\)" --release_cache_every -1
expect_error missing_jsonl "$tmp/none.jsonl" --embed_jsonl "$tmp/none.jsonl"
expect_error missing_raw "King James text '$tmp/no_raw' does not exist" --raw "$tmp/no_raw"
mkdir -p "$tmp/kjv_bad" && sed '3s/^Ge1:3 /Ge1-3 /' "$tmp/kjv_raw/kjv.txt" > "$tmp/kjv_bad/kjv.txt"
expect_error kjv_bad_line "kjv_bad/kjv.txt:3: not a verse line \(got 'Ge1-3 " --raw "$tmp/kjv_bad"
expect_error bad_device "device must be cpu or cuda\[:N\] \(got 'tpu'\)" --device tpu
expect_error bad_precision "precision must be auto, fp32, bf16 or fp16 \(got 'fp8'\)" --precision fp8
expect_error fp16_on_cpu "--precision fp16 needs a CUDA device \(got --precision fp16 with --device cpu\)" \
  --precision fp16 --device cpu
expect_error pinned_host_on_cpu "pinned-host keeps AdamW's state in pinned host memory for training on a GPU \(got --device cpu\)" \
  --optimizer_state pinned-host --device cpu
if ! nvidia-smi -L > /dev/null 2>&1; then  # no GPU here: a CUDA run must stop at start, saying why
  expect_error cuda_without_gpu "device cuda: (no CUDA GPU is visible|this build's LibTorch .* has no CUDA)" --device cuda
fi
expect_error missing_tokenizer "$tmp/no_data/tokenizer.model" --data "$tmp/no_data"
expect_error missing_init_model "init_model '$tmp/none' lacks config.json" --init_model "$tmp/none"
expect_error init_model_vocab "has vocab_size 100 but the tokenizer .* has 120 pieces \(123 with" --init_model "$tmp/other_vocab"
expect_error batch_over_records "fewer than batch_size" --batch_size 100000

finish
