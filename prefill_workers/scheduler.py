"""Chunked-prefill scheduling by token budget. Pure bookkeeping: no model, no cache, no threads.

Each engine step gets a `StepPlan`: at most `step_token_budget` tokens, at most `chunk_tokens` of them
for any one request, taken in due order over the running requests. A 128K-token prompt therefore
takes one chunk per step and a short prompt that arrives behind it runs in the same step: long
prompts never block short ones, and every running request progresses every step the budget allows.
A chunk ends on a block boundary unless it ends the prompt, so its blocks are final and can ship.

Waiting requests become running in due order while there is room (`max_running_requests`) and the
engine's `admit` callback can give them blocks; a request that cannot get blocks yet stays at the
head of the queue (no overtaking, so a large prompt is not starved by small ones).

A request's due time is its arrival plus a slack that grows with its effort
(`cedserve.model.effort.queue_due_s`): cheaper requests go first, and a request is overtaken only by
those that fall due before it. Equal due times keep arrival order, so equal slack is FIFO.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

RequestId = str


@dataclass
class SchedEntry:
    """One request as the scheduler sees it."""

    request_id: RequestId
    prompt_len: int
    due: float = 0.0
    """When the request falls due (seconds on the engine's clock): the queue's order."""
    order: int = 0
    """Arrival number: breaks ties between equal due times."""
    next_pos: int = 0
    """First prompt token not computed yet (the cached prefix is skipped at admission)."""
    key: tuple[float, int] = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.due, self.order)

    @property
    def remaining(self) -> int:
        return self.prompt_len - self.next_pos


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute prompt tokens `[start, end)` of `request_id` in this step."""

    request_id: RequestId
    start: int
    end: int
    last: bool
    """The chunk ends the prompt: the engine then replays the decoder and closes the transfer."""

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


AdmitFn = Callable[[RequestId], "int | None"]
"""Give a waiting request its blocks: the first position to compute (cached tokens are skipped), or
None when it cannot be admitted yet (no blocks; it stays waiting). A request the callback has
failed must be removed by the caller (`remove`) before returning None."""


class PrefillScheduler:
    """Waiting queue + running set, both by due time; `schedule` plans one step and advances the plan's
    positions."""

    def __init__(self, chunk_tokens: int, step_token_budget: int, block_size: int, max_running: int) -> None:
        if chunk_tokens % block_size or chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens {chunk_tokens} must be a positive multiple of block_size {block_size}")
        self.chunk_tokens = chunk_tokens
        self.step_token_budget = step_token_budget
        self.block_size = block_size
        self.max_running = max_running
        self._waiting: list[SchedEntry] = []
        """Sorted by `SchedEntry.key`."""
        self._running: dict[RequestId, SchedEntry] = {}
        self._arrivals = 0

    # ------------------------------------------------------------------ membership

    def add(self, request_id: RequestId, prompt_len: int, due: float = 0.0) -> None:
        """Queue a request; `due` orders the queue (equal values: arrival order)."""
        if request_id in self:
            raise ValueError(f"request {request_id!r} is already scheduled")
        self._arrivals += 1
        entry = SchedEntry(request_id, prompt_len, due, self._arrivals)
        bisect.insort(self._waiting, entry, key=lambda e: e.key)

    def remove(self, request_id: RequestId) -> bool:
        """Forget a request (finished, failed, cancelled); False if it was not here."""
        if self._running.pop(request_id, None) is not None:
            return True
        for i, entry in enumerate(self._waiting):
            if entry.request_id == request_id:
                del self._waiting[i]
                return True
        return False

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._running or any(e.request_id == request_id for e in self._waiting)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def queued_tokens(self) -> int:
        """Prompt tokens not computed yet, waiting and running (cached ones of waiting requests included)."""
        return sum(e.remaining for e in self._waiting) + sum(e.remaining for e in self._running.values())

    # ------------------------------------------------------------------ planning

    def admit_waiting(self, admit: AdmitFn) -> None:
        """Move waiting requests to running, in order, while there is room and `admit` succeeds."""
        while self._waiting and len(self._running) < self.max_running:
            head = self._waiting[0]
            start = admit(head.request_id)
            if head.request_id not in self:  # the callback failed and removed it
                continue
            if start is None:
                return
            del self._waiting[0]
            head.next_pos = start
            self._running[head.request_id] = head

    def schedule(self) -> list[ScheduledChunk]:
        """This step's chunks; positions advance as if they are computed (a request whose chunk
        fails is removed by the engine)."""
        budget = self.step_token_budget
        plan: list[ScheduledChunk] = []
        for entry in sorted(self._running.values(), key=lambda e: e.key):
            take = self._chunk_size(entry, budget)
            if take <= 0:
                continue
            start = entry.next_pos
            entry.next_pos += take
            plan.append(ScheduledChunk(entry.request_id, start, entry.next_pos, entry.next_pos == entry.prompt_len))
            budget -= take
            if budget == 0:
                break
        return plan

    def _chunk_size(self, entry: SchedEntry, budget: int) -> int:
        take = min(entry.remaining, self.chunk_tokens, budget)
        if take < entry.remaining:
            take -= take % self.block_size
        return take

    def finish(self, request_id: RequestId) -> None:
        """A request computed its last chunk: it no longer takes a running slot."""
        entry = self._running.get(request_id)
        if entry is not None and entry.remaining == 0:
            del self._running[request_id]
