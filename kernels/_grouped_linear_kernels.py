"""Triton kernel behind `cedserve.kernels.grouped_linear`.

`_grouped_linear_kernel`, grid (groups x column blocks, row blocks, K splits): a program owns
`BLOCK_M` rows and `BLOCK_R` output columns of one group and walks its split's `K_SPLIT` inputs of
that group in `BLOCK_K` steps, accumulating `x[rows, g, k-block] @ w[g * R + cols, k-block]^T` in
float32. With one split it writes the output; with several, each writes its float32 partial sums
to `out[split]` and `_sum_splits_kernel` adds them in split order (fixed: no atomics). Float32 operands are
multiplied with `input_precision="ieee"` (full float32 products, not TF32); bf16 / fp16 operands on
the tensor cores, or (`DOT_F32`, the interpreter) upcast first, which is exact. One pass, no
atomics: the same inputs give the same bits.
"""
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _grouped_linear_kernel(
    x_ptr, stride_xn, stride_xg,
    w_ptr, stride_wr,
    out_ptr, stride_os, stride_on,
    N, K, R, K_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: wait for the kernels before, let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    col_blocks = tl.cdiv(R, BLOCK_R)
    group = tl.program_id(0) // col_blocks
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tl.program_id(0) % col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    split = tl.program_id(2)
    row_ok = rows < N
    col_ok = cols < R
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xn + group * stride_xg
    w_cols = w_ptr + (group * R + cols).to(tl.int64)[None, :] * stride_wr
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_start = split * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    out = out_ptr + split.to(tl.int64) * stride_os + rows.to(tl.int64)[:, None] * stride_on + (group * R + cols)[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, stride_ps, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """`out[i] = sum over s of part[s, i]` (float32, in split order), cast to `out`'s dtype."""
    if PDL:  # programmatic dependent launch: wait for the kernels before, let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in range(1, SPLITS):
        acc += tl.load(part_ptr + s * stride_ps + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)
