"""Torch reference quantizers and cache-record codecs (CPU or GPU, vectorised).

This module is the executable specification of every quantized value the serving
system stores. It reproduces, bit for bit, the fake-quant functions of the public
DeepSeek-V4.1 reference model (``_fake_quant_fp8_block`` / ``_fake_quant_fp4_block``
of ``transformers``' ``modeling_deepseek_v41.py``) and defines the byte layout of the
three cache records built on them (their byte sizes, which need no torch, are in
``record_sizes.py``). It imports nothing else from the rest of the project.

Where the reference quantizes (all on cached values only):

=====================================  =========================  ===========================
tensor                                 fake-quant                  record
=====================================  =========================  ===========================
window (SWA) KV, whole head_dim        ``fake_quant_fp8(x, 32)``   ``pack_swa``  (528 B @ 512)
compressed main KV, after RoPE         ``fake_quant_fp4(x, 16,     ``pack_main_kv`` (288 B @ 512)
                                       "e4m3")``
indexer keys (and queries), after RoPE ``fake_quant_fp4(x, 32,     ``pack_index_key`` (68 B @ 128)
                                       "ue8m0")``
=====================================  =========================  ===========================

Common semantics (all arithmetic in float32, whatever the input dtype):

* The input is upcast with ``x.float()`` and split into blocks of ``block_size``
  consecutive elements of the last dimension. ``amax`` is the block's largest
  absolute value.
* If the last dimension is not a multiple of ``block_size`` the fake-quant functions
  return ``x`` itself, unquantized (the reference does this for shapes it cannot
  block). The ``pack_*`` functions refuse such shapes instead.
* The quantized value is ``clamp(x / scale, -MAX, MAX)`` (a true division, never a
  multiplication by a reciprocal), cast to the element format with
  round-to-nearest-even; the dequantized value is ``element * scale`` in float32
  (always exact), cast back to the input dtype.
* FP8 (SWA): ``amax`` is floored at ``1e-4``; the scale is the UE8M0 power of two
  ``2**ceil(log2(fl32(amax * fl32(1/448))))``; elements are E4M3 (max 448).
* FP4 with UE8M0 scales (index keys): ``amax`` is floored at ``6 * 2**-126``; the
  scale is ``2**ceil(log2(fl32(amax * fl32(1/6))))`` (never below ``2**-126``);
  elements are E2M1 (max 6).
* FP4 with E4M3 scales (main KV): ``amax`` is floored at ``6 * 2**-9`` so that the
  scale ``e4m3(amax / 6)`` is at least ``2**-9``, the smallest E4M3 subnormal, and
  never zero. The scale is *rounded to nearest* (not up), so ``x / scale`` can exceed
  6 by up to ~6 % and the clamp to ±6 is part of the semantics. ``amax / 6`` above 448
  saturates to 448 (scale byte ``0x7E``), whatever the torch version. The reference
  itself depends on the version there: torch 2.13's float8 cast saturates the same
  way, but torch 2.11's (CPU and CUDA) returns NaN for ``amax / 6 > 464``, i.e. a block
  with ``amax > 2784`` would come out all NaN. Those are the only inputs on which this
  module and the reference can differ.
* ``ceil(log2(t))`` is taken from the float32 bit pattern: biased exponent minus 127,
  plus one if any mantissa bit is set (inputs are always normal floats thanks to the
  floors).
* E2M1 rounding is round-to-nearest-even on the grid ``{0, .5, 1, 1.5, 2, 3, 4, 6}``:
  the midpoints 0.25, 1.25, 2.5 and 5 round down (towards the even code), 0.75,
  1.75 and 3.5 round up.
* E2M1 sign: the code carries the sign bit of ``x / scale`` (``signbit``), so a
  negative value (or ``-0.0``) that rounds to zero is the code ``0x8`` ("negative
  zero"). Like the reference, decoding maps ``0x8`` to ``+0.0``: FP4 outputs never
  contain ``-0.0``. FP8 (E4M3) keeps ``-0.0`` (byte ``0x80``) and decodes it to
  ``-0.0``.

Non-finite inputs: the fake-quant functions do no checking and reproduce what the
reference does (a NaN or ±inf turns its whole block to NaN, except with E4M3 scales,
where an inf saturates the scale at 448 and a NaN gives NaN); ``pack_*`` raise ``ValueError`` if any element is NaN or
±inf *after* the float32 upcast (so float64 values beyond float32 range are rejected).

Contract (tested in ``tests/kernels/test_records.py``): for every finite ``x``,

* ``unpack_main_kv(pack_main_kv(x))   == fake_quant_fp4(x.float(), 16, "e4m3")``
* ``unpack_index_key(pack_index_key(x)) == fake_quant_fp4(x.float(), 32, "ue8m0")``
* ``unpack_swa(pack_swa(x))           == fake_quant_fp8(x.float(), 32)``

bit for bit (float32 bit patterns, signed zeros included). For bfloat16 ``x`` the
right-hand sides also equal ``fake_quant_*(x).float()``, since every dequantized value
is exactly representable in bfloat16.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cedserve.kernels.record_sizes import (
    INDEX_KEY_BLOCK,
    MAIN_KV_BLOCK,
    SWA_BLOCK,
    check_record_dim,
    index_key_record_bytes,
    main_kv_record_bytes,
    swa_record_bytes,
)

__all__ = [
    "E2M1_GRID",
    "E2M1_MAX",
    "E4M3_MAX",
    "FP4_E4M3_AMAX_FLOOR",
    "FP4_UE8M0_AMAX_FLOOR",
    "FP8_AMAX_FLOOR",
    "INDEX_KEY_BLOCK",
    "MAIN_KV_BLOCK",
    "SWA_BLOCK",
    "e2m1_decode",
    "e2m1_encode",
    "fake_quant_fp4",
    "fake_quant_fp8",
    "index_key_record_bytes",
    "main_kv_record_bytes",
    "pack_index_key",
    "pack_main_kv",
    "pack_swa",
    "swa_record_bytes",
    "ue8m0_decode",
    "unpack_index_key",
    "unpack_main_kv",
    "unpack_swa",
]

E2M1_MAX = 6.0
"""Largest E2M1 magnitude."""
E4M3_MAX = 448.0
"""Largest finite E4M3 (float8_e4m3fn) magnitude."""
E2M1_GRID: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1 magnitudes indexed by the 3 low bits of a code (bit 3 is the sign)."""

FP8_AMAX_FLOOR = 1e-4
"""Block amax floor of the FP8/UE8M0 quantizer (SWA)."""
FP4_UE8M0_AMAX_FLOOR = 6.0 * 2.0**-126
"""Block amax floor of the FP4/UE8M0 quantizer (index keys): scale >= 2**-126."""
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9
"""Block amax floor of the FP4/E4M3 quantizer (main KV): scale >= 2**-9."""

_UE8M0_BIAS = 127
_SCALE_FORMATS = ("e4m3", "ue8m0")


# --------------------------------------------------------------------------- helpers


def _check_block_size(block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")


def _to_blocks(x: Tensor, block_size: int) -> Tensor:
    """float32 view ``[..., D // block_size, block_size]`` of ``x[..., D]``."""
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)


def _ceil_log2(t: Tensor) -> Tensor:
    """``ceil(log2(t))`` as int32 for positive normal float32 ``t``, read off the bit
    pattern (biased exponent - 127, +1 when the mantissa is non-zero)."""
    bits = t.contiguous().view(torch.int32)
    biased_exponent = torch.bitwise_and(torch.bitwise_right_shift(bits, 23), 0xFF)
    inexact = torch.bitwise_and(bits, 0x7FFFFF).ne(0).to(torch.int32)
    return biased_exponent - _UE8M0_BIAS + inexact


def ue8m0_decode(scale_bytes: Tensor) -> Tensor:
    """Decode UE8M0 scale bytes (uint8, any shape) to float32 ``2**(b - 127)``.

    Built from the float32 bit pattern, hence exact. ``b == 0`` gives ``2**-127`` (a
    float32 subnormal) and ``b == 255`` is NaN (the OCP MX convention); the ``pack_*``
    functions only ever write bytes in ``[1, 254]``.
    """
    if scale_bytes.dtype != torch.uint8:
        raise TypeError(f"UE8M0 scales must be uint8, got {scale_bytes.dtype}")
    b = scale_bytes.to(torch.int32)
    value = torch.bitwise_left_shift(b, 23).view(torch.float32)
    value = torch.where(b == 0, torch.full_like(value, 2.0**-127), value)
    return torch.where(b == 255, torch.full_like(value, float("nan")), value)


def _ue8m0_from_exponent(k: Tensor) -> tuple[Tensor, Tensor]:
    """(float32 ``2**k``, uint8 byte ``k + 127``) for int32 ``k`` in ``[-126, 127]``.

    Larger ``k`` (only from a non-finite block amax) gives ``inf`` and byte 255, the
    scale the reference's ``exp2`` produces there.
    """
    biased = (k + _UE8M0_BIAS).clamp(0, 255)
    return torch.bitwise_left_shift(biased, 23).view(torch.float32), biased.to(torch.uint8)


def e2m1_encode(q: Tensor) -> Tensor:
    """Round float32 values already clamped to ``[-6, 6]`` to E2M1 codes (uint8).

    Code layout: bit 3 = sign (``signbit`` of ``q``, so ``-0.0`` and small negatives
    give ``0x8``), bits 0-2 = index into :data:`E2M1_GRID`. Rounding is to nearest
    with ties to the even code. Works by splitting the grid into three uniform
    stretches (step 0.5 below 2, step 1 in ``[2, 4)``, step 2 from 4) and rounding
    ``|q| / step`` half-to-even; scaling by a power of two is exact, and the even
    multiple of each step is the even code.
    """
    magnitude = torch.nan_to_num(q.abs(), nan=0.0)  # NaN -> code 0 (| sign), as the reference
    at_least_4 = magnitude >= 4.0
    at_least_2 = magnitude >= 2.0
    # code = round(|q| / step) + offset with (step, offset) = (0.5, 0), (1, 2), (2, 4)
    inv_step = torch.where(
        at_least_4,
        torch.full_like(magnitude, 0.5),
        torch.where(at_least_2, torch.ones_like(magnitude), torch.full_like(magnitude, 2.0)),
    )
    offset = at_least_4.to(torch.uint8) * 2 + at_least_2.to(torch.uint8) * 2
    code = torch.round(magnitude * inv_step).to(torch.uint8) + offset
    return torch.bitwise_or(code, torch.bitwise_left_shift(torch.signbit(q).to(torch.uint8), 3))


def e2m1_decode(codes: Tensor) -> Tensor:
    """Decode E2M1 codes (uint8, low 4 bits used) to float32; ``0x8`` decodes to
    ``+0.0`` exactly as the reference's value table does."""
    # computed, not looked up in a table built from host values: a captured CUDA graph cannot copy one
    magnitude_code = torch.bitwise_and(codes, 0x7).to(torch.int32)
    exponent, mantissa = magnitude_code >> 1, (magnitude_code & 1).float()
    scaled = (1.0 + 0.5 * mantissa) * torch.exp2((exponent - 1).float())
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, scaled)
    negative = torch.bitwise_and(codes, 0x8) != 0
    return torch.where(negative, -magnitude, magnitude) + 0.0  # -0.0 + 0.0 = +0.0, as the reference's table


def _fp8_quantize(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """FP8/UE8M0 quantization of float32 ``[..., nb, bs]`` blocks.

    Returns (E4M3 elements as float8_e4m3fn ``[..., nb, bs]``, float32 scales
    ``[..., nb]``, UE8M0 scale bytes ``[..., nb]``).
    """
    amax = blocks.abs().amax(dim=-1).clamp_min(FP8_AMAX_FLOOR)
    scale, scale_bytes = _ue8m0_from_exponent(_ceil_log2(amax * (1.0 / E4M3_MAX)))
    elements = (blocks / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return elements, scale, scale_bytes


def _fp4_quantize(blocks: Tensor, scale_format: str) -> tuple[Tensor, Tensor, Tensor]:
    """FP4 quantization of float32 ``[..., nb, bs]`` blocks.

    Returns (E2M1 codes uint8 ``[..., nb, bs]``, float32 scales ``[..., nb]``, scale
    bytes uint8 ``[..., nb]``: E4M3 bit patterns or UE8M0 biased exponents).
    """
    amax = blocks.abs().amax(dim=-1)
    if scale_format == "e4m3":
        # Division (not reciprocal multiply) then RNE cast; the explicit clamp makes the
        # overflow behaviour (saturate at 448) independent of the torch version.
        scale_fp8 = (amax.clamp_min(FP4_E4M3_AMAX_FLOOR) / E2M1_MAX).clamp_max(E4M3_MAX)
        scale_fp8 = scale_fp8.to(torch.float8_e4m3fn)
        scale = scale_fp8.float()
        scale_bytes = scale_fp8.view(torch.uint8)
    elif scale_format == "ue8m0":
        k = _ceil_log2(amax.clamp_min(FP4_UE8M0_AMAX_FLOOR) * (1.0 / E2M1_MAX))
        scale, scale_bytes = _ue8m0_from_exponent(k)
    else:
        raise ValueError(f"scale_format must be one of {_SCALE_FORMATS}, got {scale_format!r}")
    codes = e2m1_encode((blocks / scale.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX))
    return codes, scale, scale_bytes


# ----------------------------------------------------------------------- fake quant


def fake_quant_fp8(x: Tensor, block_size: int = 32) -> Tensor:
    """Quantize-dequantize ``x[..., D]`` to E4M3 with one UE8M0 scale per ``block_size``
    channels of the last dim (the reference's window-KV quantizer).

    Returns a new tensor of ``x``'s shape and dtype (or ``x`` itself, unquantized,
    when ``D % block_size != 0``, as the reference does). Bit-identical to the
    reference's ``_fake_quant_fp8_block(x, block_size)``.
    """
    _check_block_size(block_size)
    if x.shape[-1] % block_size:
        return x
    elements, scale, _ = _fp8_quantize(_to_blocks(x, block_size))
    return (elements.float() * scale.unsqueeze(-1)).reshape(x.shape).to(x.dtype)


def fake_quant_fp4(x: Tensor, block_size: int, scale_format: str) -> Tensor:
    """Quantize-dequantize ``x[..., D]`` to E2M1 with one scale per ``block_size``
    channels of the last dim.

    ``scale_format`` is ``"e4m3"`` (main KV: block 16) or ``"ue8m0"`` (indexer keys
    and queries: block 32). Returns a new tensor of ``x``'s shape and dtype (or ``x``
    itself, unquantized, when ``D % block_size != 0``). Bit-identical to the
    reference's ``_fake_quant_fp4_block(x, block_size, e4m3_scales=scale_format ==
    "e4m3")``.
    """
    _check_block_size(block_size)
    if scale_format not in _SCALE_FORMATS:
        raise ValueError(f"scale_format must be one of {_SCALE_FORMATS}, got {scale_format!r}")
    if x.shape[-1] % block_size:
        return x
    codes, scale, _ = _fp4_quantize(_to_blocks(x, block_size), scale_format)
    return (e2m1_decode(codes) * scale.unsqueeze(-1)).reshape(x.shape).to(x.dtype)


# -------------------------------------------------------------------------- records


def _pack_blocks(x: Tensor, block_size: int, what: str, check_finite: bool = True) -> Tensor:
    """Validate a pack input and return its finite float32 blocks (`check_finite=False`: the caller
    checks finiteness itself; the check reads a device value, a host sync on a GPU)."""
    if not x.is_floating_point():
        raise TypeError(f"{what}: expected a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{what}: expected at least one dimension")
    check_record_dim(x.shape[-1], block_size, what)
    blocks = _to_blocks(x, block_size)
    if check_finite and not bool(torch.isfinite(blocks).all()):
        raise ValueError(f"{what}: input contains NaN or inf (after the float32 upcast)")
    return blocks


def _record_dim(rec: Tensor, bytes_of: int, channels_of: int, block_size: int, what: str) -> int:
    """D of a record whose size is ``D * bytes_of / channels_of``; validates dtype/size."""
    if rec.dtype != torch.uint8:
        raise TypeError(f"{what}: records must be uint8, got {rec.dtype}")
    if rec.dim() == 0:
        raise ValueError(f"{what}: expected at least one dimension")
    size = rec.shape[-1]
    dim = size * channels_of // bytes_of
    if size * channels_of % bytes_of or dim <= 0 or dim % block_size:
        raise ValueError(f"{what}: {size} is not a valid record size")
    return dim


def _pack_nibbles(codes: Tensor) -> Tensor:
    """uint8 codes ``[..., D]`` -> bytes ``[..., D // 2]``; element ``2i`` in the low
    nibble of byte ``i``, element ``2i + 1`` in its high nibble."""
    return torch.bitwise_or(codes[..., 0::2], torch.bitwise_left_shift(codes[..., 1::2], 4))


def _unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of :func:`_pack_nibbles`: bytes ``[..., n]`` -> codes ``[..., 2n]``."""
    low = torch.bitwise_and(packed, 0xF)
    high = torch.bitwise_right_shift(packed, 4)
    return torch.stack([low, high], dim=-1).flatten(-2)


def pack_main_kv(x: Tensor, check_finite: bool = True) -> Tensor:
    """Pack compressed main-KV vectors ``x[..., D]`` (float, finite, post-RoPE) into
    records ``uint8[..., D // 2 + D // 16]`` (288 B for D = 512).

    Quantization is :func:`fake_quant_fp4` with ``block_size=16, scale_format="e4m3"``.
    Byte layout of one record (D must be a multiple of 16):

    * bytes ``[0, D/2)``: E2M1 codes, two per byte; byte ``i`` holds channel ``2i`` in
      bits 0-3 and channel ``2i + 1`` in bits 4-7. A code is ``sign << 3 | index``
      with ``index`` into :data:`E2M1_GRID` (``0x8`` = negative zero).
    * bytes ``[D/2, D/2 + D/16)``: one E4M3 (float8_e4m3fn bit pattern) scale per 16
      channels, block ``j`` covering channels ``[16j, 16j + 16)``; always positive,
      at least ``2**-9`` (byte ``0x01``), at most 448 (byte ``0x7E``).

    Channel ``c`` decodes to ``e2m1(code_c) * e4m3(scale_{c // 16})`` in float32.
    Raises ``ValueError`` on NaN/inf (unless ``check_finite`` is False: then such rows give
    unspecified records) or a bad D, ``TypeError`` on a non-float input.
    """
    blocks = _pack_blocks(x, MAIN_KV_BLOCK, "pack_main_kv", check_finite)
    codes, _, scale_bytes = _fp4_quantize(blocks, "e4m3")
    return torch.cat([_pack_nibbles(codes.flatten(-2)), scale_bytes], dim=-1)


def unpack_main_kv(rec: Tensor) -> Tensor:
    """Decode main-KV records ``uint8[..., D // 2 + D // 16]`` (layout in
    :func:`pack_main_kv`) to ``float32[..., D]``. Equals
    ``fake_quant_fp4(x.float(), 16, "e4m3")`` bit for bit for ``rec = pack_main_kv(x)``.
    """
    dim = _record_dim(rec, 9, 16, MAIN_KV_BLOCK, "unpack_main_kv")
    half = dim // 2
    codes = _unpack_nibbles(rec[..., :half])
    scale = rec[..., half:].contiguous().view(torch.float8_e4m3fn).float()
    values = e2m1_decode(codes).reshape(*rec.shape[:-1], dim // MAIN_KV_BLOCK, MAIN_KV_BLOCK)
    return (values * scale.unsqueeze(-1)).reshape(*rec.shape[:-1], dim)


def pack_index_key(x: Tensor, check_finite: bool = True) -> Tensor:
    """Pack indexer keys ``x[..., D]`` (float, finite, post-RoPE) into records
    ``uint8[..., D // 2 + D // 32]`` (68 B for D = 128).

    Quantization is :func:`fake_quant_fp4` with ``block_size=32, scale_format="ue8m0"``.
    Byte layout of one record (D must be a multiple of 32):

    * bytes ``[0, D/2)``: E2M1 codes, two per byte, exactly as in :func:`pack_main_kv`
      (channel ``2i`` in the low nibble of byte ``i``, ``2i + 1`` in the high nibble).
    * bytes ``[D/2, D/2 + D/32)``: one UE8M0 scale per 32 channels: the biased
      exponent ``b`` of the power-of-two scale ``2**(b - 127)``, ``b`` in ``[1, 254]``.

    Channel ``c`` decodes to ``e2m1(code_c) * 2**(b_{c // 32} - 127)`` in float32.
    Raises ``ValueError`` on NaN/inf (unless ``check_finite`` is False: then such rows give
    unspecified records) or a bad D, ``TypeError`` on a non-float input.
    """
    blocks = _pack_blocks(x, INDEX_KEY_BLOCK, "pack_index_key", check_finite)
    codes, _, scale_bytes = _fp4_quantize(blocks, "ue8m0")
    return torch.cat([_pack_nibbles(codes.flatten(-2)), scale_bytes], dim=-1)


def unpack_index_key(rec: Tensor) -> Tensor:
    """Decode index-key records ``uint8[..., D // 2 + D // 32]`` (layout in
    :func:`pack_index_key`) to ``float32[..., D]``. Equals
    ``fake_quant_fp4(x.float(), 32, "ue8m0")`` bit for bit for
    ``rec = pack_index_key(x)``.
    """
    dim = _record_dim(rec, 17, 32, INDEX_KEY_BLOCK, "unpack_index_key")
    half = dim // 2
    codes = _unpack_nibbles(rec[..., :half])
    scale = ue8m0_decode(rec[..., half:])
    values = e2m1_decode(codes).reshape(*rec.shape[:-1], dim // INDEX_KEY_BLOCK, INDEX_KEY_BLOCK)
    return (values * scale.unsqueeze(-1)).reshape(*rec.shape[:-1], dim)


def pack_swa(x: Tensor, check_finite: bool = True) -> Tensor:
    """Pack sliding-window KV vectors ``x[..., D]`` (float, finite, whole head_dim
    post-RoPE) into records ``uint8[..., D + D // 32]`` (528 B for D = 512).

    Quantization is :func:`fake_quant_fp8` with ``block_size=32``. Byte layout of one
    record (D must be a multiple of 32):

    * bytes ``[0, D)``: one E4M3 (float8_e4m3fn bit pattern) per channel, in channel
      order; ``0x80`` is ``-0.0``, ``0x7F``/``0xFF`` (NaN) never occur.
    * bytes ``[D, D + D/32)``: one UE8M0 scale per 32 channels, biased exponent ``b``
      of ``2**(b - 127)``; with the ``1e-4`` amax floor ``b >= 105``.

    Channel ``c`` decodes to ``e4m3(byte_c) * 2**(b_{c // 32} - 127)`` in float32.
    Raises ``ValueError`` on NaN/inf (unless ``check_finite`` is False: then such rows give
    unspecified records) or a bad D, ``TypeError`` on a non-float input.
    """
    blocks = _pack_blocks(x, SWA_BLOCK, "pack_swa", check_finite)
    elements, _, scale_bytes = _fp8_quantize(blocks)
    return torch.cat([elements.view(torch.uint8).flatten(-2), scale_bytes], dim=-1)


def unpack_swa(rec: Tensor) -> Tensor:
    """Decode SWA records ``uint8[..., D + D // 32]`` (layout in :func:`pack_swa`) to
    ``float32[..., D]``. Equals ``fake_quant_fp8(x.float(), 32)`` bit for bit for
    ``rec = pack_swa(x)``.
    """
    dim = _record_dim(rec, 33, 32, SWA_BLOCK, "unpack_swa")
    elements = rec[..., :dim].contiguous().view(torch.float8_e4m3fn).float()
    scale = ue8m0_decode(rec[..., dim:])
    values = elements.reshape(*rec.shape[:-1], dim // SWA_BLOCK, SWA_BLOCK)
    return (values * scale.unsqueeze(-1)).reshape(*rec.shape[:-1], dim)
