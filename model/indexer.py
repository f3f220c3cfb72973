"""CSA2 sparse indexer: scores queries against the shared index keys and picks top-k entries.

Keys (`k_norm(wk(latent))`, compress-RoPE at the group's first position) exist only at KV-source
layers; every index source (Full or Reindex) scores with its own `wq_b`/`weights_proj`:
`score[s, t] = sum_h relu(q[s,h] . k[t]) / sqrt(d) * w[s,h] / sqrt(H)`, with q and k FP4
(UE8M0 per 32) quantized. An entry is visible to the token at position p once its group ended at
or before p. The candidate-source layer keeps its top blocks of `candidate_block_size` entries;
later index sources pick their top-k inside that pool (two-level top-k).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cedserve.kernels.reference import fake_quant_fp4
from cedserve.model.config import ModelConfig
from cedserve.model.kv_format import straight_through
from cedserve.model.norm import RMSNorm
from cedserve.model.rope import apply_rope

INDEX_QUANT_BLOCK = 32


def visible_entries(positions: Tensor, ratio: int) -> Tensor:
    """Number of compressed entries visible to each query position: `[S]` -> `[S, 1]`."""
    return (positions.long().unsqueeze(-1) + 1) // ratio


def mask_invisible(scores: Tensor, positions: Tensor, ratio: int) -> Tensor:
    """Set entries not yet complete at each query's position to -inf: `[S, T]`."""
    entry = torch.arange(scores.shape[-1], device=scores.device).unsqueeze(0)
    return scores.masked_fill(entry >= visible_entries(positions, ratio), float("-inf"))


def select_candidate_blocks(scores: Tensor, visible: Tensor, topk_blocks: int, block_size: int) -> Tensor:
    """Level one of the two-level top-k: bool `[S, T]` keeping each query's `topk_blocks` best
    blocks (block score = max entry score). The block holding the newest visible entry is always
    kept; blocks with no visible entry never are. `visible [S, 1]` counts visible entries."""
    width = scores.shape[-1]
    padded = F.pad(scores, (0, -width % block_size), value=float("-inf"))
    block_scores = padded.view(*padded.shape[:-1], -1, block_size).amax(dim=-1)  # [(B,) S, n_blocks]
    num_blocks = block_scores.shape[-1]
    newest = (visible - 1).div(block_size, rounding_mode="floor")
    block_ids = torch.arange(num_blocks, device=scores.device).unsqueeze(0)
    block_scores = block_scores.masked_fill(block_ids == newest, float("inf"))
    top = block_scores.topk(min(topk_blocks, num_blocks), dim=-1)
    keep = torch.zeros_like(block_scores, dtype=torch.bool)
    keep.scatter_(-1, top.indices, top.values > float("-inf"))
    return keep.repeat_interleave(block_size, dim=-1)[..., :width]


def select_topk(scores: Tensor, k: int) -> Tensor:
    """bool `[S, T]`: each query's k best entries among those with a finite score."""
    picked = torch.zeros_like(scores, dtype=torch.bool)
    k = min(k, scores.shape[-1])
    if k == 0:
        return picked
    top = scores.topk(k, dim=-1, sorted=False)
    return picked.scatter_(-1, top.indices, top.values > float("-inf"))


class Indexer(nn.Module):
    """Checkpoint names under `attn.indexer.`: `wq_b`, `weights_proj`, and at KV sources `wk`,
    `k_norm`."""

    def __init__(self, config: ModelConfig, owns_keys: bool) -> None:
        super().__init__()
        self.num_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)
        self.wk = nn.Linear(config.head_dim, self.head_dim, bias=False) if owns_keys else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if owns_keys else None

    def keys(self, latent: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Unquantized index keys `[G, index_head_dim]` of pre-RoPE latents `[G, head_dim]`,
        rotated at the groups' first positions (`cos`/`sin` `[G, rope_dim/2]`)."""
        if self.wk is None or self.k_norm is None:
            raise RuntimeError("index keys are produced only by a KV-source layer's indexer")
        keys: Tensor = apply_rope(self.k_norm(self.wk(latent)), cos, sin)
        return keys

    def scores(self, x: Tensor, q_residual: Tensor, cos: Tensor, sin: Tensor, keys: Tensor) -> Tensor:
        """Index scores `[S, T]` (before visibility masking) of queries from `x [S, D]` and
        `q_residual [S, q_lora_rank]` against dequantized `keys [T, index_head_dim]`. Batched:
        `x [B, S, D]`, `q_residual [B, S, q_lora_rank]`, `keys [B, T, d]` -> `[B, S, T]`; the query
        quantizer is straight-through under autograd."""
        return self.score(self.query(q_residual, cos, sin), self.head_weights(x), keys)

    def query(self, q_residual: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Quantized index queries `[..., S, H, d]` of `q_residual [..., S, q_lora_rank]` (row-wise)."""
        q = self.wq_b(q_residual).unflatten(-1, (self.num_heads, self.head_dim))  # [(B,) S, H, d]
        q = apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
        return straight_through(q, lambda v: fake_quant_fp4(v, INDEX_QUANT_BLOCK, "ue8m0"))

    def head_weights(self, x: Tensor) -> Tensor:
        """Per-head score weights `[..., S, H]` (float32) of `x [..., S, D]` (row-wise)."""
        weights: Tensor = self.weights_proj(x).float() * self.num_heads**-0.5
        return weights

    def score(self, q: Tensor, weights: Tensor, keys: Tensor) -> Tensor:
        """Scores `[S, T]` of `query` rows `q [S, H, d]` with `head_weights` `[S, H]` against `keys
        [T, d]`; batched `[B, S, H, d]`, `[B, S, H]`, `[B, T, d]` -> `[B, S, T]`."""
        if keys.dim() == 2:
            per_head = torch.einsum("shd,td->sht", q.float(), keys.float())
        else:
            per_head = torch.einsum("bshd,btd->bsht", q.float(), keys.float())
        per_head = per_head.relu() * self.head_dim**-0.5
        scores: Tensor = (per_head * weights.unsqueeze(-1)).sum(dim=-2)
        return scores
