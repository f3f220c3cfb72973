"""float32 matmuls with a few rows (a DSpark verify pass): cuBLAS beside the skinny Triton kernel.

For each of mini-40's decode matmul shapes (weights `[N, K]` as `F.linear` holds them, and the
grouped / expert `bmm`s) and each row count, the same 40 calls (40 layers' weights, one each) are
captured as one CUDA graph and replayed: microseconds per call for cuBLAS float32 (`F.linear` /
`torch.bmm`, what the step runs today), the kernel (`kernels.skinny`, its default blocks), cuBLAS
with TF32 and in bfloat16 (other numerics: for scale only). Then a sweep of the kernel's
`(BLOCK_N, BLOCK_K)` at 6 rows. Every kernel output is checked against a float64 reference.

    python -P benchmarks/skinny_gemm.py --out /tmp/skinny.json

Prints a table and writes JSON. Needs a CUDA device."""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from cedserve.kernels import skinny

CALLS = 40
# (name, batch, N, K): F.linear weights [N, K] (batch 0) or bmm weights [batch, K, N]
SHAPES = [("wq_b", 0, 2048, 128), ("wa", 0, 2304, 256), ("experts_up", 0, 640, 256), ("shared", 0, 644, 256),
          ("gate", 0, 8, 256), ("proj_256", 0, 256, 256), ("k_512", 0, 512, 128), ("down_128", 0, 128, 512),
          ("wo_a_bmm", 2, 128, 1024), ("experts_down_bmm", 9, 256, 128)]


def graph_us(calls: list[Callable[[], Any]]) -> float:
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return float(do_bench(graph.replay, warmup=20, rep=200)) * 1e3 / len(calls)


def torch_calls(ws: list[torch.Tensor], x: torch.Tensor, batched: bool) -> list[Callable[[], Any]]:
    if batched:
        return [lambda w=w: torch.bmm(x, w) for w in ws]
    return [lambda w=w: F.linear(x, w) for w in ws]


def kernel_calls(x: torch.Tensor, ws: list[torch.Tensor], batched: bool,
                 blocks: tuple[int, int] | None = None) -> list[Callable[[], Any]]:
    xs = x if batched else x.unsqueeze(0)
    n = ws[0].shape[-1] if batched else ws[0].shape[0]
    out = torch.empty(xs.shape[0], xs.shape[1], n, device=x.device)
    return [lambda w=w: skinny._launch(xs, w.transpose(1, 2) if batched else w.unsqueeze(0), out, blocks) for w in ws]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 6, 12, 16])
    p.add_argument("--sweep-rows", type=int, default=6)
    p.add_argument("--out", default="")
    args = p.parse_args()
    device = "cuda"
    gen = torch.Generator().manual_seed(0)
    results: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    print(f"{'shape':<18} {'rows':>4} {'cublas':>8} {'skinny':>8} {'tf32':>8} {'bf16':>8} {'x':>6} {'err':>9}")
    for name, batch, n, k in SHAPES:
        if batch:
            weights = [torch.randn(batch, k, n, generator=gen).div(k**0.5).to(device) for _ in range(CALLS)]
        else:
            weights = [torch.randn(n, k, generator=gen).div(k**0.5).to(device) for _ in range(CALLS)]
        halves = [w.bfloat16() for w in weights]
        for rows in args.rows:
            x = torch.randn(*((batch,) if batch else ()), rows, k, generator=gen).to(device)
            xh = x.bfloat16()

            row: dict[str, Any] = {"shape": name, "batch": batch, "n": n, "k": k, "rows": rows}
            row["cublas_us"] = graph_us(torch_calls(weights, x, bool(batch)))
            row["skinny_us"] = graph_us(kernel_calls(x, weights, bool(batch)))
            torch.backends.cuda.matmul.allow_tf32 = True
            row["tf32_us"] = graph_us(torch_calls(weights, x, bool(batch)))
            torch.backends.cuda.matmul.allow_tf32 = False
            row["bf16_us"] = graph_us(torch_calls(halves, xh, bool(batch)))
            got = skinny.skinny_mm(x, weights[0].transpose(1, 2)) if batch else skinny.skinny_matmul(x, weights[0])
            if batch:
                want = torch.bmm(x.double(), weights[0].double())
            else:
                want = x.double() @ weights[0].double().T
            row["max_err"] = float((got.double() - want).abs().max())
            row["blocks"] = list(skinny.skinny_blocks(rows, n, k))
            results.append(row)
            print(f"{name:<18} {rows:>4} {row['cublas_us']:8.2f} {row['skinny_us']:8.2f} {row['tf32_us']:8.2f} "
                  f"{row['bf16_us']:8.2f} {row['cublas_us'] / row['skinny_us']:6.2f} {row['max_err']:9.2e}")
            if rows == args.sweep_rows:
                entry: dict[str, Any] = {"shape": name, "rows": rows}
                for bn in (8, 16, 32, 64):
                    for bk in (32, 64, 128):
                        if skinny.next_power_of_2(rows) * bn * bk > 32768:
                            continue
                        entry[f"{bn}x{bk}"] = graph_us(kernel_calls(x, weights, bool(batch), (bn, bk)))
                best = min((v, key) for key, v in entry.items() if key not in ("shape", "rows"))
                print(f"   sweep at {rows} rows: best {best[1]} {best[0]:.2f} us; default {row['skinny_us']:.2f}")
                sweep.append(entry)
    report = {"benchmark": "skinny_gemm", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version()},
              "calls_per_graph": CALLS, "cells": results, "sweep": sweep}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
