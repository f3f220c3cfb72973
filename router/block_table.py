"""A hash table of 32-byte block hashes -> int32 values in numpy arrays: the prefix index's storage.

Lookups, inserts and deletions take a whole array of keys at once, so a prompt's thousand block
hashes are looked up in one compiled loop (`get`, `get_prefix`: a bucket row read per key, stopping
at the first miss) instead of a thousand dictionary lookups, and a million entries are a few arrays
that the garbage collector never visits, not a million Python objects.

Layout: open addressing with buckets of `WIDTH` = 8 slots (slot = bucket * 8 + column),
any number of buckets. A bucket is one 128-byte row, aligned to 128 bytes (two adjacent cache
lines), of 16 uint64 words:

    words 0-7    tag    uint64[8]  a key's first 8 bytes, little-endian
    words 8-11   value  int32[8]   the key's value (>= 0), or EMPTY (never used) or DELETED
    words 12-15  check  uint32[8]  the low 4 bytes of the key's second 8 bytes

and, apart, `rest` uint64[num_buckets * 8, 3]: each slot's key bytes 8-31. A key lives in its home
bucket (`(tag >> 32) * num_buckets >> 32`: the first bytes of a sha256 are uniform) or, when that was full,
in the first bucket after it (wrapping) with a free slot. A search reads the bucket's row and stops
at a slot whose tag and check match (a live one), or at a bucket with an EMPTY slot: the key is not
there; else it goes on to the next bucket (a few keys in a hundred at the table's highest load).

`get` and `get_prefix` (the prefix walk's lookup) match on those 12 bytes, 96 bits, and reads nothing else;
`find` (updates) confirms all 32 bytes in `rest`, so the table itself never confuses two keys. A
query answered wrongly by `get` would need a hash that equals a stored one in 96 bits: sha256 makes
that 2**-96 a pair by chance, and one who can choose prompts needs about 2**48 hashes of its own to
make such a pair, to misplace its own request by one block's credit (a hash commits to the whole
chain before it, so the next block differs).

Deleting marks the slot DELETED, not EMPTY, so no later key's search stops short of it; an insert
may reuse it. The table is rebuilt when used (live or DELETED) slots would pass `MAX_LOAD`: into a
table where the live keys fill at most `_LOAD_AFTER_REBUILD` of the slots (about 1.4x the size), or
the same size when it was mostly DELETED slots.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import struct
from array import array
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from cedserve.router.jit import compiled

WIDTH = 8
"""Slots per bucket (the row's layout, and `_any_in_rows`, rely on 8)."""
MAX_LOAD = 0.5
"""Used (live or DELETED) slots over all slots above which the table is rebuilt."""
_LOAD_AFTER_REBUILD = 0.35
"""Live slots over all slots after a rebuild, at most: it grows by about 1.4x when it has not
shed DELETED slots (memory ~ 40 bytes / 0.35-0.5 per hash held; a search reads its home bucket
alone for all but about one key in a thousand at 0.35, a few in a hundred at 0.5)."""
EMPTY = -1
DELETED = -2
KEY_BYTES = 32
_ROW_WORDS = 2 * WIDTH  # uint64 words per bucket row
_VALUES = slice(2 * WIDTH, 3 * WIDTH)  # the row's values, in its int32 view
_CHECKS = slice(3 * WIDTH, 4 * WIDTH)  # the row's checks, in its int32 view

Keys = npt.NDArray[np.uint64]
"""`[n, 4]` block hashes as little-endian 64-bit words."""
Slots = npt.NDArray[np.intp]
Values = npt.NDArray[np.int32]


def _other_length(block_hash: bytes) -> bytes:
    return hashlib.sha256(b"cedserve/index-key\x00" + block_hash).digest()


def as_keys(block_hashes: Sequence[bytes]) -> Keys:
    """`[n, 4]` words of `block_hashes`. A hash of another length than 32 bytes (never a real block
    hash: `hashing.HASH_BYTES`) is replaced by the sha256 of it with a prefix of its own, so such keys
    keep distinct unless sha256 collides."""
    joined = b"".join(block_hashes)
    if len(joined) != KEY_BYTES * len(block_hashes):
        joined = b"".join(h if len(h) == KEY_BYTES else _other_length(h) for h in block_hashes)
    return np.frombuffer(joined, dtype="<u8").reshape(-1, 4)


def _words_of(block_hash: bytes) -> list[int]:
    """One key's 4 words, as `as_keys` makes them."""
    if len(block_hash) != KEY_BYTES:
        block_hash = _other_length(block_hash)
    return list(struct.unpack("<4Q", block_hash))


def _check(keys: Keys) -> npt.NDArray[np.int32]:
    """`[n]` the keys' checks (the low 4 bytes of word 1), as the rows' int32 view holds them."""
    return keys[:, 1].astype(np.uint32).view(np.int32)


def _zeros(num_words: int) -> npt.NDArray[np.uint64]:
    """`[num_words]` zeroed uint64 in an anonymous mapping of its own: given back to the system when
    the table drops it (a rebuild), where a large array from malloc may leave the process's heap
    holding the memory. Private, not `mmap`'s default shared mapping: shared anonymous memory is shmem,
    which the kernel backs with huge pages only when shmem is set to (usually never), so the advice
    below did nothing and every lookup paid a TLB miss (a page walk, nested in a VM)."""
    memory = mmap.mmap(-1, 8 * num_words, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # as numpy asks for its large arrays: fewer TLB misses on lookups
        memory.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(memory, dtype=np.uint64)


def _any_in_rows(flags: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
    """`[p]` whether each row of a C-contiguous `[p, 8]` boolean array has a True (its row read as one
    uint64: one comparison, where a reduction along a short axis is slow in numpy)."""
    rows: npt.NDArray[np.bool_] = flags.view(np.uint64).reshape(-1) != 0
    return rows


@compiled
def _lookup(
    rows: npt.NDArray[np.uint64], words: npt.NDArray[np.int32], keys: Keys, values: Values, stop_at_miss: bool
) -> int:
    """Writes `values[k]`, the value of `keys[k]` (EMPTY when absent), matched on tag and check (96
    bits), for k = 0, 1, ...; returns how many were written: all of them, or with `stop_at_miss` up to
    the first absent key (not written). `rows` / `words`: the table's `[buckets, 16]` uint64 rows and
    their `[buckets, 32]` int32 view. Compiled (`jit.compiled`): a loop per key, no array made."""
    num_buckets = rows.shape[0]
    for k in range(len(keys)):
        tag = keys[k, 0]
        check = np.int32(
            np.int64(keys[k, 1] & np.uint64(0xFFFFFFFF)) - (np.int64(keys[k, 1] & np.uint64(0x80000000)) << 1)
        )
        bucket = np.int64(((tag >> np.uint64(32)) * np.uint64(num_buckets)) >> np.uint64(32))
        value = EMPTY
        while True:
            free = False  # an EMPTY slot: a key absent from its bucket is absent from the table
            for column in range(WIDTH):
                v = words[bucket, 2 * WIDTH + column]
                if v >= 0 and rows[bucket, column] == tag and words[bucket, 3 * WIDTH + column] == check:
                    value = v
                    break
                free |= v == EMPTY
            if value >= 0 or free:
                break
            bucket = (bucket + 1) % num_buckets
        if value < 0 and stop_at_miss:
            return k
        values[k] = value
    return len(keys)


class BlockTable:
    """Block hash -> int32 value. Not thread-safe (it lives on the router's event loop)."""

    def __init__(self, num_buckets: int = 1024) -> None:
        self._alloc(num_buckets)
        self._live = 0
        self._used = 0  # live + DELETED slots

    def _alloc(self, num_buckets: int) -> None:
        self._num_buckets = num_buckets
        self._scale = np.uint64(num_buckets)
        # Page-aligned (rows on 128 bytes: two cache lines each), in mappings of their own.
        self._rows = _zeros(num_buckets * _ROW_WORDS).reshape(num_buckets, _ROW_WORDS)
        self._words = self._rows.view(np.int32)  # [num_buckets, 32]: the same rows as int32
        self._words[:, _VALUES] = EMPTY
        self._rest = _zeros(num_buckets * WIDTH * 3).reshape(num_buckets * WIDTH, 3)
        # The same memory as flat memoryviews, for the one-key methods: an element read or written
        # through one costs a fraction of a numpy scalar access.
        self._row_words = self._rows.reshape(-1).data.cast("B").cast("Q")  # uint64, 16 a bucket
        self._row_ints = self._words.reshape(-1).data.cast("B").cast("i")  # int32, 32 a bucket
        self._rest_words = self._rest.reshape(-1).data.cast("B").cast("Q")  # uint64, 3 a slot

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        return self._rows.nbytes + self._rest.nbytes

    @property
    def values(self) -> Values:
        """`[slots]` a copy of every slot's value, EMPTY or DELETED where no key is."""
        return self._words[:, _VALUES].reshape(-1)

    def get(self, keys: Keys) -> Values:
        """`[n]` the values of `keys`, EMPTY (-1) for an absent key; keys matched on 96 bits (see above)."""
        values = np.empty(len(keys), dtype=np.int32)
        _lookup(self._rows, self._words, keys, values, False)
        return values

    def get_prefix(self, keys: Keys) -> Values:
        """The values of `keys` up to the first absent one (`get` cut there): the prefix walk's lookup,
        one compiled loop that reads a bucket row per key and stops at the first miss."""
        values = np.empty(len(keys), dtype=np.int32)
        return values[: _lookup(self._rows, self._words, keys, values, True)]

    def find(self, keys: Keys) -> Slots:
        """`[n]` the slots of `keys`, -1 for an absent key; keys matched on all 32 bytes."""
        return self._search(keys, exact=True)[0]

    def _search(self, keys: Keys, exact: bool) -> tuple[Slots, Values]:
        """`[n]` slots and `[n]` values of `keys` (-1 and EMPTY for an absent key). Each round reads
        one bucket row per key still sought: its home bucket first, where all but a few in a hundred
        are settled (found, or absent: the bucket has an EMPTY slot), then the next bucket for those."""
        n = len(keys)
        slots = np.full(n, -1, dtype=np.intp)
        values = np.full(n, EMPTY, dtype=np.int32)
        index = np.arange(n)  # [p] the keys still sought ...
        tags, checks = keys[:, 0], _check(keys)  # ... their tags and checks ...
        bucket = self._home(tags)  # ... and the bucket each reads next
        while True:
            rows = self._rows.take(bucket, axis=0)  # [p, 16]
            words = rows.view(np.int32)  # [p, 32]
            live = words[:, _VALUES] >= 0
            hit = (rows[:, :WIDTH] == tags[:, None]) & (words[:, _CHECKS] == checks[:, None]) & live  # [p, 8]
            column = hit.argmax(axis=1)
            slot = bucket * WIDTH + column
            found = _any_in_rows(hit)
            done = found | _any_in_rows(words[:, _VALUES] == EMPTY)  # absent: it would be in this bucket
            if exact and found.any():
                matched = np.flatnonzero(found)
                rest, want = self._rest.take(slot[matched], axis=0), keys[index[matched]]
                same = (rest[:, 0] == want[:, 1]) & (rest[:, 1] == want[:, 2]) & (rest[:, 2] == want[:, 3])
                for k in index[matched[~same]].tolist():  # 96 equal bits, another key: the slow way
                    slots[k] = self._probe(keys[k].tolist())[0]
                    values[k] = self.values_at(slots[k : k + 1])[0] if slots[k] >= 0 else EMPTY
                found[matched[~same]] = False
            slots[index[found]] = slot[found]
            values[index[found]] = words.reshape(-1)[(np.arange(len(rows)) * 32 + 2 * WIDTH + column)[found]]
            if done.all():
                return slots, values
            onward = ~done
            index, tags, checks = index[onward], tags[onward], checks[onward]
            bucket = (bucket[onward] + 1) % self._num_buckets

    # ------------------------------------------------------------------ one key at a time, in Python
    # (an event of a few hashes: a dozen numpy calls per key cost more than this per key)

    def find_one(self, block_hash: bytes) -> tuple[int, int]:
        """(the slot of one key or -1 if absent, matched on all 32 bytes; when absent, the first free
        slot on its way, where `insert_one` puts it)."""
        return self._probe(_words_of(block_hash), want_free=True)

    def _probe(self, key: list[int], want_free: bool = False) -> tuple[int, int]:
        tag, rest = key[0], key[1:]
        bucket = (tag >> 32) * self._num_buckets >> 32
        free = -1
        while True:
            at = bucket * 2 * _ROW_WORDS
            values = self._row_ints[at + 2 * WIDTH : at + 3 * WIDTH].tolist()
            tags = self._row_words[bucket * _ROW_WORDS : bucket * _ROW_WORDS + WIDTH].tolist()
            if tag in tags:
                for column, found in enumerate(tags):
                    slot = bucket * WIDTH + column
                    if (
                        found == tag
                        and values[column] >= 0
                        and self._rest_words[3 * slot : 3 * slot + 3].tolist() == rest
                    ):
                        return slot, -1
            if want_free and free < 0 and min(values) < 0:
                for column, value in enumerate(values):
                    if value < 0:
                        free = bucket * WIDTH + column
                        break
            if EMPTY in values:
                return -1, free
            bucket = (bucket + 1) % self._num_buckets

    def _value_index(self, slot: int) -> int:
        """Where `slot`'s value is in `_row_ints`."""
        return (slot // WIDTH) * 2 * _ROW_WORDS + 2 * WIDTH + slot % WIDTH

    def value_at(self, slot: int) -> int:
        return int(self._row_ints[self._value_index(slot)])

    def set_value(self, slot: int, value: int) -> None:
        self._row_ints[self._value_index(slot)] = value

    def delete_one(self, slot: int) -> None:
        self._row_ints[self._value_index(slot)] = DELETED
        self._live -= 1

    def insert_one(self, block_hash: bytes, value: int, free: int) -> None:
        """Add one absent key with `value` (>= 0) at `free`, the free slot `find_one` gave for it (the
        table unchanged since)."""
        key = _words_of(block_hash)
        if self._used + 1 > MAX_LOAD * self._rows.shape[0] * WIDTH:
            self._rebuild(self._live + 1)
            free = self._probe(key, want_free=True)[1]
        bucket, column = divmod(free, WIDTH)
        at = self._value_index(free)
        self._used += self._row_ints[at] == EMPTY
        self._live += 1
        self._row_words[bucket * _ROW_WORDS + column] = key[0]
        self._row_ints[at] = value
        self._row_ints[at + WIDTH] = (key[1] & 0xFFFFFFFF) - ((key[1] & 0x80000000) << 1)
        self._rest_words[3 * free : 3 * free + 3] = array("Q", key[1:])

    def _home(self, tags: npt.NDArray[np.uint64]) -> Slots:
        """`[n]` the home buckets of keys with these tags: their high 32 bits scaled to the bucket count."""
        return (((tags >> np.uint64(32)) * self._scale) >> np.uint64(32)).astype(np.intp)

    def values_at(self, slots: Slots) -> Values:
        """`[n]` the values at `slots` (from `find`)."""
        return self._words[slots // WIDTH, 2 * WIDTH + slots % WIDTH]

    def set_values(self, slots: Slots, values: Values) -> None:
        """Replace the values at `slots` (from `find`) with `values` (>= 0)."""
        self._words[slots // WIDTH, 2 * WIDTH + slots % WIDTH] = values

    def delete(self, slots: Slots) -> None:
        """Remove the keys at `slots` (distinct, from `find`)."""
        self._words[slots // WIDTH, 2 * WIDTH + slots % WIDTH] = DELETED
        self._live -= len(slots)

    def insert(self, keys: Keys, values: Values) -> None:
        """Add `keys` (distinct, none present) with `values` (>= 0)."""
        n = len(keys)
        if not n:
            return
        if self._used + n > MAX_LOAD * self._rows.shape[0] * WIDTH:
            self._rebuild(self._live + n)
        self._used += self._place(keys, values)
        self._live += n

    def _rebuild(self, live_after: int) -> None:
        """Re-insert every live key into a table where `live_after` keys fill at most
        `_LOAD_AFTER_REBUILD` of the slots (never a smaller one); DELETED slots are shed."""
        live = self._words[:, _VALUES] >= 0  # [num_buckets, 8]
        keys = np.concatenate([self._rows[:, :WIDTH][live][:, None], self._rest[live.reshape(-1)]], axis=1)
        values = self._words[:, _VALUES][live]
        self._alloc(max(len(self._rows), math.ceil(live_after / (_LOAD_AFTER_REBUILD * WIDTH))))
        self._used = self._place(keys, values)

    def _place(self, keys: Keys, values: Values) -> int:
        """Write absent, distinct `keys` into free slots; the caller keeps the load below 1. Returns
        how many were EMPTY (the others were DELETED: used already). In rounds:
        the keys still to place whose next bucket is the same are ranked, and the r-th of them takes
        the bucket's r-th free slot if it has one, else tries the next bucket."""
        pending = np.arange(len(keys))
        bucket = self._home(keys[:, 0])
        checks = _check(keys)
        empty = 0
        while pending.size:
            order = np.argsort(bucket, kind="stable")
            pending, bucket = pending[order], bucket[order]
            starts = np.flatnonzero(np.concatenate(([True], bucket[1:] != bucket[:-1])))
            rank = np.arange(bucket.size) - np.repeat(starts, np.diff(np.append(starts, bucket.size)))
            free = self._words.take(bucket, axis=0)[:, _VALUES] < 0  # [p, 8] EMPTY or DELETED
            placed = rank < free.sum(axis=1)
            column = (np.cumsum(free, axis=1) == (rank + 1)[:, None]).argmax(axis=1)[placed]
            at, mine = bucket[placed], pending[placed]
            empty += int((self._words[at, 2 * WIDTH + column] == EMPTY).sum())
            self._rows[at, column] = keys[mine, 0]
            self._words[at, 2 * WIDTH + column] = values[mine]
            self._words[at, 3 * WIDTH + column] = checks[mine]
            self._rest[at * WIDTH + column] = keys[mine, 1:]
            pending, bucket = pending[~placed], (bucket[~placed] + 1) % self._num_buckets
        return empty
