"""Triton kernel behind `cedserve.kernels.skinny`: a matmul with a handful of rows.

`_skinny_mm_kernel`, grid (column blocks, batch): `out[b, :, n] = sum_k x[b, :, k] * w[b, n, k]` for
`BLOCK_N` output columns per program, every one of the `M <= M_P2` rows at once. Each program streams
its `[BLOCK_N, K]` slab of `w` once, in `BLOCK_K` steps along `w`'s contiguous axis, and multiplies
it with the `[M_P2, BLOCK_K]` rows of `x` (padding rows are zeros and are not stored) in float32 FMAs:
a memory-bound GEMV over all rows, where cuBLAS picks a tiled float32 GEMM whose tiles are mostly
padding.
"""
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _skinny_mm_kernel(x_ptr, w_ptr, out_ptr, M, N, K,
                      sx_b, sx_m, sx_k, sw_b, sw_n, sw_k, so_b, so_m, so_n,
                      M_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, M_P2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_base = x_ptr + b * sx_b + rows[:, None] * sx_m
    w_base = w_ptr + b * sw_b + cols[:, None].to(tl.int64) * sw_n
    acc = tl.zeros((M_P2, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_base + ks[None, :] * sx_k, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_base + ks[None, :] * sw_k, mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    out = out_ptr + b * so_b + rows[:, None] * so_m + cols[None, :] * so_n
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
