#!/usr/bin/env bash
# Prefill and decode figures on CUDA hosts (H200), one bounded run per call (each < 4 minutes):
#
#     OUT=/some/dir bash scripts/gpu_bench.sh MODE
#
#   prefill          benchmarks/prefill.py, mini-40, 4K 16K 64K 128K prompts: the prefill engine
#                    (encoder + decoder KV source + replay) against all 40 layers in the same run
#   prefill-paged    the same engine on the dense path and through the kernels (`prefill.paged_attention`)
#                    side by side at 4K 32K 128K (engine twice per cell, the second reported; no
#                    all-layer pass); prefill-paged-released: with the released attention geometry
#   decode-short     benchmarks/decode.py, one GPU, contexts 4K and 16K, batches 1 8 32, +-DSpark
#   decode-64k       the same at 64K
#   decode-128k      the same at 128K
#   decode-ep2       expert parallel over two GPUs (NCCL), contexts 4K and 64K, batches 8 and 32
#
# Each writes $OUT/<mode>.json and $OUT/<mode>.log. Every run has a time budget (BUDGET_S, default
# 190 s: no new cell starts after it, skipped cells are recorded) under a hard `timeout` (LIMIT_S,
# default 235 s). As in scripts/gpu_decode.sh the project need not be installed: a symlink tree puts
# `cedserve.*` on PYTHONPATH, and wheels in build/gpu_wheels (msgspec, protobuf, grpcio) are installed
# into build/gpu_site first when present.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:?usage: scripts/gpu_bench.sh prefill|prefill-paged|prefill-paged-released|decode-short|decode-64k|decode-128k|decode-ep2}
OUT=${OUT:-build/gpu_bench}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-190}
LIMIT_S=${LIMIT_S:-235}
mkdir -p "$OUT"
tree=build/gpu_tree_$MODE  # one per mode: two modes may run at once on two GPUs
source scripts/gpu_tree.sh && make_gpu_tree "$tree"
if ls build/gpu_wheels/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install --quiet --upgrade --no-deps --no-index --target build/gpu_site build/gpu_wheels/*.whl
fi
export PYTHONPATH="$PWD/$tree:$PWD/build/gpu_site${PYTHONPATH:+:$PYTHONPATH}"
NOTE="mini-40 layer plan, random weights, vocabulary 512; torch ops but the mHC kernel and (decode) the paged attention"
decode() {  # decode <mode> <args...>
  local mode=$1; shift
  # decode attention: ATTENTION="off kernels" times both paths side by side (default: auto, the
  # kernels on CUDA); the rest of the step is torch ops as in prefill
  timeout "$LIMIT_S" "$PY" benchmarks/decode.py --device cuda --preset mini-40 --steps 4 --time-budget-s "$BUDGET_S" \
    --attention ${ATTENTION:-auto} --note "$NOTE; decode attention ${ATTENTION:-auto}; $mode" --out "$OUT/$mode.json" \
    "$@" 2>&1 | grep -v NIXL | tee "$OUT/$mode.log"
}
case "$MODE" in
  prefill)
    timeout "$LIMIT_S" "$PY" benchmarks/prefill.py --device cuda --preset mini-40 \
      --tokens 4096 16384 65536 131072 --chunk-tokens 2048 --time-budget-s "$BUDGET_S" \
      --note "$NOTE; one GPU" --out "$OUT/prefill.json" 2>&1 | grep -v NIXL | tee "$OUT/prefill.log" ;;
  prefill-paged|prefill-paged-released)
    released=(); [ "$MODE" = prefill-paged-released ] && released=(--released-attention)
    timeout "$LIMIT_S" "$PY" benchmarks/prefill.py --device cuda --preset mini-40 "${released[@]}" \
      --tokens ${TOKENS:-4096 32768 131072} --chunk-tokens 2048 --attention ${ATTENTION:-off kernels} --repeats 2 --skip-all-layers \
      --time-budget-s "$BUDGET_S" --note "$NOTE; prefill attention dense vs kernels; one GPU" \
      --out "$OUT/$MODE.json" 2>&1 | grep -v NIXL | tee "$OUT/$MODE.log" ;;
  decode-short) decode "$MODE" --contexts 4096 16384 --batches 1 8 32 ;;
  decode-64k)   decode "$MODE" --contexts 65536 --batches 1 8 32 ;;
  decode-128k)  decode "$MODE" --contexts 131072 --batches 1 8 32 ;;
  decode-ep2)   decode "$MODE" --ep 2 --contexts 4096 65536 --batches 8 32 ;;
  *) echo "unknown mode $MODE" >&2; exit 2 ;;
esac
