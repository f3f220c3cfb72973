"""Where a small-batch decode step's index time goes: the 8 index calls of one step (1 candidate
source, 3 Full sources, 4 Reindex layers; `benchmarks/kernels.py`'s step section) at a given batch
and contexts, under torch.profiler, summed per GPU kernel over `--steps` steps.

    python -P benchmarks/index_step_profile.py --batch 1 --contexts 4096,1048576 --out /tmp/p.json

Prints, per context, the step's GPU time by kernel (sorted, with launch counts and share) and
the step's wall time launched call by call; writes the same as JSON. Needs a CUDA device."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import _index_queries, _pool, step_index_calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--contexts", default="4096,1048576")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    contexts = [int(c) for c in args.contexts.split(",")]
    entries, n = 64, args.batch
    max_ctx = max(contexts)
    idx = _pool("index", 128, n * max_ctx, entries, dev, fill=True)
    table = torch.arange(n * (max_ctx // entries), device=dev).view(n, -1).int()
    qi = _index_queries(n, dev)
    wi = torch.randn(n, 32, device=dev) * 32**-0.5
    report: dict[str, Any] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              "machine": {"host": platform.node(), "gpu": torch.cuda.get_device_name(dev)},
                              "command": "python3 " + " ".join(sys.argv), "batch": n, "contexts": {}}
    for ctx in contexts:
        cand, full, reindex, _ = step_index_calls(idx, table, qi, wi, n, ctx, 2048, 512)
        calls = [cand] + 3 * [full] + 4 * [reindex]

        def step(calls: list[Any] = calls) -> None:
            for c in calls:
                c()

        for _ in range(3):  # compile and warm
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) / args.steps * 1e6
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for ev in prof.events():
            if str(ev.device_type).endswith("CUDA"):  # (DeviceType.CUDA)
                per_kernel[ev.name][0] += ev.device_time / args.steps  # us per step
                per_kernel[ev.name][1] += 1 / args.steps
        total = sum(v[0] for v in per_kernel.values())
        rows = sorted(((name, us, count) for name, (us, count) in per_kernel.items()), key=lambda r: -r[1])
        print(f"batch {n}, ctx {ctx}: GPU kernel time {total:.1f} us per step, {sum(r[2] for r in rows):.0f} "
              f"kernels; launched call by call {wall_us:.1f} us per step (wall)")
        for name, us, count in rows[:25]:
            print(f"  {us:8.1f} us {100 * us / total:5.1f} %  x{count:4.0f}  {name[:110]}")
        report["contexts"][str(ctx)] = {"gpu_us": total, "wall_us": wall_us,
                                        "kernels": [{"name": r[0], "us": r[1], "launches": r[2]} for r in rows]}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
