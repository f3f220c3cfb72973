"""Triton device functions for the record formats: E2M1, E4M3, UE8M0 and slot addressing.

Imported only by the `_*_kernels.py` modules (it imports triton). Each function reproduces, bit
for bit, the corresponding step of `cedserve.kernels.reference` using integer and float32
arithmetic only (no float8 casts: the interpreter's do not round like the GPU's). Rounding to
nearest-even uses the float32 "magic number" trick `(k + 2**23) - 2**23`, exact for
`0 <= k < 2**22`; nothing here is contracted into an FMA in a way that changes a result.
"""
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl

FORMAT_MAIN = tl.constexpr(0)  # E2M1 elements, E4M3 scale per 16 channels (288 B at 512)
FORMAT_INDEX = tl.constexpr(1)  # E2M1 elements, UE8M0 scale per 32 channels (68 B at 128)
FORMAT_SWA = tl.constexpr(2)  # E4M3 elements, UE8M0 scale per 32 channels (528 B at 512)


@triton.jit
def _ceil_log2(t):
    """ceil(log2(t)) as int32 for positive normal float32 t (exponent field, +1 if inexact)."""
    bits = t.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _ue8m0_from_amax(amax, AMAX_FLOOR: tl.constexpr, INV_ELEMENT_MAX: tl.constexpr):
    """(float32 scale 2**k, int32 biased byte k + 127) with k = ceil(log2(max(amax, floor) *
    fl32(1 / element_max))); the byte saturates to [0, 255] like the reference."""
    k = _ceil_log2(tl.maximum(amax, AMAX_FLOOR) * INV_ELEMENT_MAX)
    biased = tl.minimum(tl.maximum(k + 127, 0), 255)
    return (biased << 23).to(tl.float32, bitcast=True), biased


@triton.jit
def _e4m3_round_magnitude(a):
    """Round a float32 magnitude in [0, 448] to the nearest E4M3 value, ties to even."""
    bits = a.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    quantum_exp = tl.maximum(exponent - 3, -9)  # 3 mantissa bits; subnormal step 2**-9
    quantum = ((quantum_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_quantum = ((127 - quantum_exp) << 23).to(tl.float32, bitcast=True)
    steps = a * inv_quantum  # exact, < 16
    steps = (steps + 8388608.0) - 8388608.0
    return steps * quantum


@triton.jit
def _e4m3_magnitude_byte(v):
    """E4M3 byte (int32, sign bit clear) of an exactly representable magnitude v."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    normal = (exponent + 7) * 8 + ((bits >> 20) & 7)
    # v * 512 is an integer 0..7 here: read it off the mantissa of 2**23 + v * 512 (no F2I)
    subnormal = (v * 512.0 + 8388608.0).to(tl.int32, bitcast=True) & 0xF
    return tl.where(exponent >= -6, normal, subnormal)


@triton.jit
def _e4m3_decode(byte):
    """float32 value of E4M3 bytes (int32 0..255); 0x80 is -0.0."""
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
    # the sign goes in as a bit: `-magnitude` is `0.0 - magnitude` on Triton <= 3.6 (+0.0 for 0x80)
    sign = (byte & 0x80) << 24
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_encode(q):
    """E4M3 byte (int32) of float32 q already clamped to [-448, 448]; keeps the sign of -0.0."""
    sign = (q.to(tl.int32, bitcast=True) >> 31) & 1
    magnitude = _e4m3_magnitude_byte(_e4m3_round_magnitude(tl.abs(q)))
    return magnitude | (sign << 7)


@triton.jit
def _e2m1_magnitude_code(m):
    """E2M1 magnitude code (int32 0..7) of float32 m in [0, 6]: nearest grid point, ties to the even
    code (0.25, 1.25, 2.5, 5 round down; 0.75, 1.75, 3.5 up). From 1 up the grid is 1 mantissa
    bit per binade, so rounding the float32 bits at bit 22 (ties to even) gives
    `(exponent << 1 | mantissa bit) - 252`; below 1 the grid step is 0.5."""
    bits = m.to(tl.int32, bitcast=True)
    big = ((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - 252
    small = (m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32)
    return tl.where(m >= 1.0, big, small)


@triton.jit
def _e2m1_code_fast(q):
    """E2M1 magnitude code (int32 0..7) of |x / s|, from `q = x * RN(1 / s)` (v4 writers).

    Valid when x has at most 11 significant bits (bf16, fp16) and s at most 4 (E4M3) or is a power
    of two: then x / s is either exactly a rounding tie t (0.25, 0.75, ..., 5) or at least 2**-12 * t
    away from every tie, while q is within 2 ulps of x / s. Scaled by 2**-126, an E2M1 value's float32
    bits are its code times 2**22 (the subnormal 0.5 lands on the fp32 subnormal 2**-127, so the
    grid is uniform in the bits), and rounding the bits at bit 22 is E2M1 rounding. The rounding
    treats everything within 0x80 units of a tie as the tie (ties to even): approximation errors
    are a few units, a non-tie is >= 0x200 units away. Needs fp32 subnormals (no FTZ)."""
    m = tl.minimum(tl.abs(q * 1.1754943508222875e-38), 7.052966104933725e-38)  # |q| * 2**-126, <= 6 * 2**-126
    bits = m.to(tl.int32, bitcast=True)
    return (bits + 0x1FFF80 + ((bits >> 14) & 0x100)) >> 22


@triton.jit
def _e2m1_encode(q):
    """E2M1 code (int32 0..15) of float32 q already clamped to [-6, 6], bit 3 the sign."""
    sign = (q.to(tl.int32, bitcast=True) >> 31) & 1
    return _e2m1_magnitude_code(tl.abs(q)) | (sign << 3)


@triton.jit
def _e2m1_decode(code):
    """float32 value of E2M1 codes (int32, low 4 bits used); 0x8 decodes to +0.0."""
    index = code & 7
    exponent = index >> 1
    mantissa = index & 1
    normal = (((exponent + 126) << 23) | (mantissa << 22)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.5, normal)
    return tl.where(((code & 8) != 0) & (index != 0), -magnitude, magnitude)


@triton.jit
def _slot_address(slot, num_slots, offset_bytes, slots_per_block, slot_stride_bytes, block_stride_bytes):
    """(int64 byte offset, valid) of slots (any int tensor); invalid slots (-1 or outside
    [0, num_slots)) get offset 0 and valid False."""
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0).to(tl.int32)  # valid slots are < 2**31 (PagedRecords checks)
    block = slot // slots_per_block  # int32 division: a fraction of an int64 one's instructions
    entry = slot - block * slots_per_block
    return offset_bytes + block.to(tl.int64) * block_stride_bytes + entry.to(tl.int64) * slot_stride_bytes, valid


@triton.jit
def _round_bf16(x):
    """float32 x rounded to the nearest bfloat16, ties to even, returned as float32 (exactly
    representable, so a later `.to(tl.bfloat16)` is exact). Done on the bits because the
    interpreter's float32 -> bfloat16 cast truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _to_output(x, ptr):
    """float32 x converted to the element type of `ptr` (bf16 with round-to-nearest-even)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        x = _round_bf16(x)
    return x.to(ptr.dtype.element_ty)
