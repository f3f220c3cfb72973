"""CSA2 compressor: pools `m = compress_ratio` consecutive tokens into one KV latent.

For m > 1 each token contributes a projected latent and a per-channel gate; a group's latent is
the softmax(gate)-weighted sum over its m tokens (float32), then RMSNorm. For m = 1 every token
is its own group (a plain projection + RMSNorm, no gate). The output is *pre-RoPE*: the indexer
derives its keys from it before the main KV is rotated and quantized.

Tokens of a group that is not complete yet wait in a `PendingGroup` (part of the sequence state),
so chunked prefill and decode emit exactly the groups a one-shot prefill would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cedserve.model.config import ModelConfig
from cedserve.model.norm import RMSNorm


@dataclass
class PendingGroup:
    """Projected tokens of the incomplete group (fewer than m), float32."""

    kv: Tensor  # [n, head_dim]
    gate: Tensor  # [n, head_dim]

    @staticmethod
    def empty(head_dim: int, device: torch.device | None = None) -> PendingGroup:
        return PendingGroup(torch.zeros(0, head_dim, device=device), torch.zeros(0, head_dim, device=device))


class Compressor(nn.Module):
    """Checkpoint names: `compressor.wkv`, `compressor.wgate` (m > 1 only), `compressor.norm`."""

    def __init__(self, config: ModelConfig, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.wkv = nn.Linear(config.hidden_size, config.head_dim, bias=False)
        self.wgate = nn.Linear(config.hidden_size, config.head_dim, bias=False) if ratio > 1 else None
        self.norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def project(self, x: Tensor) -> PendingGroup:
        """Per-token float32 projections `[S, head_dim]` (latent and gate) of `x [S, D]`; m > 1."""
        if self.wgate is None:
            raise RuntimeError("a ratio-1 compressor has no pending groups")
        kv = F.linear(x.float(), self.wkv.weight.float())
        return PendingGroup(kv, F.linear(x.float(), self.wgate.weight.float()))

    def forward(self, x: Tensor, pending: PendingGroup) -> tuple[Tensor, PendingGroup]:
        """Latents of the groups completed by `x [S, D]` after `pending`: `[G, head_dim]` (G may be
        0), and the new pending group."""
        if self.wgate is None:
            latent: Tensor = self.norm(self.wkv(x))
            return latent, pending
        projected = self.project(x)
        kv, gate = torch.cat([pending.kv, projected.kv]), torch.cat([pending.gate, projected.gate])
        usable = (kv.shape[0] // self.ratio) * self.ratio
        rest = PendingGroup(kv[usable:], gate[usable:])
        return self.pool(kv[:usable], gate[:usable], x.dtype), rest

    def forward_full(self, x: Tensor) -> Tensor:
        """Latents `[..., G, head_dim]` of the complete groups of whole sequences `x [..., S, D]`
        that start at position 0 (`forward` with an empty pending group, batched)."""
        if self.wgate is None:
            latent: Tensor = self.norm(self.wkv(x))
            return latent
        projected = self.project(x)
        usable = (x.shape[-2] // self.ratio) * self.ratio
        return self.pool(projected.kv[..., :usable, :], projected.gate[..., :usable, :], x.dtype)

    def pool(self, kv: Tensor, gate: Tensor, dtype: torch.dtype) -> Tensor:
        """Gated pooling of whole groups: float32 `[..., G * m, head_dim]` -> normed `[..., G, head_dim]`."""
        normed: Tensor = self.norm(pool_groups(kv, gate, self.ratio).to(dtype))
        return normed


def pool_groups(kv: Tensor, gate: Tensor, ratio: int) -> Tensor:
    """The softmax(gate)-weighted sum of each group of `ratio` rows: float32 `[..., G * m, head_dim]`
    -> `[..., G, head_dim]` (before the norm)."""
    groups_kv = kv.view(*kv.shape[:-2], -1, ratio, kv.shape[-1])  # [..., G, m, head_dim]
    groups_gate = gate.view(*gate.shape[:-2], -1, ratio, gate.shape[-1])
    return (groups_kv * groups_gate.softmax(dim=-2)).sum(dim=-2)
