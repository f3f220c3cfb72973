"""Bounded per-request state: SWA rings and partial groups, with rollback for rejected drafts."""

from __future__ import annotations

import pytest
import torch

from cedserve.model.cache.errors import SWAPoolExhaustedError
from cedserve.model.cache.swa import SWAGeometry, SWAPool
from cedserve.model.presets import preset

pytestmark = pytest.mark.unit


def records(start: int, n: int, width: int) -> torch.Tensor:
    """Record of position p = bytes all equal to p % 251 (so positions are recognisable)."""
    return (torch.arange(start, start + n) % 251).to(torch.uint8)[:, None].expand(n, width).contiguous()


def test_released_geometry_is_bounded() -> None:
    g = SWAGeometry.from_config(preset("v4.1-flash"), spare=8)
    assert len(g.layer_ids) == 43 and g.record_bytes == 528 and g.capacity == 136
    assert g.partial_layers == ((2, 2), (8, 2), (14, 2))
    assert g.bytes_per_slot == 43 * 136 * 528 + 3 * 10 * 2 * 512 * 4


def test_window_wraps_and_rolls_back_within_spare() -> None:
    g = SWAGeometry.from_config(preset("tiny"), spare=3)  # window 8, capacity 11
    state = SWAPool(g, 2).acquire("r")
    for start, n in ((0, 5), (5, 9), (14, 1)):
        for layer in g.layer_ids:
            state.write(layer, records(start, n, g.record_bytes))
        state.advance(n)
    assert state.position == 15
    assert state.window(4)[:, 0].tolist() == list(range(8, 15))
    mark = state.snapshot()
    state.write(4, records(15, 3, g.record_bytes))  # three drafts
    state.advance(3)
    state.rollback(mark + 1)  # one accepted
    assert state.window(4)[:, 0].tolist() == list(range(9, 16))
    state.write(4, records(100, 4, g.record_bytes))  # four more: 16..19 overwrite 5..8 in the ring
    state.advance(4)
    assert not state.can_rollback(12)  # its window starts at 5
    with pytest.raises(ValueError, match="roll back"):
        state.rollback(12)
    state.rollback(16)
    assert state.window(4)[:, 0].tolist() == list(range(9, 16))


def test_partial_groups_follow_the_position() -> None:
    g = SWAGeometry.from_config(preset("tiny"), spare=2)  # layer 2 has m = 2
    state = SWAPool(g, 1).acquire("r")
    kv = torch.arange(3 * 64, dtype=torch.float32).view(3, 64)
    state.write_partial(2, kv, -kv)
    state.advance(3)
    pending_kv, pending_gate = state.pending(2)
    assert torch.equal(pending_kv, kv[2:]) and torch.equal(pending_gate, -kv[2:])
    state.rollback(2)
    assert state.pending(2)[0].shape == (0, 64)


def test_replay_start_and_slot_exhaustion() -> None:
    g = SWAGeometry.from_config(preset("tiny"), spare=1)
    pool = SWAPool(g, 1)
    state = pool.acquire("r", start_position=1000)  # replaying the last tokens of a long prompt
    for layer in g.layer_ids:
        state.write(layer, records(1000, 3, g.record_bytes))
    state.advance(3)
    assert state.window(0).shape[0] == 3
    assert not state.can_rollback(999)
    with pytest.raises(SWAPoolExhaustedError) as info:
        pool.acquire("s")
    assert info.value.request_id == "s"
    pool.release("r")
    assert pool.acquire("s").position == 0
