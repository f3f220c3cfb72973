"""A decode engine loop that fails answers nothing again, so nothing may wait on it: every waiting and
later Reserve and Decode call ends with UNAVAILABLE at once (the router places the request
elsewhere), and the worker's serve loop returns at once, not alive, so the process exits and
`cedserve serve`'s supervisor starts it again. Before, a proposer bug that stopped the loop (the
DSpark deferral's first cut) left the HTTP API's clients waiting until their read timeouts, and the
worker process serving on without an engine."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from decode_support import Rig, tiny
from test_decode_early_cancel import Aborted, Context, make_service

from cedserve.common.errors import ErrorKind
from cedserve.decode_workers.loop import EngineLoop, LocalChannel
from cedserve.decode_workers.messages import Failed, Tokens
from cedserve.decode_workers.service import OutputRouter
from cedserve.proto import worker_pb2 as wpb
from cedserve.serving.drain import DrainController
from cedserve.serving.worker import serve_until_drained

pytestmark = pytest.mark.unit


def test_a_failed_router_fails_every_waiting_and_later_call() -> None:
    router = OutputRouter(1)
    waiting = router.expect_reserve("r1", 0, "lease-1")
    stream = router.open_stream("r2")
    router.fail_all(ErrorKind.UNAVAILABLE, "the decode engine stopped")
    out = waiting.result(timeout=1)
    assert isinstance(out, Failed) and out.kind is ErrorKind.UNAVAILABLE and out.lease_id == "lease-1"
    _, streamed = stream.get(timeout=1)
    assert isinstance(streamed, Failed) and streamed.request_id == "r2"
    later = router.expect_reserve("r3", 0)  # answered at once: no engine will
    assert later.done() and isinstance(later.result(), Failed)
    _, opened = router.open_stream("r4").get(timeout=1)
    assert isinstance(opened, Failed) and opened.message == "the decode engine stopped"


def test_a_reserve_on_a_failed_engine_is_unavailable_at_once() -> None:
    service, _, router = make_service()
    router.fail_all(ErrorKind.UNAVAILABLE, "the decode engine stopped: boom")
    context = Context()
    start = time.monotonic()
    with pytest.raises(Aborted, match="stopped"):
        service.Reserve(wpb.ReserveRequest(request_id="r1", prompt_tokens=10), context)  # type: ignore[arg-type]
    assert context.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - start < 1.0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop re-raises
def test_the_loop_calls_on_failure_with_what_stopped_it() -> None:
    model, drafter = tiny()
    rig = Rig(model, drafter)
    loop = EngineLoop(rig.engine, LocalChannel())
    seen: list[BaseException] = []
    loop.on_failure = seen.append

    def broken() -> list[Tokens]:
        raise RuntimeError("a bug in the engine")

    rig.engine.poll = broken  # type: ignore[method-assign]  # every tick polls
    thread = loop.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and isinstance(loop.error, RuntimeError)
    assert seen == [loop.error]


class Health:
    def __init__(self) -> None:
        self.alive: list[bool] = []
        self.ready: list[bool] = []

    def set_alive(self, alive: bool) -> None:
        self.alive.append(alive)

    def set_ready(self, ready: bool) -> None:
        self.ready.append(ready)


class Target:
    def stop_accepting(self) -> None:
        raise AssertionError("a failed engine is not drained")

    def in_flight(self) -> int:
        return 0

    def hand_back(self) -> None:
        raise AssertionError("a failed engine is not drained")


def test_the_serve_loop_returns_when_the_engine_failed() -> None:
    """No drain was asked for: `serve_until_drained` returns False once `failed()`, not alive."""
    health, dead = Health(), threading.Event()
    threading.Timer(0.2, dead.set).start()
    start = time.monotonic()
    drained = serve_until_drained(DrainController(), health, lambda: not dead.is_set(),  # type: ignore[arg-type]
                                  Target(), failed=dead.is_set)
    assert drained is False and time.monotonic() - start < 5.0
    assert health.alive[-1] is False and health.ready[-1] is False
