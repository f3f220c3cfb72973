"""One worker's KV cache: the block pool, the prefix cache, the lower tiers and the event stream.

Lifecycle of a request (all calls from the engine's thread):

1. `admit(request_id, token_ids, salt)`: hash the prompt's whole blocks, find the longest cached run
   across tiers, share device hits (no copy), allocate the rest (contiguous where possible), copy
   host-tier hits in, queue disk-tier reads. Evicts idle cached blocks if the pool is short; raises
   `CacheExhaustedError` (leaving nothing behind) if even that is not enough.
2. `finish_onload(request_id)`: wait for the disk reads; a rejected file ends the cached run there
   (the request recomputes from that block). Returns the tokens to skip.
3. The engine writes records into `block_table(request_id)`, then `commit(request_id, n)` makes
   every whole block of the first `n` tokens a shared prefix block (`BlockStored` event).
4. Decode: `append_tokens` (allocates a block when the last one fills), `commit`, and for DSpark
   `truncate` to drop rejected tokens that were never committed.
5. `free(request_id)`: cached blocks stay as idle prefix blocks (LRU); the others return to the pool.

Eviction moves idle blocks down: device -> host -> disk (disk writes in the background), or drops
them when a tier is off. Every change of what the worker holds is published as a KV event; `poll()`
retires finished disk work, publishes, and raises `TierIOError` for failed disk I/O.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from cedserve.model.cache.background import IOWorker
from cedserve.model.cache.block_pool import BlockPool, gather_rows, scatter_rows
from cedserve.model.cache.config import KVCacheConfig
from cedserve.model.cache.errors import (
    BlockFileMissingError,
    CacheExhaustedError,
    CorruptBlockFileError,
    TierIOError,
    UnknownRequestError,
)
from cedserve.model.cache.events import (
    BlockRemoved,
    BlockStored,
    BlockTierChanged,
    KVEventBatch,
    KVEventPublisher,
    Tier,
)
from cedserve.model.cache.hashing import TokenIds, hash_blocks
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.metrics import CacheMetrics
from cedserve.model.cache.prefix import PrefixCache
from cedserve.model.cache.tiers import DiskTier, HostTier, Payload, ReadOutcome
from cedserve.model.config_table import config_error

RequestId = str
STAGING_KEEP_BLOCKS = 1024
"""Largest disk-read staging buffer kept for reuse (58 MB at 56,960 B blocks): fresh host memory
costs a page fault per 4 KiB on first touch, which would otherwise dominate onload time."""


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached run of a prompt's blocks, without taking anything."""

    block_hashes: list[bytes]
    """Hashes of every whole block of the prompt."""
    tiers: list[Tier]
    """Tier serving each block of the run (device first, then host, then disk)."""

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)


@dataclass(frozen=True)
class Admission:
    """What `admit` gave a request."""

    request_id: RequestId
    block_ids: list[int]
    """The request's block table: block `i` holds tokens `[i * block_size, (i + 1) * block_size)`."""
    num_cached_tokens: int
    """Prompt tokens whose records are in the blocks (provisional while `onload_pending`)."""
    hit_tiers: tuple[Tier, ...]
    """Where each cached block came from."""
    onload_pending: bool
    """Disk reads are in flight: call `finish_onload` before reading the blocks."""


@dataclass
class _Onload:
    """Disk reads of one request, in chain order."""

    positions: list[int]
    block_hashes: list[bytes]
    staging: torch.Tensor
    """`uint8 [>= len(positions), block_bytes]` host buffer the I/O thread reads into (pinned with CUDA)."""
    future: Future[list[ReadOutcome]]


@dataclass
class _Request:
    request_id: RequestId
    salt: str
    block_ids: list[int]
    hashes: list[bytes]
    """Hashes of the whole blocks known so far (at least the committed ones)."""
    pending: array[int]
    """Token ids from position `pending_start` on: those of blocks not committed yet (the engine holds
    the rest; 8 B per token)."""
    pending_start: int = 0
    num_committed_blocks: int = 0
    """Blocks `[0, n)` have been offered to the prefix cache (shared hits count as offered)."""
    num_cached_tokens: int = 0
    onload: _Onload | None = None

    @property
    def num_tokens(self) -> int:
        return self.pending_start + len(self.pending)



def state_owner(request_id: str) -> str:
    """The owner name under which a request's shipped-state scratch blocks are held
    (`allocate_scratch`): one name on the prefill side, which packs the state, and the decode side,
    which receives it."""
    return f"{request_id}#state"

class KVCacheManager:
    """Owns the pool, prefix cache, tiers and events of one worker. Not thread-safe."""

    def __init__(self, layout: BlockLayout, config: KVCacheConfig, worker_id: str = "worker-0",
                 device: torch.device | str = "cpu", event_sink: Callable[[KVEventBatch], None] | None = None,
                 epoch: int | None = None) -> None:
        if config.block_size != layout.block_size:
            raise config_error("cache", "block_size", f"{config.block_size}, but the layout's blocks hold {layout.block_size} tokens")
        self.layout = layout
        self.config = config
        self.block_size = layout.block_size
        self.metrics = CacheMetrics()
        self.pool = BlockPool(config.num_blocks, layout.block_bytes, device)
        self.prefix = PrefixCache(self.pool, self.block_size)
        self.events = KVEventPublisher(worker_id, epoch, config.event_replay_batches, event_sink)
        self.host = HostTier(config.host_offload_blocks, layout.block_bytes) if config.host_offload_blocks else None
        self._io: IOWorker | None = None
        self.disk: DiskTier | None = None
        if config.disk_path is not None:
            self._io = IOWorker(config.io_queue_depth)
            self.disk = DiskTier(config.disk_path, layout.compat_hash, layout.block_bytes, self._io, self.metrics,
                                 config.disk_capacity_blocks, config.disk_fsync)
        self._requests: dict[RequestId, _Request] = {}
        self._orphans: list[_Onload] = []
        self._spare_staging: torch.Tensor | None = None
        self._spare_ready: torch.cuda.Event | None = None
        self._errors: list[BaseException] = []
        self.events.snapshot(self.holdings())  # seq 0 of every epoch: what survived the restart

    # ------------------------------------------------------------------ lookup and admission

    def lookup(self, token_ids: TokenIds, salt: str = "") -> PrefixMatch:
        """The longest cached run of the prompt's whole blocks, across tiers (changes nothing)."""
        hashes = hash_blocks(token_ids, salt, self.block_size)
        return PrefixMatch(hashes, self._match(hashes[: self._usable_blocks(len(token_ids))])[0])

    def admit(self, request_id: RequestId, token_ids: TokenIds, salt: str = "",
              num_lookahead_tokens: int = 0) -> Admission:
        """Give a new request its blocks: shared prefix hits plus fresh blocks for the rest of the prompt
        and `num_lookahead_tokens` more. At least the last prompt token is always left to compute."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already admitted")
        tokens = np.asarray(token_ids, dtype=np.int64)
        hashes = hash_blocks(tokens, salt, self.block_size)
        usable = self._usable_blocks(len(tokens))
        tiers, located = self._match(hashes[:usable])
        self._count_lookup(tiers, usable)
        table = np.full(max(math.ceil((len(tokens) + num_lookahead_tokens) / self.block_size), len(tiers)), -1)
        table[: len(located)] = located
        device_ids = table[table >= 0]
        self.pool.incref(device_ids)
        # Take the lower-tier hits' bytes (host) or queue their reads (disk) before allocating: making
        # room may push those very blocks further down or out.
        host_pos = [i for i, t in enumerate(tiers) if t is Tier.HOST]
        host_rows = self._read_host([hashes[i] for i in host_pos])
        disk_pos = [i for i, t in enumerate(tiers) if t is Tier.DISK]
        onload = None
        if disk_pos:
            disk_hashes = [hashes[i] for i in disk_pos]
            staging = self._take_staging(len(disk_pos))
            rows = staging[: len(disk_pos)].numpy()
            onload = _Onload(disk_pos, disk_hashes, staging, self._disk().read_many(disk_hashes, rows))
        lead = next((i for i, t in enumerate(tiers) if t is not Tier.DEVICE), len(tiers))
        hint = int(table[lead - 1]) + 1 if lead else None
        try:
            fresh = self._allocate(len(table) - len(device_ids), request_id, hint)
        except CacheExhaustedError:
            self._release(device_ids.tolist())
            self._orphans += [onload] if onload is not None else []
            raise
        table[table < 0] = fresh
        req = _Request(request_id, salt, table.tolist(), hashes, array("q", tokens.tobytes()),
                       num_cached_tokens=len(tiers) * self.block_size, onload=onload)
        if host_rows is not None:
            scatter_rows(self.pool.storage, table[host_pos], host_rows)
            self.metrics.onload_host_bytes += host_rows.numel()
        self._register(req, disk_pos[0] if disk_pos else len(tiers))
        self._requests[request_id] = req
        self.events.flush()
        return Admission(request_id, list(req.block_ids), req.num_cached_tokens, tuple(tiers), onload is not None)

    def finish_onload(self, request_id: RequestId) -> int:
        """Wait for the request's disk reads and copy them in. A rejected or unreadable file is dropped
        (counted, `BlockRemoved` published) and the cached run ends before it. Returns the number of
        prompt tokens whose records are in the blocks."""
        req = self._get(request_id)
        if req.onload is None:
            return req.num_cached_tokens
        onload = req.onload
        end = req.num_cached_tokens // self.block_size
        for position, block_hash, outcome in zip(onload.positions, onload.block_hashes, onload.future.result()):
            if outcome is not None:
                self._drop_disk(block_hash, outcome)
                end = min(end, position)
        usable = sum(1 for i in onload.positions if i < end)  # a prefix of the staging rows
        if usable:
            blocks = [req.block_ids[i] for i in onload.positions[:usable]]
            scatter_rows(self.pool.storage, blocks, onload.staging[:usable])
            self.metrics.onload_disk_bytes += usable * self.layout.block_bytes
        self._give_staging(onload.staging)
        req.onload = None
        req.num_cached_tokens = end * self.block_size
        self._register(req, end)
        self.events.flush()
        return req.num_cached_tokens

    # ------------------------------------------------------------------ running requests

    def __contains__(self, request_id: object) -> bool:
        """Whether `request_id` holds blocks here."""
        return request_id in self._requests

    def block_table(self, request_id: RequestId) -> list[int]:
        return list(self._get(request_id).block_ids)

    def num_tokens(self, request_id: RequestId) -> int:
        return self._get(request_id).num_tokens

    def commit(self, request_id: RequestId, num_computed_tokens: int) -> None:
        """Records of the first `num_computed_tokens` tokens are written: make their whole blocks shared
        prefix blocks. A block whose hash another request already cached stays private."""
        req = self._get(request_id)
        if req.onload is not None:
            raise ValueError(f"request {request_id!r}: call finish_onload before commit")
        if not 0 <= num_computed_tokens <= req.num_tokens:
            raise ValueError(f"request {request_id!r}: {num_computed_tokens} computed tokens of {req.num_tokens}")
        full = num_computed_tokens // self.block_size
        if full > len(req.hashes):
            parent = req.hashes[-1] if req.hashes else None
            lo = len(req.hashes) * self.block_size - req.pending_start
            hi = full * self.block_size - req.pending_start
            req.hashes += hash_blocks(np.frombuffer(req.pending, dtype=np.int64)[lo:hi], req.salt, self.block_size,
                                      parent)
        self._register(req, full)
        self.events.flush()

    def append_tokens(self, request_id: RequestId, token_ids: Sequence[int]) -> list[int]:
        """Add generated (or draft) tokens; returns blocks newly allocated to hold them."""
        req = self._get(request_id)
        fresh = self._cover(req, req.num_tokens + len(token_ids))
        req.pending.extend(int(t) for t in token_ids)
        self.events.flush()
        return fresh

    def reserve_tokens(self, request_id: RequestId, num_tokens: int) -> list[int]:
        """Grow the request's table to hold `num_tokens` tokens without adding any (a step's draft
        rows, whose records are written before acceptance is known); returns the new blocks. Later
        tokens fill them first (`append_tokens`), and `free` returns them. `CacheExhaustedError`
        (nothing taken) when the pool cannot supply them."""
        fresh = self._cover(self._get(request_id), num_tokens)
        self.events.flush()  # making room may have evicted cached blocks
        return fresh

    def _cover(self, req: _Request, num_tokens: int) -> list[int]:
        """Allocate the blocks `req` lacks to hold `num_tokens` tokens."""
        need = math.ceil(num_tokens / self.block_size) - len(req.block_ids)
        if need <= 0:
            return []
        fresh = self._allocate(need, req.request_id, req.block_ids[-1] + 1 if req.block_ids else None)
        req.block_ids += fresh
        return fresh

    def truncate(self, request_id: RequestId, num_tokens: int) -> None:
        """Forget tokens after `num_tokens` (rejected drafts). Committed blocks cannot be cut into."""
        req = self._get(request_id)
        if not req.num_committed_blocks * self.block_size <= num_tokens <= req.num_tokens:
            raise ValueError(f"request {request_id!r}: cannot truncate to {num_tokens} tokens "
                             f"({req.num_committed_blocks} blocks committed, {req.num_tokens} tokens)")
        del req.pending[num_tokens - req.pending_start :]
        del req.hashes[num_tokens // self.block_size :]

    def allocate_scratch(self, owner: RequestId, num_blocks: int) -> list[int]:
        """`num_blocks` fresh blocks under `owner` that hold bytes other than KV records (a shipped
        decode state): never hashed, cached or published. `free(owner)` returns them. Raises
        `ValueError` for an owner already holding blocks, `CacheExhaustedError` (nothing taken)."""
        if owner in self._requests:
            raise ValueError(f"request {owner!r} is already admitted")
        blocks = self._allocate(num_blocks, owner, None)
        self._requests[owner] = _Request(owner, "", blocks, [], array("q"))
        self.events.flush()  # making room may have evicted cached blocks
        return blocks

    def free(self, request_id: RequestId) -> None:
        """Release a request's blocks: cached ones become idle prefix blocks, the rest free."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(request_id)
        self._orphans += [req.onload] if req.onload is not None else []
        self._release(req.block_ids)
        self.events.flush()

    # ------------------------------------------------------------------ eviction and tiers

    def evict(self, num_blocks: int) -> int:
        """Evict up to `num_blocks` idle cached blocks (least recently released first) down the tiers."""
        victims = self.prefix.pick_victims(num_blocks)
        if victims.size:
            hashes = self.prefix.remove(victims)
            self._offload(hashes, victims)
            self.pool.free(victims)
            self.metrics.evicted_device_blocks += int(victims.size)
        self.events.flush()
        return int(victims.size)

    def poll(self) -> None:
        """Retire finished disk work, publish events; `TierIOError` if disk I/O failed since the last call."""
        if self.disk is not None:
            for block_hash, exc in self.disk.poll():
                if block_hash:
                    self.events.add(BlockRemoved([block_hash], Tier.DISK))
                self._errors.append(exc)
        for onload in [o for o in self._orphans if o.future.done()]:
            self._orphans.remove(onload)
            for block_hash, outcome in zip(onload.block_hashes, onload.future.result()):
                if outcome is not None:
                    self._drop_disk(block_hash, outcome)
            self._give_staging(onload.staging)
        self.events.flush()
        if self._errors:
            errors, self._errors = self._errors, []
            raise TierIOError(f"{len(errors)} disk-tier operations failed; first: {errors[0]!r}", errors)

    def drain(self) -> None:
        """Wait for every queued disk write, delete and abandoned read, then `poll`."""
        if self.disk is not None:
            self.disk.drain()
        for onload in self._orphans:
            onload.future.exception()  # waits; outcomes are per block, never raised
        self.poll()

    def snapshot_events(self) -> KVEventBatch:
        """A snapshot batch (for a consumer that lost track): clears and restates every tier's blocks."""
        return self.events.snapshot(self.holdings())

    def close(self, persist: bool = False) -> None:
        """Finish queued disk work and stop the disk worker; `TierIOError` if any of it failed.
        `persist`: first queue every cached device and host block that is not on disk yet, so a
        graceful restart keeps them all."""
        try:
            if self.disk is not None and persist:
                hashes = self.prefix.hashes()
                rows = [self._device_block(h) for h in hashes]
                self._persist(hashes, gather_rows(self.pool.storage, rows).cpu().numpy())
                if self.host is not None:
                    self._persist(*self.host.dump())
        finally:
            if self._io is not None:
                self._io.close()  # runs every queued job first
        try:
            self.poll()
        finally:
            if self.disk is not None:
                self.disk.close()

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_invariants(self) -> None:
        """`AssertionError` if pool, prefix cache and request tables disagree (tests)."""
        self.pool.check_invariants()
        expected = np.zeros(self.pool.num_blocks, dtype=np.int64)
        for req in self._requests.values():
            np.add.at(expected, np.asarray(req.block_ids, dtype=np.int64), 1)
        assert (self.pool.refcount(np.arange(self.pool.num_blocks)) == expected).all(), "refcounts != block tables"
        idle = self.pool.idle_mask()
        assert self.prefix.cached_mask(np.flatnonzero(idle)).all(), "an idle block is not cached (leaked)"
        for h in self.prefix.hashes():
            block = self.prefix.get(h)
            assert block is not None and not self.pool.is_free([block])[0], "cached block is free"

    # ------------------------------------------------------------------ internals

    def _get(self, request_id: RequestId) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(request_id)
        return req

    def _usable_blocks(self, num_tokens: int) -> int:
        """Whole blocks a prompt may take from the cache: the last token is always computed (its logits
        give the first output token)."""
        return max(0, num_tokens - 1) // self.block_size

    def _match(self, hashes: list[bytes]) -> tuple[list[Tier], list[int]]:
        """Tier of each block of the longest cached run, and its device block (-1 in other tiers)."""
        located = self.prefix.lookup(hashes)  # the leading device run: the common case, one tight loop
        tiers = [Tier.DEVICE] * len(located)
        for h in hashes[len(located) :]:
            block = self.prefix.get(h)
            if block is not None:
                tiers.append(Tier.DEVICE)
            elif self.host is not None and h in self.host:
                tiers.append(Tier.HOST)
            elif self.disk is not None and h in self.disk:
                tiers.append(Tier.DISK)
            else:
                break
            located.append(-1 if block is None else block)
        return tiers, located

    def _count_lookup(self, tiers: list[Tier], usable: int) -> None:
        m = self.metrics
        m.lookups += 1
        m.lookup_blocks += usable
        m.hit_blocks_device += tiers.count(Tier.DEVICE)
        m.hit_blocks_host += tiers.count(Tier.HOST)
        m.hit_blocks_disk += tiers.count(Tier.DISK)

    def _device_block(self, block_hash: bytes) -> int:
        block = self.prefix.get(block_hash)
        assert block is not None
        return block

    def _allocate(self, n: int, request_id: RequestId, hint: int | None) -> list[int]:
        short = n - self.pool.num_free
        if short > 0:
            evictable = self.prefix.num_evictable()
            if short > evictable:
                self.metrics.exhausted_errors += 1
                raise CacheExhaustedError(request_id, n, self.pool.num_free + evictable)
            self.evict(short)
        blocks = self.pool.allocate(n, request_id, hint)
        self.metrics.allocated_blocks += n
        return blocks

    def _release(self, block_ids: list[int]) -> None:
        idle = self.pool.decref(block_ids)
        if idle.size == 0:
            return
        cached = self.prefix.cached_mask(idle)
        table = np.asarray(block_ids, dtype=np.int64)
        self.prefix.touch_released(table[np.isin(table, idle[cached])])
        self.pool.free(idle[~cached])

    def _read_host(self, hashes: list[bytes]) -> torch.Tensor | None:
        """Copy of the host-tier blocks `hashes` (all held), `uint8 [n, block_bytes]`; None if none."""
        if not hashes or self.host is None:
            return None
        slots = [self.host.get(h) for h in hashes]
        assert all(s is not None for s in slots)
        return self.host.read([s for s in slots if s is not None], self.pool.storage.device)

    def _take_staging(self, n: int) -> torch.Tensor:
        spare = self._spare_staging
        if spare is not None and spare.shape[0] >= n:
            if self._spare_ready is not None:
                self._spare_ready.synchronize()  # its last copy to the device has been read
            self._spare_staging, self._spare_ready = None, None
            return spare
        return torch.empty((n, self.layout.block_bytes), dtype=torch.uint8, pin_memory=self.pool.storage.is_cuda)

    def _give_staging(self, staging: torch.Tensor) -> None:
        """Keep the largest finished staging buffer (up to STAGING_KEEP_BLOCKS rows) for the next onload."""
        spare = self._spare_staging
        if staging.shape[0] <= STAGING_KEEP_BLOCKS and (spare is None or staging.shape[0] > spare.shape[0]):
            self._spare_staging = staging
            self._spare_ready = None
            if self.pool.storage.is_cuda:  # an asynchronous host -> device copy may still read it
                self._spare_ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
                self._spare_ready.record()

    def _disk(self) -> DiskTier:
        assert self.disk is not None
        return self.disk

    def _register(self, req: _Request, end: int) -> None:
        """Offer blocks `[num_committed_blocks, end)` to the prefix cache and publish what it took."""
        start = req.num_committed_blocks
        if end <= start:
            return
        ids = req.block_ids[start:end]
        hashes = req.hashes[start:end]
        inserted = self.prefix.insert(ids, hashes)
        for lo, hi in _true_runs(inserted):
            parent = req.hashes[start + lo - 1] if start + lo > 0 else None
            self.events.add(BlockStored(hashes[lo:hi], Tier.DEVICE, parent))
        req.num_committed_blocks = end
        committed_tokens = end * self.block_size
        del req.pending[: committed_tokens - req.pending_start]
        req.pending_start = committed_tokens
        if self.disk is not None and self.config.disk_write_through and inserted.any():
            new = [i for i in np.flatnonzero(inserted).tolist() if hashes[i] not in self.disk]
            rows = gather_rows(self.pool.storage, [ids[i] for i in new])
            self._persist([hashes[i] for i in new], rows.cpu().numpy())

    def _persist(self, hashes: list[bytes], data: Payload) -> None:
        """Queue copies on disk of blocks that stay where they are (write-through, shutdown)."""
        disk = self._disk()
        new = [i for i, h in enumerate(hashes) if h not in disk]
        evicted = disk.write_many([(hashes[i], data[i]) for i in new])
        self.events.add(BlockStored([hashes[i] for i in new], Tier.DISK))
        self.events.add(BlockRemoved(evicted, Tier.DISK))

    def _offload(self, hashes: list[bytes], block_ids: np.ndarray) -> None:
        """Move evicted device blocks to the next tier down (or drop them)."""
        if self.host is None:
            if self.disk is None:
                self.events.add(BlockRemoved(hashes, Tier.DEVICE))
            else:
                self._spill(hashes, gather_rows(self.pool.storage, block_ids).cpu().numpy(), Tier.DEVICE)
            return
        held = np.asarray([h in self.host for h in hashes], dtype=np.bool_)
        self.events.add(BlockRemoved([h for h, k in zip(hashes, held) if k], Tier.DEVICE))
        new = np.flatnonzero(~held)
        for lo in range(0, new.size, self.host.num_blocks):
            part = new[lo : lo + self.host.num_blocks]
            part_hashes = [hashes[i] for i in part.tolist()]
            rows = gather_rows(self.pool.storage, block_ids[part])
            evicted, evicted_bytes = self.host.put(part_hashes, rows, keep_evicted=self.disk is not None)
            self.metrics.offload_host_bytes += len(part_hashes) * self.layout.block_bytes
            self.metrics.evicted_host_blocks += len(evicted)
            self._spill(evicted, evicted_bytes, Tier.HOST)
            self.events.add(BlockTierChanged(part_hashes, Tier.DEVICE, Tier.HOST))

    def _spill(self, hashes: list[bytes], data: Payload, src: Tier) -> None:
        """Blocks leaving `src` for good: to disk when there is one, else dropped."""
        if not hashes:
            return
        if self.disk is None:
            self.events.add(BlockRemoved(hashes, src))
            return
        held = [h in self.disk for h in hashes]
        self.events.add(BlockRemoved([h for h, k in zip(hashes, held) if k], src))
        moved = [h for h, k in zip(hashes, held) if not k]
        evicted = self.disk.write_many([(h, data[i]) for i, h in enumerate(hashes) if not held[i]])
        self.events.add(BlockTierChanged(moved, src, Tier.DISK))
        self.events.add(BlockRemoved(evicted, Tier.DISK))

    def _drop_disk(self, block_hash: bytes, exc: BaseException) -> None:
        assert self.disk is not None
        self.metrics.onload_failed_blocks += 1
        if self.disk.drop(block_hash, exc):
            self.events.add(BlockRemoved([block_hash], Tier.DISK))
        if not isinstance(exc, CorruptBlockFileError | BlockFileMissingError):
            self._errors.append(exc)

    def holdings(self) -> list[tuple[Tier, list[bytes]]]:
        out = [(Tier.DEVICE, self.prefix.hashes())]
        if self.host is not None:
            out.append((Tier.HOST, self.host.hashes()))
        if self.disk is not None:
            out.append((Tier.DISK, self.disk.hashes()))
        return out


def _true_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """`[lo, hi)` ranges where `mask` is True."""
    padded = np.concatenate([[False], mask.astype(np.bool_), [False]])
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[0::2], edges[1::2])]
