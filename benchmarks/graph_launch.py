"""What launching a captured CUDA graph costs the host, by the graph's kernel count: idle, behind a
launch of the same graph still running, and behind a launch of another graph still running.

The DSpark cycle's profile (docs/benchmarks/gpu-2026-12-08) put `cudaGraphLaunch` at 0.68 ms of host
time a plain step (456 kernels, launched while the step before ran) and 0.96 ms a verify step (465
kernels, launched with the GPU idle). This tells whether that is the launch's own cost per kernel node
(then fewer nodes, or a graph in pieces so the GPU starts on the first while the host launches the
rest) or a wait for the same graph's previous launch (then two graphs a bucket, alternating).

    python -P benchmarks/graph_launch.py --out /tmp/graph-launch.json

Each graph: a `torch.cuda._sleep` of about `--busy-us` (so a launch behind it finds it running),
then N one-element additions (N kernel nodes). Median host microseconds of the `replay()` call over
`--reps` launches. Then the lever it points to: the same N nodes (no sleep) as one graph against
`--pieces` graphs of N / pieces nodes launched one after the other, wall microseconds from the first
launch to the stream's end, the GPU idle before: whether the GPU starts on the first piece while the
host launches the rest. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch


def capture(n: int, busy_cycles: int, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm the kernels outside the capture
            x.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        torch.cuda._sleep(busy_cycles)
        for _ in range(n):
            x.add_(1)
    torch.cuda.synchronize()
    return graph


def whole_us(graphs: list[torch.cuda.CUDAGraph]) -> float:
    """Wall microseconds from the first graph's launch to the end of the last, launched back to back."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for graph in graphs:
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6


def timed(call: Callable[[], None]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[64, 256, 512, 1024, 1536])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--busy-us", type=float, default=2000.0)
    p.add_argument("--pieces", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_launch.py needs a CUDA device")
    dev = torch.device("cuda")
    clock_khz = getattr(torch.cuda.get_device_properties(dev), "clock_rate", 1_755_000)  # kHz (H100's boost)
    busy_cycles = int(args.busy_us * clock_khz / 1000)
    x = torch.zeros(1, device=dev)
    cells = []
    print(f"{'nodes':>6} {'idle us':>9} {'behind same us':>15} {'behind other us':>16} {'gpu us':>8}")
    for n in args.nodes:
        a, b = capture(n, busy_cycles, x), capture(n, busy_cycles, x)
        idle, same, other, gpu = [], [], [], []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            idle.append(timed(a.replay))
            torch.cuda.synchronize()
            a.replay()
            same.append(timed(a.replay))  # the first launch's sleep is still running
            torch.cuda.synchronize()
            a.replay()
            other.append(timed(b.replay))
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a.replay()
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end) * 1e3)
        cell = {"nodes": n, "idle_us": statistics.median(idle), "behind_same_us": statistics.median(same),
                "behind_other_us": statistics.median(other), "gpu_us": statistics.median(gpu),
                "idle_us_per_node": statistics.median(idle) / n}
        cells.append(cell)
        print(f"{n:>6} {cell['idle_us']:>9.1f} {cell['behind_same_us']:>15.1f} {cell['behind_other_us']:>16.1f} "
              f"{cell['gpu_us']:>8.1f}")
    split = []
    print(f"{'nodes':>6} {'pieces':>6} {'launch to end us':>17} {'one graph us':>13} {'ratio':>6}")
    for n in args.nodes:
        one = [capture(n, 0, x)]
        for k in args.pieces:
            if n % k:
                continue
            parts = [capture(n // k, 0, x) for _ in range(k)]
            whole, pieced = [], []
            for _ in range(args.reps):  # alternating, so drift hits both
                whole.append(whole_us(one))
                pieced.append(whole_us(parts))
            cell = {"nodes": n, "pieces": k, "pieces_us": statistics.median(pieced),
                    "one_graph_us": statistics.median(whole)}
            cell["ratio"] = cell["pieces_us"] / cell["one_graph_us"]
            split.append(cell)
            print(f"{n:>6} {k:>6} {cell['pieces_us']:>17.1f} {cell['one_graph_us']:>13.1f} {cell['ratio']:>6.2f}")
    out = {"benchmark": "graph_launch", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": f"{torch.cuda.get_device_name(dev)}, {platform.node()}", "torch": torch.__version__,
           "command": "python -P benchmarks/graph_launch.py", "busy_us": args.busy_us, "cells": cells, "pieces": split}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
