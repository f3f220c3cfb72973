"""The router's global prefix index: which worker holds which prefix blocks, in which tier.

Fed by every worker's KV event stream (`cedserve.model.cache.events`). Each worker's batches carry
sequence numbers; a batch that does not follow the last applied one is refused (`apply` returns
False and the worker is marked for resync), and the caller reconnects asking the worker to replay
from the last applied sequence number, or for a snapshot when its replay buffer no longer reaches
back. The index is exact: a worker is credited only for blocks it said it stored and has not said
it removed.

Per worker only its (epoch, last sequence number) is kept, to order and check batches; the state
itself is one inverted map `hash -> holders` (a per-worker copy of every hash's tiers, as
`KVIndexMirror` keeps, would be a million small sets for a million entries: memory, and a full
garbage collection pass of about a second on the router's event loop). The map answers "how long a prefix of this prompt does every worker hold" in one walk over the prompt's
blocks. A holder set (`worker -> tier bitmask`) is immutable and interned: every hash held by the
same workers in the same tiers points to one `_Holders` object. Along a prompt's chain consecutive
blocks usually share it, so the walk compares objects by identity and does per-worker work only
where the holder set changes (a worker's run ends, or its fastest tier changes), and the change
between two holder sets is computed once (one set difference in C) and memoised on the (immutable)
pair as plain ints, so a repeat walk touches neither the later set nor its masks. A query costs
O(blocks + holders of the first block + changes), not O(blocks x holders); an update of one hash
costs O(its holders), as it builds the new interned set.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, count
from operator import is_not
from typing import cast

from cedserve.model.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockTierChanged,
    KVEvent,
    KVEventBatch,
    Tier,
)

TIER_ORDER: tuple[Tier, ...] = (Tier.DEVICE, Tier.HOST, Tier.DISK)
_BIT = {t: 1 << i for i, t in enumerate(TIER_ORDER)}
# Fastest tier (index into TIER_ORDER) of a non-empty tier bitmask: its lowest set bit.
_FASTEST = [0, 0, 1, 0, 2, 0, 1, 0]


@dataclass(frozen=True)
class PrefixHit:
    """Leading blocks of a prompt a worker holds: `blocks_by_tier[t]` of them are served from tier t
    (each block counted once, in its fastest tier)."""

    worker_id: str
    blocks_by_tier: dict[Tier, int]

    @property
    def total_blocks(self) -> int:
        return sum(self.blocks_by_tier.values())


def _empty(worker_id: str) -> PrefixHit:
    return PrefixHit(worker_id, {t: 0 for t in TIER_ORDER})


_FIRST_LOOKUPS = 64
"""Block hashes the prefix walk looks up first; each further chunk is twice the one before."""
_MAX_MEMOISED_CHANGES = 8
"""Holder-set changes remembered per holder set (a chain reaches a set from few others)."""


class _Holders:
    """The workers holding a block hash, `masks[worker] = tier bitmask`: immutable and interned, so
    equal holder sets are the same object. `refs` counts the hashes pointing at it."""

    __slots__ = ("_changes", "key", "masks", "refs", "sid")

    def __init__(self, masks: dict[str, int], key: frozenset[int], sid: int) -> None:
        self.masks = masks
        self.sid = sid
        """Its number: the index maps a hash to this very int object, so equal numbers are one object."""
        self.key = key
        """Its (worker, mask) items as small ints, `slot << 3 | mask`: set operations on two keys run in C."""
        self.refs = 0
        self._changes: dict[_Holders, tuple[int, ...]] = {}

    def changes_to(self, other: _Holders, names: list[str]) -> tuple[int, ...]:
        """The workers of this set whose mask differs in `other`, as `slot << 3 | their mask in other`
        (0 where absent; `names`: worker by slot). The set difference of the two keys runs in C over
        small ints, O(holders); then Python work only for the (usually one or two) workers that changed.
        Both sets are immutable, so the answer is memoised (a few per set); the memo is keyed by the
        object, and its answer holds plain ints, so a repeat walk touches neither `other` nor its masks."""
        changes = self._changes.get(other)
        if changes is None:
            if len(self._changes) >= _MAX_MEMOISED_CHANGES:
                self._changes.clear()
            theirs = other.masks
            changes = self._changes[other] = tuple(
                item & ~7 | theirs.get(names[item >> 3], 0) for item in self.key - other.key)
        return changes


class GlobalPrefixIndex:
    """Exact mirror of every worker's cache, with longest-prefix queries."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, int]] = {}  # worker -> (epoch, last applied seq)
        # hash -> its holder set's `sid`, and sid -> the set: a map of bytes to ints is one the garbage
        # collector leaves alone (a million-entry map of objects costs every full collection a pass)
        self._holders: dict[bytes, int] = {}
        self._sets: dict[int, _Holders] = {}
        self._next_sid = 0
        self._interned: dict[frozenset[int], _Holders] = {}
        self._slots: dict[str, int] = {}  # worker -> its number in the holder sets' keys (kept for good)
        self._names: list[str] = []  # slot -> worker
        self._num_entries = 0
        self._by_worker: dict[str, dict[bytes, None]] = {}  # dicts, not sets: untracked by the collector too
        self._out_of_step: set[str] = set()

    def apply(self, batch: KVEventBatch) -> bool:
        """Apply a batch; False (and the worker marked for resync) when it does not follow the last one."""
        worker = batch.worker_id
        last = self._last.get(worker)
        if not batch.is_snapshot:
            if last is None or last[0] != batch.epoch or batch.seq > last[1] + 1:
                self._out_of_step.add(worker)
                return False
            if batch.seq <= last[1]:  # applied already (a replay overlapping what arrived)
                self._out_of_step.discard(worker)
                return True
        self._out_of_step.discard(worker)
        for event in batch.events:
            self._apply_inverted(worker, event)
        self._last[worker] = (batch.epoch, batch.seq)
        return True

    def needs_resync(self) -> set[str]:
        return set(self._out_of_step)

    def last_seq(self, worker_id: str) -> int | None:
        last = self._last.get(worker_id)
        return None if last is None else last[1]

    @property
    def num_entries(self) -> int:
        """(block hash, worker) pairs indexed."""
        return self._num_entries

    def forget(self, worker_id: str) -> None:
        """Drop a worker (it left or died): no prefix credit until its next snapshot."""
        self._apply_inverted(worker_id, AllBlocksCleared())
        self._last.pop(worker_id, None)  # its next batch is a gap: only a snapshot brings it back
        self._out_of_step.discard(worker_id)

    def longest_prefix(self, worker_id: str, block_hashes: Sequence[bytes]) -> PrefixHit:
        """How many leading blocks of `block_hashes` the worker holds, split by fastest tier."""
        return self.prefix_hits(block_hashes).get(worker_id) or _empty(worker_id)

    def prefix_hits(self, block_hashes: Sequence[bytes]) -> dict[str, PrefixHit]:
        """Every worker holding at least the first block, with its longest run by tier."""
        return {w: PrefixHit(w, dict(zip(TIER_ORDER, c))) for w, c in self.prefix_runs(block_hashes).items()}

    def prefix_runs(self, block_hashes: Sequence[bytes]) -> dict[str, list[int]]:
        """Every worker holding at least the first block -> its longest leading run of `block_hashes`
        as `[device, host, disk]` block counts (each block in its fastest tier). One walk over the
        chain, stopping at the first block nobody holds or once every worker's run has ended."""
        states = self._holder_sids(block_hashes)
        if not states:
            return {}
        sets, names, end = self._sets, self._names, len(states)
        prev = sets[states[0]]
        tier = {item >> 3: _FASTEST[item & 7] for item in prev.key}  # slot -> fastest tier, while in its run
        since = dict.fromkeys(tier, 0)  # slot -> block where its current tier began
        counts = {slot: [0, 0, 0] for slot in tier}
        # Blocks where the holder set changes (found in C by identity); runs of one interned set cost nothing.
        for k in compress(count(1), map(is_not, states[: end - 1], states[1:end])):
            cur = sets[states[k]]
            for change in prev.changes_to(cur, names):  # usually one or two workers
                slot = change >> 3
                t = tier.get(slot)
                if t is None:
                    continue  # its run ended at an earlier block
                counts[slot][t] += k - since[slot]
                mask = change & 7
                if mask:
                    tier[slot], since[slot] = _FASTEST[mask], k
                else:
                    del tier[slot]
            if not tier:
                break
            prev = cur
        for slot, t in tier.items():
            counts[slot][t] += end - since[slot]
        return {names[slot]: run for slot, run in counts.items()}

    def _holder_sids(self, block_hashes: Sequence[bytes]) -> list[int]:
        """The holder sets (`sid`s) of the leading blocks anybody holds, up to the first block nobody does.
        Looked up in C, in chunks that double (64, 128, ...), so a prompt whose cached prefix is short
        costs little more than that prefix (a cold lookup in a 1M-entry index is a few cache misses),
        and a long one takes few chunks."""
        get = self._holders.get
        states: list[int] = []
        lo, size = 0, _FIRST_LOOKUPS
        while lo < len(block_hashes):
            chunk = list(map(get, block_hashes[lo: lo + size]))
            if None in chunk:
                states += cast("list[int]", chunk[: chunk.index(None)])
                break
            states += cast("list[int]", chunk)
            lo, size = lo + size, 2 * size
        return states

    def prefix_hits_reference(self, block_hashes: Sequence[bytes]) -> dict[str, PrefixHit]:
        """`prefix_hits` the straightforward way: every block, every worker still in its run. The
        oracle of the fast walk's tests and the old path of benchmarks/router.py."""
        first = self._lookup(block_hashes[0]) if block_hashes else None
        if first is None:
            return {}
        counts = {w: [0, 0, 0] for w in first.masks}
        alive = list(first.masks)
        for h in block_hashes:
            holders = self._lookup(h)
            if holders is None:
                break
            still = []
            for w in alive:
                mask = holders.masks.get(w)
                if mask:
                    counts[w][_FASTEST[mask]] += 1
                    still.append(w)
            if not still:
                break
            alive = still
        return {w: PrefixHit(w, dict(zip(TIER_ORDER, c))) for w, c in counts.items()}

    def best(self, workers: Iterable[str], block_hashes: Sequence[bytes]) -> PrefixHit | None:
        hits = self.prefix_hits(block_hashes)
        return max((hits.get(w) or _empty(w) for w in workers), key=lambda h: h.total_blocks, default=None)

    def _apply_inverted(self, worker_id: str, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            for h in list(self._by_worker.get(worker_id, ())):
                self._drop(h, worker_id, None)
        elif isinstance(event, BlockStored):
            for h in event.block_hashes:
                self._add(h, worker_id, event.tier)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self._drop(h, worker_id, event.tier)
        elif isinstance(event, BlockTierChanged):
            for h in event.block_hashes:
                self._drop(h, worker_id, event.src)
                self._add(h, worker_id, event.dst)

    def _lookup(self, h: bytes) -> _Holders | None:
        sid = self._holders.get(h)
        return None if sid is None else self._sets[sid]

    def _add(self, h: bytes, worker_id: str, tier: Tier) -> None:
        old = self._lookup(h)
        self._set(h, old, worker_id, (old.masks.get(worker_id, 0) if old else 0) | _BIT[tier])
        self._by_worker.setdefault(worker_id, {})[h] = None

    def _drop(self, h: bytes, worker_id: str, tier: Tier | None) -> None:
        old = self._lookup(h)
        mask = old.masks.get(worker_id, 0) if old else 0
        if not mask:
            return
        mask = 0 if tier is None else mask & ~_BIT[tier]
        self._set(h, old, worker_id, mask)
        if not mask:
            self._by_worker.get(worker_id, {}).pop(h, None)

    def _set(self, h: bytes, old: _Holders | None, worker_id: str, mask: int) -> None:
        """Point `h` at the interned holder set `old` with `worker_id`'s mask replaced (0: removed)."""
        masks = dict(old.masks) if old else {}
        before = len(masks)
        if mask:
            masks[worker_id] = mask
        else:
            masks.pop(worker_id, None)
        self._num_entries += len(masks) - before
        if old is not None:
            old.refs -= 1
            if not old.refs:
                del self._interned[old.key]
                del self._sets[old.sid]
        if not masks:
            self._holders.pop(h, None)
            return
        slot = self._slots.get(worker_id)
        if slot is None:
            slot = self._slots[worker_id] = len(self._names)
            self._names.append(worker_id)
        # A (worker, mask) item is one small int, `slot << 3 | mask`: keys hash and compare in C.
        key: frozenset[int] = frozenset() if old is None else old.key
        if old is not None and worker_id in old.masks:
            key = key - {slot << 3 | old.masks[worker_id]}
        if mask:
            key = key | {slot << 3 | mask}
        new = self._interned.get(key)
        if new is None:
            new = self._interned[key] = self._sets[self._next_sid] = _Holders(masks, key, self._next_sid)
            self._next_sid += 1
        new.refs += 1
        self._holders[h] = new.sid
