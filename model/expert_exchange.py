"""The fixed-capacity expert-parallel exchange: an all-to-all whose shapes never depend on the routing.

Rank r of R owns routed experts `[r E/R, (r+1) E/R)`. At an MoE layer each rank holds N tokens
routed to k experts each: N x k (token, slot) pairs. A counted exchange (`decode_workers.
expert_parallel.TorchDistributedEP`) sends each peer exactly its pairs, so its split sizes are read
back to the host every layer, which a CUDA graph cannot hold. Here every rank sends every peer exactly
`capacity = rows x k` rows, the worst case (all of a rank's pairs to one peer), so nothing is ever
dropped and every split is `capacity`:

    send   [R x C, hidden]   peer p's block is rows [p C, (p+1) C): this rank's pairs for p's experts
                             in (token, slot) order, then rows nobody reads
    meta   [R x C, 2] f32    each row's (global expert id, routing weight); (-1, 0) on an empty row
    recv   [R x C, hidden]   source s's pairs in block s; `meta` tells which rows are real

The received rows' (expert, weight) travel beside them, so no count is ever exchanged or read: the
per-row metadata is the fixed-size descriptor (an expert id of -1 marks an empty row). The owner
runs its experts over all `R x C` received rows at a fixed shape (an empty row is weighted 0 and its
output is never gathered), and `combine` sends every row back on the same fixed splits; the source
gathers its pairs' rows (`dest`, from `slot_positions`). Every rank must call `dispatch` and
`combine` the same number of times with the same `rows` (the group's agreed bucket).

Buffers are allocated once for `max_tokens` and sliced per call (a view's leading rows are
contiguous): `send` (also the combine's receive buffer: the dispatch is done with it by then),
`recv`, and the two metadata buffers. Bytes: `R x max_tokens x k x (2 x hidden x itemsize + 16)`
(`fixed_capacity_bytes`). No host reads and no data-dependent shapes, so a captured decode step
(`cedserve.model.slot_step`) holds the collectives (NCCL `all_to_all_single` with equal splits);
with gloo on a CPU the same code runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


def experts_of(rank: int, world_size: int, num_experts: int) -> range:
    """The routed experts rank `rank` owns."""
    if num_experts % world_size:
        raise ValueError(
            f"config field `decode.group_size`: {world_size} ranks do not split "
            f"{num_experts} routed experts evenly"
        )
    per_rank = num_experts // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def fixed_capacity_bytes(world_size: int, max_tokens: int, top_k: int, hidden: int, itemsize: int) -> int:
    """Bytes of `FixedCapacityEP`'s buffers: rows in and out in the model's dtype, (expert, weight)
    float32 pairs in and out, for `world_size x max_tokens x top_k` rows."""
    return world_size * max_tokens * top_k * (2 * hidden * itemsize + 2 * 2 * 4)


def slot_positions(owner: Tensor, world_size: int, capacity: int) -> Tensor:
    """Each pair's row in a `[world_size x capacity]` send buffer: `owner [P]` (the destination rank
    of each pair, in send order) -> `owner * capacity + (pairs before it with the same owner)`; on
    the device, no read-back. Capacity must hold every pair of one owner (the caller's worst case)."""
    onehot = (owner.unsqueeze(1) == torch.arange(world_size, device=owner.device)).long()  # [P, R]
    place = (onehot.cumsum(0) - 1).gather(1, owner.unsqueeze(1)).squeeze(1)
    return owner * capacity + place


@dataclass(frozen=True)
class Slotted:
    """What `FixedCapacityEP.dispatch` received, in fixed-shape buffers, and what `combine` needs.
    `x`, `expert_ids` and `weights` view the exchange's buffers: valid until its next `dispatch`."""

    x: Tensor  # [R * C, hidden]: C rows from each source rank, rank-major; rows past a sender's pairs unread
    expert_ids: Tensor  # int64 [R * C]: each row's global expert, -1 on an empty row
    weights: Tensor  # float32 [R * C, 1]: each row's routing weight, 0 on an empty row
    dest: Tensor  # int64 [N * k]: where each of this rank's (token, slot) pairs went (rank * C + place)
    num_tokens: int
    top_k: int


class FixedCapacityEP:
    """Dispatch and combine with fixed-size, preallocated buffers (module docstring).

    `max_tokens`: the most tokens one rank passes to `dispatch` (the runner's largest bucket);
    `hidden`, `dtype`, `device`: the rows'. `group` holds exactly the decode group's ranks; give the
    runner's step a group of its own (a captured collective should not share its communicator with
    eager ones). Mutates only its own buffers.
    """

    def __init__(
        self,
        num_experts: int,
        max_tokens: int,
        top_k: int,
        hidden: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if max_tokens < 1 or top_k < 1:
            raise ValueError(
                f"fixed-capacity EP: max_tokens and top_k must be >= 1, got {max_tokens}, {top_k}"
            )
        self._group = group
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)
        self.local_experts = experts_of(self._rank, self._world, num_experts)
        self.num_experts, self.max_tokens, self.top_k, self.hidden = num_experts, max_tokens, top_k, hidden
        self.capacity = max_tokens * top_k
        rows = self._world * self.capacity
        self._send = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self._recv = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self._meta = torch.zeros(rows, 2, dtype=torch.float32, device=device)
        self._recv_meta = torch.zeros(rows, 2, dtype=torch.float32, device=device)
        self._empty_row = torch.tensor([-1.0, 0.0], device=device)  # (expert, weight) of an empty row

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def buffer_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self._send, self._recv, self._meta, self._recv_meta)
        )

    def dispatch(self, x: Tensor, indices: Tensor, weights: Tensor, rows: int | None = None) -> Slotted:
        """`x [N, hidden]` routed to global experts `indices [N, k]` with `weights [N, k]` -> the rows
        this rank's experts received. `rows`: the capacity basis, the same on every rank (the runner's
        bucket; default `max_tokens`), with N <= rows. A caller may pad its batch with any rows: their
        pairs travel and come back like the others (the capacity counts them). Collective."""
        n, k = indices.shape
        rows = self.max_tokens if rows is None else rows
        if not n <= rows <= self.max_tokens or k != self.top_k:
            raise ValueError(
                f"fixed-capacity EP: built for {self.max_tokens} tokens x top-{self.top_k}, "
                f"got {n} x {k} (capacity basis {rows})"
            )
        if x.shape[-1] != self.hidden or x.dtype != self._send.dtype:
            raise ValueError(
                f"fixed-capacity EP: rows must be [N, {self.hidden}] {self._send.dtype}, "
                f"got {list(x.shape)} {x.dtype}"
            )
        capacity = rows * k
        total = self._world * capacity
        send, meta = self._send[:total], self._meta[:total]
        owner = indices.reshape(-1) // (self.num_experts // self._world)
        dest = slot_positions(owner, self._world, capacity)
        send[dest] = (
            x.unsqueeze(1).expand(n, k, self.hidden).reshape(n * k, self.hidden)
        )  # repeat_interleave syncs
        meta.copy_(self._empty_row)  # broadcast: one kernel
        meta[dest] = torch.stack([indices.reshape(-1).float(), weights.reshape(-1).float()], dim=1)
        recv, recv_meta = self._recv[:total], self._recv_meta[:total]
        dist.all_to_all_single(recv, send, group=self._group)  # equal splits: `capacity` rows per peer
        dist.all_to_all_single(recv_meta, meta, group=self._group)
        return Slotted(recv, recv_meta[:, 0].long(), recv_meta[:, 1:], dest, n, k)

    def combine(self, y: Tensor, sent: Slotted) -> Tensor:
        """Expert outputs `y [R * C, hidden]` (rows of `sent.x`) back to their source ranks:
        `[N, k, hidden]` in `y`'s dtype, the caller's (token, slot) order. Collective."""
        if tuple(y.shape) != (sent.x.shape[0], self.hidden):
            raise ValueError(
                f"fixed-capacity EP: combine takes [{sent.x.shape[0]}, {self.hidden}], got {list(y.shape)}"
            )
        # the dispatch's send buffer receives (it was sent already); another dtype needs its own
        back = self._send[: y.shape[0]] if y.dtype == self._send.dtype else torch.empty_like(y)
        dist.all_to_all_single(back, y.contiguous(), group=self._group)
        return back[sent.dest].view(sent.num_tokens, sent.top_k, self.hidden)
