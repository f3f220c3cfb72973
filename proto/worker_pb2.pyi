from cedserve.proto import kv_transfer_pb2 as _kv_transfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ErrorCode]
    ERROR_CODE_RESOURCE_EXHAUSTED: _ClassVar[ErrorCode]
    ERROR_CODE_DEADLINE_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_CODE_CANCELLED: _ClassVar[ErrorCode]
    ERROR_CODE_NOT_FOUND: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_TRANSFER_FAILED: _ClassVar[ErrorCode]
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_INVALID_ARGUMENT: ErrorCode
ERROR_CODE_RESOURCE_EXHAUSTED: ErrorCode
ERROR_CODE_DEADLINE_EXCEEDED: ErrorCode
ERROR_CODE_UNAVAILABLE: ErrorCode
ERROR_CODE_CANCELLED: ErrorCode
ERROR_CODE_NOT_FOUND: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_TRANSFER_FAILED: ErrorCode

class ErrorDetail(_message.Message):
    __slots__ = ("code", "field", "message", "retry_after_ms", "request_id")
    CODE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    field: str
    message: str
    retry_after_ms: int
    request_id: str
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., field: _Optional[str] = ..., message: _Optional[str] = ..., retry_after_ms: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop_token_ids", "stop", "logprobs", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: int
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class DecodeTarget(_message.Message):
    __slots__ = ("worker_id", "agent_name", "control_address", "lease_id", "num_cached_blocks", "reservation", "state_room")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    STATE_ROOM_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    agent_name: str
    control_address: str
    lease_id: str
    num_cached_blocks: int
    reservation: _kv_transfer_pb2.Reservation
    state_room: StateRoom
    def __init__(self, worker_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., control_address: _Optional[str] = ..., lease_id: _Optional[str] = ..., num_cached_blocks: _Optional[int] = ..., reservation: _Optional[_Union[_kv_transfer_pb2.Reservation, _Mapping]] = ..., state_room: _Optional[_Union[StateRoom, _Mapping]] = ...) -> None: ...

class StateRoom(_message.Message):
    __slots__ = ("num_blocks", "format_version", "dspark_taps")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DSPARK_TAPS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    format_version: int
    dspark_taps: bool
    def __init__(self, num_blocks: _Optional[int] = ..., format_version: _Optional[int] = ..., dspark_taps: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "effort", "cache_salt", "target", "deadline_unix_ms", "replay_span", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EFFORT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_SPAN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    effort: int
    cache_salt: str
    target: DecodeTarget
    deadline_unix_ms: int
    replay_span: int
    sampling: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., effort: _Optional[int] = ..., cache_salt: _Optional[str] = ..., target: _Optional[_Union[DecodeTarget, _Mapping]] = ..., deadline_unix_ms: _Optional[int] = ..., replay_span: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "cached_tokens")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    cached_tokens: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "computed_tokens", "bytes_sent", "prefill_s", "transfer_s", "handoff", "transfer_tail_s")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TAIL_S_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    bytes_sent: int
    prefill_s: float
    transfer_s: float
    handoff: PrefillHandoff
    transfer_tail_s: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., handoff: _Optional[_Union[PrefillHandoff, _Mapping]] = ..., transfer_tail_s: _Optional[float] = ...) -> None: ...

class PrefillHandoff(_message.Message):
    __slots__ = ("request_id", "lease_id", "num_tokens", "first_block_index", "num_blocks_sent", "replay_span", "first_token", "first_logprob", "state_bytes", "state_format_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    REPLAY_SPAN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    num_tokens: int
    first_block_index: int
    num_blocks_sent: int
    replay_span: int
    first_token: int
    first_logprob: float
    state_bytes: int
    state_format_version: int
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., first_block_index: _Optional[int] = ..., num_blocks_sent: _Optional[int] = ..., replay_span: _Optional[int] = ..., first_token: _Optional[int] = ..., first_logprob: _Optional[float] = ..., state_bytes: _Optional[int] = ..., state_format_version: _Optional[int] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "done", "error")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    done: PrefillDone
    error: ErrorDetail
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., done: _Optional[_Union[PrefillDone, _Mapping]] = ..., error: _Optional[_Union[ErrorDetail, _Mapping]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "lease_ms", "cache_salt", "sender_agent", "sender_control_address", "token_ids", "ship_state")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SENDER_AGENT_FIELD_NUMBER: _ClassVar[int]
    SENDER_CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SHIP_STATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    lease_ms: int
    cache_salt: str
    sender_agent: str
    sender_control_address: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    ship_state: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., lease_ms: _Optional[int] = ..., cache_salt: _Optional[str] = ..., sender_agent: _Optional[str] = ..., sender_control_address: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., ship_state: _Optional[bool] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("lease_id", "agent_name", "control_address", "block_ids", "num_cached_blocks", "lease_deadline_unix_ms", "reservation", "state_room")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    STATE_ROOM_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    agent_name: str
    control_address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_blocks: int
    lease_deadline_unix_ms: int
    reservation: _kv_transfer_pb2.Reservation
    state_room: StateRoom
    def __init__(self, lease_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., control_address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_blocks: _Optional[int] = ..., lease_deadline_unix_ms: _Optional[int] = ..., reservation: _Optional[_Union[_kv_transfer_pb2.Reservation, _Mapping]] = ..., state_room: _Optional[_Union[StateRoom, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "lease_id", "token_ids", "first_token", "effort", "sampling", "deadline_unix_ms", "replay_span", "prefill_locally")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EFFORT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_SPAN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    effort: int
    sampling: SamplingParams
    deadline_unix_ms: int
    replay_span: int
    prefill_locally: bool
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., effort: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., deadline_unix_ms: _Optional[int] = ..., replay_span: _Optional[int] = ..., prefill_locally: _Optional[bool] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "accepted_drafts", "top_logprobs", "draft_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    accepted_drafts: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenTopLogprobs]
    draft_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., accepted_drafts: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenTopLogprobs, _Mapping]]] = ..., draft_tokens: _Optional[int] = ...) -> None: ...

class TokenTopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class DecodeComplete(_message.Message):
    __slots__ = ("finish_reason", "output_tokens", "draft_tokens", "accepted_drafts")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    output_tokens: int
    draft_tokens: int
    accepted_drafts: int
    def __init__(self, finish_reason: _Optional[str] = ..., output_tokens: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_drafts: _Optional[int] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("tokens", "complete", "error")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenChunk
    complete: DecodeComplete
    error: ErrorDetail
    def __init__(self, tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., complete: _Optional[_Union[DecodeComplete, _Mapping]] = ..., error: _Optional[_Union[ErrorDetail, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id", "lease_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class LeaseRef(_message.Message):
    __slots__ = ("request_id", "lease_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("leases", "lease_ms")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[LeaseRef]
    lease_ms: int
    def __init__(self, leases: _Optional[_Iterable[_Union[LeaseRef, _Mapping]]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class RenewReply(_message.Message):
    __slots__ = ("lost_lease_ids",)
    LOST_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lost_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lost_lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("worker_id", "role", "seq", "queued_tokens", "running_requests", "free_blocks", "total_blocks", "prefill_tokens_per_s", "step_s", "agent_name", "control_address", "held_blocks", "cached_blocks", "queued_requests", "decode_tokens_per_s", "mean_accepted_tokens", "preempted_requests")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    seq: int
    queued_tokens: int
    running_requests: int
    free_blocks: int
    total_blocks: int
    prefill_tokens_per_s: float
    step_s: _containers.RepeatedScalarFieldContainer[float]
    agent_name: str
    control_address: str
    held_blocks: int
    cached_blocks: int
    queued_requests: int
    decode_tokens_per_s: float
    mean_accepted_tokens: float
    preempted_requests: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., seq: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., running_requests: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., step_s: _Optional[_Iterable[float]] = ..., agent_name: _Optional[str] = ..., control_address: _Optional[str] = ..., held_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., queued_requests: _Optional[int] = ..., decode_tokens_per_s: _Optional[float] = ..., mean_accepted_tokens: _Optional[float] = ..., preempted_requests: _Optional[int] = ...) -> None: ...

class KVEventsRequest(_message.Message):
    __slots__ = ("since_seq",)
    SINCE_SEQ_FIELD_NUMBER: _ClassVar[int]
    since_seq: int
    def __init__(self, since_seq: _Optional[int] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("worker_id", "seq", "events_msgpack", "snapshot")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_MSGPACK_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    seq: int
    events_msgpack: bytes
    snapshot: bool
    def __init__(self, worker_id: _Optional[str] = ..., seq: _Optional[int] = ..., events_msgpack: _Optional[bytes] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class ProbeLinkRequest(_message.Message):
    __slots__ = ("decode_address", "num_bytes", "seed", "timeout_ms")
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    decode_address: str
    num_bytes: int
    seed: int
    timeout_ms: int
    def __init__(self, decode_address: _Optional[str] = ..., num_bytes: _Optional[int] = ..., seed: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class ProbeLinkReply(_message.Message):
    __slots__ = ("num_bytes", "num_blocks", "block_bytes", "transfer_s", "gbps", "descriptors", "verified", "sha256", "received_sha256", "wall_s", "prefill_agent", "decode_agent")
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    GBPS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_SHA256_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_AGENT_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    num_blocks: int
    block_bytes: int
    transfer_s: float
    gbps: float
    descriptors: int
    verified: bool
    sha256: str
    received_sha256: str
    wall_s: float
    prefill_agent: str
    decode_agent: str
    def __init__(self, num_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., transfer_s: _Optional[float] = ..., gbps: _Optional[float] = ..., descriptors: _Optional[int] = ..., verified: _Optional[bool] = ..., sha256: _Optional[str] = ..., received_sha256: _Optional[str] = ..., wall_s: _Optional[float] = ..., prefill_agent: _Optional[str] = ..., decode_agent: _Optional[str] = ...) -> None: ...

class CheckProbeRequest(_message.Message):
    __slots__ = ("request_id", "lease_id", "sha256")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    sha256: str
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class CheckProbeReply(_message.Message):
    __slots__ = ("verified", "sha256", "num_bytes", "num_blocks")
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    verified: bool
    sha256: str
    num_bytes: int
    num_blocks: int
    def __init__(self, verified: _Optional[bool] = ..., sha256: _Optional[str] = ..., num_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...
