"""Triton kernels behind `cedserve.kernels.sparse_attention`.

Channel split: a 512-channel vector is handled as two 256-channel halves, `lo` = the even channels
and `hi` = the odd ones. It is the natural split of an E2M1 record (byte `i` holds channel `2i`
in its low nibble and `2i + 1` in its high nibble), `q . k = q_lo . k_lo + q_hi . k_hi`, and the
output's RoPE pairs `(2i, 2i + 1)` become `(lo[i], hi[i])`, so the inverse rotation needs no
shuffle. Hopper has no FP4 MMA: records are decoded in registers to bf16 (exact: an E2M1 value
times an E4M3 scale has at most 6 significant bits) and fed to bf16 `tl.dot`s with fp32
accumulation.

Online softmax runs in base 2 (`sm_scale_log2 = softmax_scale * log2(e)`); the per-head sink
logit starts the running max and sum (`m = sink`, `l = 1`), so it only enlarges the denominator
and a row with every key masked returns zeros. With `NUM_SPLITS > 1` each split writes its
unnormalised accumulator and (m, l) without the sink, and `_combine_splits_kernel` merges them.
"""
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl

from cedserve.kernels._jit_codecs import _e2m1_decode, _e4m3_decode, _slot_address, _to_output

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _attend_tile(q_lo, q_hi, k_lo, k_hi, ok, acc_lo, acc_hi, m_i, l_i, sm_scale_log2, DOT_F32: tl.constexpr):
    """One online-softmax step over a tile of keys `k_lo/k_hi [BLOCK_N, HALF]` (K = V)."""
    if DOT_F32:
        k_lo = k_lo.to(tl.float32)
        k_hi = k_hi.to(tl.float32)
    s = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))  # [BLOCK_H, BLOCK_N]
    s = tl.where(ok[None, :], s * sm_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(k_lo.dtype)
    acc_lo = tl.dot(p, k_lo, acc_lo * alpha[:, None])
    acc_hi = tl.dot(p, k_hi, acc_hi * alpha[:, None])
    return acc_lo, acc_hi, m_new, l_i


@triton.jit
def _store_output(out_ptr, out_stride_h, o_lo, o_hi, cs_ptr_cos, cs_ptr_sin, h, h_ok,
                  HALF: tl.constexpr, ROPE_PAIRS: tl.constexpr):
    """Inverse-RoPE the last ROPE_PAIRS pairs of `o [BLOCK_H, lo|hi]` and store it interleaved."""
    i = tl.arange(0, HALF)
    pair = i - (HALF - ROPE_PAIRS)
    is_rope = pair >= 0
    cos = tl.load(cs_ptr_cos + pair, mask=is_rope, other=1.0)[None, :]
    sin = tl.load(cs_ptr_sin + pair, mask=is_rope, other=0.0)[None, :]
    r_lo = o_lo * cos + o_hi * sin
    r_hi = o_hi * cos - o_lo * sin
    base = out_ptr + h[:, None].to(tl.int64) * out_stride_h + 2 * i[None, :]
    tl.store(base, _to_output(r_lo, out_ptr), mask=h_ok[:, None])
    tl.store(base + 1, _to_output(r_hi, out_ptr), mask=h_ok[:, None])


@triton.jit
def _sparse_decode_attention_kernel(
    q_ptr, q_stride_n, q_stride_h, sink_ptr,
    main_ptr, topk_ptr, topk_stride, num_topk, main_chunk,
    main_num_slots, main_offset, main_spb, main_slot_stride, main_block_stride,
    swa_ptr, win_ptr, win_stride, num_win, win_chunk,
    swa_num_slots, swa_offset, swa_spb, swa_slot_stride, swa_block_stride,
    cos_ptr, sin_ptr, cs_stride,
    out_ptr, out_stride_n, out_stride_h,
    part_acc_ptr, part_ml_ptr,
    num_heads, sm_scale_log2,
    HALF: tl.constexpr, ROPE_PAIRS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_MAIN: tl.constexpr, HAS_SWA: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Program (token n, head block, split): attend `BLOCK_H` heads of token n over its split of
    the selected main-KV entries (`topk_slots[n]`) and of its window (`window_slots[n]`)."""
    n = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = h < num_heads
    i = tl.arange(0, HALF)

    q_row = q_ptr + n.to(tl.int64) * q_stride_n + h[:, None].to(tl.int64) * q_stride_h + 2 * i[None, :]
    q_lo = tl.load(q_row, mask=h_ok[:, None], other=0.0)
    q_hi = tl.load(q_row + 1, mask=h_ok[:, None], other=0.0)
    if DOT_F32:
        q_lo = q_lo.to(tl.float32)
        q_hi = q_hi.to(tl.float32)
    acc_lo = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    if NUM_SPLITS == 1:
        m_i = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)

    if HAS_MAIN:  # FP4 records: [HALF bytes of E2M1 pairs | HALF // 8 E4M3 scales]
        start = split * main_chunk
        end = tl.minimum(start + main_chunk, num_topk)
        for j0 in range(start, end, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            slot = tl.load(topk_ptr + n.to(tl.int64) * topk_stride + j, mask=j < end, other=-1)
            rec, ok = _slot_address(slot, main_num_slots, main_offset, main_spb, main_slot_stride,
                                    main_block_stride)
            ok = ok & (j < end)
            row = main_ptr + rec[:, None]
            codes = tl.load(row + i[None, :], mask=ok[:, None], other=0).to(tl.int32)  # [BLOCK_N, HALF]
            scale = _e4m3_decode(tl.load(row + HALF + (i // 8)[None, :], mask=ok[:, None], other=0).to(tl.int32))
            k_lo = (_e2m1_decode(codes) * scale).to(tl.bfloat16)
            k_hi = (_e2m1_decode(codes >> 4) * scale).to(tl.bfloat16)
            acc_lo, acc_hi, m_i, l_i = _attend_tile(q_lo, q_hi, k_lo, k_hi, ok, acc_lo, acc_hi, m_i, l_i,
                                                    sm_scale_log2, DOT_F32)

    if HAS_SWA:  # FP8 records: [2 * HALF E4M3 bytes | HALF // 16 UE8M0 scales]
        start = split * win_chunk
        end = tl.minimum(start + win_chunk, num_win)
        for j0 in range(start, end, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            slot = tl.load(win_ptr + n.to(tl.int64) * win_stride + j, mask=j < end, other=-1)
            rec, ok = _slot_address(slot, swa_num_slots, swa_offset, swa_spb, swa_slot_stride, swa_block_stride)
            ok = ok & (j < end)
            row = swa_ptr + rec[:, None]
            lo = tl.load(row + 2 * i[None, :], mask=ok[:, None], other=0).to(tl.int32)
            hi = tl.load(row + 2 * i[None, :] + 1, mask=ok[:, None], other=0).to(tl.int32)
            exp = tl.load(row + 2 * HALF + (i // 16)[None, :], mask=ok[:, None], other=127).to(tl.int32)
            scale = (exp << 23).to(tl.float32, bitcast=True)
            k_lo = (_e4m3_decode(lo) * scale).to(tl.bfloat16)
            k_hi = (_e4m3_decode(hi) * scale).to(tl.bfloat16)
            acc_lo, acc_hi, m_i, l_i = _attend_tile(q_lo, q_hi, k_lo, k_hi, ok, acc_lo, acc_hi, m_i, l_i,
                                                    sm_scale_log2, DOT_F32)

    if NUM_SPLITS == 1:
        inv_l = 1.0 / l_i
        _store_output(out_ptr + n.to(tl.int64) * out_stride_n, out_stride_h,
                      acc_lo * inv_l[:, None], acc_hi * inv_l[:, None],
                      cos_ptr + n.to(tl.int64) * cs_stride, sin_ptr + n.to(tl.int64) * cs_stride,
                      h, h_ok, HALF, ROPE_PAIRS)
    else:
        # partials: acc [N, NUM_SPLITS, H, 2 * HALF] (lo then hi), ml [N, NUM_SPLITS, H, 2]
        part = (n.to(tl.int64) * NUM_SPLITS + split) * num_heads + h.to(tl.int64)
        acc_row = part_acc_ptr + part[:, None] * (2 * HALF) + i[None, :]
        tl.store(acc_row, acc_lo, mask=h_ok[:, None])
        tl.store(acc_row + HALF, acc_hi, mask=h_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=h_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=h_ok)


@triton.jit
def _combine_splits_kernel(
    part_acc_ptr, part_ml_ptr, sink_ptr, cos_ptr, sin_ptr, cs_stride, out_ptr, out_stride_n, out_stride_h,
    num_heads,
    HALF: tl.constexpr, ROPE_PAIRS: tl.constexpr, BLOCK_H: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Merge the splits of one (token, head block) with the sink, then store like the main kernel."""
    n = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    i = tl.arange(0, HALF)
    m = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * LOG2E
    for s in range(NUM_SPLITS):
        part = (n.to(tl.int64) * NUM_SPLITS + s) * num_heads + h.to(tl.int64)
        m = tl.maximum(m, tl.load(part_ml_ptr + part * 2, mask=h_ok, other=-1.0e30))
    sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * LOG2E
    total = tl.exp2(sink - m)
    o_lo = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    o_hi = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        part = (n.to(tl.int64) * NUM_SPLITS + s) * num_heads + h.to(tl.int64)
        weight = tl.exp2(tl.load(part_ml_ptr + part * 2, mask=h_ok, other=-1.0e30) - m)
        total += weight * tl.load(part_ml_ptr + part * 2 + 1, mask=h_ok, other=0.0)
        acc_row = part_acc_ptr + part[:, None] * (2 * HALF) + i[None, :]
        o_lo += weight[:, None] * tl.load(acc_row, mask=h_ok[:, None], other=0.0)
        o_hi += weight[:, None] * tl.load(acc_row + HALF, mask=h_ok[:, None], other=0.0)
    inv = 1.0 / total
    _store_output(out_ptr + n.to(tl.int64) * out_stride_n, out_stride_h, o_lo * inv[:, None], o_hi * inv[:, None],
                  cos_ptr + n.to(tl.int64) * cs_stride, sin_ptr + n.to(tl.int64) * cs_stride,
                  h, h_ok, HALF, ROPE_PAIRS)
