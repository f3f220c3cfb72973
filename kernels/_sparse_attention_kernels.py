"""Triton kernels behind `cedserve.kernels.sparse_attention`.

One program takes the `BLOCK_H` heads of one query token as the M dimension of its MMAs (64 heads
x 512 channels at the released shape: MQA, every head reads the same K = V latent) and walks a
slice of that token's keys in tiles of `BLOCK_N`:

    records [BLOCK_N] --decode once, in registers--> K [BLOCK_N, D] bf16 (exact)
    S   = Q [BLOCK_H, D] . K^T                       (bf16 MMAs, fp32 accumulate)
    P   = online softmax of S, rounded to bf16
    acc = acc * alpha + P . K                        (the same decoded tile: K = V)

so each key is decoded once per program and shared by every head.

Channel split: a group of C channels is held as two halves, `lo` = its even channels and `hi` = its
odd ones. It is the natural split of an E2M1 record (byte `i` holds channel `2i` in its low nibble
and `2i + 1` in its high nibble) and of SWA pairs read as 16-bit words, `q . k = q_lo . k_lo +
q_hi . k_hi`, and the output's RoPE pairs `(2i, 2i + 1)` become `(lo[i], hi[i])`. Record bytes
are loaded as `[BLOCK_N, C / 16, 8]` (main: 8 bytes per 16-channel scale block) or `[BLOCK_N, C /
32, 16]` 16-bit pairs (SWA), decoded elementwise against their block's scale and reshaped to
`[BLOCK_N, C / 2]`, so every thread keeps contiguous channels from load to shared-memory store.
With `DV_SPLIT = 2` two programs share a head block: each accumulates one half of the value
channels (half the accumulator registers) and both compute the logits over all D channels.
With `PREFETCH` the records of the next tile are loaded before the current one is decoded.

Decoding (`HW_CVT`, sm89+ GPUs): an E2M1 nibble `s e1 e0 m` is turned into the E4M3 byte
`s 0000 e1 e0 m 00` with bit operations; as E4M3 that byte is exactly the E2M1 value times 2**-6
(e >= 1: 2**(e - 7) * (1 + m / 2); e = 0: the E4M3 subnormal m * 2**-7), so the hardware fp8 ->
fp16 conversion decodes it, and one fp16 multiply by `scale * 64` (the E4M3 block scale, also
converted by hardware) gives the key: every product has at most 6 significant bits and lies in
[2**-10, 2688], so fp16 holds it exactly and the cast to bf16 is exact. SWA bytes are E4M3
already; their power-of-two UE8M0 scales multiply in fp32. Without `HW_CVT` (the CPU interpreter,
whose fp8 casts differ) the same values are decoded with integer and fp32 arithmetic.

Online softmax runs in base 2 (`sm_scale_log2 = softmax_scale * log2(e)`); the per-head sink
logit starts the running max and sum (`m = sink`, `l = 1`), so it only enlarges the denominator
and a row with every key masked returns zeros. With `NUM_SPLITS > 1` (split-KV, "flash-decoding")
a token's key tiles, main list then window, are dealt out in contiguous runs of equal length (+-1
tile) to `NUM_SPLITS` programs; each writes its unnormalised fp32 accumulator and (m, l) without
the sink, and `_combine_splits_kernel` merges them, adds the sink and rotates back.
"""
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl

from cedserve.kernels._jit_codecs import _e2m1_decode, _e4m3_decode, _slot_address, _to_output

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _record_rows(slot_row_ptr, j, end, num_slots, offset, spb, slot_stride, block_stride,
                 ALIGN: tl.constexpr):
    """(byte offsets [BLOCK_N] of the records of slots `slot_row_ptr[j]`, valid [BLOCK_N])."""
    slot = tl.load(slot_row_ptr + j, mask=j < end, other=-1)
    rec, ok = _slot_address(slot, num_slots, offset, spb, slot_stride, block_stride)
    return tl.multiple_of(rec, ALIGN), ok & (j < end)


@triton.jit
def _load_main(main_ptr, rec, ok, first, D: tl.constexpr, C: tl.constexpr):
    """Raw main-KV records, channels `[first, first + C)`: (E2M1 pair bytes uint8
    [BLOCK_N, C // 16, 8] (8 bytes per 16-channel scale block), E4M3 scale bytes uint8 [BLOCK_N, C // 16])."""
    row = main_ptr + rec
    blk = tl.arange(0, C // 16)
    codes = tl.load(row[:, None, None] + (first // 2 + blk * 8)[None, :, None] + tl.arange(0, 8)[None, None, :],
                    mask=ok[:, None, None], other=0)
    scales = tl.load(row[:, None] + (D // 2 + first // 16 + blk)[None, :], mask=ok[:, None], other=0x38)  # 1.0
    return codes, scales


@triton.jit
def _decode_main(codes, scales, BLOCK_N: tl.constexpr, C: tl.constexpr, HW_CVT: tl.constexpr):
    """(k_lo, k_hi) bf16 [BLOCK_N, C // 2], exact, from `_load_main`'s bytes."""
    if HW_CVT:
        # each E2M1 nibble -> the E4M3 byte of its value * 2**-6 (module docstring)
        lo8 = ((codes & 7) << 2) | ((codes & 8) << 4)
        hi8 = ((codes >> 2) & 0x1C) | (codes & 0x80)
        scale = (scales.to(tl.float8e4nv, bitcast=True).to(tl.float16) * 64.0)[:, :, None]
        lo = lo8.to(tl.float8e4nv, bitcast=True).to(tl.float16) * scale
        hi = hi8.to(tl.float8e4nv, bitcast=True).to(tl.float16) * scale
    else:
        c = codes.to(tl.int32)
        scale = _e4m3_decode(scales.to(tl.int32))[:, :, None]
        lo = _e2m1_decode(c) * scale
        hi = _e2m1_decode(c >> 4) * scale
    return tl.reshape(lo, [BLOCK_N, C // 2]).to(tl.bfloat16), tl.reshape(hi, [BLOCK_N, C // 2]).to(tl.bfloat16)


@triton.jit
def _load_swa(swa_ptr, rec, ok, first, D: tl.constexpr, C: tl.constexpr, ALIGN: tl.constexpr):
    """Raw SWA records, channels `[first, first + C)`: (E4M3 channel pairs as little-endian 16-bit
    words int32 [BLOCK_N, C // 32, 16], UE8M0 scale bytes uint8 [BLOCK_N, C // 32])."""
    row = swa_ptr + rec
    blk = tl.arange(0, C // 32)
    pair = (first // 2 + blk * 16)[None, :, None] + tl.arange(0, 16)[None, None, :]
    if ALIGN >= 2:
        ptr = row.to(tl.pointer_type(tl.int16))[:, None, None] + pair
        values = tl.load(ptr, mask=ok[:, None, None], other=0).to(tl.int32) & 0xFFFF
    else:
        lo = tl.load(row[:, None, None] + 2 * pair, mask=ok[:, None, None], other=0).to(tl.int32)
        hi = tl.load(row[:, None, None] + 2 * pair + 1, mask=ok[:, None, None], other=0).to(tl.int32)
        values = lo | (hi << 8)
    scales = tl.load(row[:, None] + (D + first // 32 + blk)[None, :], mask=ok[:, None], other=127)
    return values, scales


@triton.jit
def _decode_swa(values, scales, BLOCK_N: tl.constexpr, C: tl.constexpr, HW_CVT: tl.constexpr):
    """(k_lo, k_hi) bf16 [BLOCK_N, C // 2], exact, from `_load_swa`'s words."""
    scale = (scales.to(tl.int32) << 23).to(tl.float32, bitcast=True)[:, :, None]  # 2**(b - 127)
    lo = values & 0xFF
    hi = values >> 8
    if HW_CVT:
        lo = lo.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        hi = hi.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        lo = _e4m3_decode(lo)
        hi = _e4m3_decode(hi)
    return (tl.reshape(lo * scale, [BLOCK_N, C // 2]).to(tl.bfloat16),
            tl.reshape(hi * scale, [BLOCK_N, C // 2]).to(tl.bfloat16))


@triton.jit
def _load_q(q_row, h_ok, first, C: tl.constexpr, DOT_F32: tl.constexpr):
    """(q_lo, q_hi) [BLOCK_H, C // 2]: the even and odd channels of `[first, first + C)`."""
    q = tl.load(q_row + first + tl.arange(0, C)[None, :], mask=h_ok[:, None], other=0.0)  # [BLOCK_H, C]
    q_lo, q_hi = tl.split(tl.reshape(q, [q.shape[0], C // 2, 2]))
    if DOT_F32:
        q_lo = q_lo.to(tl.float32)
        q_hi = q_hi.to(tl.float32)
    return q_lo, q_hi


@triton.jit
def _logits(q_lo, q_hi, k_lo, k_hi, s, DOT_F32: tl.constexpr):
    """s + q . k^T over one channel group (lo and hi halves)."""
    if DOT_F32:
        k_lo = k_lo.to(tl.float32)
        k_hi = k_hi.to(tl.float32)
    s = tl.dot(q_lo, tl.trans(k_lo), s)
    return tl.dot(q_hi, tl.trans(k_hi), s)


@triton.jit
def _softmax_step(s, ok, m_i, l_i, sm_scale_log2):
    """Online softmax over one tile's logits `s [BLOCK_H, BLOCK_N]`: (p, alpha, m, l)."""
    return _masked_softmax_step(s, ok[None, :], m_i, l_i, sm_scale_log2)


@triton.jit
def _masked_softmax_step(s, keep, m_i, l_i, sm_scale_log2):
    """`_softmax_step` with a mask per logit, `keep [BLOCK_H, BLOCK_N]` (or broadcast to it)."""
    s = tl.where(keep, s * sm_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _accumulate(p, alpha, k_lo, k_hi, acc_lo, acc_hi, DOT_F32: tl.constexpr):
    """acc * alpha + p . k (K = V) for both halves; p rounded to the keys' dtype (bf16)."""
    if DOT_F32:
        k_lo = k_lo.to(tl.float32)
        k_hi = k_hi.to(tl.float32)
    p = p.to(k_lo.dtype)
    return tl.dot(p, k_lo, acc_lo * alpha[:, None]), tl.dot(p, k_hi, acc_hi * alpha[:, None])


@triton.jit
def _store_output(out_ptr, out_stride_h, o_lo, o_hi, first, cos_ptr, sin_ptr, h, h_ok,
                  D: tl.constexpr, C: tl.constexpr, ROPE_PAIRS: tl.constexpr):
    """Inverse-RoPE (the head's last ROPE_PAIRS channel pairs) and store the channel group
    `[first, first + C)` given as its even / odd halves `o_lo, o_hi [BLOCK_H, C // 2]`."""
    i = tl.arange(0, C // 2)
    pair = first // 2 + i - (D // 2 - ROPE_PAIRS)
    is_rope = pair >= 0
    cos = tl.load(cos_ptr + pair, mask=is_rope, other=1.0)[None, :]
    sin = tl.load(sin_ptr + pair, mask=is_rope, other=0.0)[None, :]
    o = tl.join(o_lo * cos + o_hi * sin, o_hi * cos - o_lo * sin)  # [BLOCK_H, C // 2, 2]
    o = tl.reshape(o, [o_lo.shape[0], C])
    ptr = out_ptr + h[:, None].to(tl.int64) * out_stride_h + first + tl.arange(0, C)[None, :]
    tl.store(ptr, _to_output(o, out_ptr), mask=h_ok[:, None])


@triton.jit
def _start_rows(sink_ptr, h, h_ok, ROWS: tl.constexpr, C: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """A program's accumulators for `ROWS` query rows of heads `h`: (acc_lo, acc_hi [ROWS, C // 2],
    m, l [ROWS]); the sink starts the running max and sum, except in a split's partials (the combine
    adds it)."""
    acc_lo = tl.zeros([ROWS, C // 2], dtype=tl.float32)
    acc_hi = tl.zeros([ROWS, C // 2], dtype=tl.float32)
    if NUM_SPLITS == 1:
        m_i = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * LOG2E
        l_i = tl.full([ROWS], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
    return acc_lo, acc_hi, m_i, l_i


@triton.jit
def _sparse_decode_attention_kernel(
    q_ptr, q_stride_n, q_stride_h, sink_ptr,
    main_ptr, topk_ptr, topk_stride, num_topk,
    main_num_slots, main_offset, main_spb, main_slot_stride, main_block_stride,
    swa_ptr, win_ptr, win_stride, num_win,
    swa_num_slots, swa_offset, swa_spb, swa_slot_stride, swa_block_stride,
    cos_ptr, sin_ptr, cs_stride,
    out_ptr, out_stride_n, out_stride_h,
    part_acc_ptr, part_ml_ptr,
    num_heads, sm_scale_log2,
    D: tl.constexpr, ROPE_PAIRS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DV_SPLIT: tl.constexpr, HAS_MAIN: tl.constexpr, HAS_SWA: tl.constexpr,
    MAIN_ALIGN: tl.constexpr, SWA_ALIGN: tl.constexpr, HW_CVT: tl.constexpr, PREFETCH: tl.constexpr,
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (token n, head block x value half, key split): attend `BLOCK_H` heads of token n over
    its split of the selected main-KV entries (`topk_slots[n]`) and of its window
    (`window_slots[n]`), accumulating the output channels `[mine, mine + C)`, C = D / DV_SPLIT."""
    if PDL:  # programmatic dependent launch: wait for the kernels before, let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    C: tl.constexpr = D // DV_SPLIT
    TWO: tl.constexpr = DV_SPLIT == 2
    n = tl.program_id(0)
    h = (tl.program_id(1) // DV_SPLIT) * BLOCK_H + tl.arange(0, BLOCK_H)
    mine = (tl.program_id(1) % DV_SPLIT) * C  # first channel this program accumulates
    other = C - mine  # first channel of the other half (TWO only)
    split = tl.program_id(2)
    h_ok = h < num_heads

    q_row = q_ptr + n.to(tl.int64) * q_stride_n + h[:, None].to(tl.int64) * q_stride_h
    q_lo, q_hi = _load_q(q_row, h_ok, mine, C, DOT_F32)
    q2_lo, q2_hi = q_lo, q_hi
    if TWO:
        q2_lo, q2_hi = _load_q(q_row, h_ok, other, C, DOT_F32)
    acc_lo, acc_hi, m_i, l_i = _start_rows(sink_ptr, h, h_ok, BLOCK_H, C, NUM_SPLITS)
    jn = tl.arange(0, BLOCK_N)
    # key split: the token's tiles, main then window, dealt out in contiguous runs of equal length
    # (+-1 tile), so a split may end in the main list and continue in the window
    main_tiles = tl.cdiv(num_topk, BLOCK_N)
    total_tiles = main_tiles + tl.cdiv(num_win, BLOCK_N)
    t0 = split * total_tiles // NUM_SPLITS
    t1 = (split + 1) * total_tiles // NUM_SPLITS

    if HAS_MAIN:  # FP4 records: [D / 2 bytes of E2M1 pairs | D / 16 E4M3 scales]
        start = tl.minimum(t0, main_tiles) * BLOCK_N
        end = tl.minimum(tl.minimum(t1, main_tiles) * BLOCK_N, num_topk)
        slot_row = topk_ptr + n.to(tl.int64) * topk_stride
        if PREFETCH:
            rec, ok = _record_rows(slot_row, start + jn, end, main_num_slots, main_offset, main_spb,
                                   main_slot_stride, main_block_stride, MAIN_ALIGN)
            codes, scales = _load_main(main_ptr, rec, ok, mine, D, C)
            codes2, scales2 = codes, scales
            if TWO:
                codes2, scales2 = _load_main(main_ptr, rec, ok, other, D, C)
        for j0 in range(start, end, BLOCK_N):
            if PREFETCH:  # the next tile's records are in flight while this one is decoded and multiplied
                cur_ok, cur_codes, cur_scales, cur_codes2, cur_scales2 = ok, codes, scales, codes2, scales2
                rec, ok = _record_rows(slot_row, j0 + BLOCK_N + jn, end, main_num_slots, main_offset,
                                       main_spb, main_slot_stride, main_block_stride, MAIN_ALIGN)
                codes, scales = _load_main(main_ptr, rec, ok, mine, D, C)
                if TWO:
                    codes2, scales2 = _load_main(main_ptr, rec, ok, other, D, C)
            else:  # plain loads at the top of the body: num_stages > 1 lets the compiler pipeline them
                cur_rec, cur_ok = _record_rows(slot_row, j0 + jn, end, main_num_slots, main_offset,
                                               main_spb, main_slot_stride, main_block_stride, MAIN_ALIGN)
                cur_codes, cur_scales = _load_main(main_ptr, cur_rec, cur_ok, mine, D, C)
                cur_codes2, cur_scales2 = cur_codes, cur_scales
                if TWO:
                    cur_codes2, cur_scales2 = _load_main(main_ptr, cur_rec, cur_ok, other, D, C)
            k_lo, k_hi = _decode_main(cur_codes, cur_scales, BLOCK_N, C, HW_CVT)
            s = _logits(q_lo, q_hi, k_lo, k_hi, tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), DOT_F32)
            if TWO:
                k2_lo, k2_hi = _decode_main(cur_codes2, cur_scales2, BLOCK_N, C, HW_CVT)
                s = _logits(q2_lo, q2_hi, k2_lo, k2_hi, s, DOT_F32)
            p, alpha, m_i, l_i = _softmax_step(s, cur_ok, m_i, l_i, sm_scale_log2)
            acc_lo, acc_hi = _accumulate(p, alpha, k_lo, k_hi, acc_lo, acc_hi, DOT_F32)

    if HAS_SWA:  # FP8 records: [D E4M3 bytes | D / 32 UE8M0 scales]
        start = tl.maximum(t0 - main_tiles, 0) * BLOCK_N
        end = tl.minimum(tl.maximum(t1 - main_tiles, 0) * BLOCK_N, num_win)
        slot_row = win_ptr + n.to(tl.int64) * win_stride
        if PREFETCH:
            rec, ok = _record_rows(slot_row, start + jn, end, swa_num_slots, swa_offset, swa_spb,
                                   swa_slot_stride, swa_block_stride, SWA_ALIGN)
            values, scales = _load_swa(swa_ptr, rec, ok, mine, D, C, SWA_ALIGN)
            values2, scales2 = values, scales
            if TWO:
                values2, scales2 = _load_swa(swa_ptr, rec, ok, other, D, C, SWA_ALIGN)
        for j0 in range(start, end, BLOCK_N):
            if PREFETCH:
                cur_ok, cur_values, cur_scales, cur_values2, cur_scales2 = ok, values, scales, values2, scales2
                rec, ok = _record_rows(slot_row, j0 + BLOCK_N + jn, end, swa_num_slots, swa_offset, swa_spb,
                                       swa_slot_stride, swa_block_stride, SWA_ALIGN)
                values, scales = _load_swa(swa_ptr, rec, ok, mine, D, C, SWA_ALIGN)
                if TWO:
                    values2, scales2 = _load_swa(swa_ptr, rec, ok, other, D, C, SWA_ALIGN)
            else:
                cur_rec, cur_ok = _record_rows(slot_row, j0 + jn, end, swa_num_slots, swa_offset, swa_spb,
                                               swa_slot_stride, swa_block_stride, SWA_ALIGN)
                cur_values, cur_scales = _load_swa(swa_ptr, cur_rec, cur_ok, mine, D, C, SWA_ALIGN)
                cur_values2, cur_scales2 = cur_values, cur_scales
                if TWO:
                    cur_values2, cur_scales2 = _load_swa(swa_ptr, cur_rec, cur_ok, other, D, C, SWA_ALIGN)
            k_lo, k_hi = _decode_swa(cur_values, cur_scales, BLOCK_N, C, HW_CVT)
            s = _logits(q_lo, q_hi, k_lo, k_hi, tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), DOT_F32)
            if TWO:
                k2_lo, k2_hi = _decode_swa(cur_values2, cur_scales2, BLOCK_N, C, HW_CVT)
                s = _logits(q2_lo, q2_hi, k2_lo, k2_hi, s, DOT_F32)
            p, alpha, m_i, l_i = _softmax_step(s, cur_ok, m_i, l_i, sm_scale_log2)
            acc_lo, acc_hi = _accumulate(p, alpha, k_lo, k_hi, acc_lo, acc_hi, DOT_F32)

    if NUM_SPLITS == 1:
        inv_l = (1.0 / l_i)[:, None]
        _store_output(out_ptr + n.to(tl.int64) * out_stride_n, out_stride_h, acc_lo * inv_l, acc_hi * inv_l, mine,
                      cos_ptr + n.to(tl.int64) * cs_stride, sin_ptr + n.to(tl.int64) * cs_stride,
                      h, h_ok, D, C, ROPE_PAIRS)
    else:
        # partials: acc [N, NUM_SPLITS, H, D] (natural channel order), ml [N, NUM_SPLITS, H, 2]
        # (both value halves write the same ml)
        part = (n.to(tl.int64) * NUM_SPLITS + split) * num_heads + h.to(tl.int64)
        acc = tl.reshape(tl.join(acc_lo, acc_hi), [BLOCK_H, C])
        tl.store(part_acc_ptr + part[:, None] * D + mine + tl.arange(0, C)[None, :], acc, mask=h_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=h_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=h_ok)


@triton.jit
def _combine_splits_kernel(
    part_acc_ptr, part_ml_ptr, sink_ptr, cos_ptr, sin_ptr, cs_stride, out_ptr, out_stride_n, out_stride_h,
    num_heads,
    D: tl.constexpr, ROPE_PAIRS: tl.constexpr, BLOCK_H: tl.constexpr, NUM_SPLITS: tl.constexpr,
    NORMALIZED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Merge the splits of one (token, head block) with the sink, then store like the main kernel.
    `NORMALIZED`: the partials are divided by their row sums (the Gluon kernel's fp16 partials)."""
    if PDL:  # programmatic dependent launch: wait for the kernels before, let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    c = tl.arange(0, D)
    sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * LOG2E
    m = sink
    # (unrolled: the splits' loads are independent, and a loop of dependent latencies made the
    # merge 5.3 us of a 13 us batch-1 call, run 42)
    for s in tl.static_range(NUM_SPLITS):
        part = (n.to(tl.int64) * NUM_SPLITS + s) * num_heads + h.to(tl.int64)
        m = tl.maximum(m, tl.load(part_ml_ptr + part * 2, mask=h_ok, other=-1.0e30))
    total = tl.exp2(sink - m)
    o_lo = tl.zeros([BLOCK_H, D // 2], dtype=tl.float32)
    o_hi = tl.zeros([BLOCK_H, D // 2], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        part = (n.to(tl.int64) * NUM_SPLITS + s) * num_heads + h.to(tl.int64)
        weight = tl.exp2(tl.load(part_ml_ptr + part * 2, mask=h_ok, other=-1.0e30) - m)
        weight_l = weight * tl.load(part_ml_ptr + part * 2 + 1, mask=h_ok, other=0.0)
        total += weight_l
        acc = tl.load(part_acc_ptr + part[:, None] * D + c[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
        if NORMALIZED:
            weight = weight_l
        acc_lo, acc_hi = tl.split(tl.reshape(acc, [BLOCK_H, D // 2, 2]))
        o_lo += weight[:, None] * acc_lo
        o_hi += weight[:, None] * acc_hi
    inv = (1.0 / total)[:, None]
    _store_output(out_ptr + n.to(tl.int64) * out_stride_n, out_stride_h, o_lo * inv, o_hi * inv, 0,
                  cos_ptr + n.to(tl.int64) * cs_stride, sin_ptr + n.to(tl.int64) * cs_stride,
                  h, h_ok, D, D, ROPE_PAIRS)


@triton.jit
def _store_output_rows(out_ptr, out_stride_n, out_stride_h, o_lo, o_hi, row, hh, ok, cos_ptr, sin_ptr, cs_stride,
                       D: tl.constexpr, ROPE_PAIRS: tl.constexpr):
    """`_store_output` for a tile whose M rows are (token `row[m]`, head `hh[m]`) pairs, each with
    its token's own RoPE angles; all D channels."""
    i = tl.arange(0, D // 2)
    pair = i - (D // 2 - ROPE_PAIRS)
    is_rope = (pair >= 0)[None, :] & ok[:, None]
    cs = row[:, None].to(tl.int64) * cs_stride + pair[None, :]
    cos = tl.load(cos_ptr + cs, mask=is_rope, other=1.0)
    sin = tl.load(sin_ptr + cs, mask=is_rope, other=0.0)
    o = tl.join(o_lo * cos + o_hi * sin, o_hi * cos - o_lo * sin)  # [BLOCK_M, D // 2, 2]
    o = tl.reshape(o, [o_lo.shape[0], D])
    ptr = (out_ptr + row[:, None].to(tl.int64) * out_stride_n + hh[:, None].to(tl.int64) * out_stride_h
           + tl.arange(0, D)[None, :])
    tl.store(ptr, _to_output(o, out_ptr), mask=ok[:, None])


@triton.jit
def _grouped_attention_kernel(
    q_ptr, q_stride_n, q_stride_h, sink_ptr, offsets_ptr, num_tokens,
    main_ptr, topk_ptr, topk_stride, num_topk,
    main_num_slots, main_offset, main_spb, main_slot_stride, main_block_stride,
    swa_ptr, win_ptr, win_stride, num_win,
    swa_num_slots, swa_offset, swa_spb, swa_slot_stride, swa_block_stride,
    cos_ptr, sin_ptr, cs_stride,
    out_ptr, out_stride_n, out_stride_h,
    part_acc_ptr, part_ml_ptr,
    num_heads, sm_scale_log2,
    D: tl.constexpr, ROPE_PAIRS: tl.constexpr, HP: tl.constexpr, RP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_MAIN: tl.constexpr, HAS_SWA: tl.constexpr,
    MAIN_ALIGN: tl.constexpr, SWA_ALIGN: tl.constexpr, HW_CVT: tl.constexpr, DOT_F32: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (token n, -, key split): when n is the first of a sequence's consecutive rows
    (`offsets[n] == 0`), attend every head of rows n .. n + R - 1 (R <= RP: those whose offsets
    continue 1, 2, ...) together, M row m = (row m // HP, head m % HP); other programs do nothing.

    The rows' windows are one run of positions (row r's list is row 0's shifted by r: W ring slots
    ending at its own position), so their union, row 0's list then the last row's newest R - 1
    slots, is decoded once and each row masked to its own W keys. Each row's selected main-KV
    entries are its own: their tiles are decoded once and multiplied for every row, masked to the
    row they belong to. The same split-KV partials and combine as `_sparse_decode_attention_kernel`
    (one value half: all D channels a program)."""
    if PDL:  # programmatic dependent launch: wait for the kernels before, let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    C: tl.constexpr = D
    n = tl.program_id(0)
    split = tl.program_id(2)
    m = tl.arange(0, BLOCK_M)
    r_m = m // HP
    hh = m % HP
    row = n + r_m
    first = tl.load(offsets_ptr + n + 0 * m)  # (as a tensor: the interpreter's scalar & tensor is no mask)
    offs = tl.load(offsets_ptr + row, mask=(row < num_tokens) & (r_m < RP), other=-1)
    row_ok = (offs == r_m) & (first == 0) & (r_m < RP)  # the rows of n's sequence (none unless n is its first)
    count = tl.max(tl.where(row_ok, r_m + 1, 0), axis=0)
    m_ok = row_ok & (hh < num_heads)
    row = tl.where(row_ok, row, n)

    q_row = q_ptr + row[:, None].to(tl.int64) * q_stride_n + hh[:, None].to(tl.int64) * q_stride_h
    q_lo, q_hi = _load_q(q_row, m_ok, 0, C, DOT_F32)
    acc_lo, acc_hi, m_i, l_i = _start_rows(sink_ptr, hh, m_ok, BLOCK_M, C, NUM_SPLITS)
    jn = tl.arange(0, BLOCK_N)
    # tiles: each row's main list (count x main_tiles), then the union window, dealt out to splits
    main_tiles = tl.cdiv(num_topk, BLOCK_N)
    union = tl.where(count > 0, num_win + count - 1, 0)
    row_main = count * main_tiles
    total_tiles = row_main + tl.cdiv(union, BLOCK_N)
    t0 = split * total_tiles // NUM_SPLITS
    t1 = (split + 1) * total_tiles // NUM_SPLITS

    if HAS_MAIN:
        for t in range(tl.minimum(t0, row_main), tl.minimum(t1, row_main)):
            r = t // main_tiles
            j0 = (t - r * main_tiles) * BLOCK_N
            slot_row = topk_ptr + (n + r).to(tl.int64) * topk_stride
            rec, ok = _record_rows(slot_row, j0 + jn, num_topk, main_num_slots, main_offset, main_spb,
                                   main_slot_stride, main_block_stride, MAIN_ALIGN)
            codes, scales = _load_main(main_ptr, rec, ok, 0, D, C)
            k_lo, k_hi = _decode_main(codes, scales, BLOCK_N, C, HW_CVT)
            s = _logits(q_lo, q_hi, k_lo, k_hi, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_F32)
            p, alpha, m_i, l_i = _masked_softmax_step(s, ok[None, :] & (r_m == r)[:, None], m_i, l_i, sm_scale_log2)
            acc_lo, acc_hi = _accumulate(p, alpha, k_lo, k_hi, acc_lo, acc_hi, DOT_F32)

    if HAS_SWA:
        u_start = tl.maximum(t0 - row_main, 0) * BLOCK_N
        u_end = tl.minimum(tl.maximum(t1 - row_main, 0) * BLOCK_N, union)
        first_row = win_ptr + n.to(tl.int64) * win_stride
        last_row = win_ptr + (n + tl.maximum(count, 1) - 1).to(tl.int64) * win_stride
        for u0 in range(u_start, u_end, BLOCK_N):
            u = u0 + jn
            from_first = u < num_win
            slot = tl.where(from_first,
                            tl.load(first_row + u, mask=from_first & (u < u_end), other=-1),
                            tl.load(last_row + (u - count + 1), mask=(u >= num_win) & (u < u_end), other=-1))
            rec, ok = _slot_address(slot, swa_num_slots, swa_offset, swa_spb, swa_slot_stride, swa_block_stride)
            rec = tl.multiple_of(rec, SWA_ALIGN)
            ok = ok & (u < u_end)
            values, scales = _load_swa(swa_ptr, rec, ok, 0, D, C, SWA_ALIGN)
            k_lo, k_hi = _decode_swa(values, scales, BLOCK_N, C, HW_CVT)
            s = _logits(q_lo, q_hi, k_lo, k_hi, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_F32)
            # row r's window: union positions r .. r + W - 1
            keep = ok[None, :] & (u[None, :] >= r_m[:, None]) & (u[None, :] < r_m[:, None] + num_win)
            p, alpha, m_i, l_i = _masked_softmax_step(s, keep, m_i, l_i, sm_scale_log2)
            acc_lo, acc_hi = _accumulate(p, alpha, k_lo, k_hi, acc_lo, acc_hi, DOT_F32)

    if NUM_SPLITS == 1:
        inv_l = (1.0 / l_i)[:, None]
        _store_output_rows(out_ptr, out_stride_n, out_stride_h, acc_lo * inv_l, acc_hi * inv_l, row, hh, m_ok,
                           cos_ptr, sin_ptr, cs_stride, D, ROPE_PAIRS)
    else:
        part = (row.to(tl.int64) * NUM_SPLITS + split) * num_heads + hh.to(tl.int64)
        acc = tl.reshape(tl.join(acc_lo, acc_hi), [BLOCK_M, C])
        tl.store(part_acc_ptr + part[:, None] * D + tl.arange(0, C)[None, :], acc, mask=m_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=m_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=m_ok)
