"""Pluggable routing policies, so benchmarks can compare them on the same trace.

Every policy sees the same facts (worker loads, the request's shape, prefix hits from the global
index, measured link rates) and returns a `Placement`. `cache_aware` is the default: it applies the
cost formula of `placement.py`; the others ignore parts of it on purpose.

The router calls `choose_from` with its `LoadTable` (kept current by load reports): `cache_aware`
places from the table's arrays in O(workers); the baselines build the per-worker objects `choose`
takes.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from cedserve.model.config_table import config_error
from cedserve.router.load_table import LoadTable, TierRun
from cedserve.router.placement import (
    DecodeLoad,
    LinkModel,
    NoCapacityError,
    NoWorkerError,
    Placement,
    PrefillLoad,
    RequestShape,
    decode_pressure,
    place,
)


class RoutingPolicy(Protocol):
    """Chooses where one request runs. Mutates only its own bookkeeping (e.g. a round-robin cursor);
    raises `LookupError` when no worker can take the request."""

    name: str

    def choose(self, req: RequestShape, prefill: Sequence[PrefillLoad], decode: Sequence[DecodeLoad],
               links: LinkModel) -> Placement: ...

    def choose_from(self, req: RequestShape, loads: LoadTable, runs: Mapping[str, TierRun], links: LinkModel,
                    excluded: Collection[str]) -> Placement:
        """`choose` over the table's workers but `excluded`, with prefix credit from `runs`
        (`GlobalPrefixIndex.prefix_runs`)."""
        ...


class _FromObjects(ABC):
    """`choose_from` for a policy that reads per-worker objects."""

    @abstractmethod
    def choose(self, req: RequestShape, prefill: Sequence[PrefillLoad], decode: Sequence[DecodeLoad],
               links: LinkModel) -> Placement: ...

    def choose_from(self, req: RequestShape, loads: LoadTable, runs: Mapping[str, TierRun], links: LinkModel,
                    excluded: Collection[str]) -> Placement:
        prefill, decode = loads.loads(runs, excluded)
        return self.choose(req, prefill, decode, links)


def _decode_only(req: RequestShape, d: DecodeLoad, decode_only_max_tokens: int) -> Placement:
    """With no prefill worker (colocated serving, or the pool is down) the baselines fall back to the
    decode worker prefilling itself, under the same suffix limit as the cost formula."""
    if req.prompt_len - d.cached_blocks * req.block_size > decode_only_max_tokens:
        raise NoWorkerError("no prefill worker is available")
    return Placement(None, d.worker_id, 0.0, {})


def _fitting(req: RequestShape, decode: Sequence[DecodeLoad]) -> list[DecodeLoad]:
    fits = [d for d in decode if d.free_blocks >= req.num_blocks - d.cached_blocks]
    if not fits:
        raise NoCapacityError(f"no decode worker has {req.num_blocks} free blocks for a {req.prompt_len}-token prompt")
    return fits


class RoundRobin(_FromObjects):
    """Cycles through prefill and decode workers, ignoring load and cache."""

    name = "round_robin"

    def __init__(self, decode_only_max_tokens: int = 0) -> None:
        self._counter = itertools.count()
        self.decode_only_max_tokens = decode_only_max_tokens

    def choose(self, req: RequestShape, prefill: Sequence[PrefillLoad], decode: Sequence[DecodeLoad],
               links: LinkModel) -> Placement:
        fits = _fitting(req, decode)
        n = next(self._counter)
        if not prefill:
            return _decode_only(req, fits[n % len(fits)], self.decode_only_max_tokens)
        return Placement(prefill[n % len(prefill)].worker_id, fits[n % len(fits)].worker_id, 0.0, {})


class LeastLoaded(_FromObjects):
    """Shortest prefill queue and lightest decode batch, ignoring cache locality."""

    name = "least_loaded"

    def __init__(self, decode_only_max_tokens: int = 0) -> None:
        self.decode_only_max_tokens = decode_only_max_tokens

    def choose(self, req: RequestShape, prefill: Sequence[PrefillLoad], decode: Sequence[DecodeLoad],
               links: LinkModel) -> Placement:
        fits = _fitting(req, decode)
        d = min(fits, key=lambda w: (decode_pressure(w, req.effort), w.worker_id))
        if not prefill:
            return _decode_only(req, d, self.decode_only_max_tokens)
        p = min(prefill, key=lambda w: (w.queued_tokens / w.prefill_tokens_per_s, w.worker_id))
        return Placement(p.worker_id, d.worker_id, 0.0, {})


class CacheAware:
    """The documented cost formula: prefix credit, queues, transfer time and decode pressure in seconds."""

    name = "cache_aware"

    def __init__(self, decode_only_max_tokens: int) -> None:
        self.decode_only_max_tokens = decode_only_max_tokens

    def choose(self, req: RequestShape, prefill: Sequence[PrefillLoad], decode: Sequence[DecodeLoad],
               links: LinkModel) -> Placement:
        return place(req, prefill, decode, links, self.decode_only_max_tokens)

    def choose_from(self, req: RequestShape, loads: LoadTable, runs: Mapping[str, TierRun], links: LinkModel,
                    excluded: Collection[str]) -> Placement:
        return loads.place(req, runs, links, self.decode_only_max_tokens, excluded)


def make_policy(name: str, decode_only_max_tokens: int) -> RoutingPolicy:
    """`ValueError` naming the choices for an unknown policy."""
    if name == "cache_aware":
        return CacheAware(decode_only_max_tokens)
    if name == "least_loaded":
        return LeastLoaded(decode_only_max_tokens)
    if name == "round_robin":
        return RoundRobin(decode_only_max_tokens)
    raise config_error("router", "policy", f"unknown {name!r}; choose cache_aware, least_loaded or round_robin")
