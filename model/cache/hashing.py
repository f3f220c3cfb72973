"""Chained, salted block hashes over token ids: the prefix cache's keys, shared with the router.

The router computes the same hashes to look prompts up in its global index, so this module is a
wire contract and imports neither torch nor the rest of the cache:

    root    = sha256(b"cedserve/prefix/v1\\x00" + utf8(cache_salt))
    h[0]    = sha256(root   + tokens[0 : B])
    h[i]    = sha256(h[i-1] + tokens[i*B : (i+1)*B])

where `B` is the block size and a block's tokens are little-endian uint32 token ids (4*B bytes).
Only whole blocks are hashed: a trailing partial block is never cached. Every hash commits to
the salt and to all tokens before it, so two prompts share block `i` only if their first
`(i+1)*B` tokens and their salt are equal. sha256 resists collisions (a tenant cannot craft
a prompt that aliases another's block), and the per-tenant salt keeps one tenant from probing
another's cache through timing. Effort is rendered into the system prompt, so it partitions the
cache with no extra key.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

HASH_DOMAIN = b"cedserve/prefix/v1\x00"
HASH_BYTES = 32

TokenIds = Sequence[int] | npt.NDArray[np.integer]
_UINT32 = next(code for code in "IL" if array(code).itemsize == 4)
"""The `array` type code of a 4-byte unsigned integer on this platform."""


def root_hash(salt: str = "") -> bytes:
    """The chain's starting value for tenant `salt` (the request's `cache_salt`; "" when none)."""
    return hashlib.sha256(HASH_DOMAIN + salt.encode()).digest()


def hash_blocks(token_ids: TokenIds, salt: str, block_size: int, parent: bytes | None = None) -> list[bytes]:
    """Hashes of the whole blocks of `token_ids` (a trailing partial block is skipped).

    `parent`: the hash of the block just before `token_ids[0]` when continuing a chain (then `salt`
    is not used: the parent already commits to it); None starts at the root of `salt`.
    `ValueError` for a bad block size or a token id outside `[0, 2**32)`.
    """
    if block_size <= 0:
        raise ValueError(f"cache field `block_size`: must be positive, got {block_size}")
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    data = memoryview(_uint32_le_bytes(token_ids[: num_blocks * block_size]))
    stride = 4 * block_size
    h = root_hash(salt) if parent is None else parent
    out: list[bytes] = []
    for start in range(0, len(data), stride):
        step = hashlib.sha256(h)
        step.update(data[start : start + stride])
        h = step.digest()
        out.append(h)
    return out


def _uint32_le_bytes(token_ids: TokenIds) -> bytes:
    """The ids as little-endian uint32s; `ValueError` for a non-integer or an id outside `[0, 2**32)`.
    A list or tuple (the router's prompts) goes through `array`: a few microseconds for a 200-token
    prompt, where numpy's conversion and range checks cost several times that."""
    if isinstance(token_ids, (list, tuple)):
        try:
            packed = array(_UINT32, token_ids)
        except OverflowError:
            raise ValueError("token ids must be in [0, 2**32)") from None
        except TypeError as exc:
            raise ValueError(f"token ids must be integers ({exc})") from None
        if sys.byteorder == "big":
            packed.byteswap()
        return packed.tobytes()
    tokens = np.asarray(token_ids)
    if tokens.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {tokens.dtype}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFFFFFF):
        raise ValueError("token ids must be in [0, 2**32)")
    return tokens.astype("<u4", copy=False).tobytes()
