"""How cached KV values are held: the record formats, or unquantized bf16 for measuring what they cost.

`KVFormat.RECORDS` is the serving format (`kernels/reference.py`): window KV as FP8 records (UE8M0
scale per 32 channels), compressed main KV as FP4 records (E4M3 scale per 16), index keys as FP4
records (UE8M0 per 32). `KVFormat.BF16` keeps the same values rounded to bf16 instead; it exists to
measure the records' effect on quality (`benchmarks/demo_eval.py`) and is never stored in paged
blocks or shipped (those layouts hold records only).

Two views of each format:

* bytes (`encode_*` / `decode_*`): what a `SequenceState` stores, uint8 rows, so snapshots, windows
  and concatenation work alike for both formats. bf16 rows are the values' bf16 bit patterns
  (`[n, 2 * D]` bytes).
* values (`*_values`): the round trip `decode(encode(x))` computed directly, as float32, for the
  full-sequence training forward. Under autograd the round trip is straight-through: the forward
  value is exactly the round trip (bit for bit the record codec's), the gradient passes unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from cedserve.kernels.reference import (
    INDEX_KEY_BLOCK,
    MAIN_KV_BLOCK,
    SWA_BLOCK,
    fake_quant_fp4,
    fake_quant_fp8,
    index_key_record_bytes,
    main_kv_record_bytes,
    pack_index_key,
    pack_main_kv,
    pack_swa,
    swa_record_bytes,
    unpack_index_key,
    unpack_main_kv,
    unpack_swa,
)


class KVFormat(str, Enum):
    """Format of every cached KV value of a sequence."""

    RECORDS = "records"
    """FP8 window records, FP4 main-KV and index-key records: what serving stores and ships."""
    BF16 = "bf16"
    """Unquantized values rounded to bf16 (evaluation only; never stored in blocks)."""


# ------------------------------------------------------------------ bytes (SequenceState)


def _bf16_bytes(x: Tensor) -> Tensor:
    return x.to(torch.bfloat16).contiguous().view(torch.uint8)


def _bf16_values(rows: Tensor) -> Tensor:
    return rows.contiguous().view(torch.bfloat16).float()


def window_row_bytes(fmt: KVFormat, dim: int) -> int:
    """Bytes of one window row of `dim` channels."""
    return swa_record_bytes(dim) if fmt is KVFormat.RECORDS else 2 * dim


def main_row_bytes(fmt: KVFormat, dim: int) -> int:
    """Bytes of one compressed main-KV row."""
    return main_kv_record_bytes(dim) if fmt is KVFormat.RECORDS else 2 * dim


def index_key_row_bytes(fmt: KVFormat, dim: int) -> int:
    """Bytes of one index-key row."""
    return index_key_record_bytes(dim) if fmt is KVFormat.RECORDS else 2 * dim


def encode_window(x: Tensor, fmt: KVFormat, finite: list[Tensor] | None = None) -> Tensor:
    """Window KV `[n, D]` -> uint8 rows. Records refuse NaN/inf input (`ValueError`) at once or, given
    a `finite` list, append a device flag `isfinite(x).all()` to it for the caller to check once for
    a whole pass (`check_finite`)."""
    if fmt is not KVFormat.RECORDS:
        return _bf16_bytes(x)
    if finite is not None:
        finite.append(torch.isfinite(x).all())
    return pack_swa(x, check_finite=finite is None)


def check_finite(finite: list[Tensor], what: str) -> None:
    """Raise `ValueError` if any flag the `encode_*` calls left in `finite` is false: one host read
    for all of them (a pass's records), instead of one per call."""
    if finite and not bool(torch.stack(finite).all()):
        raise ValueError(f"{what}: a record's input contains NaN or inf")
    finite.clear()


def decode_window(rows: Tensor, fmt: KVFormat) -> Tensor:
    """uint8 window rows -> float32 `[n, D]`."""
    values: Tensor = unpack_swa(rows) if fmt is KVFormat.RECORDS else _bf16_values(rows)
    return values


def encode_main(x: Tensor, fmt: KVFormat, finite: list[Tensor] | None = None) -> Tensor:
    """Post-RoPE compressed main KV `[G, D]` -> uint8 rows (NaN/inf and `finite`: as `encode_window`)."""
    if fmt is not KVFormat.RECORDS:
        return _bf16_bytes(x)
    if finite is not None:
        finite.append(torch.isfinite(x).all())
    return pack_main_kv(x, check_finite=finite is None)


def decode_main(rows: Tensor, fmt: KVFormat) -> Tensor:
    values: Tensor = unpack_main_kv(rows) if fmt is KVFormat.RECORDS else _bf16_values(rows)
    return values


def encode_index_key(x: Tensor, fmt: KVFormat, finite: list[Tensor] | None = None) -> Tensor:
    """Post-RoPE index keys `[G, d]` -> uint8 rows (NaN/inf and `finite`: as `encode_window`)."""
    if fmt is not KVFormat.RECORDS:
        return _bf16_bytes(x)
    if finite is not None:
        finite.append(torch.isfinite(x).all())
    return pack_index_key(x, check_finite=finite is None)


def decode_index_key(rows: Tensor, fmt: KVFormat) -> Tensor:
    values: Tensor = unpack_index_key(rows) if fmt is KVFormat.RECORDS else _bf16_values(rows)
    return values


# ------------------------------------------------------------------ values (training forward)


class _StraightThrough(torch.autograd.Function):
    """Forward: the given rounded value; backward: the gradient to `x` unchanged."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, rounded: Tensor) -> Tensor:
        return rounded

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def straight_through(x: Tensor, round_trip: Callable[[Tensor], Tensor]) -> Tensor:
    """`round_trip(x)` as the value; under autograd, the gradient of the identity."""
    rounded = round_trip(x.detach())
    if torch.is_grad_enabled() and x.requires_grad:
        out: Tensor = _StraightThrough.apply(x, rounded)  # type: ignore[no-untyped-call]
        return out
    return rounded


def _round_bf16(x: Tensor) -> Tensor:
    return x.float().to(torch.bfloat16).float()


def window_values(x: Tensor, fmt: KVFormat) -> Tensor:
    """float32 `decode_window(encode_window(x))` for `x [..., D]`, straight-through."""
    if fmt is KVFormat.RECORDS:
        return straight_through(x, lambda v: fake_quant_fp8(v.float(), SWA_BLOCK))
    return straight_through(x, _round_bf16)


def main_values(x: Tensor, fmt: KVFormat) -> Tensor:
    """float32 `decode_main(encode_main(x))`, straight-through."""
    if fmt is KVFormat.RECORDS:
        return straight_through(x, lambda v: fake_quant_fp4(v.float(), MAIN_KV_BLOCK, "e4m3"))
    return straight_through(x, _round_bf16)


def index_key_values(x: Tensor, fmt: KVFormat) -> Tensor:
    """float32 `decode_index_key(encode_index_key(x))`, straight-through."""
    if fmt is KVFormat.RECORDS:
        return straight_through(x, lambda v: fake_quant_fp4(v.float(), INDEX_KEY_BLOCK, "ue8m0"))
    return straight_through(x, _round_bf16)
