"""Where a KV transfer's staging copy spends its time on a GPU: `gather_blocks` (the sender's, the
receiver's `scatter_blocks` is its mirror) split into the ids' copy in, the kernel's launch, and the
wait, for a 4K-token (64 blocks) and a 64K-token (1,024 blocks) request of 56,960-byte blocks:
in a process alone on the GPU, then with a second process holding a CUDA context that launches a
small kernel every 100 us (two agents sharing one GPU, as `cedserve bench kv-transfer --device
cuda` runs them), beside a spinning thread, in a process holding an idle NIXL agent, and in one whose
agent sends request after request to a second agent meanwhile. On an H100 the bench measured 0.4-0.65 ms per staging copy of either size (session
25), where the kernel itself takes tens of microseconds.

    python -P benchmarks/staging_probe.py --out /tmp/staging-probe.json

Prints a table and writes JSON. Needs a CUDA device."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cedserve.kv_transfer.staging import _wide, gather_blocks

BLOCK_BYTES = 56_960


def neighbour(stop: Any, ready: Any) -> None:
    """A second process with its own CUDA context: a small kernel every 100 us."""
    x = torch.zeros(1 << 16, device="cuda")
    torch.cuda.synchronize()
    ready.set()
    while not stop.is_set():
        x.add_(1.0)
        time.sleep(1e-4)
    torch.cuda.synchronize()


def spinner(stop: Any) -> None:
    """The transfer engine's progress thread in a hot spell (`NixlEngine._spin`): `sched_yield`
    and a zero wait on its doorbell, round after round, in Python (holding the GIL between them)."""
    bell = threading.Event()
    while not stop.is_set():
        os.sched_yield()
        bell.wait(0.0)


def _agent(blocks: torch.Tensor, name: str) -> Any:
    """A NIXL transfer agent registering `blocks` (as a worker's pool)."""
    from cedserve.kv_transfer.agent import NixlTransferAgent
    from cedserve.kv_transfer.config import KVTransferConfig
    from cedserve.kv_transfer.region import KVLayout, KVRegion
    return NixlTransferAgent(KVTransferConfig(auth_token="staging-probe"), KVRegion(blocks.view(-1), BLOCK_BYTES),
                             KVLayout.raw(BLOCK_BYTES), name)


def _have_nixl(setting: str) -> bool:
    from cedserve.kv_transfer.nixl_backend import nixl_available
    if not nixl_available():
        print(f"no NIXL here: the {setting} setting is skipped", flush=True)
        return False
    return True


def idle_agent(blocks: torch.Tensor) -> Any:
    """An agent over `blocks` (its progress thread idle), or None without NIXL."""
    return _agent(blocks, "staging-probe") if _have_nixl("in-agent") else None


def busy_agents(blocks: torch.Tensor) -> tuple[Any, Any] | None:
    """A sending agent over `blocks` and a receiving one over a region of the same size, handshaken
    on loopback in this process; None without NIXL."""
    if not _have_nixl("transfer-in-flight"):
        return None
    sender = _agent(blocks, "staging-probe-sender")
    receiver = _agent(torch.zeros_like(blocks), "staging-probe-receiver")
    sender.handshake(receiver.control_address)
    return sender, receiver


def keep_transferring(sender: Any, receiver: Any, stop: threading.Event, blocks: int, done: list[int]) -> None:
    """Request after request of `blocks` contiguous blocks from `sender` to `receiver` until `stop`
    (a worker's agent with a transfer always in flight); `done` counts the finished requests."""
    ids = np.arange(blocks)
    while not stop.is_set():
        rid = f"busy-{len(done)}"
        reservation = receiver.receiver().reserve(rid, ids, sender=sender.name, lease_s=30.0)
        sender.sender().open(reservation, timeout_s=30.0)
        sender.sender().write_blocks(rid, ids, last=True)
        sender.sender().wait(rid, 30.0).raise_for_state()
        receiver.receiver().wait(rid, 30.0).raise_for_state()
        done.append(1)


def probe(blocks: torch.Tensor, staging: torch.Tensor, n: int, reps: int, rng: np.random.Generator,
          stream: torch.cuda.Stream) -> dict[str, float]:
    ids_in, launch, wait, whole = [], [], [], []
    for _ in range(reps):
        ids = rng.choice(blocks.shape[0], n, replace=False).astype(np.int64)
        out = staging[: n * BLOCK_BYTES].view(n, BLOCK_BYTES)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gather_blocks(blocks, ids, out, stream)
        whole.append(time.perf_counter() - t0)
        # the same, in parts
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            t0 = time.perf_counter()
            dev_ids = torch.from_numpy(ids).to(blocks.device)
            t1 = time.perf_counter()
            torch.index_select(_wide(blocks), 0, dev_ids, out=_wide(out))
            t2 = time.perf_counter()
        stream.synchronize()
        t3 = time.perf_counter()
        ids_in.append(t1 - t0)
        launch.append(t2 - t1)
        wait.append(t3 - t2)
    return {k: round(statistics.median(v) * 1e6, 1) for k, v in
            (("gather_blocks_us", whole), ("ids_copy_us", ids_in), ("launch_us", launch), ("wait_us", wait))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default="")
    args = p.parse_args()
    blocks = torch.zeros(4096, BLOCK_BYTES, dtype=torch.uint8, device="cuda")
    staging = torch.zeros(1024 * BLOCK_BYTES, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(0)
    probe(blocks, staging, 64, 3, rng, stream)  # warm
    cells = []
    ctx = mp.get_context("spawn")
    settings = ("alone", "with a busy neighbour process", "beside a spinning thread",
                "beside a spinning thread, switch interval 50 us", "in a process holding an idle NIXL agent",
                "in a process whose NIXL agent has a transfer in flight")
    default_interval = sys.getswitchinterval()
    for setting in settings:
        stop, ready = ctx.Event(), ctx.Event()
        proc = thread = agent = None
        receiver = None
        transfers: list[int] = []
        if setting == "in a process whose NIXL agent has a transfer in flight":
            # the agent over these blocks sends 1,024-block requests to a second agent, one after
            # another, while the copies are timed (UCX's progress, the engine's loop and threads busy)
            pair = busy_agents(blocks)
            if pair is None:
                continue
            agent, receiver = pair
            thread_stop = threading.Event()
            thread = threading.Thread(target=keep_transferring, args=(agent, receiver, thread_stop, 1024, transfers),
                                      daemon=True)
            thread.start()
        elif setting == "in a process holding an idle NIXL agent":
            # a transfer agent over these very blocks (UCX registered, its progress thread idle):
            # inside an agent each staging copy took 0.4-0.7 ms on an H100 (gpu-2026-12-07c)
            agent = idle_agent(blocks)
            if agent is None:
                continue
        elif setting == "with a busy neighbour process":
            proc = ctx.Process(target=neighbour, args=(stop, ready), daemon=True)
            proc.start()
            ready.wait(120)
        elif setting.startswith("beside a spinning thread"):
            # the copy's waits release the GIL; taking it back competes with the spinning thread
            # (a transfer agent's sender gathers on the caller's thread while its progress thread spins)
            thread_stop = threading.Event()
            thread = threading.Thread(target=spinner, args=(thread_stop,), daemon=True)
            thread.start()
            if "switch interval" in setting:
                sys.setswitchinterval(5e-5)
        try:
            for n in (64, 1024):
                cell = {"setting": setting, "blocks": n, **probe(blocks, staging, n, args.reps, rng, stream)}
                if agent is not None and agent.staging is not None:  # the agent's own pool, as its engine copies
                    pool = agent.staging
                    rows = pool.slot_rows(0, n, BLOCK_BYTES)
                    took = []
                    for _ in range(args.reps):
                        ids = rng.choice(blocks.shape[0], n, replace=False).astype(np.int64)
                        t0 = time.perf_counter()
                        pool.gather(blocks, ids, rows)
                        took.append(time.perf_counter() - t0)
                    cell["pool_gather_us"] = round(statistics.median(took) * 1e6, 1)
                if receiver is not None:
                    cell["transfers_done"] = len(transfers)  # so far: the transfers did run meanwhile
                print(cell, flush=True)
                cells.append(cell)
        finally:
            stop.set()
            if thread is not None:
                thread_stop.set()
                thread.join(30)
                sys.setswitchinterval(default_interval)
            if agent is not None:
                agent.close()
            if receiver is not None:
                receiver.close()
            if proc is not None:
                proc.join(30)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "command": "python -P benchmarks/staging_probe.py",
            "notes": "median microseconds over reps; ids are random distinct block ids", "cells": cells}, indent=1) + "\n")


if __name__ == "__main__":
    main()
