"""Triton kernels behind `cedserve.kernels.moe`: a grouped GEMM over expert-sorted token rows.

Rows (token, expert) pairs are sorted by expert and padded so that every `BLOCK_M` tile belongs to
one expert (`block_expert[tile]`, -1 for unused tiles; `padded_pair[row]`, -1 for padding). Two
kernels: `_moe_gate_up_kernel` (x @ [w1; w3]^T for one tile, SwiGLU with the clamp, times the
routing weight, bf16 rows of `h`) and `_moe_down_kernel` (h @ w2^T, bf16 rows per pair).

FP4 weights (checkpoint layout: uint8 `[E, out, in/2]`, input channel `2j` in the low nibble of
byte `j`, `2j + 1` in the high nibble; UE8M0 scale bytes `[E, out, in/32]`) are decoded in
registers into bf16 (exact) and multiplied by the matching even / odd input channels of the
activations, so no interleave is needed: `x . w = x_even . w_lo + x_odd . w_hi`.

`WORDS` (FP4, `BLOCK_K` dividing both widths): the index scan's word decode instead of a per-byte
one (`_indexer_kernels`, v4): each 32-bit word of codes gives four bf16 pair tensors with three
integer ops and one bf16x2 multiply by the block scale times 2**-64 per pair, `W_j[:, 2w + i]` =
input channel `8w + 4i + j` of the tile, against activations gathered in that order and scaled by
2**64 (both exact; scale bytes 59..192, weights 2**-68..2**65). Four MMAs of K = BLOCK_K / 4 per
step.
"""
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl

from cedserve.kernels._indexer_kernels import _load_q_pairs, _pairs_bf16
from cedserve.kernels._jit_codecs import _e2m1_decode, _to_output


@triton.jit
def _weight_halves(w_ptr, s_ptr, rows, row_ok, j, j_ok, w_row_stride, s_row_stride, FP4: tl.constexpr):
    """bf16 `[len(rows), len(j)]` (even, odd) input-channel halves of weight rows: channels `2j`
    and `2j + 1`. FP4: `j` are packed byte columns; bf16: two strided loads."""
    mask = row_ok[:, None] & j_ok[None, :]
    if FP4:
        packed = tl.load(w_ptr + rows[:, None].to(tl.int64) * w_row_stride + j[None, :], mask=mask,
                         other=0).to(tl.int32)
        exp = tl.load(s_ptr + rows[:, None].to(tl.int64) * s_row_stride + (j // 16)[None, :], mask=mask,
                      other=127).to(tl.int32)
        scale = (exp << 23).to(tl.float32, bitcast=True)
        w_lo = (_e2m1_decode(packed) * scale).to(tl.bfloat16)
        w_hi = (_e2m1_decode(packed >> 4) * scale).to(tl.bfloat16)
    else:
        base = w_ptr + rows[:, None].to(tl.int64) * w_row_stride + 2 * j[None, :]
        w_lo = tl.load(base, mask=mask, other=0.0)
        w_hi = tl.load(base + 1, mask=mask, other=0.0)
    return w_lo, w_hi


@triton.jit
def _weight_words(w_ptr, s_ptr, rows, row_ok, k0, w_row_stride, s_row_stride, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, QSHIFT: tl.constexpr, DOT_F32: tl.constexpr):
    """(W_0, W_1, W_2, W_3) bf16 `[BLOCK_N, BLOCK_K / 4]` of weight rows over input channels
    `[k0, k0 + BLOCK_K)`, `W_j[:, 2w + i]` = channel `k0 + 8w + 4i + j` times 2**-QSHIFT."""
    NW: tl.constexpr = BLOCK_K // 8
    wi = tl.arange(0, NW)
    row = rows[:, None].to(tl.int64)
    words = tl.load((w_ptr + row * w_row_stride + k0 // 2 + wi[None, :] * 4).to(tl.pointer_type(tl.int32)),
                    mask=row_ok[:, None], other=0)
    exp = tl.load(s_ptr + row * s_row_stride + (k0 // 32 + wi // 4)[None, :], mask=row_ok[:, None],
                  other=127).to(tl.int32)
    mult = tl.minimum(exp + (126 - QSHIFT), 254) << 7
    mult = mult | (mult << 16)
    return (_pairs_bf16(words, mult, BLOCK_N, NW, DOT_F32), _pairs_bf16(words >> 4, mult, BLOCK_N, NW, DOT_F32),
            _pairs_bf16(words >> 8, mult, BLOCK_N, NW, DOT_F32), _pairs_bf16(words >> 12, mult, BLOCK_N, NW, DOT_F32))


@triton.jit
def _act_words(a_ptr, rows, row_ok, k0, a_row_stride, BLOCK_K: tl.constexpr, QSHIFT: tl.constexpr,
               DOT_F32: tl.constexpr):
    """Activation rows over `[k0, k0 + BLOCK_K)` in `_weight_words`' channel order, times 2**QSHIFT."""
    NW: tl.constexpr = BLOCK_K // 8
    base = a_ptr + rows.to(tl.int64) * a_row_stride + k0
    qc = tl.reshape(tl.arange(0, NW)[:, None] * 8 + tl.arange(0, 2)[None, :] * 4, [2 * NW])
    return (_load_q_pairs(base[:, None], qc, row_ok, QSHIFT, DOT_F32),
            _load_q_pairs(base[:, None], qc + 1, row_ok, QSHIFT, DOT_F32),
            _load_q_pairs(base[:, None], qc + 2, row_ok, QSHIFT, DOT_F32),
            _load_q_pairs(base[:, None], qc + 3, row_ok, QSHIFT, DOT_F32))


@triton.jit
def _mma4(a0, a1, a2, a3, w0, w1, w2, w3, acc, DOT_F32: tl.constexpr):
    return _mma(a3, w3, _mma(a2, w2, _mma(a1, w1, _mma(a0, w0, acc, DOT_F32), DOT_F32), DOT_F32), DOT_F32)


@triton.jit
def _act_halves(a_ptr, rows, row_ok, j, j_ok, a_row_stride):
    """(even, odd) input-channel halves `[len(rows), len(j)]` of activation rows."""
    base = a_ptr + rows[:, None].to(tl.int64) * a_row_stride + 2 * j[None, :]
    mask = row_ok[:, None] & j_ok[None, :]
    return tl.load(base, mask=mask, other=0.0), tl.load(base + 1, mask=mask, other=0.0)


@triton.jit
def _mma(a, w, acc, DOT_F32: tl.constexpr):
    """acc + a @ w^T (fp32 operands under the interpreter, whose bf16 dot is broken)."""
    if DOT_F32:
        return acc + tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)))
    return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, x_row_stride, block_expert_ptr, padded_pair_ptr, route_w_ptr,
    w_ptr, w_expert_stride, w_row_stride, s_ptr, s_expert_stride, s_row_stride,
    h_ptr, h_row_stride,
    hidden, inter, swiglu_limit,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP4: tl.constexpr, HAS_LIMIT: tl.constexpr, DOT_F32: tl.constexpr, WORDS: tl.constexpr = False,
    QSHIFT: tl.constexpr = 64,
):
    """h[tile rows, n-block] = w * silu(min(g, L)) * clamp(u, -L, L), g/u = x @ w1^T / x @ w3^T."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(padded_pair_ptr + r)
        row_ok = pair >= 0
        token = tl.where(row_ok, pair // TOP_K, 0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        w_base = w_ptr + expert.to(tl.int64) * w_expert_stride
        s_base = s_ptr + expert.to(tl.int64) * s_expert_stride
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            if WORDS:
                a0, a1, a2, a3 = _act_words(x_ptr, token, row_ok, k0, x_row_stride, BLOCK_K, QSHIFT, DOT_F32)
                g0, g1, g2, g3 = _weight_words(w_base, s_base, n, n_ok, k0, w_row_stride, s_row_stride, BLOCK_N,
                                               BLOCK_K, QSHIFT, DOT_F32)
                gate = _mma4(a0, a1, a2, a3, g0, g1, g2, g3, gate, DOT_F32)
                u0, u1, u2, u3 = _weight_words(w_base, s_base, n + inter, n_ok, k0, w_row_stride, s_row_stride,
                                               BLOCK_N, BLOCK_K, QSHIFT, DOT_F32)
                up = _mma4(a0, a1, a2, a3, u0, u1, u2, u3, up, DOT_F32)
            else:
                j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                j_ok = j < hidden // 2
                a_lo, a_hi = _act_halves(x_ptr, token, row_ok, j, j_ok, x_row_stride)
                g_lo, g_hi = _weight_halves(w_base, s_base, n, n_ok, j, j_ok, w_row_stride, s_row_stride, FP4)
                gate = _mma(a_hi, g_hi, _mma(a_lo, g_lo, gate, DOT_F32), DOT_F32)
                u_lo, u_hi = _weight_halves(w_base, s_base, n + inter, n_ok, j, j_ok, w_row_stride, s_row_stride,
                                            FP4)
                up = _mma(a_hi, u_hi, _mma(a_lo, u_lo, up, DOT_F32), DOT_F32)
        if HAS_LIMIT:
            up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
            gate = tl.minimum(gate, swiglu_limit)
        weight = tl.load(route_w_ptr + tl.where(row_ok, pair, 0), mask=row_ok, other=0.0).to(tl.float32)
        h = weight[:, None] * (gate / (1.0 + tl.exp(-gate)) * up)
        h_out = h_ptr + r[:, None].to(tl.int64) * h_row_stride + n[None, :]
        tl.store(h_out, _to_output(h, h_ptr), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(
    h_ptr, h_row_stride, block_expert_ptr, padded_pair_ptr,
    w_ptr, w_expert_stride, w_row_stride, s_ptr, s_expert_stride, s_row_stride,
    out_ptr, out_row_stride,
    hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP4: tl.constexpr,
    DOT_F32: tl.constexpr, WORDS: tl.constexpr = False, QSHIFT: tl.constexpr = 64,
):
    """out[pair, n-block] = h[tile rows] @ w2^T, rounded to the output dtype."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(padded_pair_ptr + r)
        row_ok = pair >= 0
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        w_base = w_ptr + expert.to(tl.int64) * w_expert_stride
        s_base = s_ptr + expert.to(tl.int64) * s_expert_stride
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            if WORDS:
                a0, a1, a2, a3 = _act_words(h_ptr, r, row_ok, k0, h_row_stride, BLOCK_K, QSHIFT, DOT_F32)
                w0, w1, w2, w3 = _weight_words(w_base, s_base, n, n_ok, k0, w_row_stride, s_row_stride, BLOCK_N,
                                               BLOCK_K, QSHIFT, DOT_F32)
                acc = _mma4(a0, a1, a2, a3, w0, w1, w2, w3, acc, DOT_F32)
            else:
                j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                j_ok = j < inter // 2
                a_lo, a_hi = _act_halves(h_ptr, r, row_ok, j, j_ok, h_row_stride)
                w_lo, w_hi = _weight_halves(w_base, s_base, n, n_ok, j, j_ok, w_row_stride, s_row_stride, FP4)
                acc = _mma(a_hi, w_hi, _mma(a_lo, w_lo, acc, DOT_F32), DOT_F32)
        out = out_ptr + tl.where(row_ok, pair, 0)[:, None].to(tl.int64) * out_row_stride + n[None, :]
        tl.store(out, _to_output(acc, out_ptr), mask=row_ok[:, None] & n_ok[None, :])
