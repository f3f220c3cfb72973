"""Time to first token of running systems side by side: one request at a time, the systems in turn.

Each round sends the same fresh prompt (random token ids, a cache salt of its own: no prefix hit)
to every system, one after the other, and times the first streamed chunk at the client; the router's
own figure (`Usage.ttft_s`, from its receipt of the request) is kept beside it, and the client's
time to the second token (the decode worker's first). Alternating the
systems request by request lets a shared machine's load fall on all of them alike.

    python benchmarks/first_token.py --system before=127.0.0.1:50051 --system after=127.0.0.1:50061 \
        --prompt-tokens 64,512,2048 --rounds 30 --out docs/benchmarks/first-token-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cedserve.client import AsyncClient, Piece


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _one(client: AsyncClient, prompt: list[int], max_tokens: int, salt: str) -> tuple[float, float, float]:
    """(client's seconds to the first token, to the second, the router's `ttft_s`)."""
    start = time.perf_counter()
    arrivals: list[float] = []  # one per token, at its chunk's arrival

    def on_piece(piece: Piece) -> None:
        arrivals.extend([time.perf_counter() - start] * len(piece.token_ids))

    done = await client.generate(prompt, on_piece=on_piece, max_tokens=max_tokens, cache_salt=salt, effort="low")
    return arrivals[0], arrivals[min(1, len(arrivals) - 1)], float(done.usage["ttft_s"])


async def run(systems: dict[str, str], prompt_lens: list[int], rounds: int, max_tokens: int, vocab: int,
              warmup: int, seed: int) -> dict[str, Any]:
    clients = {name: AsyncClient(address, timeout_s=120) for name, address in systems.items()}
    rng = random.Random(seed)
    try:
        for i in range(warmup):
            for client in clients.values():
                await _one(client, [rng.randrange(3, vocab) for _ in range(64)], max_tokens, f"warm{i}")
        out: dict[str, Any] = {}
        for n in prompt_lens:
            client_s: dict[str, list[float]] = {name: [] for name in systems}
            second_s: dict[str, list[float]] = {name: [] for name in systems}
            router_s: dict[str, list[float]] = {name: [] for name in systems}
            for r in range(rounds):
                prompt = [rng.randrange(3, vocab) for _ in range(n)]
                order = list(systems) if r % 2 == 0 else list(reversed(systems))
                for name in order:
                    c, c2, t = await _one(clients[name], prompt, max_tokens, f"{name}-{n}-{r}")
                    client_s[name].append(c)
                    second_s[name].append(c2)
                    router_s[name].append(t)
            out[str(n)] = {name: {"client_ttft_p50_ms": 1e3 * _pct(client_s[name], 0.5),
                                  "client_ttft_p90_ms": 1e3 * _pct(client_s[name], 0.9),
                                  "client_ttft_mean_ms": 1e3 * statistics.fmean(client_s[name]),
                                  "client_second_token_p50_ms": 1e3 * _pct(second_s[name], 0.5),
                                  "client_second_token_mean_ms": 1e3 * statistics.fmean(second_s[name]),
                                  "router_ttft_p50_ms": 1e3 * _pct(router_s[name], 0.5),
                                  "router_ttft_mean_ms": 1e3 * statistics.fmean(router_s[name]),
                                  "requests": len(client_s[name])} for name in systems}
        return out
    finally:
        for client in clients.values():
            await client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", action="append", required=True, help="NAME=HOST:PORT (repeat; alternated)")
    ap.add_argument("--prompt-tokens", default="64,512,2048")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=2, help="at least 2 for a second token")
    ap.add_argument("--vocab", type=int, default=4000, help="prompt ids drawn from [3, vocab)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    systems = dict(s.split("=", 1) for s in args.system)
    results = asyncio.run(run(systems, [int(x) for x in args.prompt_tokens.split(",")], args.rounds,
                              args.max_tokens, args.vocab, args.warmup, args.seed))
    report = {"benchmark": "first-token", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"hostname": platform.node(), "python": platform.python_version()},
              "note": args.note, "systems": systems, "rounds": args.rounds, "max_tokens": args.max_tokens,
              "by_prompt_tokens": results}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
