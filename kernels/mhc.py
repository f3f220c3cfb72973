"""mHC sites in few launches: the tail of one (`cedserve.model.mhc.hc_mixes`: sigmoids and Sinkhorn)
in one, a whole site (expansion, projection, tail, collapse and RMSNorm) in two.

From the site's projection `mixes [S, (2 + n) * n]` (float32; `n` = hc_mult streams), `scale [3]`
and `base [(2 + n) * n]`, :func:`hc_mix_tail` returns

    pre  [S, n]    = sigmoid(mixes[:, :n] * scale[0] + base[:n]) + eps
    post [S, n]    = 2 * sigmoid(mixes[:, n:2n] * scale[1] + base[n:2n])
    comb [S, n, n] = sinkhorn(mixes[:, 2n:] * scale[2] + base[2n:] as [S, n(from), n(to)])

where :func:`sinkhorn` is a row softmax plus `eps`, a column normalisation, then `iters - 1`
row/column normalisation pairs (each divides by the sum plus `eps`). In torch that is ~6 ops per
iteration, ~250 launches per site at 20 iterations; the kernel (`_hc_mix_tail_kernel`) keeps a
token's `n x n` matrix in registers for all of them, in the same order of operations (float32
results agree with the reference to ~1e-6; `exp` and division may round differently on a GPU).

A whole site, :func:`hc_site`, in two launches (the captured decode step's mHC: `model/slot_step.py`).
From the streams entering the site `[S, n, D]` (optionally first expanded by the previous sublayer:
`hc_expand(out, streams, post, comb)`), the previous site's `pre_prev [S, n]`, the site's `fn [(2 +
n) * n, n * D]`, `scale`, `base` and the sublayer's RMSNorm weight `[D]`, it returns

    streams            the expanded streams (or the input), in the streams dtype
    x    [S, D]        = weight * rms_normalize(hc_collapse(streams, pre_prev))
    pre, post, comb    = hc_mix_tail(rms_normalize(flat streams, fp32) @ fn^T, scale, base)

which is :func:`hc_site_reference`, the composition of those functions. The first kernel takes
`[rows, chunk of D]` blocks (many programs even at one row of the released width, hidden 4096): the
expanded chunk rounded to the streams dtype (the rounded value is what the rest reads, as in the
composition), partial sums of squares, partial dot products with the `(2 + n) * n` rows of `fn` and
the collapsed chunk (rounded to the streams dtype, as `hc_collapse`) with its sum of squares, into a
small partials buffer; the second (one row per program on a GPU) sums the partials in chunk order
(no atomics: the same inputs give the same bits), scales the dot products by the row's 1 / rms and runs the tail and the final RMSNorm.
float32 results agree with the composition to a few ulps (the dot products are summed in another
order); a rounded streams or `x` element may land one ulp of its dtype away.

Implementations (`impl`): "triton" (the kernels; CUDA tensors, or CPU under `TRITON_INTERPRET=1`),
"torch" (:func:`hc_mix_tail_reference`, :func:`hc_site_reference`) or "auto".
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from cedserve.kernels.triton_support import (
    Impl,
    cdiv,
    check_tensor,
    interpreting,
    next_power_of_2,
    pdl_launch,
    resolve_impl,
)

MAX_HC = 16
"""Largest stream count the kernel takes (a `[BLOCK_S, n, n]` tile lives in registers)."""


def sinkhorn(logits: Tensor, iters: int, eps: float) -> Tensor:
    """Project `logits [..., n, n]` towards the doubly stochastic matrices: a row softmax, then
    `iters` alternating normalisations (columns first, the row/column pairs after)."""
    m = torch.softmax(logits, dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


def hc_collapse(streams: Tensor, pre: Tensor) -> Tensor:
    """Weighted sum of the streams: `[S, hc, D]`, `[S, hc]` -> `[S, D]`."""
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=-2).to(streams.dtype)


def hc_expand(x: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """New streams `out[k] = post[k] * x + sum_j comb[j, k] * residual[j]`, `[S, hc, D]`."""
    mixed = torch.einsum("sjk,sjd->skd", comb.float(), residual.float())
    return (post.unsqueeze(-1) * x.float().unsqueeze(-2) + mixed).to(residual.dtype)


def hc_mix_tail_reference(mixes: Tensor, scale: Tensor, base: Tensor, sinkhorn_iters: int,
                          hc_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """The torch reference of :func:`hc_mix_tail` (any leading dimensions `[..., (2+n)*n]`)."""
    hc = _num_streams(mixes.shape[-1])
    mixes, scale, base = mixes.float(), scale.float(), base.float()
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb_logits = (mixes[..., 2 * hc :] * scale[2] + base[2 * hc :]).view(*mixes.shape[:-1], hc, hc)
    return pre, post, sinkhorn(comb_logits, sinkhorn_iters, hc_eps)


def hc_mix_tail(mixes: Tensor, scale: Tensor, base: Tensor, sinkhorn_iters: int, hc_eps: float,
                impl: Impl = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """`(pre [S, n], post [S, n], comb [S, n, n])` float32 from `mixes [S, (2+n)*n]` float32
    (last dimension contiguous), `scale [3]` and `base [(2+n)*n]` (float32, contiguous)."""
    if resolve_impl(impl, "hc_mix_tail", mixes, scale, base) == "torch":
        return hc_mix_tail_reference(mixes, scale, base, sinkhorn_iters, hc_eps)
    check_tensor(mixes, "hc_mix_tail: mixes", dtypes=(torch.float32,), dim=2)
    check_tensor(scale, "hc_mix_tail: scale", dtypes=(torch.float32,), dim=1)
    check_tensor(base, "hc_mix_tail: base", dtypes=(torch.float32,), dim=1)
    hc = _num_streams(mixes.shape[1])
    if hc & (hc - 1) or hc > MAX_HC:
        raise ValueError(f"hc_mix_tail: the kernel takes a power-of-two hc_mult up to {MAX_HC}, got {hc}")
    if scale.shape[0] != 3 or base.shape[0] != mixes.shape[1]:
        raise ValueError(f"hc_mix_tail: scale must be [3] and base [{mixes.shape[1]}], "
                         f"got {list(scale.shape)} and {list(base.shape)}")
    num_tokens = mixes.shape[0]
    pre = mixes.new_empty(num_tokens, hc)
    post = mixes.new_empty(num_tokens, hc)
    comb = mixes.new_empty(num_tokens, hc, hc)
    if num_tokens == 0:
        return pre, post, comb
    from cedserve.kernels._mhc_kernels import _hc_mix_tail_kernel

    block_s = min(next_power_of_2(num_tokens), max(1, 1024 // (hc * hc)))
    _hc_mix_tail_kernel[(cdiv(num_tokens, block_s),)](
        mixes, mixes.stride(0), scale, base, pre, post, comb,
        num_tokens, sinkhorn_iters, hc_eps,
        N=hc, BLOCK_S=block_s, num_warps=1 if block_s * hc * hc <= 256 else 4, **pdl_launch(mixes.device),
    )
    return pre, post, comb


def _num_streams(width: int) -> int:
    """n from the mixes width (2 + n) * n; `ValueError` when no n fits."""
    hc = math.isqrt(width + 1) - 1  # (2 + n) * n + 1 = (n + 1)^2
    if hc < 1 or (2 + hc) * hc != width:
        raise ValueError(f"hc_mix_tail: mixes width must be (2 + n) * n for some n, got {width}")
    return hc


class HcSite(NamedTuple):
    """What one mHC site leaves (:func:`hc_site`)."""

    streams: Tensor  # [S, n, D] streams dtype: the streams after the expansion (the input without one)
    x: Tensor  # [S, D]: the sublayer's input, in the promoted dtype of the norm weight and the streams
    pre: Tensor  # [S, n] float32: the next site's collapse weights
    post: Tensor  # [S, n] float32
    comb: Tensor  # [S, n(from), n(to)] float32


Expansion = tuple[Tensor, Tensor, Tensor]
"""The previous sublayer's output `[S, D]` with its site's `post [S, n]` and `comb [S, n, n]`:
what :func:`hc_expand` spreads into the streams."""


def _rms_normalize(x: Tensor, eps: float) -> Tensor:
    """`model.norm.rms_normalize` (kernels import nothing from the model): fp32 statistics, the
    result in `x`'s dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def hc_site_reference(streams: Tensor, pre_prev: Tensor, fn: Tensor, scale: Tensor, base: Tensor,
                      norm_weight: Tensor, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                      expand: Expansion | None = None) -> HcSite:
    """The torch reference of :func:`hc_site`: `hc_expand`, the projection of `hc_mixes`, its
    tail and `RMSNorm(hc_collapse(...))`, as the modules compose them."""
    if expand is not None:
        streams = hc_expand(expand[0], streams, expand[1], expand[2])
    mixes = _rms_normalize(streams.flatten(start_dim=-2).float(), norm_eps) @ fn.float().t()
    pre, post, comb = hc_mix_tail_reference(mixes, scale, base, sinkhorn_iters, hc_eps)
    x = norm_weight * _rms_normalize(hc_collapse(streams, pre_prev), norm_eps)
    return HcSite(streams, x, pre, post, comb)


def hc_site(streams: Tensor, pre_prev: Tensor, fn: Tensor, scale: Tensor, base: Tensor, norm_weight: Tensor,
            sinkhorn_iters: int, hc_eps: float, norm_eps: float, expand: Expansion | None = None,
            impl: Impl = "auto") -> HcSite:
    """One mHC site in two launches (module docstring). `streams [S, n, D]` (bf16, fp16 or fp32;
    unit stride in D), `pre_prev [S, n]` float32 contiguous, `fn [(2+n)*n, n*D]` (float; unit
    stride in its columns), `scale [3]`, `base [(2+n)*n]`, `norm_weight [D]` contiguous; `expand`:
    `(out [S, D], post [S, n], comb [S, n, n])`, post and comb float32 contiguous."""
    tensors = [streams, pre_prev, fn, scale, base, norm_weight, *(expand or ())]
    if resolve_impl(impl, "hc_site", *tensors) == "torch":
        return hc_site_reference(streams, pre_prev, fn, scale, base, norm_weight, sinkhorn_iters, hc_eps,
                                 norm_eps, expand)
    rows, hc, dim = _check_site(streams, pre_prev, fn, scale, base, norm_weight, expand)
    width, device = (2 + hc) * hc, streams.device
    out = streams if expand is None else torch.empty(rows, hc, dim, dtype=streams.dtype, device=device)
    x = torch.empty(rows, dim, dtype=torch.promote_types(norm_weight.dtype, streams.dtype), device=device)
    pre = torch.empty(rows, hc, dtype=torch.float32, device=device)
    post = torch.empty(rows, hc, dtype=torch.float32, device=device)
    comb = torch.empty(rows, hc, hc, dtype=torch.float32, device=device)
    if rows == 0:
        return HcSite(out, x, pre, post, comb)
    from cedserve.kernels._mhc_kernels import _hc_site_finish_kernel, _hc_site_streams_kernel

    block_r, block_d = _site_blocks(rows, dim)
    chunks = cdiv(dim, block_d)
    collapsed = torch.empty(rows, dim, dtype=streams.dtype, device=device)  # [S, D]: the collapsed rows
    part = torch.empty(rows, chunks, width + 2, dtype=torch.float32, device=device)  # the partials
    # without an expansion the kernel never reads the sublayer output, post or comb: stand-ins
    src, post_in, comb_in = expand if expand is not None else (streams, pre, comb)
    _hc_site_streams_kernel[(cdiv(rows, block_r), chunks)](
        streams, streams.stride(0), streams.stride(1),
        src, src.stride(0), post_in, comb_in,
        out, pre_prev, fn, fn.stride(0),
        collapsed, part,
        rows, dim, chunks,
        N=hc, M=width, M_PAD=next_power_of_2(width), EXPAND=expand is not None,
        BLOCK_R=block_r, BLOCK_D=block_d, **pdl_launch(streams.device),
    )
    block_s = min(next_power_of_2(rows), 16) if interpreting() else 1  # one row a program on a GPU
    _hc_site_finish_kernel[(cdiv(rows, block_s),)](
        part, scale, base, collapsed, norm_weight,
        pre, post, comb, x,
        rows, dim, chunks, sinkhorn_iters, hc_eps, norm_eps,
        N=hc, M=width, BLOCK_S=block_s, BLOCK_D=min(next_power_of_2(dim), 1024),
        num_warps=1 if block_s * hc * hc <= 256 else 4,  # the tail's reductions within one warp, as hc_mix_tail
        **pdl_launch(part.device),
    )
    return HcSite(out, x, pre, post, comb)


def _site_blocks(rows: int, dim: int) -> tuple[int, int]:
    """`(BLOCK_R, BLOCK_D)` of the streams kernel: one row a program at small batch, four past 8 rows
    (each program reads its `fn` chunk once for the four); columns in at least 8 chunks, 16 to 128
    wide. Measured on an H100 as 40 captured sites (benchmarks/mhc_blocks.py, docs/benchmarks/
    mhc-blocks-h100.json): mini-40's 256 columns at one row ran 2 programs of 128 (12.1 us a site)
    where 8 of 32 take 9.3; the released 4096 at 32 and 192 rows took 35.6 and 119 us in blocks
    of 32 (the old rule kept BLOCK_R x BLOCK_D at 128) against 19.3 and 56.3 in blocks of 128;
    every other cell measured within 1 us of its best. The interpreter pays ~2 ms a program
    whatever its size: there, few large blocks."""
    if interpreting():
        return min(next_power_of_2(rows), 16), min(next_power_of_2(dim), 1024)
    block_r = 1 if rows <= 8 else 4
    block_d = 1 << (max(dim // 8, 1).bit_length() - 1)  # the largest power of two <= dim / 8
    return block_r, min(max(block_d, 16), 128)


def _check_site(streams: Tensor, pre_prev: Tensor, fn: Tensor, scale: Tensor, base: Tensor, norm_weight: Tensor,
                expand: Expansion | None) -> tuple[int, int, int]:
    """`(rows, hc, dim)` of a site's inputs; `TypeError` / `ValueError` naming the bad one."""
    floats = (torch.float32, torch.bfloat16, torch.float16)
    check_tensor(streams, "hc_site: streams", dtypes=floats, dim=3)
    rows, hc, dim = streams.shape
    if hc & (hc - 1) or hc > MAX_HC:
        raise ValueError(f"hc_site: the kernels take a power-of-two hc_mult up to {MAX_HC}, got {hc}")
    width = (2 + hc) * hc
    check_tensor(fn, "hc_site: fn", dtypes=floats, dim=2)
    check_tensor(norm_weight, "hc_site: norm_weight", dtypes=floats, dim=1)
    _check_contiguous(pre_prev, "pre_prev", (rows, hc))
    _check_contiguous(scale, "scale", (3,))
    _check_contiguous(base, "base", (width,))
    if tuple(fn.shape) != (width, hc * dim):
        raise ValueError(f"hc_site: fn must be [{width}, {hc * dim}], got {list(fn.shape)}")
    if norm_weight.shape[0] != dim:
        raise ValueError(f"hc_site: norm_weight must be [{dim}], got {list(norm_weight.shape)}")
    if expand is not None:
        out, post, comb = expand
        check_tensor(out, "hc_site: expanded output", dtypes=floats, dim=2)
        if tuple(out.shape) != (rows, dim):
            raise ValueError(f"hc_site: the expanded output must be [{rows}, {dim}], got {list(out.shape)}")
        _check_contiguous(post, "post", (rows, hc))
        _check_contiguous(comb, "comb", (rows, hc, hc))
    return rows, hc, dim


def _check_contiguous(t: Tensor, what: str, shape: tuple[int, ...]) -> None:
    """A float32 contiguous tensor of `shape`."""
    check_tensor(t, f"hc_site: {what}", dtypes=(torch.float32,), dim=len(shape))
    if tuple(t.shape) != shape or not t.is_contiguous():
        raise ValueError(f"hc_site: {what} must be a contiguous {list(shape)}, got {list(t.shape)} "
                         f"with strides {t.stride()}")
