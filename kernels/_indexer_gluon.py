"""Gluon kernel behind `cedserve.kernels.indexer.index_scores` on Hopper (v14, range mode; the full
scan of the index keys, the one decode cost that grows with context).

The same math as v4 of `_indexer_kernels` (read that module's docstring: the E2M1 nibbles of a
code word become bf16 pairs times `2**(b - 1 - QSHIFT)`, the queries are pre-scaled by
`2**QSHIFT`, four MMAs of K = 32 per tile), with what the Triton kernel could not choose. Its
profile (kernels-notes.md, "Profile") showed it latency-bound: half the scheduler cycles had no
warp ready, each tile waiting on its own record loads. Here

* a CTA (one warpgroup) streams `TILES` tiles of 64 entries of one token's request through a
  ring of `STAGES` shared-memory stages filled by `cp.async` (4-byte copies: records are 68 bytes,
  4-byte aligned), so `STAGES - 1` tiles are in flight while one is decoded (2 by default: the
  kernel is bound by instruction issue, not by loads in flight); blocks of >= 32 records stored
  back to back (the cache's index regions) take two block-table loads per tile, not one per row;
* a thread reads from shared memory exactly the code words it needs as the wgmma's register A
  operand (`DotOperandLayout`, 32-bit elements: rows `l / 4` and `l / 4 + 8` of its warp's 16,
  words `l % 4 + 4 i`, so word `i` is in scale block `i`), decodes each into four bf16 pairs with
  one inline-PTX block, and the four `K_j` tiles go to the tensor cores from registers with the
  queries' `Q_j^T` in shared memory (`S = sum_j K_j . Q_j^T`, `[64 entries, H]`);
* relu, the head weights and the sum over heads stay in the MMA's register layout; block maxima
  (level one of the two-level top-k) are maxima over 8 rows, i.e. across lanes.

Sm_90 only, `d = 128`, at most 32 heads, one token per request (`tokens_per_request = 1`), range
mode, 4-byte aligned records stored back to back; `index_scores` uses the Triton kernel for
anything else, and the CPU interpreter cannot run Gluon (GPU tests in tests/kernels/test_indexer.py).
"""
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from cedserve.kernels._records_gluon import _gl_block_entry

# One code word (nibble n = channel 8w + n) and its block's multiplier (the bf16 2**(b - 1 - QSHIFT),
# twice) -> 4 bf16 pairs: pair j = (nibble j, nibble j + 4) = channels (8w + j, 8w + 4 + j). Per pair
# (`_indexer_kernels._pairs_bf16`): keep the two nibbles, a multiply moves each one's sign to bit 15
# and magnitude to bits 8..6 of its half (E2M1 * 2**-126 as a bf16), then one bf16x2 multiply.
# Nibbles 1 and 3 are taken in place (mask 0x00F000F0, multiplier 0x104 = 0x1040 / 16), so one
# shift by 8 serves pairs 2 and 3.
_PAIR = "and.b32 t, {src}, {mask};\nmul.lo.u32 t, t, {mul};\nand.b32 t, t, 0x81C081C0;\n" \
        "mul.rn.bf16x2 t, t, $9;\nmov.b32 {{{lo}, {hi}}}, t;\n"
_WORD_ASM = gl.constexpr(
    "{\n.reg .b32 t, s;\n" + _PAIR.format(src="$8", mask="0x000F000F", mul="0x1040", lo="$0", hi="$1")
    + _PAIR.format(src="$8", mask="0x00F000F0", mul="0x104", lo="$2", hi="$3")
    + "shr.b32 s, $8, 8;\n" + _PAIR.format(src="s", mask="0x000F000F", mul="0x1040", lo="$4", hi="$5")
    + _PAIR.format(src="s", mask="0x00F000F0", mul="0x104", lo="$6", hi="$7") + "}")


@gluon.jit
def _gl_tile_bases(tile, req, block_table_ptr, bt_stride, max_blocks, num_blocks, offset_bytes, block_stride,
                   SPB_LOG2: gl.constexpr, RB: gl.constexpr):
    """Blocks of >= 32 records (`FAST_ROWS`): (byte address of the tile's row 0, of its row 32, each
    half readable), scalars from two block-table loads: rows r < 32 are at `base0 + r * RB`, the
    others at `base1 + (r - 32) * RB`."""
    e0 = tile * 64
    e1 = e0 + 32
    i0 = e0 >> SPB_LOG2
    i1 = e1 >> SPB_LOG2
    row = block_table_ptr + req * bt_stride
    b0 = gl.load(row + i0, mask=i0 < max_blocks, other=-1).to(gl.int64)
    b1 = gl.load(row + i1, mask=i1 < max_blocks, other=-1).to(gl.int64)
    ok0 = (b0 >= 0) & (b0 < num_blocks)
    ok1 = (b1 >= 0) & (b1 < num_blocks)
    mask: gl.constexpr = (1 << SPB_LOG2) - 1
    base0 = offset_bytes + gl.where(ok0, b0, 0) * block_stride + (e0 & mask) * RB
    base1 = offset_bytes + gl.where(ok1, b1, 0) * block_stride + (e1 & mask) * RB
    return base0, base1, ok0, ok1


@gluon.jit
def _gl_rows_from_bases(base0, base1, ok0, ok1, tile, num_entries, RB: gl.constexpr, LR: gl.constexpr):
    """(int64 record byte offsets, readable) of the tile's 64 rows in layout LR, from `_gl_tile_bases`."""
    r = gl.arange(0, 64, layout=LR)
    upper = r >= 32
    rec = gl.where(upper, base1, base0) + (r & 31) * RB
    ok = gl.where(upper, ok1, ok0) & (tile * 64 + r < num_entries)
    return rec, ok


@gluon.jit
def _gl_tile_rows(tile, req, block_table_ptr, bt_stride, max_blocks, num_blocks, num_entries, offset_bytes, spb,
                  slot_stride, block_stride, SPB_LOG2: gl.constexpr, LR: gl.constexpr):
    """(int64 record byte offsets, readable) of the 64 entries of `tile`, in layout LR."""
    e = tile * 64 + gl.arange(0, 64, layout=LR)
    ok = e < num_entries
    bi, entry = _gl_block_entry(e, spb, SPB_LOG2)
    ok = ok & (bi < max_blocks)
    block = gl.load(block_table_ptr + req * bt_stride + bi, mask=ok, other=-1).to(gl.int64)
    ok = ok & (block >= 0) & (block < num_blocks)
    block = gl.where(ok, block, 0)
    return offset_bytes + block * block_stride + entry.to(gl.int64) * slot_stride, ok


@gluon.jit
def _gl_rows(tile, req, block_table_ptr, bt_stride, max_blocks, num_blocks, num_entries, offset_bytes, spb,
             slot_stride, block_stride, SPB_LOG2: gl.constexpr, FAST_ROWS: gl.constexpr, RB: gl.constexpr,
             LR: gl.constexpr):
    """(int64 record byte offsets, readable) of the 64 entries of `tile` in layout LR."""
    if FAST_ROWS:
        base0, base1, ok0, ok1 = _gl_tile_bases(tile, req, block_table_ptr, bt_stride, max_blocks, num_blocks,
                                                offset_bytes, block_stride, SPB_LOG2, RB)
        return _gl_rows_from_bases(base0, base1, ok0, ok1, tile, num_entries, RB, LR)
    else:
        return _gl_tile_rows(tile, req, block_table_ptr, bt_stride, max_blocks, num_blocks, num_entries,
                             offset_bytes, spb, slot_stride, block_stride, SPB_LOG2, LR)


@gluon.jit
def _gl_issue(stage, tile, req, key_ptr, codes_s, scale_s, block_table_ptr, bt_stride, max_blocks, num_blocks,
              num_entries, offset_bytes, spb, slot_stride, block_stride,
              SPB_LOG2: gl.constexpr, FAST_ROWS: gl.constexpr, RB: gl.constexpr, LC: gl.constexpr,
              LR: gl.constexpr):
    """cp.async the 64 records of `tile` (16 code words and the scale word each) into `stage`
    (rows that cannot be read become zeros). The rows are resolved in each copy's own layout:
    that costs less than a layout conversion (shared memory and barriers)."""
    w = gl.arange(0, 16, layout=gl.SliceLayout(0, LC))
    if FAST_ROWS:  # two block-table loads per tile, shared by both layouts
        base0, base1, ok0, ok1 = _gl_tile_bases(tile, req, block_table_ptr, bt_stride, max_blocks, num_blocks,
                                                offset_bytes, block_stride, SPB_LOG2, RB)
        rec_c, ok_c = _gl_rows_from_bases(base0, base1, ok0, ok1, tile, num_entries, RB, gl.SliceLayout(1, LC))
        rec, ok = _gl_rows_from_bases(base0, base1, ok0, ok1, tile, num_entries, RB, LR)
        src = (key_ptr + gl.expand_dims(rec_c, 1) + gl.expand_dims(w * 4, 0)).to(gl.pointer_type(gl.int32))
        if ok0 & ok1 & ((tile + 1) * 64 <= num_entries):  # the common case: no per-copy predicates
            async_copy.async_copy_global_to_shared(codes_s.index(stage), src)
            async_copy.async_copy_global_to_shared(scale_s.index(stage),
                                                   (key_ptr + rec + 64).to(gl.pointer_type(gl.int32)))
        else:
            async_copy.async_copy_global_to_shared(codes_s.index(stage), src, mask=gl.expand_dims(ok_c, 1))
            async_copy.async_copy_global_to_shared(scale_s.index(stage),
                                                   (key_ptr + rec + 64).to(gl.pointer_type(gl.int32)), mask=ok)
    else:
        rec_c, ok_c = _gl_tile_rows(tile, req, block_table_ptr, bt_stride, max_blocks, num_blocks, num_entries,
                                    offset_bytes, spb, slot_stride, block_stride, SPB_LOG2, gl.SliceLayout(1, LC))
        rec, ok = _gl_tile_rows(tile, req, block_table_ptr, bt_stride, max_blocks, num_blocks, num_entries,
                                offset_bytes, spb, slot_stride, block_stride, SPB_LOG2, LR)
        src = (key_ptr + gl.expand_dims(rec_c, 1) + gl.expand_dims(w * 4, 0)).to(gl.pointer_type(gl.int32))
        async_copy.async_copy_global_to_shared(codes_s.index(stage), src, mask=gl.expand_dims(ok_c, 1))
        async_copy.async_copy_global_to_shared(scale_s.index(stage), (key_ptr + rec + 64).to(gl.pointer_type(gl.int32)),
                                               mask=ok)


@gluon.jit
def _gl_index_scan_kernel(
    q_ptr, q_stride_n, q_stride_h, w_ptr, w_stride_n,
    key_ptr, num_blocks, offset_bytes, slots_per_block, slot_stride_bytes, block_stride_bytes,
    block_table_ptr, bt_stride, max_blocks, token_req_ptr, visible_ptr, num_entries,
    score_ptr, score_stride, block_score_ptr, block_score_stride, num_heads, scale,
    H: gl.constexpr, TILES: gl.constexpr, STAGES: gl.constexpr, CAND_BLOCK: gl.constexpr,
    WRITE_SCORES: gl.constexpr, WRITE_BLOCK_MAX: gl.constexpr, SPB_LOG2: gl.constexpr, FAST_ROWS: gl.constexpr,
    QSHIFT: gl.constexpr,
):
    """CTA (token n, span of TILES x 64 entries): scores and / or block maxima of the span."""
    gl.static_assert(64 % CAND_BLOCK == 0)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16])
    DA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)  # bf16 [64, 32]
    DW: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=1)  # 32-bit [64, 16]
    LC: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [4, 1], [1, 0])  # cp.async of code words: 32-byte rows
    LR: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # one value per entry (64 of 128 lanes)
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    SH_Q: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, 32], gl.bfloat16)
    # code words: 16-byte vectors XOR-swizzled by (row / 2) % 4, so the A-operand reads (8 rows x 4
    # words per instruction) hit 32 different banks
    SH_C: gl.constexpr = gl.SwizzledSharedLayout(4, 2, 4, [1, 0])
    SH_R: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    n = gl.program_id(0)
    first = gl.program_id(1) * TILES
    req = gl.load(token_req_ptr + n).to(gl.int64)
    visible = gl.load(visible_ptr + n)

    # Q_j [H, 32] = q[:, 4c + j] * 2**QSHIFT (column c = 2w + i holds channel 8w + 4i + j), in shared memory
    hq = gl.arange(0, H, layout=gl.SliceLayout(1, LQ))
    cq = gl.arange(0, 128, layout=gl.SliceLayout(0, LQ))
    q = gl.load(q_ptr + n.to(gl.int64) * q_stride_n + gl.expand_dims(hq * q_stride_h, 1) + gl.expand_dims(cq, 0),
                mask=gl.expand_dims(hq < num_heads, 1), other=0.0).to(gl.float32) * (2.0**QSHIFT)
    q_even, q_odd = gl.split(gl.reshape(q.to(gl.bfloat16), [H, 32, 2, 2]))  # j % 2 = 0 / 1
    q0, q2 = gl.split(q_even)
    q1, q3 = gl.split(q_odd)
    q0_s = gl.allocate_shared_memory(gl.bfloat16, [H, 32], SH_Q, q0)
    q1_s = gl.allocate_shared_memory(gl.bfloat16, [H, 32], SH_Q, q1)
    q2_s = gl.allocate_shared_memory(gl.bfloat16, [H, 32], SH_Q, q2)
    q3_s = gl.allocate_shared_memory(gl.bfloat16, [H, 32], SH_Q, q3)
    hw = gl.arange(0, H, layout=gl.SliceLayout(0, MMA))
    w = gl.load(w_ptr + n.to(gl.int64) * w_stride_n + hw, mask=hw < num_heads, other=0.0).to(gl.float32) * scale

    codes_s = gl.allocate_shared_memory(gl.int32, [STAGES, 64, 16], SH_C)
    scale_s = gl.allocate_shared_memory(gl.int32, [STAGES, 64], SH_R)

    # prologue: tiles first .. first + STAGES - 2 in flight (a tile past the span reads nothing)
    span_end = gl.minimum(num_entries, (first + TILES) * 64)
    for s in gl.static_range(STAGES - 1):
        _gl_issue(s, first + s, req, key_ptr, codes_s, scale_s, block_table_ptr, bt_stride, max_blocks, num_blocks,
                  span_end, offset_bytes, slots_per_block, slot_stride_bytes, block_stride_bytes, SPB_LOG2, FAST_ROWS,
                  68, LC, LR)
        async_copy.commit_group()

    wcol = gl.arange(0, 16, layout=gl.SliceLayout(0, DW))
    bshift = (wcol // 4) * 8  # word i of a thread (column l % 4 + 4 i) is in scale block i
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    for t in range(TILES):
        # every thread is done reading the stage of tile t - 1: refill it with tile t + STAGES - 1
        gl.thread_barrier()
        ahead = t + STAGES - 1
        _gl_issue(ahead % STAGES, first + ahead, req, key_ptr, codes_s, scale_s, block_table_ptr, bt_stride,
                  max_blocks, num_blocks, span_end, offset_bytes, slots_per_block, slot_stride_bytes,
                  block_stride_bytes, SPB_LOG2, FAST_ROWS, 68, LC, LR)
        async_copy.commit_group()
        # this tile's rows again, in the MMA's row layout, for the mask (issued before the wait)
        _, row_ok = _gl_rows(first + t, req, block_table_ptr, bt_stride, max_blocks, num_blocks, num_entries,
                             offset_bytes, slots_per_block, slot_stride_bytes, block_stride_bytes, SPB_LOG2, FAST_ROWS,
                             68, gl.SliceLayout(1, MMA))
        async_copy.wait_group(STAGES - 1)  # this thread's copies of tile t have landed
        gl.thread_barrier()  # and everyone's

        stage = t % STAGES
        words = codes_s.index(stage).load(DW)  # [64, 16]
        sc = gl.expand_dims(scale_s.index(stage).load(gl.SliceLayout(1, DW)), 1)
        # the bf16 2**(b - 1 - QSHIFT) of each word's block, twice (finite for b <= QSHIFT + 128)
        mult = gl.minimum(((sc >> gl.expand_dims(bshift, 0)) & 0xFF) + (126 - QSHIFT), 254) << 7
        mult = mult | (mult << 16)
        p0l, p0h, p1l, p1h, p2l, p2h, p3l, p3h = gl.inline_asm_elementwise(
            _WORD_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, mult], dtype=(gl.bfloat16,) * 8, is_pure=True,
            pack=1)
        k0 = gl.convert_layout(gl.reshape(gl.join(p0l, p0h), [64, 32]), DA, assert_trivial=True)
        k1 = gl.convert_layout(gl.reshape(gl.join(p1l, p1h), [64, 32]), DA, assert_trivial=True)
        k2 = gl.convert_layout(gl.reshape(gl.join(p2l, p2h), [64, 32]), DA, assert_trivial=True)
        k3 = gl.convert_layout(gl.reshape(gl.join(p3l, p3h), [64, 32]), DA, assert_trivial=True)
        acc = gl.zeros([64, H], gl.float32, layout=MMA)
        acc = warpgroup_mma(k0, q0_s.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(k1, q1_s.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(k2, q2_s.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(k3, q3_s.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))

        e = (first + t) * 64 + rows
        score = gl.sum(gl.maximum(acc, 0.0) * gl.expand_dims(w, 0), axis=1)  # [64]
        score = gl.where(row_ok & (e < visible), score, float("-inf"))
        if WRITE_SCORES:
            gl.store(score_ptr + n.to(gl.int64) * score_stride + e, score, mask=e < num_entries)
        if WRITE_BLOCK_MAX:
            bmax = gl.max(gl.reshape(score, [64 // CAND_BLOCK, CAND_BLOCK]), axis=1)
            LB: gl.constexpr = bmax.type.layout
            b = (first + t) * (64 // CAND_BLOCK) + gl.arange(0, 64 // CAND_BLOCK, layout=LB)
            gl.store(block_score_ptr + n.to(gl.int64) * block_score_stride + b, bmax, mask=b * CAND_BLOCK < num_entries)
    async_copy.wait_group(0)
