"""Triton kernel behind `cedserve.kernels.compressor`: pool, RMSNorm, RoPE, quantize, pack.

A program handles `BLOCK_G` groups. Channels are held as (even, odd) pair halves `lo`/`hi`, each
shaped `[BLOCK_G, NB, WPB, 4]`: pair `i = (nb * WPB + w) * 4 + p` holds channels `2i` and
`2i + 1`, `NB` scale blocks of `WPB` 32-bit record words of 4 pairs (8 E2M1 codes). RoPE rotates
pairs `(lo[i], hi[i])` in place, and a record word is `sum_p code(lo_p) << 8p | code(hi_p) << 8p+4`.

Intermediate roundings follow the reference model step by step (`ACT_ROUND` / `OUT_ROUND`: 0 keep
fp32, 1 round to bf16): the pooled latent is cast to the activation dtype, RMSNorm
casts `x * rsqrt(mean(x^2) + eps)` to it before the weight multiplies (result in the promoted
dtype), RoPE computes in fp32 and casts back.
"""
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl

from cedserve.kernels._jit_codecs import _round_bf16, _slot_address, _to_output
from cedserve.kernels._records_kernels import _block_scale, _quantize_elements, _store_record


@triton.jit
def _round_to(x, ROUND: tl.constexpr):
    """Emulate a cast of float32 x to the activation dtype and back (1: bf16, 0: none)."""
    if ROUND == 1:
        x = _round_bf16(x)
    return x


@triton.jit
def _load_pairs(ptr, rows, row_stride, pair, mask):
    """(even, odd) channels of `rows [G]` at pair indices `pair [NB, WPB, 4]` as float32."""
    base = ptr + rows.to(tl.int64)[:, None, None, None] * row_stride + 2 * pair[None, :, :, :]
    return (tl.load(base, mask=mask, other=0.0).to(tl.float32),
            tl.load(base + 1, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _compress_kernel(
    kv_ptr, kv_stride, gate_ptr, gate_stride, weight_ptr, cos_ptr, sin_ptr, cs_stride,
    slot_ptr, out_ptr, latent_ptr, latent_stride,
    num_groups, eps,
    num_slots, offset_bytes, slots_per_block, slot_stride_bytes, block_stride_bytes,
    RATIO: tl.constexpr, FORMAT: tl.constexpr, HALF: tl.constexpr, NB: tl.constexpr, WPB: tl.constexpr,
    ROPE_PAIRS: tl.constexpr, ACT_ROUND: tl.constexpr, OUT_ROUND: tl.constexpr, BLOCK_G: tl.constexpr,
    WORD_STORES: tl.constexpr, SCALE_WORDS: tl.constexpr, WRITE_LATENT: tl.constexpr, HW_FP8: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Groups `g` of `RATIO` rows of `kv` (softmax(`gate`)-weighted over the rows when RATIO > 1)
    -> latent (RMSNorm with `weight`) -> RoPE with `cos/sin[g]` -> FP4 record at `slot[g]`."""
    if PDL:  # programmatic dependent launch: wait for the kernels before, let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    g_ok = g < num_groups
    pair = (tl.arange(0, NB)[:, None, None] * WPB + tl.arange(0, WPB)[None, :, None]) * 4 \
        + tl.arange(0, 4)[None, None, :]  # [NB, WPB, 4]
    mask = g_ok[:, None, None, None] & (pair < HALF)[None, :, :, :]

    if RATIO == 1:
        lo, hi = _load_pairs(kv_ptr, g, kv_stride, pair, mask)
    else:  # softmax over the group's rows, per channel, in fp32
        m_lo = tl.full([BLOCK_G, NB, WPB, 4], float("-inf"), dtype=tl.float32)
        m_hi = tl.full([BLOCK_G, NB, WPB, 4], float("-inf"), dtype=tl.float32)
        for r in tl.static_range(RATIO):
            a_lo, a_hi = _load_pairs(gate_ptr, g * RATIO + r, gate_stride, pair, mask)
            m_lo = tl.maximum(m_lo, a_lo)
            m_hi = tl.maximum(m_hi, a_hi)
        s_lo = tl.zeros([BLOCK_G, NB, WPB, 4], dtype=tl.float32)
        s_hi = tl.zeros([BLOCK_G, NB, WPB, 4], dtype=tl.float32)
        for r in tl.static_range(RATIO):
            a_lo, a_hi = _load_pairs(gate_ptr, g * RATIO + r, gate_stride, pair, mask)
            s_lo += tl.exp(a_lo - m_lo)
            s_hi += tl.exp(a_hi - m_hi)
        lo = tl.zeros([BLOCK_G, NB, WPB, 4], dtype=tl.float32)
        hi = tl.zeros([BLOCK_G, NB, WPB, 4], dtype=tl.float32)
        for r in tl.static_range(RATIO):
            a_lo, a_hi = _load_pairs(gate_ptr, g * RATIO + r, gate_stride, pair, mask)
            v_lo, v_hi = _load_pairs(kv_ptr, g * RATIO + r, kv_stride, pair, mask)
            lo += v_lo * (tl.exp(a_lo - m_lo) / s_lo)
            hi += v_hi * (tl.exp(a_hi - m_hi) / s_hi)
        lo = tl.where(mask, lo, 0.0)
        hi = tl.where(mask, hi, 0.0)

    # RMSNorm: statistics in fp32 over the (activation-dtype) latent, weight applied last
    lo = _round_to(lo, ACT_ROUND)
    hi = _round_to(hi, ACT_ROUND)
    sum_sq = tl.sum(tl.sum(tl.sum(lo * lo + hi * hi, axis=3), axis=2), axis=1)
    rstd = tl.rsqrt(sum_sq / (2 * HALF) + eps)[:, None, None, None]
    w_lo = tl.load(weight_ptr + 2 * pair, mask=pair < HALF, other=0.0).to(tl.float32)[None, :, :, :]
    w_hi = tl.load(weight_ptr + 2 * pair + 1, mask=pair < HALF, other=0.0).to(tl.float32)[None, :, :, :]
    lo = _round_to(w_lo * _round_to(lo * rstd, ACT_ROUND), OUT_ROUND)
    hi = _round_to(w_hi * _round_to(hi * rstd, ACT_ROUND), OUT_ROUND)
    if WRITE_LATENT:
        base = latent_ptr + g.to(tl.int64)[:, None, None, None] * latent_stride + 2 * pair[None, :, :, :]
        tl.store(base, _to_output(lo, latent_ptr), mask=mask)
        tl.store(base + 1, _to_output(hi, latent_ptr), mask=mask)

    # RoPE at the group's first position on the last ROPE_PAIRS pairs
    rope_pair = pair - (HALF - ROPE_PAIRS)
    is_rope = (rope_pair >= 0)[None, :, :, :] & g_ok[:, None, None, None]
    cs = g.to(tl.int64)[:, None, None, None] * cs_stride + rope_pair[None, :, :, :]
    cos = tl.load(cos_ptr + cs, mask=is_rope, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + cs, mask=is_rope, other=0.0).to(tl.float32)
    r_lo = _round_to(lo * cos - hi * sin, OUT_ROUND)
    r_hi = _round_to(lo * sin + hi * cos, OUT_ROUND)
    lo = tl.where(is_rope, r_lo, lo)
    hi = tl.where(is_rope, r_hi, hi)

    # quantize and pack: one scale per [WPB, 4] pairs
    amax = tl.max(tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=3), axis=2)  # [G, NB]
    scale, inv_scale, scale_byte = _block_scale(amax, FORMAT, 4, HW_FP8)
    scale = scale[:, :, None, None]
    inv_scale = inv_scale[:, :, None, None]
    byte = (_quantize_elements(lo, scale, inv_scale, FORMAT, 4, HW_FP8)
            | (_quantize_elements(hi, scale, inv_scale, FORMAT, 4, HW_FP8) << 4))
    shifts = (tl.arange(0, 4) * 8).to(tl.uint32)
    words = tl.sum(byte.to(tl.uint32) << shifts[None, None, None, :], axis=3)  # [G, NB, WPB]

    slot = tl.load(slot_ptr + g, mask=g_ok, other=-1)
    rec, ok = _slot_address(slot, num_slots, offset_bytes, slots_per_block, slot_stride_bytes, block_stride_bytes)
    _store_record(out_ptr, rec, ok & g_ok, words, scale_byte, BLOCK_G, NB, NB, WPB, HALF, WORD_STORES, SCALE_WORDS)
