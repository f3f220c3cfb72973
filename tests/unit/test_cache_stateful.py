"""Random interleavings of the cache's operations keep its promises.

A hypothesis state machine drives a real `KVCacheManager` (tiny layout, 10 device blocks, 3 host
blocks, a disk tier of 6 files) through admit, onload, compute + commit, decode, free, evict,
disk flush, file corruption and restart, and checks after every step that

* no block leaks and refcounts equal the number of block tables holding each block; a block is in
  two tables only when it is a shared prefix-cache block (never a referenced block handed out again);
* every cached block, in every tier, holds exactly the bytes computed for its hash, and a request
  is only told a block is cached when it holds those bytes (corrupted files are never served);
* a consumer of the KV events alone knows exactly which hashes each tier holds.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from cedserve.model.cache.config import KVCacheConfig
from cedserve.model.cache.disk_format import HEADER_BYTES, block_path
from cedserve.model.cache.errors import CacheExhaustedError
from cedserve.model.cache.events import KVIndexMirror, Tier
from cedserve.model.cache.hashing import hash_blocks
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.manager import KVCacheManager
from cedserve.model.presets import preset

pytestmark = pytest.mark.unit

BLOCK_SIZE = 2
LAYOUT = BlockLayout.from_config(preset("tiny"), BLOCK_SIZE)
SALTS = ("", "tenant-b")
STEMS = ((0, 1, 2, 0, 1, 2, 0, 1), (0, 1, 2, 2, 1, 0, 1, 1), (2, 2, 2, 2, 0, 0, 0, 0))
"""Prompts start with a cut of one of these, so they often share cached blocks."""
prompts = st.builds(lambda stem, cut, tail: list(stem[:cut]) + tail, st.sampled_from(STEMS), st.integers(0, 8),
                    st.lists(st.integers(0, 2), max_size=3)).filter(bool)


def content(block_hash: bytes) -> np.ndarray:
    """The bytes a block with this hash holds once computed: a function of the hash only."""
    seed = np.frombuffer(hashlib.sha256(b"content" + block_hash).digest(), dtype=np.uint8)
    return np.resize(seed, LAYOUT.block_bytes)


class CacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="cedserve-cache-"))
        self.config = KVCacheConfig(block_size=BLOCK_SIZE, num_blocks=10, host_offload_blocks=3, disk_dir=str(self.dir),
                                    disk_capacity_blocks=6, io_queue_depth=4)
        self.mirror = KVIndexMirror()
        self.cache = self._start()
        self.live: dict[str, tuple[list[int], str]] = {}
        self.onload_pending: set[str] = set()
        self.counter = 0
        self.history: list[tuple[list[int], str]] = []

    def _start(self) -> KVCacheManager:
        return KVCacheManager(LAYOUT, self.config, worker_id="w", event_sink=self.mirror.apply)

    def teardown(self) -> None:
        self.cache.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ rules

    @rule(target=requests, tokens=prompts, salt=st.sampled_from(SALTS))
    def admit(self, tokens: list[int], salt: str) -> str:
        rid = f"r{self.counter}"
        self.counter += 1
        before = self.cache.pool.num_free
        try:
            admission = self.cache.admit(rid, tokens, salt)
        except CacheExhaustedError as exc:
            assert exc.request_id == rid and exc.needed > exc.available
            assert self.cache.pool.num_free >= before  # nothing left allocated (evictions may have freed some)
            return rid
        self.live[rid] = (tokens, salt)
        self.history.append((tokens, salt))
        if admission.onload_pending:
            self.onload_pending.add(rid)
        else:
            self._check_cached(rid, admission.num_cached_tokens)
        return rid

    @precondition(lambda self: bool(self.history))
    @rule(target=requests, pick=st.integers(0, 100))
    def admit_again(self, pick: int) -> str:
        """A session comes back with a prompt seen before (hits in whatever tier it now lives)."""
        tokens, salt = self.history[pick % len(self.history)]
        return self.admit(tokens, salt)

    @rule(rid=requests)
    def compute_and_commit(self, rid: str) -> None:
        if rid not in self.live:
            return
        cached = self.cache.finish_onload(rid)
        self.onload_pending.discard(rid)
        self._check_cached(rid, cached)
        self._write_and_commit(rid)

    @rule(rid=requests, new=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def decode(self, rid: str, new: list[int]) -> None:
        if rid not in self.live or rid in self.onload_pending:
            return
        try:
            self.cache.append_tokens(rid, new)
        except CacheExhaustedError:
            return
        tokens, salt = self.live[rid]
        self.live[rid] = (tokens + new, salt)
        self._write_and_commit(rid)

    @rule(rid=consumes(requests))
    def complete(self, rid: str) -> None:
        """The common life: onload, compute, commit, free."""
        if rid in self.live:
            self.compute_and_commit(rid)
            self.free(rid)

    @rule(rid=consumes(requests))
    def free(self, rid: str) -> None:
        if rid in self.live:
            self.cache.free(rid)
            del self.live[rid]
            self.onload_pending.discard(rid)

    @rule(n=st.integers(1, 8))
    def evict(self, n: int) -> None:
        self.cache.evict(n)

    @rule()
    def flush_disk(self) -> None:
        self.cache.drain()

    @rule(pick=st.integers(0, 100), truncate=st.booleans())
    def damage_file(self, pick: int, truncate: bool) -> None:
        disk = self.cache.disk
        assert disk is not None
        self.cache.drain()
        hashes = disk.hashes()
        if not hashes:
            return
        path = block_path(self.dir, hashes[pick % len(hashes)])
        if not path.exists():
            return
        data = bytearray(path.read_bytes())
        if truncate or len(data) <= HEADER_BYTES:
            path.write_bytes(bytes(data[: len(data) // 2]))
        else:
            data[HEADER_BYTES + pick % (len(data) - HEADER_BYTES)] ^= 0xFF
            path.write_bytes(bytes(data))

    @rule(persist=st.booleans(), write_through=st.booleans())
    def restart(self, persist: bool, write_through: bool) -> None:
        self.cache.close(persist=persist)
        self.config = msgspec.structs.replace(self.config, disk_write_through=write_through)
        self.cache = self._start()
        self.live.clear()
        self.onload_pending.clear()

    # ------------------------------------------------------------------ helpers

    def _write_and_commit(self, rid: str) -> None:
        tokens, salt = self.live[rid]
        table = self.cache.block_table(rid)
        hashes = hash_blocks(tokens, salt, BLOCK_SIZE)
        committed = self._committed_blocks(rid)
        for i in range(committed, len(hashes)):
            self.cache.pool.storage[table[i]] = torch.from_numpy(content(hashes[i]))
        if len(tokens) % BLOCK_SIZE:
            self.cache.pool.storage[table[len(hashes)]] = 0x5A  # a partial block: never cached
        self.cache.commit(rid, len(tokens))

    def _committed_blocks(self, rid: str) -> int:
        # blocks whose bytes the request no longer rewrites: those already in the prefix cache under its hashes
        tokens, salt = self.live[rid]
        table = self.cache.block_table(rid)
        n = 0
        for i, h in enumerate(hash_blocks(tokens, salt, BLOCK_SIZE)):
            if self.cache.prefix.get(h) != table[i]:
                break
            n += 1
        return n

    def _check_cached(self, rid: str, cached_tokens: int) -> None:
        tokens, salt = self.live[rid]
        table = self.cache.block_table(rid)
        for i, h in enumerate(hash_blocks(tokens, salt, BLOCK_SIZE)[: cached_tokens // BLOCK_SIZE]):
            got = self.cache.pool.storage[table[i]].numpy()
            assert (got == content(h)).all(), f"{rid}: cached block {i} holds other bytes"

    # ------------------------------------------------------------------ invariants

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        self.cache.check_invariants()
        owners: dict[int, int] = {}
        for rid in self.live:
            for block in self.cache.block_table(rid):
                owners[block] = owners.get(block, 0) + 1
        for block, count in owners.items():
            if count > 1:
                assert self.cache.prefix.cached_mask([block])[0], f"block {block} shared but not a prefix block"

    @invariant()
    def cached_bytes_match(self) -> None:
        for h in self.cache.prefix.hashes():
            block = self.cache.prefix.get(h)
            assert block is not None
            assert (self.cache.pool.storage[block].numpy() == content(h)).all(), "device block corrupted"
        host = self.cache.host
        if host is not None:
            for h in host.hashes():
                slot = host.get(h)
                assert slot is not None and (host.storage[slot].numpy() == content(h)).all(), "host block corrupted"

    @invariant()
    def events_mirror_holdings(self) -> None:
        self.cache.events.flush()
        actual: dict[bytes, set[Tier]] = {}
        for tier, hashes in self.cache.holdings():
            for h in hashes:
                actual.setdefault(h, set()).add(tier)
        assert self.mirror.holdings("w") == {h: frozenset(t) for h, t in actual.items()}


CacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestCacheMachine = CacheMachine.TestCase
