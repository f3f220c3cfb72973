#!/usr/bin/env bash
# The session's GPU figures on one 4 x H200 host in two bounded calls (each < 10 minutes), every
# part on its own GPUs at the same time (separate GPUs; the host's 64 cores are shared, noted in
# each JSON's machine line):
#
#     OUT=/some/dir bash scripts/gpu_x4.sh a    # GPU 0: drafter training + demo eval
#                                               # GPU 1: decode-short, then decode-64k
#                                               # GPUs 2-3: KV transfer (new beside old path), then decode-ep2
#     OUT=/some/dir bash scripts/gpu_x4.sh b    # GPUs 0-2: full topology (prefill GPU 0, EP=2 decode GPUs 1-2)
#                                               # GPU 3: decode-128k
#
# Carry .whl (wheels the CUDA image lacks), build/kv_before (the old kv_transfer, made by
# `bash scripts/gpu_transfer.sh --prepare-before REF`). Each part's files are packed into one
# tarball in $OUT (the device returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:?usage: scripts/gpu_x4.sh a|b}
OUT=${OUT:?set OUT}
W=/tmp/gpu_x4 && rm -rf "$W" && mkdir -p "$W"
python3 -m pip install --quiet --no-deps --no-index --target /tmp/site .whl/*.whl 2>&1 | tail -2
# googleapis-common-protos and grpcio-status share the `google` folder with protobuf: a second target
python3 -m pip install --quiet --no-deps --no-index --target /tmp/site2 .whl/googleapis*.whl .whl/grpcio_status*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/site2
nvidia-smi --query-gpu=index,name,memory.used --format=csv > "$OUT/gpus.txt"
pack() { tar -C "$W" -czf "$OUT/$1.tgz" "$1"; }
case "$PART" in
  a)
    mkdir -p "$W/drafter" "$W/decode" "$W/transfer"
    CUDA_VISIBLE_DEVICES=0 OUT="$W/drafter" DRAFTER_ONLY=1 DRAFTER_S=${DRAFTER_S:-240} TRAIN_TIMEOUT_S=330 \
      EVAL_TIMEOUT_S=200 bash scripts/gpu_train_demo.sh > "$W/drafter/stdout.log" 2>&1 &
    ( CUDA_VISIBLE_DEVICES=1 OUT="$W/decode" BUDGET_S=150 LIMIT_S=190 bash scripts/gpu_bench.sh decode-short
      CUDA_VISIBLE_DEVICES=1 OUT="$W/decode" BUDGET_S=150 LIMIT_S=190 bash scripts/gpu_bench.sh decode-64k
    ) > "$W/decode/stdout.log" 2>&1 &
    ( CUDA_VISIBLE_DEVICES=2,3 OUT="$W/transfer" SKIP_WHL=1 SITE=/tmp/site:/tmp/site2 bash scripts/gpu_transfer.sh
      CUDA_VISIBLE_DEVICES=2,3 OUT="$W/decode" BUDGET_S=${EP_BUDGET_S:-80} LIMIT_S=${EP_LIMIT_S:-110} \
        bash scripts/gpu_bench.sh decode-ep2
    ) > "$W/transfer/stdout.log" 2>&1 &
    wait
    pack drafter; pack decode; pack transfer ;;
  b)
    mkdir -p "$W/topology" "$W/decode128"
    CUDA_VISIBLE_DEVICES=3 OUT="$W/decode128" BUDGET_S=190 LIMIT_S=235 bash scripts/gpu_bench.sh decode-128k \
      > "$W/decode128/stdout.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=0,1,2 OUT="$W/topology" GPUS=3 SITE=/tmp/site:/tmp/site2 BENCH_S=${TOPO_S:-420} \
      MAX_RUN_S=${MAX_RUN_S:-45} bash scripts/gpu_full_topology.sh > "$W/topology/stdout.log" 2>&1
    wait
    find "$W/topology/logs" -name '*.log' -size +2M -exec truncate -s 2M {} + 2>/dev/null
    pack topology; pack decode128 ;;
  *) echo "unknown part $PART" >&2; exit 2 ;;
esac
ls -la "$OUT"
