"""`LocalMemory`: what one agent registered with NIXL, and the NIXL requests built over it.

At start the whole block pool (`KVRegion`) and the staging buffer are registered once; with the
cross-layer layout the pool is also prepared once as a NIXL descriptor list, so a request names
blocks by index (NIXL merges runs) instead of carrying descriptors. A peer's pool is prepared the
same way at its handshake (`prep_peer_blocks`). `blocks_job` and `staging_job` build one request
(`PostJob`) from our blocks or slots to a peer's; `post` hands it to NIXL. No transfer state lives
here: the engine (`engine.py`) owns that.
"""

from __future__ import annotations

import logging
from typing import Literal

import numpy as np

from cedserve.kv_transfer.config import KVTransferConfig
from cedserve.kv_transfer.descriptors import (
    RegionAddress,
    block_descs,
    coalesced_descs,
    count_runs,
    single_desc,
)
from cedserve.kv_transfer.nixl_backend import MemType, NixlBackend, NixlCallError, mem_type
from cedserve.kv_transfer.region import KVLayout, KVRegion, LayoutKind
from cedserve.kv_transfer.staging import StagingPool
from cedserve.kv_transfer.transfers import PeerState, PostJob, Transfer

log = logging.getLogger(__name__)


class LocalMemory:
    """The registered block pool, staging buffer and prepared block list of one agent."""

    def __init__(self, backend: NixlBackend, config: KVTransferConfig, region: KVRegion, layout: KVLayout) -> None:
        """`config` as `KVTransferConfig.resolved` filled it in."""
        self.backend = backend
        self.region = region
        self.layout = layout
        self.mem: MemType = mem_type(region.tensor)
        self.run_descs_max = config.run_descs_max or 0
        backend.register(region.tensor)
        # Cross-layer blocks are posted by index into lists prepared once (ours here, a peer's at its
        # handshake); the per-layer baseline builds its unmerged descriptors per transfer.
        self.blocks_list: int | None = None
        if layout.kind is LayoutKind.CROSS_LAYER:
            try:
                self.blocks_list = backend.prep_blocks(None, region.base_address, region.block_bytes,
                                                       region.num_blocks, region.device_id, self.mem)
            except NixlCallError as exc:  # still correct, only slower: descriptors built per transfer
                log.warning("%s; building descriptor lists per transfer instead", exc)
        self.staging: StagingPool | None = None
        slots, slot_bytes = config.staging_slots or 0, config.staging_slot_bytes or 0
        if slots > 0 and config.pack_threshold(region.device_memory) > 0:
            self.staging = StagingPool.allocate(slots, slot_bytes, region.tensor.device)
            backend.register(self.staging.tensor)

    @property
    def address(self) -> RegionAddress:
        return RegionAddress(self.region.base_address, self.region.num_blocks, self.region.device_id)

    def release_slot(self, slot: int | None) -> None:
        """Return one of our staging slots (None: the request held none)."""
        if slot is not None and self.staging is not None:
            self.staging.release(slot)

    def prep_peer_blocks(self, peer: str, kv: RegionAddress, block_bytes: int, kv_mem: MemType) -> int | None:
        """Prepare a peer's block pool as a NIXL list (its metadata loaded); None when we post
        per-layer descriptors, or when NIXL refused (still correct, only slower)."""
        if self.blocks_list is None:
            return None
        try:
            return self.backend.prep_blocks(peer, kv.base_address, block_bytes, kv.num_blocks, kv.device_id, kv_mem)
        except NixlCallError as exc:
            log.warning("%s; building descriptor lists per transfer to %s", exc, peer)
            return None

    def blocks_job(self, t: Transfer, seq: int, op: Literal["WRITE", "READ"], local_ids: np.ndarray,
                   peer_ids: np.ndarray, peer: PeerState, notif: bytes, runs: int | None = None) -> PostJob:
        """The request moving our blocks `local_ids[i]` to or from the peer's `peer_ids[i]`: indices into
        the prepared block lists (cross-layer; NIXL merges runs), or the per-layer descriptors.
        `runs`: `count_runs` of the pairs when the caller already has it; else they are counted once
        the request is posted (`PostJob.descriptors`), not on the way to its post. Pairs of at most
        `run_descs_max` runs go as one descriptor per run instead (`KVTransferConfig.run_descs_max`)."""
        nbytes = int(local_ids.size) * self.region.block_bytes
        if self.blocks_list is not None and peer.blocks_list is not None:
            if self.run_descs_max and local_ids.size > 1:
                runs = count_runs(local_ids, peer_ids) if runs is None else runs
                if runs <= self.run_descs_max:
                    descs = coalesced_descs(self.address, peer.kv, self.region.block_bytes, local_ids, peer_ids)
                    return PostJob(t, seq, op, descs, peer.kv_mem, notif, nbytes, None, None, descriptors=descs.count)
            return PostJob(t, seq, op, None, peer.kv_mem, notif, nbytes, None, None,
                           blocks=(local_ids, peer_ids), blocks_lists=(self.blocks_list, peer.blocks_list),
                           descriptors=runs)
        descs = block_descs(self.layout, self.address, peer.kv, local_ids, peer_ids)
        return PostJob(t, seq, op, descs, peer.kv_mem, notif, nbytes, None, None, descriptors=descs.count)

    def staging_job(self, t: Transfer, seq: int, op: Literal["WRITE", "READ"], local_slot: int, peer_slot: int,
                    peer: PeerState, notif: bytes, nbytes: int, scatter_ids: np.ndarray | None,
                    peer_row: int = 0) -> PostJob:
        """The request moving `nbytes` between the start of our staging slot and the peer's slot from
        block row `peer_row` (one descriptor)."""
        assert self.staging is not None
        descs = single_desc(self.staging.slot_address(local_slot), self.region.device_id,
                            peer.staging_address(peer_slot) + peer_row * self.region.block_bytes,
                            peer.staging_device, nbytes)
        return PostJob(t, seq, op, descs, peer.staging_mem, notif, nbytes, local_slot, scatter_ids, descriptors=1)

    @staticmethod
    def descriptors(job: PostJob) -> int:
        """Descriptors `job` moves (after NIXL merges runs), counted now if `blocks_job` left it open."""
        if job.descriptors is None:
            assert job.blocks is not None
            job.descriptors = count_runs(*job.blocks)
        return job.descriptors

    def post(self, job: PostJob) -> tuple[object, str, NixlCallError | None]:
        """Hand one request to NIXL: `(handle, status, None)`, or `(None, "ERR", error)`."""
        try:
            if job.blocks is not None:
                handle, status = self.backend.post_blocks(job.op, job.blocks_lists[0], job.blocks[0],
                                                          job.blocks_lists[1], job.blocks[1], job.transfer.peer,
                                                          job.notif)
            else:
                assert job.descs is not None
                handle, status = self.backend.post(job.op, job.descs, self.mem, job.remote_mem,
                                                   job.transfer.peer, job.notif)
        except NixlCallError as exc:
            return None, "ERR", exc
        return handle, status, None
