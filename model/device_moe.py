"""`MoE.forward` without a host synchronisation: what a captured step runs for each MoE layer.

`MoE.forward` counts the rows routed to each expert on the host (one sync per call) and launches
each busy expert once. A captured step cannot read a device value, so `DeviceMoE` stacks a layer's
experts once and runs them at a fixed shape:

* "dense": every routed expert over every row, unrouted pairs weighted by zero (exact, and cheap
  while experts are few and rows many; `FusedOps.dense_moe`);
* "grouped": (row, expert) pairs sorted into fixed tiles by `kernels.moe.moe_experts` (bf16).

The decode step (`cedserve.model.slot_step`) and the DSpark drafter's step
(`cedserve.model.draft_step`) both use it.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from cedserve.kernels.moe import ExpertWeights, moe_experts
from cedserve.model.fused import FusedOps
from cedserve.model.moe import Expert, MoE

MoeMode = Literal["auto", "dense", "grouped"]
DENSE_MAX_EXPERTS = 16
"""`moe = "auto"` runs every expert over every row up to this many routed experts."""


def resolve_moe_mode(mode: MoeMode, num_experts: int, kernels: bool) -> Literal["dense", "grouped"]:
    """"auto": dense up to `DENSE_MAX_EXPERTS` routed experts or without the GPU kernels, else grouped."""
    if mode == "auto":
        return "dense" if num_experts <= DENSE_MAX_EXPERTS or not kernels else "grouped"
    return mode


class DeviceMoE:
    """One MoE layer's experts, stacked for a sync-free call (module docstring)."""

    def __init__(self, ffn: MoE, mode: Literal["dense", "grouped"]) -> None:
        self.ffn, self.mode = ffn, mode
        self.config = ffn.gate.config  # the layer's own expert counts (the drafter's differ)
        experts = [e for e in ffn.experts if isinstance(e, Expert)]
        w1 = torch.stack([e.w1.weight for e in experts])  # [E, I, D]
        w3 = torch.stack([e.w3.weight for e in experts])
        w2 = torch.stack([e.w2.weight for e in experts])  # [E, D, I]
        if mode == "dense":
            self.dense = (w1, w3, w2)
        else:
            w13 = ExpertWeights(torch.cat([w1, w3], dim=1).to(torch.bfloat16).contiguous())
            self.grouped = (w13, ExpertWeights(w2.to(torch.bfloat16).contiguous()))

    def __call__(self, x: Tensor, ops: FusedOps) -> Tensor:
        """`x [N, D]` -> `[N, D]`: routed experts plus the shared one."""
        ffn, c = self.ffn, self.config
        if self.mode == "dense":
            w1, w3, w2 = self.dense
            shared = ffn.shared_experts
            dense: Tensor = ops.dense_moe(x, ffn.gate.weight, ffn.gate.bias, w1, w3, w2, shared.w1.weight,
                                          shared.w3.weight, shared.w2.weight, c.scoring_func, c.gate_temp,
                                          c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor,
                                          c.swiglu_limit)
            return dense
        weights, indices = ffn.gate(x)  # [N, k] float32, long
        w13, w2e = self.grouped
        routed = moe_experts(x.to(torch.bfloat16), indices, weights, w13, w2e, swiglu_limit=c.swiglu_limit).float()
        out: Tensor = (routed + ffn.shared_experts(x).float()).to(x.dtype)
        return out
