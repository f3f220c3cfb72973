"""Host cost of staging a runner step's Engram rows from an `EngramStore` (`model.engram_staging`).

With the tables memory-mapped, the model runner hashes each step row's n-grams on the host, gathers
its table rows from the maps into a pinned buffer and copies them to the device before the replay.
The hash and the gather sit on the step's critical path (a row's token is known only once the
previous step has sampled it), so their host time adds to every step's. This measures it, per batch
size, at the released model's Engram geometry (2 layers, 2-4-grams x 8 heads, 256 channels, FP8 rows
with float32 scales per 32 channels; rows dequantized to float32), over tables shrunk to
`--vocab` buckets per head so they fit the page cache (the released tables' 384M rows each would
not): page-cache hits only, no disk reads. Cells:

* `hash_ms`: `EngramStaging.hash_ids` (history ring, compress, `hash_rows`);
* `stage_ms`: `EngramStaging.stage` (hash + the rows' stored bytes from the maps into `host`);
* `host_dequantized_ms`: the alternative, hash + `EngramStore.gather` (rows dequantized to float32
  on the host, what staging would copy if the step did not dequantize);
* `upload_ms`: `upload` (on CUDA until the copy has landed; on a CPU a plain copy);
* `bytes_per_step`, `host_dequantized_bytes_per_step`: what each way copies per step;
* wall (median of `--steps`) and process CPU time per step beside it (the host is shared).

    python benchmarks/engram_staging.py --out docs/benchmarks/engram-staging-cpu.json
    python benchmarks/engram_staging.py --device cuda --out docs/benchmarks/engram-staging-h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from cedserve.model.config import ModelConfig
from cedserve.model.engram import EngramHasher, table_primes
from cedserve.model.engram_staging import EngramStaging
from cedserve.model.engram_store import EngramStore
from cedserve.model.presets import preset


def shrunk_config(vocab: int) -> ModelConfig:
    """The released config with `vocab` hash buckets per (layer, n-gram size, head)."""
    config = dataclasses.replace(preset("v4.1-flash"), engram_vocab_size=vocab)
    rows = tuple(sum(sum(p) for p in per_layer) for per_layer in table_primes(config))
    return dataclasses.replace(config, engram_num_embeddings=rows)


def write_tables(config: ModelConfig, path: Path) -> None:
    """FP8 tables of random finite bytes (0x00-0x7d: positive, no NaN) and float32 scales."""
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer_id, rows in zip(config.engram_layer_ids, config.engram_num_embeddings):
        raw = torch.randint(0, 0x7E, (rows, config.engram_head_dim), dtype=torch.uint8, generator=gen)
        tensors[f"model.layers.{layer_id}.engram.embed.weight"] = raw.view(torch.float8_e4m3fn)
        tensors[f"model.layers.{layer_id}.engram.embed.scale"] = torch.rand(
            rows, config.engram_head_dim // 32
        )
    save_file(tensors, str(path))


def timed(fn: Callable[[], object], steps: int) -> tuple[float, float]:
    """Median wall ms and mean process CPU ms of `fn` over `steps` calls (after one warm-up)."""
    fn()
    walls, cpu0 = [], time.process_time()
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        walls.append((time.perf_counter() - start) * 1e3)
    return statistics.median(walls), (time.process_time() - cpu0) * 1e3 / steps


def measure(staging: EngramStaging, batch: int, steps: int, seed: int) -> dict[str, Any]:
    """One batch size's cell: slots 0..batch-1 each feeding one new random token per step."""
    gen = torch.Generator().manual_seed(seed)
    slots, vocab = list(range(batch)), staging.hasher.token_map.shape[0]
    position = [1000]

    def rows() -> tuple[list[int], list[int]]:
        position[0] += 1
        return torch.randint(3, vocab, (batch,), generator=gen).tolist(), [position[0]] * batch

    def hash_only() -> None:
        staging.hash_ids(slots, *rows())

    def stage() -> None:
        staging.stage(slots, *rows())

    def dequantized_on_host() -> None:  # the alternative: the store's rows, dequantized on the host
        staging.store.gather(staging.hash_ids(slots, *rows()))

    def upload() -> None:
        staging.upload(batch)
        if staging.device.type == "cuda":
            torch.cuda.synchronize(staging.device)

    cell: dict[str, Any] = {"batch": batch}
    for _ in range(2):  # interleaved twice: the host is shared, the later pass is kept
        for name, fn in (
            ("hash", hash_only),
            ("stage", stage),
            ("host_dequantized", dequantized_on_host),
            ("upload", upload),
        ):
            wall, cpu = timed(fn, steps)
            cell[f"{name}_ms"], cell[f"{name}_cpu_ms"] = round(wall, 3), round(cpu, 3)
    cell["bytes_per_step"] = batch * staging.row_bytes
    cell["host_dequantized_bytes_per_step"] = (
        batch
        * staging.columns
        * len(staging.store.tables)
        * int(staging.store.tables[0].weight.shape[1])
        * staging.dtype.itemsize
    )
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--vocab", type=int, default=20_000, help="hash buckets per head (released: 16,000,000)"
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = shrunk_config(args.vocab)
    device = torch.device(args.device)
    token_map = [i % config.engram_compressed_vocab_size for i in range(config.vocab_size)]
    hasher = EngramHasher(config, token_map)
    cells: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tables.safetensors"
        write_tables(config, path)
        with EngramStore.open([path], config, torch.float32) as store:
            width = max(args.batches)
            staging = EngramStaging(store, hasher, config, width, 1, width, device)
            gen = torch.Generator().manual_seed(1)
            for slot in range(width):
                staging.load(
                    slot, torch.randint(0, config.engram_compressed_vocab_size, (3,), generator=gen), 1000
                )
            for batch in args.batches:
                cells.append(measure(staging, batch, args.steps, seed=batch))
                print(json.dumps(cells[-1]), flush=True)
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "command": " ".join(["python", *sys.argv]),
        "vocab_per_head": args.vocab,
        "table_rows": list(config.engram_num_embeddings),
        "threads": torch.get_num_threads(),
        "cells": cells,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
