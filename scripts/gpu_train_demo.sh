#!/usr/bin/env bash
# Train the demo checkpoint on one CUDA GPU and evaluate it, in one go (the H200 run of issue 13):
# scripts/train_demo.py (time-budgeted from a probe of its first steps), then benchmarks/demo_eval.py
# on the written checkpoint. Run from the repo root on a CUDA host:
#
#     OUT=/some/dir bash scripts/gpu_train_demo.sh
#
# Writes into $OUT (8 files): demo/{config,tokenizer,generation_config}.json, demo/model.safetensors,
# train.log, train-demo.json, eval.log, demo-eval.json. Copy $OUT/demo to cedserve/assets/demo and
# the JSON files to docs/benchmarks/ afterwards. BACKBONE_S / DRAFTER_S set the training budgets;
# TRAIN_ARGS / EVAL_ARGS add flags (e.g. a quick CPU rehearsal with DEVICE=cpu).
#
# DRAFTER_ONLY=1: train only the drafter of INIT (default cedserve/assets/demo), its backbone frozen
# and written back byte for byte (scripts/train_demo.py --drafter-only): GREEDY_S bounds the
# backbone's greedy continuations of training prompts (default 60 s), DRAFTER_S the drafter's
# training over that cache (default 240 s); then the evaluation's decode cells only (the backbone's
# perplexity figures cannot change). Same 8 files, with train-drafter.json for train-demo.json:
#
#     DRAFTER_ONLY=1 DRAFTER_S=240 OUT=/some/dir bash scripts/gpu_train_demo.sh     # ~7 min on one H200
#
# The project need not be installed: a symlink tree puts `cedserve.*` on PYTHONPATH (as
# scripts/gpu_decode.sh does), and python runs with -P so the repo root does not shadow it. Wheels in
# build/gpu_wheels (msgspec; protobuf at the version the generated code needs) are installed into
# /tmp/site first when present; see scripts/gpu_decode.sh for fetching them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu_train_demo}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
tree=${GPU_TREE:-build/gpu_tree}  # one per concurrent run (scripts/gpu_x2.sh c runs two)
source scripts/gpu_tree.sh && make_gpu_tree "$tree"
if ls build/gpu_wheels/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    build/gpu_wheels/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/$tree${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  "$PY" -P -c 'import sys, sysconfig, torch, tokenizers; print("python", sys.version.split()[0], "torch", torch.__version__,
"tokenizers", tokenizers.__version__, "stdlib", sysconfig.get_paths()["stdlib"])'
} 2>&1 | tee "$OUT/train.log"
if [ "${DRAFTER_ONLY:-0}" = 1 ]; then
  drafter_s=${DRAFTER_S:-240}
  greedy_s=${GREEDY_S:-60}
  train_timeout=${TRAIN_TIMEOUT_S:-$((drafter_s + greedy_s + 120))}
  # --deadline-seconds: if loading, generation and caching ran long, training gives up the difference
  # rather than the timeout killing the run before it writes the checkpoint
  # shellcheck disable=SC2086
  timeout "$train_timeout" "$PY" -P scripts/train_demo.py --device "$DEVICE" \
    --init "${INIT:-cedserve/assets/demo}" --drafter-only --out "$OUT/demo" --report "$OUT/train-drafter.json" \
    --drafter-seconds "$drafter_s" --greedy-seconds "$greedy_s" --deadline-seconds "$((train_timeout - 15))" \
    ${TRAIN_ARGS:-} 2>&1 | tee -a "$OUT/train.log"
  rc_train=${PIPESTATUS[0]}
  EVAL_ARGS=${EVAL_ARGS:---parts speed}
  NOTE=${NOTE:-one GPU; the backbone of ${INIT:-cedserve/assets/demo} with the drafter just trained by scripts/train_demo.py --drafter-only}
else
  # shellcheck disable=SC2086
  timeout "${TRAIN_TIMEOUT_S:-430}" "$PY" -P scripts/train_demo.py --device "$DEVICE" --out "$OUT/demo" \
    --report "$OUT/train-demo.json" --backbone-seconds "${BACKBONE_S:-200}" --drafter-seconds "${DRAFTER_S:-80}" \
    ${TRAIN_ARGS:-} 2>&1 | tee -a "$OUT/train.log"
  rc_train=${PIPESTATUS[0]}
fi
rc_eval=-1
if [ "$rc_train" -eq 0 ] && [ "${SKIP_EVAL:-0}" != 1 ]; then  # SKIP_EVAL=1: the caller evaluates
  # shellcheck disable=SC2086
  timeout "${EVAL_TIMEOUT_S:-150}" "$PY" -P benchmarks/demo_eval.py --device "$DEVICE" --checkpoint "$OUT/demo" \
    --out "$OUT/demo-eval.json" --note "${NOTE:-one GPU; the checkpoint just trained by scripts/train_demo.py}" \
    ${EVAL_ARGS:-} 2>&1 | grep -v NIXL | tee "$OUT/eval.log"
  rc_eval=${PIPESTATUS[0]}
fi
echo "train rc=$rc_train eval rc=$rc_eval (results in $OUT)"
[ "$rc_train" -eq 0 ] && { [ "$rc_eval" -eq 0 ] || [ "${SKIP_EVAL:-0}" = 1 ]; }
