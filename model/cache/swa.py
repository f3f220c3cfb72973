"""Bounded per-request state: SWA rings of every layer and the compressors' partial groups.

Unlike global KV this state does not grow with context, is never shared between requests and is
never persisted: after a prefix hit, a restart or a transfer it is rebuilt by replaying the last
tokens (DESIGN section 1, "SWA Bounded Replay").

One `SWAPool` holds all of it in two tensors, one slot per running request:

* `rings`:   `uint8 [num_slots, num_layers, capacity, swa_record_bytes]` (528 B records,
  `pack_swa`), position `p` of a layer in ring row `p % capacity`;
* `partial`: `float32 [num_slots, num_partial_layers, partial_capacity, 2, head_dim]`, the projected
  `kv` (index 0) and `gate` (index 1) rows of each token at the KV sources with `m > 1`; the pending
  group at position `p` is rows `[p - p % m, p)`.

`capacity = sliding_window + spare` and `partial_capacity = max m + spare`: the `spare` rows let a
request write up to `spare` speculative tokens (DSpark verifies 5 drafts per pass) and `rollback`
to any earlier position whose window those writes did not overwrite, with no copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cedserve.kernels.reference import swa_record_bytes
from cedserve.model.cache.errors import SWAPoolExhaustedError, UnknownRequestError
from cedserve.model.config import AttentionMode, ModelConfig


@dataclass(frozen=True)
class SWAGeometry:
    """Shapes of one request's bounded state."""

    layer_ids: tuple[int, ...]
    """Layers with an SWA ring (every backbone layer, then the draft layers)."""
    window: int
    """Tokens in each layer's window (`sliding_window`)."""
    spare: int
    """Extra ring rows for tokens that may be rolled back."""
    record_bytes: int
    """Bytes of one SWA record (528 at head_dim 512)."""
    partial_layers: tuple[tuple[int, int], ...]
    """(layer id, compress ratio) of the KV sources whose groups span several tokens."""
    head_dim: int

    @classmethod
    def from_config(cls, config: ModelConfig, spare: int = 8, draft_layers: bool = True) -> SWAGeometry:
        if spare < 0:
            raise ValueError(f"cache field `swa_spare`: must be >= 0, got {spare}")
        n = config.num_hidden_layers + (config.num_nextn_predict_layers if draft_layers else 0)
        partial = tuple((s.layer_id, s.compress_ratio) for s in config.layer_plan
                        if s.mode is AttentionMode.FULL and s.compress_ratio > 1)
        return cls(tuple(range(n)), config.sliding_window, spare, swa_record_bytes(config.head_dim), partial,
                   config.head_dim)

    @property
    def capacity(self) -> int:
        return self.window + self.spare

    @property
    def partial_capacity(self) -> int:
        return max((m for _, m in self.partial_layers), default=1) + self.spare

    @property
    def bytes_per_slot(self) -> int:
        rings = len(self.layer_ids) * self.capacity * self.record_bytes
        return rings + len(self.partial_layers) * self.partial_capacity * 2 * self.head_dim * 4


class SWAPool:
    """Fixed slots of bounded state; `acquire` raises `SWAPoolExhaustedError` when all are taken."""

    def __init__(self, geometry: SWAGeometry, num_slots: int, device: torch.device | str = "cpu") -> None:
        if num_slots <= 0:
            raise ValueError(f"cache field `swa_slots`: must be positive, got {num_slots}")
        g = geometry
        self.geometry = g
        self.num_slots = num_slots
        self.rings = torch.zeros((num_slots, len(g.layer_ids), g.capacity, g.record_bytes), dtype=torch.uint8,
                                 device=device)
        self.partial = torch.zeros((num_slots, len(g.partial_layers), g.partial_capacity, 2, g.head_dim),
                                   dtype=torch.float32, device=device)
        self._free = list(range(num_slots - 1, -1, -1))
        self._states: dict[str, SWAState] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, request_id: str, start_position: int = 0) -> SWAState:
        """A slot for `request_id` whose first written token will be `start_position` (the replay start)."""
        if request_id in self._states:
            raise ValueError(f"request {request_id!r} already holds an SWA slot")
        if not self._free:
            raise SWAPoolExhaustedError(request_id, self.num_slots)
        state = SWAState(self, self._free.pop(), start_position)
        self._states[request_id] = state
        return state

    def get(self, request_id: str) -> SWAState:
        state = self._states.get(request_id)
        if state is None:
            raise UnknownRequestError(request_id)
        return state

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is None:
            raise UnknownRequestError(request_id)
        self._free.append(state.slot)


class SWAState:
    """One request's rings and partial groups. Layers `write` the tokens of a step at `position`,
    then the step calls `advance`."""

    def __init__(self, pool: SWAPool, slot: int, start_position: int) -> None:
        if start_position < 0:
            raise ValueError(f"start position must be >= 0, got {start_position}")
        g = pool.geometry
        self._g = g
        self.slot = slot
        self.position = start_position
        """Tokens consumed: the next token's absolute position."""
        self._rings = pool.rings[slot]  # [layers, capacity, record_bytes]
        self._partial = pool.partial[slot]  # [partial layers, partial_capacity, 2, head_dim]
        self._layer_row = {layer: i for i, layer in enumerate(g.layer_ids)}
        self._partial_row = {layer: (i, m) for i, (layer, m) in enumerate(g.partial_layers)}
        self._start = start_position  # nothing before it was written (replay starts here)
        self._floor = start_position  # oldest position not yet overwritten in the rings
        self._partial_floor = start_position

    # ------------------------------------------------------------------ writes

    def write(self, layer_id: int, records: Tensor) -> None:
        """SWA records `uint8 [n, record_bytes]` of positions `[position, position + n)` of a layer."""
        g = self._g
        if records.dtype != torch.uint8 or records.dim() != 2 or records.shape[1] != g.record_bytes:
            raise ValueError(f"SWA records must be uint8 [n, {g.record_bytes}], got {records.dtype} {list(records.shape)}")
        self._floor = max(self._floor, self._ring_write(self._rings[self._layer_row[layer_id]], records, g.capacity))

    def write_partial(self, layer_id: int, kv: Tensor, gate: Tensor) -> None:
        """Projected compressor rows `float32 [n, head_dim]` (kv and gate) of positions `[position, position + n)`."""
        row, _ = self._partial_row[layer_id]
        if kv.shape != gate.shape or kv.dim() != 2 or kv.shape[1] != self._g.head_dim:
            raise ValueError(f"kv and gate must both be [n, {self._g.head_dim}], got {list(kv.shape)}, {list(gate.shape)}")
        rows = torch.stack([kv, gate], dim=1).float()  # [n, 2, head_dim]
        floor = self._ring_write(self._partial[row], rows, self._g.partial_capacity)
        self._partial_floor = max(self._partial_floor, floor)

    def _ring_write(self, ring: Tensor, rows: Tensor, capacity: int) -> int:
        """Write `rows` at `position...`; returns the oldest position the ring still holds afterwards."""
        n = rows.shape[0]
        keep = min(n, capacity)
        first = self.position + n - keep
        index = torch.arange(first, first + keep, device=ring.device) % capacity
        ring[index] = rows[n - keep :].to(ring.device)
        return self.position + n - capacity

    def advance(self, n: int) -> None:
        """The step's `n` tokens are written in every layer."""
        if n < 0:
            raise ValueError(f"cannot advance by {n}")
        self.position += n

    # ------------------------------------------------------------------ reads

    def records(self, layer_id: int, start: int, end: int) -> Tensor:
        """Copy of one layer's records of positions `[start, end)`, oldest first, `uint8 [end - start, 528]`."""
        if not self._floor <= start <= end <= self.position:
            raise ValueError(f"positions [{start}, {end}) are not in the ring (holds [{self._floor}, {self.position}))")
        index = torch.arange(start, end, device=self._rings.device) % self._g.capacity
        return self._rings[self._layer_row[layer_id]][index]

    def window(self, layer_id: int) -> Tensor:
        """The `window - 1` records (fewer near the start) the next token attends to besides itself."""
        start = max(self.position - (self._g.window - 1), self._start)
        return self.records(layer_id, start, self.position)

    def pending(self, layer_id: int) -> tuple[Tensor, Tensor]:
        """(kv, gate) rows `float32 [r, head_dim]` of the incomplete group at `position` (r < m)."""
        row, m = self._partial_row[layer_id]
        start = max(self.position - self.position % m, self._start)
        if start < self._partial_floor:
            raise ValueError(f"layer {layer_id}: the partial group from position {start} is not held")
        index = torch.arange(start, self.position, device=self._partial.device) % self._g.partial_capacity
        rows = self._partial[row][index]
        return rows[:, 0], rows[:, 1]

    # ------------------------------------------------------------------ speculation

    def snapshot(self) -> int:
        """The position to `rollback` to (the rings need no copy)."""
        return self.position

    def can_rollback(self, position: int) -> bool:
        """Whether the window and partial groups at `position` are still intact."""
        if not self._start <= position <= self.position:
            return False
        window_start = max(position - (self._g.window - 1), self._start)
        group_start = min((position - position % m for _, m in self._g.partial_layers), default=position)
        return self._floor <= window_start and self._partial_floor <= max(group_start, self._start)

    def rollback(self, position: int) -> None:
        """Forget tokens from `position` on (rejected drafts). `ValueError` if later writes overwrote
        part of the state `position` needs (more than `spare` tokens back) or it is before the start."""
        if not self.can_rollback(position):
            raise ValueError(f"cannot roll back to {position}: position is {self.position}, state held from "
                             f"{max(self._floor, self._start)} (at most {self._g.spare} tokens back)")
        self.position = position
