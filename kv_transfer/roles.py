"""The sender and receiver roles of a transfer engine, written once for every engine.

`NixlTransferAgent` and the `LoopbackAgent` fake both do their work in one engine object; these
thin facades give each role the keyword-only `KVSender` / `KVReceiver` surface of `protocol.py`.
"""

from __future__ import annotations

from typing import Protocol

from cedserve.kv_transfer.errors import FailureCause, RequestId
from cedserve.kv_transfer.protocol import BlockIds, Reservation, TransferMode
from cedserve.kv_transfer.state import FinishCallback, Role, TransferResult, TransferState


class TransferEngine(Protocol):
    """What the role facades call on an engine (positional, the engines' own signatures)."""

    @property
    def name(self) -> str: ...

    def reserve(self, request_id: RequestId, block_ids: BlockIds, sender: str, mode: TransferMode | None,
                lease_s: float | None, on_finish: FinishCallback | None) -> Reservation: ...

    def open(self, reservation: Reservation, timeout_s: float | None, on_finish: FinishCallback | None) -> None: ...

    def write_blocks(self, request_id: RequestId, local_block_ids: BlockIds, last: bool) -> None: ...

    def wait(self, role: Role, request_id: RequestId, timeout_s: float) -> TransferResult: ...

    def state(self, role: Role, request_id: RequestId) -> TransferState: ...

    def abort(self, request_id: RequestId, cause: FailureCause = FailureCause.CANCELLED, detail: str = "") -> bool: ...


class _Role:
    role: Role

    def __init__(self, engine: TransferEngine) -> None:
        self._engine = engine

    @property
    def agent_name(self) -> str:
        return self._engine.name

    def wait(self, request_id: RequestId, timeout_s: float) -> TransferResult:
        return self._engine.wait(self.role, request_id, timeout_s)

    def state(self, request_id: RequestId) -> TransferState:
        return self._engine.state(self.role, request_id)

    def abort(self, request_id: RequestId, cause: FailureCause = FailureCause.CANCELLED, detail: str = "") -> bool:
        return self._engine.abort(request_id, cause, detail)


class SenderRole(_Role):
    """The sender role of an engine (satisfies `KVSender`)."""

    role = Role.SENDER

    def open(self, reservation: Reservation, *, timeout_s: float | None = None,
             on_finish: FinishCallback | None = None) -> None:
        self._engine.open(reservation, timeout_s, on_finish)

    def write_blocks(self, request_id: RequestId, local_block_ids: BlockIds, *, last: bool = False) -> None:
        self._engine.write_blocks(request_id, local_block_ids, last)


class ReceiverRole(_Role):
    """The receiver role of an engine (satisfies `KVReceiver`)."""

    role = Role.RECEIVER

    def reserve(self, request_id: RequestId, block_ids: BlockIds, *, sender: str,
                mode: TransferMode | None = None, lease_s: float | None = None,
                on_finish: FinishCallback | None = None) -> Reservation:
        return self._engine.reserve(request_id, block_ids, sender, mode, lease_s, on_finish)
