"""RMS normalisation as the reference computes it (statistics in float32, weight applied last)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """`x / rms(x)` over the last dimension, computed in float32 and returned in `x`'s dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learned per-channel weight (checkpoint name `<module>.weight`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * rms_normalize(x, self.eps)
