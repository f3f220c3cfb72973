"""KV transfer between prefill and decode workers over NIXL (cedserve.kv_transfer).

Reading order (docs/kv_transfer.md has the full picture):

1. `protocol`    the contract: `Reservation`, `KVSender`, `KVReceiver`, `TransferEndpoint`, decode-first lifecycle
2. `state`       `TransferState` (reserved, transferring, done, failed, aborted), `TransferRecord`, `TransferResult`
3. `errors`      `KVTransferError(request_id, cause)`, `FailureCause`, `CompatibilityError`
4. `region`      `KVRegion` (the registered pool), `KVLayout` (cross-layer vs per-layer), `PROTOCOL_VERSION`, compatibility hash
5. `descriptors` vectorised descriptor lists: coalesced runs, per-layer baseline, the pack decision
6. `staging`     packed staging slots: gather on the sender, scatter on the receiver
7. `config`      `KVTransferConfig`
8. `control`     the token-authenticated gRPC control plane (Handshake, Heartbeat, Abort, Claim)
9. `registration` `LocalMemory`: registered pool and staging buffer, prepared block list, posting
10. `handshake`  `AgentInfo` both ways, loading a peer into NIXL, the sender's claim
11. `engine`     `NixlEngine`: transfers, notifications, heartbeats, leases, failure handling, progress loop
12. `agent`      `NixlTransferAgent`: the three above and the control service, what a worker holds
13. `loopback`   `LoopbackAgent`: the in-process fake with the same interface
14. `metrics`, `wire`, `nixl_backend`, `transfers`: metrics, protobuf conversions, the NIXL wrapper, bookkeeping

The load test and its references (`cedserve bench kv-transfer`) live in `cedserve.bench.kv_transfer`.

Nothing here imports NIXL at import time; `NixlTransferAgent` imports it when constructed.
"""

from cedserve.kv_transfer.config import KVTransferConfig
from cedserve.kv_transfer.errors import (
    CompatibilityError,
    FailureCause,
    HandshakeError,
    KVTransferError,
    RequestId,
)
from cedserve.kv_transfer.protocol import KVReceiver, KVSender, Reservation, TransferEndpoint, TransferMode
from cedserve.kv_transfer.region import PROTOCOL_VERSION, KVLayout, KVRegion, LayoutKind
from cedserve.kv_transfer.state import Role, TransferResult, TransferState

__all__ = [
    "PROTOCOL_VERSION",
    "CompatibilityError",
    "FailureCause",
    "HandshakeError",
    "KVLayout",
    "KVReceiver",
    "KVRegion",
    "KVSender",
    "KVTransferConfig",
    "KVTransferError",
    "LayoutKind",
    "RequestId",
    "Reservation",
    "Role",
    "TransferEndpoint",
    "TransferMode",
    "TransferResult",
    "TransferState",
]
