"""Cache benchmarks: pool overhead, lookup/allocation throughput at a 1M-token prompt, and
offload/onload bandwidth against plain copies of the same bytes in the same run.

    python benchmarks/cache.py                      # prints a table, writes docs/benchmarks/cache-cpu.json
    python benchmarks/cache.py --blocks 512 --out /tmp/cache.json

Figures (see docs/cache.md, "Reading the figures"):

* overhead: bytes the cache holds per token beyond 890 B, at the released geometry (block 64), for
  a pool holding one 1M-token prompt: padding in the block layout plus every piece of bookkeeping
  (numpy arrays, the prefix dict, the request's block table and hashes), measured with tracemalloc.
* throughput: blocks per second for hashing, prefix lookup, allocation (empty and fragmented pool)
  and whole `admit` calls (cold: all miss; warm: all hit) of a 1M-token prompt (16,384 blocks).
* bandwidth: device -> host and host -> device copies through the cache against one torch copy
  of the same bytes; device -> disk (async writes, checksums, temp + rename) and disk -> device
  (verify + copy) against a plain copy of one file with the same bytes and plain writes/reads of
  the same number of files. Files are read back from the page cache in both cases.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cedserve.model.cache.block_pool import BlockPool, gather_rows, scatter_rows
from cedserve.model.cache.config import KVCacheConfig
from cedserve.model.cache.hashing import hash_blocks
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.manager import KVCacheManager
from cedserve.model.kv_accounting import KVAccounting
from cedserve.model.presets import preset

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 64
PROMPT_TOKENS = 1 << 20
GB = 1e9


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out: dict[str, Any] = {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
                           "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
                           "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                           "load_average_1m_at_start": os.getloadavg()[0]}
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], repeat: int = 3, setup: Callable[[], object] | None = None) -> tuple[float, float]:
    """(best, median) seconds of `fn` over `repeat` runs, `setup` untimed before each."""
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def prompt(num_tokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 129_280, size=num_tokens, dtype=np.int64)


# ---------------------------------------------------------------------- overhead


def overhead(layout: BlockLayout, bytes_per_token: float) -> dict[str, Any]:
    num_blocks = PROMPT_TOKENS // BLOCK_SIZE
    tokens = prompt(PROMPT_TOKENS)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    cache = KVCacheManager(layout, KVCacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks))
    empty = tracemalloc.get_traced_memory()[0] - base
    cache.admit("r", tokens)
    cache.commit("r", PROMPT_TOKENS)
    held = tracemalloc.get_traced_memory()[0] - base
    cache.free("r")
    idle = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    storage = cache.pool.storage.numel()
    payload = PROMPT_TOKENS * bytes_per_token
    padding = layout.padding_bytes * num_blocks
    cache.close()
    worst = max(held, idle)
    return {
        "preset": "v4.1-flash", "block_size": BLOCK_SIZE, "block_bytes": layout.block_bytes,
        "tokens": PROMPT_TOKENS, "blocks": num_blocks, "payload_bytes": payload, "storage_bytes": storage,
        "padding_bytes": padding, "metadata_bytes_empty_pool": empty, "metadata_bytes_request_holding": held,
        "metadata_bytes_cached_idle": idle,
        "metadata_bytes_per_block": worst / num_blocks,
        "overhead_fraction": (storage + worst) / payload - 1,
        "bytes_per_token": (storage + worst) / PROMPT_TOKENS,
    }


# ---------------------------------------------------------------------- throughput


def throughput(layout: BlockLayout) -> dict[str, Any]:
    num_blocks = PROMPT_TOKENS // BLOCK_SIZE
    tokens = prompt(PROMPT_TOKENS, seed=1)
    out: dict[str, Any] = {"tokens": PROMPT_TOKENS, "blocks": num_blocks}

    def rate(name: str, seconds: tuple[float, float], blocks: int = num_blocks) -> None:
        out[name] = {"blocks_per_s": blocks / seconds[0], "best_s": seconds[0], "median_s": seconds[1]}

    hashes: list[bytes] = []
    rate("hash_chain", timed(lambda: hashes.extend(hash_blocks(tokens, "tenant", BLOCK_SIZE))))
    hashes = hashes[:num_blocks]

    cache = KVCacheManager(layout, KVCacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks + 64))

    def cold_setup() -> None:
        if "r" in cache:
            cache.free("r")
            cache.evict(num_blocks)

    rate("admit_cold", timed(lambda: cache.admit("r", tokens, "tenant"), setup=cold_setup))
    rate("commit", timed(lambda: cache.commit("r", PROMPT_TOKENS), repeat=1))
    hit = cache.prefix.block_hashes(tokens, "tenant")
    rate("prefix_lookup", timed(lambda: cache.prefix.lookup(hit)))
    rate("lookup_with_hashing", timed(lambda: cache.lookup(tokens, "tenant")))
    rate("admit_warm", timed(lambda: cache.admit("w", tokens, "tenant"),
                             setup=lambda: cache.free("w") if "w" in cache else None))
    cache.close()

    pool = BlockPool(num_blocks, 8)

    def reset() -> None:
        pool.free(pool.decref(np.flatnonzero(~pool.is_free(np.arange(num_blocks)))))

    rate("allocate_empty_pool", timed(lambda: pool.allocate(num_blocks, "r"), setup=reset))
    reset()  # then fragment: 64-block requests, every other one freed -> 128 holes of 64 blocks
    runs = [pool.allocate(64, "x") for _ in range(num_blocks // 64)]
    for ids in runs[::2]:
        pool.free(pool.decref(ids))
    extents = pool.num_extents
    got: list[int] = []
    rate("allocate_fragmented_pool", timed(lambda: got.extend(pool.allocate(num_blocks // 2, "y")), repeat=1),
         blocks=num_blocks // 2)
    out["allocate_fragmented_pool"]["free_extents_before"] = extents
    rate("free_fragmented", timed(lambda: pool.free(pool.decref(got)), repeat=1), blocks=num_blocks // 2)
    return out


# ---------------------------------------------------------------------- bandwidth


def fill_cache(cache: KVCacheManager, tokens: np.ndarray) -> torch.Tensor:
    """Admit, write random bytes, commit and free one prompt; returns the written bytes (on CPU) in table order."""
    admission = cache.admit("fill", tokens)
    data = torch.randint(0, 256, (len(admission.block_ids), cache.layout.block_bytes), dtype=torch.uint8)
    scatter_rows(cache.pool.storage, admission.block_ids, data)
    cache.commit("fill", len(tokens))
    cache.free("fill")
    return data[: len(tokens) // cache.block_size]


def bandwidth(layout: BlockLayout, num_blocks: int, folder: Path, device: str, repeat: int = 3) -> dict[str, Any]:
    """Each path runs `repeat` times on fresh prompts; `best` is the steady state (pages of reused
    buffers already faulted in), `first` the cold run. Baselines are timed the same way."""
    bb = layout.block_bytes
    nbytes = num_blocks * bb
    out: dict[str, Any] = {"blocks": num_blocks, "bytes": nbytes, "repeat": repeat, "device_pool": device}

    def table_bytes(cache: KVCacheManager, rid: str) -> torch.Tensor:
        return gather_rows(cache.pool.storage, cache.block_table(rid)[:num_blocks]).cpu()

    def record(name: str, seconds: list[float]) -> None:
        out[name] = {"GB_per_s": nbytes / min(seconds) / GB, "first_GB_per_s": nbytes / seconds[0] / GB,
                     "seconds": seconds}

    def tokens_for(k: int) -> np.ndarray:
        return prompt(num_blocks * BLOCK_SIZE + 1, seed=10 + k)

    # device <-> host tier, against one torch copy of the same bytes
    cache = KVCacheManager(layout, KVCacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks + 1,
                                                 host_offload_blocks=num_blocks), device=device)
    off, on = [], []
    for k in range(repeat):
        tokens = tokens_for(k)
        data = fill_cache(cache, tokens)
        off.append(timed(lambda: cache.evict(num_blocks), repeat=1)[0])
        on.append(timed(lambda: cache.admit("back", tokens), repeat=1)[0])  # noqa: B023
        assert torch.equal(table_bytes(cache, "back"), data)
        cache.free("back")
    record("offload_device_to_host", off)
    record("onload_host_to_device", on)
    cache.close()
    src = data.to(device)
    dst = torch.empty(data.shape, dtype=torch.uint8, pin_memory=device != "cpu")
    record("plain_torch_copy", [timed(lambda: dst.copy_(src), repeat=1)[0] for _ in range(repeat)])

    # device -> disk (background writes) and disk -> device after a restart
    config = KVCacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks + 1, disk_dir=str(folder / "tier"),
                           io_queue_depth=4)
    off, on_cold, on_warm, scans = [], [], [], []
    for k in range(repeat):
        tokens = tokens_for(k)
        cache = KVCacheManager(layout, config, device=device)
        data = fill_cache(cache, tokens)
        sync()
        start = time.perf_counter()
        cache.evict(num_blocks)
        cache.drain()
        off.append(time.perf_counter() - start)
        cache.close()
        start = time.perf_counter()
        cache = KVCacheManager(layout, config, device=device)  # a restart: scan and re-index the folder
        scans.append((time.perf_counter() - start, len(cache.disk or [])))
        for timings in (on_cold, on_warm):  # the second read reuses the staging buffer
            start = time.perf_counter()
            cache.admit("back", tokens)
            assert cache.finish_onload("back") == num_blocks * BLOCK_SIZE
            sync()
            timings.append(time.perf_counter() - start)
            assert torch.equal(table_bytes(cache, "back"), data)
            cache.free("back")
            cache.evict(num_blocks)  # already on disk: nothing is written
        assert cache.metrics.disk_rejected_files == 0
        cache.close()
    record("offload_device_to_disk", off)
    record("onload_disk_to_device_cold", on_cold)
    record("onload_disk_to_device", on_warm)
    seconds, files = min(scans)
    out["restart_scan"] = {"files": files, "seconds": seconds, "files_per_s": files / seconds}

    # plain file copies of the same bytes, same file system, same run, into reused buffers
    raw = data.numpy()
    buf = np.zeros_like(raw)
    view, back = memoryview(raw).cast("B"), memoryview(buf).cast("B")
    one = folder / "one.bin"

    def write_one() -> None:
        with open(one, "wb") as f:
            f.write(view)

    def read_one() -> None:
        with open(one, "rb") as f:
            f.readinto(back)

    def write_files(k: int) -> None:
        plain = folder / f"plain{k}"
        plain.mkdir()
        for i in range(num_blocks):
            with open(plain / f"{i}.bin", "wb") as f:
                f.write(memoryview(raw[i]).cast("B"))

    def read_files() -> None:
        plain = folder / "plain0"
        for i in range(num_blocks):
            with open(plain / f"{i}.bin", "rb") as f:
                f.readinto(memoryview(buf[i]).cast("B"))

    record("plain_write_one_file", [timed(write_one, repeat=1)[0] for _ in range(repeat)])
    record("plain_copyfile_one_file", [timed(lambda: shutil.copyfile(one, folder / "copy.bin"), repeat=1)[0]
                                       for _ in range(repeat)])
    record("plain_read_one_file", [timed(read_one, repeat=1)[0] for _ in range(repeat)])
    record("plain_write_per_block_files", [timed(lambda: write_files(k), repeat=1)[0] for k in range(repeat)])  # noqa: B023
    record("plain_read_per_block_files", [timed(read_files, repeat=1)[0] for _ in range(repeat)])
    return out


# ---------------------------------------------------------------------- report


def table(result: dict[str, Any]) -> str:
    o, t, b = result["overhead"], result["throughput_1m_tokens"], result["bandwidth"]
    rows = [
        ("pool overhead at v4.1-flash, block 64", f"{100 * o['overhead_fraction']:.3f} %",
         f"{o['bytes_per_token']:.2f} B/token vs 890; padding {o['padding_bytes']} B; "
         f"{o['metadata_bytes_per_block']:.0f} B metadata per 56,960 B block"),
    ]
    for name in ("hash_chain", "prefix_lookup", "lookup_with_hashing", "allocate_empty_pool",
                 "allocate_fragmented_pool", "admit_cold", "admit_warm", "commit"):
        rows.append((f"{name} (1M tokens)", f"{t[name]['blocks_per_s']:,.0f} blocks/s", f"{t[name]['best_s'] * 1e3:.1f} ms"))
    for name in ("offload_device_to_host", "onload_host_to_device", "plain_torch_copy", "offload_device_to_disk",
                 "onload_disk_to_device", "onload_disk_to_device_cold", "plain_write_one_file",
                 "plain_copyfile_one_file", "plain_read_one_file", "plain_write_per_block_files",
                 "plain_read_per_block_files"):
        rows.append((name, f"{b[name]['GB_per_s']:.2f} GB/s",
                     f"{b['bytes'] / 1e6:.0f} MB; first run {b[name]['first_GB_per_s']:.2f} GB/s"))
    rows.append(("restart scan", f"{b['restart_scan']['files_per_s']:,.0f} files/s", f"{b['restart_scan']['files']} files"))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:<{width}}  {value:>22}  {note}" for name, value, note in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=1024, help="blocks moved in the bandwidth runs (57 KB each)")
    parser.add_argument("--device", default="cpu", help="device of the block pool in the bandwidth runs (cpu, cuda)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default docs/benchmarks/cache-<cpu|gpu>.json)")
    args = parser.parse_args(argv)
    config = preset("v4.1-flash")
    layout = BlockLayout.from_config(config, BLOCK_SIZE)
    bytes_per_token = float(KVAccounting.from_config(config).global_bytes_per_token)
    with tempfile.TemporaryDirectory(prefix="cedserve-cache-bench-", dir=os.environ.get("CEDSERVE_BENCH_DIR")) as tmp:
        result = {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python", os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
            "machine": machine(),
            "layout": {"block_size": BLOCK_SIZE, "block_bytes": layout.block_bytes, "regions": layout.describe()},
            "overhead": overhead(layout, bytes_per_token),
            "throughput_1m_tokens": throughput(layout),
            "bandwidth": bandwidth(layout, args.blocks, Path(tmp), args.device),
        }
    print(table(result))
    if args.out is None:
        args.out = REPO / "docs" / "benchmarks" / f"cache-{'cpu' if args.device == 'cpu' else 'gpu'}.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
