#!/usr/bin/env bash
# KV transfer load test on a CUDA host with 2+ GPUs (NVLink): `cedserve bench kv-transfer --device cuda`.
# Run from the repo root on that host:
#
#     OUT=/some/dir bash scripts/gpu_transfer.sh     # writes into $OUT (default build/gpu_transfer)
#     DEVICE=cpu QUICK=1 SKIP_WHL=1 PYTHON=.venv/bin/python bash scripts/gpu_transfer.sh  # smoke test
#
# What it runs, in order, each step under its own time limit (about 6.5 minutes in all; 7 files in
# $OUT; every table also lands in $OUT/bench.log, whose last lines are a summary):
#   A. benchmarks/kv_transfer_host.py: the host cost of one request by phase with this host's CPU
#      (NIXL calls, then the engine between two agents in one process): $OUT/host.json.
#   B. benchmarks/kv_transfer_requests.py: what one NIXL request costs by itself (the same bytes as
#      1, 2, 4 or 16 back-to-back requests): $OUT/requests.json.
#   C. the full matrix (32K, 128K, 1M; batch 1, 4, 8; READ and WRITE; baselines) with the default
#      config: $OUT/kv-transfer-cuda.json, the file docs/benchmarks/kv-transfer-cuda-h200x2.json
#      comes from.
#   D. side by side, new path then old path, the same core cells (128K and 1M WRITE, contiguous and
#      scattered ids, batch 1, 4, 8): $OUT/core-new.json and $OUT/core-old.json, and between them
#      the new path without its ChunkPosted notices (128K, batch 1 and 8: `announce_posts=false`):
#      $OUT/core-new-noannounce.json. The old path is the kv_transfer of another commit in
#      build/kv_before (make it here first: `bash scripts/gpu_transfer.sh --prepare-before REF`,
#      and carry build/kv_before to the device); without it, D runs only the new path.
#
# Needs torch (CUDA build) and NIXL. Wheels missing on the host (nixl-cu13, msgspec, protobuf,
# grpcio for Python 3.12) can travel in .whl/ (git-ignored; see docs/kv_transfer.md): they are
# installed into $SITE (default /tmp/site). The project need not be installed: a symlink tree puts
# `cedserve.*` on PYTHONPATH (as scripts/gpu_kernels.sh does), and the benchmark runs from /tmp so
# the checkout's own `cedserve/` folder does not shadow the tree in the worker processes.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [ "${1:-}" = "--prepare-before" ]; then
  ref=${2:?usage: --prepare-before GIT_REF}
  rm -rf build/kv_before && mkdir -p build/kv_before
  for f in $(git ls-tree --name-only "$ref" kv_transfer/); do
    git show "$ref:$f" > "build/kv_before/$(basename "$f")"
  done
  echo "$ref $(git rev-parse "$ref")" > build/kv_before/REF
  ls build/kv_before
  exit 0
fi

OUT=${OUT:-build/gpu_transfer}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-0}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
LOG="$OUT/bench.log"
: > "$LOG"

if [ -z "${SKIP_WHL:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    2>&1 | tail -3 | tee -a "$LOG"
fi

make_tree() {  # $1: tree folder, $2: the kv_transfer folder to map
  rm -rf "$1"; mkdir -p "$1/cedserve"
  for f in cedserve/*; do ln -s "$ROOT/$f" "$1/cedserve/$(basename "$f")"; done
  for pkg in model kernels prefill_workers decode_workers router proto; do
    [ -d "$pkg" ] && ln -s "$ROOT/$pkg" "$1/cedserve/$pkg"
  done
  ln -s "$2" "$1/cedserve/kv_transfer"
}
make_tree /tmp/kvx_new "$ROOT/kv_transfer"
[ -f build/kv_before/agent.py ] && make_tree /tmp/kvx_old "$ROOT/build/kv_before"

export PYTHONUNBUFFERED=1
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1
  nvidia-smi topo -m 2>/dev/null | head -4
  cd /tmp && PYTHONPATH="$SITE:/tmp/kvx_new" "$PY" -P -c 'import torch, cedserve.bench.kv_transfer.loadtest as lt
from cedserve.kv_transfer.nixl_backend import import_nixl
print("torch", torch.__version__, "gpus", torch.cuda.device_count(), "nixl", import_nixl().__name__)'
} 2>&1 | tee -a "$LOG"

bench() {  # $1: tree, $2: json name, $3: timeout s, rest: bench arguments
  local tree=$1 name=$2 limit=$3; shift 3
  echo "== [$name] bench kv-transfer $*" | tee -a "$LOG"
  (cd /tmp && PYTHONPATH="$SITE:$tree" timeout "$limit" "$PY" -P -m cedserve.bench.kv_transfer.loadtest \
     --device "$DEVICE" --json "$OUT/$name.json" "$@") 2>&1 | grep -v "NIXL INFO\|^\[" | tee -a "$LOG"
}

SIZE=128K; SIZES=32K,128K,1M; BIG=128K,1M; BLOCKS=2048
[ "$QUICK" = 1 ] && { SIZE=4K; SIZES=4K; BIG=4K; BLOCKS=256; }
echo "== [host] benchmarks/kv_transfer_host.py" | tee -a "$LOG"
(cd /tmp && PYTHONPATH="$SITE:/tmp/kvx_new" timeout 60 "$PY" -P "$ROOT/benchmarks/kv_transfer_host.py" \
   --blocks $BLOCKS --reps 50 --engine-reps 15 --json "$OUT/host.json") 2>&1 \
   | grep -v "NIXL INFO\|^\[" | tee -a "$LOG"
echo "== [requests] benchmarks/kv_transfer_requests.py" | tee -a "$LOG"
(cd /tmp && PYTHONPATH="$SITE:/tmp/kvx_new" timeout 40 "$PY" -P "$ROOT/benchmarks/kv_transfer_requests.py" \
   --device "$DEVICE" --sizes "$SIZES" --pieces 1,2,4,16 --reps 3 --json "$OUT/requests.json") 2>&1 \
   | grep -v "NIXL INFO\|^\[" | tee -a "$LOG"

bench /tmp/kvx_new "kv-transfer-$DEVICE" 100 --sizes $SIZES --batch 1,4,8 --fan-in 1 --reps 3
CORE=(--sizes $BIG --batch 1,4,8 --modes write --fan-in 1 --reps 3 --only cross_layer,auto)
bench /tmp/kvx_new core-new 60 "${CORE[@]}"
bench /tmp/kvx_new core-new-noannounce 45 --sizes $SIZE --batch 1,8 --modes write --fan-in 1 --reps 3 \
  --only cross_layer,auto --set announce_posts=false
if [ -d /tmp/kvx_old ]; then
  echo "== old path: $(cat build/kv_before/REF)" | tee -a "$LOG"
  bench /tmp/kvx_old core-old 60 "${CORE[@]}"
fi

echo "== summary (GB/s; ratio to raw one-descriptor NIXL; p50 ms)" | tee -a "$LOG"
(cd /tmp && "$PY" - "$OUT" "$([ "$QUICK" = 1 ] && echo 4096 || echo 131072)" <<'EOF'
import json, sys, os, glob
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    d = json.load(open(path))
    for c in d.get("cells", []):
        if c["layout"] != "cross_layer" or c["mode"] != "write" or c["tokens"] < int(sys.argv[2]):
            continue
        print(f"{os.path.basename(path)[:-5]:<17} {c['alloc']:<10} {c['pack']:<4} {c['tokens'] >> 10:>5}K b{c['batch']} "
              f"{c['gbps']:7.1f} GB/s  raw1 {c['raw_gbps']:6.1f}  ratio {c['ratio_to_raw']:4.2f}  "
              f"p50 {c['p50_ms']:6.2f} ms  desc {c['descriptors_per_request']:6.0f} "
              f"{'FAIL' if c['failures'] else ('v' if c['verified'] else '-')}")
EOF
) 2>&1 | tee -a "$LOG"
