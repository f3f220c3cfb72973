"""Abandoned work on the decode worker (issue 32): a Reserve whose caller is already gone, or whose
Cancel ran first (under load the router's Cancel can overtake the Reserve it cancels), leases
nothing; a lease granted after its caller left is cancelled at once instead of held until it
expires. `DecodeService` over a fake inbox and a fake call context; the engine's answer is fed
through `OutputRouter` as the engine's reports would."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest

from cedserve.common.errors import ErrorKind
from cedserve.decode_workers import service as service_module
from cedserve.decode_workers.messages import CancelCommand, Failed, ReserveCommand, Reserved
from cedserve.decode_workers.service import EARLY_CANCEL_TTL_S, DecodeService, OutputRouter
from cedserve.proto import worker_pb2 as wpb
from cedserve.serving.drain import DrainController

pytestmark = pytest.mark.unit


class Aborted(Exception):
    pass


class Context:
    def __init__(self, active: bool = True) -> None:
        self.active = active
        self.code: grpc.StatusCode | None = None

    def is_active(self) -> bool:
        return self.active

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise Aborted(details)


class Inbox:
    def __init__(self) -> None:
        self.commands: list[Any] = []

    def put(self, command: Any) -> None:
        self.commands.append(command)


def make_service() -> tuple[DecodeService, Inbox, OutputRouter]:
    inbox, router = Inbox(), OutputRouter(1)
    return DecodeService("d0", inbox, router, None, lambda: None, DrainController(), 30_000), inbox, router  # type: ignore[arg-type]


def test_a_reserve_whose_caller_is_gone_leases_nothing() -> None:
    service, inbox, _ = make_service()
    context = Context(active=False)
    with pytest.raises(Aborted):
        service.Reserve(wpb.ReserveRequest(request_id="r1", prompt_tokens=10), context)  # type: ignore[arg-type]
    assert context.code == grpc.StatusCode.CANCELLED and inbox.commands == []


def test_a_cancel_that_overtakes_its_reserve_is_remembered() -> None:
    service, inbox, router = make_service()
    assert not service.Cancel(wpb.CancelRequest(request_id="r2"), Context()).found  # type: ignore[arg-type]
    context = Context()
    with pytest.raises(Aborted):
        service.Reserve(wpb.ReserveRequest(request_id="r2", prompt_tokens=10), context)  # type: ignore[arg-type]
    assert context.code == grpc.StatusCode.CANCELLED and inbox.commands == []
    assert not router.cancelled_early("r2")  # consumed: a later request with that id is not refused


def test_early_cancels_are_forgotten_after_their_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    router = OutputRouter(1)
    router.note_early_cancel("old")
    now = time.monotonic()
    monkeypatch.setattr(service_module.time, "monotonic", lambda: now + EARLY_CANCEL_TTL_S + 1)
    assert not router.cancelled_early("old")


def test_a_lease_granted_after_its_caller_left_is_cancelled_at_once() -> None:
    service, inbox, router = make_service()
    context = Context()
    result: list[BaseException] = []

    def reserve() -> None:
        try:
            service.Reserve(wpb.ReserveRequest(request_id="r3", prompt_tokens=10), context)  # type: ignore[arg-type]
        except Aborted as exc:
            result.append(exc)

    caller = threading.Thread(target=reserve)
    caller.start()
    deadline = time.monotonic() + 5
    while not inbox.commands and time.monotonic() < deadline:
        time.sleep(0.01)
    command = inbox.commands[0]
    assert isinstance(command, ReserveCommand)
    context.active = False  # the router's deadline passes while the engine works on the Reserve
    router._route(Reserved("r3", command.lease_id, "agent", "127.0.0.1:1", (1, 2), 0, 0))
    caller.join(5)
    assert result and context.code == grpc.StatusCode.CANCELLED
    cancel = inbox.commands[-1]
    assert isinstance(cancel, CancelCommand) and cancel.request_id == "r3" and cancel.lease_id == command.lease_id


def test_early_cancels_are_bounded_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service_module, "MAX_EARLY_CANCELS", 3)
    router = OutputRouter(1)
    for rid in ("a", "b", "c", "d"):
        router.note_early_cancel(rid)
    assert not router.cancelled_early("a")  # evicted: the oldest past the bound
    assert all(router.cancelled_early(rid) for rid in ("b", "c", "d"))


def _reserve_in_thread(service: DecodeService, inbox: Inbox, request_id: str,
                       answers: list[object]) -> tuple[threading.Thread, ReserveCommand]:
    """A Reserve call waiting on the engine's answer; its queued command."""
    def reserve() -> None:
        try:
            answers.append(service.Reserve(wpb.ReserveRequest(request_id=request_id, prompt_tokens=10),
                                           Context()))  # type: ignore[arg-type]
        except Aborted as exc:
            answers.append(exc)

    caller = threading.Thread(target=reserve)
    caller.start()
    deadline = time.monotonic() + 5
    while not any(isinstance(c, ReserveCommand) for c in inbox.commands) and time.monotonic() < deadline:
        time.sleep(0.01)
    command = next(c for c in inbox.commands if isinstance(c, ReserveCommand))
    return caller, command


def test_a_cancel_of_an_ended_lease_does_not_refuse_the_retry() -> None:
    """The router retries a failed attempt under the same request id after cancelling the attempt's
    lease; a Cancel naming a lease this worker no longer holds is not one for the retry's Reserve."""
    service, inbox, router = make_service()
    assert not service.Cancel(wpb.CancelRequest(request_id="r4", lease_id="ended"), Context()).found  # type: ignore[arg-type]
    assert not router.cancelled_early("r4")
    answers: list[object] = []
    caller, command = _reserve_in_thread(service, inbox, "r4", answers)
    router._route(Reserved("r4", command.lease_id, "agent", "127.0.0.1:1", (1, 2), 0, 0))
    caller.join(5)
    assert len(answers) == 1 and isinstance(answers[0], wpb.ReserveReply), answers
    assert answers[0].lease_id == command.lease_id


def test_an_earlier_leases_answer_does_not_answer_the_retry() -> None:
    """The Cancel of a failed attempt's lease answers "lease cancelled" once the engine runs it; when
    the retry's Reserve already waits, that answer is the old lease's, not the retry's."""
    service, inbox, router = make_service()
    answers: list[object] = []
    caller, command = _reserve_in_thread(service, inbox, "r5", answers)
    router._route(Failed("r5", ErrorKind.CANCELLED, "lease cancelled: cancelled by the router", lease_id="old"))
    assert not answers and router.rank_of("r5") == 0  # dropped: the retry still waits, its rank kept
    router._route(Reserved("r5", command.lease_id, "agent", "127.0.0.1:1", (1, 2), 0, 0))
    caller.join(5)
    assert len(answers) == 1 and isinstance(answers[0], wpb.ReserveReply), answers
