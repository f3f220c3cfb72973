"""Placement inputs kept per worker in dense arrays, updated on load reports; placement in O(workers).

`placement.place` is the cost formula as written: it takes one `PrefillLoad` / `DecodeLoad` object
per worker, built for every request, and scores all P x D pairs. `LoadTable` keeps what does not
depend on the request in per-worker arrays (slot = worker), written once per load report
(`set_prefill`, `set_decode`, `drop`), so a request costs a few vector operations over the workers:

    A[P]        = wait[P] + compute[P]           wait precomputed; compute = prompt_len / rate[P],
                                                 except the few prefix holders (scalar, exact terms)
    pressure[D] = E(effort) x added[D] x running[D] + step_next[D]   added, step_next precomputed
    cost(P, D)  = (A[P] + missing[D] / link_rate(P, D)) + pressure[D]

cost(P, D) grows with A[P] and falls with the link rate. So with p* = argmin A, no pair into D costs
less than its floor `(A[p*] + missing[D] / fastest_rate_into(D)) + pressure[D]`
(`LinkModel.max_rates`), and the pair (p*, D) is D's cheapest wherever p* has D's fastest link (every
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
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from cedserve.model.effort import expected_output_tokens
from cedserve.router.index import PrefixRuns
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
Ints = npt.NDArray[np.int64]
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

    # ------------------------------------------------------------------ load reports

    def set_prefill(self, load: PrefillLoad) -> None:
        """A prefill worker's report (its `cached_blocks` are ignored: they are per request)."""
        if load.worker_id in self._d.index:  # a worker has one role: a report of the other replaces it
            self.drop(load.worker_id)
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
        if (k := self._p.release(worker_id)) is not None:
            self._p_load[k] = None
        if (k := self._d.release(worker_id)) is not None:
            self._d_load[k] = None

    def num_workers(self, role: str, excluded: Collection[str] = ()) -> int:
        slots = self._p if role == "prefill" else self._d
        return int(slots.usable(excluded).sum())

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
        choice, cost and parts; the same `NoCapacityError` / `NoWorkerError`."""
        d_ok = self._d.usable(excluded)
        nd = len(d_ok)
        p_slots, p_runs, d_slots, d_blocks = self._held(runs)
        cached = np.zeros(nd, dtype=np.int64)  # [D] leading blocks held, any tier
        cached[d_slots] = d_blocks
        fits = d_ok & (self._d_free[:nd] >= req.num_blocks - cached)
        if not fits.any():
            raise NoCapacityError(f"no decode worker has {req.num_blocks} free blocks for a {req.prompt_len}-token prompt")
        pressure = expected_output_tokens(req.effort) * self._d_added[:nd] * self._d_running[:nd] + self._d_step_next[:nd]
        missing = (np.maximum(0, req.num_blocks - cached) * req.block_bytes).astype(np.float64)  # [D] bytes
        best = self._best_pair(req, (p_slots, p_runs), links, fits, pressure, missing, excluded)
        if req.prompt_len - (int(d_blocks.max()) if d_blocks.size else 0) * req.block_size > decode_only_max_tokens:
            alone = None  # not even the decode worker holding the most of the prompt may prefill it alone
        else:
            uncached = req.prompt_len - cached * req.block_size  # [D] tokens a decode-only placement prefills
            alone = fits & (uncached <= decode_only_max_tokens)
        if alone is not None and alone.any():
            compute = np.maximum(0, uncached) / self._d_rate[:nd]
            cost = np.where(alone, (self._d_wait[:nd] + compute) + pressure, np.inf)
            low = cost.min()
            j = min(np.flatnonzero(cost == low), key=lambda k: self._d.ids[k])
            parts = {"prefill_wait": float(self._d_wait[j]), "compute": float(compute[j]), "transfer": 0.0,
                     "decode_pressure": float(pressure[j])}
            if best is None or (float(low), "") <= (best.cost_s, best.prefill_id or ""):
                best = Placement(None, self._d.ids[j], float(low), parts)
        if best is None:
            raise NoWorkerError("no prefill worker is available and the prompt is too long for decode-only placement")
        return best

    def _held(self, runs: Mapping[str, TierRun]) -> tuple[Ints, Ints, Ints, Ints]:
        """The prefix holders among the prefill workers (`[h]` slots, `[h, 3]` runs) and among the
        decode workers (`[g]` slots, `[g]` blocks in any tier): two gathers from a `PrefixRuns`."""
        if isinstance(runs, PrefixRuns):
            workers, blocks = runs.workers, runs.blocks
            p_rows, p_slots, d_rows, d_slots = self._positions_of(workers)
        else:
            workers = tuple(runs)
            blocks = np.array([list(run) for run in runs.values()], dtype=np.int64).reshape(-1, 3)
            p_rows, p_slots, d_rows, d_slots = self._split(workers)
        return p_slots, blocks[p_rows], d_slots, blocks[d_rows].sum(axis=1)

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

    def _best_pair(self, req: RequestShape, held: tuple[Ints, Ints], links: LinkModel,
                   fits: npt.NDArray[np.bool_], pressure: Floats, missing: Floats,
                   excluded: Collection[str]) -> Placement | None:
        """The cheapest (prefill, decode) pair, None without a usable prefill worker."""
        p_ok = self._p.usable(excluded)
        if not p_ok.any():
            return None
        compute = self._compute(req, held, links, len(p_ok))
        a = np.where(p_ok, self._p_wait[: len(p_ok)] + compute, np.inf)  # [P] wait + compute
        p_ids, d_ids = self._p.ids, self._d.ids
        best_p = int(np.argmin(a))
        # cost(P, D) = (a[P] + missing[D] / rate(P, D)) + pressure[D] grows with a[P] and falls with the
        # rate, so no pair into D costs less than `floor[D]` (the least a, D's fastest link), and pairs
        # with best_p cost `via_best[D]`: where best_p has D's fastest link, that is D's cheapest pair.
        row = links.matrix([p_ids[best_p]], d_ids)[0]  # [D] best_p's link rates
        fastest = links.max_rates(d_ids)  # [D]
        via_best = np.where(fits, (a[best_p] + missing / row) + pressure, np.inf)
        floor = np.where(fits, (a[best_p] + missing / fastest) + pressure, np.inf)
        column_min = via_best.copy()  # [D] cheapest pair into each decode worker
        open_ = np.flatnonzero((floor <= via_best.min()) & (row < fastest))  # where another P may win
        if open_.size:
            rates = links.matrix(p_ids, [d_ids[j] for j in open_])  # [P, open]
            column_min[open_] = ((a[:, None] + missing[open_] / rates) + pressure[open_]).min(axis=0)
        low = float(column_min.min())
        i, j = self._first_tied(low, a, np.flatnonzero(column_min == low), links, pressure, missing, fastest)
        rate = float(links.matrix([p_ids[i]], [d_ids[j]])[0, 0])
        parts = {"prefill_wait": float(self._p_wait[i]), "compute": float(compute[i]),
                 "transfer": float(missing[j] / rate), "decode_pressure": float(pressure[j])}
        return Placement(p_ids[i], d_ids[j], low, parts)

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
        if len(candidates) == 1 and columns.size == 1:  # the column's minimum is reached, only it can
            return candidates[0], int(columns[0])
        tied_ids = [d_ids[j] for j in columns]
        for i in sorted(candidates, key=lambda k: p_ids[k]):
            costs = (a[i] + missing[columns] / links.matrix([p_ids[i]], tied_ids)[0]) + pressure[columns]
            hits = columns[costs == low]
            if hits.size:
                return i, min(hits.tolist(), key=lambda k: d_ids[k])
        raise AssertionError(f"no pair costs the minimum {low}")

    def _compute(self, req: RequestShape, held: tuple[Ints, Ints], links: LinkModel,
                 num_slots: int) -> Floats:
        """`[P]` compute(P) seconds: the prompt at each worker's rate, less the prefix it holds (`held`:
        the holders' `[h]` slots and `[h, 3]` runs), summed as `placement._prefill_terms` sums it, so the
        values are the same to the bit."""
        rate = self._p_rate[:num_slots]
        compute = req.prompt_len / rate
        slots, runs = held
        if slots.size:
            device, host, disk = runs.T
            tiers = links.tier_bytes_per_s
            onload = host * req.block_bytes / tiers["host"] + disk * req.block_bytes / tiers["disk"]
            cached = np.minimum(device * req.block_size, req.prompt_len)
            uncached = np.maximum(0, req.prompt_len - cached - (host + disk) * req.block_size)
            compute[slots] = uncached / rate[slots] + onload
        return compute
