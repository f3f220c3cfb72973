"""Byte sizes of the three cache records (`reference.py` defines their layouts), without torch.

The router and the serve config size blocks from these (`model/kv_accounting.py`) and must not
import torch to do it; `reference.py`, the executable specification, re-exports them.
"""

from __future__ import annotations

MAIN_KV_BLOCK = 16
"""Channels per E4M3 scale in a main-KV record."""
INDEX_KEY_BLOCK = 32
"""Channels per UE8M0 scale in an index-key record."""
SWA_BLOCK = 32
"""Channels per UE8M0 scale in an SWA record."""


def check_record_dim(dim: int, block_size: int, what: str) -> None:
    """`ValueError` unless `dim` is a positive multiple of `block_size` (the record's scale block)."""
    if dim <= 0 or dim % block_size:
        raise ValueError(f"{what}: D must be a positive multiple of {block_size}, got {dim}")


def main_kv_record_bytes(dim: int) -> int:
    """Bytes of one main-KV record of ``dim`` channels: ``dim // 2 + dim // 16``
    (288 for 512, 36 for 64)."""
    check_record_dim(dim, MAIN_KV_BLOCK, "main KV record")
    return dim // 2 + dim // MAIN_KV_BLOCK


def index_key_record_bytes(dim: int) -> int:
    """Bytes of one index-key record of ``dim`` channels: ``dim // 2 + dim // 32``
    (68 for 128, 17 for 32)."""
    check_record_dim(dim, INDEX_KEY_BLOCK, "index key record")
    return dim // 2 + dim // INDEX_KEY_BLOCK


def swa_record_bytes(dim: int) -> int:
    """Bytes of one SWA record of ``dim`` channels: ``dim + dim // 32`` (528 for 512,
    66 for 64)."""
    check_record_dim(dim, SWA_BLOCK, "SWA record")
    return dim + dim // SWA_BLOCK
