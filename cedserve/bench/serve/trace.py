"""Mooncake-format traces: read, write, turn hash ids into token ids, and the prefix-reuse oracle.

One JSON object per line, as in the public traces (kvcache-ai/Mooncake, FAST25-release):

    {"timestamp": 0, "input_length": 6755, "output_length": 500, "hash_ids": [0, 1, 2, ..., 13]}

`timestamp` is the arrival in ms after the trace's start; `input_length` and `output_length` are
token counts; `hash_ids` has one id per `block_size`-token block of the prompt (the last block may be
partial). An id names a block *and everything before it*: two prompts share their first k ids
exactly when they share their first k blocks. The block size is not in the file (the public traces
use 512); `infer_block_size` finds it from `len(hash_ids) == ceil(input_length / block_size)`.

Optional keys, read here and ignored by tools that do not know them:

    session_id  turns of one session are sent in file order, each after the previous one completed
    delay       ms between the previous turn's completion and this turn (tool-call time)
    effort      reasoning effort 1-100 (a cedserve extension)

Replay makes the prompt's tokens from its ids: block `h` is `block_size` ids drawn from a generator
seeded by `(seed, h)`, so equal ids give equal token blocks and the serving system sees exactly the
sharing the trace describes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


class TraceFormatError(ValueError):
    """A trace line is malformed; the message names the file, the line and the field."""


@dataclass(frozen=True)
class TraceRecord:
    """One request of a trace."""

    timestamp_ms: float
    """Arrival after the trace's start (for a session's later turns: the arrival had every answer
    been instant; replay waits for the previous turn plus `delay_ms` instead)."""
    input_length: int
    """Prompt tokens."""
    output_length: int
    """Output tokens asked for (`max_tokens`)."""
    hash_ids: tuple[int, ...]
    """One id per prompt block; equal leading ids mean an equal prefix."""
    session_id: str | None = None
    """Turns sharing it are sent in order, each after the previous completes."""
    delay_ms: float = 0.0
    """Wait between the previous turn's completion and this one (tool-call time)."""
    effort: int | None = None
    """Reasoning effort 1-100; None: assigned by the bench's effort mix."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"timestamp": _number(self.timestamp_ms), "input_length": self.input_length,
                               "output_length": self.output_length, "hash_ids": list(self.hash_ids)}
        if self.session_id is not None:
            out["session_id"] = self.session_id
        if self.delay_ms:
            out["delay"] = _number(self.delay_ms)
        if self.effort is not None:
            out["effort"] = self.effort
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str) -> TraceRecord:
        """`TraceFormatError` naming `where` (file:line) and the field for anything malformed."""
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj]
        if missing:
            raise TraceFormatError(f"{where}: missing field(s) {missing}")
        ids = obj["hash_ids"]
        if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0
                                                for h in ids):
            raise TraceFormatError(f"{where}: field `hash_ids` must be a list of non-negative integers")
        effort = obj.get("effort")
        if effort is not None and (not isinstance(effort, int) or not 1 <= effort <= 100):
            raise TraceFormatError(f"{where}: field `effort` must be an integer in [1, 100], got {effort!r}")
        session = obj.get("session_id")
        record = cls(_field_number(obj, "timestamp", where), _field_int(obj, "input_length", where, 1),
                     _field_int(obj, "output_length", where, 1), tuple(ids),
                     None if session is None else str(session),
                     _field_number(obj, "delay", where) if "delay" in obj else 0.0, effort)
        if not ids:
            raise TraceFormatError(f"{where}: field `hash_ids` is empty for a {record.input_length}-token prompt")
        return record


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def _field_int(obj: dict[str, Any], name: str, where: str, minimum: int) -> int:
    value = obj[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceFormatError(f"{where}: field `{name}` must be an integer >= {minimum}, got {value!r}")
    return value


def _field_number(obj: dict[str, Any], name: str, where: str) -> float:
    value = obj[name]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or not math.isfinite(value):
        raise TraceFormatError(f"{where}: field `{name}` must be a number >= 0 (ms), got {value!r}")
    return float(value)


def read_trace(path: str | Path) -> list[TraceRecord]:
    """Every record of a JSONL trace, in file order (blank lines skipped)."""
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{path}:{n}: not JSON ({exc.msg})") from None
            records.append(TraceRecord.from_json(obj, f"{path}:{n}"))
    if not records:
        raise TraceFormatError(f"{path}: the trace holds no records")
    return records


def write_trace(path: str | Path, records: Iterable[TraceRecord]) -> None:
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record.to_json(), separators=(", ", ": ")) + "\n")


def block_size_fits(record: TraceRecord, block_size: int) -> bool:
    return len(record.hash_ids) == -(-record.input_length // block_size)


def infer_block_size(records: Sequence[TraceRecord],
                     candidates: Sequence[int] = (16, 32, 64, 128, 256, 512, 1024, 2048)) -> int:
    """The one candidate block size every record fits; `ValueError` when none or several do."""
    fits = [b for b in candidates if all(block_size_fits(r, b) for r in records)]
    if len(fits) != 1:
        what = "no block size in" if not fits else f"several block sizes ({fits}) of"
        raise ValueError(f"trace: {what} {list(candidates)} gives len(hash_ids) == ceil(input_length / "
                         "block_size) on every line; pass --trace-block-size")
    return fits[0]


def check_block_size(records: Sequence[TraceRecord], block_size: int) -> None:
    """`ValueError` naming the first record whose hash ids do not cover its prompt in `block_size` blocks."""
    for i, r in enumerate(records):
        if not block_size_fits(r, block_size):
            raise ValueError(f"trace record {i}: {len(r.hash_ids)} hash ids do not cover {r.input_length} tokens in "
                             f"{block_size}-token blocks (expected {-(-r.input_length // block_size)})")


class TokenSynth:
    """Token ids of a record's prompt, deterministic per hash id.

    Block `h` is `block_size` ids drawn uniformly from `[low, vocab_size)` by a PCG64 generator
    seeded with `(seed, h)`; a prompt is its blocks in order, the last cut to `input_length`.
    """

    def __init__(self, block_size: int, vocab_size: int, seed: int = 0, low: int = 3) -> None:
        if block_size <= 0 or not 0 <= low < vocab_size:
            raise ValueError(f"token synthesis: block_size {block_size} must be > 0 and low {low} in [0, {vocab_size})")
        self.block_size, self.vocab_size, self.seed, self.low = block_size, vocab_size, seed, low

    def block(self, hash_id: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64([self.seed, hash_id]))
        return rng.integers(self.low, self.vocab_size, self.block_size, dtype=np.int64)

    def prompt(self, record: TraceRecord) -> list[int]:
        tokens = np.concatenate([self.block(h) for h in record.hash_ids])[: record.input_length]
        if len(tokens) != record.input_length:
            raise ValueError(f"token synthesis: {len(record.hash_ids)} blocks of {self.block_size} cannot make "
                             f"{record.input_length} tokens")
        return [int(t) for t in tokens]


class PrefixOracle:
    """The best prefix reuse any placement could reach: one cache of unbounded size, shared by every
    worker and never evicting, that has seen every request sent before.

    `observe` returns a request's reusable tokens, the leading run of its hash ids the cache holds
    (in tokens, at most the prompt), rounded down to whole blocks of the serving system
    (`system_block_size`: only whole blocks are cached), and then adds all its ids. A real system
    can only do worse: finite caches evict, placement spreads a prefix over workers, and the first
    token's replay span is recomputed.
    """

    def __init__(self, trace_block_size: int, system_block_size: int) -> None:
        self.trace_block_size, self.system_block_size = trace_block_size, system_block_size
        self._held: set[int] = set()

    def observe(self, record: TraceRecord) -> int:
        run = 0
        for h in record.hash_ids:
            if h not in self._held:
                break
            run += 1
        self._held.update(record.hash_ids)
        shared = min(run * self.trace_block_size, record.input_length)
        return shared // self.system_block_size * self.system_block_size


def oracle_cached_tokens(records: Iterable[TraceRecord], trace_block_size: int, system_block_size: int) -> list[int]:
    """`PrefixOracle.observe` over records in the order given (the order they are sent)."""
    oracle = PrefixOracle(trace_block_size, system_block_size)
    return [oracle.observe(r) for r in records]
