# scripts/env.sh — sourced by the scripts: repository root, build settings shared by
# scripts/test, scripts/demo and scripts/bench.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# ccache may reuse objects built with the precompiled header only with these settings.
export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
# Paths relative to the checkout: a fresh clone elsewhere (CI) reuses this machine's cache.
export CCACHE_BASEDIR="$ROOT"
JOBS="${JOBS:-$(nproc)}"
GENERATOR=(-G Ninja)
# The Python that reads Parquet sources for memopt (memopt/data/parquet.hpp): the project's venv,
# which scripts/deps fills with pyarrow, unless the caller chose one. Set even before the venv
# exists: scripts/test sources this first and runs scripts/deps, which makes it, afterwards.
if [ -z "${MEMOPT_PYTHON:-}" ]; then export MEMOPT_PYTHON="$ROOT/.venv/bin/python3"; fi
