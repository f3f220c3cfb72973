"""Placement: pick the (prefill, decode) pair, or decode-only, that minimises estimated seconds.

For a request with `prompt_len` tokens and effort `e`, every candidate pair (P, D) is scored as

    cost(P, D) = prefill_wait(P) + compute(P) + transfer(P, D) + decode_pressure(D)

    prefill_wait(P)    = P.queued_tokens / P.prefill_tokens_per_s
    compute(P)         = (prompt_len - cached_P) / P.prefill_tokens_per_s + onload(P)
    onload(P)          = bytes of the prefix held in P's slower tiers / that tier's measured rate
    transfer(P, D)     = global KV bytes of the blocks D lacks / link_rate(P, D)
    link_rate(P, D)    = ewma(bytes) / ewma(seconds) over the pair's completed transfers
                         (`MeasuredLinks`); the configured default until the pair has one
    decode_pressure(D) = expected_output(e) x (D.step_s(batch + 1) - D.step_s(batch)) x batch
                         + D.step_s(batch + 1)

`cached_P` is the longest prefix of the request's block hashes that worker P holds (exact, from KV
events), `onload` is zero for HBM hits. The decode pressure is the time this request adds to
everyone already decoding on D over its expected output length (its effect on others) plus its own
first decode step. Decode-only placement (D prefills the suffix itself) is scored as

    cost(D) = D.queued_tokens / D.prefill_tokens_per_s + (prompt_len - cached_D) / D.prefill_tokens_per_s
              + decode_pressure(D)

and is allowed only when the uncached suffix is at most `decode_only_max_tokens`. A decode worker
without room for the request's blocks is not a candidate. Every rate is measured by the workers and
reported in load reports; nothing here is a tuned weight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from cedserve.model.effort import expected_output_tokens


class NoCapacityError(LookupError):
    """No decode worker has room for the request's blocks (retry later)."""


class NoWorkerError(LookupError):
    """No worker can run the request at all (none healthy, and too long for decode-only)."""


@dataclass(frozen=True)
class PrefillLoad:
    """What the router knows about one prefill worker."""

    worker_id: str
    queued_tokens: int
    prefill_tokens_per_s: float
    cached_blocks: int = 0
    """Leading blocks of this request held in HBM (from the global index)."""
    offloaded_blocks: Mapping[str, int] = field(default_factory=dict)
    """Further leading blocks held in slower tiers, by tier name."""


@dataclass(frozen=True)
class DecodeLoad:
    """What the router knows about one decode worker."""

    worker_id: str
    running_requests: int
    free_blocks: int
    step_s: Sequence[float]
    """Measured seconds per decode step by batch size (index = batch size; last value extrapolated)."""
    prefill_tokens_per_s: float
    queued_tokens: int = 0
    cached_blocks: int = 0

    def step_at(self, batch: int) -> float:
        if batch < len(self.step_s):
            return self.step_s[batch]
        # Beyond the profile: extend linearly from its last two points.
        last, prev = self.step_s[-1], self.step_s[-2] if len(self.step_s) > 1 else self.step_s[-1]
        return last + (batch - len(self.step_s) + 1) * max(0.0, last - prev)


@dataclass(frozen=True)
class RequestShape:
    prompt_len: int
    effort: int
    block_size: int
    block_bytes: int
    """Global KV bytes of one full block (all KV sources)."""

    @property
    def num_blocks(self) -> int:
        return -(-self.prompt_len // self.block_size)


@dataclass(frozen=True)
class LinkNumbers:
    """A link model's rates as arrays, for compiled loops: the rate of (prefill_ids[i], decode_ids[j])
    is `rates[rows[i], cols[j]]`, and no pair into decode_ids[j] is faster than `fastest[cols[j]]`
    (`LinkModel.numbered`). The arrays are the model's own or fresh: read them, never write them."""

    rates: npt.NDArray[np.float64]
    """`[rows, columns]` bytes/s."""
    fastest: npt.NDArray[np.float64]
    """`[columns]` the column's fastest rate, at least the default."""
    rows: npt.NDArray[np.intp]
    """`[P]` each prefill worker's row."""
    cols: npt.NDArray[np.intp]
    """`[D]` each decode worker's column."""


@dataclass(frozen=True)
class LinkRates:
    """Measured rates in bytes/s: prefill->decode links (pairs not listed use the default) and tier onloads."""

    transfer_bytes_per_s: Mapping[tuple[str, str], float]
    tier_bytes_per_s: Mapping[str, float]
    default_transfer_bytes_per_s: float = 1e9

    def max_rates(self, decode_ids: Sequence[str]) -> npt.NDArray[np.float64]:
        """`[D]` each decode worker's fastest listed link, at least the default."""
        rates = np.full(len(decode_ids), self.default_transfer_bytes_per_s)
        if not self.transfer_bytes_per_s:
            return rates
        d_index = {w: j for j, w in enumerate(decode_ids)}
        for (_, d), rate in self.transfer_bytes_per_s.items():
            if (j := d_index.get(d)) is not None:
                rates[j] = max(rates[j], rate)
        return rates

    def numbered(self, prefill_ids: Sequence[str], decode_ids: Sequence[str]) -> LinkNumbers:
        """The rates as `LinkNumbers`: a `[listed prefill + 1, listed decode + 1]` matrix (row and column
        0: workers with no listed pair), its column maxima, and each worker's row or column."""
        if not self.transfer_bytes_per_s:  # every pair at the default: row 0 and column 0 for all
            default = np.full((1, 1), self.default_transfer_bytes_per_s, dtype=np.float64)
            return LinkNumbers(default, default[0], np.zeros(len(prefill_ids), dtype=np.intp),
                               np.zeros(len(decode_ids), dtype=np.intp))
        p_index = {p: i + 1 for i, p in enumerate(dict.fromkeys(p for p, _ in self.transfer_bytes_per_s))}
        d_index = {d: j + 1 for j, d in enumerate(dict.fromkeys(d for _, d in self.transfer_bytes_per_s))}
        rates = np.full((len(p_index) + 1, len(d_index) + 1), self.default_transfer_bytes_per_s, dtype=np.float64)
        for (p, d), rate in self.transfer_bytes_per_s.items():
            rates[p_index[p], d_index[d]] = rate
        return LinkNumbers(rates, rates.max(axis=0), np.array([p_index.get(p, 0) for p in prefill_ids], dtype=np.intp),
                           np.array([d_index.get(d, 0) for d in decode_ids], dtype=np.intp))

    def matrix(self, prefill_ids: Sequence[str], decode_ids: Sequence[str]) -> npt.NDArray[np.float64]:
        """`[P, D]` link rates."""
        rates = np.full((len(prefill_ids), len(decode_ids)), self.default_transfer_bytes_per_s)
        if self.transfer_bytes_per_s:
            p_index = {w: i for i, w in enumerate(prefill_ids)}
            d_index = {w: j for j, w in enumerate(decode_ids)}
            for (p, d), rate in self.transfer_bytes_per_s.items():
                if p in p_index and d in d_index:
                    rates[p_index[p], d_index[d]] = rate
        return rates


class MeasuredLinks:
    """Per-(prefill, decode) link rates learned from completed transfers; not thread-safe.

    Each pair keeps exponentially weighted moving averages of the bytes and the seconds of its
    transfers (`alpha` = weight of the newest); its rate is their ratio,

        rate(P, D) = ewma(bytes) / ewma(seconds)

    a byte-weighted mean, so a small transfer, where latency dominates, moves the estimate no more
    than its share of the bytes. Pairs not yet measured use `default_bytes_per_s`. Rates live in a
    dense `[prefill, decode]` array so `matrix` is one gather, whatever the number of pairs.
    """

    def __init__(self, default_bytes_per_s: float, alpha: float, tier_bytes_per_s: Mapping[str, float]) -> None:
        if default_bytes_per_s <= 0 or not 0 < alpha <= 1:
            raise ValueError(f"link rates: default {default_bytes_per_s} must be > 0 and alpha {alpha} in (0, 1]")
        self.default_bytes_per_s = default_bytes_per_s
        self.alpha = alpha
        self.tier_bytes_per_s = dict(tier_bytes_per_s)
        self._rows: dict[str, int] = {}  # prefill id -> row (row 0: never measured)
        self._cols: dict[str, int] = {}  # decode id -> column (column 0: never measured)
        self._bytes = np.zeros((1, 1))   # [rows, cols] EWMA of bytes; 0 where unmeasured
        self._seconds = np.zeros((1, 1))
        self._rates = np.full((1, 1), default_bytes_per_s, dtype=np.float64)
        self._column_max = np.full(1, default_bytes_per_s, dtype=np.float64)  # [cols] fastest rate into each decode worker
        # Row / column numbers of id lists asked for again and again (a placement's full worker lists):
        # a tuple hash in C instead of a dict lookup per id. Cleared when a new worker gets a number.
        self._positions: dict[tuple[int, tuple[str, ...]], npt.NDArray[np.intp]] = {}

    def observe(self, prefill_id: str, decode_id: str, num_bytes: int, seconds: float) -> None:
        """One completed transfer P->D. Nothing sent (a fully cached prompt) measures nothing."""
        if num_bytes <= 0 or seconds <= 0:
            return
        i, j = self._index(self._rows, prefill_id, 0), self._index(self._cols, decode_id, 1)
        a = self.alpha if self._seconds[i, j] > 0 else 1.0
        self._bytes[i, j] = a * num_bytes + (1 - a) * self._bytes[i, j]
        self._seconds[i, j] = a * seconds + (1 - a) * self._seconds[i, j]
        self._rates[i, j] = self._bytes[i, j] / self._seconds[i, j]
        self._column_max[j] = self._rates[:, j].max()  # row 0 (never measured) keeps it >= the default

    def rate(self, prefill_id: str, decode_id: str) -> float:
        """Measured bytes/s of the pair, or the default."""
        return float(self._rates[self._rows.get(prefill_id, 0), self._cols.get(decode_id, 0)])

    def matrix(self, prefill_ids: Sequence[str], decode_ids: Sequence[str]) -> npt.NDArray[np.float64]:
        """`[P, D]` link rates."""
        return self._rates[np.ix_(self._numbers(0, prefill_ids), self._numbers(1, decode_ids))]

    def forget(self, worker_id: str) -> None:
        """Drop a departed worker's measurements (one that comes back starts from the default)."""
        for index, axis in ((self._rows, 0), (self._cols, 1)):
            k = index.get(worker_id)
            if k is not None:
                cut = (k, slice(None)) if axis == 0 else (slice(None), k)
                self._bytes[cut], self._seconds[cut], self._rates[cut] = 0.0, 0.0, self.default_bytes_per_s
        self._column_max = self._rates.max(axis=0)

    def max_rates(self, decode_ids: Sequence[str]) -> npt.NDArray[np.float64]:
        """`[D]` the fastest measured rate into each decode worker, at least the default."""
        return self._column_max[self._numbers(1, decode_ids)]

    def numbered(self, prefill_ids: Sequence[str], decode_ids: Sequence[str]) -> LinkNumbers:
        """The rate matrix itself, its column maxima and the workers' rows and columns (0: never
        measured): no copy, whatever the number of pairs."""
        return LinkNumbers(self._rates, self._column_max, self._numbers(0, prefill_ids), self._numbers(1, decode_ids))

    def _numbers(self, axis: int, worker_ids: Sequence[str]) -> npt.NDArray[np.intp]:
        """Rows (axis 0) or columns (axis 1) of `worker_ids`; 0 for a worker never measured."""
        if len(worker_ids) < 8:
            index = self._rows if axis == 0 else self._cols
            return np.array([index.get(w, 0) for w in worker_ids], dtype=np.intp)
        key = (axis, tuple(worker_ids))
        numbers = self._positions.get(key)
        if numbers is None:
            index = self._rows if axis == 0 else self._cols
            numbers = np.fromiter((index.get(w, 0) for w in worker_ids), dtype=np.intp, count=len(worker_ids))
            if len(self._positions) >= 8:
                self._positions.clear()
            self._positions[key] = numbers
        return numbers

    def _index(self, index: dict[str, int], worker_id: str, axis: int) -> int:
        k = index.get(worker_id)
        if k is None:
            k = index[worker_id] = len(index) + 1
            self._positions.clear()
            if k >= self._rates.shape[axis]:  # grow by doubling: amortised O(1) per new worker
                grow = [(0, 0), (0, 0)]
                grow[axis] = (0, self._rates.shape[axis])
                self._bytes = np.pad(self._bytes, grow)
                self._seconds = np.pad(self._seconds, grow)
                self._rates = np.pad(self._rates, grow, constant_values=self.default_bytes_per_s)
                self._column_max = self._rates.max(axis=0)
        return k


class LinkModel(Protocol):
    """What placement reads about links: `LinkRates` (constructed) or `MeasuredLinks` (learned)."""

    @property
    def tier_bytes_per_s(self) -> Mapping[str, float]: ...

    def max_rates(self, decode_ids: Sequence[str]) -> npt.NDArray[np.float64]:
        """`[D]` no pair into decode worker D runs faster than this (its fastest link, or the default)."""
        ...

    def matrix(self, prefill_ids: Sequence[str], decode_ids: Sequence[str]) -> npt.NDArray[np.float64]: ...

    def numbered(self, prefill_ids: Sequence[str], decode_ids: Sequence[str]) -> LinkNumbers:
        """The rates of every (prefill, decode) pair as `LinkNumbers` (what `matrix` and `max_rates`
        give, without making a `[P, D]` array)."""
        ...


@dataclass(frozen=True)
class Placement:
    prefill_id: str | None
    """None for decode-only placement."""
    decode_id: str
    cost_s: float
    parts: Mapping[str, float]
    """The cost's terms, for logs and metrics."""


def decode_pressure(d: DecodeLoad, effort: int) -> float:
    batch = d.running_requests
    added = d.step_at(batch + 1) - d.step_at(batch)
    return expected_output_tokens(effort) * added * batch + d.step_at(batch + 1)


def _prefill_terms(req: RequestShape, p: PrefillLoad, links: LinkModel) -> tuple[float, float]:
    """(prefill_wait, compute) of one prefill worker, in seconds."""
    cached = min(p.cached_blocks * req.block_size, req.prompt_len)
    onload = sum(blocks * req.block_bytes / links.tier_bytes_per_s[tier] for tier, blocks in p.offloaded_blocks.items())
    offloaded_tokens = sum(p.offloaded_blocks.values()) * req.block_size
    uncached = max(0, req.prompt_len - cached - offloaded_tokens)
    return p.queued_tokens / p.prefill_tokens_per_s, uncached / p.prefill_tokens_per_s + onload


def _pair_costs(req: RequestShape, prefill: Sequence[PrefillLoad], decode: Sequence[DecodeLoad],
                links: LinkModel) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Per-prefill `[P, 2]` (wait, compute), per-decode `[D]` pressure and `[P, D]` transfer seconds."""
    prefill_terms = np.array([_prefill_terms(req, p, links) for p in prefill], dtype=np.float64).reshape(-1, 2)
    pressure = np.array([decode_pressure(d, req.effort) for d in decode], dtype=np.float64)
    missing_bytes = np.array([max(0, req.num_blocks - d.cached_blocks) * req.block_bytes for d in decode],
                             dtype=np.float64)
    rates = links.matrix([p.worker_id for p in prefill], [d.worker_id for d in decode])
    return prefill_terms, pressure, missing_bytes[None, :] / rates


def _decode_only_cost(req: RequestShape, d: DecodeLoad) -> Placement:
    uncached = max(0, req.prompt_len - d.cached_blocks * req.block_size)
    parts = {
        "prefill_wait": d.queued_tokens / d.prefill_tokens_per_s,
        "compute": uncached / d.prefill_tokens_per_s,
        "transfer": 0.0,
        "decode_pressure": decode_pressure(d, req.effort),
    }
    return Placement(None, d.worker_id, sum(parts.values()), parts)


def place(req: RequestShape, prefill: Sequence[PrefillLoad], decode: Sequence[DecodeLoad], links: LinkModel,
          decode_only_max_tokens: int) -> Placement:
    """The cheapest placement; `NoCapacityError` when no decode worker has room for the request,
    `NoWorkerError` when no placement exists at all. Ties go to the smallest worker ids.

    Every pair is scored, vectorised: `cost[P, D] = wait[P] + compute[P] + transfer[P, D] + pressure[D]`.
    """
    fits = sorted((d for d in decode if d.free_blocks >= req.num_blocks - d.cached_blocks), key=lambda d: d.worker_id)
    if not fits:
        raise NoCapacityError(f"no decode worker has {req.num_blocks} free blocks for a {req.prompt_len}-token prompt")
    options: list[Placement] = []
    ordered = sorted(prefill, key=lambda p: p.worker_id)
    if ordered:
        terms, pressure, transfer = _pair_costs(req, ordered, fits, links)
        cost = terms.sum(axis=1)[:, None] + transfer + pressure[None, :]
        i, j = np.unravel_index(int(np.argmin(cost)), cost.shape)
        parts = {"prefill_wait": float(terms[i, 0]), "compute": float(terms[i, 1]),
                 "transfer": float(transfer[i, j]), "decode_pressure": float(pressure[j])}
        options.append(Placement(ordered[i].worker_id, fits[j].worker_id, float(cost[i, j]), parts))
    for d in fits:
        if req.prompt_len - d.cached_blocks * req.block_size <= decode_only_max_tokens:
            options.append(_decode_only_cost(req, d))
    if not options:
        raise NoWorkerError("no prefill worker is available and the prompt is too long for decode-only placement")
    return min(options, key=lambda o: (o.cost_s, o.prefill_id or "", o.decode_id))
