"""Triton kernel behind `cedserve.kernels.indexer`: index scores over FP4 index-key records.

Program (token n, `TILES` tiles of `BLOCK_T` entries): per tile, decode the records (E2M1 pairs times UE8M0
scales, exact in bf16) into (even, odd) channel halves, `s = q_lo . k_lo^T + q_hi . k_hi^T`
(`[heads, BLOCK_T]`, fp32 accumulation), then `score = sum_h relu(s) * scale * w[h]`. Entries are
either `[0, width)` (range mode; also writes the max of every `CAND_BLOCK` consecutive entries,
level one of the two-level top-k) or an explicit list per token (list mode). Entry `e` of the
token's request is slot `block_table[req, e // spb] * spb + e % spb`; entries at or past the
token's visible count, -1 list entries and unmapped blocks score -inf.
"""
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl

from cedserve.kernels._jit_codecs import _e2m1_decode, _slot_address


@triton.jit
def _index_scores_kernel(
    q_ptr, q_stride_n, q_stride_h, w_ptr, w_stride_n,
    key_ptr, num_slots, offset_bytes, slots_per_block, slot_stride_bytes, block_stride_bytes,
    block_table_ptr, bt_stride, max_blocks, token_req_ptr, visible_ptr,
    entries_ptr, entries_stride, num_entries,
    score_ptr, score_stride, block_score_ptr, block_score_stride,
    num_heads, scale,
    HALF: tl.constexpr, HEADS_P2: tl.constexpr, BLOCK_T: tl.constexpr, TILES: tl.constexpr,
    LIST_MODE: tl.constexpr, CAND_BLOCK: tl.constexpr, WRITE_SCORES: tl.constexpr, WRITE_BLOCK_MAX: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Program (token n, span of TILES x BLOCK_T entries): the token's queries are loaded once."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_P2)
    h_ok = h < num_heads
    i = tl.arange(0, HALF)
    q_row = q_ptr + n * q_stride_n + h[:, None] * q_stride_h + 2 * i[None, :]
    q_lo = tl.load(q_row, mask=h_ok[:, None], other=0.0)
    q_hi = tl.load(q_row + 1, mask=h_ok[:, None], other=0.0)
    if DOT_F32:
        q_lo = q_lo.to(tl.float32)
        q_hi = q_hi.to(tl.float32)
    w = tl.load(w_ptr + n * w_stride_n + h, mask=h_ok, other=0.0).to(tl.float32) * scale
    visible = tl.load(visible_ptr + n).to(tl.int64)
    req = tl.load(token_req_ptr + n).to(tl.int64)

    for tile in range(TILES):
        t = (tl.program_id(1) * TILES + tile) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < num_entries
        if LIST_MODE:
            entry = tl.load(entries_ptr + n * entries_stride + t, mask=t_ok, other=-1).to(tl.int64)
        else:
            entry = t.to(tl.int64)
        ok = t_ok & (entry >= 0) & (entry < visible)
        entry = tl.where(ok, entry, 0)
        block_idx = entry // slots_per_block
        ok = ok & (block_idx < max_blocks)
        block = tl.load(block_table_ptr + req * bt_stride + block_idx, mask=ok, other=-1).to(tl.int64)
        slot = tl.where(block >= 0, block * slots_per_block + (entry - block_idx * slots_per_block), -1)
        rec, rec_ok = _slot_address(slot, num_slots, offset_bytes, slots_per_block, slot_stride_bytes,
                                    block_stride_bytes)
        ok = ok & rec_ok

        row = key_ptr + rec[:, None]
        codes = tl.load(row + i[None, :], mask=ok[:, None], other=0).to(tl.int32)  # [BLOCK_T, HALF]
        exp = tl.load(row + HALF + (i // 16)[None, :], mask=ok[:, None], other=127).to(tl.int32)
        k_scale = (exp << 23).to(tl.float32, bitcast=True)
        k_lo = (_e2m1_decode(codes) * k_scale).to(tl.bfloat16)
        k_hi = (_e2m1_decode(codes >> 4) * k_scale).to(tl.bfloat16)
        if DOT_F32:
            s = tl.dot(q_lo, tl.trans(k_lo.to(tl.float32)))
            s += tl.dot(q_hi, tl.trans(k_hi.to(tl.float32)))
        else:
            s = tl.dot(q_lo, tl.trans(k_lo))
            s = tl.dot(q_hi, tl.trans(k_hi), s)  # [HEADS_P2, BLOCK_T]
        score = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
        score = tl.where(ok, score, float("-inf"))
        if WRITE_SCORES:
            tl.store(score_ptr + n * score_stride + t, score, mask=t_ok)
        if WRITE_BLOCK_MAX:
            block_max = tl.max(tl.reshape(score, [BLOCK_T // CAND_BLOCK, CAND_BLOCK]), axis=1)
            b = (tl.program_id(1) * TILES + tile) * (BLOCK_T // CAND_BLOCK) + tl.arange(0, BLOCK_T // CAND_BLOCK)
            tl.store(block_score_ptr + n * block_score_stride + b, block_max, mask=b * CAND_BLOCK < num_entries)
