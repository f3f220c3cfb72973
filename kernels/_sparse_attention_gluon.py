"""Gluon kernel behind `cedserve.kernels.sparse_attention` on Hopper (`AttentionConfig(kernel="gluon")`,
the default on sm_90). v20: v11 with main-KV code words decoded straight to bf16 pairs and slot ->
block by shift (v16), the first tile's loads before Q's (v18) and fp16 partials divided by their
sums (v20); kernels-notes.md. The earlier sides of those switches were removed (docs/kernels.md).

The same math as `_sparse_decode_attention_kernel` (read that module's docstring first: channel
halves, E2M1 -> E4M3 decode, base-2 online softmax, split-KV partials), written in Gluon so that
the layouts the Triton kernel could not choose are ours (kernels-notes.md, "Profile"):

* one CTA of two warpgroups takes all 64 heads of a token (the MMAs' M) over a contiguous run of
  that token's key tiles and writes split-KV partials, which `_combine_splits_kernel` merges (a
  merge inside the last split's CTA, behind a per-token counter, lost at every batch from run 36
  on and was removed after run 45; kernels-notes.md, v16 and run 45);
* a thread decodes 4 code words of a main-KV record (one 16-byte load; one inline-PTX block per
  word) and stores the bf16 pairs to shared memory as 16-byte vectors in the
  NVMMA-swizzled layout that `wgmma` reads (the Triton kernel staged decoded keys with 16-bit
  stores);
* `S = Q . K^T` and `acc += P . K` are asynchronous warpgroup MMAs reading Q, K and P from shared
  memory; K is double-buffered, and tile t + 1 is loaded and decoded while tile t's `P . K` runs
  (its slot ids loaded before tile t's `S`);
* the two warpgroups split the keys of `S` (32 each) and the value channels of `acc` (128 of each
  256-channel half each: 128 fp32 registers per thread for the accumulators).

Hopper only (sm_90, 8 warps, 64 heads, D = 512, 16-byte aligned records): `sparse_attention`
falls back to the Triton kernel for anything else, and the CPU interpreter cannot run Gluon, so
this kernel is tested on the GPU only (tests/kernels/test_sparse_attention.py, CUDA tier).
"""
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from cedserve.kernels._records_gluon import _gl_slot_address


@gluon.jit
def _gl_slot_valid(slot_row_ptr, j, end, num_slots):
    """Whether the slots `slot_row_ptr[j]` (for `j < end`, else none) name records (S's key mask)."""
    slot = gl.load(slot_row_ptr + j, mask=j < end, other=-1)
    return (slot >= 0) & (slot < num_slots)


@gluon.jit
def _gl_tile_valid(t, main_tiles, topk_row, num_topk, win_row, num_win, main_num_slots, swa_num_slots,
                   BLOCK_N: gl.constexpr, LC: gl.constexpr):
    """S's key mask of tile `t` (main list tiles first, then the window's) in S's column layout `LC`."""
    cols = gl.arange(0, BLOCK_N, layout=LC)
    if t < main_tiles:
        ok = _gl_slot_valid(topk_row, t * BLOCK_N + cols, num_topk, main_num_slots)
    else:
        ok = _gl_slot_valid(win_row, (t - main_tiles) * BLOCK_N + cols, num_win, swa_num_slots)
    return ok


@gluon.jit
def _gl_tile_slots(t, main_tiles, topk_row, num_topk, win_row, num_win, BLOCK_N: gl.constexpr, LR: gl.constexpr):
    """Slots of key tile `t` (main list tiles first, then the window's) in layout LR, -1 past a
    list's end: loaded a tile ahead, so their latency hides behind the current tile's MMAs."""
    j = gl.arange(0, BLOCK_N, layout=LR)
    jm = t * BLOCK_N + j
    jw = (t - main_tiles) * BLOCK_N + j
    from_main = gl.load(topk_row + jm, mask=(jm < num_topk) & (t < main_tiles), other=-1)
    from_win = gl.load(win_row + jw, mask=(jw >= 0) & (jw < num_win) & (t >= main_tiles), other=-1)
    return gl.where(t < main_tiles, from_main.to(gl.int64), from_win.to(gl.int64))


# One record code word (8 E2M1 channels: bytes 4j..4j+3, low nibble = even channel) and its block's
# E4M3 scale byte -> 4 words of bf16 pairs (even channels 0-1, 2-3, odd channels 0-1, 2-3), with no
# fp8 -> f16 -> f32 -> bf16 chain (v16). The scan's pair trick (`_indexer_gluon`): two nibbles 16 bits apart, masked,
# `* 0x1040` (or `* 0x104` for the high nibbles in place) puts each one's sign at bit 15 and
# magnitude at bits 8..6 of its half (E2M1 * 2**-126 as a bf16), then one bf16x2 multiply by the
# block's E4M3 scale * 2**118 (a bf16, exact: 4 significant bits, 2**109..2**127). The keys come
# out times 2**-8 (exact: at most 6 significant bits, >= 2**-18), which the kernel undoes on Q
# (times 2**8) and on the accumulators (times 2**8 after the loop); the other decoders scale by
# 2**-8 to match.
def _nibble_pair(src: str, mask: str, mul: str, dst: str) -> str:
    """PTX: the two nibbles of `src` under `mask` (16 bits apart) -> bf16 pair `dst`, times `m`."""
    return f"and.b32 t, {src}, {mask};\nmul.lo.u32 t, t, {mul};\nand.b32 t, t, 0x81C081C0;\nmul.rn.bf16x2 {dst}, t, m;\n"


_FP4_WORD_BF16_ASM = gl.constexpr(
    "{\n.reg .b32 x, t, m;\n.reg .b16 a0, a1;\n.reg .f32 f;\n"
    # scale byte -> (scale, scale) * 2**118 as a bf16 pair
    "prmt.b32 t, $5, 0, 0x4400;\nmov.b32 {a0, a1}, t;\ncvt.rn.f16x2.e4m3x2 t, a0;\nmov.b32 {a0, a1}, t;\n"
    "cvt.f32.f16 f, a0;\nmul.f32 f, f, 0f7A800000;\ncvt.rn.bf16x2.f32 m, f, f;\n"
    # code bytes 0, 1 -> bits 0-7, 16-23: even channels (low nibbles), odd channels (high nibbles)
    "prmt.b32 x, $4, 0, 0x4140;\n" + _nibble_pair("x", "0x000F000F", "0x1040", "$0")
    + _nibble_pair("x", "0x00F000F0", "0x104", "$2")
    + "prmt.b32 x, $4, 0, 0x4342;\n" + _nibble_pair("x", "0x000F000F", "0x1040", "$1")
    + _nibble_pair("x", "0x00F000F0", "0x104", "$3") + "}")
KSHIFT_BF16 = gl.constexpr(8)  # decoded keys are K * 2**-KSHIFT_BF16 (exact), undone on Q and the accumulators


@gluon.jit
def _gl_main_rows_words(main_ptr, slot, num_slots, offset, spb, slot_stride, block_stride, kw_lo, kw_hi,
                        ROWS: gl.constexpr, D: gl.constexpr, LW: gl.constexpr, LW2: gl.constexpr,
                        SPB_LOG2: gl.constexpr):
    """Decode the `ROWS` main-KV records (FP4 pairs + E4M3 scales per 16 channels) at `slot`, times
    2**-KSHIFT, a 32-bit code word at a time, into their even / odd channels: `kw_lo` / `kw_hi` are
    the destination rows (bf16 [ROWS, D / 2]) viewed as int32 bf16 pairs `[ROWS, D / 4]`. A thread takes 4 code words (one
    16-byte load) and their 2 scale bytes, and stores 8 words per half (two 16-byte stores)."""
    rec, ok = _gl_slot_address(gl.convert_layout(slot, gl.SliceLayout(1, LW)), num_slots, offset, spb, slot_stride,
                               block_stride, SPB_LOG2)
    rec = gl.multiple_of(rec, 16)  # records are 16-byte aligned (the launcher checks)
    word = gl.arange(0, D // 8, layout=gl.SliceLayout(0, LW))
    row = main_ptr + gl.expand_dims(rec, 1)
    ok2 = gl.expand_dims(ok, 1)
    codes = gl.load((row + gl.expand_dims(word * 4, 0)).to(gl.pointer_type(gl.int32)), mask=ok2, other=0)
    scales = gl.load(row + D // 2 + gl.expand_dims(word // 2, 0), mask=ok2, other=0x38).to(gl.int32)
    lo01, lo23, hi01, hi23 = gl.inline_asm_elementwise(
        _FP4_WORD_BF16_ASM, "=r,=r,=r,=r,r,r", [codes, scales], dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
        is_pure=True, pack=1)
    kw_lo.store(gl.convert_layout(gl.reshape(gl.join(lo01, lo23), [ROWS, D // 4]), LW2))
    kw_hi.store(gl.convert_layout(gl.reshape(gl.join(hi01, hi23), [ROWS, D // 4]), LW2))


@gluon.jit
def _gl_swa_rows(swa_ptr, slot, num_slots, offset, spb, slot_stride, block_stride, k_lo_dst, k_hi_dst,
                 ROWS: gl.constexpr, D: gl.constexpr, LS: gl.constexpr, L4: gl.constexpr, L3S: gl.constexpr,
                 LK: gl.constexpr, KSHIFT: gl.constexpr, SPB_LOG2: gl.constexpr):
    """Decode the `ROWS` SWA records (E4M3 bytes + UE8M0 scales per 32 channels) at `slot`, times
    2**-KSHIFT, and store their even / odd channels (bf16 [ROWS, D / 2]) to `k_lo_dst` / `k_hi_dst`.
    A thread loads the 32 bytes of one scale block (two 16-byte loads)."""
    rec, ok = _gl_slot_address(gl.convert_layout(slot, gl.SliceLayout(1, LS)), num_slots, offset, spb, slot_stride,
                               block_stride, SPB_LOG2)
    rec = gl.multiple_of(rec, 16)  # records are 16-byte aligned (the launcher checks)
    col = gl.arange(0, D, layout=gl.SliceLayout(0, LS))
    values = gl.load(swa_ptr + gl.expand_dims(rec, 1) + gl.expand_dims(col, 0), mask=gl.expand_dims(ok, 1), other=0)
    values = gl.convert_layout(gl.reshape(values, [ROWS, D // 32, 16, 2]), L4)
    lo8, hi8 = gl.split(values)  # even / odd channels [BLOCK_N, D / 32, 16]
    lo8 = gl.convert_layout(lo8, L3S)
    hi8 = gl.convert_layout(hi8, L3S)
    L2: gl.constexpr = gl.SliceLayout(2, L3S)
    rec2 = gl.convert_layout(rec, gl.SliceLayout(1, L2))
    ok2 = gl.convert_layout(ok, gl.SliceLayout(1, L2))
    blk = gl.arange(0, D // 32, layout=gl.SliceLayout(0, L2))
    scales = gl.load(swa_ptr + gl.expand_dims(rec2, 1) + D + gl.expand_dims(blk, 0), mask=gl.expand_dims(ok2, 1),
                     other=127)
    scale = gl.expand_dims((scales.to(gl.int32) << 23).to(gl.float32, bitcast=True) * 2.0**-KSHIFT, 2)  # 2**(b - 127)
    lo = (lo8.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale).to(gl.bfloat16)
    hi = (hi8.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale).to(gl.bfloat16)
    k_lo_dst.store(gl.convert_layout(gl.reshape(lo, [ROWS, D // 2]), LK))
    k_hi_dst.store(gl.convert_layout(gl.reshape(hi, [ROWS, D // 2]), LK))


@gluon.jit
def _gl_fill(t, slot, main_tiles, k_lo, k_hi, kw_lo, kw_hi, main_ptr, main_num_slots, main_offset, main_spb,
             main_slot_stride, main_block_stride, swa_ptr, swa_num_slots, swa_offset, swa_spb, swa_slot_stride,
             swa_block_stride,
             BLOCK_N: gl.constexpr, D: gl.constexpr, LS: gl.constexpr, L4: gl.constexpr,
             L3S: gl.constexpr, LK: gl.constexpr, LW: gl.constexpr, LW2: gl.constexpr, KSHIFT: gl.constexpr,
             MAIN_SPB_LOG2: gl.constexpr, SWA_SPB_LOG2: gl.constexpr):
    """Decode key tile `t` (its `slot`s from `_gl_tile_slots`) into `k_lo` / `k_hi` (`kw_lo` /
    `kw_hi`: the same buffers as int32 pairs, for the main-KV word decoder), times 2**-KSHIFT."""
    if t < main_tiles:  # (no main list: num_topk = 0; no window: every tile is main)
        _gl_main_rows_words(main_ptr, slot, main_num_slots, main_offset, main_spb, main_slot_stride,
                            main_block_stride, kw_lo, kw_hi, BLOCK_N, D, LW, LW2, MAIN_SPB_LOG2)
    else:
        _gl_swa_rows(swa_ptr, slot, swa_num_slots, swa_offset, swa_spb, swa_slot_stride, swa_block_stride, k_lo, k_hi,
                     BLOCK_N, D, LS, L4, L3S, LK, KSHIFT, SWA_SPB_LOG2)


@gluon.jit
def _gl_q_halves(q_ptr, n, q_stride_n, q_stride_h, H: gl.constexpr, D: gl.constexpr, KSHIFT: gl.constexpr,
                 LQ: gl.constexpr, LQ3: gl.constexpr):
    """Token n's Q as its even / odd channel halves (bf16 [H, D / 2] each, layout `LQ3`), times
    2**KSHIFT (exact): the keys are decoded times 2**-KSHIFT (the word decoder's bf16 pairs)."""
    hq = gl.arange(0, H, layout=gl.SliceLayout(1, LQ))
    cq = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))
    q = gl.load(q_ptr + n.to(gl.int64) * q_stride_n + gl.expand_dims(hq.to(gl.int64) * q_stride_h, 1)
                + gl.expand_dims(cq, 0))
    if KSHIFT != 0:
        q = (q.to(gl.float32) * 2.0**KSHIFT).to(gl.bfloat16)
    return gl.split(gl.convert_layout(gl.reshape(q, [H, D // 2, 2]), LQ3))


@gluon.jit
def _gl_store_partial(acc, m_i, l_i, part, part_acc_ptr, part_ml_ptr, H: gl.constexpr, D: gl.constexpr,
                      MMA_S: gl.constexpr):
    """A split's partial: `acc [H, D]` (fp16, divided by its row sums;
    channel order) at row `part` of `part_acc`, and its base-2 row maxima / sums at `part_ml`."""
    LO: gl.constexpr = acc.type.layout
    ho = gl.arange(0, H, layout=gl.SliceLayout(1, LO))
    co = gl.arange(0, D, layout=gl.SliceLayout(0, LO))
    hm = gl.arange(0, H, layout=gl.SliceLayout(1, MMA_S))
    gl.store(part_acc_ptr + (part + gl.expand_dims(ho, 1).to(gl.int64)) * D + gl.expand_dims(co, 0), acc)
    gl.store(part_ml_ptr + (part + hm) * 2, m_i)
    gl.store(part_ml_ptr + (part + hm) * 2 + 1, l_i)


@gluon.jit
def _gl_finish(acc_lo, acc_hi, m_i, l_i, split, n, part_acc_ptr, part_ml_ptr, H: gl.constexpr, D: gl.constexpr,
               NUM_SPLITS: gl.constexpr, KSHIFT: gl.constexpr, MMA_S: gl.constexpr, MMA_O: gl.constexpr):
    """After a CTA's last key tile: store its split-KV partial, divided by its row sums (a convex mix
    of values: |x| <= 2688) in fp16 (v20)."""
    if KSHIFT != 0:  # the values were decoded times 2**-KSHIFT (exact in fp32)
        acc_lo = acc_lo * 2.0**KSHIFT
        acc_hi = acc_hi * 2.0**KSHIFT
    part = (n.to(gl.int64) * NUM_SPLITS + split) * H
    # interleave the halves back to channel order in registers: a thread's two adjacent columns of
    # each half become 4 adjacent channels, one 16-byte store
    inv_l = gl.expand_dims(gl.convert_layout(gl.where(l_i > 0, 1.0 / l_i, 0.0), gl.SliceLayout(1, MMA_O)), 1)
    acc = gl.reshape(gl.join(acc_lo * inv_l, acc_hi * inv_l), [H, D]).to(gl.float16)
    _gl_store_partial(acc, m_i, l_i, part, part_acc_ptr, part_ml_ptr, H, D, MMA_S)


@gluon.jit
def _gl_sparse_attention_kernel(
    q_ptr, q_stride_n, q_stride_h,
    main_ptr, topk_ptr, topk_stride, num_topk,
    main_num_slots, main_offset, main_spb, main_slot_stride, main_block_stride,
    swa_ptr, win_ptr, win_stride, num_win,
    swa_num_slots, swa_offset, swa_spb, swa_slot_stride, swa_block_stride,
    part_acc_ptr, part_ml_ptr, sm_scale_log2,
    H: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, NUM_SPLITS: gl.constexpr,
    MAIN_SPB_LOG2: gl.constexpr = -1, SWA_SPB_LOG2: gl.constexpr = -1,
):
    """CTA (token n, split): partial attention of the token's 64 heads over its split of the key
    tiles (main list, then window), written as `part_acc [N, NUM_SPLITS, H, D]` (natural channel
    order; fp16, divided by the row sums) and
    `part_ml [N, NUM_SPLITS, H, 2]` (base-2 max, sum), no sink."""
    HALF: gl.constexpr = D // 2
    # layouts (8 warps): record loads, decoded keys, and the two MMAs (warps [4, 2]: the second
    # warpgroup takes the upper half of S's keys and of each accumulator's channels)
    LS: gl.constexpr = gl.BlockedLayout([1, 32], [2, 16], [8, 1], [1, 0])
    L4: gl.constexpr = gl.BlockedLayout([1, 1, 16, 2], [2, 16, 1, 1], [8, 1, 1, 1], [3, 2, 1, 0])
    L3S: gl.constexpr = gl.BlockedLayout([1, 1, 16], [2, 16, 1], [8, 1, 1], [2, 1, 0])
    LK: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [8, 1], [1, 0])
    LW: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [8, 1], [1, 0])  # code words of main records
    LW2: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])  # bf16 pairs of one half
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    LQ3: gl.constexpr = gl.BlockedLayout([1, 4, 2], [1, 32, 1], [8, 1, 1], [2, 1, 0])
    MMA_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                    instr_shape=[16, BLOCK_N // 2, 16])
    MMA_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 128, 16])
    SH_K: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], gl.bfloat16)
    SH_Q: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, HALF], gl.bfloat16)
    SH_P: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, BLOCK_N], gl.bfloat16)

    n = gl.program_id(0)
    split = gl.program_id(1)

    KSHIFT: gl.constexpr = KSHIFT_BF16
    main_tiles = gl.cdiv(num_topk, BLOCK_N)
    total_tiles = main_tiles + gl.cdiv(num_win, BLOCK_N)
    t0 = split * total_tiles // NUM_SPLITS
    t1 = (split + 1) * total_tiles // NUM_SPLITS
    topk_row = topk_ptr + n.to(gl.int64) * topk_stride
    win_row = win_ptr + n.to(gl.int64) * win_stride
    LR: gl.constexpr = gl.SliceLayout(1, LW)
    # the first tile's slots, then Q's loads, then the first tile's records: the three latencies
    # overlap instead of Q's load, Q's shared-memory store, then the slots, then the records
    # (v18, the default since run 38)
    slot0 = _gl_tile_slots(t0, main_tiles, topk_row, num_topk, win_row, num_win, BLOCK_N, LR)
    q_lo, q_hi = _gl_q_halves(q_ptr, n, q_stride_n, q_stride_h, H, D, KSHIFT, LQ, LQ3)
    q_lo_s = gl.allocate_shared_memory(gl.bfloat16, [H, HALF], SH_Q)
    q_hi_s = gl.allocate_shared_memory(gl.bfloat16, [H, HALF], SH_Q)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_N, HALF], SH_K)  # (buffer, half) pairs
    # the same bytes as int32 bf16 pairs (the 128-byte swizzle acts on bytes, so it is the same map)
    kw_s = k_s._reinterpret(gl.int32, [4, BLOCK_N, HALF // 2],
                            gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
    p_s = gl.allocate_shared_memory(gl.bfloat16, [H, BLOCK_N], SH_P)

    acc_lo = gl.zeros([H, HALF], gl.float32, layout=MMA_O)
    acc_hi = gl.zeros([H, HALF], gl.float32, layout=MMA_O)
    s_zero = gl.zeros([H, BLOCK_N], gl.float32, layout=MMA_S)
    m_i = gl.full([H], -1.0e30, gl.float32, layout=gl.SliceLayout(1, MMA_S))
    l_i = gl.zeros([H], gl.float32, layout=gl.SliceLayout(1, MMA_S))

    # rotated pipeline: tile t + 1 is loaded and decoded into the other buffer while tile t's
    # P . K runs, and that MMA is waited for inside the same iteration. An asynchronous MMA left
    # in flight across the loop's back edge makes ptxas serialise every wgmma of the kernel
    # (C7515, "non wgmma instructions defining accumulator registers"): 40 waits instead of 5.
    if t0 < t1:
        _gl_fill(t0, slot0, main_tiles,
                 k_s.index(0), k_s.index(1), kw_s.index(0), kw_s.index(1), main_ptr, main_num_slots, main_offset,
                 main_spb, main_slot_stride, main_block_stride, swa_ptr, swa_num_slots, swa_offset, swa_spb,
                 swa_slot_stride, swa_block_stride, BLOCK_N, D, LS, L4, L3S, LK, LW, LW2, KSHIFT,
                 MAIN_SPB_LOG2, SWA_SPB_LOG2)
    q_lo_s.store(q_lo)
    q_hi_s.store(q_hi)
    fence_async_shared()
    gl.thread_barrier()
    LC: gl.constexpr = gl.SliceLayout(0, MMA_S)
    for t in range(t0, t1):
        buf = (t - t0) % 2
        k_lo = k_s.index(2 * buf)
        k_hi = k_s.index(2 * buf + 1)
        s = warpgroup_mma(q_lo_s, k_lo.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_hi_s, k_hi.permute((1, 0)), s, is_async=True)
        slot_next = _gl_tile_slots(t + 1, main_tiles, topk_row, num_topk, win_row, num_win, BLOCK_N, LR)
        # (loading this mask in the previous iteration instead was slower: v16, run 30)
        ok = _gl_tile_valid(t, main_tiles, topk_row, num_topk, win_row, num_win, main_num_slots, swa_num_slots,
                            BLOCK_N, LC)
        s = warpgroup_mma_wait(0, deps=(s,))
        s = gl.where(gl.expand_dims(ok, 0), s * sm_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p_s.store(p.to(gl.bfloat16))  # (the previous P . K, which read p_s, was waited for)
        fence_async_shared()
        gl.thread_barrier()
        alpha_o = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, MMA_O)), 1)
        acc_lo = acc_lo * alpha_o  # both rescaled before either MMA is issued (C7515)
        acc_hi = acc_hi * alpha_o
        acc_lo = warpgroup_mma(p_s, k_lo, acc_lo, is_async=True)
        acc_hi = warpgroup_mma(p_s, k_hi, acc_hi, is_async=True)
        if t + 1 < t1:  # the other buffer was last read by tile t - 1's MMAs, waited for
            _gl_fill(t + 1, slot_next, main_tiles, k_s.index(2 - 2 * buf), k_s.index(3 - 2 * buf),
                     kw_s.index(2 - 2 * buf), kw_s.index(3 - 2 * buf), main_ptr, main_num_slots, main_offset, main_spb,
                     main_slot_stride, main_block_stride, swa_ptr, swa_num_slots, swa_offset, swa_spb,
                     swa_slot_stride, swa_block_stride, BLOCK_N, D, LS, L4, L3S, LK, LW, LW2, KSHIFT,
                     MAIN_SPB_LOG2, SWA_SPB_LOG2)
        acc_lo, acc_hi = warpgroup_mma_wait(0, deps=(acc_lo, acc_hi))
        fence_async_shared()
        gl.thread_barrier()

    _gl_finish(acc_lo, acc_hi, m_i, l_i, split, n, part_acc_ptr, part_ml_ptr, H, D, NUM_SPLITS, KSHIFT, MMA_S, MMA_O,
)
