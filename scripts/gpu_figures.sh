#!/usr/bin/env bash
# One bounded call on a 2 x H200 host that gathers the prefill, decode and full-topology figures
# side by side (each script is bounded on its own; see them for details):
#
#     OUT=/some/dir bash scripts/gpu_figures.sh
#
# phase 1 (<= 235 s): GPU 0 runs `gpu_bench.sh prefill` while GPU 1 runs `gpu_bench.sh decode-short`;
# phase 2 (<= PHASE2_S): `gpu_full_topology.sh` on both GPUs: disaggregated (prefill GPU 0, decode
# GPU 1) against colocated serving under each routing policy.
# Wheels for the packages the CUDA image lacks (msgspec, protobuf, grpcio, grpc health/reflection,
# nixl-cu13) are read from .whl/ (carried with the tree) into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
mkdir -p "$OUT/bench" "$OUT/topology"
python3 -m pip install --quiet --no-deps --no-index --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.used --format=csv | tee "$OUT/gpus.txt"
CUDA_VISIBLE_DEVICES=0 OUT="$OUT/bench" bash scripts/gpu_bench.sh prefill > "$OUT/bench/prefill.stdout" 2>&1 &
CUDA_VISIBLE_DEVICES=1 OUT="$OUT/bench" bash scripts/gpu_bench.sh decode-short > "$OUT/bench/decode.stdout" 2>&1
wait
OUT="$OUT/topology" GPUS=2 SITE=/tmp/site BENCH_S=${PHASE2_S:-330} MAX_RUN_S=${MAX_RUN_S:-40} \
  bash scripts/gpu_full_topology.sh --colocated-policies cache_aware,least_loaded,round_robin
