"""What flows into and out of a decode engine: commands from the gRPC service, outputs to its streams.

In a decode group the leader's service receives every call; commands are broadcast to all ranks at
the start of a step and outputs are gathered back at its end, so every message here is a tagged
msgspec struct (msgpack on the wire between ranks, never pickle). A command names the rank that
owns its request; the others ignore it.
"""

from __future__ import annotations

import msgspec

from cedserve.common.errors import ErrorKind
from cedserve.model.sampling import SamplingParams

RequestId = str


class Sampling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`SamplingParams` on the wire, as the router resolved it (checked where `params` builds them)."""

    temperature: float = 0.0
    top_p: float = 1.0
    """In (0, 1]; 1: off."""
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 1
    """The output budget the router decided (>= 1)."""
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int = 0
    ignore_eos: bool = False

    def params(self, max_tokens: int) -> SamplingParams:
        """The sampling parameters, with at most `max_tokens` output tokens (`ValueError` names a
        field out of its range)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, max_tokens=max_tokens, stop_token_ids=self.stop_token_ids,
                              logprobs=self.logprobs, ignore_eos=self.ignore_eos)


# ------------------------------------------------------------------ commands


class ReserveCommand(msgspec.Struct, frozen=True, tag="reserve"):
    """Lease blocks for a prompt whose KV a prefill worker will WRITE (or that this rank prefills)."""

    rank: int
    request_id: RequestId
    lease_id: str
    prompt_tokens: int
    token_ids: tuple[int, ...]
    """The prompt when the router sent it (prefix reuse and caching); empty: neither."""
    lease_ms: int
    cache_salt: str = ""
    sender_agent: str = ""
    """The prefill worker's NIXL agent; empty: no transfer (decode-only placement)."""
    sender_control_address: str = ""
    ship_state: bool | None = None
    """Hold room for the prefill side's bounded decode state; None: the rank's `decode.ship_state`."""


class AttachCommand(msgspec.Struct, frozen=True, tag="attach"):
    """A Decode call for a lease: decode once the KV is in place."""

    rank: int
    request_id: RequestId
    lease_id: str
    token_ids: tuple[int, ...]
    """The whole prompt."""
    first_token: int | None
    """Sampled by the prefill side; None when this rank prefills (`prefill_locally`)."""
    effort: int
    """1-100 (checked by the service)."""
    sampling: Sampling
    deadline_unix_ms: int = 0
    replay_span: int = 0


class CancelCommand(msgspec.Struct, frozen=True, tag="cancel"):
    """Cancel a request or a lease: every block and transfer of it is released."""

    rank: int
    request_id: RequestId
    """`*`: every request and lease of the rank (a drain handing work back)."""
    lease_id: str = ""
    reason: str = "cancelled"
    hand_back: bool = False
    """Fail with UNAVAILABLE (retry elsewhere) instead of finishing as cancelled."""


class ProbeCheckCommand(msgspec.Struct, frozen=True, tag="probe_check"):
    """The link probe: hash a probe lease's received blocks once its transfer ended, compare with
    `sha256`, and free the lease (`CheckProbe`)."""

    rank: int
    request_id: RequestId
    lease_id: str
    sha256: str
    """What the blocks should hash to (the sender's digest)."""


class RenewCommand(msgspec.Struct, frozen=True, tag="renew"):
    """The router still waits on these leases (`Renew`): each unattached one gets a fresh deadline."""

    rank: int
    lease_ids: tuple[str, ...]
    lease_ms: int


Command = ReserveCommand | AttachCommand | CancelCommand | ProbeCheckCommand | RenewCommand


# ------------------------------------------------------------------ outputs


class Reserved(msgspec.Struct, frozen=True, tag="reserved"):
    """Answer to a `ReserveCommand`."""

    request_id: RequestId
    lease_id: str
    agent_name: str
    control_address: str
    block_ids: tuple[int, ...]
    num_cached_blocks: int
    lease_deadline_unix_ms: int
    reservation: bytes = b""
    """The kv_transfer `Reservation` (serialized protobuf) for the sender; empty without a transfer."""
    state_blocks: int = 0
    """The reservation's last blocks, room for the shipped bounded state (0: the rank will replay)."""
    state_taps: bool = False
    """The state should carry DSpark taps (this rank drafts)."""


class Tokens(msgspec.Struct, frozen=True, tag="tokens"):
    """Tokens accepted in one step, in order."""

    request_id: RequestId
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] = ()
    """Log-probability of each token under the target's unprocessed distribution (when asked)."""
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    """Per token, the `logprobs` most likely (token, log-probability) pairs."""
    accepted_drafts: int = 0
    draft_tokens: int = 0
    """DSpark drafts verified in the step that made these tokens (the usage's `draft_tokens` adds
    them up even when the router stops reading before `Finished`)."""


class Finished(msgspec.Struct, frozen=True, tag="finished"):
    request_id: RequestId
    finish_reason: str
    """"stop", "length" or "cancelled"."""
    output_tokens: int
    draft_tokens: int
    accepted_drafts: int


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    """The request (or the command) failed, of a domain `ErrorKind` (the service maps it to the wire)."""

    request_id: RequestId
    kind: ErrorKind
    message: str
    field: str = ""
    retry_after_ms: int = 0
    lease_id: str = ""


class ProbeChecked(msgspec.Struct, frozen=True, tag="probe_checked"):
    """Answer to a `ProbeCheckCommand`; the lease is freed."""

    request_id: RequestId
    lease_id: str
    sha256: str
    """Digest of the received blocks, in reservation order."""
    verified: bool
    num_blocks: int
    num_bytes: int


Output = Reserved | Tokens | Finished | Failed | ProbeChecked


# ------------------------------------------------------------------ one tick of a group


class RankLoad(msgspec.Struct, frozen=True):
    """One rank's load after a tick (the leader aggregates them into `LoadReport`)."""

    rank: int
    running: int = 0
    waiting: int = 0
    """Attached requests waiting for KV or a batch slot, plus unattached leases."""
    preempted: int = 0
    in_flight: int = 0
    """Requests and leases held (drain waits for 0 on every rank)."""
    free_blocks: int = 0
    total_blocks: int = 0
    held_blocks: int = 0
    cached_blocks: int = 0
    queued_tokens: int = 0
    """Rows the waiting requests' joins will compute (replay spans, local prefills)."""
    tokens_emitted: int = 0
    busy_s: float = 0.0
    draft_tokens: int = 0
    accepted_drafts: int = 0
    verify_passes: int = 0
    step_s: tuple[float, ...] = ()
    agent_name: str = ""
    control_address: str = ""


class TickCommands(msgspec.Struct, frozen=True):
    """What the leader broadcasts at the start of a tick."""

    commands: list[Command]
    draining: bool = False
    stop: bool = False


class TickReport(msgspec.Struct, frozen=True):
    """What each rank sends back at the end of a tick."""

    outputs: list[Output]
    load: RankLoad


_encoder = msgspec.msgpack.Encoder()
_tick_commands = msgspec.msgpack.Decoder(TickCommands)
_tick_report = msgspec.msgpack.Decoder(TickReport)


def encode(message: TickCommands | TickReport) -> bytes:
    return _encoder.encode(message)


def decode_tick_commands(data: bytes) -> TickCommands:
    """`msgspec.ValidationError` (a `ValueError`) names a malformed field."""
    return _tick_commands.decode(data)


def decode_tick_report(data: bytes) -> TickReport:
    return _tick_report.decode(data)
