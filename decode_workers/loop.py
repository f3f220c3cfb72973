"""The engine loop of one rank, and the control plane that keeps a decode group's ranks in step.

Every rank runs `EngineLoop.tick` forever. One tick:

1. the leader takes the commands the gRPC service queued (when idle, waiting for the first command or
   a wake-up, `CommandInbox.wake`, at most `idle_wait_s`) and
   broadcasts them with the drain/stop flags (`TickCommands`); every rank applies those addressed to it;
2. every rank polls its transfers and leases;
3. the ranks agree whether any has work; if so every rank runs one `DecodeEngine.step` (an empty
   pass where it has none), whose MoE layers exchange tokens between the ranks;
4. every rank reports its outputs and load (`TickReport`); the leader hands them to the service.
   With `on_release`, the service holds the Decode streams' outputs until the next step has
   scheduled and starts its passes (or the tick ends with no work left): the streams' threads then
   run while this thread mostly waits on torch ops without the GIL, not during the step's
   Python-bound schedule and joins.

`GroupChannel` carries steps 1, 3 and 4: `LocalChannel` for a group of one (no communication: the
tick's commands and report stay Python objects, never encoded), `TorchChannel` over a
torch.distributed gloo group (CPU tensors, msgpack payloads) otherwise.

Each phase of a tick is timed into `cedserve_decode_loop_phase_seconds` (`metrics.LOOP_PHASES`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from cedserve.decode_workers.engine import DecodeEngine
from cedserve.decode_workers.messages import (
    Command,
    TickCommands,
    TickReport,
    decode_tick_commands,
    decode_tick_report,
    encode,
)

log = logging.getLogger(__name__)


class GroupChannel(Protocol):
    """Control-plane collectives of a decode group. Every rank calls each method once per tick, in order."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def broadcast(self, data: bytes | None) -> bytes:
        """The leader's `data` on every rank (the leader passes it, the others None)."""
        ...

    def agree(self, value: int) -> int:
        """The largest `value` any rank passed."""
        ...

    def gather(self, data: bytes) -> list[bytes] | None:
        """Every rank's `data`, in rank order, on the leader; None elsewhere."""
        ...


class LocalChannel:
    """A group of one."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def broadcast(self, data: bytes | None) -> bytes:
        assert data is not None
        return data

    def agree(self, value: int) -> int:
        return value

    def gather(self, data: bytes) -> list[bytes] | None:
        return [data]


class TorchChannel:
    """Collectives over a gloo process group (`group`, default the world)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self._group = group
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def broadcast(self, data: bytes | None) -> bytes:
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.long)
        dist.broadcast(size, src=0, group=self._group)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8)
        if int(size):
            dist.broadcast(buf, src=0, group=self._group)
        return bytes(buf.numpy().tobytes())

    def agree(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return int(t.item())

    def gather(self, data: bytes) -> list[bytes] | None:
        size = torch.tensor([len(data)], dtype=torch.long)
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self._world)]
        dist.all_gather(sizes, size, group=self._group)
        longest = max(int(s) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
        parts = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self._world)]
        dist.all_gather(parts, buf, group=self._group)
        if self._rank != 0:
            return None
        return [bytes(p[: int(s)].numpy().tobytes()) for p, s in zip(parts, sizes)]


class CommandInbox:
    """Commands from the gRPC threads to the leader's loop, and wake-ups from any thread (thread-safe)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Command | None] = queue.SimpleQueue()  # None: a wake-up

    def put(self, cmd: Command) -> None:
        self._queue.put(cmd)

    def wake(self) -> None:
        """End the loop's idle wait now (news for `DecodeEngine.poll`, such as a finished transfer)."""
        self._queue.put(None)

    def take(self, wait_s: float) -> list[Command]:
        """Everything queued; waits up to `wait_s` for the first command or wake-up when there is none."""
        items: list[Command | None] = []
        try:
            items.append(self._queue.get(timeout=wait_s) if wait_s > 0 else self._queue.get_nowait())
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return [cmd for cmd in items if cmd is not None]


class EngineLoop:
    """Drives one rank's engine (see the module docstring). `on_report` (leader) gets every rank's
    `TickReport` each tick."""

    def __init__(self, engine: DecodeEngine, channel: GroupChannel, inbox: CommandInbox | None = None,
                 on_report: Callable[[list[TickReport]], None] | None = None,
                 on_release: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.channel = channel
        self.inbox = inbox if inbox is not None else CommandInbox()
        if self.leader:
            # a transfer that ends while the loop idles is applied at once, not at the next idle tick
            # (other ranks wait in the leader's broadcast: `idle_wait_s` bounds how late they see theirs)
            engine.leases.on_result = self.inbox.wake
        self.on_report = on_report
        self.on_release = on_release
        """Hands the outputs `on_report` held to their streams (module docstring, step 4)."""
        if self.leader and on_release is not None:
            engine.on_passes = on_release
        self.draining = False
        self.stop_requested = False
        self.last_tick_s = time.monotonic()
        self.error: BaseException | None = None
        self.on_failure: Callable[[BaseException], None] | None = None
        """Called with the exception when the loop fails (the leader's output router fails every
        waiting call with it, so none waits for outputs that will never come)."""
        self.lock = threading.Lock()
        """Held while the engine runs; other threads hold it to read the engine's cache safely."""

    @property
    def leader(self) -> bool:
        return self.channel.rank == 0

    def tick(self) -> bool:
        """One tick; False once the group stops."""
        phases = self.engine.metrics.phases
        tick, t = self._commands()
        self.engine.draining = tick.draining
        outputs = []
        with self.lock:
            for cmd in tick.commands:
                if cmd.rank == self.channel.rank:
                    outputs.extend(self.engine.handle(cmd))
            t = phases.lap("commands", t)
            outputs.extend(self.engine.poll())
            work = int(self.engine.has_work())
        work = self.channel.agree(work)
        t = phases.lap("poll", t)
        if work:
            with self.lock:
                outputs.extend(self.engine.step())  # its phases are timed inside
            t = time.perf_counter()
        self._release()  # the last tick's outputs, had the step not released them
        self._report(TickReport(outputs, self.engine.publish_load()))
        if not self.engine.has_work():  # no next step to release them: the stream's last token, or idle
            self._release()
        phases.lap("report", t)
        self.last_tick_s = time.monotonic()
        return not tick.stop

    def _release(self) -> None:
        if self.on_release is not None and self.leader:
            self.on_release()

    def _commands(self) -> tuple[TickCommands, float]:
        """This tick's commands, and when the idle wait for them ended (the `commands` phase's start)."""
        if not self.leader:
            return decode_tick_commands(self.channel.broadcast(None)), time.perf_counter()
        idle = not self.engine.has_work()
        start = time.perf_counter()
        commands = self.inbox.take(self.engine.config.idle_wait_s if idle else 0.0)
        if idle:
            start = self.engine.metrics.phases.lap("idle_wait", start)
        tick = TickCommands(commands, self.draining, self.stop_requested)
        if self.channel.world_size > 1:
            self.channel.broadcast(encode(tick))
        return tick, start

    def _report(self, report: TickReport) -> None:
        """Every rank's report to the leader's `on_report` (a group of one hands its own over as is)."""
        if self.channel.world_size == 1:
            if self.on_report is not None:
                self.on_report([report])
            return
        gathered = self.channel.gather(encode(report))
        if gathered is not None and self.on_report is not None:
            self.on_report([decode_tick_report(g) for g in gathered])

    def run(self) -> None:
        """Tick until the leader says stop; a failure is kept in `error` and ends the loop."""
        try:
            while self.tick():
                pass
        except BaseException as exc:
            self.error = exc
            log.exception("decode engine loop of rank %d failed", self.channel.rank)
            if self.on_failure is not None:
                self.on_failure(exc)
            raise

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name=f"decode-engine-{self.channel.rank}", daemon=True)
        thread.start()
        return thread
