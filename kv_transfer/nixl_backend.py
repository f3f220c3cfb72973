"""A typed, locked wrapper over one `nixl_agent`: the only module that touches NIXL.

NIXL is imported lazily here (`nixl_cu13` on CUDA 13 hosts, `nixl_cu12` elsewhere), so importing
cedserve never needs it. NIXL's agent is not thread-safe without its listener thread, so every call
goes through one lock. Errors come back as `NixlCallError` naming the call and the peer.
"""

from __future__ import annotations

import importlib
import os
import threading
from types import ModuleType
from typing import Any, Literal

import numpy as np
import torch

from cedserve.kv_transfer.config import KVTransferConfig
from cedserve.kv_transfer.descriptors import DescriptorPair
from cedserve.kv_transfer.errors import NixlUnavailableError

XferStatus = Literal["DONE", "PROC", "ERR"]
MemType = Literal["DRAM", "VRAM"]

_NIXL_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")


def import_nixl() -> ModuleType:
    """The installed NIXL Python package, or `NixlUnavailableError` saying what to install."""
    errors = []
    for name in _NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if hasattr(module, "nixl_agent"):
            return module
    raise NixlUnavailableError("NIXL is not installed (tried " + "; ".join(errors) + "): install the "
                               "`nixl` extra, `pip install 'cedserve[nixl]'` (nixl-cu12), or nixl-cu13")


def nixl_available() -> bool:
    try:
        import_nixl()
    except NixlUnavailableError:
        return False
    return True


def apply_ucx_environment(config: KVTransferConfig) -> None:
    """Export the configured UCX variables; UCX reads them when the agent's context is created."""
    if config.ucx_tls is not None:
        os.environ["UCX_TLS"] = config.ucx_tls
    if config.ucx_net_devices is not None:
        os.environ["UCX_NET_DEVICES"] = config.ucx_net_devices


class NixlCallError(RuntimeError):
    """A NIXL call failed; `disconnected` is True when NIXL said the remote endpoint is gone."""

    def __init__(self, call: str, peer: str, exc: BaseException) -> None:
        self.call = call
        self.peer = peer
        kind = type(exc).__name__
        self.disconnected = "Disconnect" in kind or "REMOTE_DISCONNECT" in str(exc)
        super().__init__(f"NIXL {call} (peer {peer!r}) failed: {kind}: {exc}")


def mem_type(t: torch.Tensor) -> MemType:
    return "VRAM" if t.device.type == "cuda" else "DRAM"


class NixlBackend:
    """One NIXL agent with its UCX backend and registered memory."""

    def __init__(self, name: str, config: KVTransferConfig) -> None:
        nixl = import_nixl()
        apply_ucx_environment(config)
        self.name = name
        self._lock = threading.Lock()
        agent_config = nixl.nixl_agent_config(enable_prog_thread=config.progress_thread,
                                              enable_listen_thread=False, backends=[])
        try:
            self._agent: Any = nixl.nixl_agent(name, agent_config)
            for backend in config.backends:
                params: dict[str, str] = {}
                if backend == "UCX":
                    params = {"ucx_error_handling_mode": config.ucx_error_handling_mode,
                              "num_workers": str(config.ucx_num_workers)}
                self._agent.create_backend(backend, params)
        except Exception as exc:  # NIXL raises its own binding errors; name what failed
            raise NixlCallError(f"agent/backend creation ({', '.join(config.backends)})", "", exc) from exc
        self._registered: list[Any] = []
        self._lists: dict[int, Any] = {}  # prepared block lists by key (see `prep_blocks`)
        self._next_list = 1

    def register(self, tensor: torch.Tensor) -> None:
        """Register a contiguous tensor with every backend, once; deregistered at `close`."""
        with self._lock:
            try:
                self._registered.append(self._agent.register_memory(tensor))
            except Exception as exc:
                raise NixlCallError("register_memory", "", exc) from exc

    def metadata(self) -> bytes:
        with self._lock:
            return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        with self._lock:
            try:
                name = self._agent.add_remote_agent(metadata)
            except Exception as exc:
                raise NixlCallError("add_remote_agent", "?", exc) from exc
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_peer(self, peer: str) -> None:
        """Forget a peer and disconnect from it; errors are swallowed into the return of callers
        that already declared the peer dead (there is nothing left to tell it)."""
        with self._lock:
            try:
                self._agent.remove_remote_agent(peer)
            except Exception as exc:
                raise NixlCallError("remove_remote_agent", peer, exc) from exc

    def post(self, op: Literal["WRITE", "READ"], descs: DescriptorPair, local_mem: MemType,
             remote_mem: MemType, peer: str, notif: bytes) -> tuple[Any, XferStatus]:
        """Create and post one transfer request; `(handle, status)`."""
        with self._lock:
            try:
                local = self._agent.get_xfer_descs(descs.local, local_mem)
                remote = self._agent.get_xfer_descs(descs.remote, remote_mem)
                handle = self._agent.initialize_xfer(op, local, remote, peer, notif)
                status: XferStatus = self._agent.transfer(handle)
            except Exception as exc:
                raise NixlCallError(f"{op} post", peer, exc) from exc
        return handle, status

    def prep_blocks(self, peer: str | None, base_address: int, block_bytes: int, num_blocks: int,
                    device_id: int, mem: MemType) -> int:
        """Prepare, once, a descriptor list of `num_blocks` blocks of `block_bytes` from `base_address`:
        ours (`peer` None) or a peer's (its metadata loaded). `post_blocks` then names blocks by index
        and NIXL merges runs that are consecutive on both sides into one descriptor, so no
        descriptor is built or validated per transfer. Returns a key for `post_blocks` and
        `release_blocks`. The list is passed in NIXL's strided form (one row: address, length,
        device, stride, count); a NIXL without it gets the plain `[num_blocks, 3]` list."""
        agent_name = "NIXL_INIT_AGENT" if peer is None else peer
        strided = np.array([[base_address, block_bytes, device_id, block_bytes, num_blocks]], dtype=np.uint64)
        with self._lock:
            try:
                try:
                    handle = self._agent.prep_xfer_dlist(agent_name, strided, mem)
                except Exception:
                    rows = np.empty((num_blocks, 3), dtype=np.uint64)
                    rows[:, 0] = base_address + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
                    rows[:, 1] = block_bytes
                    rows[:, 2] = device_id
                    handle = self._agent.prep_xfer_dlist(agent_name, rows, mem)
            except Exception as exc:
                raise NixlCallError("prep_xfer_dlist", peer or "", exc) from exc
            key = self._next_list
            self._next_list += 1
            self._lists[key] = handle
        return key

    def release_blocks(self, key: int) -> None:
        """Release a prepared list; a post naming it afterwards fails with `NixlCallError`."""
        with self._lock:
            handle = self._lists.pop(key, None)
            if handle is None:
                return
            try:
                self._agent.release_dlist_handle(handle)
            except Exception as exc:
                raise NixlCallError("release_dlist_handle", "", exc) from exc

    def post_blocks(self, op: Literal["WRITE", "READ"], local: int, local_ids: np.ndarray, remote: int,
                    remote_ids: np.ndarray, peer: str, notif: bytes) -> tuple[Any, XferStatus]:
        """Create and post one transfer request of blocks `local_ids[i]` <-> `remote_ids[i]` of two
        prepared lists (`prep_blocks`); `(handle, status)`."""
        with self._lock:
            local_list, remote_list = self._lists.get(local), self._lists.get(remote)
            if local_list is None or remote_list is None:  # the peer was removed meanwhile
                raise NixlCallError(f"{op} post", peer, RuntimeError("descriptor list released"))
            try:
                handle = self._agent.make_prepped_xfer(op, local_list, local_ids.astype(np.int32, copy=False),
                                                       remote_list, remote_ids.astype(np.int32, copy=False),
                                                       notif)
                status: XferStatus = self._agent.transfer(handle)
            except Exception as exc:
                raise NixlCallError(f"{op} post", peer, exc) from exc
        return handle, status

    def status(self, handle: Any, peer: str) -> XferStatus:
        with self._lock:
            try:
                status: XferStatus = self._agent.check_xfer_state(handle)
            except Exception as exc:
                raise NixlCallError("check_xfer_state", peer, exc) from exc
        return status

    def release(self, handle: Any, peer: str) -> None:
        """Free a finished request, or ask NIXL to cancel a running one (raises if it cannot)."""
        with self._lock:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception as exc:
                raise NixlCallError("release_xfer_handle", peer, exc) from exc

    def notify(self, peer: str, message: bytes) -> None:
        with self._lock:
            try:
                self._agent.send_notif(peer, message)
            except Exception as exc:
                raise NixlCallError("send_notif", peer, exc) from exc

    def drain_notifs(self) -> dict[str, list[bytes]]:
        """New notifications by sending agent (also progresses UCX when there is no progress thread)."""
        with self._lock:
            try:
                got: dict[str, list[bytes]] = self._agent.get_new_notifs()
            except Exception as exc:
                raise NixlCallError("get_new_notifs", "", exc) from exc
        return got

    def close(self) -> None:
        for key in list(self._lists):
            self.release_blocks(key)
        with self._lock:
            for reg in self._registered:
                try:
                    self._agent.deregister_memory(reg)
                except Exception as exc:  # closing anyway; report, do not mask the close
                    raise NixlCallError("deregister_memory", "", exc) from exc
            self._registered.clear()
