"""Expert parallelism: attention data-parallel per rank, routed experts sharded across ranks.

Every rank of a decode group runs attention for its own requests. At each MoE layer the ranks
exchange tokens: each (token, routed slot) pair goes to the rank owning that expert (`dispatch`),
the owner runs its experts over everything it received, and the outputs travel back (`combine`).
The shared expert runs where the token lives. Rank r owns experts `[r * E/R, (r+1) * E/R)`.

`ExpertParallel` is the contract; `SingleRank` (no communication) and `TorchDistributedEP`
(`torch.distributed.all_to_all_single`: NCCL on GPUs, gloo on CPU) implement it. A faster
backend (DeepEP-style kernels, `nixl_ep`) replaces the class, not the engine. `ep_moe` runs one
MoE layer through any implementation and is bit-compatible with `MoE.forward`: rows reach each
expert grouped by source rank, then in token order, and each token sums its routed outputs in
ascending expert order, as the single-process loop does. With one rank it is bit-equal to
`MoE.forward`; across ranks it equals one rank over the same rows in rank order up to the float
rounding of the router's matmul over fewer rows.

Collectives: every rank calls `dispatch`/`combine` (and `agree`) the same number of times in the
same order. The engine guarantees it by agreeing each step which passes run (the eager pass where any
rank has rows for it, the model runner's step on the group's largest row count) and running them on
every rank, empty or padded where a rank has less.

The model runner's step cannot read counts back (it is captured in CUDA graphs): it exchanges through
`FixedCapacityEP` (`cedserve.model.expert_exchange`, re-exported here), which `runner_exchange` builds
over a process group of its own. `fixed_capacity_moe` runs the same exchange over the eager `MoE`
modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cedserve.model.expert_exchange import FixedCapacityEP, Slotted, experts_of, slot_positions
from cedserve.model.moe import MoE, expert_segments, run_segments, sum_ascending

__all__ = ["AbsentExpert", "Dispatched", "ExpertParallel", "FixedCapacityEP", "SingleRank", "Slotted",
           "TorchDistributedEP", "ep_moe", "experts_of", "fixed_capacity_moe", "shard_experts", "slot_positions"]


@dataclass(frozen=True)
class Dispatched:
    """What one rank received in `dispatch`, and what `combine` needs to send results back."""

    x: Tensor  # [M, hidden] rows for this rank's experts: by source rank, then (expert, token)
    expert_ids: Tensor  # int64 [M] global expert id of each row (all owned by this rank)
    weights: Tensor  # float32 [M, 1] routing weight of each row
    order: Tensor  # int64 [N * k] flat (token * k + slot) index of each sent row, in send order
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank
    num_tokens: int  # N: tokens of this rank
    top_k: int


class ExpertParallel(Protocol):
    """Dispatch and combine of routed-expert work across the ranks of a decode group."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def dispatch(self, x: Tensor, indices: Tensor, weights: Tensor) -> Dispatched:
        """Send each (token, slot) of `x [N, hidden]`, routed to `indices [N, k]` with `weights [N, k]`,
        to the rank owning the expert. Collective; N may be 0. Mutates nothing."""
        ...

    def combine(self, y: Tensor, dispatched: Dispatched) -> Tensor:
        """Return expert outputs `y [M, hidden]` (rows of `dispatched.x`) to their source ranks:
        `[N, k, hidden]` float32 in the caller's (token, slot) order. Collective."""
        ...

    def agree(self, value: int) -> int:
        """The largest `value` any rank passed (collective): lets ranks decide together to step."""
        ...

    def runner_exchange(self, max_tokens: int, top_k: int, hidden: int, dtype: torch.dtype,
                        device: torch.device) -> FixedCapacityEP | None:
        """The model runner's exchange over the same ranks: fixed capacity for `max_tokens` rows per
        rank (its largest bucket), on a communicator of its own, so that the collectives its graphs
        capture never share one with the eager pass's (`cedserve.model.expert_exchange`). None with
        one rank. Collective (every rank calls it once, in the same order as its other groups)."""
        ...


def _send_order(indices: Tensor, world_size: int, num_experts: int) -> tuple[Tensor, Tensor]:
    """Flat (token * k + slot) indices sorted by (expert, token), and rows per destination rank
    (int64 `[world_size]`, on the device: nothing is read back here)."""
    flat_expert = indices.reshape(-1)
    # flat index token * k + slot is already token-major: a stable sort by expert keeps token order
    order = torch.argsort(flat_expert, stable=True)
    owner = flat_expert // (num_experts // world_size)
    counts = torch.zeros(world_size, dtype=torch.long, device=indices.device)
    counts.index_add_(0, owner, torch.ones_like(owner))
    return order, counts


class SingleRank:
    """One rank owns every expert: dispatch and combine are local permutations."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def dispatch(self, x: Tensor, indices: Tensor, weights: Tensor) -> Dispatched:
        order = torch.argsort(indices.reshape(-1), stable=True)  # by (expert, token); no read-back
        k = indices.shape[1]
        counts = [indices.numel()]
        return Dispatched(x[order // k], indices.reshape(-1)[order], weights.reshape(-1, 1)[order].float(),
                          order, counts, counts, int(x.shape[0]), k)

    def combine(self, y: Tensor, dispatched: Dispatched) -> Tensor:
        out = torch.zeros(dispatched.num_tokens * dispatched.top_k, y.shape[-1], dtype=torch.float32, device=y.device)
        out[dispatched.order] = y.float()
        return out.view(dispatched.num_tokens, dispatched.top_k, y.shape[-1])

    def agree(self, value: int) -> int:
        return value

    def runner_exchange(self, max_tokens: int, top_k: int, hidden: int, dtype: torch.dtype,
                        device: torch.device) -> FixedCapacityEP | None:
        return None


class TorchDistributedEP:
    """`all_to_all_single` over a torch.distributed process group (NCCL with CUDA tensors, gloo on CPU).

    `group` must hold exactly the decode group's ranks; `control` (a CPU/gloo group, default
    `group`) carries `agree`. Rows travel in the model's dtype, routing metadata as float32.
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None,
                 control: dist.ProcessGroup | None = None) -> None:
        self._group = group
        self._control = control if control is not None else group
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)
        experts_of(self._rank, self._world, num_experts)  # checks the split
        self.num_experts = num_experts

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def _exchange(self, rows: Tensor, send: list[int], recv: list[int]) -> Tensor:
        out = rows.new_empty((sum(recv), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=self._group)
        return out

    def dispatch(self, x: Tensor, indices: Tensor, weights: Tensor) -> Dispatched:
        order, send_t = _send_order(indices, self._world, self.num_experts)
        recv_t = torch.empty_like(send_t)
        dist.all_to_all_single(recv_t, send_t, group=self._group)
        counts = torch.cat([send_t, recv_t]).tolist()  # the one read-back: both split lists at once
        send, recv = counts[: self._world], counts[self._world :]
        k = indices.shape[1]
        meta = torch.stack([indices.reshape(-1)[order].float(), weights.reshape(-1)[order].float()], dim=1)
        rows = self._exchange(x[order // k], send, recv)
        got = self._exchange(meta, send, recv)
        return Dispatched(rows, got[:, 0].long(), got[:, 1:], order, send, recv, int(x.shape[0]), k)

    def combine(self, y: Tensor, dispatched: Dispatched) -> Tensor:
        back = self._exchange(y.float(), dispatched.recv_counts, dispatched.send_counts)
        out = torch.zeros(dispatched.num_tokens * dispatched.top_k, y.shape[-1], dtype=torch.float32, device=y.device)
        out[dispatched.order] = back
        return out.view(dispatched.num_tokens, dispatched.top_k, y.shape[-1])

    def agree(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._control)
        return int(t.item())

    def runner_exchange(self, max_tokens: int, top_k: int, hidden: int, dtype: torch.dtype,
                        device: torch.device) -> FixedCapacityEP | None:
        ranks = dist.get_process_group_ranks(self._group) if self._group is not None else None
        group = dist.new_group(ranks)  # the data group's backend: NCCL on GPUs, gloo on CPU
        return FixedCapacityEP(self.num_experts, max_tokens, top_k, hidden, dtype=dtype, device=device, group=group)


def ep_moe(ep: ExpertParallel, ffn: MoE, x: Tensor) -> Tensor:
    """One MoE layer over this rank's tokens `x [N, hidden]` through `ep` -> `[N, hidden]`."""
    weights, indices = ffn.gate(x)
    sent = ep.dispatch(x, indices, weights)
    # received rows grouped by expert, keeping (source rank, token) order within one: one host sync
    order, counts = expert_segments(sent.expert_ids, len(ffn.experts))
    y = torch.empty(sent.x.shape[0], x.shape[-1], dtype=torch.float32, device=x.device)
    y[order] = run_segments(ffn.experts, sent.x[order], sent.weights[order], counts)
    out = sum_ascending(ep.combine(y, sent), indices)  # combine: [N, k, hidden]
    out += ffn.shared_experts(x).float()
    return out.to(x.dtype)


def fixed_capacity_moe(ep: FixedCapacityEP, ffn: MoE, x: Tensor) -> Tensor:
    """`ep_moe` with fixed shapes: one MoE layer over this rank's tokens `x [N, hidden]` -> `[N, hidden]`.
    Each local expert runs over every received row, rows routed elsewhere weighted 0 (SwiGLU of a
    zero-weighted row contributes exactly 0 after the down projection)."""
    weights, indices = ffn.gate(x)
    sent = ep.dispatch(x, indices, weights)
    y = torch.zeros(sent.x.shape[0], x.shape[-1], dtype=torch.float32, device=x.device)
    for expert_id in ep.local_experts:
        mine = torch.where(sent.expert_ids == expert_id, sent.weights[:, 0], 0.0).unsqueeze(1)
        y += ffn.experts[expert_id](sent.x, mine).float()
    out = sum_ascending(ep.combine(y, sent), indices)
    out += ffn.shared_experts(x).float()
    return out.to(x.dtype)


class AbsentExpert(nn.Module):
    """Stands in for an expert another rank owns; calling it is a routing bug."""

    def __init__(self, expert_id: int) -> None:
        super().__init__()
        self.expert_id = expert_id

    def forward(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        raise RuntimeError(f"expert {self.expert_id} is owned by another rank: dispatch sent a token here")


def shard_experts(model: nn.Module, rank: int, world_size: int) -> int:
    """Drop the routed experts this rank does not own from every backbone MoE; returns how many.
    (DSpark's draft layers keep theirs: the drafter is small and runs whole on every rank.)"""
    dropped = 0
    for name, module in model.named_modules():
        if isinstance(module, MoE) and not name.startswith("dspark"):
            owned = experts_of(rank, world_size, len(module.experts))
            for expert_id in range(len(module.experts)):
                if expert_id not in owned:
                    module.experts[expert_id] = AbsentExpert(expert_id)
                    dropped += 1
    return dropped
