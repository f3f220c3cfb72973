#!/usr/bin/env bash
# Re-render helm/cedserve/golden/*.yaml (chart defaults + each examples/*.yaml) after a chart change.
# `--check` only compares. Needs the dev extra (helm-python-sdk): scripts/setup.sh installs it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
exec "$PY" helm/chart_golden.py "$@"
