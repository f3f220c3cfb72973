"""How long a request waiting for decode capacity waits after the capacity frees (router/capacity.py).

A real router on loopback gRPC against the scripted fake workers of the router tests
(tests/unit/test_router_service.py): one decode worker with room for exactly one request (the
other has none), each request decoding for `--decode-ms`. `--requests` requests are sent at once:
one runs, the others wait in their class's FIFO. Each request's *wake gap* is the time from the
previous request's last message to this request's first token at the client: the wait after the
room freed, plus a Reserve, a fake prefill and the first write (about a millisecond on loopback).
Load polls run at the router's default period (`--poll-s`, 0.5 s).

Run it with another tree's router to compare (the fakes come from this file's tree, the router
from the interpreter's install):

    python benchmarks/capacity_wake.py --out after.json
    /path/to/base/.venv/bin/python benchmarks/capacity_wake.py --out before.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from itertools import pairwise
from pathlib import Path
from typing import Any


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _burst(address: str, prompt: list[int], requests: int, max_tokens: int) -> list[tuple[float, float]]:
    """(first token, last message) times of each request, sent at once."""
    from cedserve.client import AsyncClient, Piece

    client = AsyncClient(address, timeout_s=120)

    async def one() -> tuple[float, float]:
        first: list[float] = []

        def on_piece(piece: Piece) -> None:
            if not first:
                first.append(time.perf_counter())

        await client.generate(prompt, on_piece=on_piece, max_tokens=max_tokens, effort="low")
        return first[0], time.perf_counter()

    try:
        return list(await asyncio.gather(*(one() for _ in range(requests))))
    finally:
        await client.close()


def bench(requests: int, rounds: int, decode_ms: float, poll_s: float) -> dict[str, Any]:
    tests = Path(__file__).resolve().parents[1] / "tests"
    sys.path[:0] = [str(tests / "unit"), str(tests)]
    from test_router_service import Cluster  # the scripted fake workers of the router tests

    import cedserve
    from cedserve.model.presets import preset
    from cedserve.model.tokenizer import tiny_tokenizer_path

    ckpt = Path("build/bench_capacity_ckpt")
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(preset("tiny").to_hf_dict()))
    (ckpt / "tokenizer.json").write_bytes(tiny_tokenizer_path().read_bytes())
    cluster = Cluster(ckpt, load_poll_s=poll_s)
    gaps: list[float] = []
    try:
        cluster.decode[0].total_blocks, cluster.decode[1].total_blocks = 4, 0
        max_tokens = 5
        cluster.decode[0].script.token_delay_s = decode_ms / 1000 / (max_tokens - 1)
        prompt = list(range(3, 200))  # 4 blocks of 64: one request fills the worker
        for _ in range(rounds):
            times = sorted(asyncio.run(_burst(cluster.address, prompt, requests, max_tokens)))
            gaps += [first - prev_end for (_, prev_end), (first, _) in pairwise(times)]
            time.sleep(poll_s)  # the next round starts from a fresh report
    finally:
        cluster.close()
    return {"router": str(Path(cedserve.__file__).resolve().parents[1]), "requests_per_round": requests,
            "rounds": rounds, "decode_ms": decode_ms, "load_poll_s": poll_s, "wake_gaps": len(gaps),
            "wake_gap_p50_ms": 1e3 * _pct(gaps, 0.5), "wake_gap_p99_ms": 1e3 * _pct(gaps, 0.99),
            "wake_gap_mean_ms": 1e3 * statistics.fmean(gaps), "wake_gap_max_ms": 1e3 * max(gaps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8, help="sent at once per round")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--decode-ms", type=float, default=40.0, help="how long each request holds the worker")
    ap.add_argument("--poll-s", type=float, default=0.5, help="the router's load poll period")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = bench(args.requests, args.rounds, args.decode_ms, args.poll_s)
    report = {"benchmark": "capacity-wake", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"hostname": platform.node(), "python": platform.python_version()}, **result}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
