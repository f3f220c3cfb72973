"""Gluon kernel behind `write_records("index", ...)` on sm_90 (v12, `version=12`).

The index-key writer's Triton versions were bound by one of two things (kernels-notes.md,
"Profile of the index-key writer"): v3 by its integer work (ALU pipe 91 %), v4 (a third less of
it) by L2, because the layout Triton chose stored each 68-byte record's 4-byte words from lanes
of different records. Here the layout is ours: 16 lanes own one 128-channel row, a lane 8
contiguous channels (one 16-byte load, one code word), so

* a record's 16 code words are stored by 16 neighbouring lanes (64 contiguous bytes) and its scale
  word by one lane right after them;
* a 32-channel block's maximum is 4 lanes' (two shuffles), its UE8M0 scale and the 4-scale word a
  reduction across the row's lanes;
* the arithmetic is v4's (`_e2m1_code_fast`: one multiply by the exact power-of-two inverse, the
  rounding on the bits), so inputs must be bf16 or fp16.

A program writes `TILES` tiles of `BLOCK_T` rows and loads tile i + 1 (rows and slots) before it
quantizes and stores tile i. Same bytes as the reference (tested bit-exact on the GPU).
"""
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from cedserve.kernels import _jit_codecs

# the Triton codecs are elementwise: the same source compiles under Gluon
_e2m1_code_fast = gluon.jit(_jit_codecs._e2m1_code_fast.fn)
_ceil_log2 = gluon.jit(_jit_codecs._ceil_log2.fn)


@gluon.jit
def _gl_slot_address(slot, num_slots, offset, spb, slot_stride, block_stride):
    """(int64 record byte offsets, valid) of slots (-1 or out of range: invalid): the arithmetic
    of `_jit_codecs._slot_address`, in whatever layout `slot` has."""
    valid = (slot >= 0) & (slot < num_slots)
    slot = gl.where(valid, slot, 0).to(gl.int32)
    block = slot // spb
    entry = slot - block * spb
    rec = offset + block.to(gl.int64) * block_stride + entry.to(gl.int64) * slot_stride
    return rec, valid


@gluon.jit
def _gl_write_index_kernel(
    x_ptr, x_row_stride, slot_ptr, out_ptr,
    num_tokens, num_slots, offset_bytes, slots_per_block, slot_stride_bytes, block_stride_bytes,
    BLOCK_T: gl.constexpr, TILES: gl.constexpr, num_warps: gl.constexpr,
):
    """Quantize `x [num_tokens, 128]` (bf16 / fp16) rows to 68-byte index-key records (64 bytes of
    E2M1 pairs, 4 UE8M0 scales) at their slots; rows whose slot is invalid are skipped."""
    L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])  # [row, channel]
    LB: gl.constexpr = gl.BlockedLayout([1, 1, 8], [2, 4, 4], [num_warps, 1, 1], [2, 1, 0])  # [row, block, ch]
    LW: gl.constexpr = gl.BlockedLayout([1, 1, 8], [2, 16, 1], [num_warps, 1, 1], [2, 1, 0])  # [row, word, code]
    LR: gl.constexpr = gl.SliceLayout(1, L)
    rows = gl.arange(0, BLOCK_T, layout=LR)
    ch = gl.arange(0, 128, layout=gl.SliceLayout(0, L))
    tok = gl.program_id(0) * (TILES * BLOCK_T) + rows
    ok = tok < num_tokens
    slot = gl.load(slot_ptr + tok, mask=ok, other=-1)
    x = gl.load(x_ptr + gl.expand_dims(tok.to(gl.int64) * x_row_stride, 1) + gl.expand_dims(ch, 0),
                mask=gl.expand_dims(ok, 1), other=0.0)
    WR: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LW))
    word = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))
    shifts = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW))) * 4
    bshift = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, LB))) * 8
    for i in range(TILES):
        nxt = tok + BLOCK_T
        nxt_ok = (nxt < num_tokens) & (i + 1 < TILES)
        slot_next = gl.load(slot_ptr + nxt, mask=nxt_ok, other=-1)
        x_next = gl.load(x_ptr + gl.expand_dims(nxt.to(gl.int64) * x_row_stride, 1) + gl.expand_dims(ch, 0),
                         mask=gl.expand_dims(nxt_ok, 1), other=0.0)
        xb = gl.convert_layout(gl.reshape(x.to(gl.float32), [BLOCK_T, 4, 32]), LB)
        amax = gl.max(gl.abs(xb), axis=2)  # [T, 4]
        # UE8M0 scale 2**k, k = ceil(log2(max(amax, 6 * 2**-126) / 6)); multiply by the exact 2**-k
        k = _ceil_log2(gl.maximum(amax, 7.052966104933725e-38) * 0.16666666666666666)
        biased = gl.minimum(gl.maximum(k + 127, 0), 255)
        inv = ((254 - biased) << 23).to(gl.float32, bitcast=True)
        code = _e2m1_code_fast(xb * gl.expand_dims(inv, 2)) | ((xb.to(gl.int32, bitcast=True) >> 28) & 8)
        code = gl.convert_layout(gl.reshape(code, [BLOCK_T, 16, 8]), LW)
        words = gl.sum(code << gl.expand_dims(gl.expand_dims(shifts, 0), 1), axis=2)  # [T, 16], disjoint nibbles
        scale_word = gl.sum(biased << gl.expand_dims(bshift, 0), axis=1)  # [T]
        rec, valid = _gl_slot_address(gl.convert_layout(slot, WR), num_slots, offset_bytes, slots_per_block,
                                      slot_stride_bytes, block_stride_bytes)
        valid = valid & gl.convert_layout(ok, WR)
        base = out_ptr + rec
        gl.store((gl.expand_dims(base, 1) + gl.expand_dims(word * 4, 0)).to(gl.pointer_type(gl.int32)), words,
                 mask=gl.expand_dims(valid, 1))
        RS: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LB))
        gl.store((gl.convert_layout(base, RS) + 64).to(gl.pointer_type(gl.int32)), scale_word,
                 mask=gl.convert_layout(valid, RS))
        tok = nxt
        ok = nxt < num_tokens
        slot = slot_next
        x = x_next
