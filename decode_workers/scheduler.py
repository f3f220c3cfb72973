"""Continuous batching for one decode rank: who runs, who joins, who is preempted, step by step.

Each step (`schedule`):

1. Growth: every running request may emit up to `lookahead` tokens (drafts + 1), so it needs blocks
   for `len(tokens) + lookahead` tokens. When the pool (free plus evictable cached blocks) cannot
   cover everyone, the latest-due requests are preempted until it can: OFFLOAD copies their blocks
   to host memory, RECOMPUTE drops them (the engine does either before the pass).
2. Joins: preempted requests come back first, then new ones whose KV is in place, each group
   earliest due first, while the batch has room, the pool covers their growth (a returning request
   needs all its blocks again) and the pass stays within `max_pass_tokens` rows (one oversized join
   may run alone).
3. Requests that finish or are cancelled leave through `remove` at any time between steps.

A request falls due at its arrival plus a slack that grows with its effort
(`DecodeSequence.due_s`, `cedserve.model.effort.queue_due_s`): cheap requests go first, and equal
due times keep arrival order, so equal slack is FIFO.

The scheduler only decides; it never touches model state or blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from cedserve.decode_workers.config import DecodeConfig, PreemptionPolicy
from cedserve.decode_workers.sched_output import JoinPlan, Preemption, SchedulerOutput
from cedserve.decode_workers.sequence import DecodeSequence, JoinKind, RequestId, Status


class BlockBudget:
    """What the scheduler needs to know about the pool (the engine passes its cache manager's view)."""

    def __init__(self, available: Callable[[], int], table_len: Callable[[RequestId], int]) -> None:
        self.available = available
        """Blocks a request could get now: free plus evictable cached blocks."""
        self.table_len = table_len
        """Blocks a request holds (0 when it holds none)."""


class DecodeScheduler:
    def __init__(self, config: DecodeConfig, block_size: int, budget: BlockBudget, lookahead: int,
                 offload_fits: Callable[[DecodeSequence], bool]) -> None:
        self.config = config
        self.block_size = block_size
        """Tokens per block of the pool (`KVCacheConfig.block_size`)."""
        self.budget = budget
        self.lookahead = lookahead
        self.offload_fits = offload_fits
        """Whether the host budget can take this request's blocks (else OFFLOAD falls back)."""
        self.running: list[DecodeSequence] = []
        self.waiting: list[DecodeSequence] = []
        self.preempted: list[DecodeSequence] = []
        self._step = 0

    # ------------------------------------------------------------------ membership

    def add(self, seq: DecodeSequence) -> None:
        """A request whose KV is in place (or that prefills here) waits for a batch slot."""
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def remove(self, request_id: RequestId) -> DecodeSequence | None:
        for queue in (self.running, self.waiting, self.preempted):
            for i, seq in enumerate(queue):
                if seq.request_id == request_id:
                    return queue.pop(i)
        return None

    @property
    def num_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.preempted)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        available = self.budget.available()
        need = {s.request_id: self._growth(s) for s in self.running}
        preemptions = []
        while self.running and sum(need.values()) > available:
            victim = self.running.pop()
            available += self.budget.table_len(victim.request_id)  # its blocks come back
            del need[victim.request_id]
            preemptions.append(Preemption(victim.request_id, self._policy(victim)))
            victim.join = victim.preempted_as(preemptions[-1].policy)
            victim.status = Status.PREEMPTED
            self.preempted.append(victim)
        available -= sum(need.values())
        joins, available = self._joins(available, frozenset(p.request_id for p in preemptions))
        self.running.sort(key=lambda s: s.queue_key)
        out = SchedulerOutput(step=self._step, running=tuple(s.request_id for s in self.running),
                              joins=tuple(joins), preemptions=tuple(preemptions), lookahead_tokens=self.lookahead,
                              num_join_rows=sum(j.num_rows for j in joins), num_free_blocks=available)
        self._step += 1
        return out

    def steady(self) -> bool:
        """Whether `schedule` would keep the running batch as it is: nobody could join (no one waits,
        or the batch is full) and every running request's growth fits the pool (no preemption)."""
        if (self.waiting or self.preempted) and len(self.running) < self.config.max_running_requests:
            return False
        return sum(self._growth(s) for s in self.running) <= self.budget.available()

    def _joins(self, available: int, just_preempted: frozenset[RequestId]) -> tuple[list[JoinPlan], int]:
        joins: list[JoinPlan] = []
        rows = 0
        candidates = (sorted(self.preempted, key=lambda s: s.queue_key)
                      + sorted(self.waiting, key=lambda s: s.queue_key))
        for seq in candidates:
            if seq.request_id in just_preempted:
                continue
            if len(self.running) >= self.config.max_running_requests:
                break
            blocks = self._growth(seq)
            join_rows = self.join_rows(seq)
            if blocks > available or (joins and rows + join_rows > self.config.max_pass_tokens):
                break
            available -= blocks
            rows += join_rows
            resumed = seq.status is Status.PREEMPTED
            (self.preempted if resumed else self.waiting).remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            joins.append(JoinPlan(seq.request_id, seq.join, join_rows, resumed))
        return joins, available

    def _growth(self, seq: DecodeSequence) -> int:
        """Blocks `seq` still needs to hold its tokens plus one step's growth."""
        blocks = math.ceil((len(seq.tokens) + self.lookahead) / self.block_size)
        return max(0, blocks - self.budget.table_len(seq.request_id))

    def join_rows(self, seq: DecodeSequence) -> int:
        """Rows `seq`'s join adds to a pass."""
        if seq.join is JoinKind.REPLAY:
            return min(seq.replay_span, seq.num_prompt_tokens)
        if seq.join in (JoinKind.PREFILL, JoinKind.RECOMPUTE):
            return len(seq.tokens)
        return 0

    def _policy(self, seq: DecodeSequence) -> PreemptionPolicy:
        if self.config.preemption is PreemptionPolicy.OFFLOAD and self.offload_fits(seq):
            return PreemptionPolicy.OFFLOAD
        return PreemptionPolicy.RECOMPUTE
