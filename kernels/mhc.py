"""The tail of one mHC site (`cedserve.model.mhc.hc_mixes`) in one launch: sigmoids and Sinkhorn.

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

Implementations (`impl`): "triton" (the kernel; CUDA tensors, or CPU under `TRITON_INTERPRET=1`),
"torch" (:func:`hc_mix_tail_reference`) or "auto".
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from cedserve.kernels.triton_support import Impl, cdiv, check_tensor, next_power_of_2, resolve_impl

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
        N=hc, BLOCK_S=block_s, num_warps=1 if block_s * hc * hc <= 256 else 4,
    )
    return pre, post, comb


def _num_streams(width: int) -> int:
    """n from the mixes width (2 + n) * n; `ValueError` when no n fits."""
    hc = math.isqrt(width + 1) - 1  # (2 + n) * n + 1 = (n + 1)^2
    if hc < 1 or (2 + hc) * hc != width:
        raise ValueError(f"hc_mix_tail: mixes width must be (2 + n) * n for some n, got {width}")
    return hc
