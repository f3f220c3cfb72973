"""Record writers and readers: quantize-and-pack vectors straight into paged cache slots, and back.

Three record formats (byte layouts in `cedserve.kernels.reference`, `pack_main_kv`,
`pack_index_key`, `pack_swa`):

=========  ==============================================  ===========  =====================
kind       elements / scales                               bytes @ D    writes
=========  ==============================================  ===========  =====================
``main``   E2M1 pairs, E4M3 scale per 16 channels          288 @ 512    compressed main KV
``index``  E2M1 pairs, UE8M0 scale per 32 channels         68 @ 128     indexer keys
``swa``    E4M3 bytes, UE8M0 scale per 32 channels         528 @ 512    sliding-window KV
=========  ==============================================  ===========  =====================

:func:`write_records` takes `x [T, D]` (bf16, fp16 or fp32; rows may be strided, channels
contiguous) and an int32/int64 `slot_mapping [T]` (-1 = skip the row) and writes record `i` at
slot `slot_mapping[i]` of a :class:`~cedserve.kernels.paged.PagedRecords`. The kernel's bytes
equal `pack_*` of the same rows bit for bit. :func:`read_records` decodes the records at `slots
[T]` to `[T, D]` (zeros where the slot is -1), equal to `unpack_*` bit for bit.

Three layers per op (STYLE): `_write_records_kernel` / `_read_records_kernel` in
`_records_kernels.py`; the launchers here (shape, dtype and stride checks); the torch references
:func:`write_records_reference` / :func:`read_records_reference` (the model's CPU path).

Differences between the layers, by design: the reference raises on NaN/inf input and on slots
outside `[-1, num_slots)`; the kernel checks neither on the device (no host sync): non-finite
rows give unspecified records and out-of-range slots are skipped. With duplicate slots the
written record is one of the rows, unspecified which.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch
from torch import Tensor

from cedserve.kernels import reference as ref
from cedserve.kernels.paged import PagedRecords
from cedserve.kernels.triton_support import (
    Impl,
    cdiv,
    check_tensor,
    hardware_fp8,
    interpreting,
    log2_if_power_of_2,
    next_power_of_2,
    pdl_launch,
    resolve_impl,
)

RecordKind = Literal["main", "index", "swa"]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SLOT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class RecordFormat:
    """Static description of one record kind."""

    kind: RecordKind
    format_id: int
    """The kernels' FORMAT constexpr (0 main, 1 index, 2 swa)."""
    scale_block: int
    """Channels per scale."""
    elem_bits: int
    """Bits per element: 4 (E2M1) or 8 (E4M3)."""

    def record_bytes(self, dim: int) -> int:
        """Bytes of one record of `dim` channels (`ValueError` unless `dim` is a positive multiple
        of `scale_block`)."""
        if dim <= 0 or dim % self.scale_block:
            raise ValueError(f"{self.kind} records: D must be a positive multiple of {self.scale_block}, got {dim}")
        return dim * self.elem_bits // 8 + dim // self.scale_block

    def dim(self, record_bytes: int) -> int:
        """Channels of a record of `record_bytes` bytes (inverse of :meth:`record_bytes`)."""
        per_block = self.scale_block * self.elem_bits // 8 + 1
        if record_bytes <= 0 or record_bytes % per_block:
            raise ValueError(f"{self.kind} records: {record_bytes} B is not a valid record size")
        return record_bytes // per_block * self.scale_block


FORMATS: dict[str, RecordFormat] = {
    "main": RecordFormat("main", 0, ref.MAIN_KV_BLOCK, 4),
    "index": RecordFormat("index", 1, ref.INDEX_KEY_BLOCK, 4),
    "swa": RecordFormat("swa", 2, ref.SWA_BLOCK, 8),
}


def record_format(kind: str) -> RecordFormat:
    """The :class:`RecordFormat` of `kind` ("main", "index" or "swa")."""
    try:
        return FORMATS[kind]
    except KeyError:
        raise ValueError(f"record kind must be one of {sorted(FORMATS)}, got {kind!r}") from None


# ---------------------------------------------------------------------------- references

_PACK = {"main": ref.pack_main_kv, "index": ref.pack_index_key, "swa": ref.pack_swa}
_UNPACK = {"main": ref.unpack_main_kv, "index": ref.unpack_index_key, "swa": ref.unpack_swa}


def write_records_reference(kind: RecordKind, x: Tensor, slot_mapping: Tensor, dest: PagedRecords) -> None:
    """Torch reference of :func:`write_records`: `pack_*` the rows, scatter them to their slots."""
    records = _PACK[kind](x)
    dest.scatter(slot_mapping, records)


def read_records_reference(kind: RecordKind, src: PagedRecords, slots: Tensor,
                           dtype: torch.dtype = torch.float32) -> Tensor:
    """Torch reference of :func:`read_records`: gather the records, `unpack_*` them, zero the
    rows whose slot is -1. Each distinct slot is unpacked once (the attention and index references
    list the same records for many tokens: a prefill chunk's rows share most of their slots)."""
    distinct, inverse = torch.unique(slots, return_inverse=True)
    if distinct.numel() < slots.numel():
        values = _UNPACK[kind](src.gather(distinct))[inverse]
    else:
        values = _UNPACK[kind](src.gather(slots))
    return values.masked_fill((slots < 0).unsqueeze(-1), 0.0).to(dtype)


# ---------------------------------------------------------------------------- launchers


def _check_slots(slots: Tensor, tokens: int, what: str) -> None:
    check_tensor(slots, what, dtypes=_SLOT_DTYPES, dim=1)
    if slots.shape[0] != tokens:
        raise ValueError(f"{what}: expected {tokens} slots, got {slots.shape[0]}")


def write_records(kind: RecordKind, x: Tensor, slot_mapping: Tensor, dest: PagedRecords, *,
                  block_t: int | None = None, num_warps: int | None = None, word_stores: bool | None = None,
                  version: int | None = None, tiles: int | None = None, num_stages: int | None = None,
                  rcp_nudge: int = 0, impl: Impl = "auto") -> None:
    """Quantize `x [T, D]` to `kind` records and store row `i` at slot `slot_mapping[i]` of
    `dest` (skipped where the slot is -1). See the module docstring for the contract. `block_t`
    (rows per program, a power of two), `num_warps` and `word_stores` (pack codes into 32-bit
    words, `_write_words_kernel`, or store bytes, `_write_records_kernel`) override the launch
    defaults (the benchmark sweeps them). `version=3` selects the v3 arithmetic for E2M1 records
    (correctly rounded quotient per element); 4 uses the cheaper `_e2m1_code_fast` for bf16 / fp16
    inputs (`kernels-notes.md`); both are bit-exact. Default (None): what the H200 runs measured
    fastest, 5 for the main KV (run 5: 72% of copy), 4 for SWA, and for the 128-wide index keys 13
    where it runs (bf16 / fp16 rows on sm_90: 76 %), else 3 (60 %).

    `version=5` (E2M1 formats; SWA runs as 4): `_write_words_v5_kernel`, v4's arithmetic with the
    main-KV 1 / scale from one approximate reciprocal, and `tiles` tiles of `block_t` rows per
    program with the next tile's rows loaded before the current tile is quantized (`num_stages`
    1 by default: the prefetch is by hand, the compiler's pipeliner would stage it through shared
    memory). `rcp_nudge` (interpreter tests only) moves the v5 reciprocal by that many float32
    ulps to show the rounding does not depend on it being correctly rounded.

    `version=13` (index keys of 128 channels from bf16 / fp16, sm_90 GPUs, 4-byte aligned records):
    `_gl_write_index_kernel` (Gluon, `_records_gluon.py`), v4's arithmetic trimmed to what finite
    bf16 / fp16 rows need, with 16 lanes per row so a record's words are stored by neighbouring
    lanes (`kernels-notes.md`, v12 and v13; v12, the same layout with v4's codec, was removed)."""
    if version is None:
        version = {"main": 5, "index": 13 if _v13_unsupported(kind, x, dest) is None else 3}.get(kind, 4)
    if version not in (3, 4, 5, 13):
        raise ValueError(f"write_records: version must be 3, 4, 5 or 13, got {version}")
    if tiles is not None and (tiles < 1 or version not in (5, 13)):
        raise ValueError(f"write_records: tiles must be >= 1 and needs version 5 or 13, got tiles={tiles} version={version}")
    fmt = record_format(kind)
    op = f"write_records({kind!r})"
    check_tensor(x, f"{op}: x", dtypes=_FLOAT_DTYPES, dim=2)
    _check_slots(slot_mapping, x.shape[0], f"{op}: slot_mapping")
    dim = x.shape[1]
    if fmt.record_bytes(dim) != dest.record_bytes:
        raise ValueError(f"{op}: D={dim} makes {fmt.record_bytes(dim)} B records, dest holds "
                         f"{dest.record_bytes} B records")
    if resolve_impl(impl, op, x, slot_mapping, dest.storage) == "torch":
        write_records_reference(kind, x, slot_mapping, dest)
        return
    if x.shape[0] == 0:
        return
    from cedserve.kernels import _records_kernels as k

    if version == 13:
        _launch_v13(kind, x, slot_mapping, dest, block_t=block_t, tiles=tiles, num_warps=num_warps)
        return
    nb = dim // fmt.scale_block
    fast = version >= 4 and fmt.elem_bits == 4 and x.dtype in (torch.bfloat16, torch.float16)
    if version == 5 and fmt.elem_bits == 4:
        return _launch_v5(k, fmt, x, slot_mapping, dest, nb, fast, block_t=block_t, tiles=tiles,
                          num_warps=num_warps, num_stages=num_stages, rcp_nudge=rcp_nudge)
    if word_stores is None:
        word_stores = fmt.elem_bits == 4  # measured: words for the E2M1 formats, bytes for SWA (kernels-notes.md)
    # rows per program: ~4K elements for 512-wide rows, ~8K for the 128-wide index keys (run 3)
    block_t = block_t or max(1, (8192 if dim <= 128 else 4096) // next_power_of_2(dim))
    grid = (cdiv(x.shape[0], block_t),)
    common = (x, x.stride(0), slot_mapping, dest.storage, x.shape[0], dest.num_slots, dest.offset_bytes,
              dest.slots_per_block, dest.slot_stride_bytes, dest.block_stride_bytes)
    if word_stores:
        cpw = 32 // fmt.elem_bits
        words = dest.alignment >= 4
        k._write_words_kernel[grid](
            *common, FORMAT=fmt.format_id, SCALE_BLOCK=fmt.scale_block, ELEM_BITS=fmt.elem_bits,
            NB=nb, NB_P2=next_power_of_2(nb), WPB=fmt.scale_block // cpw, CPW=cpw, CODE_BYTES=dim * fmt.elem_bits // 8,
            BLOCK_T=block_t, WORD_STORES=words, SCALE_WORDS=words and nb % 4 == 0 and nb == next_power_of_2(nb),
            HW_FP8=hardware_fp8(x.device), FAST_E2M1=fast, num_warps=num_warps or 4, **pdl_launch(x.device),
        )
        return
    k._write_records_kernel[grid](
        *common, FORMAT=fmt.format_id, SCALE_BLOCK=fmt.scale_block, ELEM_BITS=fmt.elem_bits,
        NB=nb, NB_P2=next_power_of_2(nb), CODE_BYTES=dim * fmt.elem_bits // 8, BLOCK_T=block_t,
        ALIGN=dest.alignment, HW_FP8=hardware_fp8(x.device), FAST_E2M1=fast, num_warps=num_warps or 4, **pdl_launch(x.device),
    )


def _v13_unsupported(kind: RecordKind, x: Tensor, dest: PagedRecords) -> str | None:
    """Why the Gluon index-key writer (v13) cannot take this call, or None (then it is the default:
    76 % of copy against v3's 60 % on the H200, run 20)."""
    if kind != "index" or x.ndim != 2 or x.shape[1] != 128:
        return f"it writes 128-channel index keys, got {kind!r} x {list(x.shape)[1:]}"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"it takes bf16 / fp16 rows (its E2M1 rounding needs <= 11 significant bits), got {x.dtype}"
    if x.device.type != "cuda" or interpreting() or torch.cuda.get_device_capability(x.device) != (9, 0):
        return "it needs an sm_90 GPU (Gluon; the interpreter cannot run it)"
    if dest.alignment < 4 or x.stride(1) != 1:
        return "records must be 4-byte aligned and rows contiguous"
    return None


def _launch_v13(kind: RecordKind, x: Tensor, slot_mapping: Tensor, dest: PagedRecords, *, block_t: int | None,
                tiles: int | None, num_warps: int | None) -> None:
    """`_gl_write_index_kernel` (Gluon, v13): refuses, with the reason, what it cannot take."""
    why = _v13_unsupported(kind, x, dest)
    if why is not None:
        raise ValueError(f"write_records: version 13 cannot run here: {why}")
    from cedserve.kernels import _records_gluon as g

    block_t = block_t or 32
    tiles = tiles or 4
    num_warps = num_warps or 4
    if block_t & (block_t - 1) or block_t < 2 * num_warps:
        raise ValueError(f"write_records: version 13 needs block_t a power of two >= {2 * num_warps}, got {block_t}")
    g._gl_write_index_kernel[(cdiv(x.shape[0], block_t * tiles),)](
        x, x.stride(0), slot_mapping, dest.storage, x.shape[0], dest.num_slots, dest.offset_bytes,
        dest.slots_per_block, dest.slot_stride_bytes, dest.block_stride_bytes,
        BLOCK_T=block_t, TILES=tiles, SPB_LOG2=log2_if_power_of_2(dest.slots_per_block), num_warps=num_warps,
    )


def _launch_v5(k: ModuleType, fmt: RecordFormat, x: Tensor, slot_mapping: Tensor, dest: PagedRecords, nb: int,
               fast: bool, *, block_t: int | None, tiles: int | None, num_warps: int | None, num_stages: int | None,
               rcp_nudge: int) -> None:
    """`_write_words_v5_kernel` (E2M1 formats). Defaults: the fastest v4 tile of run 4 (8 rows of
    512, 32 rows of 128) and 4 tiles per program (kernels-notes.md, v5)."""
    dim = x.shape[1]
    block_t = block_t or (32 if dim <= 128 else max(1, 4096 // next_power_of_2(dim)))
    tiles = tiles or 4
    cpw = 32 // fmt.elem_bits
    words = dest.alignment >= 4
    k._write_words_v5_kernel[(cdiv(x.shape[0], block_t * tiles),)](
        x, x.stride(0), slot_mapping, dest.storage, x.shape[0], dest.num_slots, dest.offset_bytes,
        dest.slots_per_block, dest.slot_stride_bytes, dest.block_stride_bytes,
        FORMAT=fmt.format_id, SCALE_BLOCK=fmt.scale_block, ELEM_BITS=fmt.elem_bits,
        NB=nb, NB_P2=next_power_of_2(nb), WPB=fmt.scale_block // cpw, CPW=cpw, CODE_BYTES=dim * fmt.elem_bits // 8,
        BLOCK_T=block_t, TILES=tiles, WORD_STORES=words,
        SCALE_WORDS=words and nb % 4 == 0 and nb == next_power_of_2(nb), HW_FP8=hardware_fp8(x.device),
        FAST_E2M1=fast, APPROX_RCP=fast, RCP_NUDGE=rcp_nudge, num_warps=num_warps or 4, num_stages=num_stages or 1, **pdl_launch(x.device),
    )


def write_main_kv(x: Tensor, slot_mapping: Tensor, dest: PagedRecords, *, impl: Impl = "auto") -> None:
    """Compressed main KV (post-RoPE) `x [T, D]` -> 288 B records (at D = 512)."""
    write_records("main", x, slot_mapping, dest, impl=impl)


def write_index_key(x: Tensor, slot_mapping: Tensor, dest: PagedRecords, *, impl: Impl = "auto") -> None:
    """Indexer keys (post-RoPE) `x [T, D]` -> 68 B records (at D = 128)."""
    write_records("index", x, slot_mapping, dest, impl=impl)


def write_swa(x: Tensor, slot_mapping: Tensor, dest: PagedRecords, *, impl: Impl = "auto") -> None:
    """Sliding-window KV (post-RoPE, whole head) `x [T, D]` -> 528 B records (at D = 512)."""
    write_records("swa", x, slot_mapping, dest, impl=impl)


def read_records(kind: RecordKind, src: PagedRecords, slots: Tensor, *, dtype: torch.dtype | None = None,
                 out: Tensor | None = None, impl: Impl = "auto") -> Tensor:
    """Decode the `kind` records at `slots [T]` to `[T, D]`, rows whose slot is -1 zeroed. The
    dtype is `out.dtype` when `out` is given (`[T, D]`, contiguous rows), else `dtype` (default
    float32); bf16 holds every decoded value exactly."""
    fmt = record_format(kind)
    op = f"read_records({kind!r})"
    check_tensor(slots, f"{op}: slots", dtypes=_SLOT_DTYPES, dim=1)
    dim = fmt.dim(src.record_bytes)
    if out is None:
        out = torch.empty(slots.shape[0], dim, dtype=dtype or torch.float32, device=src.device)
    check_tensor(out, f"{op}: out", dtypes=(torch.float32, torch.bfloat16, torch.float16), dim=2)
    if tuple(out.shape) != (slots.shape[0], dim) or (dtype is not None and out.dtype != dtype):
        raise ValueError(f"{op}: out must be {[slots.shape[0], dim]} {dtype or ''}, got {out.dtype} {list(out.shape)}")
    if resolve_impl(impl, op, slots, src.storage, out) == "torch":
        out.copy_(read_records_reference(kind, src, slots, out.dtype))
        return out
    if slots.shape[0] == 0:
        return out
    from cedserve.kernels import _records_kernels as k

    block_t = max(1, 4096 // next_power_of_2(dim))
    grid = (cdiv(slots.shape[0], block_t),)
    k._read_records_kernel[grid](
        src.storage, slots, out, out.stride(0),
        slots.shape[0], src.num_slots, src.offset_bytes, src.slots_per_block, src.slot_stride_bytes,
        src.block_stride_bytes,
        FORMAT=fmt.format_id, D=dim, D_P2=next_power_of_2(dim), SCALE_BLOCK=fmt.scale_block,
        ELEM_BITS=fmt.elem_bits, CODE_BYTES=dim * fmt.elem_bits // 8, BLOCK_T=block_t, num_warps=4, **pdl_launch(out.device),
    )
    return out


__all__ = [
    "FORMATS",
    "RecordFormat",
    "RecordKind",
    "read_records",
    "read_records_reference",
    "record_format",
    "write_index_key",
    "write_main_kv",
    "write_records",
    "write_records_reference",
    "write_swa",
]
