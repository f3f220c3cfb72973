#!/usr/bin/env bash
# The whole test command: set up, lint, type-check, run every test tier. CI (.ci/run) calls this.
# Extra arguments go to pytest (e.g. `scripts/test.sh -m unit`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
echo "== ruff"; ruff check .
echo "== mypy"; scripts/typecheck.sh
echo "== pytest"
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi
exit "$rc"
