from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_DRAM: _ClassVar[MemoryKind]
    MEMORY_KIND_VRAM: _ClassVar[MemoryKind]

class TransferMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_MODE_UNSPECIFIED: _ClassVar[TransferMode]
    TRANSFER_MODE_WRITE: _ClassVar[TransferMode]
    TRANSFER_MODE_READ: _ClassVar[TransferMode]

class FailureCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_CAUSE_UNSPECIFIED: _ClassVar[FailureCause]
    FAILURE_CAUSE_CANCELLED: _ClassVar[FailureCause]
    FAILURE_CAUSE_DEADLINE: _ClassVar[FailureCause]
    FAILURE_CAUSE_PEER_DISCONNECTED: _ClassVar[FailureCause]
    FAILURE_CAUSE_PEER_SILENT: _ClassVar[FailureCause]
    FAILURE_CAUSE_TRANSFER_ERROR: _ClassVar[FailureCause]
    FAILURE_CAUSE_PEER_ABORTED: _ClassVar[FailureCause]
    FAILURE_CAUSE_INVALID: _ClassVar[FailureCause]
    FAILURE_CAUSE_SHUTDOWN: _ClassVar[FailureCause]
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_DRAM: MemoryKind
MEMORY_KIND_VRAM: MemoryKind
TRANSFER_MODE_UNSPECIFIED: TransferMode
TRANSFER_MODE_WRITE: TransferMode
TRANSFER_MODE_READ: TransferMode
FAILURE_CAUSE_UNSPECIFIED: FailureCause
FAILURE_CAUSE_CANCELLED: FailureCause
FAILURE_CAUSE_DEADLINE: FailureCause
FAILURE_CAUSE_PEER_DISCONNECTED: FailureCause
FAILURE_CAUSE_PEER_SILENT: FailureCause
FAILURE_CAUSE_TRANSFER_ERROR: FailureCause
FAILURE_CAUSE_PEER_ABORTED: FailureCause
FAILURE_CAUSE_INVALID: FailureCause
FAILURE_CAUSE_SHUTDOWN: FailureCause

class MemoryRegion(_message.Message):
    __slots__ = ("base_address", "length_bytes", "device_id", "kind")
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    base_address: int
    length_bytes: int
    device_id: int
    kind: MemoryKind
    def __init__(self, base_address: _Optional[int] = ..., length_bytes: _Optional[int] = ..., device_id: _Optional[int] = ..., kind: _Optional[_Union[MemoryKind, str]] = ...) -> None: ...

class Compatibility(_message.Message):
    __slots__ = ("protocol_version", "compat_hash", "description")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    compat_hash: str
    description: str
    def __init__(self, protocol_version: _Optional[int] = ..., compat_hash: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class AgentInfo(_message.Message):
    __slots__ = ("agent_name", "nixl_metadata", "compat", "kv_region", "block_bytes", "num_blocks", "staging_region", "staging_slot_bytes", "num_staging_slots", "control_address", "doorbell_port", "incarnation")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    KV_REGION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STAGING_REGION_FIELD_NUMBER: _ClassVar[int]
    STAGING_SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGING_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_PORT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    nixl_metadata: bytes
    compat: Compatibility
    kv_region: MemoryRegion
    block_bytes: int
    num_blocks: int
    staging_region: MemoryRegion
    staging_slot_bytes: int
    num_staging_slots: int
    control_address: str
    doorbell_port: int
    incarnation: int
    def __init__(self, agent_name: _Optional[str] = ..., nixl_metadata: _Optional[bytes] = ..., compat: _Optional[_Union[Compatibility, _Mapping]] = ..., kv_region: _Optional[_Union[MemoryRegion, _Mapping]] = ..., block_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., staging_region: _Optional[_Union[MemoryRegion, _Mapping]] = ..., staging_slot_bytes: _Optional[int] = ..., num_staging_slots: _Optional[int] = ..., control_address: _Optional[str] = ..., doorbell_port: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("initiator", "link", "lost_link")
    INITIATOR_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    LOST_LINK_FIELD_NUMBER: _ClassVar[int]
    initiator: AgentInfo
    link: int
    lost_link: int
    def __init__(self, initiator: _Optional[_Union[AgentInfo, _Mapping]] = ..., link: _Optional[int] = ..., lost_link: _Optional[int] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("responder",)
    RESPONDER_FIELD_NUMBER: _ClassVar[int]
    responder: AgentInfo
    def __init__(self, responder: _Optional[_Union[AgentInfo, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("agent_name", "seq")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    seq: int
    def __init__(self, agent_name: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("agent_name", "seq", "active_transfers")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    seq: int
    active_transfers: int
    def __init__(self, agent_name: _Optional[str] = ..., seq: _Optional[int] = ..., active_transfers: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "cause", "detail", "agent_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    cause: FailureCause
    detail: str
    agent_name: str
    def __init__(self, request_id: _Optional[str] = ..., cause: _Optional[_Union[FailureCause, str]] = ..., detail: _Optional[str] = ..., agent_name: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("request_id", "sender_agent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_AGENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sender_agent: str
    def __init__(self, request_id: _Optional[str] = ..., sender_agent: _Optional[str] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ("found", "detail")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    found: bool
    detail: str
    def __init__(self, found: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("request_id", "receiver_agent", "sender_agent", "block_ids", "mode", "staging_slots", "lease_s", "compat_hash")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_AGENT_FIELD_NUMBER: _ClassVar[int]
    SENDER_AGENT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STAGING_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    receiver_agent: str
    sender_agent: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    mode: TransferMode
    staging_slots: _containers.RepeatedScalarFieldContainer[int]
    lease_s: float
    compat_hash: str
    def __init__(self, request_id: _Optional[str] = ..., receiver_agent: _Optional[str] = ..., sender_agent: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., mode: _Optional[_Union[TransferMode, str]] = ..., staging_slots: _Optional[_Iterable[int]] = ..., lease_s: _Optional[float] = ..., compat_hash: _Optional[str] = ...) -> None: ...

class ChunkDone(_message.Message):
    __slots__ = ("seq", "first_index", "num_blocks", "staging_slot", "last", "total_chunks", "staging_offset")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STAGING_SLOT_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    STAGING_OFFSET_FIELD_NUMBER: _ClassVar[int]
    seq: int
    first_index: int
    num_blocks: int
    staging_slot: int
    last: bool
    total_chunks: int
    staging_offset: int
    def __init__(self, seq: _Optional[int] = ..., first_index: _Optional[int] = ..., num_blocks: _Optional[int] = ..., staging_slot: _Optional[int] = ..., last: _Optional[bool] = ..., total_chunks: _Optional[int] = ..., staging_offset: _Optional[int] = ...) -> None: ...

class SlotFree(_message.Message):
    __slots__ = ("staging_slot",)
    STAGING_SLOT_FIELD_NUMBER: _ClassVar[int]
    staging_slot: int
    def __init__(self, staging_slot: _Optional[int] = ...) -> None: ...

class ChunkReady(_message.Message):
    __slots__ = ("seq", "first_index", "num_blocks", "block_ids", "staging_slot", "last", "total_chunks")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    STAGING_SLOT_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    first_index: int
    num_blocks: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    staging_slot: int
    last: bool
    total_chunks: int
    def __init__(self, seq: _Optional[int] = ..., first_index: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., staging_slot: _Optional[int] = ..., last: _Optional[bool] = ..., total_chunks: _Optional[int] = ...) -> None: ...

class ChunkConsumed(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("cause", "detail")
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    cause: FailureCause
    detail: str
    def __init__(self, cause: _Optional[_Union[FailureCause, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class AbortAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class Probe(_message.Message):
    __slots__ = ("probe_id",)
    PROBE_ID_FIELD_NUMBER: _ClassVar[int]
    probe_id: int
    def __init__(self, probe_id: _Optional[int] = ...) -> None: ...

class ChunkPosted(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class TransferNotice(_message.Message):
    __slots__ = ("protocol_version", "request_id", "chunk_done", "slot_free", "chunk_ready", "chunk_consumed", "abort", "abort_ack", "heartbeat", "probe", "chunk_posted")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_DONE_FIELD_NUMBER: _ClassVar[int]
    SLOT_FREE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_READY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    ABORT_ACK_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_POSTED_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    request_id: str
    chunk_done: ChunkDone
    slot_free: SlotFree
    chunk_ready: ChunkReady
    chunk_consumed: ChunkConsumed
    abort: Abort
    abort_ack: AbortAck
    heartbeat: Heartbeat
    probe: Probe
    chunk_posted: ChunkPosted
    def __init__(self, protocol_version: _Optional[int] = ..., request_id: _Optional[str] = ..., chunk_done: _Optional[_Union[ChunkDone, _Mapping]] = ..., slot_free: _Optional[_Union[SlotFree, _Mapping]] = ..., chunk_ready: _Optional[_Union[ChunkReady, _Mapping]] = ..., chunk_consumed: _Optional[_Union[ChunkConsumed, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., abort_ack: _Optional[_Union[AbortAck, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., probe: _Optional[_Union[Probe, _Mapping]] = ..., chunk_posted: _Optional[_Union[ChunkPosted, _Mapping]] = ...) -> None: ...
