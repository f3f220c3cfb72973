#!/usr/bin/env bash
# Run a pytest selection under each CPU kernel setting in turn, as the numerics tests are checked
# (tests/unit/near_ties.py): the machine's best ISA, AVX2 and SSE4.2/no-vector ATen and MKL kernels.
# One after another in the same shell, so they share whatever caches a user's runs would share.
#   ROUNDS=3 scripts/cpu_matrix.sh tests/unit/test_fused.py -k compiled
# Prints one line per run; exits non-zero if any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
settings=(
    ""
    "ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2"
    "ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2"
)
failed=0
for round in $(seq "${ROUNDS:-1}"); do
    for setting in "${settings[@]}"; do
        log=$(mktemp)
        # shellcheck disable=SC2086  # the setting is a list of NAME=value words
        env -u ATEN_CPU_CAPABILITY -u MKL_ENABLE_INSTRUCTIONS $setting .venv/bin/python -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1
        rc=$?
        echo "round $round [${setting:-best ISA}] rc=$rc: $(tail -n 1 "$log")"
        if [ "$rc" -ne 0 ]; then
            failed=1
            grep -E "^(FAILED|ERROR)|difference: nan|^E .*error" "$log" | head -n 5
        fi
        rm -f "$log"
    done
done
exit "$failed"
