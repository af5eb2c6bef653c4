# tests/examples/brown_corpus.sh — sourced by the example tests: writes a tiny corpus in the
# Brown corpus's format (files c<genre><NN> of tab-indented word/tag sentences) for
# memopt_prepare_corpus. Deterministic: the same arguments give the same bytes.
#   brown_corpus DIR GENRES DOCS WORDS OFFSET
#     GENRES: genre letters ("a" or "a b c"); DOCS: documents per genre (named 01, 02, …); WORDS: words per
#     sentence (20 sentences a document); OFFSET: added to every word index.
# brown_words holds the 16 words it draws from.
brown_words=(the quick brown fox jumps over a lazy dog while memory models train tokens fast slow)
brown_corpus() {
  local dir="$1" genres="$2" docs="$3" nwords="$4" offset="$5" g f l w line
  mkdir -p "$dir"
  for g in $genres; do
    for f in $(seq -f %02g 1 "$docs"); do
      for l in $(seq 1 20); do
        line=""
        for w in $(seq 1 "$nwords"); do line+="${brown_words[$(( (10#$f * 7 + l * 3 + w * 5 + offset) % 16 ))]}/nn "; done
        printf '\t%s./.\n' "$line"
      done > "$dir/c$g$f"
    done
  done
}
