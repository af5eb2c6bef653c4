#!/usr/bin/env bash
# examples/04_custom_policy: a policy defined outside include/ (custom::Bf16Moments) reached from
# its flag, weighed by the estimator and the planner, trained within 10% of its estimated peak,
# and resumed from a checkpoint bit-identically.
#   bash tests/examples/custom_policy_test.sh build/examples/04_custom_policy/custom_policy
set -euo pipefail
bin=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
peak_of() { sed -n 's/^estimate: peak \([0-9]*\) bytes$/\1/p' <<<"$1"; }

# 1. The flag reaches the estimator through the policy's describe(): half the resident state.
none=$(peak_of "$("$bin" --optimizer_state resident --estimate_only)")
mine_out=$("$bin" --offload bf16-moments --estimate_only)  # the earlier flag name, an alias
mine=$(peak_of "$mine_out")
[[ -n $none && -n $mine ]] || fail "no estimate line"
grep -q "state=bf16-moments" <<<"$mine_out" || fail "the flag did not select bf16-moments"
(( mine < none )) || fail "bf16 moments should need less than AdamW's fp32 state ($mine vs $none bytes)"

# 2. The planner weighs it: with no budget plain AdamW wins (faster); between the two peaks only it fits.
"$bin" --policies auto --estimate_only | grep -q "^chose recompute=none precision=fp32 state=resident " \
  || fail "without a budget the faster plain AdamW should be chosen"
budget=$(( (none + mine) / 2 ))
plan=$("$bin" --policies auto --memory_budget "$budget" --estimate_only)
grep -q "^chose recompute=none precision=fp32 state=bf16-moments " <<<"$plan" \
  || { echo "$plan"; fail "at a budget of $budget bytes the planner should choose bf16-moments"; }

# 3. The Trainer runs it: the measured peak within 10% of the estimate; a resumed run is bit-identical.
run=$("$bin" --optimizer-state bf16-moments --steps 6 --check_resume --output_dir "$out/run")
echo "$run"
error=$(sed -n 's/^measured: .*error \([-+][0-9.]*\)%)$/\1/p' <<<"$run")
[[ -n $error ]] || fail "no measured line"
awk -v e="$error" 'BEGIN { exit !(e >= -10 && e <= 10) }' || fail "estimate off by $error% (more than 10%)"
grep -q "^resume: bit-identical" <<<"$run" || fail "the resumed run differs"

# 4. A value the compiled list does not hold: the flag, the value, the choices, a HINT; exit 1.
set +e
err=$("$bin" --optimizer_state nvme --estimate_only 2>&1); rc=$?
set -e
(( rc == 1 )) || fail "bad --optimizer_state exited $rc"
grep -q "optimizer_state must be resident, bf16-moments (got 'nvme')" <<<"$err" && grep -q HINT <<<"$err" \
  || { echo "$err"; fail "bad --optimizer_state error"; }
echo "custom_policy: all checks passed"
