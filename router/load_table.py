"""Placement inputs kept per worker in dense arrays, updated on load reports; placement in O(workers).

`placement.place` is the cost formula as written: it takes one `PrefillLoad` / `DecodeLoad` object
per worker, built for every request, and scores all P x D pairs. `LoadTable` keeps what does not
depend on the request in per-worker arrays (slot = worker), written once per load report
(`set_prefill`, `set_decode`, `drop`), so a request costs a few passes over the workers, compiled
loops (`jit.compiled`) writing into buffers the table keeps (no array made per request):

    A[P]        = wait[P] + compute[P]           wait precomputed; compute = prompt_len / rate[P],
                                                 except the few prefix holders (scalar, exact terms)
    pressure[D] = E(effort) x added[D] x running[D] + step_next[D]   added, step_next precomputed
    cost(P, D)  = (A[P] + missing[D] / link_rate(P, D)) + pressure[D]

cost(P, D) grows with A[P] and falls with the link rate. So with p* = argmin A, no pair into D costs
less than its floor `(A[p*] + missing[D] / fastest_rate_into(D)) + pressure[D]`
(`LinkNumbers.fastest`), and the pair (p*, D) is D's cheapest wherever p* has D's fastest link (every
unmeasured pair runs at the default rate). Only the decode workers where another prefill worker
might win (p* is not on their fastest link) and whose floor is not above the best (p*, D) cost get
their column scored exactly, a `[P, open]` gather: usually none or a few, not P x D. Ties are resolved
by rescoring just the tied columns, trying prefill workers in id order, so the choice (smallest
prefill id, then decode id, among the cheapest) is `place`'s, bit for bit: every sum is taken in
`place`'s order, and rounding is monotone, so the bounds hold for the rounded costs too.

The table is not thread-safe: it lives on the router's event loop, like `WorkerPool`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from cedserve.model.effort import expected_output_tokens
from cedserve.router.index import PrefixRuns
from cedserve.router.jit import compiled
from cedserve.router.placement import (
    DecodeLoad,
    LinkModel,
    NoCapacityError,
    NoWorkerError,
    Placement,
    PrefillLoad,
    RequestShape,
)

_Scalar = TypeVar("_Scalar", bound=np.generic)
Floats = npt.NDArray[np.float64]
Floats2 = npt.NDArray[np.float64]  # two-dimensional
Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]
_NO_TIERS = {"host": 1.0, "disk": 1.0}
"""Tier rates `place` passes when no prefill worker holds a prefix (unread then)."""
SMALL_POOL_PAIRS = 64
"""`LoadTable.place` scores every pair in Python (`place_small`) up to this many (prefill, decode) pairs
in the table."""
_MAX_POSITIONS = 1024
"""Holder tuples whose slots `LoadTable._positions_of` keeps (all are dropped when it has this many)."""
TierRun = Sequence[int]
"""A worker's longest leading run of the prompt's blocks, `[device, host, disk]` block counts
(`GlobalPrefixIndex.prefix_runs`)."""


class _Slots:
    """Worker id <-> dense slot, reusing freed slots; `active[slot]` is False for a free one."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.ids: list[str] = []
        self._free: list[int] = []
        self.active = np.zeros(0, dtype=bool)
        self.changes = 0  # workers given or freed slots: what `LoadTable._positions_of` keeps holds until then

    def claim(self, worker_id: str) -> int:
        """The worker's slot, a new one if needed; True in `active`. The caller's arrays must then
        be at least `capacity` long (`_grown`)."""
        k = self.index.get(worker_id)
        if k is None:
            k = self._free.pop() if self._free else len(self.ids)
            if k == len(self.ids):
                self.ids.append(worker_id)
            self.index[worker_id], self.ids[k] = k, worker_id
            self.changes += 1
            if k >= len(self.active):
                self.active = _grown(self.active, k)
        self.active[k] = True
        return k

    def release(self, worker_id: str) -> int | None:
        """The freed slot, None when the worker has none."""
        k = self.index.pop(worker_id, None)
        if k is not None:
            self.active[k], self.ids[k] = False, ""
            self.changes += 1
            self._free.append(k)
        return k

    def usable(self, excluded: Collection[str]) -> npt.NDArray[np.bool_]:
        """`[slots]` active and not excluded (read only: a view of `active` when nothing is excluded)."""
        mask = self.active[: len(self.ids)]
        if excluded:
            mask = mask.copy()
        for w in excluded:
            k = self.index.get(w)
            if k is not None:
                mask[k] = False
        return mask


def _grown(a: npt.NDArray[_Scalar], k: int) -> npt.NDArray[_Scalar]:
    """`a` padded with zeros to hold index `k`: doubling, so amortised O(1) per new worker."""
    return np.concatenate([a, np.zeros(max(k + 1, 2 * len(a), 8) - len(a), dtype=a.dtype)])


class _Scratch:
    """`LoadTable.place`'s per-request arrays, kept between requests (one `[prefill slots]` or `[decode
    slots]` long; a request uses their first `num_p` / `num_d` entries)."""

    __slots__ = ("a", "cached", "column_min", "columns", "compute", "d_compute", "d_cost", "fits", "missing",
                 "pressure")

    def __init__(self, num_p: int, num_d: int) -> None:
        self.compute = np.empty(num_p)  # [P] compute(P) seconds
        self.a = np.empty(num_p)  # [P] prefill_wait + compute, inf where not usable
        self.cached = np.empty(num_d, dtype=np.int64)  # [D] leading blocks held, any tier
        self.fits = np.empty(num_d, dtype=np.bool_)  # [D] usable, with room for the request's blocks
        self.pressure = np.empty(num_d)  # [D] decode pressure seconds
        self.missing = np.empty(num_d)  # [D] bytes of the blocks it lacks
        self.column_min = np.empty(num_d)  # [D] cheapest pair into it
        self.columns = np.empty(num_d, dtype=np.int64)  # decode slots: open, or tied at the least cost
        self.d_compute = np.empty(num_d)  # [D] decode-only: seconds to prefill what it lacks
        self.d_cost = np.empty(num_d)  # [D] decode-only cost, inf where not allowed


@dataclass(frozen=True)
class _Lists:
    """The table's per-slot values as Python lists, what `place_small` reads: made on the first small
    placement after a change to the table (a load report, a worker leaving), kept until the next
    (a request reads a dozen lists, each `tolist` a numpy call, and reports come far less often)."""

    p_wait: list[float]
    p_rate: list[float]
    d_free: list[int]
    d_running: list[int]
    d_added: list[float]
    d_step_next: list[float]
    d_wait: list[float]
    d_rate: list[float]


class LoadTable:
    """The router's healthy workers as placement sees them. `set_*` on every load report, `drop`
    when a worker leaves placement; `place` per request."""

    def __init__(self) -> None:
        self._p = _Slots()
        self._p_wait: Floats = np.zeros(0)  # [P] queued_tokens / prefill_tokens_per_s
        self._p_rate: Floats = np.zeros(0)  # [P] prefill_tokens_per_s
        self._p_load: list[PrefillLoad | None] = []
        self._d = _Slots()
        self._d_running: Ints = np.zeros(0, dtype=np.int64)  # [D] running requests (the batch)
        self._d_free: Ints = np.zeros(0, dtype=np.int64)  # [D] free blocks
        self._d_added: Floats = np.zeros(0)  # [D] step_s(batch + 1) - step_s(batch)
        self._d_step_next: Floats = np.zeros(0)  # [D] step_s(batch + 1)
        self._d_wait: Floats = np.zeros(0)  # [D] queued_tokens / prefill_tokens_per_s
        self._d_rate: Floats = np.zeros(0)  # [D] prefill_tokens_per_s
        self._d_load: list[DecodeLoad | None] = []
        # holder tuple's id -> (the tuple, its `_split`): `_positions_of`
        self._positions: dict[int, tuple[tuple[str, ...], tuple[Ints, Ints, Ints, Ints]]] = {}
        self._positions_stamp = (0, 0)
        self._buffers: _Scratch | None = None  # `place`'s per-request arrays
        self._lists: _Lists | None = None  # `place_small`'s view; None once the table changed

    # ------------------------------------------------------------------ load reports

    def set_prefill(self, load: PrefillLoad) -> None:
        """A prefill worker's report (its `cached_blocks` are ignored: they are per request)."""
        if load.worker_id in self._d.index:  # a worker has one role: a report of the other replaces it
            self.drop(load.worker_id)
        self._lists = None
        k = self._p.claim(load.worker_id)
        if k >= len(self._p_wait):
            self._p_wait, self._p_rate = _grown(self._p_wait, k), _grown(self._p_rate, k)
            self._p_load.extend([None] * (len(self._p_wait) - len(self._p_load)))
        self._p_wait[k] = load.queued_tokens / load.prefill_tokens_per_s
        self._p_rate[k] = load.prefill_tokens_per_s
        self._p_load[k] = load

    def set_decode(self, load: DecodeLoad) -> None:
        """A decode worker's report (its `cached_blocks` are ignored: they are per request)."""
        if load.worker_id in self._p.index:
            self.drop(load.worker_id)
        self._lists = None
        k = self._d.claim(load.worker_id)
        if k >= len(self._d_wait):
            self._d_running, self._d_free = _grown(self._d_running, k), _grown(self._d_free, k)
            self._d_added, self._d_step_next = _grown(self._d_added, k), _grown(self._d_step_next, k)
            self._d_wait, self._d_rate = _grown(self._d_wait, k), _grown(self._d_rate, k)
            self._d_load.extend([None] * (len(self._d_wait) - len(self._d_load)))
        batch = load.running_requests
        self._d_running[k], self._d_free[k] = batch, load.free_blocks
        self._d_added[k] = load.step_at(batch + 1) - load.step_at(batch)
        self._d_step_next[k] = load.step_at(batch + 1)
        self._d_wait[k] = load.queued_tokens / load.prefill_tokens_per_s
        self._d_rate[k] = load.prefill_tokens_per_s
        self._d_load[k] = load

    def drop(self, worker_id: str) -> None:
        """Out of placement (left, down, or a follower rank) until its next `set_*`."""
        self._lists = None
        if (k := self._p.release(worker_id)) is not None:
            self._p_load[k] = None
        if (k := self._d.release(worker_id)) is not None:
            self._d_load[k] = None

    def num_workers(self, role: str, excluded: Collection[str] = ()) -> int:
        slots = self._p if role == "prefill" else self._d  # its `index` holds exactly the active slots
        return len(slots.index) - sum(1 for w in excluded if w in slots.index)

    def _small_lists(self) -> _Lists:
        if self._lists is None:
            self._lists = _Lists(self._p_wait.tolist(), self._p_rate.tolist(), self._d_free.tolist(),
                                 self._d_running.tolist(), self._d_added.tolist(), self._d_step_next.tolist(),
                                 self._d_wait.tolist(), self._d_rate.tolist())
        return self._lists

    def loads(self, runs: Mapping[str, TierRun], excluded: Collection[str] = ()
              ) -> tuple[list[PrefillLoad], list[DecodeLoad]]:
        """The table as `place` and the baseline policies take it: one object per usable worker,
        with this request's prefix credit (`runs`). O(workers): the slow path."""
        prefill = []
        for k in np.flatnonzero(self._p.usable(excluded)):
            p = self._p_load[k]
            assert p is not None
            run = runs.get(p.worker_id, (0, 0, 0))
            prefill.append(PrefillLoad(p.worker_id, p.queued_tokens, p.prefill_tokens_per_s, cached_blocks=run[0],
                                       offloaded_blocks={"host": run[1], "disk": run[2]}))
        decode = []
        for k in np.flatnonzero(self._d.usable(excluded)):
            d = self._d_load[k]
            assert d is not None
            decode.append(DecodeLoad(d.worker_id, d.running_requests, d.free_blocks, d.step_s, d.prefill_tokens_per_s,
                                     d.queued_tokens, cached_blocks=sum(runs.get(d.worker_id, ()))))
        return prefill, decode

    # ------------------------------------------------------------------ placement

    def place(self, req: RequestShape, runs: Mapping[str, TierRun], links: LinkModel, decode_only_max_tokens: int,
              excluded: Collection[str] = ()) -> Placement:
        """`placement.place` over the table's usable workers, with prefix credit from `runs`: the same
        choice, cost and parts; the same `NoCapacityError` / `NoWorkerError`. The per-worker terms are
        one compiled pass over the workers (`_scores`), the pair's bounds and ties another
        (`_cheapest_pair`, over the link model's `numbered` rates); Python handles what is left: the
        rare ties between several pairs, decode-only placement's id order, the result. A small pool
        (`SMALL_POOL_PAIRS`) is placed in Python instead (`place_small`), with the same result."""
        if len(self._p.index) * len(self._d.index) <= SMALL_POOL_PAIRS:
            return self.place_small(req, runs, links, decode_only_max_tokens, excluded)
        return self.place_compiled(req, runs, links, decode_only_max_tokens, excluded)

    def place_compiled(self, req: RequestShape, runs: Mapping[str, TierRun], links: LinkModel,
                       decode_only_max_tokens: int, excluded: Collection[str] = ()) -> Placement:
        """`place` through the compiled loops, whatever the pool's size."""
        p_ok, d_ok = self._p.usable(excluded), self._d.usable(excluded)
        num_p, num_d = len(p_ok), len(d_ok)
        s = self._scratch(num_p, num_d)
        p_rows, p_slots, d_rows, d_slots, blocks = self._held(runs)
        tiers = links.tier_bytes_per_s if p_rows.size else _NO_TIERS
        # Scalars as the types `jit.warm_up` compiled for (an int rate from a config would compile anew)
        best_p, num_fit, most_cached = _scores(
            int(req.prompt_len), int(req.num_blocks), int(req.block_size), int(req.block_bytes),
            float(expected_output_tokens(req.effort)), float(tiers["host"]), float(tiers["disk"]),
            blocks, p_rows, p_slots, d_rows, d_slots,
            p_ok, self._p_wait, self._p_rate, d_ok, self._d_free, self._d_running, self._d_added, self._d_step_next,
            s.compute, s.a, s.cached, s.fits, s.pressure, s.missing)
        if not num_fit:
            raise NoCapacityError(f"no decode worker has {req.num_blocks} free blocks for a {req.prompt_len}-token prompt")
        best = self._best_pair(best_p, s, num_p, num_d, links) if best_p >= 0 else None
        if req.prompt_len - most_cached * req.block_size <= decode_only_max_tokens:
            # Some decode worker holds enough of the prompt to prefill the rest itself.
            j, low = self._decode_only(req, s, num_d, decode_only_max_tokens)
            if j >= 0 and (best is None or (low, "") <= (best.cost_s, best.prefill_id or "")):
                parts = {"prefill_wait": float(self._d_wait[j]), "compute": float(s.d_compute[j]),
                         "transfer": 0.0, "decode_pressure": float(s.pressure[j])}
                best = Placement(None, self._d.ids[j], low, parts)
        if best is None:
            raise NoWorkerError("no prefill worker is available and the prompt is too long for decode-only placement")
        return best

    def place_small(self, req: RequestShape, runs: Mapping[str, TierRun], links: LinkModel,
                    decode_only_max_tokens: int, excluded: Collection[str] = ()) -> Placement:
        """`place` with every pair scored in Python floats: for a few workers the compiled loops' calls
        (their dispatch checks some 25 arguments) and the arrays made per request cost more than the
        arithmetic. The terms are the compiled loops' (`_scores`, `_decode_only_costs`), in their order
        and types, so every cost is the same to the bit; the choice is the cheapest pair by (cost,
        prefill id, decode id), as `place` chooses; then the decode-only comparison, as above."""
        p_slots = [k for w, k in self._p.index.items() if w not in excluded]
        d_slots = [k for w, k in self._d.index.items() if w not in excluded]
        lists = self._small_lists()
        p_wait, p_rate = lists.p_wait, lists.p_rate
        prompt_len, block_size, block_bytes = req.prompt_len, req.block_size, req.block_bytes
        compute = {k: prompt_len / p_rate[k] for k in p_slots}
        cached: dict[int, int] = {}
        held = zip(runs.workers, runs.blocks.tolist()) if isinstance(runs, PrefixRuns) else runs.items()
        tiers = links.tier_bytes_per_s
        for w, (device, host, disk) in held:
            if (k := self._p.index.get(w)) is not None:
                if k in compute:
                    onload = host * block_bytes / tiers["host"] + disk * block_bytes / tiers["disk"]
                    uncached = max(0, prompt_len - min(device * block_size, prompt_len) - (host + disk) * block_size)
                    compute[k] = uncached / p_rate[k] + onload
            elif (k := self._d.index.get(w)) is not None:
                cached[k] = device + host + disk
        num_blocks, expected_output = req.num_blocks, expected_output_tokens(req.effort)
        d_free, d_running, d_added, d_step_next = lists.d_free, lists.d_running, lists.d_added, lists.d_step_next
        pressure = {k: expected_output * d_added[k] * d_running[k] + d_step_next[k] for k in d_slots}
        fits = [k for k in d_slots if d_free[k] >= num_blocks - cached.get(k, 0)]
        if not fits:
            raise NoCapacityError(f"no decode worker has {req.num_blocks} free blocks for a {req.prompt_len}-token prompt")
        missing = {k: float(max(0, num_blocks - cached.get(k, 0)) * block_bytes) for k in fits}
        best: Placement | None = None
        if p_slots:
            best = self._cheapest_small(p_slots, fits, p_wait, compute, missing, pressure, links)
        if prompt_len - max(cached.values(), default=0) * block_size <= decode_only_max_tokens:
            only = self._decode_only_small(prompt_len, block_size, decode_only_max_tokens, fits, cached, pressure)
            if only is not None and (best is None or only.cost_s <= best.cost_s):
                best = only
        if best is None:
            raise NoWorkerError("no prefill worker is available and the prompt is too long for decode-only placement")
        return best

    def _cheapest_small(self, p_slots: list[int], d_slots: list[int], p_wait: list[float], compute: dict[int, float],
                        missing: dict[int, float], pressure: dict[int, float], links: LinkModel) -> Placement:
        """`place_small`'s cheapest (prefill, decode) pair over every pair of `p_slots` x `d_slots`."""
        p_ids, d_ids = [self._p.ids[i] for i in p_slots], [self._d.ids[j] for j in d_slots]
        view = links.numbered(p_ids, d_ids)
        rates, rows, cols = view.rates.tolist(), view.rows.tolist(), view.cols.tolist()
        best: tuple[float, str, str, int, int, float] | None = None
        for pi, i in enumerate(p_slots):
            a, rate_row = p_wait[i] + compute[i], rates[rows[pi]]
            for dj, j in enumerate(d_slots):
                rate = rate_row[cols[dj]]
                pair = ((a + missing[j] / rate) + pressure[j], p_ids[pi], d_ids[dj], i, j, rate)
                if best is None or pair[:3] < best[:3]:
                    best = pair
        assert best is not None  # both lists are non-empty
        cost, p_id, d_id, i, j, rate = best
        return Placement(p_id, d_id, cost, {"prefill_wait": p_wait[i], "compute": compute[i],
                                            "transfer": missing[j] / rate, "decode_pressure": pressure[j]})

    def _decode_only_small(self, prompt_len: int, block_size: int, max_tokens: int, fits: list[int],
                           cached: dict[int, int], pressure: dict[int, float]) -> Placement | None:
        """`place_small`'s cheapest decode-only placement, None when no decode worker may."""
        d_wait, d_rate = self._small_lists().d_wait, self._small_lists().d_rate
        best: tuple[float, str, int, float] | None = None
        for j in fits:
            uncached = prompt_len - cached.get(j, 0) * block_size
            if uncached > max_tokens:
                continue
            compute = max(0, uncached) / d_rate[j]
            option = ((d_wait[j] + compute) + pressure[j], self._d.ids[j], j, compute)
            if best is None or option[:2] < best[:2]:
                best = option
        if best is None or best[0] == np.inf:
            return None
        cost, d_id, j, compute = best
        return Placement(None, d_id, cost, {"prefill_wait": d_wait[j], "compute": compute, "transfer": 0.0,
                                            "decode_pressure": pressure[j]})

    def _scratch(self, num_p: int, num_d: int) -> _Scratch:
        """Buffers for `num_p` prefill and `num_d` decode slots, kept between requests."""
        if self._buffers is None or len(self._buffers.a) < num_p or len(self._buffers.fits) < num_d:
            self._buffers = _Scratch(max(num_p, len(self._p_wait)), max(num_d, len(self._d_wait)))
        return self._buffers

    def _held(self, runs: Mapping[str, TierRun]) -> tuple[Ints, Ints, Ints, Ints, Ints]:
        """Where the prefix holders are in `runs` and in the table: positions of the prefill workers among
        them, their slots, positions of the decode workers, their slots; and `[holders, 3]` their runs."""
        if isinstance(runs, PrefixRuns):
            return (*self._positions_of(runs.workers), runs.blocks)
        blocks = np.array([list(run) for run in runs.values()], dtype=np.int64).reshape(-1, 3)
        return (*self._split(tuple(runs)), blocks)

    def _positions_of(self, workers: tuple[str, ...]) -> tuple[Ints, Ints, Ints, Ints]:
        """`_split` of a holder tuple of the index, kept per tuple object (the index hands the same one
        for every prompt whose first block has the same holders) until a worker joins or leaves."""
        stamp = (self._p.changes, self._d.changes)
        if stamp != self._positions_stamp or len(self._positions) >= _MAX_POSITIONS:
            self._positions.clear()
            self._positions_stamp = stamp
        kept = self._positions.get(id(workers))
        if kept is None or kept[0] is not workers:  # holding the tuple keeps its id from being reused
            kept = self._positions[id(workers)] = (workers, self._split(workers))
        return kept[1]

    def _split(self, workers: tuple[str, ...]) -> tuple[Ints, Ints, Ints, Ints]:
        """Positions in `workers` of the prefill workers, their slots, positions of the decode workers,
        their slots (workers in neither role are left out)."""
        p_rows, p_slots, d_rows, d_slots = [], [], [], []
        for row, w in enumerate(workers):
            if (k := self._p.index.get(w)) is not None:
                p_rows.append(row)
                p_slots.append(k)
            elif (k := self._d.index.get(w)) is not None:
                d_rows.append(row)
                d_slots.append(k)
        return (np.array(p_rows, dtype=np.int64), np.array(p_slots, dtype=np.int64),
                np.array(d_rows, dtype=np.int64), np.array(d_slots, dtype=np.int64))

    def _best_pair(self, best_p: int, s: _Scratch, num_p: int, num_d: int, links: LinkModel) -> Placement:
        """The cheapest (prefill, decode) pair, given `_scores`'s terms in `s` and `best_p`, the prefill
        worker of least wait + compute: `_cheapest_pair` over the link model's rates (`numbered`)."""
        p_ids, d_ids = self._p.ids, self._d.ids
        a, missing, pressure = s.a[:num_p], s.missing[:num_d], s.pressure[:num_d]
        view = links.numbered(p_ids, d_ids)
        low, num_tied, candidate = _cheapest_pair(a, best_p, s.fits, missing, pressure, view.rates, view.fastest,
                                                  view.rows, view.cols, s.column_min, s.columns)
        columns = s.columns[:num_tied]
        if candidate >= 0 and num_tied == 1:  # one column reaches the minimum, and one prefill worker can
            i, j = candidate, int(columns[0])
        else:
            i, j = self._first_tied(low, a, columns, links, pressure, missing, view.fastest[view.cols])
        rate = float(view.rates[view.rows[i], view.cols[j]])
        parts = {"prefill_wait": float(self._p_wait[i]), "compute": float(s.compute[i]),
                 "transfer": float(missing[j] / rate), "decode_pressure": float(pressure[j])}
        return Placement(p_ids[i], d_ids[j], low, parts)

    def _decode_only(self, req: RequestShape, s: _Scratch, num_d: int, max_tokens: int) -> tuple[int, float]:
        """The cheapest decode-only placement (the decode worker prefills what it lacks of the prompt):
        (its slot, its cost), (-1, inf) when no decode worker may."""
        low, num_tied = _decode_only_costs(int(req.prompt_len), int(req.block_size), int(max_tokens), num_d,
                                           s.fits, s.cached,
                                           self._d_wait, self._d_rate, s.pressure, s.d_compute, s.d_cost, s.columns)
        if not num_tied:
            return -1, low
        return min(s.columns[:num_tied].tolist(), key=lambda k: self._d.ids[k]), low

    def _first_tied(self, low: float, a: Floats, columns: Ints, links: LinkModel, pressure: Floats,
                    missing: Floats, fastest: Floats) -> tuple[int, int]:
        """The pair of cost `low` with the smallest prefill id, then decode id, among `columns` (the
        decode workers whose cheapest pair costs `low`). Prefill workers are tried in id order, only
        those whose floor in some tied column reaches `low`: usually one."""
        p_ids, d_ids = self._p.ids, self._d.ids
        maybe = np.zeros(len(a), dtype=bool)
        for t, pr in set(zip((missing[columns] / fastest[columns]).tolist(), pressure[columns].tolist(), strict=True)):
            maybe |= (a + t) + pr <= low
        candidates = np.flatnonzero(maybe).tolist()
        tied_ids = [d_ids[j] for j in columns]
        for i in sorted(candidates, key=lambda k: p_ids[k]):
            costs = (a[i] + missing[columns] / links.matrix([p_ids[i]], tied_ids)[0]) + pressure[columns]
            hits = columns[costs == low]
            if hits.size:
                return i, min(hits.tolist(), key=lambda k: d_ids[k])
        raise AssertionError(f"no pair costs the minimum {low}")


# ---------------------------------------------------------------------- compiled loops (`jit.compiled`)
# Each sum is taken in `placement.place`'s order and with its types (ints multiplied as int64, then
# divided as float64), so the values are the same to the bit.


@compiled
def _scores(prompt_len: int, num_blocks: int, block_size: int, block_bytes: int, expected_output: float,
            host_bytes_per_s: float, disk_bytes_per_s: float, blocks: Ints, p_rows: Ints, p_slots: Ints,
            d_rows: Ints, d_slots: Ints, p_ok: Bools, p_wait: Floats, p_rate: Floats, d_ok: Bools, d_free: Ints,
            d_running: Ints, d_added: Floats, d_step_next: Floats, compute: Floats, a: Floats, cached: Ints,
            fits: Bools, pressure: Floats, missing: Floats) -> tuple[int, int, int]:
    """The request's per-worker terms, written into the first `len(p_ok)` / `len(d_ok)` entries of
    `compute`, `a` (wait + compute, inf where not usable), and `cached`, `fits`, `pressure`, `missing`.
    The prefix holders (`blocks[p_rows]` at prefill slots `p_slots`, `blocks[d_rows]` at decode slots
    `d_slots`) get their exact terms. Returns (the prefill slot of least `a`, the first of them; -1
    when none is usable), the decode workers that fit, and the most blocks a decode worker holds."""
    for i in range(len(p_ok)):
        compute[i] = prompt_len / p_rate[i]
    for h in range(len(p_rows)):
        device, host, disk = blocks[p_rows[h], 0], blocks[p_rows[h], 1], blocks[p_rows[h], 2]
        onload = host * block_bytes / host_bytes_per_s + disk * block_bytes / disk_bytes_per_s
        uncached = max(0, prompt_len - min(device * block_size, prompt_len) - (host + disk) * block_size)
        compute[p_slots[h]] = uncached / p_rate[p_slots[h]] + onload
    best_p, usable = 0, False
    for i in range(len(p_ok)):
        a[i] = p_wait[i] + compute[i] if p_ok[i] else np.inf
        usable |= p_ok[i]
        if a[i] < a[best_p]:
            best_p = i
    cached[: len(d_ok)] = 0
    most_cached = 0
    for g in range(len(d_rows)):
        held = blocks[d_rows[g], 0] + blocks[d_rows[g], 1] + blocks[d_rows[g], 2]
        cached[d_slots[g]] = held
        most_cached = max(most_cached, held)
    num_fit = 0
    for j in range(len(d_ok)):
        fits[j] = d_ok[j] and d_free[j] >= num_blocks - cached[j]
        num_fit += fits[j]
        pressure[j] = expected_output * d_added[j] * d_running[j] + d_step_next[j]
        missing[j] = max(0, num_blocks - cached[j]) * block_bytes
    return (best_p if usable else -1), num_fit, most_cached


@compiled
def _cheapest_pair(a: Floats, best_p: int, fits: Bools, missing: Floats, pressure: Floats, rates: Floats2,
                   fastest: Floats, rows: Ints, cols: Ints, column_min: Floats, columns: Ints) -> tuple[float, int, int]:
    """The least pair cost over the first `len(missing)` decode slots, how many decode slots reach it
    (written into `columns`), and the prefill slot whose floor in one of them reaches it when it is
    the only one, else -1 (`_first_tied` then decides). `column_min[D]` is written: the cheapest
    pair into D. Rates: `rates[rows[P], cols[D]]`, D's fastest `fastest[cols[D]]` (`LinkNumbers`).

    cost(P, D) = (a[P] + missing[D] / rate(P, D)) + pressure[D] grows with a[P] and falls with the
    rate, so no pair into D costs less than its floor (a[best_p] over D's fastest link), and the pair
    (best_p, D) is D's cheapest where best_p has D's fastest link: only the other columns ("open")
    whose floor reaches the least (best_p, D) cost are scored over every prefill worker."""
    row = rows[best_p]
    low = np.inf
    for j in range(len(missing)):
        column_min[j] = (a[best_p] + missing[j] / rates[row, cols[j]]) + pressure[j] if fits[j] else np.inf
        low = min(low, column_min[j])
    for j in range(len(missing)):
        top = fastest[cols[j]]
        if fits[j] and rates[row, cols[j]] < top and (a[best_p] + missing[j] / top) + pressure[j] <= low:
            cheapest = np.inf
            for i in range(len(a)):
                cheapest = min(cheapest, (a[i] + missing[j] / rates[rows[i], cols[j]]) + pressure[j])
            column_min[j] = cheapest
    low = np.inf
    for j in range(len(missing)):
        low = min(low, column_min[j])
    num_tied = 0
    for j in range(len(missing)):
        if column_min[j] == low:
            columns[num_tied] = j
            num_tied += 1
    candidate, last_t, last_pressure = -1, np.nan, np.nan
    for c in range(num_tied):
        t, pr = missing[columns[c]] / fastest[cols[columns[c]]], pressure[columns[c]]
        if t == last_t and pr == last_pressure:  # tied columns alike (idle workers): one pass will do
            continue
        last_t, last_pressure = t, pr
        for i in range(len(a)):
            if (a[i] + t) + pr <= low and i != candidate:
                if candidate >= 0:
                    return low, num_tied, -1
                candidate = i
    return low, num_tied, candidate


@compiled
def _decode_only_costs(prompt_len: int, block_size: int, max_tokens: int, num_d: int, fits: Bools, cached: Ints,
                       d_wait: Floats, d_rate: Floats, pressure: Floats, compute: Floats, cost: Floats,
                       columns: Ints) -> tuple[float, int]:
    """Decode-only placement: writes `compute[D]` (seconds to prefill what D lacks) and `cost[D]` (inf
    where D does not fit or would prefill more than `max_tokens`) for the first `num_d` slots; returns
    the least cost and how many slots reach it (written into `columns`; none when no slot may)."""
    low = np.inf
    for j in range(num_d):
        uncached = prompt_len - cached[j] * block_size
        compute[j] = max(0, uncached) / d_rate[j]
        cost[j] = (d_wait[j] + compute[j]) + pressure[j] if fits[j] and uncached <= max_tokens else np.inf
        low = min(low, cost[j])
    num_tied = 0
    for j in range(num_d if low < np.inf else 0):
        if cost[j] == low:
            columns[num_tied] = j
            num_tied += 1
    return low, num_tied
