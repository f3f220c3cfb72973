#!/usr/bin/env bash
# Decode on CUDA: benchmarks/decode.py --device cuda, then the two-GPU expert-parallel check (NCCL,
# tests/unit/test_decode_expert_parallel.py -m gpu). Run from the repo root on a CUDA host:
#
#     OUT=/some/dir bash scripts/gpu_decode.sh      # writes env.txt, decode-cuda.json, bench.log, ep.log
#
# The project need not be installed: a symlink tree puts `cedserve.*` on PYTHONPATH (as
# scripts/typecheck.sh does). Wheels in build/gpu_wheels (msgspec; protobuf and grpcio at the versions
# the generated code needs) are installed into build/gpu_site first when present; fetch them here with
#
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#         -d build/gpu_wheels msgspec==0.23.0 protobuf==7.36.2 grpcio==1.85.3
#
# and carry build/gpu_wheels along (it is git-ignored).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu_decode}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
tree=build/gpu_tree
source scripts/gpu_tree.sh && make_gpu_tree "$tree"
if ls build/gpu_wheels/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install --quiet --upgrade --no-deps --no-index --target build/gpu_site build/gpu_wheels/*.whl
fi
export PYTHONPATH="$PWD/$tree:$PWD/build/gpu_site${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch; print(torch.__version__, torch.cuda.device_count(), torch.cuda.get_device_name(0))" \
  | tee "$OUT/env.txt"
timeout "${BENCH_S:-330}" "$PY" benchmarks/decode.py --device cuda --preset mini-40 \
  --contexts ${CONTEXTS:-256 2048} --batches ${BATCHES:-1 8 32} --steps 4 \
  --attention ${ATTENTION:-off kernels} --warmup-steps 4 \
  --note "one H200; mini-40 layer plan, random weights, vocabulary cut to 512; decode attention dense (off) and paged kernels" \
  --out "$OUT/decode-cuda.json" 2>&1 | grep -v NIXL | tee "$OUT/bench.log"
timeout 200 "$PY" -P -m pytest tests/unit/test_decode_expert_parallel.py -m gpu -q -p no:cacheprovider 2>&1 \
  | tail -20 | tee "$OUT/ep.log"
