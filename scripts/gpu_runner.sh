#!/usr/bin/env bash
# GPU run of the model runner (issue 28), within one 10-minute device call: its GPU tests, then
# benchmarks/step.py (the step as forward_batch and as a graph replay, side by side) for mini-40 at
# 4K / 64K x batch 1 / 32 and the released attention geometry at 64K x 32, then benchmarks/decode.py
# (the real decode engine, runner off and auto). Run from the repo root on a CUDA host, carrying
# build/gpu_wheels (msgspec and a grpcio new enough for the generated code: the image lacks them):
#
#     OUT=/some/dir bash scripts/gpu_runner.sh
#     PART=bench bash scripts/gpu_runner.sh        # PART=tests | step | engine | bench (step + engine)
#
# Outputs in $OUT: env.txt, gpu-tests.log, decode-step-h200.json (+ -released.json), step.log,
# decode-engine-h200.json, engine.log. Each part has its own timeout (TESTS_S, STEP_S, RELEASED_S,
# ENGINE_S) so the whole stays under 10 minutes.
#
#     bash scripts/gpu_runner.sh --prepare-wheels  # here first: the wheels into build/gpu_wheels
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--prepare-wheels" ]; then
  mkdir -p build/gpu_wheels
  for req in msgspec "grpcio>=1.85.1"; do
    .venv/bin/python -m pip download -q "$req" --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d build/gpu_wheels
  done
  ls -la build/gpu_wheels
  exit 0
fi
OUT=${OUT:-build/gpu_runner}
PY=${PYTHON:-python3}
PART=${PART:-all}
mkdir -p "$OUT"
tree=build/gpu_tree
source scripts/gpu_tree.sh && make_gpu_tree "$tree" && install_gpu_wheels "$PY"
export PYTHONPATH="$PWD/$tree:$PWD/build/gpu_site${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,utilization.gpu --format=csv >> "$OUT/env.txt"
quiet() { grep -v "USDT\|profiler_st\|_warn_once\|UserWarning\|sync_debug"; }
if [ "$PART" = all ] || [ "$PART" = tests ]; then
  timeout "${TESTS_S:-130}" "$PY" -P -m pytest -q -p no:cacheprovider --tb=short tests/unit/test_runner_gpu.py 2>&1 \
    | tail -120 | tee "$OUT/gpu-tests.log"
fi
if [ "$PART" = all ] || [ "$PART" = bench ] || [ "$PART" = step ]; then
  timeout "${STEP_S:-220}" "$PY" -P benchmarks/step.py --contexts 4096 65536 --batches 1 32 --rows 1 6 --steps 5 \
    --warmup 3 --paths eager graph graph-fused --out "$OUT/decode-step-h200.json" 2>&1 | quiet | tee "$OUT/step.log"
  timeout "${RELEASED_S:-110}" "$PY" -P benchmarks/step.py --released-attention yes --contexts 65536 \
    --batches 32 --steps 5 --warmup 3 --paths eager graph graph-fused --out "$OUT/decode-step-h200-released.json" 2>&1 \
    | quiet | tee -a "$OUT/step.log"
fi
if [ "$PART" = all ] || [ "$PART" = bench ] || [ "$PART" = engine ]; then
  timeout "${ENGINE_S:-120}" "$PY" -P benchmarks/decode.py --device cuda --preset mini-40 --contexts 4096 \
    --batches 1 32 --steps 5 --warmup-steps 3 --runner off auto --out "$OUT/decode-engine-h200.json" 2>&1 \
    | quiet | tee "$OUT/engine.log"
fi
