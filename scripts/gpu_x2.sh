#!/usr/bin/env bash
# The session's GPU figures on one 2 x H200 host in two bounded calls (each < 10 minutes), parts on
# their own GPUs at the same time where the figures allow it (the host's 32 cores are shared; each
# JSON's machine line says so):
#
#     OUT=/some/dir bash scripts/gpu_x2.sh a    # GPU 0: drafter-only training + demo eval, while
#                                               # GPUs 0-1 run the KV transfer bench (new beside old path),
#                                               # then GPU 1 the kernel GPU tests and a short decode-short
#     OUT=/some/dir bash scripts/gpu_x2.sh b    # GPU 0: decode-short, then decode-64k; GPU 1: decode-128k;
#                                               # then GPUs 0-1: decode-ep2 (NCCL)
#     OUT=/some/dir TRAIN_ARGS_1="--draft-layers 2 --drafter-init fresh" bash scripts/gpu_x2.sh c
#                                               # two drafter-only trainings side by side, then their
#                                               # demo evals one after the other (GPU_1=0: one GPU;
#                                               # EVAL_BEST=1: only the better one's)
#     OUT=/some/dir bash scripts/gpu_x2.sh d    # one GPU: the shipped demo's decode cells, then the
#                                               # kernel GPU tests + QUICK benchmark
#
# Carry .whl (wheels the CUDA image lacks) and, for part a, build/kv_before (the old kv_transfer, made
# by `bash scripts/gpu_transfer.sh --prepare-before REF`). Each part's files are packed into one
# tarball in $OUT (the device returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:?usage: scripts/gpu_x2.sh a|b}
OUT=${OUT:?set OUT}
W=/tmp/gpu_x2 && rm -rf "$W" && mkdir -p "$W"
python3 -m pip install --quiet --no-deps --no-index --target /tmp/site .whl/*.whl 2>&1 | tail -2
# googleapis-common-protos and grpcio-status share the `google` folder with protobuf: a second target
python3 -m pip install --quiet --no-deps --no-index --target /tmp/site2 .whl/googleapis*.whl .whl/grpcio_status*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/site2
nvidia-smi --query-gpu=index,name,memory.used --format=csv > "$OUT/gpus.txt"
pack() { tar -C "$W" -czf "$OUT/$1.tgz" "$1"; }
case "$PART" in
  a)
    mkdir -p "$W/drafter" "$W/transfer"
    CUDA_VISIBLE_DEVICES=0 OUT="$W/drafter" DRAFTER_ONLY=1 DRAFTER_S=${DRAFTER_S:-220} GREEDY_S=${GREEDY_S:-50} TRAIN_TIMEOUT_S=380 \
      EVAL_TIMEOUT_S=150 bash scripts/gpu_train_demo.sh > "$W/drafter/stdout.log" 2>&1 &
    ( CUDA_VISIBLE_DEVICES=0,1 OUT="$W/transfer" SKIP_WHL=1 SITE=/tmp/site:/tmp/site2 bash scripts/gpu_transfer.sh
      # then GPU 1 alone: the fused mHC kernel's GPU tests and a short decode run on it
      CUDA_VISIBLE_DEVICES=1 PART=tests MARK=gpu OUT="$W/transfer/mhc" TESTS_TIMEOUT_S=60 bash scripts/gpu_kernels.sh
      CUDA_VISIBLE_DEVICES=1 OUT="$W/transfer" BUDGET_S=${SHORT_BUDGET_S:-70} LIMIT_S=${SHORT_LIMIT_S:-100} \
        bash scripts/gpu_bench.sh decode-short
    ) > "$W/transfer/stdout.log" 2>&1 &
    wait
    pack drafter; pack transfer ;;
  b)
    mkdir -p "$W/decode"
    ( CUDA_VISIBLE_DEVICES=0 OUT="$W/decode" BUDGET_S=150 LIMIT_S=190 bash scripts/gpu_bench.sh decode-short
      CUDA_VISIBLE_DEVICES=0 OUT="$W/decode" BUDGET_S=150 LIMIT_S=190 bash scripts/gpu_bench.sh decode-64k
    ) > "$W/decode/gpu0.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 OUT="$W/decode" BUDGET_S=190 LIMIT_S=235 bash scripts/gpu_bench.sh decode-128k \
      > "$W/decode/gpu1.log" 2>&1 &
    wait
    CUDA_VISIBLE_DEVICES=0,1 OUT="$W/decode" BUDGET_S=${EP_BUDGET_S:-80} LIMIT_S=${EP_LIMIT_S:-110} \
      bash scripts/gpu_bench.sh decode-ep2 > "$W/decode/ep2.log" 2>&1
    pack decode ;;
  c)
    # two drafter-only trainings side by side (GPU_0 / GPU_1: which GPU each uses, default 0 and 1;
    # on a one-GPU host both 0), then demo_eval's decode cells of each, one after the other so the
    # timings are not shared; TRAIN_ARGS_0 / TRAIN_ARGS_1 say how the two differ
    for v in 0 1; do
      mkdir -p "$W/drafter$v"
      args_var=TRAIN_ARGS_$v gpu_var=GPU_$v
      CUDA_VISIBLE_DEVICES=${!gpu_var:-$v} GPU_TREE=build/gpu_tree$v OUT="$W/drafter$v" DRAFTER_ONLY=1 SKIP_EVAL=1 \
        DRAFTER_S=${DRAFTER_S:-180} GREEDY_S=${GREEDY_S:-100} TRAIN_TIMEOUT_S=${TRAIN_TIMEOUT_S:-350} \
        TRAIN_ARGS="${!args_var:-}" bash scripts/gpu_train_demo.sh > "$W/drafter$v/stdout.log" 2>&1 &
    done
    wait
    evaluate="0 1"
    if [ "${EVAL_BEST:-0}" = 1 ]; then  # only the variant whose held-out replay accepted more
      evaluate=$(python3 -c 'import json, sys
best = max(sys.argv[1:], key=lambda v: json.load(open(f"{v}/train-drafter.json"))["acceptance_after"]["accepted_per_verify"])
print(best[-1])' $(for v in 0 1; do [ -f "$W/drafter$v/train-drafter.json" ] && echo "$W/drafter$v"; done))
    fi
    for v in $evaluate; do
      gpu_var=GPU_$v args_var=TRAIN_ARGS_$v
      [ -f "$W/drafter$v/demo/model.safetensors" ] || continue
      # shellcheck disable=SC2086
      CUDA_VISIBLE_DEVICES=${!gpu_var:-$v} PYTHONPATH="$PWD/build/gpu_tree$v:$PYTHONPATH" timeout "${EVAL_TIMEOUT_S:-100}" \
        python3 -P benchmarks/demo_eval.py --device cuda --checkpoint "$W/drafter$v/demo" --parts speed \
        --modes ${EVAL_MODES:-off batched batched+cost-check} --out "$W/drafter$v/demo-eval.json" \
        --note "the backbone of cedserve/assets/demo with the drafter trained by scripts/train_demo.py --drafter-only ${!args_var:-}" \
        2>&1 | grep -v NIXL > "$W/drafter$v/eval.log"
    done
    pack drafter0; pack drafter1 ;;
  d)
    # one GPU: the shipped demo checkpoint's decode cells (demo_eval --parts speed), then the kernels'
    # GPU tests and benchmark (QUICK; carry build/gpu_pydeps too); EVAL_ARGS / KERNEL_ENV add settings
    mkdir -p "$W/eval" "$W/kernels"
    source scripts/gpu_tree.sh && make_gpu_tree build/gpu_tree_eval
    # shellcheck disable=SC2086
    PYTHONPATH="$PWD/build/gpu_tree_eval:$PYTHONPATH" timeout "${EVAL_TIMEOUT_S:-200}" python3 -P benchmarks/demo_eval.py \
      --device cuda --parts speed --out "$W/eval/demo-eval.json" --note "one GPU; the shipped cedserve/assets/demo" \
      ${EVAL_ARGS:-} > "$W/eval/eval.log" 2>&1
    # shellcheck disable=SC2086
    env ${KERNEL_ENV:-} QUICK=1 OUT="$W/kernels" bash scripts/gpu_kernels.sh > "$W/kernels/run.log" 2>&1
    pack eval; pack kernels ;;
  *) echo "unknown part $PART" >&2; exit 2 ;;
esac
ls -la "$OUT"
