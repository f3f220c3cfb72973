"""Triton kernels behind `cedserve.kernels.mhc`: the tail of one mHC site, and a whole site.

`_hc_mix_tail_kernel` takes `BLOCK_S` tokens per program. A token's row of `mixes` (float32,
`(2 + N) * N` values: `pre` logits `[0, N)`, `post` logits `[N, 2N)`, then the `[N, N]` comb logits
row-major, `(from, to)`) becomes `pre = sigmoid(a * scale[0] + base) + eps`, `post = 2 sigmoid(a *
scale[1] + base)` and the Sinkhorn projection of `c * scale[2] + base` (`_hc_tail`), all held in
registers as `[BLOCK_S, N]` and `[BLOCK_S, N, N]` tiles, in the torch reference's order of operations.

A site (`hc_site`) is two launches over a partials buffer `part [S, chunks, M + 2]` float32 (`M =
(2 + N) * N`; per row and chunk of `BLOCK_D` columns: the `M` partial dot products with `fn`, then
the partial sum of squares of the row's streams, then that of its collapsed row):

* `_hc_site_streams_kernel`, grid (row blocks, column chunks): the streams chunk (expanded from the
  previous sublayer's output when `EXPAND`, rounded to the streams dtype and stored), its partials,
  and the collapsed chunk `sum_k pre_prev[k] * streams[k]` rounded to the streams dtype;
* `_hc_site_finish_kernel`, grid (row blocks): the partials summed in chunk order (no atomics: the same
  inputs give the same bits), the RMS scale of the projection, `_hc_tail`, and the sublayer input
  `weight * rms_normalize(collapsed)`.
"""
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl

from cedserve.kernels._jit_codecs import _to_output


@triton.jit
def _hc_tail(a_pre, a_post, comb_logits, scale_ptr, base_ptr, iters, hc_eps, N: tl.constexpr):
    """`pre`, `post` `[R, N]` and `comb` `[R, N, N]` from the site's projection `a_pre`, `a_post`
    `[R, N]` and `comb_logits [R, N(from j), N(to k)]` (float32, before `scale` and `base`)."""
    c = tl.arange(0, N)
    a = a_pre * tl.load(scale_ptr) + tl.load(base_ptr + c)[None, :]
    pre = tl.sigmoid(a) + hc_eps
    b = a_post * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + c)[None, :]
    post = 2 * tl.sigmoid(b)
    jk = (c[:, None] * N + c[None, :])[None, :, :]  # [1, N, N]
    logits = comb_logits * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + jk)
    # row softmax (over k), then eps, then the column normalisation (over j)
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    m = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
    m = m / (tl.sum(m, axis=1)[:, None, :] + hc_eps)
    for _ in range(iters - 1):
        m = m / (tl.sum(m, axis=2)[:, :, None] + hc_eps)
        m = m / (tl.sum(m, axis=1)[:, None, :] + hc_eps)
    return pre, post, m


@triton.jit
def _hc_mix_tail_kernel(
    mixes_ptr, mixes_row_stride, scale_ptr, base_ptr,
    pre_ptr, post_ptr, comb_ptr,
    num_tokens, iters, hc_eps,
    N: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """pre/post `[S, N]` and comb `[S, N, N]` (contiguous) from `mixes [S, (2+N)*N]`."""
    if PDL:  # programmatic dependent launch: wait for the kernels before, let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = s < num_tokens
    c = tl.arange(0, N)
    row = mixes_ptr + s.to(tl.int64) * mixes_row_stride  # [BLOCK_S]
    mask2 = s_ok[:, None] & (c[None, :] < N)
    a = tl.load(row[:, None] + c[None, :], mask=mask2, other=0.0)
    b = tl.load(row[:, None] + N + c[None, :], mask=mask2, other=0.0)
    jk = (c[:, None] * N + c[None, :])[None, :, :]  # [1, N, N]
    mask3 = s_ok[:, None, None] & (jk < N * N)
    logits = tl.load(row[:, None, None] + 2 * N + jk, mask=mask3, other=0.0)
    pre, post, comb = _hc_tail(a, b, logits, scale_ptr, base_ptr, iters, hc_eps, N)
    out2 = s.to(tl.int64)[:, None] * N + c[None, :]
    tl.store(pre_ptr + out2, pre, mask=mask2)
    tl.store(post_ptr + out2, post, mask=mask2)
    tl.store(comb_ptr + s.to(tl.int64)[:, None, None] * (N * N) + jk, comb, mask=mask3)


@triton.jit
def _hc_site_streams_kernel(
    streams_ptr, streams_row_stride, streams_hc_stride,
    x_ptr, x_row_stride, post_ptr, comb_ptr,
    out_ptr, pre_ptr, fn_ptr, fn_row_stride,
    collapsed_ptr, part_ptr,
    num_rows, dim, num_chunks,
    N: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr, EXPAND: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One `[BLOCK_R, N, BLOCK_D]` block of the site's streams -> partials and collapsed chunk.

    `streams [S, N, D]` (unit stride in D); when `EXPAND`, the stored streams are `out[k] =
    post[k] * x + sum_j comb[j, k] * streams[j]` (`x [S, D]`, `post [S, N]`, `comb [S, N, N]`
    float32 contiguous; `out` contiguous), else the streams themselves. `pre_ptr [S, N]` float32:
    the previous site's `pre`; `fn [M, N * D]`; `collapsed [S, D]` (streams dtype) and `part [S,
    chunks, M + 2]` contiguous."""
    if PDL:  # programmatic dependent launch: wait for the kernels before, let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows_ok, cols_ok = rows < num_rows, cols < dim
    ok = rows_ok[:, None] & cols_ok[None, :]  # [BLOCK_R, BLOCK_D]
    rows64 = rows.to(tl.int64)
    hc = tl.arange(0, N)
    m = tl.arange(0, M_PAD)
    in_rows = streams_ptr + rows64 * streams_row_stride  # [BLOCK_R]
    if EXPAND:
        x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        residual = tl.load(in_rows[:, None, None] + hc[None, :, None] * streams_hc_stride + cols[None, None, :],
                           mask=ok[:, None, :], other=0.0).to(tl.float32)  # [BLOCK_R, N(j), BLOCK_D]
    sum_sq = tl.zeros([BLOCK_R], dtype=tl.float32)
    dots = tl.zeros([BLOCK_R, M_PAD], dtype=tl.float32)
    collapsed = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(N):
        if EXPAND:
            post = tl.load(post_ptr + rows64 * N + k, mask=rows_ok, other=0.0)  # [BLOCK_R]
            comb = tl.load(comb_ptr + rows64[:, None] * (N * N) + hc[None, :] * N + k,
                           mask=rows_ok[:, None], other=0.0)  # [BLOCK_R, N(j)]: comb[:, j, k]
            mixed = tl.sum(comb[:, :, None] * residual, axis=1)
            stream = _to_output(post[:, None] * x + mixed, collapsed_ptr)  # the streams dtype
            tl.store(out_ptr + rows64[:, None] * (N * dim) + k * dim + cols[None, :], stream, mask=ok)
            stream = stream.to(tl.float32)
        else:
            stream = tl.load(in_rows[:, None] + k * streams_hc_stride + cols[None, :], mask=ok,
                             other=0.0).to(tl.float32)
        sum_sq += tl.sum(stream * stream, axis=1)
        pre = tl.load(pre_ptr + rows64 * N + k, mask=rows_ok, other=0.0)
        collapsed += pre[:, None] * stream
        fn = tl.load(fn_ptr + m[:, None] * fn_row_stride + k * dim + cols[None, :],
                     mask=(m[:, None] < M) & cols_ok[None, :], other=0.0).to(tl.float32)  # [M_PAD, BLOCK_D]
        dots += tl.sum(stream[:, None, :] * fn[None, :, :], axis=2)
    rounded = _to_output(collapsed, collapsed_ptr)
    tl.store(collapsed_ptr + rows64[:, None] * dim + cols[None, :], rounded, mask=ok)
    rounded32 = rounded.to(tl.float32)
    collapsed_sq = tl.sum(rounded32 * rounded32, axis=1)
    part = part_ptr + (rows64 * num_chunks + tl.program_id(1)) * (M + 2)  # [BLOCK_R]
    tl.store(part[:, None] + m[None, :], dots, mask=rows_ok[:, None] & (m[None, :] < M))
    tl.store(part + M, sum_sq, mask=rows_ok)
    tl.store(part + M + 1, collapsed_sq, mask=rows_ok)


@triton.jit
def _hc_site_finish_kernel(
    part_ptr, scale_ptr, base_ptr, collapsed_ptr, weight_ptr,
    pre_ptr, post_ptr, comb_ptr, x_ptr,
    num_rows, dim, num_chunks, iters, hc_eps, norm_eps,
    N: tl.constexpr, M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """`BLOCK_S` rows: the partials -> `pre`, `post` `[S, N]`, `comb [S, N, N]` and `x [S, D]`
    (all contiguous; `collapsed [S, D]` in the streams dtype, `weight [D]`)."""
    if PDL:  # programmatic dependent launch: wait for the kernels before, let the next one start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    rows_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    hc = tl.arange(0, N)
    jk = (hc[:, None] * N + hc[None, :])[None, :, :]  # [1, N, N]
    ok2, ok3 = rows_ok[:, None] & (hc[None, :] < N), rows_ok[:, None, None] & (jk < N * N)
    a_pre = tl.zeros([BLOCK_S, N], dtype=tl.float32)
    a_post = tl.zeros([BLOCK_S, N], dtype=tl.float32)
    a_comb = tl.zeros([BLOCK_S, N, N], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_S], dtype=tl.float32)
    collapsed_sq = tl.zeros([BLOCK_S], dtype=tl.float32)
    for chunk in range(num_chunks):  # in chunk order: the same partials give the same sums
        part = part_ptr + (rows64 * num_chunks + chunk) * (M + 2)  # [BLOCK_S]
        a_pre += tl.load(part[:, None] + hc[None, :], mask=ok2, other=0.0)
        a_post += tl.load(part[:, None] + N + hc[None, :], mask=ok2, other=0.0)
        a_comb += tl.load(part[:, None, None] + 2 * N + jk, mask=ok3, other=0.0)
        sum_sq += tl.load(part + M, mask=rows_ok, other=0.0)
        collapsed_sq += tl.load(part + M + 1, mask=rows_ok, other=0.0)
    # the projection of the RMS-normalised row: every dot product times the row's 1 / rms
    inv_rms = tl.rsqrt(sum_sq / (N * dim) + norm_eps)
    pre, post, comb = _hc_tail(a_pre * inv_rms[:, None], a_post * inv_rms[:, None],
                               a_comb * inv_rms[:, None, None], scale_ptr, base_ptr, iters, hc_eps, N)
    out2 = rows64[:, None] * N + hc[None, :]
    tl.store(pre_ptr + out2, pre, mask=ok2)
    tl.store(post_ptr + out2, post, mask=ok2)
    tl.store(comb_ptr + rows64[:, None, None] * (N * N) + jk, comb, mask=ok3)

    inv_rms_c = tl.rsqrt(collapsed_sq / dim + norm_eps)[:, None]
    cols = tl.arange(0, BLOCK_D)
    for start in range(0, dim, BLOCK_D):
        ok = rows_ok[:, None] & (start + cols < dim)[None, :]
        at = rows64[:, None] * dim + start + cols[None, :]
        c = tl.load(collapsed_ptr + at, mask=ok, other=0.0).to(tl.float32)
        normed = _to_output(c * inv_rms_c, collapsed_ptr).to(tl.float32)
        w = tl.load(weight_ptr + start + cols, mask=start + cols < dim, other=0.0).to(tl.float32)
        tl.store(x_ptr + at, _to_output(w[None, :] * normed, x_ptr), mask=ok)
