#!/usr/bin/env bash
# GPU run of the model runner (issue 28): its GPU tests, then benchmarks/step.py beside the eager
# path. Run from the repo root on a CUDA host (carry build/gpu_pydeps for pytest:
# `bash scripts/gpu_kernels.sh --prepare-deps` here first; carry build/gpu_wheels with a msgspec
# wheel for the host's Python, which its image lacks):
#
#     OUT=/some/dir bash scripts/gpu_runner.sh
#     PART=bench CONTEXTS="4096 65536" BATCHES="1 32" bash scripts/gpu_runner.sh
#
# Outputs in $OUT: env.txt, gpu-tests.log, decode-step-h200.json, step.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu_runner}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
tree=build/gpu_tree
source scripts/gpu_tree.sh && make_gpu_tree "$tree"
if ls build/gpu_wheels/*.whl >/dev/null 2>&1; then  # msgspec: not in the GPU host's image
  "$PY" -m pip install --quiet --upgrade --no-deps --no-index --target build/gpu_site build/gpu_wheels/*.whl
fi
export PYTHONPATH="$PWD/$tree:$PWD/build/gpu_site:$PWD/build/gpu_pydeps${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,utilization.gpu --format=csv >> "$OUT/env.txt"
if [ "${PART:-all}" != "bench" ]; then
  timeout "${TESTS_S:-150}" "$PY" -P -m pytest -q -p no:cacheprovider \
    tests/unit/test_runner_gpu.py 2>&1 | tail -40 | tee "$OUT/gpu-tests.log"
fi
if [ "${PART:-all}" != "tests" ]; then
  timeout "${BENCH_S:-400}" "$PY" -P benchmarks/step.py --contexts ${CONTEXTS:-4096 65536} \
    --batches ${BATCHES:-1 32} --released-attention ${RELEASED:-both} --steps ${STEPS:-5} \
    --paths ${PATHS:-eager graph} \
    --out "$OUT/decode-step-h200.json" 2>&1 | tee "$OUT/step.log"
fi
