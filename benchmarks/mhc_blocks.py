"""The mHC site kernel's column blocks at decode batches, side by side: the default split
(`kernels.mhc._site_blocks`) and fixed `BLOCK_D` choices, each timed as 40 sites (one a layer's
attention and MoE half, with the previous sublayer's expansion) captured as one CUDA graph, in
microseconds per site, at the hidden sizes of mini-40 (256) and the released model (4096).

At batch 1 mini-40's site runs two programs (256 columns in blocks of 128), each reading half of
a 96 KB projection: latency, not bandwidth. More, narrower blocks trade that for a longer sum in
the finishing kernel. Each choice's output is checked against the torch reference.

    python -P benchmarks/mhc_blocks.py --out /tmp/mhc-blocks.json

Prints a table and writes JSON. Needs a CUDA device."""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from triton.testing import do_bench

from cedserve.kernels import mhc

SITES = 40


def site_inputs(rows: int, dim: int, hc: int, gen: torch.Generator, device: str) -> list[dict[str, Any]]:
    """`SITES` sites' inputs, each its own weights and streams (as 40 layers read them)."""
    width = (2 + hc) * hc
    out = []
    for _ in range(SITES):
        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(device)
        pre = torch.rand(rows, hc, generator=gen).to(device) + 0.5
        comb = torch.softmax(torch.randn(rows, hc, hc, generator=gen), -1).to(device)
        out.append(dict(streams=rand(rows, hc, dim), pre_prev=pre, fn=rand(width, hc * dim, scale=dim ** -0.5),
                        scale=torch.tensor([0.5, 0.5, 1.0], device=device), base=rand(width, scale=0.1),
                        norm_weight=rand(dim).abs() + 0.5,
                        expand=(rand(rows, dim), torch.rand(rows, hc, generator=gen).to(device), comb)))
    return out


def run_site(a: dict[str, Any]) -> mhc.HcSite:
    return mhc.hc_site(a["streams"], a["pre_prev"], a["fn"], a["scale"], a["base"], a["norm_weight"],
                       sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6, expand=a["expand"], impl="triton")


def graph_us(sites: list[dict[str, Any]]) -> float:
    for a in sites:
        run_site(a)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a in sites:
            run_site(a)
    return float(do_bench(graph.replay, warmup=20, rep=200)) * 1e3 / len(sites)


def max_error(a: dict[str, Any]) -> float:
    got = run_site(a)
    want = mhc.hc_site_reference(a["streams"], a["pre_prev"], a["fn"], a["scale"], a["base"], a["norm_weight"],
                                 20, 1e-6, 1e-6, a["expand"])
    return max(float((g.float() - w.float()).abs().max()) for g, w in
               ((got.x, want.x), (got.pre, want.pre), (got.post, want.post), (got.comb, want.comb),
                (got.streams, want.streams)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[256, 4096])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 6, 32, 192])
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--out", default="")
    args = p.parse_args()
    device = "cuda"
    default_blocks = mhc._site_blocks
    gen = torch.Generator().manual_seed(0)
    cells = []
    print(f"{'dim':>5} {'rows':>5} {'block':>8} {'us/site':>8} {'max err':>9}")
    for dim in args.dims:
        for rows in args.rows:
            sites = site_inputs(rows, dim, 4, gen, device)
            choices: list[int | None] = [None, *args.blocks]
            for block_d in choices:
                if block_d is None:
                    mhc._site_blocks = default_blocks
                else:
                    block_r = default_blocks(rows, dim)[0]
                    mhc._site_blocks = lambda r, d, b=block_d, br=block_r: (br, min(b, d))
                try:
                    us, err = graph_us(sites), max_error(sites[0])
                finally:
                    mhc._site_blocks = default_blocks
                name = f"default({default_blocks(rows, dim)[1]})" if block_d is None else str(block_d)
                print(f"{dim:>5} {rows:>5} {name:>8} {us:>8.2f} {err:>9.2e}", flush=True)
                cells.append({"dim": dim, "rows": rows, "block_d": block_d or default_blocks(rows, dim)[1],
                              "default": block_d is None, "us_per_site": round(us, 3), "max_abs_error": err})
    if args.out:
        doc = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "python": platform.python_version(),
               "command": "python -P benchmarks/mhc_blocks.py", "sites_per_graph": SITES, "cells": cells}
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
