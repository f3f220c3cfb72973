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
def _load_main(main_ptr, rec, ok, first_block, D: tl.constexpr, C: tl.constexpr, ALIGN: tl.constexpr):
    """Raw main-KV records, channels `[16 * first_block, 16 * first_block + C)`: (codes int32
    [BLOCK_N, C // 16, 2]: the 8 bytes of E2M1 pairs of each 16-channel scale block, E4M3 scale
    bytes uint8 [BLOCK_N, C // 16])."""
    row = main_ptr + rec
    codes = _load_words(row + first_block * 8, ok, C // 16, 2, ALIGN)
    scales = tl.load(row[:, None] + (D // 2 + first_block) + tl.arange(0, C // 16)[None, :], mask=ok[:, None],
                     other=0x38)  # 0x38 = 1.0
    return codes, scales


@triton.jit
def _bytes_of(words):
    """int32 words `[N, B, W]` -> their bytes, low first, as uint8 `[N, B, W, 4]`."""
    return ((words[:, :, :, None] >> (tl.arange(0, 4) * 8)) & 0xFF).to(tl.uint8)


@triton.jit
def _decode_main(codes, scales, BLOCK_N: tl.constexpr, C: tl.constexpr, HW_CVT: tl.constexpr):
    """Main-KV keys [BLOCK_N, C] bf16 (exact) from `_load_main`'s words: byte `4k + t` of a block's
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
    return tl.reshape(tl.join(lo, hi), [BLOCK_N, C]).to(tl.bfloat16)


@triton.jit
def _load_swa(swa_ptr, rec, ok, first_block, D: tl.constexpr, C: tl.constexpr, ALIGN: tl.constexpr):
    """Raw SWA records, channels `[32 * first_block, 32 * first_block + C)`: (E4M3 bytes as int32
    words [BLOCK_N, C // 32, 8], UE8M0 bytes uint8 [BLOCK_N, C // 32])."""
    row = swa_ptr + rec
    values = _load_words(row + first_block * 32, ok, C // 32, 8, ALIGN)
    scales = tl.load(row[:, None] + (D + first_block) + tl.arange(0, C // 32)[None, :], mask=ok[:, None],
                     other=127)
    return values, scales


@triton.jit
def _decode_swa(values, scales, BLOCK_N: tl.constexpr, C: tl.constexpr, HW_CVT: tl.constexpr):
    """SWA keys [BLOCK_N, C] bf16 (exact) from `_load_swa`'s words."""
    scale = (scales.to(tl.int32) << 23).to(tl.float32, bitcast=True)[:, :, None, None]  # 2**(b - 127)
    if HW_CVT:
        v = _bytes_of(values).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        v = _e4m3_decode((values[:, :, :, None] >> (tl.arange(0, 4) * 8)) & 0xFF)
    return tl.reshape(v * scale, [BLOCK_N, C]).to(tl.bfloat16)


@triton.jit
def _attend_tile(q, k, q2, k2, ok, acc, m_i, l_i, sm_scale_log2, TWO: tl.constexpr, DOT_F32: tl.constexpr):
    """One online-softmax step over a tile of keys (K = V): logits `q . k^T (+ q2 . k2^T when TWO)`,
    `acc += p . k`. `k [BLOCK_N, C]` holds the channels this program accumulates, `k2` the rest."""
    if DOT_F32:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k))  # [BLOCK_H, BLOCK_N]
    if TWO:
        if DOT_F32:
            k2 = k2.to(tl.float32)
        s = tl.dot(q2, tl.trans(k2), s)
    s = tl.where(ok[None, :], s * sm_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(k.dtype), k, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _store_output(out_ptr, out_stride_h, o, first_channel, cos_ptr, sin_ptr, h, h_ok, BLOCK_H: tl.constexpr,
                  D: tl.constexpr, C: tl.constexpr, ROPE_PAIRS: tl.constexpr):
    """Inverse-RoPE (the last ROPE_PAIRS channel pairs of the head) and store `o [BLOCK_H, C]`, the
    channels `[first_channel, first_channel + C)` of the output rows."""
    even, odd = tl.split(tl.reshape(o, [BLOCK_H, C // 2, 2]))
    pair = first_channel // 2 + tl.arange(0, C // 2) - (D // 2 - ROPE_PAIRS)
    is_rope = pair >= 0
    cos = tl.load(cos_ptr + pair, mask=is_rope, other=1.0)[None, :]
    sin = tl.load(sin_ptr + pair, mask=is_rope, other=0.0)[None, :]
    o = tl.reshape(tl.join(even * cos + odd * sin, odd * cos - even * sin), [BLOCK_H, C])
    ptr = out_ptr + h[:, None].to(tl.int64) * out_stride_h + first_channel + tl.arange(0, C)[None, :]
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
    NUM_SPLITS: tl.constexpr, DV_SPLIT: tl.constexpr, HAS_MAIN: tl.constexpr, HAS_SWA: tl.constexpr,
    MAIN_ALIGN: tl.constexpr, SWA_ALIGN: tl.constexpr, HW_CVT: tl.constexpr, PREFETCH: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Program (token n, head block x value half, key split): attend `BLOCK_H` heads of token n over
    its split of the selected main-KV entries (`topk_slots[n]`) and of its window
    (`window_slots[n]`), accumulating the output channels `[dv * C, dv * C + C)`, C = D / DV_SPLIT
    (DV_SPLIT = 2 halves the accumulator's registers; both halves compute the full logits)."""
    C: tl.constexpr = D // DV_SPLIT
    TWO: tl.constexpr = DV_SPLIT == 2
    n = tl.program_id(0)
    h = (tl.program_id(1) // DV_SPLIT) * BLOCK_H + tl.arange(0, BLOCK_H)
    dv = tl.program_id(1) % DV_SPLIT
    split = tl.program_id(2)
    h_ok = h < num_heads
    mine = dv * C  # first channel of this program's value half; the other half starts at `other`
    other = (1 - dv) * C
    cc = tl.arange(0, C)

    q_row = q_ptr + n.to(tl.int64) * q_stride_n + h[:, None].to(tl.int64) * q_stride_h
    q = tl.load(q_row + mine + cc[None, :], mask=h_ok[:, None], other=0.0)  # [BLOCK_H, C]
    q2 = q
    if TWO:
        q2 = tl.load(q_row + other + cc[None, :], mask=h_ok[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
        q2 = q2.to(tl.float32)
    acc = tl.zeros([BLOCK_H, C], dtype=tl.float32)
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
        codes, scales = _load_main(main_ptr, rec, ok, mine // 16, D, C, MAIN_ALIGN)
        codes2, scales2 = codes, scales
        if TWO:
            codes2, scales2 = _load_main(main_ptr, rec, ok, other // 16, D, C, MAIN_ALIGN)
        for j0 in range(start, end, BLOCK_N):
            cur_ok, cur_codes, cur_scales, cur_codes2, cur_scales2 = ok, codes, scales, codes2, scales2
            if PREFETCH:  # the next tile's records are in flight while this one is decoded and multiplied
                rec, ok = _record_rows(slot_row, j0 + BLOCK_N + jn, end, main_num_slots, main_offset,
                                       main_spb, main_slot_stride, main_block_stride, MAIN_ALIGN)
                codes, scales = _load_main(main_ptr, rec, ok, mine // 16, D, C, MAIN_ALIGN)
                if TWO:
                    codes2, scales2 = _load_main(main_ptr, rec, ok, other // 16, D, C, MAIN_ALIGN)
            elif j0 > start:
                cur_rec, cur_ok = _record_rows(slot_row, j0 + jn, end, main_num_slots, main_offset,
                                               main_spb, main_slot_stride, main_block_stride, MAIN_ALIGN)
                cur_codes, cur_scales = _load_main(main_ptr, cur_rec, cur_ok, mine // 16, D, C, MAIN_ALIGN)
                if TWO:
                    cur_codes2, cur_scales2 = _load_main(main_ptr, cur_rec, cur_ok, other // 16, D, C, MAIN_ALIGN)
            k = _decode_main(cur_codes, cur_scales, BLOCK_N, C, HW_CVT)
            k2 = k
            if TWO:
                k2 = _decode_main(cur_codes2, cur_scales2, BLOCK_N, C, HW_CVT)
            acc, m_i, l_i = _attend_tile(q, k, q2, k2, cur_ok, acc, m_i, l_i, sm_scale_log2, TWO, DOT_F32)

    if HAS_SWA:  # FP8 records: [D E4M3 bytes | D / 32 UE8M0 scales]
        start = split * win_chunk
        end = tl.minimum(start + win_chunk, num_win)
        slot_row = win_ptr + n.to(tl.int64) * win_stride
        rec, ok = _record_rows(slot_row, start + jn, end, swa_num_slots, swa_offset, swa_spb,
                               swa_slot_stride, swa_block_stride, SWA_ALIGN)
        values, scales = _load_swa(swa_ptr, rec, ok, mine // 32, D, C, SWA_ALIGN)
        values2, scales2 = values, scales
        if TWO:
            values2, scales2 = _load_swa(swa_ptr, rec, ok, other // 32, D, C, SWA_ALIGN)
        for j0 in range(start, end, BLOCK_N):
            cur_ok, cur_values, cur_scales, cur_values2, cur_scales2 = ok, values, scales, values2, scales2
            if PREFETCH:
                rec, ok = _record_rows(slot_row, j0 + BLOCK_N + jn, end, swa_num_slots, swa_offset, swa_spb,
                                       swa_slot_stride, swa_block_stride, SWA_ALIGN)
                values, scales = _load_swa(swa_ptr, rec, ok, mine // 32, D, C, SWA_ALIGN)
                if TWO:
                    values2, scales2 = _load_swa(swa_ptr, rec, ok, other // 32, D, C, SWA_ALIGN)
            elif j0 > start:
                cur_rec, cur_ok = _record_rows(slot_row, j0 + jn, end, swa_num_slots, swa_offset, swa_spb,
                                               swa_slot_stride, swa_block_stride, SWA_ALIGN)
                cur_values, cur_scales = _load_swa(swa_ptr, cur_rec, cur_ok, mine // 32, D, C, SWA_ALIGN)
                if TWO:
                    cur_values2, cur_scales2 = _load_swa(swa_ptr, cur_rec, cur_ok, other // 32, D, C, SWA_ALIGN)
            k = _decode_swa(cur_values, cur_scales, BLOCK_N, C, HW_CVT)
            k2 = k
            if TWO:
                k2 = _decode_swa(cur_values2, cur_scales2, BLOCK_N, C, HW_CVT)
            acc, m_i, l_i = _attend_tile(q, k, q2, k2, cur_ok, acc, m_i, l_i, sm_scale_log2, TWO, DOT_F32)

    if NUM_SPLITS == 1:
        _store_output(out_ptr + n.to(tl.int64) * out_stride_n, out_stride_h, acc * (1.0 / l_i)[:, None], mine,
                      cos_ptr + n.to(tl.int64) * cs_stride, sin_ptr + n.to(tl.int64) * cs_stride,
                      h, h_ok, BLOCK_H, D, C, ROPE_PAIRS)
    else:
        # partials: acc [N, NUM_SPLITS, H, D], ml [N, NUM_SPLITS, H, 2] (both value halves write the same ml)
        part = (n.to(tl.int64) * NUM_SPLITS + split) * num_heads + h.to(tl.int64)
        tl.store(part_acc_ptr + part[:, None] * D + mine + cc[None, :], acc, mask=h_ok[:, None])
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
    _store_output(out_ptr + n.to(tl.int64) * out_stride_n, out_stride_h, o * (1.0 / total)[:, None], 0,
                  cos_ptr + n.to(tl.int64) * cs_stride, sin_ptr + n.to(tl.int64) * cs_stride,
                  h, h_ok, BLOCK_H, D, D, ROPE_PAIRS)
