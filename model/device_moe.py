"""`MoE.forward` without a host synchronisation: what a captured step runs for each MoE layer.

`MoE.forward` counts the rows routed to each expert on the host (one sync per call) and launches
each busy expert once. A captured step cannot read a device value, so `DeviceMoE` stacks a layer's
experts once and runs them at a fixed shape:

* "dense": every routed expert over every row, unrouted pairs weighted by zero (exact, and cheap
  while experts are few and rows many; `FusedOps.dense_moe`);
* "grouped": (row, expert) pairs sorted into fixed tiles by `kernels.moe.moe_experts` (bf16, the
  shared expert among them: each expert's output rounded to bf16, summed in float32).

Either way the shared expert is one more stacked expert that every row routes to with weight 1.

With expert parallelism (`exchange`, `cedserve.model.expert_exchange`) a layer holds only its rank's
routed experts: the rows route over all E, their pairs travel to the owners through the
fixed-capacity all-to-all, the owner runs its experts over every received row at a fixed shape
(empty rows weighted 0) stacked with the shared expert over its own rows, and the outputs travel
back. Still no host read and no data-dependent shape.

The decode step (`cedserve.model.slot_step`) and the DSpark drafter's step
(`cedserve.model.draft_step`) both use it.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from cedserve.kernels.moe import ExpertWeights, moe_experts
from cedserve.model.expert_exchange import FixedCapacityEP
from cedserve.model.fused import FusedOps
from cedserve.model.moe import Expert, MoE
from cedserve.model.weight_views import stack_experts

MoeMode = Literal["auto", "dense", "grouped"]
DENSE_MAX_EXPERTS = 16
"""`moe = "auto"` runs every expert over every row up to this many routed experts."""


def resolve_moe_mode(mode: MoeMode, num_experts: int, kernels: bool) -> Literal["dense", "grouped"]:
    """"auto": dense up to `DENSE_MAX_EXPERTS` routed experts or without the GPU kernels, else grouped."""
    if mode == "auto":
        return "dense" if num_experts <= DENSE_MAX_EXPERTS or not kernels else "grouped"
    return mode


class DeviceMoE:
    """One MoE layer's experts, stacked for a sync-free call (module docstring). The shared expert is
    stacked last, as expert `E` of every row with weight 1 (exact: its activation times 1.0), so the
    routed and shared experts run in the same GEMMs. The stacked tensors hold the weights and the
    experts' modules view them (`cedserve.model.weight_views`): no second copy."""

    def __init__(self, ffn: MoE, mode: Literal["dense", "grouped"], exchange: FixedCapacityEP | None = None) -> None:
        self.ffn, self.mode, self.exchange = ffn, mode, exchange
        self.config = ffn.gate.config  # the layer's own expert counts (the drafter's differ)
        owned = range(len(ffn.experts)) if exchange is None else exchange.local_experts
        if [i for i, e in enumerate(ffn.experts) if isinstance(e, Expert)] != list(owned):
            raise ValueError(f"DeviceMoE: the layer must hold exactly experts {owned.start}..{owned.stop - 1} "
                             f"(rank {exchange.rank if exchange else 0}'s): shard the model to match its exchange")
        experts = [e for e in ffn.experts if isinstance(e, Expert)] + [ffn.shared_experts]  # `owned`, in order
        # [E + 1, 2I, D], [E + 1, D, I]: the experts' own weights become views of these (no second copy)
        w13, w2 = stack_experts([(e.w1.weight, e.w3.weight) for e in experts], [e.w2.weight for e in experts])
        self.gate = ffn.gate.weight.detach().float()  # [E, D]: the router runs in float32
        self.bias = ffn.gate.bias.detach().float()
        if mode == "dense":
            self.dense = (w13, w2)
        else:
            self.grouped = (ExpertWeights(w13.to(torch.bfloat16).contiguous()),
                            ExpertWeights(w2.to(torch.bfloat16).contiguous()))

    def __call__(self, x: Tensor, ops: FusedOps) -> Tensor:
        """`x [N, D]` -> `[N, D]`: routed experts plus the shared one. With an exchange every rank of
        the group calls it with the same N (collective)."""
        c = self.config
        rules = (c.scoring_func, c.gate_temp, c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor)
        if self.exchange is not None:
            return self._expert_parallel(x, ops, self.exchange, rules)
        if self.mode == "dense":
            w13_dense, w2_dense = self.dense
            dense: Tensor = ops.dense_moe(x, self.gate, self.bias, w13_dense, w2_dense, *rules, c.swiglu_limit)
            return dense
        weights, indices = ops.route_with_shared(x, self.gate, self.bias, *rules)  # [N, k + 1] float32, long
        w13, w2 = self.grouped
        out: Tensor = moe_experts(x.to(torch.bfloat16), indices, weights, w13, w2, swiglu_limit=c.swiglu_limit)
        return out.to(x.dtype)

    def _expert_parallel(self, x: Tensor, ops: FusedOps, exchange: FixedCapacityEP,
                         rules: tuple[str, float, int, bool, float]) -> Tensor:
        """The layer across the group: route over every expert, send each pair to its owner, run
        this rank's experts over everything received (`R x N x k` rows, empty ones weighted 0) and
        the shared expert over this rank's `N` rows in the same stacked call, return the received
        rows' outputs, and sum each token's in float32."""
        weights, indices = ops.route_topk(x, self.gate, self.bias, *rules)  # float32 [N, k], long [N, k]
        got = exchange.dispatch(x, indices, weights, rows=x.shape[0])
        received, shared = got.x.shape[0], len(exchange.local_experts)  # the shared expert is stacked last
        local = got.expert_ids - exchange.local_experts.start  # [R C]: < 0 on an empty row
        rows = torch.cat([got.x, x])  # [R C + N, D]: received rows, then this rank's own
        if self.mode == "dense":
            w13_dense, w2_dense = self.dense
            ids = torch.arange(shared + 1, device=x.device)
            routing = torch.cat([(local.unsqueeze(1) == ids) * got.weights,  # [R C, E_r + 1]; empty rows: none
                                 (ids == shared).float().expand(x.shape[0], -1)])  # own rows: shared, weight 1
            y: Tensor = ops.dense_experts(rows, routing, w13_dense, w2_dense, self.config.swiglu_limit)
        else:
            mine = got.expert_ids >= 0
            ids = torch.cat([torch.where(mine, local, shared), torch.full_like(indices[:, 0], shared)]).unsqueeze(1)
            route = torch.cat([torch.where(mine, got.weights[:, 0], 0.0), weights.new_ones(x.shape[0])]).unsqueeze(1)
            w13, w2 = self.grouped
            y = moe_experts(rows.to(torch.bfloat16), ids, route, w13, w2, swiglu_limit=self.config.swiglu_limit)
        back = exchange.combine(y[:received], got)  # [N, k, D]: each pair's expert output, in y's dtype
        out = back.float().sum(dim=1) + y[received:].float()
        return out.to(x.dtype)
