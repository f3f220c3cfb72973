"""Where a small-batch decode step's index time goes: the 8 index calls of one step (1 candidate
source, 3 Full sources, 4 Reindex layers; `benchmarks/kernels.py`'s step section) at a given batch
and contexts, under torch.profiler, summed per GPU kernel over `--steps` steps. `--attention`
profiles one sparse attention layer at that batch instead (the default launch and fp32 partials).

    python -P benchmarks/index_step_profile.py --batch 1 --contexts 4096,1048576 --out /tmp/p.json
    python -P benchmarks/index_step_profile.py --batch 1 --attention

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
from kernels import AttentionProblem, profiling_device, step_index_calls, step_index_inputs


def kernel_table(title: str, calls: list[Any], steps: int) -> dict[str, Any]:
    """Time and profile `calls` (one step), print the table under `title` and return it: GPU kernel
    us per step, wall us per step launched call by call, and each kernel's us and launches."""
    for _ in range(3):  # compile and warm
        for c in calls:
            c()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        for c in calls:
            c()
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) / steps * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            for c in calls:
                c()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for ev in prof.events():
        if str(ev.device_type).endswith("CUDA"):  # (DeviceType.CUDA)
            per_kernel[ev.name][0] += ev.device_time / steps  # us per step
            per_kernel[ev.name][1] += 1 / steps
    rows = sorted(((name, us, count) for name, (us, count) in per_kernel.items()), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    print(f"{title}: GPU kernel time {total:.1f} us per step, {sum(r[2] for r in rows):.0f} kernels; launched call "
          f"by call {wall_us:.1f} us per step (wall)")
    for name, us, count in rows[:25]:
        print(f"  {us:8.1f} us {100 * us / max(total, 1e-9):5.1f} %  x{count:4.0f}  {name[:110]}")
    return {"gpu_us": total, "wall_us": wall_us, "kernels": [{"name": r[0], "us": r[1], "launches": r[2]} for r in rows]}


def main() -> int:
    # (after `kernels`, which makes `cedserve.kernels` importable from a plain checkout)
    from cedserve.kernels.sparse_attention import AttentionConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--contexts", default="4096,1048576")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--attention", action="store_true", help="profile one sparse attention layer instead")
    args = parser.parse_args()
    dev = profiling_device()
    if dev is None:
        return 2
    report: dict[str, Any] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              "machine": {"host": platform.node(), "gpu": torch.cuda.get_device_name(dev)},
                              "command": "python3 " + " ".join(sys.argv), "batch": args.batch}
    if args.attention:
        p = AttentionProblem.make(dev).first(args.batch)
        out = torch.empty_like(p.q)
        report["attention"] = {
            label: kernel_table(f"attention batch {p.q.shape[0]}, {label}", [p.call(out, cfg)], args.steps)
            for label, cfg in (("default", AttentionConfig(kernel="gluon")),)}
    else:
        contexts = [int(c) for c in args.contexts.split(",")]
        idx, table, qi, wi = step_index_inputs(args.batch, max(contexts), dev)
        report["contexts"] = {}
        for ctx in contexts:
            cand, full, reindex, _ = step_index_calls(idx, table, qi, wi, args.batch, ctx, 2048, 512)
            report["contexts"][str(ctx)] = kernel_table(f"batch {args.batch}, ctx {ctx}",
                                                        [cand] + 3 * [full] + 4 * [reindex], args.steps)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
