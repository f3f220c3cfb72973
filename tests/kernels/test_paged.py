"""Slot addressing shared by every kernel (`cedserve.kernels.paged`)."""

from __future__ import annotations

import pytest
import torch

from cedserve.kernels.paged import PagedRecords, entries_to_slots
from cedserve.kernels.triton_support import log2_if_power_of_2

pytestmark = pytest.mark.kernels


def test_region_addresses_match_the_block_layout() -> None:
    pool = torch.zeros(5, 1000, dtype=torch.uint8)
    region = PagedRecords.region(pool, region_offset=96, entries=3, record_bytes=288)
    assert region.num_slots == 15 and region.num_blocks == 5
    offsets = region.byte_offsets(torch.tensor([0, 2, 3, 14, -1]))
    assert offsets.tolist() == [96, 96 + 576, 1000 + 96, 4 * 1000 + 96 + 576, -1]
    assert region.alignment == (8 if pool.data_ptr() % 8 == 0 else region.alignment)  # 1000 B blocks


def test_flat_view_with_wide_rows() -> None:
    storage = torch.arange(200, dtype=torch.int32).to(torch.uint8).view(10, 20)
    view = PagedRecords.flat(storage[2:, 5:12], record_bytes=7)  # row stride 20, first byte 45
    assert view.num_slots == 8 and view.slot_stride_bytes == 20
    assert view.gather(torch.tensor([0, 7])).tolist() == [list(range(45, 52)), list(range(185, 192))]
    view.scatter(torch.tensor([1, -1]), torch.full((2, 7), 255, dtype=torch.uint8))
    assert storage[3, 5:12].tolist() == [255] * 7 and storage[3, 12] == 72


def test_bad_slots_and_layouts_raise() -> None:
    region = PagedRecords.region(torch.zeros(2, 100, dtype=torch.uint8), 0, 4, 20)
    with pytest.raises(IndexError):
        region.byte_offsets(torch.tensor([8]))
    with pytest.raises(IndexError):
        region.byte_offsets(torch.tensor([-2]))
    with pytest.raises(ValueError, match="do not fit"):
        PagedRecords.region(torch.zeros(2, 100, dtype=torch.uint8), 30, 4, 20)
    with pytest.raises(ValueError, match="overlap"):
        PagedRecords(torch.zeros(100, dtype=torch.uint8), 20, slots_per_block=4, slot_stride_bytes=20,
                     block_stride_bytes=50)
    with pytest.raises(ValueError, match="uint8"):
        PagedRecords.flat(torch.zeros(4, 8, dtype=torch.int8), 8)


def test_entries_to_slots() -> None:
    table = torch.tensor([[7, 2, 5], [1, 0, -1]])
    entries = torch.tensor([[0, 5, 6, -1], [3, 4, 0, 2]])
    slots = entries_to_slots(entries, table, slots_per_block=4)
    assert slots.tolist() == [[28, 9, 10, -1], [7, 0, 4, 6]]


def test_log2_if_power_of_2() -> None:
    # the Gluon kernels shift slot -> block when blocks hold a power of two of records, else divide
    assert [log2_if_power_of_2(n) for n in (1, 2, 32, 64, 1 << 20)] == [0, 1, 5, 6, 20]
    assert [log2_if_power_of_2(n) for n in (0, 3, 6, 24, 96, -4)] == [-1] * 6
