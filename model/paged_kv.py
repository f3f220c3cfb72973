"""Move a sequence's global KV records between its `SequenceState` and paged blocks.

Both worker kinds use this: prefill stores the records each encoded chunk produced into the
request's blocks (which the transfer layer then ships), decode loads received blocks into a fresh
state before replaying the bounded windows. Records are copied byte for byte, so a block written
here holds exactly what `BlockLayout` documents and what the model computed.

Entry `e` of a KV source with ratio `m` lives in the request's block `e // (block_size // m)`, slot
`e % (block_size // m)`.

`store_bytes` / `load_bytes` move an opaque byte string (a shipped bounded state,
`cedserve.model.state_format`) through blocks of the same pool: byte i of it is byte
`i % block_bytes` of block `block_ids[i // block_bytes]`, zero padded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from cedserve.model.cache.block_pool import gather_rows, scatter_rows
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.network import GlobalKVRecords
from cedserve.model.state import SequenceState


def _entry_slots(layout: BlockLayout, layer_id: int, block_ids: Sequence[int], first: int, count: int,
                 ) -> tuple[Tensor, Tensor]:
    """(pool rows, slots) of entries `first .. first + count` of `layer_id`, as int64 tensors."""
    per_block = layout.region(layer_id, "main").entries
    entries = torch.arange(first, first + count)
    index = entries // per_block
    if count and int(index[-1]) >= len(block_ids):
        raise ValueError(f"layer {layer_id}: entry {first + count - 1} needs block {int(index[-1])}, "
                         f"but the request has {len(block_ids)} blocks")
    rows = torch.as_tensor(list(block_ids), dtype=torch.long)[index]
    return rows, entries % per_block


def store_records(layout: BlockLayout, storage: Tensor, block_ids: Sequence[int],
                  records: Mapping[int, GlobalKVRecords]) -> None:
    """Copy each source's newly appended records into the request's blocks."""
    for layer_id, rec in records.items():
        count = int(rec.main.shape[0])
        if count == 0:
            continue
        rows, slots = _entry_slots(layout, layer_id, block_ids, rec.first_entry, count)
        layout.pool_view(storage, layer_id, "main")[rows, slots] = rec.main.to(storage.device)
        layout.pool_view(storage, layer_id, "index")[rows, slots] = rec.index_keys.to(storage.device)


def store_state(layout: BlockLayout, storage: Tensor, block_ids: Sequence[int], state: SequenceState,
                first_token: int = 0) -> None:
    """Copy every record of `state` from token `first_token` on (a block boundary) into the blocks."""
    if first_token % layout.block_size:
        raise ValueError(f"first_token {first_token} is not on a block boundary ({layout.block_size})")
    records = {}
    for layer_id, kv in state.global_kv.items():
        first = first_token // kv.ratio
        records[layer_id] = GlobalKVRecords(layer_id, first, kv.main[first:], kv.index_keys[first:])
    store_records(layout, storage, block_ids, records)


def load_state(layout: BlockLayout, storage: Tensor, block_ids: Sequence[int], num_tokens: int,
               state: SequenceState) -> None:
    """Fill `state.global_kv` with the records of the first `num_tokens` tokens from the blocks.

    Entries are whole groups: a trailing partial group (fewer than m tokens) has no record; its
    tokens are rebuilt by replay together with the windows. The state's position is not changed.
    """
    for layer_id, kv in state.global_kv.items():
        count = num_tokens // kv.ratio
        rows, slots = _entry_slots(layout, layer_id, block_ids, 0, count)
        device = kv.main.device
        kv.set_records(layout.pool_view(storage, layer_id, "main")[rows, slots].to(device).clone(),
                       layout.pool_view(storage, layer_id, "index")[rows, slots].to(device).clone())


def store_bytes(storage: Tensor, block_ids: Sequence[int], data: bytes) -> None:
    """Write `data` across the rows `block_ids` of `storage` (`uint8 [num_blocks, block_bytes]`) in
    order, zero padded. `ValueError` when it does not fit."""
    block_bytes = int(storage.shape[1])
    room = len(block_ids) * block_bytes
    if len(data) > room:
        raise ValueError(f"{len(data)} bytes do not fit {len(block_ids)} blocks of {block_bytes} bytes")
    padded = np.zeros(room, dtype=np.uint8)
    padded[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    scatter_rows(storage, list(block_ids), torch.from_numpy(padded).view(len(block_ids), block_bytes))


def load_bytes(storage: Tensor, block_ids: Sequence[int]) -> np.ndarray:
    """The bytes of rows `block_ids`, in order: flat `uint8 [len(block_ids) * block_bytes]` on the host."""
    return np.ascontiguousarray(gather_rows(storage, list(block_ids)).cpu().numpy()).reshape(-1)
