"""Kernel warm-up: what a worker's first passes cost with and without compiling the variants first.

Triton compiles a kernel variant on its first launch, so without a warm-up the first pass at a new
batch size or power of two of the context stalls (`cedserve.model.kernel_warmup`). This script builds
the preset on the paged kernels path, optionally runs `warm_up_decode` (timed), then runs decode
passes over synthetic sequences at the `--probe` cells (context:rows, chosen off the warm-up's
grid), each twice: the first pass's excess over the second is the stall a request would have met.
Run it in a process with an empty Triton cache (`TRITON_CACHE_DIR`), once with `--warmup` and once
without, to compare:

    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/kernel_warmup.py --device cuda --warmup --out a.json
    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/kernel_warmup.py --device cuda --out b.json

`--engines` instead builds a `PrefillEngine` (prompt limit `--max-context`) and a `DecodeEngine` (a
pool of `--max-context` tokens, `--max-rows` requests) with their default `kernel_warmup` and
reports what their warm-ups did and took: the workers' start-up path. `--decode KEY=VALUE` sets
`DecodeConfig` fields (e.g. `compile_fused=true`, `runner=off`) and `--only decode` skips the prefill
engine. The decode engine's build includes its model runner's CUDA-graph capture (`decode.runner`),
so two runs in a row sharing `TRITON_CACHE_DIR` and `TORCHINDUCTOR_CACHE_DIR` give the cold and the
warm start-up:

    export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
    for run in cold warm; do python benchmarks/kernel_warmup.py --engines --only decode --released-attention \
        --max-context 1048576 --max-rows 64 --decode compile_fused=true --note $run --out $run.json; done
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from cedserve.model import presets
from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
from cedserve.model.kernel_warmup import synthetic_state, warm_up_decode
from cedserve.model.network import BatchItem, CEDModel
from cedserve.model.paged_attention import arena_block_size
from cedserve.model.tokenizer import tiny_tokenizer_path

REPO = Path(__file__).resolve().parents[1]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_pass(model: CEDModel, states: list[Any], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    model.forward_batch([BatchItem([3], s) for s in states])
    sync(device)
    return (time.perf_counter() - start) * 1e3


def engines(model: CEDModel, args: argparse.Namespace) -> dict[str, Any]:
    """Both workers' engines as their processes build them; their warm-ups run inside."""
    from cedserve.decode_workers.config import DecodeConfig
    from cedserve.decode_workers.engine import DecodeEngine
    from cedserve.model.cache.config import KVCacheConfig
    from cedserve.model.cache.layout import BlockLayout
    from cedserve.model.cache.manager import KVCacheManager
    from cedserve.prefill_workers.config import PrefillWorkerConfig
    from cedserve.prefill_workers.engine import PrefillEngine

    block = 64
    blocks = -(-args.max_context // block)

    def cache() -> KVCacheManager:
        return KVCacheManager(BlockLayout.from_config(model.config, block),
                              KVCacheConfig(block_size=block, num_blocks=blocks), "warmup", args.device)

    out: dict[str, Any] = {}
    if args.only in (None, "prefill"):
        start = time.monotonic()
        prefill = PrefillEngine(model, cache(), None, PrefillWorkerConfig(worker_id="warmup", device=args.device,
                                                                          max_prompt_tokens=args.max_context))
        out["prefill"] = {"paged_attention": prefill.paged_attention, "seconds": round(time.monotonic() - start, 1),
                          "warmup": None if prefill.warmup is None else vars(prefill.warmup)}
    if args.only in (None, "decode"):
        start = time.monotonic()
        fields = {"max_running_requests": args.max_rows, "device": args.device, **decode_overrides(args.decode)}
        try:  # strict=False: "true", "64" as the fields' types
            config = msgspec.convert(fields, DecodeConfig, strict=False)
        except msgspec.ValidationError as exc:
            raise SystemExit(f"--decode: {exc}") from None
        decode = DecodeEngine(config, model, cache())
        book = decode.slots
        report = None if book is None else book.capture_report
        out["decode"] = {"paged_attention": decode.paged_attention, "seconds": round(time.monotonic() - start, 1),
                         "warmup": None if decode.warmup is None else vars(decode.warmup),
                         "config": {key: getattr(config, key) for key in ("runner", "cuda_graphs", "compile_fused")},
                         "runner_on": book is not None,
                         "capture": None if report is None else {"buckets": list(report.buckets),
                                                                 "seconds": round(report.seconds, 1)}}
    arena = model.paged_arena
    out["arena_blocks_free_after"] = None if arena is None else [arena.num_free, arena.num_blocks]
    if args.device.startswith("cuda"):
        out["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    for name in (n for n in ("prefill", "decode") if n in out):
        print(f"{name}: {out[name]['paged_attention']}, engine built in {out[name]['seconds']} s, warm-up "
              f"{out[name]['warmup']}")
    return out


def decode_overrides(pairs: list[str]) -> dict[str, str]:
    """`FIELD=VALUE` strings as a dict (`DecodeConfig` parses each value as its field's type)."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--decode {pair!r}: expected FIELD=VALUE")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini-40")
    p.add_argument("--released-attention", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="kernels", choices=["kernels", "reference"])
    p.add_argument("--max-context", type=int, default=131072)
    p.add_argument("--max-rows", type=int, default=68)
    p.add_argument("--warmup", action="store_true", help="run warm_up_decode first (timed)")
    p.add_argument("--probe", nargs="+", default=["6000:3", "20000:23", "50000:45", "100000:7", "9000:61"],
                   help="context:rows cells to time (off the warm-up's powers of two)")
    p.add_argument("--engines", action="store_true", help="build both workers' engines (their warm-ups inside)")
    p.add_argument("--only", choices=["prefill", "decode"], help="with --engines: build one engine only")
    p.add_argument("--decode", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="with --engines: DecodeConfig fields, e.g. compile_fused=true")
    p.add_argument("--note", default="")
    p.add_argument("--out")
    args = p.parse_args(argv)
    config = fit_config_to_tokenizer(presets.preset(args.preset), tiny_tokenizer_path())
    config = presets.released_attention(config) if args.released_attention else config
    config = presets.stretch_context(config, args.max_context + 64)
    model, _ = random_model(config, tiny_tokenizer_path(), 0)
    model = model.to(args.device)
    if not args.engines:  # the engines choose their own path
        model.use_paged_attention(args.backend)
    unit = arena_block_size(config)
    result: dict[str, Any] = {
        "benchmark": "kernel_warmup", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", os.path.relpath(sys.argv[0], REPO), *(argv or sys.argv[1:])]),
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "preset": args.preset, "released_attention": args.released_attention,
        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"), "warmup": None, "note": args.note, "probes": []}
    if args.engines:  # the engines' own progress (warm-up cells, captured buckets) as a worker logs it
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        result["engines"] = engines(model, args)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return 0
    if args.warmup:
        report = warm_up_decode(model, args.max_context, args.max_rows, report=print)
        result["warmup"] = {"cells": report.cells, "seconds": round(report.seconds, 2),
                            "contexts": report.contexts, "rows": [report.rows[0], report.rows[-1]]}
    print(f"{'context':>8} {'rows':>5} {'first ms':>9} {'second ms':>10} {'stall ms':>9}")
    for cell in args.probe:
        context, rows = (int(v) for v in cell.split(":"))
        context = context // unit * unit
        states = [synthetic_state(model, context) for _ in range(rows)]
        first = timed_pass(model, states, args.device)
        second = timed_pass(model, states, args.device)
        row = {"context": context, "rows": rows, "first_ms": round(first, 1), "second_ms": round(second, 1),
               "stall_ms": round(first - second, 1)}
        result["probes"].append(row)
        print(f"{context:>8} {rows:>5} {first:>9.1f} {second:>10.1f} {first - second:>9.1f}", flush=True)
        del states
    result["total_stall_ms"] = round(sum(r["stall_ms"] for r in result["probes"]), 1)
    print(f"total stall: {result['total_stall_ms']} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
