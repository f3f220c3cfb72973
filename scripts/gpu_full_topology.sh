#!/usr/bin/env bash
# Full topology on a CUDA host (benchmarks/full_topology.py): a prefill worker on GPU 0 and a decode
# pool on the next GPUs (EP=2 on GPUs 1-2 with GPUS=3; one rank on GPU 1 with GPUS=2), against
# colocated serving on the same GPUs, mini-40 random real-format checkpoint. Run from the repo root:
#
#     OUT=/some/dir GPUS=2 SITE=/tmp/site bash scripts/gpu_full_topology.sh [full_topology.py args]
#
# e.g. `--colocated-policies cache_aware,least_loaded,round_robin` adds the policy table (MAX_RUN_S
# bounds each arm's sending time).
# writes env.txt, bench.log, full-topology-h200x$GPUS.json (+ PNG plots) and logs/ (every process).
# As in scripts/gpu_decode.sh the project need not be installed: a symlink tree puts `cedserve.*` on
# PYTHONPATH, with build/gpu_site (wheels from build/gpu_wheels) and $SITE (nixl) after it.
# PYTHONSAFEPATH keeps the checkout's own cedserve/ folder (which lacks the sibling packages) from
# shadowing the tree in the worker processes, which start as `python -m cedserve.cli` in this folder.
# The whole run is bounded by BENCH_S seconds (default 340); each arm stops sending after 60 s.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu_full_topology}
PY=${PYTHON:-python3}
GPUS=${GPUS:-2}
mkdir -p "$OUT"
tree=build/gpu_tree
source scripts/gpu_tree.sh && make_gpu_tree "$tree"
if ls build/gpu_wheels/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install --quiet --upgrade --no-deps --no-index --target build/gpu_site build/gpu_wheels/*.whl
fi
export PYTHONPATH="$PWD/$tree:$PWD/build/gpu_site:${SITE:-/tmp/site}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1 CEDSERVE_HOME="$PWD/build/cedserve_home"
"$PY" -c "import torch; print(torch.__version__, torch.cuda.device_count(), torch.cuda.get_device_name(0))" \
  | tee "$OUT/env.txt"
"$PY" -c "
import importlib
for m in ('grpc', 'msgspec', 'tokenizers', 'safetensors', 'prometheus_client', 'grpc_health', 'grpc_reflection',
          'nixl_cu13', 'nixl_cu12', 'tqdm', 'matplotlib'):
    try:
        importlib.import_module(m); print('have', m)
    except ImportError as exc:
        print('MISSING', m, exc)
" | tee -a "$OUT/env.txt"
timeout "${BENCH_S:-340}" "$PY" benchmarks/full_topology.py --gpus "$GPUS" --max-run-s "${MAX_RUN_S:-60}" --no-progress \
  --out "$OUT/full-topology-h200x$GPUS.json" --log-dir "$OUT/logs" "$@" 2>&1 | grep -v NIXL | tee "$OUT/bench.log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
