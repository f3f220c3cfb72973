"""Manifold-constrained hyper-connections (mHC), single-pass form.

The residual is `hc_mult` parallel streams `[S, hc, D]`. At each site (before attention, before
the FFN) one projection of the RMS-normalised, flattened streams yields three coefficient sets:
`pre [S, hc]` (how to collapse the streams into a sublayer input), `post [S, hc]` (how to spread
the sublayer output back) and `comb [S, hc, hc]` (a doubly stochastic mix of the residual
streams, via Sinkhorn). In the single-pass form a site's `pre` is consumed by the *next* site:
attention collapses with the previous site's `pre`, the FFN with attention's.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from cedserve.kernels.mhc import hc_collapse as hc_collapse
from cedserve.kernels.mhc import hc_expand as hc_expand
from cedserve.kernels.mhc import hc_mix_tail
from cedserve.kernels.mhc import sinkhorn as sinkhorn
from cedserve.kernels.triton_support import Impl
from cedserve.model.norm import rms_normalize


@dataclass(frozen=True)
class HcMix:
    """Coefficients of one mHC site for S tokens (all float32)."""

    pre: Tensor  # [S, hc]
    post: Tensor  # [S, hc]
    comb: Tensor  # [S, hc(from), hc(to)]


def hc_mixes(
    streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor, sinkhorn_iters: int, hc_eps: float, norm_eps: float
) -> HcMix:
    """Coefficients for `streams [S, hc, D]` from one site's `fn [(2+hc)*hc, hc*D]`,
    `scale [3]` and `base [(2+hc)*hc]`. Normalisation is over the whole flattened hc*D row.

    The sigmoids and the Sinkhorn projection (`cedserve.kernels.mhc`) run as one Triton launch on
    CUDA tensors (no fallback: a missing triton raises) and as the torch reference elsewhere."""
    flat = rms_normalize(streams.flatten(start_dim=-2).float(), norm_eps)
    mixes = flat @ fn.float().t()  # [S, (2+hc)*hc]
    impl: Impl = "triton" if streams.is_cuda else "torch"
    pre, post, comb = hc_mix_tail(mixes.reshape(-1, mixes.shape[-1]), scale.float().contiguous(),
                                  base.float().contiguous(), sinkhorn_iters, hc_eps, impl=impl)
    lead = mixes.shape[:-1]
    return HcMix(pre=pre.view(*lead, -1), post=post.view(*lead, -1), comb=comb.view(*lead, *comb.shape[-2:]))
