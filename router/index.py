"""The router's global prefix index: which worker holds which prefix blocks, in which tier.

Fed by every worker's KV event stream (`cedserve.model.cache.events`). Each worker's batches carry
sequence numbers; a batch that does not follow the last applied one is refused (`apply` returns
False and the worker is marked for resync), and the caller reconnects asking the worker to replay
from the last applied sequence number, or for a snapshot when its replay buffer no longer reaches
back. The index is exact: a worker is credited only for blocks it said it stored and has not said
it removed.

Per worker only its (epoch, last sequence number) is kept, to order and check batches; the state
itself is one inverted map `hash -> holder set`, a `BlockTable` (numpy arrays: no Python object per
entry for the garbage collector to traverse, and a prompt's hashes looked up in one compiled loop
that stops at the first miss). A holder set (`worker -> tier bitmask`) is immutable and interned:
every hash held by the same workers in the same tiers maps to one number (`sid`). When a set is
interned, its row of `_codes` (`[sets, workers]` uint8, 1 + each member's fastest tier, 0 elsewhere)
is written, so the walk turns the chain's holder sets into every worker's run in one compiled pass
(`_count_runs`): the chain is cut where the set changes (consecutive blocks usually share it), and
each segment's row of `_codes` says, for each holder of the first block still in its run, whether
the run goes on and in which tier. A query costs O(blocks + segments x holders) in native code
(`jit.compiled`), with no Python per block, set change or worker. An update finds its hashes (in a
vectorised pass beyond a few), groups them by holder set and moves each group to the set with the
worker's mask changed: Python work per group (interning the new set, O(its holders)), not per hash. Dropping a worker rewrites every set it is
in and the table's values in one pass (O(table), in C).

Memory: the table ~40 bytes / 0.35-0.5 per hash (a 128-byte bucket row of 8 slots, plus 24 bytes
of each key apart), `_codes` a byte per (set, worker), and the interned sets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cedserve.model.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockTierChanged,
    KVEvent,
    KVEventBatch,
    Tier,
)
from cedserve.router.block_table import BlockTable, as_keys
from cedserve.router.jit import compiled

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


class PrefixRuns(Mapping[str, list[int]]):
    """`GlobalPrefixIndex.prefix_runs`: every worker holding a prompt's first block -> its longest
    leading run as `[device, host, disk]` block counts. Kept as arrays, `workers` (ids, a tuple owned by
    the index: one object for every prompt whose first block has the same holders)
    and `blocks` (`[workers, 3]`), which `LoadTable.place` reads as they are; the dict of the
    mapping is built only when it is read as one."""

    __slots__ = ("_dict", "blocks", "workers")

    def __init__(self, workers: tuple[str, ...], blocks: npt.NDArray[np.int64]) -> None:
        self.workers = workers
        self.blocks = blocks
        self._dict: dict[str, list[int]] | None = None

    def _as_dict(self) -> dict[str, list[int]]:
        if self._dict is None:
            self._dict = dict(zip(self.workers, self.blocks.tolist(), strict=True))
        return self._dict

    def __getitem__(self, worker_id: str) -> list[int]:
        return self._as_dict()[worker_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self.workers)

    def __len__(self) -> int:
        return len(self.workers)

    def __repr__(self) -> str:
        return f"PrefixRuns({self._as_dict()!r})"


_NO_RUNS = PrefixRuns((), np.zeros((0, len(TIER_ORDER)), dtype=np.int64))


_FIRST_LOOKUPS = 1024
"""Block hashes the prefix walk looks up first (a 64K-token prompt at 64 tokens a block: one pass,
and a pass costs little more for a thousand keys than for a few); each further chunk is four times
the one before."""


class _Holders:
    """The workers holding a block hash, `masks[worker] = tier bitmask`: immutable and interned, so
    equal holder sets are one object, numbered `sid` (the table's value for every hash it holds;
    `refs` counts them). Its row of `GlobalPrefixIndex._codes` is written when it is interned."""

    __slots__ = ("key", "masks", "names", "refs", "sid", "slots")

    def __init__(self, masks: dict[str, int], key: frozenset[int], sid: int, names: list[str]) -> None:
        self.masks = masks
        self.key = key
        """Its (worker, mask) items as small ints, `slot << 3 | mask`: the interning key, hashed in C."""
        self.sid = sid
        self.refs = 0
        items = sorted(key)
        self.slots = np.array([item >> 3 for item in items], dtype=np.intp)  # [members] worker numbers
        # [members] their ids: a tuple of strings, which the garbage collector stops tracking
        self.names = tuple(names[item >> 3] for item in items)


_FEW_HASHES = 24
"""An event with fewer hashes is applied hash by hash in Python (a few microseconds each); one with
more, in vectorised passes (a fixed ~100 us, then about 1 us a hash)."""

MaskUpdate = Callable[[int], int]
"""A worker's new tier bitmask for a hash from its old one (0: not held)."""


@compiled
def _count_runs(sids: npt.NDArray[np.int32], codes: npt.NDArray[np.uint8], slots: npt.NDArray[np.intp],
                counts: npt.NDArray[np.int64]) -> None:
    """Adds to `counts[j, t]` (`[k, 3]`) the blocks of worker `slots[j]`'s leading run of the chain whose
    holder sets are `sids` that it holds in tier t: segment by segment (a segment: consecutive blocks
    of one set), `codes[set, worker]` (1 + fastest tier, 0: not held) says in which tier, until its
    first 0. Compiled (`jit.compiled`)."""
    alive = len(slots)
    ended = np.zeros(len(slots), dtype=np.bool_)
    start = 0
    while start < len(sids) and alive:
        sid = sids[start]
        stop = start + 1
        while stop < len(sids) and sids[stop] == sid:
            stop += 1
        for j in range(len(slots)):
            if not ended[j]:
                code = codes[sid, slots[j]]
                if code:
                    counts[j, code - 1] += stop - start
                else:
                    ended[j] = True
                    alive -= 1
        start = stop


class GlobalPrefixIndex:
    """Exact mirror of every worker's cache, with longest-prefix queries."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, int]] = {}  # worker -> (epoch, last applied seq)
        self._table = BlockTable()  # block hash -> the `sid` of its holder set
        self._sets: list[_Holders | None] = []  # sid -> holder set (None: a free number)
        self._free_sids: list[int] = []
        self._interned: dict[frozenset[int], _Holders] = {}
        self._slots: dict[str, int] = {}  # worker -> its number in the holder sets (kept for good)
        self._names: list[str] = []  # number -> worker
        # [sids, worker numbers] each holder set's members' fastest tier + 1 (0: not a member), written
        # when the set is interned, read by the walk: one byte per (set, worker)
        self._codes = np.zeros((64, 8), dtype=np.uint8)
        self._held: dict[str, int] = {}  # worker -> hashes it holds
        self._num_entries = 0
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
            self._apply_event(worker, event)
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

    @property
    def num_hashes(self) -> int:
        """Block hashes held by at least one worker."""
        return len(self._table)

    def forget(self, worker_id: str) -> None:
        """Drop a worker (it left or died): no prefix credit until its next snapshot."""
        self._clear(worker_id)
        self._last.pop(worker_id, None)  # its next batch is a gap: only a snapshot brings it back
        self._out_of_step.discard(worker_id)

    def longest_prefix(self, worker_id: str, block_hashes: Sequence[bytes]) -> PrefixHit:
        """How many leading blocks of `block_hashes` the worker holds, split by fastest tier."""
        return self.prefix_hits(block_hashes).get(worker_id) or _empty(worker_id)

    def prefix_hits(self, block_hashes: Sequence[bytes]) -> dict[str, PrefixHit]:
        """Every worker holding at least the first block, with its longest run by tier."""
        return {w: PrefixHit(w, dict(zip(TIER_ORDER, c))) for w, c in self.prefix_runs(block_hashes).items()}

    def prefix_runs(self, block_hashes: Sequence[bytes]) -> PrefixRuns:
        """Every worker holding at least the first block -> its longest leading run of `block_hashes`
        as `[device, host, disk]` block counts (each block in its fastest tier).

        The chain's holder sets are looked up up to the first block nobody holds (`BlockTable.get_prefix`),
        then one compiled pass (`_count_runs`) follows the first block's holders along the chain: a
        worker's run ends at the first set without it, and each block counts in its tier there.
        O(blocks + set changes x holders) in native code, no Python per block, set or worker (but the
        mapping's dict, when one is read)."""
        sids = self._holder_sids(block_hashes)
        if not len(sids):
            return _NO_RUNS
        first = self._set(int(sids[0]))
        counts = np.zeros((len(first.slots), len(TIER_ORDER)), dtype=np.int64)  # [k, 3] blocks per tier
        _count_runs(sids, self._codes, first.slots, counts)
        return PrefixRuns(first.names, counts)

    def _holder_sids(self, block_hashes: Sequence[bytes]) -> npt.NDArray[np.int32]:
        """The holder sets (`sid`s) of the leading blocks anybody holds, up to the first block nobody does.
        Looked up in chunks that grow fourfold (1024, 4096, ...), so a huge prompt whose cached prefix
        is short costs little more than that prefix (its hashes are joined into keys a chunk at a time),
        and a long one takes few passes."""
        parts = []
        lo, size = 0, _FIRST_LOOKUPS
        while lo < len(block_hashes):
            chunk = block_hashes[lo : lo + size]
            sids = self._table.get_prefix(as_keys(chunk))
            parts.append(sids)
            if len(sids) < len(chunk):
                break
            lo, size = lo + size, 4 * size
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

    def prefix_hits_reference(self, block_hashes: Sequence[bytes]) -> dict[str, PrefixHit]:
        """`prefix_hits` the straightforward way: every block, every worker still in its run. The
        oracle of the fast walk's tests and the old path of benchmarks/router.py; hashes matched on
        all 32 bytes (`BlockTable.find`)."""
        slots = self._table.find(as_keys(block_hashes)) if block_hashes else np.zeros(0, dtype=np.intp)
        sids = np.where(slots >= 0, self._table.values_at(np.maximum(slots, 0)), -1).tolist()
        if not sids or sids[0] < 0:
            return {}
        first = self._set(sids[0])
        counts = {w: [0, 0, 0] for w in first.masks}
        alive = list(first.masks)
        for sid in sids:
            if sid < 0:
                break
            holders = self._set(sid)
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

    # ------------------------------------------------------------------ updates (the event feed)

    def _apply_event(self, worker_id: str, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self._clear(worker_id)
        elif isinstance(event, BlockStored):
            bit = _BIT[event.tier]
            self._update(worker_id, event.block_hashes, lambda mask: mask | bit)
        elif isinstance(event, BlockRemoved):
            bit = _BIT[event.tier]
            self._update(worker_id, event.block_hashes, lambda mask: mask & ~bit)
        elif isinstance(event, BlockTierChanged):
            src, dst = _BIT[event.src], _BIT[event.dst]  # held or not, it is then held in dst
            self._update(worker_id, event.block_hashes, lambda mask: mask & ~src | dst)

    def _update(self, worker_id: str, block_hashes: Sequence[bytes], update: MaskUpdate) -> None:
        """Apply `update` to the worker's mask of each hash. Beyond a few hashes, they are found in one
        vectorised pass and grouped by their holder set; each group moves to one new set (Python work
        per group, a few per event: a chain's blocks mostly share sets), then the table is written in
        one pass."""
        if len(block_hashes) < _FEW_HASHES:
            for block_hash in dict.fromkeys(block_hashes):  # an update is idempotent: repeats change nothing
                self._update_one(worker_id, block_hash, update)
            return
        keys = as_keys(list(dict.fromkeys(block_hashes)))
        slots = self._table.find(keys)
        present = slots >= 0
        old = np.full(len(keys), -1, dtype=np.int32)  # [n] holder set before, -1: nobody
        old[present] = self._table.values_at(slots[present])
        groups, inverse, sizes = np.unique(old, return_inverse=True, return_counts=True)
        moved = [self._move(sid, worker_id, update, size) for sid, size in zip(groups.tolist(), sizes.tolist(),
                                                                              strict=True)]
        new = np.array(moved, dtype=np.int32)[inverse.reshape(-1)]  # [n] holder set after, -1: nobody
        changed = present & (new != old)
        kept = changed & (new >= 0)
        self._table.set_values(slots[kept], new[kept])
        self._table.delete(slots[changed & (new < 0)])
        added = ~present & (new >= 0)
        self._table.insert(keys[added], new[added])

    def _update_one(self, worker_id: str, block_hash: bytes, update: MaskUpdate) -> None:
        table = self._table
        slot, free = table.find_one(block_hash)
        old = table.value_at(slot) if slot >= 0 else -1
        new = self._move(old, worker_id, update, 1)
        if new == old:
            return
        if slot < 0:
            table.insert_one(block_hash, new, free)
        elif new < 0:
            table.delete_one(slot)
        else:
            table.set_value(slot, new)

    def _clear(self, worker_id: str) -> None:
        """Remove the worker from every hash it holds: each holder set with it moves to the set without
        it, and one vectorised pass over the table rewrites the hashes (O(table), in C)."""
        if not self._held.get(worker_id):
            return
        remap = np.arange(-2, len(self._sets), dtype=np.int32)  # [2 + sets] value + 2 -> new value
        for holders in [s for s in self._sets if s is not None and worker_id in s.masks]:
            remap[holders.sid + 2] = self._move(holders.sid, worker_id, lambda _: 0, holders.refs)
        values = self._table.values
        new = remap[values + 2]  # EMPTY and DELETED map to themselves
        changed = np.flatnonzero(new != values)
        dropped = new[changed] < 0
        self._table.set_values(changed[~dropped], new[changed[~dropped]])
        self._table.delete(changed[dropped])

    def _move(self, sid: int, worker_id: str, update: MaskUpdate, count: int) -> int:
        """Move `count` hashes of holder set `sid` (-1: held by nobody) to the set with the worker's
        mask updated: the new set's `sid`, -1 when nobody holds them then."""
        old = self._sets[sid] if sid >= 0 else None
        before = old.masks.get(worker_id, 0) if old is not None else 0
        mask = update(before)
        if mask == before:
            return sid
        new = self._intern(old, worker_id, mask)
        self._num_entries += ((len(new.masks) if new else 0) - (len(old.masks) if old else 0)) * count
        self._held[worker_id] = self._held.get(worker_id, 0) + (bool(mask) - bool(before)) * count
        if new is not None:
            new.refs += count
        if old is not None:
            old.refs -= count
            if not old.refs:
                del self._interned[old.key]
                self._sets[old.sid] = None
                self._free_sids.append(old.sid)
        return -1 if new is None else new.sid

    def _intern(self, old: _Holders | None, worker_id: str, mask: int) -> _Holders | None:
        """The interned holder set `old` with `worker_id`'s mask replaced (0: removed); None when empty."""
        masks = dict(old.masks) if old else {}
        if mask:
            masks[worker_id] = mask
        else:
            masks.pop(worker_id, None)
        if not masks:
            return None
        slot = self._slots.get(worker_id)
        if slot is None:
            slot = self._slots[worker_id] = len(self._names)
            self._names.append(worker_id)
            if slot >= self._codes.shape[1]:
                self._codes = np.pad(self._codes, ((0, 0), (0, self._codes.shape[1])))
        # A (worker, mask) item is one small int, `slot << 3 | mask`: keys hash and compare in C.
        key: frozenset[int] = frozenset() if old is None else old.key
        if old is not None and worker_id in old.masks:
            key = key - {slot << 3 | old.masks[worker_id]}
        if mask:
            key = key | {slot << 3 | mask}
        holders = self._interned.get(key)
        if holders is None:
            sid = self._free_sids.pop() if self._free_sids else len(self._sets)
            holders = self._interned[key] = _Holders(masks, key, sid, self._names)
            if sid == len(self._sets):
                self._sets.append(holders)
                if sid >= len(self._codes):
                    self._codes = np.pad(self._codes, ((0, len(self._codes)), (0, 0)))
            else:
                self._sets[sid] = holders
            row = self._codes[sid]
            row[:] = 0
            row[holders.slots] = [_FASTEST[item & 7] + 1 for item in sorted(key)]
        return holders

    def _set(self, sid: int) -> _Holders:
        holders = self._sets[sid]
        assert holders is not None, f"holder set {sid} is referenced but free"
        return holders
