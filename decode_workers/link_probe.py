"""The decode side of the link probe: hashing a probe lease's received blocks off the engine thread.

`CheckProbe` (service.py) queues a `ProbeCheckCommand`; once the lease's transfer is DONE the engine
copies the received blocks to the host (`load_bytes`, on the engine thread, because the lease's
blocks are freed right after) and hands the copy to `ProbeDigests.submit`. SHA-256 runs on one
worker thread (hashlib releases the GIL on large buffers), so a probe of gigabytes never stalls a
decode step; the engine's `poll` collects the finished digests as `ProbeChecked` outputs.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from cedserve.decode_workers.messages import ProbeCheckCommand, ProbeChecked
from cedserve.kv_transfer.link_probe import digest


@dataclass(frozen=True)
class _Pending:
    cmd: ProbeCheckCommand
    lease_id: str
    num_blocks: int
    num_bytes: int
    sha256: Future[str]


class ProbeDigests:
    """Probe checks whose received bytes are being hashed. `submit` and `poll` are called on the
    engine thread; only `digest` runs on the worker thread."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None  # started by the first probe
        self._pending: list[_Pending] = []

    def submit(self, cmd: ProbeCheckCommand, lease_id: str, received: np.ndarray, num_blocks: int) -> None:
        """Hash `received` (flat `uint8`, the lease's blocks in reservation order, a copy the caller
        no longer touches) and answer `cmd` from a later `poll`."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="probe-digest")
        self._pending.append(_Pending(cmd, lease_id, num_blocks, received.nbytes,
                                      self._executor.submit(digest, received)))

    def poll(self) -> list[ProbeChecked]:
        """The answers of every hash that has finished."""
        done: list[_Pending] = []
        waiting: list[_Pending] = []
        for p in self._pending:
            (done if p.sha256.done() else waiting).append(p)
        self._pending = waiting
        return [_answer(p) for p in done]


def _answer(p: _Pending) -> ProbeChecked:
    got = p.sha256.result()
    return ProbeChecked(p.cmd.request_id, p.lease_id, got, got == p.cmd.sha256, p.num_blocks, p.num_bytes)
