#!/usr/bin/env bash
# GPU kernel run: the kernel tests marked `gpu` (realistic shapes), then benchmarks/kernels.py
# (correctness at realistic shapes, then timings). Run from the repo root on a CUDA host:
#
#     OUT=/some/dir bash scripts/gpu_kernels.sh      # writes into $OUT (default build/gpu_kernels)
#     PART=tests bash scripts/gpu_kernels.sh         # only the tests (PART=bench: only the benchmark)
#     QUICK=1 bash scripts/gpu_kernels.sh            # tests + only the benchmark sections marked quick
#     QUICK=1 ATTN_SDPA=1 bash scripts/gpu_kernels.sh  # + dense torch SDPA at 32K/64K/128K (~5 s more)
#
# Both parts together stay under 10 minutes (tests are cut at 200 s, the benchmark at 380 s);
# QUICK=1 under 6 (130 s + 200 s; about 60 s + 60 s on an idle H200): the writers (v5 beside v4 /
# v3), attention (split-KV rows beside the one-program rows, the default and the key split
# interleaved 4 times; ATTN_SDPA=1, read by benchmarks/kernels.py, adds SDPA), the decode-step
# curve at 4K / 64K / 1M for the default scan and the run-11 one (each also as one CUDA graph),
# and the index scan's launch variants in 3 interleaved rounds. Every section logs nvidia-smi state.
# For a profiler: benchmarks/kernel_profile.py (see its docstring for the ncu command).
# Outputs in $OUT: env.txt, gpu-tests.log, gpu-tests.xml (junit), kernels-h200.json, benchmark.log.
# Needs torch (CUDA build) and triton; the project need not be installed: a symlink tree puts
# `cedserve.*` on PYTHONPATH as scripts/typecheck.sh does. pytest is needed for the tests; on a
# host without it (or without hypothesis, which tests/kernels/test_records.py imports), first run
#
#     bash scripts/gpu_kernels.sh --prepare-deps     # here, where .venv has them
#
# which copies the pure-Python test dependencies into build/gpu_pydeps, and carry that folder
# along (it is git-ignored); this script puts it on PYTHONPATH when present.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare-deps" ]; then
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -rf build/gpu_pydeps && mkdir -p build/gpu_pydeps
  for name in pytest _pytest py.py pluggy iniconfig packaging hypothesis _hypothesis_pytestplugin.py \
              _hypothesis_globals.py _hypothesis_ftz_detector.py sortedcontainers attr attrs pytest_timeout.py; do
    [ -e "$site/$name" ] && cp -r "$site/$name" build/gpu_pydeps/
  done
  for dist in "$site"/{pytest,pluggy,iniconfig,packaging,hypothesis,sortedcontainers,attrs,pytest_timeout}-*.dist-info; do
    [ -e "$dist" ] && cp -r "$dist" build/gpu_pydeps/
  done
  find build/gpu_pydeps -name __pycache__ -prune -exec rm -rf {} +
  du -sh build/gpu_pydeps
  exit 0
fi

OUT=${OUT:-build/gpu_kernels}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

tree=build/gpu_pkg
source scripts/gpu_tree.sh && make_gpu_tree "$tree"
export PYTHONPATH="$PWD/$tree${PYTHONPATH:+:$PYTHONPATH}"
if [ -d build/gpu_pydeps ]; then
  export PYTHONPATH="$PYTHONPATH:$PWD/build/gpu_pydeps"  # after the host's own packages
fi
unset TRITON_INTERPRET

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"; hostname; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "triton", triton.__version__, "device", torch.cuda.get_device_name())'
  "$PY" -P -c 'import cedserve.kernels as k; print("cedserve.kernels from", list(k.__path__))'
} 2>&1 | tee "$OUT/env.txt"

PART=${PART:-all}
MARK=${MARK:-gpu}    # pytest -m expression; MARK="gpu or kernels" runs the whole kernel tier natively
QUICK=${QUICK:-0}    # 1: the benchmark times only the kernels changed since the last run (--quick)
if [ "$QUICK" = 1 ]; then  # one device call of <= 6 minutes: tests <= 130 s, benchmark <= 200 s
  TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-130}
  BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-200}
fi
rc_tests=0
rc_bench=0
if [ "$PART" = bench ]; then
  :
elif "$PY" -c 'import pytest' 2>/dev/null; then
  ignore=()
  # without an importable hypothesis (a copy built for another Python lacks its native part) skip
  # the property tests and its pytest plugin, which would crash the run's summary
  "$PY" -c 'import hypothesis' 2>/dev/null || ignore=(--ignore=tests/kernels/test_records.py -p no:hypothesispytest)
  # `python -m` would put the repo root first on sys.path, where `cedserve/` (without the mapped
  # subpackages) shadows the symlink tree: -P (Python >= 3.11) leaves the cwd off sys.path.
  echo "== pytest tests/kernels -m ${MARK} ${ignore[*]}"
  timeout "${TESTS_TIMEOUT_S:-200}" "$PY" -P -m pytest tests/kernels -m "$MARK" -q -p no:cacheprovider -o addopts="" -rA \
    --junitxml="$OUT/gpu-tests.xml" "${ignore[@]}" 2>&1 | tee "$OUT/gpu-tests.log"
  rc_tests=${PIPESTATUS[0]}
  # pytest exits 5 when it collected nothing: that is a failed run here, not a pass
  if ! grep -qE "[0-9]+ passed" "$OUT/gpu-tests.log"; then echo "no GPU test passed"; [ "$rc_tests" -eq 0 ] && rc_tests=4; fi
else
  echo "pytest is not importable here: skipping the GPU tests (see --prepare-deps)" | tee "$OUT/gpu-tests.log"
  rc_tests=3
fi

if [ "$PART" != tests ]; then
  echo "== benchmarks/kernels.py"
  quick=(); [ "$QUICK" = 1 ] && quick=(--quick)
  timeout "${BENCH_TIMEOUT_S:-380}" "$PY" -P benchmarks/kernels.py "${quick[@]}" --out "$OUT/kernels-h200.json" 2>&1 \
    | tee "$OUT/benchmark.log"
  rc_bench=${PIPESTATUS[0]}
fi

echo "gpu tests rc=$rc_tests benchmark rc=$rc_bench (results in $OUT)"
[ "$rc_tests" -eq 0 ] && [ "$rc_bench" -eq 0 ]
