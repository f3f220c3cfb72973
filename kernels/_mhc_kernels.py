"""Triton kernel behind `cedserve.kernels.mhc`: the tail of one mHC site in one launch.

Each program takes `BLOCK_S` tokens. A token's row of `mixes` (float32, `(2 + N) * N` values:
`pre` logits `[0, N)`, `post` logits `[N, 2N)`, then the `[N, N]` comb logits row-major, `(from, to)`)
becomes `pre = sigmoid(a * scale[0] + base) + eps`, `post = 2 sigmoid(a * scale[1] + base)` and the
Sinkhorn projection of `c * scale[2] + base`, all held in registers as `[BLOCK_S, N]` and
`[BLOCK_S, N, N]` tiles, in the torch reference's order of operations.
"""
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _hc_mix_tail_kernel(
    mixes_ptr, mixes_row_stride, scale_ptr, base_ptr,
    pre_ptr, post_ptr, comb_ptr,
    num_tokens, iters, hc_eps,
    N: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """pre/post `[S, N]` and comb `[S, N, N]` (contiguous) from `mixes [S, (2+N)*N]`."""
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = s < num_tokens
    c = tl.arange(0, N)
    row = mixes_ptr + s.to(tl.int64) * mixes_row_stride  # [BLOCK_S]

    # pre / post: [BLOCK_S, N]
    mask2 = s_ok[:, None] & (c[None, :] < N)
    out2 = s.to(tl.int64)[:, None] * N + c[None, :]
    a = tl.load(row[:, None] + c[None, :], mask=mask2, other=0.0)
    a = a * tl.load(scale_ptr) + tl.load(base_ptr + c)[None, :]
    tl.store(pre_ptr + out2, tl.sigmoid(a) + hc_eps, mask=mask2)
    b = tl.load(row[:, None] + N + c[None, :], mask=mask2, other=0.0)
    b = b * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + c)[None, :]
    tl.store(post_ptr + out2, 2 * tl.sigmoid(b), mask=mask2)

    # comb: [BLOCK_S, N(from j), N(to k)]
    jk = (c[:, None] * N + c[None, :])[None, :, :]  # [1, N, N]
    mask3 = s_ok[:, None, None] & (jk < N * N)
    logits = tl.load(row[:, None, None] + 2 * N + jk, mask=mask3, other=0.0)
    logits = logits * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + jk)
    # row softmax (over k), then eps, then the column normalisation (over j)
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    m = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
    m = m / (tl.sum(m, axis=1)[:, None, :] + hc_eps)
    for _ in range(iters - 1):
        m = m / (tl.sum(m, axis=2)[:, :, None] + hc_eps)
        m = m / (tl.sum(m, axis=1)[:, None, :] + hc_eps)
    tl.store(comb_ptr + s.to(tl.int64)[:, None, None] * (N * N) + jk, m, mask=mask3)
