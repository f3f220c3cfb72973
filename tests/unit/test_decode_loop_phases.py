"""Where a token's time goes on the decode worker: `cedserve_decode_loop_phase_seconds` times every
phase of the engine loop's tick and of the engine's step (a real tiny engine, driven by its
`EngineLoop` as the worker drives it), and the Decode stream's handoff and gRPC write (the service
over a real `OutputRouter`, a fake call context: the gRPC boundary). A stream that fell behind
sends the tokens that queued meanwhile as one event."""

from __future__ import annotations

from typing import Any

import pytest
from decode_support import Rig, prompt, tiny
from prometheus_client import CollectorRegistry

from cedserve.common.errors import ErrorKind
from cedserve.decode_workers.loop import EngineLoop, LocalChannel
from cedserve.decode_workers.messages import (
    AttachCommand,
    Failed,
    Finished,
    Output,
    RankLoad,
    Reserved,
    TickReport,
    Tokens,
)
from cedserve.decode_workers.metrics import LOOP_PHASES, DecodeMetrics
from cedserve.decode_workers.service import DecodeService, OutputRouter, merge_tokens
from cedserve.proto import worker_pb2 as wpb
from cedserve.serving.drain import DrainController

pytestmark = pytest.mark.unit

STEP_PHASES = ("schedule", "join", "propose", "plan", "model", "accept", "persist", "observe", "account")


def _phase(registry: CollectorRegistry, phase: str, what: str) -> float:
    value = registry.get_sample_value(f"cedserve_decode_loop_phase_seconds_{what}", {"phase": phase})
    return 0.0 if value is None else value


@pytest.mark.parametrize("dspark", [False, True], ids=["plain", "dspark"])
def test_every_phase_of_a_tick_and_a_step_is_timed(dspark: bool) -> None:
    model, drafter = tiny()
    rig = Rig(model, drafter, dspark=dspark)
    registry = rig.engine.metrics.registry
    reports: list[TickReport] = []
    loop = EngineLoop(rig.engine, LocalChannel(), on_report=reports.extend)
    tokens = prompt(21, 3)
    reserved = rig.reserve(tokens)
    assert isinstance(reserved, Reserved)
    rig.attach(reserved, tokens, rig.prefill(reserved, tokens), 6)
    ticks = 0
    while not any(isinstance(o, Finished) for r in reports for o in r.outputs):
        assert loop.tick() and ticks < 50
        ticks += 1
    steps = registry.get_sample_value("cedserve_decode_step_seconds_count")
    step_s = registry.get_sample_value("cedserve_decode_step_seconds_sum")
    assert steps is not None and 5 <= steps <= ticks  # the first tick may only see the transfer end
    for phase in ("commands", "poll", "report"):
        assert _phase(registry, phase, "count") == ticks, phase
    for phase in STEP_PHASES:  # once per step, whether or not it had anything to do
        assert _phase(registry, phase, "count") == steps, phase
    assert _phase(registry, "model", "sum") > 0
    # the step's phases are consecutive laps of its clock: they add up to the step's own time
    in_step = sum(_phase(registry, phase, "sum") for phase in STEP_PHASES)
    assert step_s is not None and in_step == pytest.approx(step_s, rel=0.05, abs=1e-3)
    # the first tick found no work (the transfer's end is news for its poll, which queues the join)
    assert _phase(registry, "idle_wait", "count") == 1
    # a group of one hands its report over as is, every token of the request in it
    emitted = [t for r in reports for o in r.outputs if isinstance(o, Tokens) for t in o.token_ids]
    assert len(emitted) == 6 and isinstance(reports[-1].outputs[-1], Finished)
    rig.assert_all_free()


def test_an_idle_tick_times_its_wait() -> None:
    model, _ = tiny()
    rig = Rig(model, None, idle_wait_s=0.05)
    loop = EngineLoop(rig.engine, LocalChannel())
    assert loop.tick()
    registry = rig.engine.metrics.registry
    assert _phase(registry, "idle_wait", "count") == 1 and _phase(registry, "idle_wait", "sum") >= 0.04
    assert _phase(registry, "model", "count") == 0  # no work: no step
    assert {phase for phase in LOOP_PHASES if _phase(registry, phase, "count")} == {
        "idle_wait", "commands", "poll", "report"}


def test_merge_tokens_joins_consecutive_chunks_only() -> None:
    a = Tokens("r", (1, 2), (-0.1, -0.2), (((1, -0.1),), ((2, -0.2),)), accepted_drafts=1, draft_tokens=3)
    b = Tokens("r", (3,), (-0.3,), (((3, -0.3),),), accepted_drafts=0, draft_tokens=2)
    c = Tokens("r", (4,))
    done = Finished("r", "length", 4, 5, 1)
    assert merge_tokens([a, b, done]) == [
        Tokens("r", (1, 2, 3), (-0.1, -0.2, -0.3), (((1, -0.1),), ((2, -0.2),), ((3, -0.3),)), 1, 5), done]
    assert merge_tokens([c]) == [c]
    assert merge_tokens([]) == []
    failed = Failed("r", ErrorKind.CANCELLED, "gone")
    assert merge_tokens([c, failed, c]) == [c, failed, c]  # never across another output


class Context:
    """A Decode call's context (the gRPC boundary): active until the test says otherwise."""

    def __init__(self) -> None:
        self.callbacks: list[Any] = []

    def is_active(self) -> bool:
        return True

    def add_callback(self, callback: Any) -> bool:
        self.callbacks.append(callback)
        return True


class Inbox:
    """The engine's side of the service: answers a Decode call's attach with `outputs` at once, as
    if the loop ran three steps before the stream's thread took the first."""

    def __init__(self, router: OutputRouter, outputs: list[Output]) -> None:
        self.router = router
        self.outputs = outputs

    def put(self, command: Any) -> None:
        if isinstance(command, AttachCommand):
            self.router.on_report([TickReport(self.outputs, RankLoad(rank=0))])


def test_a_stream_behind_the_loop_sends_what_queued_as_one_event() -> None:
    metrics = DecodeMetrics()
    router = OutputRouter(1)
    outputs: list[Output] = [Tokens("r", (1,), draft_tokens=2, accepted_drafts=1), Tokens("r", (2, 3)),
                             Finished("r", "length", 4, 2, 1)]
    service = DecodeService("d0", Inbox(router, outputs), router, None, lambda: None,  # type: ignore[arg-type]
                            DrainController(), 30_000, phases=metrics.phases)
    router.expect_reserve("r", 0)
    router.on_report([TickReport([Reserved("r", "lease-r", "", "", (), 0, 0)], RankLoad(rank=0))])
    request = wpb.DecodeRequest(request_id="r", lease_id="lease-r", token_ids=[5, 6], first_token=7, effort=50,
                                sampling=wpb.SamplingParams(max_tokens=4, top_p=1.0))
    events = list(service.Decode(request, Context()))  # type: ignore[arg-type]
    assert [e.WhichOneof("event") for e in events] == ["tokens", "complete"]
    assert list(events[0].tokens.token_ids) == [1, 2, 3]
    assert (events[0].tokens.draft_tokens, events[0].tokens.accepted_drafts) == (2, 1)
    assert events[1].complete.output_tokens == 4
    registry = metrics.registry
    assert _phase(registry, "handoff", "count") == 3  # every output's wait for the stream's thread
    assert _phase(registry, "grpc_write", "count") == 1  # the merged chunk; the end needs no resume
    assert router.rank_of("r") is None  # the stream ended: the request is forgotten


def test_a_ticks_outputs_reach_the_streams_when_the_next_step_starts_its_passes() -> None:
    """With `on_release` the loop holds the Decode streams' outputs until its next step starts its
    passes (the streams' threads then wake while the loop mostly runs without the GIL); the
    tick that leaves no work hands over what it reported at once: the last token never waits."""
    model, _ = tiny()
    rig = Rig(model, None)
    router = OutputRouter(1)
    loop = EngineLoop(rig.engine, LocalChannel(), on_report=router.hold_report, on_release=router.release)
    tokens = prompt(21, 3)
    reserved = rig.reserve(tokens)
    assert isinstance(reserved, Reserved)
    stream = router.open_stream(reserved.request_id)
    release = rig.engine.on_passes
    assert release is not None
    at_passes: list[int] = []  # what the stream holds as each step's passes start

    def watch_release() -> None:
        release()
        at_passes.append(stream.qsize())

    rig.engine.on_passes = watch_release
    rig.attach(reserved, tokens, rig.prefill(reserved, tokens), 6)
    received: list[Output] = []
    per_tick: list[list[Output]] = []  # what reached the stream during each tick
    while not any(isinstance(o, Finished) for o in received):
        assert loop.tick() and len(per_tick) < 50
        per_tick.append([])
        while not stream.empty():
            per_tick[-1].append(stream.get_nowait()[1])
        received += per_tick[-1]
    emitted = [t for o in received if isinstance(o, Tokens) for t in o.token_ids]
    assert len(emitted) == 6 and isinstance(received[-1], Finished)
    # a step's token reaches the stream when the next step's passes start, never in its own tick (the
    # join's at the second step's); the last step's tick, which leaves no work, hands over the
    # previous token as its passes start and then its own token and the end at once
    assert len(at_passes) == 6 and at_passes[0] == 0 and at_passes[1:] == [1] * 5
    assert [len(outs) for outs in per_tick if outs] == [1] * 4 + [3]
    assert [type(o) for o in per_tick[-1]] == [Tokens, Tokens, Finished]
    assert router.rank_of(reserved.request_id) is None
    rig.assert_all_free()
