"""Turn a `cedserve.v1.PrefillRequest` into a checked `PrefillSpec`, or a `ServingError` naming the field.

Everything here runs before the engine sees the request, so a rejected request allocates nothing.
What cannot be checked locally (whether the decode worker really holds the lease) is checked when
the transfer opens: the transfer layer's INVALID cause maps to NOT_FOUND (`cedserve.serving`).

The router decided the request's values (effort, sampling, deadline: `router/requests.py`); this
worker takes them as given. The checks kept are those a direct caller of this port could get wrong
and that would otherwise fail deep in the engine or corrupt another request's blocks: token ids
against the vocabulary and the prompt limit, an effort outside 1-100 and sampling outside its ranges
(`check_level`, `SamplingParams`: one check each, no re-normalising), a deadline already passed,
and a target whose reservation does not fit the prompt, this worker or the state room.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from cedserve.common.errors import DeadlineExceededError, InvalidArgumentError
from cedserve.kv_transfer.protocol import Reservation, TransferMode
from cedserve.kv_transfer.wire import reservation_from_pb
from cedserve.model.config import ModelConfig
from cedserve.model.effort import check_level
from cedserve.model.sampling import SamplingParams
from cedserve.model.state_format import STATE_FORMAT_VERSION, max_state_bytes, taps_supported
from cedserve.proto import worker_pb2 as wpb


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against."""

    vocab_size: int
    max_prompt_tokens: int
    block_size: int
    default_replay_span: int
    sender_agent: str
    """This worker's transfer agent: a reservation must name it as the sender."""
    block_bytes: int = 0
    max_state_bytes: int = 0
    """Largest bounded decode state this worker ships without DSpark taps (`state_format.max_state_bytes`);
    0: it ships none (`prefill.ship_state` off), so a target with a `state_room` is refused."""
    max_state_bytes_with_taps: int = 0
    """The same with the DSpark taps; 0: this model's taps cannot be shipped."""


def state_limits(config: ModelConfig, dtype: torch.dtype, ship_state: bool) -> tuple[int, int]:
    """`(max_state_bytes, max_state_bytes_with_taps)` of `RequestLimits` for a model of `dtype`."""
    if not ship_state:
        return 0, 0
    return max_state_bytes(config), max_state_bytes(config, dtype) if taps_supported(config) else 0


@dataclass(frozen=True)
class StateRoom:
    """Blocks the decode worker reserved, after the KV blocks, for the bounded decode state."""

    num_blocks: int
    dspark_taps: bool


@dataclass(frozen=True)
class TransferTarget:
    """The decode worker's reserved blocks for one request."""

    worker_id: str
    agent_name: str
    control_address: str
    lease_id: str
    num_cached_blocks: int
    """Leading prompt blocks the decode worker already holds: blocks from this index on are sent."""
    reservation: Reservation
    """Its `request_id` is the transfer's id; position i receives prompt block `num_cached_blocks + i`,
    and its last `state_room.num_blocks` positions the shipped bounded state."""
    state_room: StateRoom | None = None
    """Set: ship the bounded decode state (the decode worker will not replay)."""

    @property
    def num_kv_blocks(self) -> int:
        """Reserved positions that receive prompt blocks."""
        return self.reservation.num_blocks - (self.state_room.num_blocks if self.state_room else 0)


@dataclass(frozen=True)
class PrefillSpec:
    """A checked prefill request."""

    request_id: str
    token_ids: np.ndarray  # int64 [prompt_len]
    effort: int
    cache_salt: str
    target: TransferTarget | None
    deadline_unix_s: float | None
    replay_span: int
    sampling: SamplingParams

    @property
    def prompt_len(self) -> int:
        return int(self.token_ids.shape[0])


def validate_prefill(req: wpb.PrefillRequest, limits: RequestLimits, now_unix_s: float | None = None) -> PrefillSpec:
    """The checked spec; `InvalidArgumentError` (field named) or `DeadlineExceededError`."""
    rid = req.request_id
    if not rid:
        raise InvalidArgumentError("request_id is empty", field="request_id")
    tokens = _check_tokens(req, limits)
    try:
        effort = check_level(req.effort)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc), field="effort", request_id=rid) from None
    deadline = req.deadline_unix_ms / 1000.0 if req.deadline_unix_ms else None
    now = time.time() if now_unix_s is None else now_unix_s
    if deadline is not None and deadline <= now:
        raise DeadlineExceededError(f"deadline passed {now - deadline:.3f} s before the request arrived",
                                    field="deadline_unix_ms", request_id=rid)
    target = _check_target(req, limits, len(tokens)) if req.HasField("target") else None
    return PrefillSpec(rid, tokens, effort, req.cache_salt, target, deadline,
                       req.replay_span or limits.default_replay_span, _sampling(req))


def _check_tokens(req: wpb.PrefillRequest, limits: RequestLimits) -> np.ndarray:
    rid = req.request_id
    tokens = np.asarray(req.token_ids, dtype=np.int64)
    if tokens.size == 0:
        raise InvalidArgumentError("empty prompt", field="token_ids", request_id=rid)
    if tokens.size > limits.max_prompt_tokens:
        raise InvalidArgumentError(f"prompt of {tokens.size} tokens exceeds the context limit of "
                                   f"{limits.max_prompt_tokens}", field="token_ids", request_id=rid)
    bad = np.flatnonzero(tokens >= limits.vocab_size)  # uint32 on the wire: never negative
    if bad.size:
        i = int(bad[0])
        raise InvalidArgumentError(f"token id {int(tokens[i])} is out of range [0, {limits.vocab_size})",
                                   field=f"token_ids[{i}]", request_id=rid)
    return tokens


def _sampling(req: wpb.PrefillRequest) -> SamplingParams:
    """The first token's sampling, as the router resolved it (`max_tokens` is the decode side's)."""
    s = req.sampling
    try:
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                              seed=s.seed if s.HasField("seed") else None, max_tokens=1,
                              stop_token_ids=tuple(s.stop_token_ids), logprobs=s.logprobs, ignore_eos=s.ignore_eos)
    except ValueError as exc:  # "field `sampling.x`: ..."
        field = str(exc).split("`")[1] if "`" in str(exc) else "sampling"
        raise InvalidArgumentError(str(exc), field=field, request_id=req.request_id) from None


def _check_target(req: wpb.PrefillRequest, limits: RequestLimits, prompt_len: int) -> TransferTarget:
    t, rid = req.target, req.request_id
    for name in ("lease_id", "agent_name"):
        if not getattr(t, name):
            raise InvalidArgumentError(f"decode target has no {name}", field=f"target.{name}", request_id=rid)
    num_blocks = math.ceil(prompt_len / limits.block_size)
    if t.num_cached_blocks > num_blocks:
        raise InvalidArgumentError(f"num_cached_blocks {t.num_cached_blocks} exceeds the prompt's {num_blocks} "
                                   "blocks", field="target.num_cached_blocks", request_id=rid)
    room = _check_state_room(t, limits, rid) if t.HasField("state_room") else None
    reservation = _check_reservation(t, limits, rid, num_blocks - t.num_cached_blocks, room.num_blocks if room else 0)
    return TransferTarget(t.worker_id, t.agent_name, t.control_address, t.lease_id, t.num_cached_blocks,
                          reservation, room)


def _check_state_room(t: wpb.DecodeTarget, limits: RequestLimits, rid: str) -> StateRoom:
    room, field = t.state_room, "target.state_room"
    if room.format_version != STATE_FORMAT_VERSION:
        raise InvalidArgumentError(f"the decode worker reads state format version {room.format_version}; this "
                                   f"worker writes version {STATE_FORMAT_VERSION}", field=f"{field}.format_version",
                                   request_id=rid)
    need = limits.max_state_bytes_with_taps if room.dspark_taps else limits.max_state_bytes
    if need == 0:
        what = "with DSpark taps (this model taps encoder layers)" if limits.max_state_bytes else \
            "(prefill.ship_state is off)"
        raise InvalidArgumentError(f"this prefill worker does not ship the bounded decode state {what}",
                                   field=f"{field}.dspark_taps" if limits.max_state_bytes else field, request_id=rid)
    if room.num_blocks * limits.block_bytes < need:
        raise InvalidArgumentError(f"{room.num_blocks} blocks of {limits.block_bytes} bytes cannot hold the state "
                                   f"(up to {need} bytes)", field=f"{field}.num_blocks", request_id=rid)
    return StateRoom(room.num_blocks, room.dspark_taps)


def _check_reservation(t: wpb.DecodeTarget, limits: RequestLimits, rid: str, kv_blocks: int,
                       state_blocks: int) -> Reservation:
    """The target's reservation, checked against this worker and the prompt: `kv_blocks` prompt
    blocks (those after `num_cached_blocks`) then `state_blocks` state blocks."""
    field = "target.reservation"
    if not t.HasField("reservation"):
        raise InvalidArgumentError("decode target carries no reservation (ReserveReply.reservation)",
                                   field=field, request_id=rid)
    try:
        r = reservation_from_pb(t.reservation)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc), field=field, request_id=rid) from None
    checks = (
        (r.request_id == t.lease_id, "request_id", f"names transfer {r.request_id!r}, not lease {t.lease_id!r}"),
        (r.receiver == t.agent_name, "receiver_agent", f"is {r.receiver!r}, the target is {t.agent_name!r}"),
        (r.sender == limits.sender_agent, "sender_agent",
         f"reserves for sender {r.sender!r}, this worker is {limits.sender_agent!r}"),
        (r.num_blocks == kv_blocks + state_blocks, "block_ids",
         f"hold {r.num_blocks} blocks; the prompt's uncached blocks and the state room need {kv_blocks} + "
         f"{state_blocks}"),
        (r.mode is TransferMode.WRITE, "mode", f"is {r.mode.value}; prefill workers WRITE"),
    )
    for ok, name, message in checks:
        if not ok:
            raise InvalidArgumentError(f"reservation {name} {message}", field=f"{field}.{name}", request_id=rid)
    return r
