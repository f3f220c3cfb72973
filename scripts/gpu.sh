#!/usr/bin/env bash
# Every GPU measurement of the project, one recipe. Run from the repo root on a CUDA host:
#
#     OUT=/some/dir bash scripts/gpu.sh                      # PART=runner (the default)
#     OUT=/some/dir PART="kernels step" bash scripts/gpu.sh  # several parts, one after the other
#
# Parts (outputs in $OUT; each step has its own timeout, in seconds, in the variable named):
#
#   runner          runner-tests, then step, then engine
#   runner-tests    tests/unit/test_runner_gpu.py, tests/kernels/test_capture_trace.py  gpu-tests.log  TESTS_S=130
#   step            benchmarks/step.py, mini-40 at 4K / 64K x batch 1 / 32 (eager, graph, graph-fused),
#                   then the released attention geometry at 64K x 32, its weights in float32 and in
#                   bfloat16 side by side (issue 28; RELEASED_DTYPES, STEP_DTYPES: step.py --dtypes)
#                                   decode-step-<gpu>.json, decode-step-<gpu>-released.json, step.log
#                                                                                 STEP_S=220 RELEASED_S=220  (RELEASED_S=0: no released cells)
#   pdl             programmatic dependent launch: tests/kernels/test_pdl.py, the GPU kernel tests (PDL_TESTS_K,
#                   default grouped_linear, mhc, sparse_attention) with CEDSERVE_PDL=1, then benchmarks/step.py (PDL_CELLS, PDL_PATHS: graph-fused graph-fused-overlap) once per
#                   PDL_VARIANTS entry "name:ours,inductor" (default off:0,0 inductor:0,1 all:1,1)
#                                   pdl-tests.log, decode-step-<gpu>-pdl-<name>.json, pdl-step.log
#                                                       PDL_TESTS_S=150 PDL_STEP_S=150 (PDL_TESTS_K: -k)
#   engine          benchmarks/decode.py, the decode engine with the runner off and auto
#                                   decode-engine-<gpu>.json, engine.log                       ENGINE_S=120
#                   The runner's parts are narrowed by TESTS_K (a pytest -k filter), STEP_CELLS (step.py's
#                   --contexts, --batches, --rows), STEP_PATHS / RELEASED_PATHS (step.py --paths) and
#                   ENGINE_RUNNERS (decode.py --runner: off auto on auto-fused auto-fused-tf32 off-tf32
#                   auto-fused-overlap), ENGINE_BATCHES (1 32), ENGINE_STEPS (5) and ENGINE_ARGS (more
#                   decode.py flags, e.g. --dspark off).
#   engram          the runner over memory-mapped Engram tables: tests/unit/test_runner_gpu.py -k engram, then
#                   benchmarks/engram_staging.py --device cuda (host staging and the pinned copy per batch)
#                                   engram-tests.log, engram-staging-<gpu>.json, engram-staging.log
#                                                                     ENGRAM_TESTS_S=150 ENGRAM_BENCH_S=120
#   startup         benchmarks/kernel_warmup.py --engines --only decode: the decode worker's build (kernel warm-up
#                   and the runner's capture) at the released 1M limit, cold Triton and Inductor caches then
#                   warm; STARTUP_DECODE sets DecodeConfig fields (e.g. compile_fused=true)
#                                   startup-cold.json, startup-warm.json, startup.log
#                                                                 STARTUP_COLD_S=260 STARTUP_WARM_S=120
#   tf32            benchmarks/tf32_agreement.py: logits with and without TF32 matmuls
#                                   tf32-agreement-<gpu>.json, tf32.log                          TF32_S=90
#   staging-probe   benchmarks/staging_probe.py: a KV transfer's staging gather in parts, alone on the GPU
#                   and beside a second process        staging-probe.json, staging-probe.log     PROBE_S=60
#   graph-launch    benchmarks/graph_launch.py: host cost of a CUDA graph launch by kernel count, idle and
#                   behind a running launch           graph-launch.json, graph-launch.log         GRAPH_S=60
#   mhc-blocks      benchmarks/mhc_blocks.py: the mHC site kernel's column blocks at decode batches
#                                   mhc-blocks.json, mhc-blocks.log                              MHC_S=90
#   batched-gemm    benchmarks/batched_gemm.py: wo_a's and the MoE down projections' float32 bmm at 1-192 rows
#                   beside per-group / concatenated F.linear, einsum, TF32, bf16   batched-gemm-<gpu>.json  BATCHED_S=60
#   attention-splits  benchmarks/attention_splits.py: the Triton sparse attention's key splits at decode
#                   batches, old rule beside the default     attention-splits-<gpu>.json   SPLITS_S=120
#   kernels         kernel-tests, then kernel-bench
#   kernel-tests    tests/kernels -m "$MARK" (default gpu)  kernel-tests.log, kernel-tests.xml
#                                                                     KERNEL_TESTS_S=200 (QUICK=1: 130)
#   kernel-bench    benchmarks/kernels.py (QUICK=1: --quick; ATTN_SDPA=1 adds dense SDPA)
#                                   kernels-<gpu>.json, kernels.log    KERNEL_BENCH_S=380 (QUICK=1: 200)
#   prefill         benchmarks/prefill.py, mini-40, 4K-128K prompts, engine and all 40 layers
#   prefill-runner  tests/unit/test_prefill_runner_gpu.py, tests/kernels/test_capture_trace.py -k prefill
#                   (prefill-runner-tests.log), then benchmarks/prefill.py: the engine through the kernels
#                   with and without the prefill runner (its graph per chunk) at $TOKENS (4K 32K) in
#                   chunks of $CHUNK (8192); PREFILL_ARGS adds flags (--released-attention), PREFILL_ATTN
#                   replaces the paths (prefill.py --attention), PREFILL_TESTS=0 skips the tests
#                                                    prefill-runner.json, prefill-runner.log
#                                                               TESTS_S=200 LIMIT_S=235 BUDGET_S=190
#   prefill-paged   the prefill engine dense and through the kernels at $TOKENS (4K 32K 128K);
#   prefill-paged-released  the same with the released attention geometry
#   decode-short    benchmarks/decode.py, 4K and 16K x batches 1 8 32, with and without DSpark
#   decode-64k      the same at 64K;  decode-128k: at 128K
#   decode-ep2      expert parallel over two GPUs (NCCL), 4K and 64K x batches 8 32
#                   (these seven: <part>.json, <part>.log; BUDGET_S=190: no new cell after it,
#                   LIMIT_S=235: the hard timeout; ATTENTION picks the decode / prefill attention)
#   decode-cuda     benchmarks/decode.py at $CONTEXTS (256 2048) x $BATCHES (1 8 32), attention
#                   $ATTENTION (off kernels)        decode-cuda.json, decode-cuda.log   DECODE_S=330
#   ep-tests        tests/unit/test_decode_expert_parallel.py -m gpu (two GPUs)  ep-tests.log
#   ep-runner       the runner's expert-parallel step captured with its all-to-all (tests/unit/
#                   test_runner_gpu.py -k expert_parallel: a one-rank NCCL group on one GPU, the
#                   two-rank test where two GPUs exist)      ep-runner-tests.log         EP_RUNNER_S=200
#                                                                                     EP_TESTS_S=200
#   disagg-ttft     benchmarks/disagg_ttft.py --device cuda: colocated beside disaggregated on this GPU, TTFT
#                   beyond compute (issue 29)   disagg/{disagg-ttft-cuda.json,disagg-ttft.log}  DISAGG_S=240;
#                   DISAGG_ARGS replaces the prompts and rounds, DISAGG_SERVE_ARGS the serve flags (--gpus 0)
#   tpot            benchmarks/tpot.py --device cuda: `cedserve serve` on this GPU (demo checkpoint), every token
#                   timed at the client beside the decode worker's step histogram, one request at a time
#                   (issue 28: TPOT within 1.25x of the step)   tpot/{tpot-cuda.json,tpot.log}  TPOT_S=200;
#                   TPOT_SERVE="name:section.field=value,...;..." the systems (graphs:decode.compile_fused=false),
#                   TPOT_ARGS the load (--prompt-tokens 600 --max-tokens 64 --rounds 10); DSpark against its bound:
#                   TPOT_SERVE="on:decode.compile_fused=false;off:decode.compile_fused=false,decode.dspark=false"
#                   (the default compile_fused, with fewer buckets to compile cold: TPOT_SERVE="on:decode.
#                   max_running_requests=4;off:decode.max_running_requests=4,decode.dspark=false"; tpot prints
#                   each system's decode paths, `cedserve_decode_path_on`)
#                   TPOT_ARGS="--prompt-tokens 600 --max-tokens 64 --rounds 10 --prompts heldout --dspark-pair on,off"
#   dspark-cycle    benchmarks/dspark_cycle.py --device cuda: the decode engine on the demo checkpoint, DSpark on
#                   and off, each engine phase's host ms, kernels, GPU ms and syncs (issue 28's DSpark bound)
#                   dspark-cycle.json, dspark-cycle.log   CYCLE_S=150 (each run); CYCLE_ARGS adds flags (--compile-fused);
#                   CYCLE_VARIANTS="f32:;bf16:--dtype bfloat16" runs once per variant (dspark-cycle-<name>.json)
#   full-topology   benchmarks/full_topology.py: prefill on GPU 0, decode on the next $GPUS-1 GPUs,
#                   against colocated serving; $TOPOLOGY_ARGS adds flags (e.g. --colocated-policies
#                   cache_aware,least_loaded,round_robin)          full-topology/{env.txt, bench.log,
#                   full-topology-<gpu>x$GPUS.json, logs/}         TOPOLOGY_S=340, MAX_RUN_S=60 per arm
#   serve           the whole system on this host's GPU(s) as a user starts it: `cedserve serve --device auto`
#                   (one GPU: router, prefill and decode workers share it, each under its memory share)
#                   with the demo checkpoint, then `cedserve generate` and a short `cedserve bench serve`
#                   against it, then stopped      serve/{serve.log, logs/, generate.log, bench-serve.json,
#                   metrics-*.txt, gpu-apps.csv, serve-<gpu>.json}   READY_S=300 GENERATE_S=60 BENCH_S=150;
#                   SERVE_ARGS adds `cedserve serve` flags, BENCH_ARGS replaces the bench's load flags;
#                   SERVE_TEST=1 then runs tests/e2e/test_serve_one_gpu.py (gpu-test.log, SERVE_TEST_S=200).
#                   Needs NIXL (the slim wheel, ../shared/tools/slim_nixl_wheel.sh) and the gRPC extras:
#                   carry them in build/gpu_wheels (--prepare-wheels, below) or .whl/.
#   serve-test      tests/e2e/test_serve_one_gpu.py alone       serve-test/gpu-test.log   SERVE_TEST_S=200
#   held            issue 32's figures on this host's quiet CPUs (the 2-core dev VM is shared): `cedserve bench held`
#                   (it starts `cedserve serve --device cpu`, demo checkpoint) with HELD_SCENARIOS (burst deadlines
#                   huge), then HELD_HUGE_RUNS (4) fresh systems of the huge scenario alone, senders alternating
#                   (client, bytes)          held/{held-cpu-quiet.json, huge-*.json, held.log, logs*/}
#                                                                       HELD_S=240, HELD_HUGE_S=90 per run
#   serve-bench     `cedserve bench serve --device cuda` starting its own arms (disaggregated, colocated) on
#                   GPUS_LIST (0,0); SERVE_BENCH_ARGS replaces the workload, checkpoint and arm flags
#                   serve-bench/{bench-serve.json, bench.log, logs/}   SERVE_BENCH_S=300
#   transfer-one    KV transfer between two processes on ONE GPU (UCX cuda_ipc), WRITE, the real block
#                   layout, contiguous and scattered ids: `cedserve bench kv-transfer` at $TRANSFER_SIZES
#                   (4K,32K,128K)       transfer-one/{bench.log, kv-transfer-cuda-<gpu>.json}  TRANSFER_ONE_S=150
#                   TRANSFER_WHOLE=1 then the same with each request in one write_blocks call
#                   (transfer-one/kv-transfer-cuda-whole.json); TRANSFER_VARIANTS="name:flags;..." then the
#                   same cells with loadtest flags added, each into transfer-one/kv-transfer-cuda-<name>.json
#                   (TRANSFER_BASE=0: only the variants); TRANSFER_CELL_ARGS adds loadtest flags to every run
#                   With build/kv_before (--prepare-before REF) instead: benchmarks/kv_transfer_old_new.py,
#                   this kv_transfer, it without the spin, and REF's, rounds alternating, then 64-byte
#                   blocks (only the fixed cost left), new and old    transfer-one/{bench.log,
#                   kv-transfer-old-new-cuda.json, kv-transfer-old-new-tiny-cuda.json}  TRANSFER_ONE_S=330,
#                   TINY_S=150 (0: skipped), ROUNDS=3; OLD_NEW_ARMS / OLD_ARMS="name:flags;..." replace
#                   the extra arm of this engine (it without the spin) / add arms of the old one
#   train-demo      python -m cedserve.training.demo, then benchmarks/demo_eval.py on its checkpoint
#                   (BACKBONE_S=200, DRAFTER_S=80 budgets)      train-demo/{demo/, train.log,
#                   train-demo.json, eval.log, demo-eval.json}  TRAIN_TIMEOUT_S=430 EVAL_TIMEOUT_S=150
#   train-drafter   the drafter only, over the frozen backbone of $INIT (cedserve/assets/demo), then
#                   the evaluation's decode cells (EVAL_ARGS, default --parts speed); GREEDY_S=60,
#                   DRAFTER_S=240          train-drafter/{..., train-drafter.json}  TRAIN_TIMEOUT_S=420
#                   (both: TRAIN_ARGS / EVAL_ARGS add flags, DEVICE=cpu for a rehearsal, SKIP_EVAL=1)
#   demo-eval       benchmarks/demo_eval.py --parts speed on the shipped demo checkpoint
#                                   demo-eval.json, demo-eval.log                  EVAL_TIMEOUT_S=200
#   transfer        KV transfer on 2+ GPUs: benchmarks/kv_transfer_host.py, kv_transfer_requests.py,
#                   the `cedserve bench kv-transfer` matrix, then the core cells on the new path (with
#                   and without ChunkPosted notices) and the old one from build/kv_before, if made
#                   (--prepare-before)      transfer/{bench.log, host.json, requests.json,
#                   kv-transfer-$DEVICE.json, core-new.json, core-new-noannounce.json, core-old.json}
#                   (DEVICE=cpu QUICK=1: a smoke test on this machine)
#
# Every call writes $OUT/env.txt (torch, the GPU and its clocks); <gpu> in a file name is the card's
# model as nvidia-smi names it (h100, h200, ...; "gpu" when it names none). Two calls may run at once on
# different GPUs (CUDA_VISIBLE_DEVICES) with different OUT: each PART list has its own tree.
#
# The project need not be installed: a folder of symlinks (build/gpu_tree/<parts>) puts `cedserve.*`
# on PYTHONPATH as installed, and python runs with -P (or PYTHONSAFEPATH=1) so the checkout's own
# cedserve/ folder does not shadow it. Wheels the CUDA image lacks are carried in build/gpu_wheels
# (or .whl/) and installed into build/gpu_site first; SITE adds a further folder (e.g. nixl) after it.
# Prepare here, then carry the folders named (all git-ignored):
#
#     bash scripts/gpu.sh --prepare-wheels       # msgspec and grpcio into build/gpu_wheels; WHEELS
#                                                # names others, e.g. for transfer / full-topology:
#     WHEELS="msgspec==0.23.0 protobuf==7.36.2 grpcio==1.85.3 grpcio-health-checking==1.85.1
#             grpcio-reflection==1.85.1 grpcio-status==1.85.3 googleapis-common-protos nixl-cu13" \
#       bash scripts/gpu.sh --prepare-wheels
#     # the router's HTTP API (`cedserve serve`, `cedserve bench serve`) needs these too:
#     WHEELS="uvicorn==0.55.0 starlette==1.10.0 anyio==4.16.0 click==8.5.1 h11==0.16.0 idna==3.21 prometheus_client tqdm" \
#       bash scripts/gpu.sh --prepare-wheels
#     bash scripts/gpu.sh --prepare-deps         # pytest, hypothesis into build/gpu_pydeps (for hosts
#                                                # without them)
#     bash scripts/gpu.sh --prepare-before REF   # kv_transfer of commit REF into build/kv_before
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}

prepare_wheels() {
  mkdir -p build/gpu_wheels
  local req
  for req in ${WHEELS:-msgspec grpcio>=1.85.1}; do
    .venv/bin/python -m pip download -q "$req" --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d build/gpu_wheels
  done
  ls -la build/gpu_wheels
}

prepare_deps() {  # the pure-Python test dependencies, for a host without pytest or hypothesis
  local site name dist
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
}

prepare_before() {  # $1: git ref whose kv_transfer/ the transfer part times as the old path
  local ref=${1:?usage: scripts/gpu.sh --prepare-before GIT_REF} f
  rm -rf build/kv_before && mkdir -p build/kv_before
  for f in $(git ls-tree --name-only "$ref" kv_transfer/); do
    git show "$ref:$f" > "build/kv_before/$(basename "$f")"
  done
  echo "$ref $(git rev-parse "$ref")" > build/kv_before/REF
  ls build/kv_before
}

case "${1:-}" in
  --prepare-wheels) prepare_wheels; exit 0 ;;
  --prepare-deps) prepare_deps; exit 0 ;;
  --prepare-before) prepare_before "${2:-}"; exit 0 ;;
  "") ;;
  *) echo "unknown argument $1 (parts are chosen with PART=...)" >&2; exit 2 ;;
esac

# setuptools' package-dir mapping (router/ -> cedserve.router, ...) does not exist on a host where
# the project is not installed: a folder of symlinks in which `cedserve.*` imports as installed.
make_gpu_tree() {  # $1: tree folder (replaced); $2: the kv_transfer folder to map (default ours)
  rm -rf "$1" && mkdir -p "$1/cedserve"
  local f pkg
  for f in cedserve/*; do ln -s "$ROOT/$f" "$1/cedserve/$(basename "$f")"; done
  for pkg in common model kernels serving prefill_workers decode_workers router proto training; do
    [ -d "$pkg" ] && ln -s "$ROOT/$pkg" "$1/cedserve/$pkg"
  done
  ln -s "${2:-$ROOT/kv_transfer}" "$1/cedserve/kv_transfer"
}

install_gpu_wheels() {  # carried wheels into build/gpu_site, one call at a time
  local wheels=()
  compgen -G "build/gpu_wheels/*.whl" > /dev/null && wheels+=(build/gpu_wheels/*.whl)
  compgen -G ".whl/*.whl" > /dev/null && wheels+=(.whl/*.whl)
  [ ${#wheels[@]} -eq 0 ] && return 0
  mkdir -p build
  # one pip call for all of them: protobuf, googleapis-common-protos and grpcio-status share `google/`
  local lock=(); command -v flock > /dev/null && lock=(flock build/.gpu_site.lock)
  "${lock[@]}" "$PY" -m pip install --quiet --upgrade --no-deps --no-index --no-compile \
    --target build/gpu_site "${wheels[@]}"
}

OUT=${OUT:-build/gpu}
PART=${PART:-runner}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
tree=build/gpu_tree/$(echo "$PART" | tr ' ' '_')
make_gpu_tree "$tree" && install_gpu_wheels
export PYTHONPATH="$ROOT/$tree:$ROOT/build/gpu_site${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
[ -d build/gpu_pydeps ] && export PYTHONPATH="$PYTHONPATH:$ROOT/build/gpu_pydeps"  # after the host's own
"$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,utilization.gpu --format=csv >> "$OUT/env.txt"
# <gpu> in the output names: the card's model (h100, h200, ...), so a file says which card made it
GPU_TAG=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE '[abhl][0-9]{2,3}' | head -1 \
          | tr '[:upper:]' '[:lower:]')
GPU_TAG=${GPU_TAG:-gpu}
quiet() { grep -v "USDT\|profiler_st\|_warn_once\|UserWarning\|sync_debug"; }
NOTE="mini-40 layer plan, random weights, vocabulary 512; torch ops but the mHC kernel and (decode) the paged attention"

# ---------------------------------------------------------------- the model runner (docs/decode.md)
part_runner_tests() {
  timeout "${TESTS_S:-130}" "$PY" -P -m pytest -q -p no:cacheprovider --tb=short tests/unit/test_runner_gpu.py tests/kernels/test_capture_trace.py -p no:warnings -rfE --durations=12 ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
    | grep -v "NIXL INFO\|DEBUG" | tail -250 | tee "$OUT/gpu-tests.log"
}

part_step() {
  timeout "${STEP_S:-220}" "$PY" -P benchmarks/step.py ${STEP_CELLS:---contexts 4096 65536 --batches 1 32 --rows 1 6} --steps 5 \
    --warmup 3 --paths ${STEP_PATHS:-eager graph graph-fused} --dtypes ${STEP_DTYPES:-float32} \
    --out "$OUT/decode-step-$GPU_TAG.json" 2>&1 | quiet | tee "$OUT/step.log"
  [ "${RELEASED_S:-220}" = 0 ] && return 0  # (timeout 0 would mean no limit: 0 skips the released cells)
  timeout "${RELEASED_S:-220}" "$PY" -P benchmarks/step.py --released-attention yes --contexts 65536 \
    --batches 32 --steps 5 --warmup 3 --paths ${RELEASED_PATHS:-${STEP_PATHS:-eager graph graph-fused}} \
    --dtypes ${RELEASED_DTYPES:-float32 bfloat16} \
    --out "$OUT/decode-step-$GPU_TAG-released.json" 2>&1 \
    | quiet | tee -a "$OUT/step.log"
}

part_pdl() {  # programmatic dependent launch (CEDSERVE_PDL, Inductor's enable_pdl): its bit-equality test and
  # the kernel tests with it on, then benchmarks/step.py once per setting (PDL_VARIANTS "name:ours,inductor ...")
  local rc=0 variant name ours inductor
  timeout 60 "$PY" -P -m pytest -q -p no:cacheprovider -o addopts="" -rA tests/kernels/test_pdl.py 2>&1 \
    | tail -15 | tee "$OUT/pdl-tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  CEDSERVE_PDL=1 timeout "${PDL_TESTS_S:-150}" "$PY" -P -m pytest -q -p no:cacheprovider -o addopts="" -rfE \
    tests/kernels -m kernels -k "${PDL_TESTS_K:-grouped_linear or mhc or sparse_attention}" 2>&1 \
    | tail -30 | tee -a "$OUT/pdl-tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  for variant in ${PDL_VARIANTS:-off:0,0 inductor:0,1 all:1,1}; do
    name=${variant%%:*}; ours=${variant#*:}; inductor=${ours#*,}; ours=${ours%,*}
    echo "== step.py, PDL $name (ours $ours, Inductor $inductor)" | tee -a "$OUT/pdl-step.log"
    CEDSERVE_PDL=$ours TORCHINDUCTOR_ENABLE_PDL=$inductor timeout "${PDL_STEP_S:-150}" "$PY" -P benchmarks/step.py \
      ${PDL_CELLS:---contexts 4096 --batches 1 32} --steps 7 --warmup 3 --paths ${PDL_PATHS:-graph-fused graph-fused-overlap} \
      --out "$OUT/decode-step-$GPU_TAG-pdl-$name.json" 2>&1 | quiet | grep -v "^graph-fused\|^  \|Online softmax\|split the" \
      | tee -a "$OUT/pdl-step.log" || rc=1
  done
  return "$rc"
}

part_engine() {
  timeout "${ENGINE_S:-120}" "$PY" -P benchmarks/decode.py --device cuda --preset mini-40 --contexts 4096 \
    --batches ${ENGINE_BATCHES:-1 32} --steps ${ENGINE_STEPS:-5} --warmup-steps 3 --runner ${ENGINE_RUNNERS:-off auto} ${ENGINE_ARGS:-} --out "$OUT/decode-engine-$GPU_TAG.json" 2>&1 \
    | quiet | tee "$OUT/engine.log"
}

part_dspark_cycle() {  # each of CYCLE_VARIANTS ("name:flags;name:flags"; default one unnamed run) with CYCLE_ARGS
  local rc=0 variant name suffix
  local -a variants
  IFS=';' read -ra variants <<< "${CYCLE_VARIANTS:-:}"
  for variant in "${variants[@]}"; do
    name=${variant%%:*}; suffix=${name:+-$name}
    echo "-- dspark-cycle$suffix: ${CYCLE_ARGS:-} ${variant#*:}"
    # shellcheck disable=SC2086
    timeout "${CYCLE_S:-150}" "$PY" -P benchmarks/dspark_cycle.py --device cuda ${CYCLE_ARGS:-} ${variant#*:} \
      --out "$OUT/dspark-cycle$suffix.json" 2>&1 | grep -v "NIXL INFO\|USDT" | tee "$OUT/dspark-cycle$suffix.log" || rc=1
  done
  return "$rc"
}

part_batched_gemm() {  # the step's two batched float32 GEMMs a layer at verify rows, beside other forms
  timeout "${BATCHED_S:-60}" "$PY" -P benchmarks/batched_gemm.py ${BATCHED_ARGS:-} --out "$OUT/batched-gemm-$GPU_TAG.json" 2>&1 \
    | quiet | tee "$OUT/batched-gemm.log"
}

part_attention_splits() {  # the Triton sparse attention's key splits: old rule, default, a sweep
  timeout "${SPLITS_S:-120}" "$PY" -P benchmarks/attention_splits.py ${SPLITS_ARGS:-} --out "$OUT/attention-splits-$GPU_TAG.json" 2>&1 \
    | quiet | tee "$OUT/attention-splits.log"
}

part_engram() {  # the runner over memory-mapped Engram tables (docs/model.md, *Engram tables in host memory*)
  local rc=0
  timeout "${ENGRAM_TESTS_S:-150}" "$PY" -P -m pytest -q -p no:cacheprovider --tb=short tests/unit/test_runner_gpu.py \
    -k engram -p no:warnings -rfE --durations=5 2>&1 | grep -v "NIXL INFO\|DEBUG" | tail -100 \
    | tee "$OUT/engram-tests.log" || rc=$?
  timeout "${ENGRAM_BENCH_S:-120}" "$PY" -P benchmarks/engram_staging.py --device cuda \
    --out "$OUT/engram-staging-$GPU_TAG.json" 2>&1 | quiet | tee "$OUT/engram-staging.log" || rc=$?
  return "$rc"
}

part_startup() {  # the decode worker's start-up at the released 1M limit: cold caches, then warm (issue 28)
  local run rc=0
  TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  export TRITON_CACHE_DIR TORCHINDUCTOR_CACHE_DIR
  for run in cold warm; do
    # shellcheck disable=SC2086
    timeout "$([ $run = cold ] && echo "${STARTUP_COLD_S:-260}" || echo "${STARTUP_WARM_S:-120}")" "$PY" -P \
      benchmarks/kernel_warmup.py --engines --only decode --device cuda --released-attention --max-context 1048576 \
      --max-rows 64 --decode ${STARTUP_DECODE:-} --note "decode worker start-up, $run Triton and Inductor caches" \
      --out "$OUT/startup-$run.json" 2>&1 | quiet | tee -a "$OUT/startup.log" || rc=1
  done
  return "$rc"
}

part_tf32() {  # what decode.matmul_tf32 does to the logits (teacher-forced, demo checkpoint and mini-40)
  timeout "${TF32_S:-90}" "$PY" -P benchmarks/tf32_agreement.py --out "$OUT/tf32-agreement-$GPU_TAG.json" 2>&1 \
    | quiet | tee "$OUT/tf32.log"
}

# ---------------------------------------------------------------- kernels (docs/kernels.md)
part_kernel_tests() (
  unset TRITON_INTERPRET
  local limit=${KERNEL_TESTS_S:-$([ "${QUICK:-0}" = 1 ] && echo 130 || echo 200)} ignore=() rc
  "$PY" -P -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "triton", triton.__version__, "device", torch.cuda.get_device_name())' 2>&1 | tee -a "$OUT/env.txt"
  if ! "$PY" -c 'import pytest' 2>/dev/null; then
    echo "pytest is not importable here: see --prepare-deps" | tee "$OUT/kernel-tests.log"
    return 3
  fi
  # without an importable hypothesis (a copy built for another Python lacks its native part) skip
  # the property tests and its pytest plugin, which would crash the run's summary
  "$PY" -c 'import hypothesis' 2>/dev/null || ignore=(--ignore=tests/kernels/test_records.py -p no:hypothesispytest)
  echo "== pytest tests/kernels -m ${MARK:-gpu} ${ignore[*]}"
  timeout "$limit" "$PY" -P -m pytest tests/kernels -m "${MARK:-gpu}" -q -p no:cacheprovider -o addopts="" -rA \
    --junitxml="$OUT/kernel-tests.xml" "${ignore[@]}" ${KERNEL_TESTS_K:+-k "$KERNEL_TESTS_K"} 2>&1 | tee "$OUT/kernel-tests.log"
  rc=${PIPESTATUS[0]}
  # pytest exits 5 when it collected nothing: that is a failed run here, not a pass
  grep -qE "[0-9]+ passed" "$OUT/kernel-tests.log" || { echo "no GPU test passed"; [ "$rc" -eq 0 ] && rc=4; }
  return "$rc"
)

part_kernel_bench() (
  unset TRITON_INTERPRET
  local limit=${KERNEL_BENCH_S:-$([ "${QUICK:-0}" = 1 ] && echo 200 || echo 380)} quick=()
  [ "${QUICK:-0}" = 1 ] && quick=(--quick)
  echo "== benchmarks/kernels.py ${quick[*]}"
  timeout "$limit" "$PY" -P benchmarks/kernels.py "${quick[@]}" --out "$OUT/kernels-$GPU_TAG.json" 2>&1 \
    | tee "$OUT/kernels.log"
  return "${PIPESTATUS[0]}"
)

# ---------------------------------------------------------------- prefill and decode engines
part_prefill() {
  timeout "${LIMIT_S:-235}" "$PY" benchmarks/prefill.py --device cuda --preset mini-40 \
    --tokens 4096 16384 65536 131072 --chunk-tokens 2048 --time-budget-s "${BUDGET_S:-190}" \
    --note "$NOTE; one GPU" --out "$OUT/prefill.json" 2>&1 | grep -v NIXL | tee "$OUT/prefill.log"
}

part_prefill_paged() {  # $1: prefill-paged or prefill-paged-released
  local released=()
  [ "$1" = prefill-paged-released ] && released=(--released-attention)
  # shellcheck disable=SC2086
  timeout "${LIMIT_S:-235}" "$PY" benchmarks/prefill.py --device cuda --preset mini-40 "${released[@]}" \
    --tokens ${TOKENS:-4096 32768 131072} --chunk-tokens 2048 --attention ${ATTENTION:-off kernels} --repeats 2 \
    --skip-all-layers --time-budget-s "${BUDGET_S:-190}" --note "$NOTE; prefill attention dense vs kernels; one GPU" \
    --out "$OUT/$1.json" 2>&1 | grep -v NIXL | tee "$OUT/$1.log"
}

part_prefill_runner() {  # the prefill runner (docs/prefill.md, *The prefill chunk runner*)
  [ "${PREFILL_TESTS:-1}" = 0 ] || timeout "${TESTS_S:-200}" "$PY" -P -m pytest -q -p no:cacheprovider --tb=short tests/unit/test_prefill_runner_gpu.py \
    tests/kernels/test_capture_trace.py -k prefill -p no:warnings -rfE --durations=8 2>&1 \
    | grep -v "NIXL INFO\|DEBUG" | tail -150 | tee "$OUT/prefill-runner-tests.log"
  # shellcheck disable=SC2086
  timeout "${LIMIT_S:-235}" "$PY" benchmarks/prefill.py --device cuda --preset mini-40 \
    --tokens ${TOKENS:-4096 32768} --chunk-tokens ${CHUNK:-8192} --attention ${PREFILL_ATTN:-kernels kernels+runner} --repeats 2 \
    --skip-all-layers --time-budget-s "${BUDGET_S:-190}" --note "$NOTE; prefill through the kernels, runner off vs on" \
    ${PREFILL_ARGS:-} --out "$OUT/prefill-runner.json" 2>&1 | grep -v NIXL | tee "$OUT/prefill-runner.log"
}

part_decode_mode() {  # $1: the part's name; rest: benchmarks/decode.py arguments
  local mode=$1; shift
  # ATTENTION="off kernels" times both decode attention paths side by side (default auto: the kernels on CUDA)
  # shellcheck disable=SC2086
  timeout "${LIMIT_S:-235}" "$PY" benchmarks/decode.py --device cuda --preset mini-40 --steps 4 \
    --time-budget-s "${BUDGET_S:-190}" --attention ${ATTENTION:-auto} \
    --note "$NOTE; decode attention ${ATTENTION:-auto}; $mode" --out "$OUT/$mode.json" "$@" 2>&1 \
    | grep -v NIXL | tee "$OUT/$mode.log"
}

part_decode_cuda() {
  # shellcheck disable=SC2086
  timeout "${DECODE_S:-330}" "$PY" benchmarks/decode.py --device cuda --preset mini-40 \
    --contexts ${CONTEXTS:-256 2048} --batches ${BATCHES:-1 8 32} --steps 4 \
    --attention ${ATTENTION:-off kernels} --warmup-steps 4 \
    --note "one H200; mini-40 layer plan, random weights, vocabulary cut to 512; decode attention dense (off) and paged kernels" \
    --out "$OUT/decode-cuda.json" 2>&1 | grep -v NIXL | tee "$OUT/decode-cuda.log"
}

part_ep_tests() {
  timeout "${EP_TESTS_S:-200}" "$PY" -P -m pytest tests/unit/test_decode_expert_parallel.py -m gpu -q -p no:cacheprovider 2>&1 \
    | tail -20 | tee "$OUT/ep-tests.log"
}

part_ep_runner() {
  timeout "${EP_RUNNER_S:-200}" "$PY" -P -m pytest -q -p no:cacheprovider --tb=short tests/unit/test_runner_gpu.py \
    -k expert_parallel -rA -p no:warnings --durations=8 2>&1 | grep -v "NIXL INFO\|DEBUG" | tail -120 \
    | tee "$OUT/ep-runner-tests.log"
}

# ---------------------------------------------------------------- serving end to end (docs/bench-serve.md)
part_full_topology() (
  local out=$OUT/full-topology gpus=${GPUS:-2}
  mkdir -p "$out"
  # the worker processes start as `python -m cedserve.cli` in this folder: keep the checkout's
  # cedserve/ off their sys.path too
  export PYTHONSAFEPATH=1 CEDSERVE_HOME="$ROOT/build/cedserve_home"
  "$PY" -c "import torch; print(torch.__version__, torch.cuda.device_count(), torch.cuda.get_device_name(0))" \
    | tee "$out/env.txt"
  "$PY" -c "
import importlib
for m in ('grpc', 'msgspec', 'tokenizers', 'safetensors', 'prometheus_client', 'grpc_health', 'grpc_reflection',
          'nixl_cu13', 'nixl_cu12', 'tqdm', 'matplotlib'):
    try:
        importlib.import_module(m); print('have', m)
    except ImportError as exc:
        print('MISSING', m, exc)
" | tee -a "$out/env.txt"
  # shellcheck disable=SC2086
  timeout "${TOPOLOGY_S:-340}" "$PY" benchmarks/full_topology.py --gpus "$gpus" --max-run-s "${MAX_RUN_S:-60}" \
    --no-progress --out "$out/full-topology-${GPU_TAG}x$gpus.json" --log-dir "$out/logs" ${TOPOLOGY_ARGS:-} 2>&1 \
    | grep -v NIXL | tee "$out/bench.log"
  local rc=${PIPESTATUS[0]}
  echo "exit $rc" | tee -a "$out/bench.log"
  return "$rc"
)

# ---------------------------------------------------------------- the whole system on one GPU (docs/deploy.md)
part_serve() (
  local out=$OUT/serve port=${SERVE_PORT:-50151} pid t0 ready_ms=-1 rc_gen=-1 rc_bench=-1 rc=0
  mkdir -p "$out/logs"
  # workers start as `python -m cedserve.cli` from here: keep the checkout's cedserve/ off sys.path
  export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 CEDSERVE_HOME="$ROOT/build/cedserve_home"
  serve_modules "$out/env.txt" || return 1
  t0=$(date +%s%N)
  # shellcheck disable=SC2086
  "$PY" -P -m cedserve.cli serve --device "${SERVE_DEVICE:-auto}" --port "$port" --http-port -1 \
    --log-dir "$out/logs" --max-restarts 0 ${SERVE_ARGS:-} > "$out/serve.log" 2>&1 &
  pid=$!
  for _ in $(seq $((${READY_S:-300} * 2))); do
    grep -q '^CEDSERVE_READY' "$out/serve.log" && { ready_ms=$((($(date +%s%N) - t0) / 1000000)); break; }
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  grep -v NIXL "$out/serve.log" | head -40
  if [ "$ready_ms" = -1 ]; then
    echo "cedserve serve was not ready (see $out/serve.log and $out/logs/)"; rc=1
  else
    echo "== ready in $ready_ms ms"
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits > "$out/gpu-apps-ready.csv" 2>&1
    timeout "${GENERATE_S:-60}" "$PY" -P -m cedserve.cli generate "def fibonacci(" --address "127.0.0.1:$port" \
      --max-tokens 48 -v > "$out/generate.log" 2>&1
    rc_gen=$?
    cat "$out/generate.log"
    # shellcheck disable=SC2086
    timeout "${BENCH_S:-150}" "$PY" -P -m cedserve.cli bench serve --address "127.0.0.1:$port" \
      ${BENCH_ARGS:---concurrency 1,4 --sessions 8 --max-run-s 45} --no-plots --no-progress \
      --out "$out/bench-serve.json" > "$out/bench.log" 2>&1
    rc_bench=$?
    tail -25 "$out/bench.log"
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits > "$out/gpu-apps.csv" 2>&1
    local name url
    grep -o 'metrics of [a-z0-9-]*: http://[^ ]*' "$out/serve.log" | while read -r _ _ name url; do
      "$PY" -P -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' \
        "$url" > "$out/metrics-${name%:}.txt" 2>&1
    done
    [ "$rc_gen" -eq 0 ] && [ "$rc_bench" -eq 0 ] || rc=1
  fi
  kill -INT "$pid" 2>/dev/null
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  "$PY" -P "$ROOT/benchmarks/serve_summary.py" "$out" --startup-ms "$ready_ms" --generate-rc "$rc_gen" \
    --bench-rc "$rc_bench" --out "$out/serve-$GPU_TAG.json" 2>&1 | tee -a "$out/bench.log"
  if [ "${SERVE_TEST:-0}" = 1 ]; then  # the GPU test of the same path (needs pytest: --prepare-deps)
    timeout "${SERVE_TEST_S:-200}" "$PY" -P -m pytest -q -p no:cacheprovider -o addopts="" -rA \
      tests/e2e/test_serve_one_gpu.py 2>&1 | grep -v NIXL | tail -40 | tee "$out/gpu-test.log"
    grep -q " passed" "$out/gpu-test.log" || rc=1
  fi
  return "$rc"
)

part_serve_test() (  # the GPU test of `cedserve serve` on one GPU alone (needs pytest: --prepare-deps)
  local out=$OUT/serve-test rc
  mkdir -p "$out"
  # the test starts `python -m cedserve.cli` from here: keep the checkout's cedserve/ off sys.path
  export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 CEDSERVE_HOME="$ROOT/build/cedserve_home"
  timeout "${SERVE_TEST_S:-200}" "$PY" -P -m pytest -q -p no:cacheprovider -o addopts="" -rA \
    tests/e2e/test_serve_one_gpu.py > "$out/pytest-raw.log" 2>&1
  rc=$?
  echo "pytest exit status $rc" >> "$out/pytest-raw.log"
  grep -v NIXL "$out/pytest-raw.log" | tail -60 | tee "$out/gpu-test.log"
  [ "$rc" -eq 0 ]
)

part_held() (  # issue 32 on quiet CPUs: the embedded default on CPU under load, abuse and huge prompts
  local out=$OUT/held i sender
  mkdir -p "$out"
  export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 CEDSERVE_HOME="$ROOT/build/cedserve_home"
  (nproc; uptime) > "$out/host.txt" 2>&1
  # shellcheck disable=SC2086
  (cd /tmp && timeout "${HELD_S:-240}" "$PY" -P -m cedserve.cli bench held --scenarios ${HELD_SCENARIOS:-burst deadlines huge} \
     --log-dir "$out/logs" --out "$out/held-cpu-quiet.json") 2>&1 | grep -v "NIXL INFO" | tail -60 | tee "$out/held.log"
  for i in $(seq "${HELD_HUGE_RUNS:-4}"); do
    sender=client; [ $((i % 2)) -eq 0 ] && sender=bytes
    echo "== huge, fresh system $i, sender $sender" | tee -a "$out/held.log"
    (cd /tmp && timeout "${HELD_HUGE_S:-90}" "$PY" -P -m cedserve.cli bench held --scenarios huge --huge-sender "$sender" \
       --log-dir "$out/logs-huge-$i" --out "$out/huge-$i-$sender.json") 2>&1 | grep -v "NIXL INFO" | tail -12 | tee -a "$out/held.log"
  done
)

serve_modules() {  # $1: where to write what this host has; fails (naming the module) where `cedserve serve` lacks one
  {
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1
    "$PY" -P -c 'import importlib, torch
print("torch", torch.__version__, "gpus", torch.cuda.device_count())
for m in ("nixl_cu13", "nixl_cu12", "grpc", "grpc_health", "grpc_reflection", "grpc_status", "msgspec", "tokenizers",
          "uvicorn", "starlette", "prometheus_client", "tqdm", "safetensors"):
    try:
        importlib.import_module(m); print("have", m)
    except ImportError as exc:
        print("MISSING", m, exc)'
  } 2>&1 | tee "$1"
  if grep -v nixl_cu "$1" | grep -q '^MISSING' || ! grep -q '^have nixl_cu' "$1"; then
    echo "a module cedserve serve needs is missing here (see above): carry its wheel in build/gpu_wheels"
    return 1
  fi
}

part_serve_bench() (  # `cedserve bench serve` starting its own arms on this GPU: disaggregated beside colocated
  local out=$OUT/serve-bench
  mkdir -p "$out"
  serve_modules "$out/env.txt" || return 1
  (cd /tmp && timeout "${SERVE_BENCH_S:-300}" "$PY" -P -m cedserve.cli bench serve --device cuda --gpus "${GPUS_LIST:-0,0}" \
     ${SERVE_BENCH_ARGS:---checkpoint "$ROOT/cedserve/assets/demo" --policies cache_aware --colocated --concurrency 1 --sessions 4 --max-run-s 30} \
     --no-progress --log-dir "$out/logs" --out "$out/bench-serve.json") 2>&1 | grep -v "NIXL INFO" | tee "$out/bench.log"
)

# ---------------------------------------------------------------- the demo checkpoint (docs/training.md)
part_train() (  # $1: train-demo or train-drafter
  local out=$OUT/$1 device=${DEVICE:-cuda} rc_train rc_eval=-1 limit note
  local init=${INIT:-cedserve/assets/demo}
  mkdir -p "$out"
  export PYTHONUNBUFFERED=1
  {
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
    "$PY" -P -c 'import sys, sysconfig, torch, tokenizers; print("python", sys.version.split()[0], "torch", torch.__version__,
"tokenizers", tokenizers.__version__, "stdlib", sysconfig.get_paths()["stdlib"])'
  } 2>&1 | tee "$out/train.log"
  if [ "$1" = train-drafter ]; then
    local drafter_s=${DRAFTER_S:-240} greedy_s=${GREEDY_S:-60}
    limit=${TRAIN_TIMEOUT_S:-$((drafter_s + greedy_s + 120))}
    # --deadline-seconds: if loading, generation and caching ran long, training gives up the
    # difference rather than the timeout killing the run before it writes the checkpoint
    # shellcheck disable=SC2086
    timeout "$limit" "$PY" -P -m cedserve.training.demo --device "$device" --init "$init" --drafter-only \
      --out "$out/demo" --report "$out/train-drafter.json" --drafter-seconds "$drafter_s" \
      --greedy-seconds "$greedy_s" --deadline-seconds "$((limit - 15))" ${TRAIN_ARGS:-} 2>&1 | tee -a "$out/train.log"
    rc_train=${PIPESTATUS[0]}
    local eval_args=${EVAL_ARGS:---parts speed}
    note=${NOTE_EVAL:-one GPU; the backbone of $init with the drafter just trained by cedserve.training.demo --drafter-only}
  else
    # shellcheck disable=SC2086
    timeout "${TRAIN_TIMEOUT_S:-430}" "$PY" -P -m cedserve.training.demo --device "$device" --out "$out/demo" \
      --report "$out/train-demo.json" --backbone-seconds "${BACKBONE_S:-200}" --drafter-seconds "${DRAFTER_S:-80}" \
      ${TRAIN_ARGS:-} 2>&1 | tee -a "$out/train.log"
    rc_train=${PIPESTATUS[0]}
    local eval_args=${EVAL_ARGS:-}
    note=${NOTE_EVAL:-one GPU; the checkpoint just trained by cedserve.training.demo}
  fi
  if [ "$rc_train" -eq 0 ] && [ "${SKIP_EVAL:-0}" != 1 ]; then  # SKIP_EVAL=1: the caller evaluates
    # shellcheck disable=SC2086
    timeout "${EVAL_TIMEOUT_S:-150}" "$PY" -P benchmarks/demo_eval.py --device "$device" --checkpoint "$out/demo" \
      --out "$out/demo-eval.json" --note "$note" $eval_args 2>&1 | grep -v NIXL | tee "$out/eval.log"
    rc_eval=${PIPESTATUS[0]}
  fi
  echo "train rc=$rc_train eval rc=$rc_eval (results in $out; copy demo/ to cedserve/assets/demo)"
  [ "$rc_train" -eq 0 ] && { [ "$rc_eval" -eq 0 ] || [ "${SKIP_EVAL:-0}" = 1 ]; }
)

part_demo_eval() {
  # shellcheck disable=SC2086
  timeout "${EVAL_TIMEOUT_S:-200}" "$PY" -P benchmarks/demo_eval.py --device cuda --parts speed \
    --out "$OUT/demo-eval.json" --note "one GPU; the shipped cedserve/assets/demo" ${EVAL_ARGS:-} 2>&1 \
    | grep -v NIXL | tee "$OUT/demo-eval.log"
}

# ---------------------------------------------------------------- KV transfer (docs/kv_transfer.md)
part_transfer() (
  # runs from /tmp so the checkout's own cedserve/ folder does not shadow the tree in worker processes
  local out=$OUT/transfer device=${DEVICE:-cuda} log size=128K sizes=32K,128K,1M big=128K,1M blocks=2048
  local new=$ROOT/$tree old=$ROOT/build/gpu_tree_before
  mkdir -p "$out"
  log=$out/bench.log
  : > "$log"
  [ "${QUICK:-0}" = 1 ] && { size=4K; sizes=4K; big=4K; blocks=256; }
  [ -f build/kv_before/agent.py ] && make_gpu_tree "$old" "$ROOT/build/kv_before"
  export PYTHONUNBUFFERED=1
  filter() { grep -v "NIXL INFO\|^\[" | tee -a "$log"; }
  {
    date -u +"%Y-%m-%dT%H:%M:%SZ"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1
    nvidia-smi topo -m 2>/dev/null | head -4
    cd /tmp && "$PY" -P -c 'import torch, cedserve.bench.kv_transfer.loadtest as lt
from cedserve.kv_transfer.nixl_backend import import_nixl
print("torch", torch.__version__, "gpus", torch.cuda.device_count(), "nixl", import_nixl().__name__)'
  } 2>&1 | tee -a "$log"
  bench() {  # $1: tree, $2: json name, $3: timeout s, rest: `cedserve bench kv-transfer` arguments
    local root=$1 name=$2 limit=$3 module=cedserve.bench.kv_transfer.loadtest; shift 3
    echo "== [$name] bench kv-transfer $*" | tee -a "$log"
    (cd /tmp && PYTHONPATH="${PYTHONPATH/$new/$root}" timeout "$limit" "$PY" -P -m "$module" \
       --device "$device" --json "$out/$name.json" "$@") 2>&1 | filter
  }
  echo "== [host] benchmarks/kv_transfer_host.py" | tee -a "$log"
  (cd /tmp && timeout 60 "$PY" -P "$ROOT/benchmarks/kv_transfer_host.py" --blocks $blocks --reps 50 --engine-reps 15 \
     --json "$out/host.json") 2>&1 | filter
  echo "== [requests] benchmarks/kv_transfer_requests.py" | tee -a "$log"
  (cd /tmp && timeout 40 "$PY" -P "$ROOT/benchmarks/kv_transfer_requests.py" --device "$device" --sizes "$sizes" \
     --pieces 1,2,4,16 --reps 3 --json "$out/requests.json") 2>&1 | filter
  bench "$new" "kv-transfer-$device" 100 --sizes $sizes --batch 1,4,8 --fan-in 1 --reps 3
  local core=(--sizes $big --batch 1,4,8 --modes write --fan-in 1 --reps 3 --only cross_layer,auto)
  bench "$new" core-new 60 "${core[@]}"
  bench "$new" core-new-noannounce 45 --sizes $size --batch 1,8 --modes write --fan-in 1 --reps 3 \
    --only cross_layer,auto --set announce_posts=false
  if [ -d "$old" ]; then
    echo "== old path: $(cat build/kv_before/REF)" | tee -a "$log"
    bench "$old" core-old 60 "${core[@]}"
  fi
  echo "== summary (GB/s; ratio to raw one-descriptor NIXL; p50 ms)" | tee -a "$log"
  (cd /tmp && "$PY" - "$out" "$([ "${QUICK:-0}" = 1 ] && echo 4096 || echo 131072)" <<'EOF'
import glob
import json
import os
import sys

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
  ) 2>&1 | tee -a "$log"
)

part_transfer_one() (  # issue 29: KV transfer between two processes on ONE GPU (UCX cuda_ipc), WRITE
  local out=$OUT/transfer-one
  local cells=(--device cuda --sizes "${TRANSFER_SIZES:-4K,32K,128K}" --batch 1 --modes write --fan-in 1 --reps 3)
  # shellcheck disable=SC2206
  cells+=(${TRANSFER_CELL_ARGS:-})  # e.g. "--stream-blocks 65536": every arm and variant hands each request over in one call
  mkdir -p "$out"
  export PYTHONUNBUFFERED=1
  if [ ! -f build/kv_before/agent.py ]; then
    [ "${TRANSFER_BASE:-1}" = 0 ] || (cd /tmp && timeout "${TRANSFER_ONE_S:-150}" "$PY" -P -m cedserve.bench.kv_transfer.loadtest "${cells[@]}" \
       --only cross_layer --json "$out/kv-transfer-cuda-$GPU_TAG.json") 2>&1 | grep -v "NIXL INFO\|^\[" | tee "$out/bench.log"
    # TRANSFER_WHOLE=1: the same cells with each request handed over in one write_blocks call (a prefill
    # that writes its KV at the end), beside the default 128-block pieces: what the pieces cost
    if [ "${TRANSFER_WHOLE:-0}" = 1 ]; then
      (cd /tmp && timeout "${TRANSFER_ONE_S:-150}" "$PY" -P -m cedserve.bench.kv_transfer.loadtest "${cells[@]}" \
         --only cross_layer --stream-blocks 65536 --json "$out/kv-transfer-cuda-whole.json") 2>&1 \
         | grep -v "NIXL INFO\|^\[" | tee -a "$out/bench.log"
    fi
    # TRANSFER_VARIANTS="name:flags;name2:flags2": the same cells again with loadtest flags added (e.g.
    # "whole-spin5ms:--stream-blocks 65536 --set spin_s=0.005"), each into kv-transfer-cuda-<name>.json
    local variant name flags
    IFS=';' read -r -a variants <<< "${TRANSFER_VARIANTS:-}"
    for variant in "${variants[@]}"; do
      name=${variant%%:*} flags=${variant#*:}
      echo "== variant $name: $flags" | tee -a "$out/bench.log"
      # shellcheck disable=SC2086
      (cd /tmp && timeout "${TRANSFER_ONE_S:-150}" "$PY" -P -m cedserve.bench.kv_transfer.loadtest "${cells[@]}" \
         --only cross_layer $flags --json "$out/kv-transfer-cuda-$name.json") 2>&1 \
         | grep -v "NIXL INFO\|^\[" | tee -a "$out/bench.log"
    done
    return
  fi
  echo "== old path: $(cat build/kv_before/REF)" | tee "$out/bench.log"
  # OLD_NEW_ARMS="name:flags;...": arms of this engine beside "new" and "old" (default: it without the
  # spin); OLD_ARMS likewise of the old engine (e.g. "old-whole:--stream-blocks 65536")
  local arms=() spec
  IFS=';' read -r -a specs <<< "${OLD_NEW_ARMS-new-nospin:--set spin_s=0}"
  for spec in "${specs[@]}"; do arms+=(--arm "$spec"); done
  IFS=';' read -r -a specs <<< "${OLD_ARMS:-}"
  for spec in "${specs[@]}"; do arms+=(--old-arm "$spec"); done
  (cd /tmp && timeout "${TRANSFER_ONE_S:-330}" "$PY" -P "$ROOT/benchmarks/kv_transfer_old_new.py" \
     --old-kv "$ROOT/build/kv_before" --rounds "${ROUNDS:-3}" "${arms[@]}" \
     --json "$out/kv-transfer-old-new-cuda.json" -- "${cells[@]}" --only cross_layer) 2>&1 \
     | grep -v "NIXL INFO\|^\[" | tee -a "$out/bench.log"
  [ "${TINY_S:-150}" = 0 ] && return
  (cd /tmp && timeout "${TINY_S:-150}" "$PY" -P "$ROOT/benchmarks/kv_transfer_old_new.py" \
     --old-kv "$ROOT/build/kv_before" --rounds 2 --json "$out/kv-transfer-old-new-tiny-cuda.json" -- \
     --device cuda --block-bytes 64 --sizes 4K,128K --batch 1 --modes write --fan-in 1 --reps 5 --only cross_layer,auto) \
     2>&1 | grep -v "NIXL INFO\|^\[" | tee -a "$out/bench.log"
)

SHIM=$ROOT/build/disagg_shim  # a tree whose .venv/bin/cedserve runs this host's python over the gpu tree (cedserve_shim)

cedserve_shim() {  # write $SHIM/.venv/bin/cedserve
  local shim=$SHIM py
  py=$(command -v "$PY")
  mkdir -p "$shim/.venv/bin"
  printf '#!/bin/sh\nexec "%s" -P -m cedserve.cli "$@"\n' "$py" > "$shim/.venv/bin/cedserve"
  chmod +x "$shim/.venv/bin/cedserve"
}

part_tpot() (  # issue 28: TPOT against the decode worker's step time, per request, on this GPU
  local spec specs serves=() bins=()
  cedserve_shim
  mkdir -p "$OUT/tpot"
  IFS=';' read -r -a specs <<< "${TPOT_SERVE:-graphs:decode.compile_fused=false}"
  for spec in "${specs[@]}"; do
    serves+=(--serve "$spec") bins+=(--serve-bin "${spec%%:*}=$SHIM/.venv/bin/cedserve")
  done
  export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 CEDSERVE_HOME="$ROOT/build/cedserve_home"
  # shellcheck disable=SC2086
  timeout "${TPOT_S:-200}" "$PY" -P benchmarks/tpot.py --device cuda "${serves[@]}" "${bins[@]}" \
    ${TPOT_ARGS:---prompt-tokens 600 --max-tokens 64 --rounds 10} --note "one GPU, demo checkpoint" \
    --out "$OUT/tpot/tpot-cuda.json" 2>&1 | grep -v "NIXL INFO" | tail -60 | tee "$OUT/tpot/tpot.log"
)

part_disagg_ttft() (  # issue 29: TTFT that disaggregation adds at low load, same prompts, same GPU
  # benchmarks/disagg_ttft.py starts `TREE/.venv/bin/cedserve`: the shim runs this host's python over the gpu tree
  cedserve_shim
  mkdir -p "$OUT/disagg"
  export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 CEDSERVE_HOME="$ROOT/build/cedserve_home"
  # shellcheck disable=SC2086
  timeout "${DISAGG_S:-240}" "$PY" -P benchmarks/disagg_ttft.py --tree "new=$SHIM" --device cuda \
    ${DISAGG_ARGS:---prompt-tokens 64,512 --long-tokens 2048 --rounds 8 --long-rounds 3 --runs 1} \
    --serve-args "${DISAGG_SERVE_ARGS:---gpus 0}" --ready-timeout-s 180 --note "one GPU, both systems on it" --out "$OUT/disagg/disagg-ttft-cuda.json" 2>&1 \
    | grep -v "NIXL INFO" | tail -80 | tee "$OUT/disagg/disagg-ttft.log"
)

run_part() {  # $1: part name
  case "$1" in
    runner) part_runner_tests; part_step; part_engine ;;
    runner-tests) part_runner_tests ;;
    step) part_step ;;
    engine) part_engine ;;
    pdl) part_pdl ;;
    engram) part_engram ;;
    tf32) part_tf32 ;;
    startup) part_startup ;;
    attention-splits) part_attention_splits ;;
    batched-gemm) part_batched_gemm ;;
    kernels) local rc=0; part_kernel_tests || rc=$?; part_kernel_bench || rc=$?; return "$rc" ;;
    kernel-tests) part_kernel_tests ;;
    kernel-bench) part_kernel_bench ;;
    prefill) part_prefill ;;
    prefill-runner) part_prefill_runner ;;
    prefill-paged|prefill-paged-released) part_prefill_paged "$1" ;;
    decode-short) part_decode_mode "$1" --contexts 4096 16384 --batches 1 8 32 ;;
    decode-64k) part_decode_mode "$1" --contexts 65536 --batches 1 8 32 ;;
    decode-128k) part_decode_mode "$1" --contexts 131072 --batches 1 8 32 ;;
    decode-ep2) part_decode_mode "$1" --ep 2 --contexts 4096 65536 --batches 8 32 ;;
    decode-cuda) part_decode_cuda ;;
    ep-tests) part_ep_tests ;;
    ep-runner) part_ep_runner ;;
    full-topology) part_full_topology ;;
    train-demo|train-drafter) part_train "$1" ;;
    demo-eval) part_demo_eval ;;
    transfer) part_transfer ;;
    serve) part_serve ;;
    serve-test) part_serve_test ;;
    held) part_held ;;
    serve-bench) part_serve_bench ;;
    transfer-one) part_transfer_one ;;
    disagg-ttft) part_disagg_ttft ;;
    tpot) part_tpot ;;
    dspark-cycle) part_dspark_cycle ;;
    staging-probe) timeout "${PROBE_S:-60}" "$PY" -P benchmarks/staging_probe.py --out "$OUT/staging-probe.json" 2>&1 \
                  | tee "$OUT/staging-probe.log" ;;
    graph-launch) timeout "${GRAPH_S:-60}" "$PY" -P benchmarks/graph_launch.py --out "$OUT/graph-launch.json" 2>&1 \
                  | tee "$OUT/graph-launch.log" ;;
    mhc-blocks) timeout "${MHC_S:-90}" "$PY" -P benchmarks/mhc_blocks.py --out "$OUT/mhc-blocks.json" 2>&1 \
                  | tee "$OUT/mhc-blocks.log" ;;
    *) echo "unknown part $1 (see the top of scripts/gpu.sh)" >&2; return 2 ;;
  esac
}

failed=()
for part in $PART; do
  echo "== part $part"
  run_part "$part" || failed+=("$part")
done
[ ${#failed[@]} -eq 0 ] || { echo "failed parts: ${failed[*]} (results in $OUT)"; exit 1; }
