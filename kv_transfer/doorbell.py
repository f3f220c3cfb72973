"""`Doorbell`: what an agent's progress loop sleeps on, so a peer can cut its sleep short.

NIXL delivers a notification only when the receiving agent next polls (`get_new_notifs`), and an
agent waiting for a peer polls every `target_poll_s` (200 us on device memory, 1 ms on host memory):
every request paid about half that in latency before its receiver saw it land. The loop now sleeps
in `select` on one UDP socket instead of a `threading.Event`: `wake()` (a change on this side, as
`Event.set` was) sends it a datagram from this process, and a peer `ring`s it right after each
data-path notification and after each of its requests completes (when NIXL sends the request's
notification), so the receiver polls within tens of microseconds of the news instead of at its
next poll. A ring carries no data and grants nothing: it only shortens a sleep, and a lost one
(UDP) costs what every request cost before, one poll interval. The socket binds to the agent's
control host (the cluster address its control service serves on); its port travels in `AgentInfo`.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

_SELF = b"s"  # a wake from this process
_PEER = b"p"  # a peer's ring
_DRAIN_MAX = 256  # datagrams consumed per wait; any left wake the next one at once


class Doorbell:
    """One non-blocking UDP socket: `wake`/`ring` send to it, `wait` sleeps on it."""

    def __init__(self, host: str) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        self._sock.bind((host, 0))
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        any_host = host in ("", "0.0.0.0", "::")
        self._self_address = ("::1" if family == socket.AF_INET6 else "127.0.0.1") if any_host else host
        self._closed = False
        self._wake_pending = False  # a wake sent and not yet seen by `wait`: the next one is redundant

    def wake(self) -> None:
        """Cut this loop's current (or next) sleep short. Cheap when a wake is already pending (a
        prefill queueing many chunks sends one datagram, not one per chunk)."""
        if self._wake_pending:
            return
        self._wake_pending = True
        self._send(_SELF, (self._self_address, self.port))

    def ring(self, address: tuple[str, int]) -> None:
        """Cut the sleep of the peer whose doorbell is at `address` short (best effort)."""
        self._send(_PEER, address)

    def _send(self, payload: bytes, address: tuple[str, int]) -> None:
        if self._closed:
            return
        # A full socket buffer means a wake is already pending; an unreachable peer has nothing to wake.
        with contextlib.suppress(OSError):
            self._sock.sendto(payload, address)

    def wait(self, timeout_s: float) -> bool:
        """Sleep until a wake or ring arrives or `timeout_s` passes; every pending datagram is
        consumed. True when a peer rang."""
        if self._closed:
            return False
        readable, _, _ = select.select([self._sock], [], [], max(timeout_s, 0.0))
        self._wake_pending = False  # before the step that follows reads the state a wake announced
        rang = False
        for _ in range(_DRAIN_MAX if readable else 0):
            try:
                payload = self._sock.recv(16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # e.g. ICMP port unreachable reported for an earlier ring: not ours to act on
                continue
            rang = rang or payload == _PEER
        return rang

    def close(self) -> None:
        self._closed = True
        self._sock.close()


class LocalBell:
    """What the progress loop sleeps on without a UDP doorbell (`KVTransferConfig.doorbell` off, the
    default): `wake` from this process ends the sleep, no port is opened and peers cannot ring it
    (`port` 0: peers never try)."""

    port = 0

    def __init__(self) -> None:
        self._event = threading.Event()

    def wake(self) -> None:
        if not self._event.is_set():  # a prefill queueing many chunks sets it once
            self._event.set()

    def ring(self, address: tuple[str, int]) -> None:
        """Nothing: this side has no doorbell socket to send from."""

    def wait(self, timeout_s: float) -> bool:
        self._event.wait(max(timeout_s, 0.0))
        self._event.clear()
        return False

    def close(self) -> None:
        self._event.set()


def peer_doorbell(control_address: str, port: int) -> tuple[str, int] | None:
    """A peer's doorbell: the host of its control address, the port it announced (0: none)."""
    if not port or not control_address:
        return None
    host = control_address.rpartition(":")[0].strip("[]")
    return (host, port) if host else None
