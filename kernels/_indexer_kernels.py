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

v4 (`VERSION=4`, the default): the codes are read as 32-bit words (8 nibbles, channels
`8w .. 8w + 7` of word `w`) and decoded with word-wide integer ops into bf16 pairs, no per-byte
work: for `j` in 0..3, `P_j = (W >> 4j) << 6 & 0x01C001C0 | (W >> 4j) << 12 & 0x80008000` puts
nibble `j` (channel `8w + j`) in the low bf16 and nibble `j + 4` in the high one, sign to bit 15,
the 3 magnitude bits to bits 8..6. A bf16 with those bits is exactly the E2M1 value times 2**-126
(E2M1 is the same float layout; its subnormal 0.5 lands on a bf16 subnormal), so one bf16 multiply
by `2**(b - 1 - QSHIFT)` per pair applies the block scale `2**(b - 127)`, with the queries
pre-multiplied by `2**QSHIFT` (exact) so that the multiplier stays finite: exact for scale bytes
`QSHIFT - 5 <= b <= QSHIFT + 128` (59..192 at QSHIFT = 64, block maxima from 2**-68 to 2**65).
The four pair tensors are four MMAs of K = d / 4 against the matching query channels.

`PREFETCH=1` (v4's default): the loop carries the next tile's slots (list entries, block ids,
record offsets), loaded while the current tile is decoded, so each tile waits on one dependent
load (its records) instead of two (block ids, then records).
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
def _load_q_pairs(q_row, channels, r_ok, QSHIFT: tl.constexpr, DOT_F32: tl.constexpr):
    """Query channels `channels [2 * NW]` of every row, times 2**QSHIFT (exact), as a dot operand."""
    q = tl.load(q_row + channels[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32) * (2.0**QSHIFT)
    return q if DOT_F32 else q.to(tl.bfloat16)


@triton.jit
def _decode_index_words(key_ptr, rec, ok, HALF: tl.constexpr, BLOCK_T: tl.constexpr, ALIGN: tl.constexpr,
                        QSHIFT: tl.constexpr, DOT_F32: tl.constexpr):
    """v4 decode: (K_0, K_1, K_2, K_3) `[BLOCK_T, HALF / 2]` of the index-key records at byte
    offsets `rec`, K_j[:, 2w + i] = key channel 8w + 4i + j times 2**-QSHIFT (module docstring)."""
    NW: tl.constexpr = HALF // 4
    w = tl.arange(0, NW)
    row = key_ptr + rec
    if ALIGN >= 4:
        words = tl.load((row[:, None] + w[None, :] * 4).to(tl.pointer_type(tl.int32)), mask=ok[:, None], other=0)
    else:  # records not 4-byte aligned: the same words from 4 byte loads
        b = row[:, None] + w[None, :] * 4
        words = tl.load(b, mask=ok[:, None], other=0).to(tl.int32)
        words = words | (tl.load(b + 1, mask=ok[:, None], other=0).to(tl.int32) << 8)
        words = words | (tl.load(b + 2, mask=ok[:, None], other=0).to(tl.int32) << 16)
        words = words | (tl.load(b + 3, mask=ok[:, None], other=0).to(tl.int32) << 24)
    exp = tl.load(row[:, None] + HALF + w[None, :] // 4, mask=ok[:, None], other=127).to(tl.int32)  # [T, NW]
    # the bf16 2**(b - 1 - QSHIFT), finite for b <= QSHIFT + 128, twice (a bf16x2 word)
    mult = tl.minimum(exp + (126 - QSHIFT), 254) << 7
    mult = mult | (mult << 16)
    k0 = _pairs_bf16(words, mult, BLOCK_T, NW, DOT_F32)
    k1 = _pairs_bf16(words >> 4, mult, BLOCK_T, NW, DOT_F32)
    k2 = _pairs_bf16(words >> 8, mult, BLOCK_T, NW, DOT_F32)
    k3 = _pairs_bf16(words >> 12, mult, BLOCK_T, NW, DOT_F32)
    return k0, k1, k2, k3


@triton.jit
def _pairs_bf16(a, mult, BLOCK_T: tl.constexpr, NW: tl.constexpr, DOT_F32: tl.constexpr):
    """Nibbles 0 and 4 of the int32 words `a [T, NW]` as bf16 `[T, 2 * NW]` (nibble 0 first) times
    the bf16x2 words `mult`: `x = a & 0x000F000F`, `x * 0x1040 & 0x81C081C0` (the two shifted
    copies do not overlap) puts each nibble's sign at bit 15 and its magnitude at bits 8..6."""
    if DOT_F32:  # interpreter: its bf16 multiply and bf16 -> fp32 conversion (of subnormals) are wrong,
        # so widen on the bits (exact) and multiply in fp32 (exact: a power of two, no underflow)
        bits = ((a & 0x000F000F) * 0x1040) & -2118090304  # 0x81C081C0 as int32
        lo = (bits << 16).to(tl.float32, bitcast=True)
        hi = (bits & -65536).to(tl.float32, bitcast=True)
        m = (mult << 16).to(tl.float32, bitcast=True)
        pair = tl.join(lo, hi) * m[:, :, None]
    else:  # the same on one 32-bit register per pair, bf16x2 multiply: E2M1 * 2**-126 * 2**(b - 1 - QSHIFT), exact
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; and.b32 t, $2, 0x000F000F; mul.lo.u32 t, t, 0x1040; and.b32 t, t, 0x81C081C0;"
            " mul.rn.bf16x2 t, t, $3; mov.b32 {$0, $1}, t; }",
            "=h,=h,r,r", [a, mult], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
        pair = tl.join(lo, hi)
    return tl.reshape(pair, [BLOCK_T, 2 * NW])


@triton.jit
def _tile_records(tile, g, req, entries_ptr, entries_stride, num_entries, block_table_ptr, bt_stride, max_blocks,
                  num_blocks, offset_bytes, slots_per_block, slot_stride_bytes, block_stride_bytes,
                  BLOCK_T: tl.constexpr, LIST_MODE: tl.constexpr):
    """(entry index t, t in range, entry, entry readable, record byte offset) of tile `tile`'s rows."""
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
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
    return t, t_ok, entry, ok, rec


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
    ALIGN: tl.constexpr, HW_CVT: tl.constexpr, DOT_F32: tl.constexpr, VERSION: tl.constexpr = 4,
    QSHIFT: tl.constexpr = 64, PREFETCH: tl.constexpr = 0, offsets_ptr=None, RUNS: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Program (group of TOKENS tokens, span of TILES x BLOCK_T entries). `RUNS`: program axis 0 is a
    token n instead, and the group is the run of consecutive rows starting at n (`offsets[n] == 0`
    and the next rows' offsets 1, 2, ..., at most TOKENS of them: one request's verify rows); a
    program whose token does not start a run does nothing."""
    if PDL:  # programmatic dependent launch: wait for the kernels before, let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    QR: tl.constexpr = TOKENS * HEADS_P2  # query rows of the group: token-major, heads padded
    if RUNS:
        base = tl.program_id(0).to(tl.int64)
    else:
        base = tl.program_id(0).to(tl.int64) * TOKENS
    g = base + tl.arange(0, TOKENS)  # [TOKENS]
    g_ok = g < num_tokens
    r = tl.arange(0, QR)
    n_r = base + r // HEADS_P2
    h_r = r % HEADS_P2
    r_ok = (n_r < num_tokens) & (h_r < num_heads)
    span = TILES
    if RUNS:  # (offsets loaded as tensors: the interpreter takes no scalar & tensor as a mask)
        g_ok = g_ok & (tl.load(offsets_ptr + g, mask=g_ok, other=-1) == tl.arange(0, TOKENS))
        g_ok = g_ok & (tl.load(offsets_ptr + base + 0 * g) == 0)
        r_ok = r_ok & (tl.load(offsets_ptr + n_r, mask=n_r < num_tokens, other=-1) == r // HEADS_P2)
        r_ok = r_ok & (tl.load(offsets_ptr + base + 0 * r) == 0)
        span = tl.where(tl.load(offsets_ptr + base) == 0, TILES, 0)
    q_row = q_ptr + n_r[:, None] * q_stride_n + h_r[:, None] * q_stride_h
    if VERSION == 4:
        NW: tl.constexpr = HALF // 4  # 32-bit code words per record
        # query channels in the order of the decoded pairs: Q_j[:, 2w + i] = q[:, 8w + 4i + j]
        qc = tl.reshape(tl.arange(0, NW)[:, None] * 8 + tl.arange(0, 2)[None, :] * 4, [2 * NW])
        q0 = _load_q_pairs(q_row, qc, r_ok, QSHIFT, DOT_F32)
        q1 = _load_q_pairs(q_row, qc + 1, r_ok, QSHIFT, DOT_F32)
        q2 = _load_q_pairs(q_row, qc + 2, r_ok, QSHIFT, DOT_F32)
        q3 = _load_q_pairs(q_row, qc + 3, r_ok, QSHIFT, DOT_F32)
    else:
        q = tl.load(q_row + tl.arange(0, 2 * HALF)[None, :], mask=r_ok[:, None], other=0.0)  # [QR, d]
        q_lo, q_hi = tl.split(tl.reshape(q, [QR, HALF, 2]))
        if DOT_F32:
            q_lo = q_lo.to(tl.float32)
            q_hi = q_hi.to(tl.float32)
    w = tl.load(w_ptr + n_r * w_stride_n + h_r, mask=r_ok, other=0.0).to(tl.float32) * scale  # [QR]
    visible = tl.load(visible_ptr + g, mask=g_ok, other=0)  # [TOKENS]
    req = tl.load(token_req_ptr + base).to(tl.int64)

    first = tl.program_id(1) * TILES
    if PREFETCH:  # the next tile's slots (list entries, block ids) are loaded a tile ahead
        n_t, n_t_ok, n_entry, n_ok, n_rec = _tile_records(
            first, g, req, entries_ptr, entries_stride, num_entries, block_table_ptr, bt_stride, max_blocks,
            num_blocks, offset_bytes, slots_per_block, slot_stride_bytes, block_stride_bytes, BLOCK_T, LIST_MODE)
    for tile in range(span):
        if PREFETCH:
            t, t_ok, entry, ok, rec = n_t, n_t_ok, n_entry, n_ok, n_rec
            n_t, n_t_ok, n_entry, n_ok, n_rec = _tile_records(
                first + tile + 1, g, req, entries_ptr, entries_stride, num_entries, block_table_ptr, bt_stride,
                max_blocks, num_blocks, offset_bytes, slots_per_block, slot_stride_bytes, block_stride_bytes, BLOCK_T,
                LIST_MODE)
        else:  # written out, not `_tile_records`: through the call Triton 3.6 neither pipelines nor
            # vectorises v3's record loads (sm_90 SASS per tile: 68 LDG.U8 instead of 34 LDGSTS)
            t = (first + tile) * BLOCK_T + tl.arange(0, BLOCK_T)
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
        if VERSION == 4:
            k0, k1, k2, k3 = _decode_index_words(key_ptr, tl.multiple_of(rec, ALIGN), ok, HALF, BLOCK_T, ALIGN,
                                                 QSHIFT, DOT_F32)
            s = tl.dot(k0, tl.trans(q0))
            s = tl.dot(k1, tl.trans(q1), s)
            s = tl.dot(k2, tl.trans(q2), s)
            s = tl.dot(k3, tl.trans(q3), s)  # [BLOCK_T, QR]
        else:
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


@triton.jit
def _radix_digit(key, active, remaining, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """One radix pass of `_topk_select_kernel`: among the `active` keys, the digit (`BITS` bits
    from `SHIFT`) of the `remaining`-th largest, how many active keys have a higher digit, and
    how many have that digit."""
    digit = ((key >> SHIFT) & ((1 << BITS) - 1)).to(tl.int32)
    hist = tl.histogram(digit, 1 << BITS, mask=active)
    at_least = tl.cumsum(hist, 0, reverse=True)  # keys with this digit or a higher one
    d = tl.sum((at_least >= remaining).to(tl.int32), 0) - 1
    bins = tl.arange(0, 1 << BITS)
    above = tl.sum(tl.where(bins == d, at_least - hist, 0), 0)
    return d, above, tl.sum(tl.where(bins == d, hist, 0), 0)


@triton.jit
def _radix_pass(key, valid, prefix, remaining, P: tl.constexpr, RADIX_BITS: tl.constexpr, NPASS: tl.constexpr):
    """Pass `P` of `_topk_select_kernel`'s select: (prefix with this pass's digit of the k-th key,
    keys still to take among those matching it, how many keys match it)."""
    if P == 0:
        active = valid
    else:  # the keys that match the digits decided so far
        active = valid & ((key >> (32 - RADIX_BITS * P)) == (prefix >> (32 - RADIX_BITS * P)))
    if P == NPASS - 1:  # the last digit: the bits left
        d, above, count = _radix_digit(key, active, remaining, 0, 32 - RADIX_BITS * P)
        prefix = prefix | d.to(tl.uint32)
    else:
        d, above, count = _radix_digit(key, active, remaining, 32 - RADIX_BITS * (P + 1), RADIX_BITS)
        prefix = prefix | (d.to(tl.uint32) << (32 - RADIX_BITS * (P + 1)))
    return prefix, remaining - above, count  # (the keys above the k-th one's digit are kept)


@triton.jit
def _topk_select_kernel(scores_ptr, scores_stride, entries_ptr, entries_stride, out_ptr, out_stride, values_ptr,
                        values_stride, width, k, chunk, BLOCK_T: tl.constexpr, HAS_ENTRIES: tl.constexpr,
                        CHUNKED: tl.constexpr, RADIX_BITS: tl.constexpr, EARLY_EXIT: tl.constexpr, PDL: tl.constexpr = False):
    """One row, or one `chunk`-wide part of it (program axis 1): the ids of its `k` best scores
    (ties at the k-th value taken in column order), unsorted. The part is held in registers as
    order-preserving uint32 keys; a radix select (passes of `RADIX_BITS` bits, each a histogram
    of the keys still matching the prefix found so far) finds the k-th key, then a prefix sum
    gives each kept column its output position. `EARLY_EXIT`: passes stop once the keys that share
    the k-th key's digits so far are exactly the ones still to take (all of them are kept).

    Whole rows (`CHUNKED=False`, `chunk >= width`): `out[row, :k]`, -1 where the score is -inf.
    Parts (`CHUNKED=True`): part `c` writes its `k` best as (score, id) to columns
    `[c * k, (c + 1) * k)` of `values` / `out`, padded with (-inf, -1) when it has fewer, in
    column order of the kept ones, so that a select over the concatenation keeps the row's
    order (score, then column) and with it the same top-k as one program over the row."""
    if PDL:  # programmatic dependent launch: wait for the kernels before, let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    start = part * chunk
    col = start + tl.arange(0, BLOCK_T)
    valid = (tl.arange(0, BLOCK_T) < chunk) & (col < width)
    kk = tl.minimum(k, tl.minimum(chunk, width - start))
    x = tl.load(scores_ptr + row * scores_stride + col, mask=valid, other=float("-inf"))
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)  # unsigned order == float order
    prefix = tl.zeros([], dtype=tl.uint32)
    remaining = kk
    NPASS: tl.constexpr = (32 + RADIX_BITS - 1) // RADIX_BITS
    done = tl.zeros([], dtype=tl.int32)
    for p in tl.static_range(NPASS):
        if EARLY_EXIT:
            if done == 0:  # (a runtime branch: the passes after the k-th key's digits are decided)
                prefix, remaining, count = _radix_pass(key, valid, prefix, remaining, p, RADIX_BITS, NPASS)
                done = (count == remaining).to(tl.int32)  # the keys sharing its digits are all kept
        else:
            prefix, remaining, count = _radix_pass(key, valid, prefix, remaining, p, RADIX_BITS, NPASS)
    # `prefix` is the k-th key: every key above it is kept, and the first `remaining` equal to it;
    # or (`done`) its digits so far, the rest zero: every key from it up is kept
    equal = valid & (key == prefix)
    take = (valid & (key > prefix)) | (equal & (tl.cumsum(equal.to(tl.int32), 0) <= remaining))
    if EARLY_EXIT:
        take = tl.where(done != 0, valid & (key >= prefix), take)
    pos = tl.cumsum(take.to(tl.int32), 0) - 1
    if HAS_ENTRIES:
        ids = tl.load(entries_ptr + row * entries_stride + col, mask=take, other=-1).to(tl.int32)
    else:
        ids = col
    if CHUNKED:
        base = part * k
        tl.store(out_ptr + row * out_stride + base + pos, ids, mask=take)
        tl.store(values_ptr + row * values_stride + base + pos, x, mask=take)
        pad = tl.arange(0, BLOCK_T)
        short = (pad >= kk) & (pad < k)  # a part with fewer than k columns: (-inf, -1) after its own
        tl.store(out_ptr + row * out_stride + base + pad, tl.full([BLOCK_T], -1, tl.int32), mask=short)
        tl.store(values_ptr + row * values_stride + base + pad, tl.full([BLOCK_T], float("-inf"), tl.float32),
                 mask=short)
    else:
        ids = tl.where(key > 0x007FFFFF, ids, -1)  # (0x007FFFFF: -inf's key)
        tl.store(out_ptr + row * out_stride + pos, ids, mask=take)
