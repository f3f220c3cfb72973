"""The handshake: how two agents learn each other before any transfer.

Each side describes itself in an `AgentInfo` (`agent_info`: NIXL's metadata blob, the block pool's
and staging buffer's addresses, protocol version and compatibility hash, its control address). The
initiator sends its own over the peer's control service and gets the peer's back
(`PeerConnector.initiate`); the responder checks it (`PeerConnector.accept`). Both sides then load
the other's info into NIXL (`load_peer`), which makes the `PeerState` the engine keeps.

Identity: an agent draws a random `incarnation` when it starts (`new_incarnation`) and sends it in
its info, and the initiator names the connection a handshake makes (`link`, random) and the one it
replaces after declaring it dead (`lost_link`). So a second handshake between two live agents
(concurrent, or crossing from both sides) keeps the connection, and only a new incarnation (a
restart) or a named lost link fails the transfers of the old one (`NixlEngine.add_peer`).

The same connector later asks a receiver, before a sender's first write, whether it still holds a
reservation for us (`claim`): the one data-path question that goes over the control plane.
"""

from __future__ import annotations

import secrets
import threading
import time

import grpc

from cedserve.kv_transfer.config import KVTransferConfig
from cedserve.kv_transfer.control import ControlClient, check_compatible
from cedserve.kv_transfer.descriptors import RegionAddress
from cedserve.kv_transfer.doorbell import peer_doorbell
from cedserve.kv_transfer.errors import FailureCause, KVTransferError
from cedserve.kv_transfer.nixl_backend import MemType
from cedserve.kv_transfer.protocol import Reservation
from cedserve.kv_transfer.region import Compatibility
from cedserve.kv_transfer.registration import LocalMemory
from cedserve.kv_transfer.transfers import PeerState
from cedserve.kv_transfer.wire import compat_from_pb, compat_to_pb
from cedserve.proto import kv_transfer_pb2 as pb


def new_incarnation() -> int:
    """A random, nonzero 64-bit id: an agent's incarnation, or a connection's link."""
    return secrets.randbits(64) | 1


def agent_info(name: str, compat: Compatibility, memory: LocalMemory, control_address: str,
               doorbell_port: int = 0, incarnation: int = 0) -> pb.AgentInfo:
    """What peers need to know about us (sent in the handshake)."""
    r = memory.region
    kind = pb.MEMORY_KIND_VRAM if r.device_memory else pb.MEMORY_KIND_DRAM
    staging = memory.staging
    staging_region = pb.MemoryRegion()
    if staging is not None:
        staging_region = pb.MemoryRegion(base_address=staging.base_address, length_bytes=staging.tensor.numel(),
                                         device_id=r.device_id, kind=kind)
    return pb.AgentInfo(
        agent_name=name, nixl_metadata=memory.backend.metadata(), compat=compat_to_pb(compat),
        kv_region=pb.MemoryRegion(base_address=r.base_address, length_bytes=r.nbytes, device_id=r.device_id,
                                  kind=kind),
        block_bytes=r.block_bytes, num_blocks=r.num_blocks, staging_region=staging_region,
        staging_slot_bytes=staging.slot_bytes if staging else 0,
        num_staging_slots=staging.num_slots if staging else 0,
        control_address=control_address, doorbell_port=doorbell_port, incarnation=incarnation)


def check_peer_info(info: pb.AgentInfo, own_name: str, block_bytes: int) -> None:
    """`ValueError` unless a peer's info names another agent whose blocks are the size of ours."""
    if not info.agent_name or info.agent_name == own_name:
        raise ValueError(f"handshake: bad peer agent name {info.agent_name!r}")
    if info.block_bytes != block_bytes:
        raise ValueError(f"handshake with {info.agent_name!r}: block_bytes {info.block_bytes} != "
                         f"ours {block_bytes}")
    if info.kv_region.length_bytes < info.num_blocks * info.block_bytes:
        raise ValueError(f"handshake with {info.agent_name!r}: region shorter than its blocks")


def load_peer(memory: LocalMemory, info: pb.AgentInfo, link: int) -> PeerState:
    """Load a checked peer's NIXL metadata (and prepare its block list): the peer, alive, seen now,
    over connection `link`. `ValueError` when the metadata names another agent than the info (it is
    unloaded again)."""
    backend = memory.backend
    loaded = backend.add_peer(info.nixl_metadata)
    if loaded != info.agent_name:
        backend.remove_peer(loaded)
        raise ValueError(f"handshake: NIXL metadata names {loaded!r}, AgentInfo names {info.agent_name!r}")
    kv_mem: MemType = "VRAM" if info.kv_region.kind == pb.MEMORY_KIND_VRAM else "DRAM"
    st_mem: MemType = "VRAM" if info.staging_region.kind == pb.MEMORY_KIND_VRAM else "DRAM"
    kv = RegionAddress(info.kv_region.base_address, info.num_blocks, info.kv_region.device_id)
    return PeerState(
        name=info.agent_name, kv=kv, kv_mem=kv_mem, block_bytes=info.block_bytes,
        staging_base=info.staging_region.base_address, staging_slot_bytes=info.staging_slot_bytes,
        staging_slots=info.num_staging_slots, staging_device=info.staging_region.device_id,
        staging_mem=st_mem, control_address=info.control_address, last_seen_s=time.monotonic(),
        blocks_list=memory.prep_peer_blocks(info.agent_name, kv, info.block_bytes, kv_mem),
        doorbell=peer_doorbell(info.control_address, info.doorbell_port), incarnation=info.incarnation,
        link=link)


class PeerConnector:
    """Our side of the control plane toward peers: the handshake both ways, and claims."""

    def __init__(self, name: str, config: KVTransferConfig, compat: Compatibility) -> None:
        self._name = name
        self._config = config
        self._compat = compat
        self._lock = threading.Lock()
        self._claim_clients: dict[str, ControlClient] = {}  # receiver agent -> its control service

    def initiate(self, address: str, info: pb.AgentInfo, link: int, lost_link: int,
                 timeout_s: float) -> pb.AgentInfo:
        """Send our `info` to the control service at `address`, proposing connection `link` (and
        naming `lost_link`, the one we declared dead, 0 if none); the responder's info, its
        compatibility checked (`CompatibilityError`, `HandshakeError`)."""
        client = ControlClient(address, self._config.auth_token, self._config.tls)
        try:
            return client.handshake(pb.HandshakeRequest(initiator=info, link=link, lost_link=lost_link),
                                    self._compat, timeout_s)
        finally:
            client.close()

    def accept(self, initiator: pb.AgentInfo) -> None:
        """Responder side: `CompatibilityError` naming both values unless the initiator matches us."""
        check_compatible(self._compat, compat_from_pb(initiator.compat), initiator.agent_name or "?")

    def claim(self, reservation: Reservation, control_address: str) -> None:
        """Ask the receiver's control plane whether it holds `reservation` for us, before any write:
        `KVTransferError` INVALID naming its answer when not (an unknown or ended lease), or
        PEER_DISCONNECTED when it cannot be asked within `peer_timeout_s`."""
        rid = reservation.request_id
        with self._lock:
            client = self._claim_clients.get(reservation.receiver)
            if client is None or client.address != control_address:
                client = ControlClient(control_address, self._config.auth_token, self._config.tls)
                self._claim_clients[reservation.receiver] = client
        try:
            problem = client.claim(rid, self._name, self._config.peer_timeout_s)
        except grpc.RpcError as exc:
            raise KVTransferError(rid, FailureCause.PEER_DISCONNECTED, f"receiver {reservation.receiver!r} "
                                  f"did not answer the claim: {exc.code().name}") from None
        if problem:
            raise KVTransferError(rid, FailureCause.INVALID, f"receiver {reservation.receiver!r}: {problem}")

    def close(self) -> None:
        with self._lock:
            clients, self._claim_clients = list(self._claim_clients.values()), {}
        for client in clients:
            client.close()
