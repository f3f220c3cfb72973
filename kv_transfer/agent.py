"""`NixlTransferAgent`: one NIXL agent per worker, moving KV blocks between workers.

It puts three parts together, each in its own module:

- `registration.LocalMemory`: the NIXL agent's registered memory (block pool, staging buffer, the
  pool's prepared descriptor list) and the requests posted over it;
- `handshake`: our `AgentInfo`, the handshake both ways over the control service, loading a
  peer into NIXL, and the claim a sender makes before its first write;
- `engine.NixlEngine`: transfers, notifications, heartbeats, deadlines and the progress loop.

Lifecycle
---------
1. Start: `NixlTransferAgent(config, region, layout, name)` creates the NIXL agent with the
   configured backends (UCX, error handling `peer`), registers the whole block pool and the staging
   buffer once, starts the KVTransferControl gRPC service (token-authenticated) and the engine's
   progress thread.
2. Handshake: `handshake(address)` sends our `AgentInfo` (NIXL metadata, region addresses,
   protocol version, compatibility hash, incarnation) to the peer's control service and loads its
   reply; both sides check version and hash and refuse, naming both values, on a mismatch.
   Concurrent calls for one address share one exchange, and a handshake with a live peer of the
   same incarnation keeps the connection (`handshake.py`, `NixlEngine.add_peer`).
3. Transfers (decode-first, see `protocol.py` and `engine.py`): the receiver reserves blocks; the
   sender claims the reservation at the receiver's control service, opens it and streams
   `write_blocks` chunks.
4. Failure: see `engine.py` (heartbeats, dead peers, deadlines, aborts).
5. Close: every live transfer is aborted (SHUTDOWN), the service stops, memory is deregistered.

Link measurement (raw NIXL requests, probe notifications) is benchmark code:
`cedserve.bench.kv_transfer.link_meter` drives an agent's `engine` and `memory` for it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

from cedserve.kv_transfer.config import KVTransferConfig
from cedserve.kv_transfer.control import ControlServer
from cedserve.kv_transfer.engine import NixlEngine
from cedserve.kv_transfer.errors import FailureCause, HandshakeError, RequestId
from cedserve.kv_transfer.handshake import PeerConnector, agent_info, new_incarnation
from cedserve.kv_transfer.metrics import TransferMetrics
from cedserve.kv_transfer.nixl_backend import NixlBackend
from cedserve.kv_transfer.protocol import BlockIds, Reservation, TransferMode
from cedserve.kv_transfer.region import Compatibility, KVLayout, KVRegion
from cedserve.kv_transfer.registration import LocalMemory
from cedserve.kv_transfer.roles import ReceiverRole, SenderRole
from cedserve.kv_transfer.staging import StagingPool
from cedserve.kv_transfer.state import FinishCallback, Role, TransferResult, TransferState
from cedserve.proto import kv_transfer_pb2 as pb


class NixlTransferAgent:
    """The real transfer backend (see the module docstring). Thread-safe."""

    def __init__(self, config: KVTransferConfig, region: KVRegion, layout: KVLayout, name: str,
                 *, metrics: TransferMetrics | None = None) -> None:
        layout.check_region(region)
        if not config.auth_token:
            raise ValueError("config field `kv_transfer.auth_token`: must be set; a handshake grants "
                             "access to the block pool")
        config = config.resolved(region.device_memory)
        self.config = config
        self.metrics = metrics if metrics is not None else TransferMetrics()
        self._name = name
        self._incarnation = new_incarnation()
        self._compat = layout.compatibility()
        self._handshakes: dict[str, Future[str]] = {}  # control address -> the exchange in flight
        self._handshakes_lock = threading.Lock()
        self._backend = NixlBackend(name, config)
        self.memory = LocalMemory(self._backend, config, region, layout)
        self.engine = NixlEngine(config, self.memory, name, self.metrics)
        self._connector = PeerConnector(name, config, self._compat)
        self._server = ControlServer(self, config.control_host, config.control_port, config.auth_token,
                                     tls=config.tls)
        self.engine.start()

    # ------------------------------------------------------------------ identity, roles

    @property
    def name(self) -> str:
        return self._name

    @property
    def control_address(self) -> str:
        return self._server.address

    @property
    def region(self) -> KVRegion:
        return self.memory.region

    @property
    def layout(self) -> KVLayout:
        return self.memory.layout

    @property
    def staging(self) -> StagingPool | None:
        return self.memory.staging

    def compatibility(self) -> Compatibility:
        return self._compat

    def sender(self) -> SenderRole:
        return SenderRole(self)

    def receiver(self) -> ReceiverRole:
        return ReceiverRole(self)

    def info(self) -> pb.AgentInfo:
        """What peers need to know about us (sent in the handshake)."""
        return agent_info(self._name, self._compat, self.memory, self.control_address, self.engine.doorbell_port,
                          self._incarnation)

    def active_transfers(self) -> int:
        return self.engine.active_transfers()

    def peers(self) -> dict[str, bool]:
        """Handshaken peers and whether each is alive."""
        return self.engine.peers()

    # ------------------------------------------------------------------ handshake (control plane)

    def handshake(self, address: str, timeout_s: float = 5.0) -> str:
        """Connect to the agent at `address` (or confirm the connection we hold); its name.
        Concurrent calls for one address share one exchange: the first caller's, whose result or
        error each caller gets (`HandshakeError` when it is not over within `timeout_s`)."""
        with self._handshakes_lock:
            flight = self._handshakes.get(address)
            leading = flight is None
            if flight is None:
                flight = self._handshakes[address] = Future()
        if not leading:
            try:
                return flight.result(timeout_s)
            except TimeoutError:
                raise HandshakeError(f"KV transfer handshake with {address}: still in progress after "
                                     f"{timeout_s} s") from None
        try:
            name = self._exchange(address, timeout_s)
        except BaseException as exc:
            flight.set_exception(exc)
            raise
        else:
            flight.set_result(name)
        finally:
            with self._handshakes_lock:
                del self._handshakes[address]
        return name

    def _exchange(self, address: str, timeout_s: float) -> str:
        link = new_incarnation()
        responder = self._connector.initiate(address, self.info(), link, self.engine.lost_link(address), timeout_s)
        self.engine.add_peer(responder, link)
        return responder.agent_name

    def accept_handshake(self, request: pb.HandshakeRequest) -> pb.AgentInfo:
        """Control-plane side of `handshake` (called by the gRPC service)."""
        self._connector.accept(request.initiator)
        self.engine.add_peer(request.initiator, request.link, request.lost_link)
        return self.info()

    def claim(self, request_id: RequestId, sender_agent: str) -> str:
        """Control plane (`Claim`): "" when a reservation `request_id` for `sender_agent` is held here
        and has not ended, else why not."""
        return self.engine.claim(request_id, sender_agent)

    # ------------------------------------------------------------------ API used by the roles

    def reserve(self, request_id: RequestId, block_ids: BlockIds, sender: str, mode: TransferMode | None,
                lease_s: float | None, on_finish: FinishCallback | None) -> Reservation:
        return self.engine.reserve(request_id, block_ids, sender, mode, lease_s, on_finish)

    def open(self, reservation: Reservation, timeout_s: float | None, on_finish: FinishCallback | None) -> None:
        """Claim `reservation` at its receiver, then start sending into it."""
        self.engine.check_reservation(reservation)
        receiver = self.engine.live_peer(reservation.receiver, reservation.request_id)
        self._connector.claim(reservation, receiver.control_address)
        self.engine.open(reservation, timeout_s, on_finish)

    def write_blocks(self, request_id: RequestId, local_block_ids: BlockIds, last: bool) -> None:
        self.engine.write_blocks(request_id, local_block_ids, last)

    def abort(self, request_id: RequestId, cause: FailureCause = FailureCause.CANCELLED, detail: str = "") -> bool:
        """Abort the request in whichever role holds it; True if a live transfer was found."""
        return self.engine.abort(request_id, cause, detail)

    def wait(self, role: Role, request_id: RequestId, timeout_s: float) -> TransferResult:
        return self.engine.wait(role, request_id, timeout_s)

    def state(self, role: Role, request_id: RequestId) -> TransferState:
        return self.engine.state(role, request_id)

    def close(self) -> None:
        """Abort every transfer (SHUTDOWN), wait for them to release, stop, deregister."""
        if self.engine.closed:
            return
        self.engine.close()
        self._server.stop()
        self._connector.close()
        self._backend.close()


if TYPE_CHECKING:
    from cedserve.kv_transfer.protocol import KVReceiver, KVSender, TransferEndpoint

    def _conforms(agent: NixlTransferAgent) -> tuple[TransferEndpoint, KVSender, KVReceiver]:
        """mypy checks the agent against the contract here; never called."""
        return agent, agent.sender(), agent.receiver()
