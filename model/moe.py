"""Mixture of experts: `noaux_tc` routing (the bias steers selection only), SwiGLU experts with
clamped pre-activations, one shared expert every token passes through."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cedserve.model.config import ModelConfig


def score_logits(logits: Tensor, scoring_func: str) -> Tensor:
    """Router activation applied to float32 logits `[N, E]`."""
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    if scoring_func == "softmax":
        return logits.softmax(dim=-1)
    raise ValueError(f"scoring_func: unsupported {scoring_func!r}")


def route(x: Tensor, weight: Tensor, bias: Tensor, config: ModelConfig) -> tuple[Tensor, Tensor]:
    """Pick `num_experts_per_tok` experts for `x [N, D]`: returns float32 weights `[N, k]`
    (unbiased scores, renormalised, times `routed_scaling_factor`) and indices `[N, k]`."""
    scores = score_logits(F.linear(x.float(), weight.float()) / config.gate_temp, config.scoring_func)
    indices = (scores + bias.float()).topk(config.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, indices)
    if config.norm_topk_prob and config.num_experts_per_tok > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * config.routed_scaling_factor, indices


class Router(nn.Module):
    """Checkpoint names: `gate.weight [E, D]`, `gate.bias [E]`, `gate.bias_vl [E]` (image spans;
    unused for text)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # defined values before a checkpoint lands (never uninitialised memory: a model built and run
        # without one, as tests and the random demo do, must not read garbage or NaN)
        self.weight = nn.Parameter(torch.randn(config.n_routed_experts, config.hidden_size) * config.initializer_range)
        self.bias = nn.Parameter(torch.zeros(config.n_routed_experts))
        self.bias_vl = nn.Parameter(torch.zeros(config.n_routed_experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return route(x, self.weight, self.bias, self.config)


class Expert(nn.Module):
    """SwiGLU expert: `w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))`, gate/up in float32."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inter, hidden = config.moe_intermediate_size, config.hidden_size
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.limit = config.swiglu_limit

    def forward(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        gate, up = self.w1(x).float(), self.w3(x).float()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        y = F.silu(gate) * up
        if weight is not None:
            y = weight * y  # [N, 1] routing weight, applied before the down projection
        down: Tensor = self.w2(y.to(x.dtype))
        return down


def expert_segments(expert_ids: Tensor, num_experts: int) -> tuple[Tensor, list[int]]:
    """Rows grouped by expert: a stable order of `expert_ids [M]` (rows of one expert keep their
    order) and the rows per expert. One host sync (the counts), whatever the number of experts."""
    order = torch.argsort(expert_ids, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=expert_ids.device)
    counts.index_add_(0, expert_ids, torch.ones_like(expert_ids))
    return order, counts.tolist()


def run_segments(experts: nn.ModuleList, x: Tensor, weights: Tensor, counts: list[int]) -> Tensor:
    """Expert outputs for rows grouped by expert (`x [M, D]`, routing `weights [M, 1]`, `counts[e]`
    rows of expert e in turn, as from `expert_segments`): float32 `[M, D]`. Each expert runs once
    over its rows, in their order; experts with no rows are not called."""
    outs, start = [], 0
    for expert_id, count in enumerate(counts):
        if count:
            outs.append(experts[expert_id](x[start:start + count], weights[start:start + count]).float())
            start += count
    if not outs:
        return x.new_zeros(x.shape, dtype=torch.float32)
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def sum_ascending(per_slot: Tensor, indices: Tensor) -> Tensor:
    """Sum each token's routed outputs `per_slot [N, k, D]` (slot order of `indices [N, k]`) in
    ascending expert order, from zero: float32 `[N, D]`, the order a loop over experts adds them."""
    ascending = indices.argsort(dim=1, stable=True)
    per_slot = per_slot.gather(1, ascending[..., None].expand_as(per_slot))
    out = per_slot.new_zeros(per_slot.shape[0], per_slot.shape[2])
    for slot in range(per_slot.shape[1]):
        out += per_slot[:, slot]
    return out


class MoE(nn.Module):
    """Routed experts plus the shared expert. The (token, slot) pairs are sorted by expert and each
    expert with tokens runs once over its contiguous rows; one host sync per call (rows per expert)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = nn.ModuleList([Expert(config) for _ in range(config.n_routed_experts)])
        self.shared_experts = Expert(config)

    def forward(self, x: Tensor) -> Tensor:
        """`x [N, D]` -> `[N, D]` (any leading dimensions: `[..., D]`)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, indices = self.gate(x)  # [N, k]
        n, k = indices.shape
        order, counts = expert_segments(indices.reshape(-1), len(self.experts))  # over flat token * k + slot
        y = run_segments(self.experts, x[order // k], weights.reshape(-1, 1)[order], counts)
        per_slot = torch.empty(n * k, shape[-1], dtype=torch.float32, device=x.device)
        per_slot[order] = y
        out = sum_ascending(per_slot.view(n, k, shape[-1]), indices)
        out += self.shared_experts(x).float()
        return out.to(x.dtype).view(shape)
