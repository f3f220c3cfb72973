"""Key splits of the Triton sparse attention kernel at decode batches, side by side: the old split
rule (at least 4 key tiles a program), the current default (one tile a program where the GPU is
mostly idle, `AttentionConfig.resolve`) and a sweep of fixed split counts.

    python -P benchmarks/attention_splits.py --out /tmp/attention-splits.json

Geometries: mini-40 (4 heads x 512, top-64 + a 128-token window: what its decode step runs with
the Triton kernel) and the released one (64 heads x 512, top-512 + 128) with the Triton kernel
forced (GPUs without the Gluon path). Each cell times 40 layers' calls captured as one CUDA graph
(each layer its own window ring and top-k picks in a 1M-entry main pool, as a step reads them) and
reports microseconds per layer; the default's output is checked against the torch reference.
Prints a table and writes JSON. Needs a CUDA device."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cedserve.kernels.sparse_attention import AttentionConfig, sparse_attention_reference
from cedserve.kernels.triton_support import cdiv, num_sms
from kernels import AttentionProblem, Bench, _graph_time_s, _pool, profiling_device

GEOMETRIES = {"mini-40": (4, 64, 128), "released-triton": (64, 512, 128)}  # heads, top-k, window
LAYERS = 40


def problem(dev: torch.device, n: int, heads: int, topk: int, window: int, main: Any) -> AttentionProblem:
    swa = _pool("swa", 512, n * window, window, dev, fill=True)
    topk_slots = torch.randint(0, main.num_slots, (n, topk), device=dev).int()
    win_slots = (torch.arange(n, device=dev).unsqueeze(1) * window + torch.arange(window, device=dev)).int()
    ang = torch.rand(n, 32, device=dev)
    return AttentionProblem(main, swa, topk_slots, win_slots, (torch.randn(n, heads, 512, device=dev) * 0.05).bfloat16(),
                            torch.randn(heads, device=dev), ang.cos(), ang.sin())


def old_splits(tokens: int, heads: int, keys: int, dev: torch.device) -> int:
    """The split rule before the idle-GPU case (kept here to time it beside the new one)."""
    cfg = AttentionConfig(kernel="triton").resolve(tokens, heads, keys, dev, 512)
    programs = tokens * cdiv(heads, cfg.block_h or 16) * (cfg.dv_split or 1)
    return max(1, min(num_sms(dev) // max(programs, 1), cdiv(keys, 4 * (cfg.block_n or 64))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--sweep", type=int, nargs="+", default=[1, 2, 3, 4, 6, 10])
    parser.add_argument("--geometries", nargs="+", choices=sorted(GEOMETRIES), default=list(GEOMETRIES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    dev = profiling_device()
    if dev is None:
        return 1
    bench = Bench(dev, smoke=False)
    main_pool = _pool("main", 512, 1 << 20, 32, dev, fill=True)
    cells: list[dict[str, Any]] = []
    print(f"{'geometry':<16} {'batch':>5} {'splits':<14} {'us/layer':>9} {'vs old':>7}")
    for name in args.geometries:
        heads, topk, window = GEOMETRIES[name]
        for n in args.batches:
            layers = [problem(dev, n, heads, topk, window, main_pool) for _ in range(LAYERS)]
            keys = max(topk, window)
            base = AttentionConfig(kernel="triton").resolve(n, heads, keys, dev, 512, lists=(topk, window))
            choices: dict[str, int] = {"old": old_splits(n, heads, keys, dev), "default": base.num_splits or 1}
            for s in args.sweep:
                choices.setdefault(f"fixed {s}", s)
            times: dict[str, float] = {}
            outs = [torch.empty_like(p.q) for p in layers]
            for label, splits in choices.items():
                cfg = replace(base, num_splits=splits)
                us = _graph_time_s(bench, [p.call(o, cfg) for p, o in zip(layers, outs, strict=True)], label) * 1e6
                times[label] = us / LAYERS
            p, o = layers[0], outs[0]
            p.call(o, replace(base, num_splits=choices["default"]))()
            ref = sparse_attention_reference(p.q, p.sink, p.main, p.topk_slots, p.swa, p.win_slots, p.cos, p.sin)
            err = (o.float() - ref.float()).abs().max().item()
            for label, us in times.items():
                ratio = times["old"] / us if us == us else float("nan")
                print(f"{name:<16} {n:>5} {label + f' ({choices[label]})':<14} {us:9.2f} {ratio:6.2f}x")
                cells.append({"geometry": name, "batch": n, "heads": heads, "topk": topk, "window": window,
                              "choice": label, "num_splits": choices[label], "us_per_layer": round(us, 3),
                              "speedup_vs_old": round(ratio, 3)})
            cells.append({"geometry": name, "batch": n, "check": "default vs torch reference",
                          "max_abs_err": err, "passed": err <= 2e-2 * max(1.0, ref.float().abs().max().item())})
            print(f"{name:<16} {n:>5} default vs reference: max abs err {err:.2e}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "benchmark": "attention_splits", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, {platform.node()}",
            "command": "python -P benchmarks/attention_splits.py " + " ".join(sys.argv[1:]),
            "layers_per_graph": LAYERS, "cells": cells}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
