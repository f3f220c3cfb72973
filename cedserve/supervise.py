"""`cedserve serve`'s supervisor: the embedded system keeps serving when one of its processes dies.

The launcher (cedserve/launcher.py) starts the parts; `EmbeddedSystem` then watches them:

- a worker that dies is started again with the same command line (a decode group of several ranks:
  all its ranks, at a fresh rendezvous port) and, once ready, registered with the router under its
  worker id at its new address (`WorkerRegistry.Register`, with the internal token), which replaces
  the dead entry; requests in flight on it have already failed with a status (the router sees the
  broken stream at once) or been placed elsewhere;
- a router that dies is started again on the same port, in front of the workers' current addresses;
- restarts back off (1 s, 2 s, 4 s, ... up to `RestartPolicy.max_backoff_s`) and are limited per
  part (`max_restarts` within `window_s`): past the limit the system stops with exit code 1;
- a router that exits with code 0 was drained (`cedserve drain`: it runs with `--exit-when-drained`)
  or stopped on purpose: the system stops cleanly, exit code 0, as on Ctrl-C.

Every restart is printed (stderr) with the exit code, the delay and the count; each start again with
the time it took to serve again.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cedserve.launcher import (
    TOKEN_FILE_NAME,
    EmbeddedOptions,
    LaunchError,
    LocalLauncher,
    Part,
    ProcessSpec,
    free_port,
    plan_workers,
    resolve_checkpoint,
    router_args,
    worker_memory_fractions,
    write_worker_config,
)

ROUTER = "router"


@dataclass(frozen=True)
class RestartPolicy:
    """How often a part may die and be started again."""

    max_restarts: int = 5
    """Restarts of one part within `window_s`; one more death stops the system (exit 1)."""
    window_s: float = 600.0
    backoff_s: float = 1.0
    """Delay before a part's first restart in the window; doubled for each further one."""
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(f"restart policy: need max_restarts >= 0, window_s > 0 and 0 <= backoff_s <= "
                             f"max_backoff_s, got {self}")


@dataclass
class RestartLedger:
    """Restarts per part in the policy's sliding window."""

    policy: RestartPolicy
    clock: Callable[[], float] = time.monotonic
    _times: dict[str, deque[float]] = field(default_factory=dict)

    def next_delay(self, name: str) -> float | None:
        """Record a restart of `name` now and return its delay; None when past the limit."""
        now = self.clock()
        times = self._times.setdefault(name, deque())
        while times and now - times[0] > self.policy.window_s:
            times.popleft()
        if len(times) >= self.policy.max_restarts:
            return None
        times.append(now)
        return min(self.policy.max_backoff_s, self.policy.backoff_s * 2.0 ** (len(times) - 1))

    def count(self, name: str) -> int:
        return len(self._times.get(name, ()))


def say(message: str) -> None:
    print(f"cedserve serve: {message}", file=sys.stderr, flush=True)


class EmbeddedSystem:
    """The embedded system's processes, started and kept running (module docstring)."""

    def __init__(self, opts: EmbeddedOptions, launcher: LocalLauncher, policy: RestartPolicy | None = None,
                 stop: threading.Event | None = None) -> None:
        self.opts = opts
        self.launcher = launcher
        self.ledger = RestartLedger(policy or RestartPolicy())
        self.checkpoint = resolve_checkpoint(opts)
        self.run_dir = launcher.log_dir / "run"
        self.configs = write_worker_config(self.run_dir, opts.device, config=opts.config,
                                           memory_fractions=worker_memory_fractions(opts))
        self.token = (self.run_dir / TOKEN_FILE_NAME).read_text().strip()
        self.specs = plan_workers(opts, self._rendezvous)
        self.parts: dict[str, Part] = {}
        self.addresses: dict[str, tuple[str, str]] = {}  # worker id -> (role, address) of its leader
        self.router_port = opts.port
        self.http_port = opts.http_port
        self.metrics: dict[str, str] = {}
        self.address = ""  # the router's, once started
        self.stop = stop or threading.Event()
        """Set to stop: supervision ends and a start in progress is abandoned (Ctrl-C, SIGTERM)."""

    def _rendezvous(self, group: int) -> tuple[str, int]:
        return self.opts.host, free_port(self.opts.host)

    def _ready_timeout_s(self) -> float:
        return 600.0 if self.opts.device == "cuda" else 180.0

    # ------------------------------------------------------------------ start

    def start(self) -> dict[str, Any]:
        """Every worker rank (together: the ranks of a decode group must meet), then the router;
        returns the router's ready info with every process's metrics URL under "metrics"."""
        self._start_workers(self.specs)
        router = self._start_router()
        return {**router, "metrics": dict(self.metrics)}

    def _start_workers(self, specs: list[ProcessSpec]) -> None:
        parts = [self.launcher.spawn(s.name, s.argv(self.checkpoint, str(self.run_dir)), dict(s.env)) for s in specs]
        for spec, part in zip(specs, parts):
            self.parts[spec.name] = part
        for spec, part in zip(specs, parts):  # every rank, followers included
            part.wait_ready(self._ready_timeout_s(), self.stop)
            self._note_metrics(spec.name, part.ready)
            if spec.rank == 0:
                self.addresses[spec.worker_id] = (spec.role, str(part.ready["address"]))

    def _start_router(self) -> dict[str, Any]:
        leaders = [(role, worker_id, address) for worker_id, (role, address) in self.addresses.items()]
        opts = replace(self.opts, port=self.router_port, http_port=self.http_port)
        args = [*router_args(opts, self.checkpoint, leaders, str(self.run_dir / TOKEN_FILE_NAME),
                             str(self.configs["router"])), "--exit-when-drained"]
        part = self.launcher.spawn(ROUTER, args)
        self.parts[ROUTER] = part
        ready = part.wait_ready(180.0, self.stop)
        self.router_port = int(ready["port"])  # port 0 asked: the restarted router takes the same one
        http_port = ready.get("http_port", -1)
        if isinstance(http_port, int) and http_port > 0:
            self.http_port = http_port
        self.address = str(ready["address"])
        self._note_metrics(ROUTER, ready)
        return ready

    def _note_metrics(self, name: str, ready: dict[str, Any]) -> None:
        port = ready.get("metrics_port", -1)
        if isinstance(port, int) and port > 0:
            self.metrics[name] = f"http://{self.opts.host}:{port}/metrics"

    # ------------------------------------------------------------------ supervise

    def supervise(self, poll_s: float = 0.1) -> int:
        """Watch the parts until `self.stop` is set (exit 0), a drained router exits (0), or a part
        dies more often than the policy allows (1)."""
        while not self.stop.wait(poll_s):
            dead = next(((name, part) for name, part in self.parts.items() if part.proc.poll() is not None), None)
            if dead is None:
                continue
            name, part = dead
            if name == ROUTER and part.proc.returncode == 0:
                say("the router has drained and exited; stopping the system")
                return 0
            if not self._restart(name, part):
                return 0 if self.stop.is_set() else 1
        return 0

    def _restart(self, name: str, part: Part) -> bool:
        """Start `name` (its whole decode group for a rank) again; False when the policy refuses or
        `self.stop` came first."""
        code = part.proc.returncode
        delay = self.ledger.next_delay(name)
        if delay is None:
            say(f"{name} exited with {code}, its {self.ledger.policy.max_restarts + 1}th death within "
                f"{self.ledger.policy.window_s:.0f} s; stopping the system. Its last log lines:\n" + "\n".join(part.tail))
            return False
        say(f"{name} exited with {code}; restarting it in {delay:.1f} s (restart {self.ledger.count(name)} of "
            f"{self.ledger.policy.max_restarts} within {self.ledger.policy.window_s:.0f} s). Its last log lines:\n"
            + "\n".join(list(part.tail)[-5:]))
        if self.stop.wait(delay):
            return False
        start = time.monotonic()
        try:
            if name == ROUTER:
                self._start_router()
            else:
                self._restart_worker(name)
        except LaunchError as exc:
            if self.stop.is_set():
                return False
            say(f"restarting {name} failed: {exc}")
            self._kill(name)  # dead or hung: the next poll starts it again, or gives up
            return True
        where = f"; metrics at {self.metrics[name]}" if name in self.metrics else ""
        say(f"{name} is serving again ({time.monotonic() - start:.1f} s after its restart began{where})")
        return True

    def _restart_worker(self, name: str) -> None:
        spec = next(s for s in self.specs if s.name == name)
        group = [s for s in self.specs if s.worker_id == spec.worker_id]
        if len(group) > 1:  # the group's collective is broken: every rank starts again, at a new rendezvous
            for s in group:
                self._kill(s.name)
            fresh = {s.name: s for s in plan_workers(self.opts, self._rendezvous)}
            group = [fresh[s.name] for s in group]
            self.specs = [fresh.get(s.name, s) if s.worker_id == spec.worker_id else s for s in self.specs]
        self._start_workers(group)
        role, address = self.addresses[spec.worker_id]
        self._register(role, spec.worker_id, address)

    def _kill(self, name: str) -> None:
        part = self.parts.get(name)
        if part is not None and part.proc.poll() is None:
            part.proc.kill()
            part.proc.wait(10)

    def _register(self, role: str, worker_id: str, address: str) -> None:
        """Tell the router the worker's new address (a router that is itself restarting learns it
        from its command line instead)."""
        import grpc

        from cedserve.router.lifecycle import register_workers

        router = self.parts.get(ROUTER)
        if router is None or router.proc.poll() is not None:
            return
        try:
            register_workers(self.address, [(worker_id, role, address)], timeout_s=10.0, token=self.token)
        except grpc.RpcError as exc:  # a router that went away meanwhile is restarted by the loop
            say(f"registering {worker_id} at {address} with the router failed: {exc}")


def serve_supervised(opts: EmbeddedOptions, policy: RestartPolicy | None = None, log_dir: Path | None = None) -> int:
    """`cedserve serve`: start everything here and keep it running until Ctrl-C, SIGTERM or a
    finished `cedserve drain` (exit 0), or until a part dies past the restart policy (exit 1)."""
    import signal

    from cedserve.launcher import cache_home

    launcher = LocalLauncher(log_dir or opts.log_dir or cache_home() / "logs")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        system = EmbeddedSystem(opts, launcher, policy, stop)
        router = system.start()
        address = router["address"]
        print(f"cedserve is serving on {address} (logs: {launcher.log_dir})", flush=True)
        print(f'try: cedserve generate "def fibonacci(" --address {address}', flush=True)
        http_port = router.get("http_port", -1)
        if isinstance(http_port, int) and http_port > 0:
            print(f"OpenAI-compatible HTTP API: http://{opts.host}:{http_port}/v1", flush=True)
        for name, url in router.get("metrics", {}).items():
            print(f"metrics of {name}: {url}", flush=True)
        ready = {"role": "system", "address": address, "http_port": http_port}
        print(f"CEDSERVE_READY {json.dumps(ready)}", flush=True)
        code = system.supervise()
        print("shutting down", flush=True)
        return code
    except LaunchError as exc:
        say(str(exc))
        return 1
    finally:
        launcher.stop_all()
