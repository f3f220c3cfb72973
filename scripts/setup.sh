#!/usr/bin/env bash
# Create .venv and install cedserve with its dev extras, from a clean clone. Idempotent.
# torch goes in first, pinned to the CPU build that lies on the dev/CI machines' disk: anything that
# depends on an unpinned torch (nixl does) would otherwise pull a multi-GB CUDA build.
# On a GPU host with torch already in the environment, set CEDSERVE_TORCH=skip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ "${CEDSERVE_TORCH:-}" != "skip" ]; then
  .venv/bin/python -m pip install -q "torch==${CEDSERVE_TORCH:-2.13.0}"
fi
.venv/bin/python -m pip install -q -e '.[dev]'
# numba (a dependency: the router's request path is compiled with it, router/jit.py) is imported here so
# that a machine where its wheel did not install fails here, not when a router starts.
.venv/bin/python -c "import cedserve, numba, torch; print('cedserve', cedserve.__version__, 'torch', torch.__version__, 'numba', numba.__version__)"
