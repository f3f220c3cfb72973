"""Triton kernel behind `cedserve.kernels.indexer`: index scores over FP4 index-key records.

Program (group of `TOKENS` query tokens of one request, `TILES` tiles of `BLOCK_T` entries): the
group's queries `[TOKENS * HEADS_P2, d]` are loaded once; per tile the records are decoded once into
(even, odd) channel halves `k_lo, k_hi [BLOCK_T, d / 2]` (E2M1 pairs times UE8M0 scales, exact in
bf16) and multiplied with every query of the group as one MMA,
`s^T = k_lo . q_lo^T + k_hi . q_hi^T` (`[BLOCK_T, TOKENS * HEADS_P2]`, fp32 accumulation), then
`score[t, g] = sum_h relu(s^T[t, g, h]) * scale * w[g, h]`. Entries are either `[0, width)` (range
mode; also writes the max of every `CAND_BLOCK` consecutive entries, level one of the two-level
top-k) or an explicit list per token (list mode, `TOKENS = 1`). Entry `e` of the request is slot
`block_table[req, e // spb] * spb + e % spb`; entries at or past a token's visible count, -1 list
entries and unmapped blocks score -inf.

Record bytes are loaded as `[BLOCK_T, d / 32, 16]` (16 bytes of E2M1 pairs per 32-channel scale
block) and decoded elementwise (see `_sparse_attention_kernels`: with `HW_CVT` each nibble becomes
the E4M3 byte of its value times 2**-6 and the GPU converts it; the fp32 product with the power-of-two
scale times 64 is exact in bf16).
"""
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl

from cedserve.kernels._jit_codecs import _e2m1_decode


@triton.jit
def _decode_index_keys(key_ptr, rec, ok, HALF: tl.constexpr, BLOCK_T: tl.constexpr, HW_CVT: tl.constexpr):
    """(k_lo, k_hi) bf16 [BLOCK_T, HALF] of the index-key records at byte offsets `rec`."""
    blk = tl.arange(0, HALF // 16)
    row = key_ptr + rec
    codes = tl.load(row[:, None, None] + (blk * 16)[None, :, None] + tl.arange(0, 16)[None, None, :],
                    mask=ok[:, None, None], other=0)  # [BLOCK_T, HALF / 16, 16] uint8
    exp = tl.load(row[:, None] + HALF + blk[None, :], mask=ok[:, None], other=127).to(tl.int32)
    if HW_CVT:
        scale = ((exp + 6) << 23).to(tl.float32, bitcast=True)[:, :, None]  # 2**(b - 127) * 64
        lo8 = ((codes & 7) << 2) | ((codes & 8) << 4)  # E2M1 nibble -> E4M3 byte of value * 2**-6
        hi8 = ((codes >> 2) & 0x1C) | (codes & 0x80)
        lo = lo8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
        hi = hi8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    else:
        scale = (exp << 23).to(tl.float32, bitcast=True)[:, :, None]
        c = codes.to(tl.int32)
        lo = _e2m1_decode(c) * scale
        hi = _e2m1_decode(c >> 4) * scale
    return (tl.reshape(lo, [BLOCK_T, HALF]).to(tl.bfloat16), tl.reshape(hi, [BLOCK_T, HALF]).to(tl.bfloat16))


@triton.jit
def _index_scores_kernel(
    q_ptr, q_stride_n, q_stride_h, w_ptr, w_stride_n,
    key_ptr, num_blocks, offset_bytes, slots_per_block, slot_stride_bytes, block_stride_bytes,
    block_table_ptr, bt_stride, max_blocks, token_req_ptr, visible_ptr,
    entries_ptr, entries_stride, num_entries, num_tokens,
    score_ptr, score_stride, block_score_ptr, block_score_stride,
    num_heads, scale,
    HALF: tl.constexpr, HEADS_P2: tl.constexpr, TOKENS: tl.constexpr, BLOCK_T: tl.constexpr, TILES: tl.constexpr,
    LIST_MODE: tl.constexpr, CAND_BLOCK: tl.constexpr, WRITE_SCORES: tl.constexpr, WRITE_BLOCK_MAX: tl.constexpr,
    ALIGN: tl.constexpr, HW_CVT: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Program (group of TOKENS tokens, span of TILES x BLOCK_T entries)."""
    QR: tl.constexpr = TOKENS * HEADS_P2  # query rows of the group: token-major, heads padded
    g = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)  # [TOKENS]
    g_ok = g < num_tokens
    r = tl.arange(0, QR)
    n_r = tl.program_id(0).to(tl.int64) * TOKENS + r // HEADS_P2
    h_r = r % HEADS_P2
    r_ok = (n_r < num_tokens) & (h_r < num_heads)
    q = tl.load(q_ptr + n_r[:, None] * q_stride_n + h_r[:, None] * q_stride_h + tl.arange(0, 2 * HALF)[None, :],
                mask=r_ok[:, None], other=0.0)  # [QR, d]
    q_lo, q_hi = tl.split(tl.reshape(q, [QR, HALF, 2]))
    if DOT_F32:
        q_lo = q_lo.to(tl.float32)
        q_hi = q_hi.to(tl.float32)
    w = tl.load(w_ptr + n_r * w_stride_n + h_r, mask=r_ok, other=0.0).to(tl.float32) * scale  # [QR]
    visible = tl.load(visible_ptr + g, mask=g_ok, other=0)  # [TOKENS]
    req = tl.load(token_req_ptr + tl.program_id(0).to(tl.int64) * TOKENS).to(tl.int64)

    for tile in range(TILES):
        t = (tl.program_id(1) * TILES + tile) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < num_entries
        if LIST_MODE:
            entry = tl.load(entries_ptr + g * entries_stride + t, mask=t_ok, other=-1)
        else:
            entry = t
        ok = t_ok & (entry >= 0)
        entry = tl.where(ok, entry, 0)
        block_idx = entry // slots_per_block
        ok = ok & (block_idx < max_blocks)
        block = tl.load(block_table_ptr + req * bt_stride + block_idx, mask=ok, other=-1).to(tl.int64)
        ok = ok & (block >= 0) & (block < num_blocks)
        block = tl.where(ok, block, 0)
        rec = offset_bytes + block * block_stride_bytes + (entry - block_idx * slots_per_block) * slot_stride_bytes
        k_lo, k_hi = _decode_index_keys(key_ptr, tl.multiple_of(rec, ALIGN), ok, HALF, BLOCK_T, HW_CVT)
        if DOT_F32:
            k_lo = k_lo.to(tl.float32)
            k_hi = k_hi.to(tl.float32)
        s = tl.dot(k_lo, tl.trans(q_lo))
        s = tl.dot(k_hi, tl.trans(q_hi), s)  # [BLOCK_T, QR]
        contrib = tl.maximum(s, 0.0) * w[None, :]
        score = tl.sum(tl.reshape(contrib, [BLOCK_T, TOKENS, HEADS_P2]), axis=2)  # [BLOCK_T, TOKENS]
        score = tl.where(ok[:, None] & (entry[:, None] < visible[None, :]), score, float("-inf"))
        if WRITE_SCORES:
            tl.store(score_ptr + g[None, :] * score_stride + t[:, None], score, mask=t_ok[:, None] & g_ok[None, :])
        if WRITE_BLOCK_MAX:
            block_max = tl.max(tl.reshape(score, [BLOCK_T // CAND_BLOCK, CAND_BLOCK, TOKENS]), axis=1)
            b = (tl.program_id(1) * TILES + tile) * (BLOCK_T // CAND_BLOCK) + tl.arange(0, BLOCK_T // CAND_BLOCK)
            tl.store(block_score_ptr + g[None, :] * block_score_stride + b[:, None], block_max,
                     mask=(b * CAND_BLOCK < num_entries)[:, None] & g_ok[None, :])
