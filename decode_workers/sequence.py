"""One request on a decode rank: its tokens, its model state, its lease, and where it stands.

Token bookkeeping. `tokens` is the prompt followed by every output token so far (the prefill side's
first token included). The target state has consumed `tokens[:state.position]`; the rest, `pending`,
is what the next pass must feed: the anchor (the last token, never consumed yet) and, after a pass
that rejected some drafts, the tokens accepted in it, which the next pass consumes in front of the
new anchor (so a rejection never costs a pass of its own; see `engine`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from cedserve.decode_workers.config import PreemptionPolicy
from cedserve.model.dspark import DraftState
from cedserve.model.sampling import SamplingParams
from cedserve.model.state import SequenceState
from cedserve.model.state_format import BoundedState

RequestId = str


class Status(str, Enum):
    LEASED = "leased"
    """Blocks reserved; waiting for the KV transfer and the Decode call."""
    WAITING = "waiting"
    """KV in place and Decode attached (or preempted and ready to come back): waits for a batch slot."""
    RUNNING = "running"
    PREEMPTED = "preempted"
    """Gave its blocks back under memory pressure (offloaded or to be recomputed)."""
    FINISHED = "finished"


class JoinKind(str, Enum):
    """How a sequence's state is built when it (re)joins the batch."""

    REPLAY = "replay"
    """Global KV from the received blocks, bounded state by replaying the last tokens."""
    PREFILL = "prefill"
    """Prefill the prompt here (decode-only placement), sampling the first token."""
    RECOMPUTE = "recompute"
    """Preempted by recompute: prefill everything but the anchor again."""
    ONLOAD = "onload"
    """Preempted by offload: copy blocks and bounded state back; no model pass."""
    SHIPPED = "shipped"
    """The prefill side shipped the bounded state (`DecodeSequence.shipped`, installed over the
    received global KV at the join), or an in-process caller handed over a ready state
    (`DecodeEngine.attach_state`)."""


@dataclass
class Offloaded:
    """Host copy of a preempted request (OFFLOAD)."""

    rows: torch.Tensor  # uint8 [blocks, block_bytes]: the request's blocks, in table order (host)
    state: SequenceState  # bounded state only: global KV records emptied (they are in `rows`)
    draft: DraftState | None

    @property
    def nbytes(self) -> int:
        return int(self.rows.numel())


@dataclass
class Lease:
    """Blocks reserved for a request before its Decode call."""

    lease_id: str
    request_id: RequestId
    block_ids: list[int]
    num_cached_blocks: int
    deadline_s: float
    """Monotonic time after which an unattached lease is freed."""
    cacheable: bool
    """The lease was admitted with the real prompt (prefix reuse; its blocks may be cached)."""
    num_prompt_tokens: int
    transfer_open: bool = False
    """A kv_transfer reservation is registered and has not finished (its blocks are not ours yet)."""
    transfer_done: bool = False
    transfer_error: str = ""
    cancelled: bool = False
    state_block_ids: list[int] = field(default_factory=list)
    """Room for the shipped bounded state: the reservation's last blocks (freed once read)."""
    state_taps: bool = False
    """The shipped state must carry DSpark taps."""


@dataclass
class DecodeSequence:
    """A request that has a Decode call (see the module docstring)."""

    request_id: RequestId
    lease: Lease
    tokens: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    join: JoinKind
    replay_span: int
    arrival: int
    """Admission order: breaks ties between equal due times."""
    due_s: float = 0.0
    """When the request falls due on the engine's clock: its Decode call's arrival plus its effort's
    queue slack (`cedserve.model.effort.queue_due_s`). Joins take the earliest due first, preemption
    the latest."""
    effort: int = 0
    """1-100 (the router decided it; the service checked the range)."""
    attached_s: float = -1.0
    """When its Decode call was taken (the engine's clock); -1 once its KV wait was counted."""
    ready_s: float = -1.0
    """When its KV was in place and it began waiting for a batch slot (-1: not yet; reset at the join)."""
    status: Status = Status.LEASED
    max_drafts: int = 0
    """Most drafts verified per pass (the effort's `DecodeConfig.draft_limit`)."""
    state: SequenceState | None = None
    shipped: BoundedState | None = None
    """The prefill side's bounded state, checked and waiting for the join to install it."""
    draft: DraftState | None = None
    offloaded: Offloaded | None = None
    stored_entries: dict[int, int] = field(default_factory=dict)
    """Global-KV entries per source layer already written into the blocks."""
    num_emitted: int = 0
    """Output tokens this worker produced (the prefill side's first token excluded)."""
    draft_tokens: int = 0
    accepted_drafts: int = 0
    finish_reason: str = ""
    deadline_s: float = float("inf")

    @property
    def queue_key(self) -> tuple[float, int]:
        """The scheduler's order: earliest due first, then arrival."""
        return self.due_s, self.arrival

    @property
    def pending(self) -> list[int]:
        """Tokens the next pass feeds (the anchor last)."""
        position = 0 if self.state is None else self.state.position
        return self.tokens[position:]

    @property
    def anchor(self) -> int:
        return self.tokens[-1]

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    def needs_pass_to_join(self) -> bool:
        return self.join in (JoinKind.REPLAY, JoinKind.PREFILL, JoinKind.RECOMPUTE)

    def preempted_as(self, policy: PreemptionPolicy) -> JoinKind:
        return JoinKind.ONLOAD if policy is PreemptionPolicy.OFFLOAD else JoinKind.RECOMPUTE
