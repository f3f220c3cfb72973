"""One launch each of the decode hot kernels at the released shapes, for a profiler to attach to:
sparse decode attention (batch 64, top-512 + 128 window, 64 heads x 512, default launch), the
index scan (64 tokens x 262K index keys, block maxima, default launch) and the index-key record
writer (1M rows, v3, v4 and the Gluon v13). Each kernel runs a few
untimed times first (compile, warm), then `--launches` times inside NVTX ranges.

    ncu --nvtx --nvtx-include "profile/" --section WarpStateStats --section SchedulerStats \\
        --section Occupancy --section MemoryWorkloadAnalysis python -P benchmarks/kernel_profile.py

Needs a CUDA device; prints the kernels it ran and their wall time per launch (event-timed)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import TRITON, AttentionProblem, _block_slots, _index_queries, _pool, _triton, profiling_device


def main() -> int:
    # (after `kernels`, which makes `cedserve.kernels` importable from a plain checkout)
    from cedserve.kernels import records as rec_ops
    from cedserve.kernels.indexer import IndexKeys, index_scores
    from cedserve.kernels.sparse_attention import AttentionConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=2)
    parser.add_argument("--only", choices=["attention", "index", "writer"], default=None)
    parser.add_argument("--attention", default="default",
                        help="attention launch: default (what the model runs: gluon on sm_90), triton (the Triton "
                             "kernel's defaults), gluon, or keysplit (Triton, keys in 2, whole value rows)")
    parser.add_argument("--tokens", type=int, default=64, help="attention batch (the first N of the 64 tokens)")
    args = parser.parse_args()
    dev = profiling_device()
    if dev is None:
        return 2
    runs: list[tuple[str, object]] = []
    if args.only in (None, "attention"):
        p = AttentionProblem.make(dev).first(args.tokens)
        cfg = {"default": AttentionConfig(), "triton": TRITON, "gluon": AttentionConfig(kernel="gluon"),
               "keysplit": _triton(64, 32, 2, 8, 1, 1, False)}[args.attention]
        runs.append(("attention", p.call(torch.empty_like(p.q), cfg)))
    if args.only in (None, "index"):
        n, ctx, entries = 64, 1 << 18, 64
        idx = _pool("index", 128, n * ctx, entries, dev, fill=True)
        table = torch.arange(n * (ctx // entries), device=dev).view(n, -1).int()
        keys = IndexKeys(idx, table, torch.arange(n, device=dev).int(), torch.full((n,), ctx, device=dev).int())
        qi = _index_queries(n, dev)
        wi = torch.randn(n, 32, device=dev) * 32**-0.5
        maxima = torch.empty(n, ctx // 8, device=dev)
        runs.append(("index", lambda: index_scores(qi, wi, keys, width=ctx, block_max=8, write_scores=False,
                                                   maxima_out=maxima, impl="triton")))
    if args.only in (None, "writer"):  # the index-key record writer at the benchmark's 256 MiB input
        tokens, dim = (256 << 20) // 256, 128
        dest = _pool("index", dim, tokens, 64, dev)
        x = torch.randn(tokens, dim, device=dev).bfloat16()
        slots = _block_slots(tokens, 64, dest.num_blocks, dev)
        for version in (3, 4, 13):
            runs.append((f"writer v{version}", lambda v=version: rec_ops.write_records("index", x, slots, dest,
                                                                                      version=v, impl="triton")))
    for name, fn in runs:
        for _ in range(3):
            fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda.nvtx.range_push(f"profile/{name}")  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(args.launches):
            fn()  # type: ignore[operator]
        end.record()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()  # type: ignore[no-untyped-call]
        print(f"{name}: {start.elapsed_time(end) * 1e3 / args.launches:.1f} us per launch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
