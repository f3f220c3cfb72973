"""Configuration of one worker's KV cache (pool, tiers, events): the serve config's `[cache]` table.

It is the one home of the block size: the cache manager, the workers and their KV layouts read it
from here (`ServeConfig.cache`), nothing copies it by hand.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from cedserve.model.config_table import fail


class KVCacheConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sizes and policies of the block pool and its tiers (every field settable from `[cache]`)."""

    block_size: int = 64
    """Tokens per block; a multiple of every compression ratio and of the candidate block."""
    num_blocks: int = 4096
    """Blocks in the device pool (HBM, or plain memory on a CPU host)."""
    host_offload_blocks: int = 0
    """Blocks in the host tier (pinned when CUDA is available); 0 disables it."""
    disk_dir: str | None = None
    """Folder of the persistent disk tier, one per worker; None disables it."""
    disk_capacity_blocks: int = 0
    """Files kept on disk before the least recently used are deleted; 0 means no limit."""
    disk_write_through: bool = False
    """Also queue every newly computed block for disk at once (so sessions survive a crash), not only
    blocks that fall out of the host tier."""
    disk_fsync: bool = False
    """fsync each file and its folder: survives power loss, at a large cost per 57 KB file. Without it
    a torn file is still detected by its checksum and dropped."""
    io_queue_depth: int = 256
    """Disk jobs queued before `submit` blocks (each queued write holds one block's bytes)."""
    event_replay_batches: int = 1024
    """KV event batches kept for replay to a consumer that missed some."""

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "io_queue_depth", "event_replay_batches"):
            if getattr(self, name) <= 0:
                fail("cache", name, f"must be positive, got {getattr(self, name)}")
        for name in ("host_offload_blocks", "disk_capacity_blocks"):
            if getattr(self, name) < 0:
                fail("cache", name, f"must be >= 0, got {getattr(self, name)}")

    @property
    def disk_path(self) -> Path | None:
        return None if self.disk_dir is None else Path(self.disk_dir)
