#!/usr/bin/env bash
# cmake/syntax_only.sh COMPILER ARGS... — the compiler launcher of targets compiled only to be
# checked (MEMOPT_BENCHMARKS_CHECK_ONLY): the same command with -fsyntax-only (parsed and every
# template instantiated, no code generated: ~2.3x faster than -O1 on trainer_bench.cpp), then the
# empty object file the build tool expects under -o. The dependency file (-MF) is written as usual.
set -euo pipefail
out="" prev=""
for arg in "$@"; do
  [[ $prev == -o ]] && out=$arg
  prev=$arg
done
"$@" -fsyntax-only
if [[ -n $out ]]; then : > "$out"; fi
