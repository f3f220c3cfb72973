"""Triton kernels behind `cedserve.kernels.moe`: a grouped GEMM over expert-sorted token rows.

Rows (token, expert) pairs are sorted by expert and padded so that every `BLOCK_M` tile belongs to
one expert (`block_expert[tile]`, -1 for unused tiles; `padded_pair[row]`, -1 for padding). Two
kernels: `_moe_gate_up_kernel` (x @ [w1; w3]^T for one tile, SwiGLU with the clamp, times the
routing weight, bf16 rows of `h`) and `_moe_down_kernel` (h @ w2^T, bf16 rows per pair).

FP4 weights (checkpoint layout: uint8 `[E, out, in/2]`, input channel `2j` in the low nibble of
byte `j`, `2j + 1` in the high nibble; UE8M0 scale bytes `[E, out, in/32]`) are decoded in
registers into bf16 (exact) and multiplied by the matching even / odd input channels of the
activations, so no interleave is needed: `x . w = x_even . w_lo + x_odd . w_hi`.
"""
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl

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
    FP4: tl.constexpr, HAS_LIMIT: tl.constexpr, DOT_F32: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """h[tile rows, n-block] = w * silu(min(g, L)) * clamp(u, -L, L), g/u = x @ w1^T / x @ w3^T."""
    if PDL:  # programmatic dependent launch: wait for the kernels before, let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            j_ok = j < hidden // 2
            a_lo, a_hi = _act_halves(x_ptr, token, row_ok, j, j_ok, x_row_stride)
            g_lo, g_hi = _weight_halves(w_base, s_base, n, n_ok, j, j_ok, w_row_stride, s_row_stride, FP4)
            gate = _mma(a_hi, g_hi, _mma(a_lo, g_lo, gate, DOT_F32), DOT_F32)
            u_lo, u_hi = _weight_halves(w_base, s_base, n + inter, n_ok, j, j_ok, w_row_stride, s_row_stride, FP4)
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
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out[pair, n-block] = h[tile rows] @ w2^T, rounded to the output dtype."""
    if PDL:  # programmatic dependent launch: wait for the kernels before, let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            j_ok = j < inter // 2
            a_lo, a_hi = _act_halves(h_ptr, r, row_ok, j, j_ok, h_row_stride)
            w_lo, w_hi = _weight_halves(w_base, s_base, n, n_ok, j, j_ok, w_row_stride, s_row_stride, FP4)
            acc = _mma(a_hi, w_hi, _mma(a_lo, w_lo, acc, DOT_F32), DOT_F32)
        out = out_ptr + tl.where(row_ok, pair, 0)[:, None].to(tl.int64) * out_row_stride + n[None, :]
        tl.store(out, _to_output(acc, out_ptr), mask=row_ok[:, None] & n_ok[None, :])
