#!/usr/bin/env bash
# tests/scripts/test_names_test.sh BINARY — every Catch2 test case of BINARY can be registered
# with ctest. catch_discover_tests reads the names as a CMake list: a ';' splits a name, and a
# '[' or ']' groups the names after it, so such names (and those that follow) silently never run.
set -euo pipefail
bad=$("$1" --list-test-names-only | grep '[][;]' || true)
if [[ -n $bad ]]; then
  echo "FAIL: test names with ';', '[' or ']' (ctest cannot register them, so they never run):" >&2
  echo "$bad" >&2
  echo "HINT: use ',' instead of ';', and no brackets, in TEST_CASE names (tags go in the second argument)" >&2
  exit 1
fi
echo "test names: $("$1" --list-test-names-only | grep -c .) listed, none with ';', '[' or ']'"
