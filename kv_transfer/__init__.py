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
9. `agent`       `NixlTransferAgent`: the engine (progress loop, heartbeats, leases, failure handling)
10. `loopback`   `LoopbackAgent`: the in-process fake with the same interface
11. `metrics`, `wire`, `nixl_backend`, `transfers`: metrics, protobuf conversions, the NIXL wrapper, bookkeeping
12. `harness`, `loadtest`: multi-process runner (loopback, network namespaces, hosts) and `cedserve bench kv-transfer`

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
