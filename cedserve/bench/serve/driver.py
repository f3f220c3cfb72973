"""Send a trace to a running system over its public gRPC API (or its OpenAI-compatible HTTP API) and
time every request.

A trace is a list of sessions (records sharing a `session_id`, or one record alone). A load point
says when sessions start:

    poisson R   open loop: sessions start at Poisson times of rate R per second
    closed N    closed loop: N sessions in flight; the next starts when one ends
    trace X     the trace's own timestamps, stretched X times

Within a session, turn k + 1 is sent `delay` ms after turn k completed (or failed), as an agent
waits for its tool. Each request carries the run's `cache_salt`, so runs never reuse each other's
cached blocks, and the session id, so placement can keep a session together.

TTFT is measured here, from the call to the first chunk that carries a token; TPOT is the time
after it divided by the output tokens after the first. `cached_tokens`, KV transfer bytes and
seconds, and decode-only placement come from the `complete` message's usage, and so does the
server's own time for the request (`total_s`, from admission to the last token): the client's time
minus it is what the API around the generation core costs per request (`api_overhead_s`), the figure
that tells the HTTP API from the gRPC one.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from cedserve.bench.serve.trace import PrefixOracle, TokenSynth, TraceRecord
from cedserve.client import CedserveError, Completion, Piece

if TYPE_CHECKING:
    from tqdm import tqdm


class GenerateClient(Protocol):
    """What the driver needs of a client: the gRPC `AsyncClient` and the HTTP API's `HttpClient`."""

    async def generate(self, prompt: list[int], on_piece: Callable[[Piece], None] | None = None, *,
                       effort: int | None = None, max_tokens: int = 0, cache_salt: str = "",
                       session_id: str = "") -> Completion: ...


@dataclass(frozen=True)
class LoadPoint:
    kind: str
    """`poisson`, `closed` or `trace`."""
    value: float
    """Sessions per second, sessions in flight, or the trace's time stretch."""

    def __post_init__(self) -> None:
        if self.kind not in ("poisson", "closed", "trace"):
            raise ValueError(f"load point: kind must be poisson, closed or trace, got {self.kind!r}")
        if self.value <= 0 or (self.kind == "closed" and self.value != int(self.value)):
            raise ValueError(f"load point {self.kind}: value must be > 0 (an integer for closed), got {self.value}")

    @property
    def label(self) -> str:
        if self.kind == "poisson":
            return f"poisson {self.value:g}/s"
        return f"closed x{int(self.value)}" if self.kind == "closed" else f"trace x{self.value:g}"


@dataclass
class RequestResult:
    """One request as the client saw it (times in seconds after the run's start)."""

    session: str
    turn: int
    effort: int
    prompt_tokens: int
    max_tokens: int
    oracle_cached_tokens: int
    """What a single unbounded cache could have reused (`PrefixOracle`)."""
    sent_s: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_s: float = 0.0
    kv_transfer_tail_s: float = 0.0
    """Of `kv_transfer_s`, the part after the prefill's last chunk was handed over (`Usage`)."""
    decode_only: bool = False
    server_s: float | None = None
    """The router's own time for the request (`Usage.total_s`): admission to the last token."""
    error: str | None = None
    """gRPC status name of a failed request."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def api_overhead_s(self) -> float | None:
        """Client-seen end to end minus the router's own time: the API layers and transport, both ways."""
        if self.e2e_s is None or self.server_s is None:
            return None
        return self.e2e_s - self.server_s

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class Sessions:
    """A trace split into sessions (record indices, in file order)."""

    keys: list[str]
    turns: list[list[int]]

    @classmethod
    def of(cls, records: Sequence[TraceRecord]) -> Sessions:
        index: dict[str, int] = {}
        keys: list[str] = []
        turns: list[list[int]] = []
        for i, r in enumerate(records):
            key = r.session_id if r.session_id is not None else f"#{i}"
            if key not in index:
                index[key] = len(keys)
                keys.append(key)
                turns.append([])
            turns[index[key]].append(i)
        return cls(keys, turns)


@dataclass
class RunOutput:
    results: list[RequestResult]
    sent: int
    """Requests issued (counted when each call starts, apart from the results)."""
    wall_s: float
    """First send to last completion."""
    expected: int
    """Requests in the trace."""


@dataclass
class Driver:
    """Runs one load point of a trace against one system."""

    client: GenerateClient
    records: Sequence[TraceRecord]
    synth: TokenSynth
    oracle: PrefixOracle
    efforts: Sequence[int]
    """Effort of each record."""
    salt: str
    progress: tqdm[Any] | None = None
    max_run_s: float = 0.0
    """After this many seconds no new request is sent (in-flight ones finish); 0: no limit."""
    sent: int = 0
    results: list[RequestResult] = field(default_factory=list)
    _t0: float = 0.0

    async def run(self, load: LoadPoint, seed: int = 0) -> RunOutput:
        sessions = Sessions.of(self.records)
        self._t0 = time.monotonic()
        if load.kind == "closed":
            queue = list(range(len(sessions.keys)))[::-1]
            await asyncio.gather(*(self._closed_worker(queue, sessions) for _ in range(int(load.value))))
        else:
            starts = self._starts(sessions, load, seed)
            await asyncio.gather(*(self._session(sessions.keys[s], sessions.turns[s], starts[s])
                                   for s in range(len(sessions.keys))))
        end = max((r.sent_s + (r.e2e_s or 0.0) for r in self.results), default=0.0)
        first = min((r.sent_s for r in self.results), default=0.0)
        return RunOutput(self.results, self.sent, end - first, len(self.records))

    def _starts(self, sessions: Sessions, load: LoadPoint, seed: int) -> list[float]:
        if load.kind == "trace":
            firsts = [self.records[t[0]].timestamp_ms / 1000 for t in sessions.turns]
            return [(f - min(firsts)) * load.value for f in firsts]
        rng = random.Random(seed)
        starts, clock = [], 0.0
        for _ in sessions.keys:
            starts.append(clock)
            clock += rng.expovariate(load.value)
        return starts

    async def _closed_worker(self, queue: list[int], sessions: Sessions) -> None:
        while queue and not (self.max_run_s and time.monotonic() - self._t0 > self.max_run_s):
            s = queue.pop()
            await self._session(sessions.keys[s], sessions.turns[s], None)

    async def _session(self, key: str, turns: list[int], start_s: float | None) -> None:
        if start_s is not None:
            await asyncio.sleep(max(0.0, self._t0 + start_s - time.monotonic()))
        for k, i in enumerate(turns):
            if k:
                await asyncio.sleep(self.records[i].delay_ms / 1000)
            if self.max_run_s and time.monotonic() - self._t0 > self.max_run_s:
                return  # out of time: the rest of the trace stays unsent (reported)
            self.results.append(await self._send(key, k, i))
            if self.progress is not None:
                self.progress.update(1)
                errors = sum(1 for r in self.results if not r.ok)
                if errors:
                    self.progress.set_postfix(errors=errors)

    async def _send(self, session: str, turn: int, i: int) -> RequestResult:
        record = self.records[i]
        tokens = self.synth.prompt(record)
        result = RequestResult(session, turn, self.efforts[i], record.input_length, record.output_length,
                               self.oracle.observe(record), time.monotonic() - self._t0)
        first: list[float] = []

        def on_piece(piece: Piece) -> None:
            if (piece.token_ids or piece.text) and not first:
                first.append(time.monotonic())

        start = time.monotonic()
        self.sent += 1
        try:
            done = await self.client.generate(tokens, on_piece=on_piece, effort=self.efforts[i],
                                              max_tokens=record.output_length, cache_salt=self.salt,
                                              session_id=f"{self.salt}/{session}")
        except CedserveError as exc:
            result.error = exc.code.name
            return result
        end = time.monotonic()
        u = done.usage
        result.e2e_s = end - start
        result.ttft_s = (first[0] if first else end) - start
        result.output_tokens = int(u["completion_tokens"])
        result.cached_tokens = int(u["cached_tokens"])
        result.kv_transfer_bytes = int(u.get("kv_transfer_bytes", 0))
        result.kv_transfer_s = float(u.get("kv_transfer_s", 0.0))
        result.kv_transfer_tail_s = float(u.get("kv_transfer_tail_s", 0.0))
        result.decode_only = bool(u.get("decode_only", 0.0))
        result.server_s = float(u["total_s"]) if "total_s" in u else None
        return result
