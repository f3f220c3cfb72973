"""Triton kernels behind `cedserve.kernels.sparse_attention`.

One program takes the `BLOCK_H` heads of one query token as the M dimension of its MMAs (64 heads
x 512 channels at the released shape: MQA, every head reads the same K = V latent) and walks a
slice of that token's keys in tiles of `BLOCK_N`:

    records [BLOCK_N] --decode once, in registers--> K [BLOCK_N, D] bf16
    S   = Q [BLOCK_H, D] . K^T                       (bf16 MMA, fp32 accumulate)
    P   = online softmax of S, rounded to bf16
    acc = acc * alpha + P . K                        (the same decoded tile: K = V)

so each key is decoded once per program and shared by every head. Channels stay in their natural
order: a main-KV record's codes are loaded as `[BLOCK_N, D / 16, 8]` bytes (8 bytes = one 16-channel
scale block), each byte decodes to channels `(2i, 2i + 1)` (low nibble, high nibble), and
`join` + `reshape` interleave them back to `[BLOCK_N, D]`. The record tiles of the next step are
loaded before the current one is decoded (two tiles in flight per program).

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
def _record_rows(slot_row_ptr, j, end, num_slots, offset, spb, slot_stride, block_stride,
                 ALIGN: tl.constexpr):
    """(byte offsets [BLOCK_N] of the records of slots `slot_row_ptr[j]`, valid [BLOCK_N])."""
    slot = tl.load(slot_row_ptr + j, mask=j < end, other=-1)
    rec, ok = _slot_address(slot, num_slots, offset, spb, slot_stride, block_stride)
    return tl.multiple_of(rec, ALIGN), ok & (j < end)


@triton.jit
def _load_words(row_ptr, ok, BLOCKS: tl.constexpr, WORDS: tl.constexpr, ALIGN: tl.constexpr):
    """The first `BLOCKS * WORDS` little-endian 32-bit words of records at byte pointers `row_ptr
    [BLOCK_N]`: int32 `[BLOCK_N, BLOCKS, WORDS]` (0 where not `ok`). Word loads when records are
    4-byte aligned, else four byte loads per word."""
    w = tl.arange(0, BLOCKS)[None, :, None] * WORDS + tl.arange(0, WORDS)[None, None, :]
    if ALIGN >= 4:
        ptr = row_ptr.to(tl.pointer_type(tl.int32))[:, None, None] + w
        return tl.load(ptr, mask=ok[:, None, None], other=0)
    byte = tl.arange(0, 4)
    raw = tl.load(row_ptr[:, None, None, None] + w[:, :, :, None] * 4 + byte[None, None, None, :],
                  mask=ok[:, None, None, None], other=0).to(tl.int32)
    return tl.sum(raw << (byte * 8)[None, None, None, :], axis=3)


@triton.jit
def _load_main(main_ptr, rec, ok, D: tl.constexpr, ALIGN: tl.constexpr):
    """Raw main-KV records: (codes int32 [BLOCK_N, D // 16, 2]: the 8 bytes of E2M1 pairs of each
    16-channel scale block, E4M3 scale bytes uint8 [BLOCK_N, D // 16])."""
    row = main_ptr + rec
    codes = _load_words(row, ok, D // 16, 2, ALIGN)
    scales = tl.load(row[:, None] + D // 2 + tl.arange(0, D // 16)[None, :], mask=ok[:, None], other=0x38)
    return codes, scales


@triton.jit
def _bytes_of(words):
    """int32 words `[N, B, W]` -> their bytes, low first, as uint8 `[N, B, W, 4]`."""
    return ((words[:, :, :, None] >> (tl.arange(0, 4) * 8)) & 0xFF).to(tl.uint8)


@triton.jit
def _decode_main(codes, scales, BLOCK_N: tl.constexpr, D: tl.constexpr, HW_CVT: tl.constexpr):
    """Main-KV keys [BLOCK_N, D] bf16 (exact) from `_load_main`'s words: byte `4k + t` of a block's
    words holds channels `8k + 2t` (low nibble) and `8k + 2t + 1` (high nibble)."""
    if HW_CVT:
        # each E2M1 nibble -> the E4M3 byte of its value * 2**-6, four bytes per int32 op
        lo8 = _bytes_of(((codes & 0x07070707) << 2) | ((codes & 0x08080808) << 4))  # [N, D/16, 2, 4]
        hi8 = _bytes_of(((codes >> 2) & 0x1C1C1C1C) | (codes & -0x7F7F7F80))  # -0x7F7F7F80 = 0x80808080 as int32
        scale = (scales.to(tl.float8e4nv, bitcast=True).to(tl.float16) * 64.0)[:, :, None, None]
        lo = lo8.to(tl.float8e4nv, bitcast=True).to(tl.float16) * scale
        hi = hi8.to(tl.float8e4nv, bitcast=True).to(tl.float16) * scale
    else:
        c = codes[:, :, :, None] >> (tl.arange(0, 4) * 8)  # [N, D/16, 2, 4], byte in the low 8 bits
        scale = _e4m3_decode(scales.to(tl.int32))[:, :, None, None]
        lo = _e2m1_decode(c) * scale
        hi = _e2m1_decode(c >> 4) * scale
    return tl.reshape(tl.join(lo, hi), [BLOCK_N, D]).to(tl.bfloat16)


@triton.jit
def _load_swa(swa_ptr, rec, ok, D: tl.constexpr, ALIGN: tl.constexpr):
    """Raw SWA records: (E4M3 bytes as int32 words [BLOCK_N, D // 32, 8], UE8M0 bytes uint8 [BLOCK_N, D // 32])."""
    row = swa_ptr + rec
    values = _load_words(row, ok, D // 32, 8, ALIGN)
    scales = tl.load(row[:, None] + D + tl.arange(0, D // 32)[None, :], mask=ok[:, None], other=127)
    return values, scales


@triton.jit
def _decode_swa(values, scales, BLOCK_N: tl.constexpr, D: tl.constexpr, HW_CVT: tl.constexpr):
    """SWA keys [BLOCK_N, D] bf16 (exact) from `_load_swa`'s words."""
    scale = (scales.to(tl.int32) << 23).to(tl.float32, bitcast=True)[:, :, None, None]  # 2**(b - 127)
    if HW_CVT:
        v = _bytes_of(values).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        v = _e4m3_decode((values[:, :, :, None] >> (tl.arange(0, 4) * 8)) & 0xFF)
    return tl.reshape(v * scale, [BLOCK_N, D]).to(tl.bfloat16)


@triton.jit
def _attend_tile(q, k, ok, acc, m_i, l_i, sm_scale_log2, DOT_F32: tl.constexpr):
    """One online-softmax step of `q [BLOCK_H, D]` over the keys `k [BLOCK_N, D]` (K = V)."""
    if DOT_F32:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k))  # [BLOCK_H, BLOCK_N]
    s = tl.where(ok[None, :], s * sm_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(k.dtype), k, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _store_output(out_ptr, out_stride_h, o, cos_ptr, sin_ptr, h, h_ok, BLOCK_H: tl.constexpr,
                  D: tl.constexpr, ROPE_PAIRS: tl.constexpr):
    """Inverse-RoPE the last ROPE_PAIRS channel pairs of `o [BLOCK_H, D]` and store it."""
    even, odd = tl.split(tl.reshape(o, [BLOCK_H, D // 2, 2]))
    pair = tl.arange(0, D // 2) - (D // 2 - ROPE_PAIRS)
    is_rope = pair >= 0
    cos = tl.load(cos_ptr + pair, mask=is_rope, other=1.0)[None, :]
    sin = tl.load(sin_ptr + pair, mask=is_rope, other=0.0)[None, :]
    o = tl.reshape(tl.join(even * cos + odd * sin, odd * cos - even * sin), [BLOCK_H, D])
    ptr = out_ptr + h[:, None].to(tl.int64) * out_stride_h + tl.arange(0, D)[None, :]
    tl.store(ptr, _to_output(o, out_ptr), mask=h_ok[:, None])


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
    D: tl.constexpr, ROPE_PAIRS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_MAIN: tl.constexpr, HAS_SWA: tl.constexpr,
    MAIN_ALIGN: tl.constexpr, SWA_ALIGN: tl.constexpr, HW_CVT: tl.constexpr, PREFETCH: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Program (token n, head block, split): attend `BLOCK_H` heads of token n over its split of
    the selected main-KV entries (`topk_slots[n]`) and of its window (`window_slots[n]`)."""
    n = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = h < num_heads
    c = tl.arange(0, D)

    q = tl.load(q_ptr + n.to(tl.int64) * q_stride_n + h[:, None].to(tl.int64) * q_stride_h + c[None, :],
                mask=h_ok[:, None], other=0.0)  # [BLOCK_H, D]
    if DOT_F32:
        q = q.to(tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    if NUM_SPLITS == 1:
        m_i = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    jn = tl.arange(0, BLOCK_N)

    if HAS_MAIN:  # FP4 records: [D / 2 bytes of E2M1 pairs | D / 16 E4M3 scales]
        start = split * main_chunk
        end = tl.minimum(start + main_chunk, num_topk)
        slot_row = topk_ptr + n.to(tl.int64) * topk_stride
        rec, ok = _record_rows(slot_row, start + jn, end, main_num_slots, main_offset, main_spb,
                               main_slot_stride, main_block_stride, MAIN_ALIGN)
        codes, scales = _load_main(main_ptr, rec, ok, D, MAIN_ALIGN)
        for j0 in range(start, end, BLOCK_N):
            if PREFETCH:  # the next tile's records are in flight while this one is decoded and multiplied
                cur_ok = ok
                cur_codes = codes
                cur_scales = scales
                rec, ok = _record_rows(slot_row, j0 + BLOCK_N + jn, end, main_num_slots, main_offset,
                                       main_spb, main_slot_stride, main_block_stride, MAIN_ALIGN)
                codes, scales = _load_main(main_ptr, rec, ok, D, MAIN_ALIGN)
            else:
                cur_ok = ok
                cur_codes = codes
                cur_scales = scales
                if j0 > start:
                    cur_rec, cur_ok = _record_rows(slot_row, j0 + jn, end, main_num_slots, main_offset,
                                                   main_spb, main_slot_stride, main_block_stride, MAIN_ALIGN)
                    cur_codes, cur_scales = _load_main(main_ptr, cur_rec, cur_ok, D, MAIN_ALIGN)
            k = _decode_main(cur_codes, cur_scales, BLOCK_N, D, HW_CVT)
            acc, m_i, l_i = _attend_tile(q, k, cur_ok, acc, m_i, l_i, sm_scale_log2, DOT_F32)

    if HAS_SWA:  # FP8 records: [D E4M3 bytes | D / 32 UE8M0 scales]
        start = split * win_chunk
        end = tl.minimum(start + win_chunk, num_win)
        slot_row = win_ptr + n.to(tl.int64) * win_stride
        rec, ok = _record_rows(slot_row, start + jn, end, swa_num_slots, swa_offset, swa_spb,
                               swa_slot_stride, swa_block_stride, SWA_ALIGN)
        values, scales = _load_swa(swa_ptr, rec, ok, D, SWA_ALIGN)
        for j0 in range(start, end, BLOCK_N):
            if PREFETCH:
                cur_ok = ok
                cur_values = values
                cur_scales = scales
                rec, ok = _record_rows(slot_row, j0 + BLOCK_N + jn, end, swa_num_slots, swa_offset, swa_spb,
                                       swa_slot_stride, swa_block_stride, SWA_ALIGN)
                values, scales = _load_swa(swa_ptr, rec, ok, D, SWA_ALIGN)
            else:
                cur_ok = ok
                cur_values = values
                cur_scales = scales
                if j0 > start:
                    cur_rec, cur_ok = _record_rows(slot_row, j0 + jn, end, swa_num_slots, swa_offset, swa_spb,
                                                   swa_slot_stride, swa_block_stride, SWA_ALIGN)
                    cur_values, cur_scales = _load_swa(swa_ptr, cur_rec, cur_ok, D, SWA_ALIGN)
            k = _decode_swa(cur_values, cur_scales, BLOCK_N, D, HW_CVT)
            acc, m_i, l_i = _attend_tile(q, k, cur_ok, acc, m_i, l_i, sm_scale_log2, DOT_F32)

    if NUM_SPLITS == 1:
        _store_output(out_ptr + n.to(tl.int64) * out_stride_n, out_stride_h, acc * (1.0 / l_i)[:, None],
                      cos_ptr + n.to(tl.int64) * cs_stride, sin_ptr + n.to(tl.int64) * cs_stride,
                      h, h_ok, BLOCK_H, D, ROPE_PAIRS)
    else:
        # partials: acc [N, NUM_SPLITS, H, D], ml [N, NUM_SPLITS, H, 2]
        part = (n.to(tl.int64) * NUM_SPLITS + split) * num_heads + h.to(tl.int64)
        tl.store(part_acc_ptr + part[:, None] * D + c[None, :], acc, mask=h_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=h_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=h_ok)


@triton.jit
def _combine_splits_kernel(
    part_acc_ptr, part_ml_ptr, sink_ptr, cos_ptr, sin_ptr, cs_stride, out_ptr, out_stride_n, out_stride_h,
    num_heads,
    D: tl.constexpr, ROPE_PAIRS: tl.constexpr, BLOCK_H: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Merge the splits of one (token, head block) with the sink, then store like the main kernel."""
    n = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    c = tl.arange(0, D)
    sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * LOG2E
    m = sink
    for s in range(NUM_SPLITS):
        part = (n.to(tl.int64) * NUM_SPLITS + s) * num_heads + h.to(tl.int64)
        m = tl.maximum(m, tl.load(part_ml_ptr + part * 2, mask=h_ok, other=-1.0e30))
    total = tl.exp2(sink - m)
    o = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        part = (n.to(tl.int64) * NUM_SPLITS + s) * num_heads + h.to(tl.int64)
        weight = tl.exp2(tl.load(part_ml_ptr + part * 2, mask=h_ok, other=-1.0e30) - m)
        total += weight * tl.load(part_ml_ptr + part * 2 + 1, mask=h_ok, other=0.0)
        o += weight[:, None] * tl.load(part_acc_ptr + part[:, None] * D + c[None, :], mask=h_ok[:, None], other=0.0)
    _store_output(out_ptr + n.to(tl.int64) * out_stride_n, out_stride_h, o * (1.0 / total)[:, None],
                  cos_ptr + n.to(tl.int64) * cs_stride, sin_ptr + n.to(tl.int64) * cs_stride,
                  h, h_ok, BLOCK_H, D, ROPE_PAIRS)
