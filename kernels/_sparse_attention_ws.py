"""v17 of the Hopper sparse decode attention (`AttentionConfig(kernel="gluon", warp_specialized=True)`):
`_gl_sparse_attention_kernel`'s math (read `_sparse_attention_gluon`'s docstring first) with the key
decode moved to a warp-specialised producer.

Why (kernels-notes.md, v16 / v17): in v11 / v16 the same 8 warps decode a tile, issue its MMAs and
run its softmax, so a tile costs the decode's load latency and ALU work plus the logits MMA and
the softmax, with only the `P . K` MMA overlapping the next decode; at 2 warps per scheduler
(205 KB of shared memory: one CTA per SM) every stall is exposed (ncu: 8 cycles per issued
instruction). Here:

* a producer partition of 8 extra warps loads each tile's slots and records, decodes them into a
  ring of 2 key buffers (the same NVMMA-swizzled bf16 halves as v16), writes the tile's key mask
  as an additive bias (0 or -inf), and signals the buffer's `ready` mbarrier;
* the default partition (8 warps, two warpgroups: the MMAs, the online softmax, the merge) waits
  for `ready`, runs the tile, and signals `empty` once its `P . K` MMAs have finished reading it;
* Q goes to shared memory in the default partition while the producer decodes the first tile.

Registers: the 16 warps share the SM's 64K registers (`maxnreg` 128); the producer runs with
`PRODUCER_REGS` and the default partition gets the rest (200).
"""
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from cedserve.kernels._records_gluon import _gl_slot_address
from cedserve.kernels._sparse_attention_gluon import (
    KSHIFT_BF16,
    _gl_finish,
    _gl_main_words_load,
    _gl_main_words_store,
    _gl_q_halves,
    _gl_swa_rows,
    _gl_tile_valid,
)

PRODUCER_WARPS = 8  # 4 decoded too slowly: the MMA warps waited on `ready` ~30 % of the time (run 33)
MAXNREG = 128  # 16 warps x 32 threads x 128 = 65,536 registers
PRODUCER_REGS = 56  # the default partition then gets (128 x 512 - 56 x 256) / 256 = 200
ROWS = 32  # rows of a main tile decoded per chunk


@gluon.jit
def _gl_ws_slots(t, r0, main_tiles, topk_row, num_topk, win_row, num_win, BLOCK_N: gl.constexpr,
                 ROWS: gl.constexpr, LR: gl.constexpr):
    """Slots of rows `r0 .. r0 + ROWS` of key tile `t` (main list tiles first, then the
    window's) in layout LR, -1 past a list's end."""
    j = r0 + gl.arange(0, ROWS, layout=LR)
    jm = t * BLOCK_N + j
    jw = (t - main_tiles) * BLOCK_N + j
    from_main = gl.load(topk_row + jm, mask=(jm < num_topk) & (t < main_tiles), other=-1)
    from_win = gl.load(win_row + jw, mask=(jw >= 0) & (jw < num_win) & (t >= main_tiles), other=-1)
    return gl.where(t < main_tiles, from_main.to(gl.int64), from_win.to(gl.int64))


@gluon.jit
def _gl_ws_main_slots(t, r0, tm1, topk_row, num_topk, BLOCK_N: gl.constexpr, ROWS: gl.constexpr, LR: gl.constexpr):
    """Main-list slots of rows `r0 .. r0 + ROWS` of tile `t`, -1 past the list's end and for
    `t >= tm1` (its loads are then masked off)."""
    j = t * BLOCK_N + r0 + gl.arange(0, ROWS, layout=LR)
    return gl.load(topk_row + j, mask=(j < num_topk) & (t < tm1), other=-1)


@gluon.jit
def _gl_ws_main_load(main_ptr, slot, num_slots, offset, spb, slot_stride, block_stride, D: gl.constexpr,
                     LW: gl.constexpr, LSC: gl.constexpr, SPB_LOG2: gl.constexpr):
    """`_gl_main_words_load` with the scale bytes loaded once per pair of words (`[ROWS, D / 16]`
    int8 in `LSC`: a thread's 4 words share 2 scale bytes): half the registers a chunk in flight
    holds for its scales."""
    codes, _ = _gl_main_words_load(main_ptr, slot, num_slots, offset, spb, slot_stride, block_stride, D, LW,
                                   SPB_LOG2, False)
    rec, ok = _gl_slot_address(gl.convert_layout(slot, gl.SliceLayout(1, LSC)), num_slots, offset, spb, slot_stride,
                               block_stride, SPB_LOG2)
    blk = gl.arange(0, D // 16, layout=gl.SliceLayout(0, LSC))
    scales = gl.load(main_ptr + gl.expand_dims(rec, 1) + D // 2 + gl.expand_dims(blk, 0), mask=gl.expand_dims(ok, 1),
                     other=0x38)
    return codes, scales


@gluon.jit
def _gl_ws_main_store(codes, scales, kw_lo, kw_hi, ROWS: gl.constexpr, D: gl.constexpr, LW: gl.constexpr,
                      LW2: gl.constexpr):
    """Decode and store a chunk of `_gl_ws_main_load`: each scale byte widened to its two words."""
    per_word = gl.convert_layout(gl.reshape(gl.join(scales, scales), [ROWS, D // 8]), LW).to(gl.int32)
    _gl_main_words_store(codes, per_word, kw_lo, kw_hi, ROWS, D, LW2, True)


@gluon.jit
def _gl_ws_producer(k_s, kw_s, bias_s, ready, empty, t0, t1, main_tiles, topk_row, num_topk, win_row, num_win,
                    main_ptr, main_num_slots, main_offset, main_spb, main_slot_stride, main_block_stride,
                    swa_ptr, swa_num_slots, swa_offset, swa_spb, swa_slot_stride, swa_block_stride,
                    BLOCK_N: gl.constexpr, D: gl.constexpr, KSHIFT: gl.constexpr, MAIN_SPB_LOG2: gl.constexpr,
                    SWA_SPB_LOG2: gl.constexpr, ROWS: gl.constexpr, PW: gl.constexpr):
    """Worker partition (`PW` warps): decode tiles t0 .. t1 into the key ring, the main list's tiles
    in two chunks of `ROWS` (= BLOCK_N / 2) rows, software-pipelined across tiles: a chunk's
    records are loaded before the previous chunk is decoded, its slots a tile ahead; then the
    window's tiles, `ROWS / 2` rows at a time."""
    # the v16 layouts for 4 warps: code words of main records, bf16 pairs of one half, scale bytes,
    # SWA bytes, the bias
    LW: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [PW, 1], [1, 0])
    LW2: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [PW, 1], [1, 0])
    LSC: gl.constexpr = gl.BlockedLayout([1, 2], [2, 16], [PW, 1], [1, 0])
    LS: gl.constexpr = gl.BlockedLayout([1, 32], [2, 16], [PW, 1], [1, 0])
    L4: gl.constexpr = gl.BlockedLayout([1, 1, 16, 2], [2, 16, 1, 1], [PW, 1, 1, 1], [3, 2, 1, 0])
    L3S: gl.constexpr = gl.BlockedLayout([1, 1, 16], [2, 16, 1], [PW, 1, 1], [2, 1, 0])
    LK: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [PW, 1], [1, 0])
    LB: gl.constexpr = gl.BlockedLayout([1], [32], [PW], [0])
    LR: gl.constexpr = gl.SliceLayout(1, LW)
    LRS: gl.constexpr = gl.SliceLayout(1, LS)
    gl.static_assert(2 * ROWS == BLOCK_N, "the main tiles are decoded in two chunks")
    tm1 = gl.minimum(t1, main_tiles)
    slot1 = _gl_ws_main_slots(t0, ROWS, tm1, topk_row, num_topk, BLOCK_N, ROWS, LR)
    codes0, scales0 = _gl_ws_main_load(main_ptr, _gl_ws_main_slots(t0, 0, tm1, topk_row, num_topk, BLOCK_N, ROWS, LR),
                                       main_num_slots, main_offset, main_spb, main_slot_stride, main_block_stride, D,
                                       LW, LSC, MAIN_SPB_LOG2)
    for t in range(t0, tm1):
        i = t - t0
        buf = i % 2
        next0 = _gl_ws_main_slots(t + 1, 0, tm1, topk_row, num_topk, BLOCK_N, ROWS, LR)
        next1 = _gl_ws_main_slots(t + 1, ROWS, tm1, topk_row, num_topk, BLOCK_N, ROWS, LR)
        codes1, scales1 = _gl_ws_main_load(main_ptr, slot1, main_num_slots, main_offset, main_spb, main_slot_stride,
                                           main_block_stride, D, LW, LSC, MAIN_SPB_LOG2)
        mbarrier.wait(empty.index(buf), ((i // 2) & 1) ^ 1)  # (a fresh barrier passes phase 1)
        fence_async_shared()  # the MMAs that read this buffer are done: order our writes after them
        ok = _gl_tile_valid(t, main_tiles, topk_row, num_topk, win_row, num_win, main_num_slots, swa_num_slots,
                            BLOCK_N, LB)
        bias_s.index(buf).store(gl.where(ok, 0.0, float("-inf")))
        _gl_ws_main_store(codes0, scales0, kw_s.index(2 * buf).slice(0, ROWS), kw_s.index(2 * buf + 1).slice(0, ROWS),
                          ROWS, D, LW, LW2)
        codes0, scales0 = _gl_ws_main_load(main_ptr, next0, main_num_slots, main_offset, main_spb, main_slot_stride,
                                           main_block_stride, D, LW, LSC, MAIN_SPB_LOG2)
        _gl_ws_main_store(codes1, scales1, kw_s.index(2 * buf).slice(ROWS, ROWS),
                          kw_s.index(2 * buf + 1).slice(ROWS, ROWS), ROWS, D, LW, LW2)
        slot1 = next1
        fence_async_shared()  # our generic-proxy stores before the consumer's wgmma reads
        gl.thread_barrier()
        mbarrier.arrive(ready.index(buf), count=1)
    for t in range(gl.maximum(t0, main_tiles), t1):
        i = t - t0
        buf = i % 2
        mbarrier.wait(empty.index(buf), ((i // 2) & 1) ^ 1)
        fence_async_shared()
        ok = _gl_tile_valid(t, main_tiles, topk_row, num_topk, win_row, num_win, main_num_slots, swa_num_slots,
                            BLOCK_N, LB)
        bias_s.index(buf).store(gl.where(ok, 0.0, float("-inf")))
        for rw in gl.static_range(0, BLOCK_N, ROWS // 2):
            slot_w = _gl_ws_slots(t, rw, main_tiles, topk_row, num_topk, win_row, num_win, BLOCK_N, ROWS // 2, LRS)
            _gl_swa_rows(swa_ptr, slot_w, swa_num_slots, swa_offset, swa_spb, swa_slot_stride, swa_block_stride,
                         k_s.index(2 * buf).slice(rw, ROWS // 2), k_s.index(2 * buf + 1).slice(rw, ROWS // 2),
                         ROWS // 2, D, LS, L4, L3S, LK, KSHIFT, SWA_SPB_LOG2)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ready.index(buf), count=1)


@gluon.jit
def _gl_ws_consumer(q_lo_s, q_hi_s, k_s, p_s, bias_s, ready, empty, t0, t1, n, split, q_ptr, q_stride_n, q_stride_h,
                    sm_scale_log2, part_acc_ptr, part_ml_ptr, counter_ptr, sink_ptr, cos_ptr, sin_ptr, cs_stride,
                    out_ptr, out_stride_n, out_stride_h,
                    H: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, NUM_SPLITS: gl.constexpr,
                    FUSED_COMBINE: gl.constexpr, LAST_UNSTORED: gl.constexpr, ROPE_PAIRS: gl.constexpr,
                    KSHIFT: gl.constexpr):
    """Default partition (8 warps): Q to shared memory, then per tile the logits MMA, the online
    softmax and the `P . K` MMA, then the split's partial or the token's merge (`_gl_finish`)."""
    HALF: gl.constexpr = D // 2
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    LQ3: gl.constexpr = gl.BlockedLayout([1, 4, 2], [1, 32, 1], [8, 1, 1], [2, 1, 0])
    MMA_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                    instr_shape=[16, BLOCK_N // 2, 16])
    MMA_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 128, 16])
    q_lo, q_hi = _gl_q_halves(q_ptr, n, q_stride_n, q_stride_h, H, D, KSHIFT, LQ, LQ3)
    q_lo_s.store(q_lo)
    q_hi_s.store(q_hi)
    fence_async_shared()
    gl.thread_barrier()

    acc_lo = gl.zeros([H, HALF], gl.float32, layout=MMA_O)
    acc_hi = gl.zeros([H, HALF], gl.float32, layout=MMA_O)
    s_zero = gl.zeros([H, BLOCK_N], gl.float32, layout=MMA_S)
    m_i = gl.full([H], -1.0e30, gl.float32, layout=gl.SliceLayout(1, MMA_S))
    l_i = gl.zeros([H], gl.float32, layout=gl.SliceLayout(1, MMA_S))
    for t in range(t0, t1):
        i = t - t0
        buf = i % 2
        mbarrier.wait(ready.index(buf), (i // 2) & 1)
        k_lo = k_s.index(2 * buf)
        k_hi = k_s.index(2 * buf + 1)
        s = warpgroup_mma(q_lo_s, k_lo.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_hi_s, k_hi.permute((1, 0)), s, is_async=True)
        bias = bias_s.index(buf).load(gl.SliceLayout(0, MMA_S))
        s = warpgroup_mma_wait(0, deps=(s,))
        s = s * sm_scale_log2 + gl.expand_dims(bias, 0)
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
        acc_lo, acc_hi = warpgroup_mma_wait(0, deps=(acc_lo, acc_hi))
        gl.thread_barrier()  # every warpgroup's MMAs have read the buffer (and the bias)
        mbarrier.arrive(empty.index(buf), count=1)

    _gl_finish(acc_lo, acc_hi, m_i, l_i, split, n, part_acc_ptr, part_ml_ptr, counter_ptr, sink_ptr, cos_ptr,
               sin_ptr, cs_stride, out_ptr, out_stride_n, out_stride_h, H, D, ROPE_PAIRS, NUM_SPLITS, FUSED_COMBINE,
               LAST_UNSTORED, KSHIFT, MMA_S, MMA_O)


@gluon.jit
def _gl_sparse_attention_ws_kernel(
    q_ptr, q_stride_n, q_stride_h,
    main_ptr, topk_ptr, topk_stride, num_topk,
    main_num_slots, main_offset, main_spb, main_slot_stride, main_block_stride,
    swa_ptr, win_ptr, win_stride, num_win,
    swa_num_slots, swa_offset, swa_spb, swa_slot_stride, swa_block_stride,
    part_acc_ptr, part_ml_ptr, sm_scale_log2,
    counter_ptr, sink_ptr, cos_ptr, sin_ptr, cs_stride, out_ptr, out_stride_n, out_stride_h,
    H: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, NUM_SPLITS: gl.constexpr,
    FUSED_COMBINE: gl.constexpr, ROPE_PAIRS: gl.constexpr, LAST_UNSTORED: gl.constexpr,
    MAIN_SPB_LOG2: gl.constexpr, SWA_SPB_LOG2: gl.constexpr, PRODUCER_REGS: gl.constexpr, ROWS: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr = 4,
):
    """CTA (token n, split): `_gl_sparse_attention_kernel`'s result (its partial or, for the last
    split, the token's output) from a producer / consumer pair of partitions (module docstring).
    Main records are decoded straight to bf16 pairs (`DIRECT_BF16`): keys times 2**-KSHIFT_BF16."""
    HALF: gl.constexpr = D // 2
    KSHIFT: gl.constexpr = KSHIFT_BF16
    SH_K: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], gl.bfloat16)
    SH_Q: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, HALF], gl.bfloat16)
    SH_P: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, BLOCK_N], gl.bfloat16)
    n = gl.program_id(0)
    split = gl.program_id(1)
    q_lo_s = gl.allocate_shared_memory(gl.bfloat16, [H, HALF], SH_Q)
    q_hi_s = gl.allocate_shared_memory(gl.bfloat16, [H, HALF], SH_Q)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_N, HALF], SH_K)  # (buffer, half) pairs
    kw_s = k_s._reinterpret(gl.int32, [4, BLOCK_N, HALF // 2],
                            gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
    p_s = gl.allocate_shared_memory(gl.bfloat16, [H, BLOCK_N], SH_P)
    bias_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(ready.index(b), count=1)
        mbarrier.init(empty.index(b), count=1)

    main_tiles = gl.cdiv(num_topk, BLOCK_N)
    total_tiles = main_tiles + gl.cdiv(num_win, BLOCK_N)
    t0 = split * total_tiles // NUM_SPLITS
    t1 = (split + 1) * total_tiles // NUM_SPLITS
    topk_row = topk_ptr + n.to(gl.int64) * topk_stride
    win_row = win_ptr + n.to(gl.int64) * win_stride
    gl.warp_specialize([
        (_gl_ws_consumer, (q_lo_s, q_hi_s, k_s, p_s, bias_s, ready, empty, t0, t1, n, split, q_ptr, q_stride_n,
                           q_stride_h, sm_scale_log2, part_acc_ptr, part_ml_ptr, counter_ptr, sink_ptr, cos_ptr,
                           sin_ptr, cs_stride, out_ptr, out_stride_n, out_stride_h, H, D, BLOCK_N, NUM_SPLITS,
                           FUSED_COMBINE, LAST_UNSTORED, ROPE_PAIRS, KSHIFT)),
        (_gl_ws_producer, (k_s, kw_s, bias_s, ready, empty, t0, t1, main_tiles, topk_row, num_topk, win_row, num_win,
                           main_ptr, main_num_slots, main_offset, main_spb, main_slot_stride, main_block_stride,
                           swa_ptr, swa_num_slots, swa_offset, swa_spb, swa_slot_stride, swa_block_stride,
                           BLOCK_N, D, KSHIFT, MAIN_SPB_LOG2, SWA_SPB_LOG2, ROWS, PRODUCER_WARPS)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])
