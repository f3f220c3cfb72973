"""The per-step message from the decode scheduler to the engine that runs the step.

One `SchedulerOutput` per step says who is in the batch, who joins it (and how its state is built),
who leaves it under memory pressure, and the room reserved for each request's growth. The engine
then drafts, chooses verification lengths, runs one target pass over everything and applies the
verdicts; those per-request numbers are decided after drafting, so they are not part of this message.
"""

from __future__ import annotations

from dataclasses import dataclass

from cedserve.decode_workers.config import PreemptionPolicy
from cedserve.decode_workers.sequence import JoinKind, RequestId


@dataclass(frozen=True)
class JoinPlan:
    """One request entering the batch this step."""

    request_id: RequestId
    # How its state is built: REPLAY / PREFILL / RECOMPUTE run rows in this step's pass before the
    # request's own decode rows; ONLOAD copies host data back; SHIPPED has its state already.
    kind: JoinKind
    # Rows this join adds to the pass (replay span, prompt or recompute tokens; 0 for ONLOAD/SHIPPED).
    num_rows: int
    # True when the request was preempted before (it comes back, rather than arriving).
    resumed: bool


@dataclass(frozen=True)
class Preemption:
    """One running request leaving the batch to free blocks."""

    request_id: RequestId
    # OFFLOAD (its blocks go to host memory) or RECOMPUTE (dropped; rebuilt on return). OFFLOAD falls
    # back to RECOMPUTE when the host budget is spent.
    policy: PreemptionPolicy


@dataclass(frozen=True)
class SchedulerOutput:
    """What one decode step runs (see the module docstring)."""

    # Step number on this rank, from 0.
    step: int
    # Requests in the batch after this step's joins and preemptions, in admission order; each
    # decodes (drafts, verifies, emits at least one token) in this step's pass, joiners included
    # (a PREFILL joiner only samples its first token this step).
    running: tuple[RequestId, ...]
    # Requests joining this step (a subset of `running`), in admission order.
    joins: tuple[JoinPlan, ...]
    # Requests leaving this step, latest admitted first; they are not in `running`.
    preemptions: tuple[Preemption, ...]
    # Tokens of growth reserved for every running request: the most one step can emit
    # (drafts + 1). The blocks for them were free when this was scheduled.
    lookahead_tokens: int
    # Rows the pass will compute for joins (sum of `joins[i].num_rows`).
    num_join_rows: int
    # Blocks left free (plus evictable) after reserving everyone's growth.
    num_free_blocks: int

    @property
    def is_empty(self) -> bool:
        return not self.running and not self.preemptions
