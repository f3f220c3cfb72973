"""`cedserve serve --ray ADDRESS`: the system's processes as Ray actors, restarted when they fail.

What runs is planned by the local launcher's code (`plan_workers`, `router_args` in
cedserve/launcher.py): the same `cedserve worker` and `cedserve router` command lines. Each process
is owned by one `ProcessActor`, which starts it as a child (so a worker is exactly the process the
local launcher and the Helm chart run, with its own signal handling, drain and logs) and dies with
it: the actor exits when its child exits, and the child gets SIGKILL when the actor dies
(PR_SET_PDEATHSIG), so Ray's restart of the actor (`max_restarts`) is a restart of the process.

Placement: one placement group for the prefill pool with one bundle per worker, and one per decode
group (its expert-parallel ranks, STRICT_PACK on one node) with one bundle per rank. A bundle is
one GPU (plus `cpus_per_worker` CPUs) when the workers run on `cuda`, else `cpus_per_worker` CPUs.
The router actor needs no GPU and takes no bundle.

Re-registration: a restarted actor's process listens on a new port (and maybe a new node). The
driver polls every actor's `status` (`RaySystem.supervise`); when a worker leader comes back it
tells the router through the router actor, which calls `WorkerRegistry.Register` on its own
router over loopback (router/lifecycle.py): the router's pool moves the worker to its new address.
When the router actor itself restarts, every leader is registered again. When any rank of a decode
group of several ranks restarts, the driver restarts the group's other ranks, so the group meets
again (one rank cannot rejoin a running expert-parallel group).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cedserve.launcher import (
    TOKEN_FILE_NAME,
    EmbeddedOptions,
    LaunchError,
    Part,
    ProcessSpec,
    cache_home,
    plan_workers,
    resolve_checkpoint,
    router_args,
    write_worker_config,
)
from cedserve.local_ranks import CHILD_TRAMPOLINE  # the child dies with the actor that started it

log = logging.getLogger(__name__)
_DEAD_FOR_GOOD_S = 10.0


@dataclass(frozen=True)
class RayOptions:
    address: str = "auto"
    """Ray cluster: `auto` (the running cluster), `ray://host:10001`, `host:6379`, or `local` (start
    a cluster in this process). Ignored when Ray is already initialised."""
    device: str = "auto"
    """Workers' device: `cuda`, `cpu`, or `auto` (cuda when the cluster has a GPU per rank)."""
    cpus_per_worker: float = 1.0
    """CPUs in each worker's bundle."""
    router_cpus: float = 1.0
    max_restarts: int = 3
    """Restarts of each actor before the system gives up."""
    ready_timeout_s: float = 600.0
    """Longest wait for a process's ready line (model loading)."""
    run_dir: str = ""
    """Folder on every node for the workers' config and token files ("": the node's temp dir)."""

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"ray field `device`: auto, cpu or cuda, got {self.device!r}")
        if self.cpus_per_worker <= 0 or self.router_cpus <= 0:
            raise ValueError("ray fields `cpus_per_worker` and `router_cpus` must be > 0")
        if self.max_restarts < 0:
            raise ValueError(f"ray field `max_restarts`: must be >= 0, got {self.max_restarts}")


@dataclass(frozen=True)
class ActorSetup:
    """What a `ProcessActor` needs besides its spec, the same for every actor of a system."""

    checkpoint: str | None
    """An explicit folder (must be readable on every node), or None: the preset's, written per node."""
    preset: str
    device: str
    token: str
    """The system's shared secret: the KV-transfer control plane's and the worker plane's."""
    run_dir: str
    log_dir: str
    config: dict[str, Any] = field(default_factory=dict)
    """The `cedserve serve --config` file's contents (`launcher.write_worker_config`)."""


class ProcessActor:
    """Owns one cedserve process (made a Ray actor by `RaySystem`). Exits when its process exits."""

    def __init__(self, spec: ProcessSpec, setup: ActorSetup) -> None:
        import ray

        self.spec = spec
        self.token = setup.token  # the router's registry requires it
        self.incarnation = uuid.uuid4().hex[:12]
        self.node_ip = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        self._stopping = False
        checkpoint = setup.checkpoint or resolve_checkpoint(EmbeddedOptions(preset=setup.preset))
        run_dir = Path(setup.run_dir) / spec.name  # one folder per process: restarts rewrite only their own
        write_worker_config(run_dir, setup.device, setup.token, setup.config)  # the router sends the token
        args = spec.argv(checkpoint, str(run_dir))
        if spec.role != "router" and "0.0.0.0" in args:  # peers and the router dial this node's address
            args += ["--advertise-host", self.node_ip]
        log_dir = Path(setup.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{spec.name}.log"
        started = threading.Event()
        self.part: Part | None = None
        # The thread that starts the child also waits for it: PDEATHSIG fires when the starting
        # *thread* ends, so it must live exactly as long as the child.
        threading.Thread(target=self._own, args=(args, dict(spec.env), started), daemon=True,
                         name=f"own-{spec.name}").start()
        started.wait()

    def _own(self, args: list[str], env: dict[str, str], started: threading.Event) -> None:
        argv = [sys.executable, "-c", CHILD_TRAMPOLINE, str(os.getpid()), *args]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, start_new_session=True)
        self.part = Part(self.spec.name, proc, self.log_path)
        log_file = self.log_path.open("a")
        threading.Thread(target=self.part.pump, args=(log_file,), daemon=True).start()
        started.set()
        code = proc.wait()
        if not self._stopping:
            print(f"{self.spec.name}: process exited with {code}; ending the actor so Ray restarts it. Last lines:\n"
                  + "\n".join(self.part.tail), file=sys.stderr, flush=True)
            os._exit(1)

    def status(self) -> dict[str, Any]:
        """Incarnation, pid, and the ready line's fields once ready (address made dialable)."""
        assert self.part is not None
        ready = dict(self.part.ready)
        if ready.get("address", "").startswith("0.0.0.0:"):
            ready["address"] = f"{self.node_ip}:{ready['address'].rsplit(':', 1)[1]}"
        return {"name": self.spec.name, "incarnation": self.incarnation, "pid": self.part.proc.pid,
                "node_ip": self.node_ip, "ready": ready, "exit_code": self.part.proc.poll()}

    def register(self, workers: list[tuple[str, str, str]]) -> list[str]:
        """Router actor only: (worker id, role, address) into the router's pool; the ids changed."""
        from cedserve.router.lifecycle import register_workers

        assert self.part is not None and self.part.ready, "the router is not ready yet"
        return register_workers(f"127.0.0.1:{self.part.ready['port']}", workers, token=self.token)

    def list_workers(self) -> list[dict[str, Any]]:
        """Router actor only: the router's pool."""
        from cedserve.router.lifecycle import list_workers

        assert self.part is not None and self.part.ready, "the router is not ready yet"
        return list_workers(f"127.0.0.1:{self.part.ready['port']}", token=self.token)

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM (the process drains), SIGKILL after `grace_s`; the exit code."""
        assert self.part is not None
        self._stopping = True
        proc = self.part.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(5)


@dataclass
class _Tracked:
    spec: ProcessSpec
    actor: Any
    incarnation: str = ""
    address: str = ""
    pid: int = 0
    dead_since: float | None = None


@dataclass
class _GroupRestart:
    """A decode group being restarted as a whole: the incarnations its ranks had when it began."""

    before: dict[str, str] = field(default_factory=dict)


class RaySystem:
    """The system on a Ray cluster: `start`, then `supervise` periodically, then `stop`."""

    def __init__(self, opts: EmbeddedOptions, ray_opts: RayOptions) -> None:
        try:
            import ray
        except ImportError as exc:
            raise ImportError("`cedserve serve --ray` needs Ray: pip install 'cedserve[ray]'") from exc
        self.ray: Any = ray
        self.opts, self.ray_opts = opts, ray_opts
        self.owns_ray = False
        self.workers: dict[str, _Tracked] = {}
        self.router: _Tracked | None = None
        self.placement_groups: list[Any] = []
        self._pg_of: dict[str, tuple[Any, int]] = {}
        self._pending: dict[str, tuple[str, str]] = {}  # worker id -> (role, address) to register
        self._group_restarts: dict[int, _GroupRestart] = {}
        self.events: list[str] = []

    # ------------------------------------------------------------------ start

    def start(self) -> dict[str, Any]:
        """Place and start every worker, then the router; returns the router's ready fields."""
        ray = self.ray
        if not ray.is_initialized():
            if self.ray_opts.address == "local":  # logical CPUs: enough for every actor of the system
                needed = self.opts.num_ranks * self.ray_opts.cpus_per_worker + self.ray_opts.router_cpus
                ray.init(num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)), include_dashboard=False,
                         logging_level="warning")
            else:
                try:
                    ray.init(address=self.ray_opts.address, include_dashboard=False, logging_level="warning")
                except ConnectionError as exc:
                    raise LaunchError(f"no Ray cluster at {self.ray_opts.address!r} ({exc}); start one with "
                                      "`ray start --head`, or serve with `--ray local`") from exc
            self.owns_ray = True
        device = self._device()
        self.opts = replace(self.opts, device=device, gpus=())
        self._check_resources(device)
        resolve_checkpoint(self.opts)  # fail here, not in every actor, when it cannot be had
        setup = ActorSetup(str(self.opts.checkpoint) if self.opts.checkpoint else None, self.opts.preset, device,
                           uuid.uuid4().hex + uuid.uuid4().hex,
                           self.ray_opts.run_dir or str(Path(tempfile.gettempdir()) / f"cedserve-ray-{os.getpid()}"),
                           str((self.opts.log_dir or cache_home() / "logs") / "ray"), dict(self.opts.config))
        self._place(device)
        specs = plan_workers(self.opts, self._rendezvous, assign_gpus=False)
        for spec in specs:
            self.workers[spec.name] = _Tracked(spec, self._actor(spec, setup))
        for tracked in self.workers.values():
            self._wait_ready(tracked)
        leaders = [(t.spec.role, t.spec.worker_id, t.address) for t in self.workers.values() if t.spec.rank == 0]
        args = router_args(self.opts, "{checkpoint}", leaders, f"{{run_dir}}/{TOKEN_FILE_NAME}",
                           "{run_dir}/router.toml")
        spec = ProcessSpec("router", "router", "", 0, 0, tuple(args))
        self.router = _Tracked(spec, self._actor(spec, setup))
        return self._wait_ready(self.router)

    def _device(self) -> str:
        if self.ray_opts.device != "auto":
            return self.ray_opts.device
        gpus = self.ray.cluster_resources().get("GPU", 0)
        return "cuda" if gpus >= self.opts.num_ranks else "cpu"

    def _check_resources(self, device: str) -> None:
        """A clear error up front instead of actors that wait for resources forever."""
        have = self.ray.cluster_resources()
        need = {"CPU": self.opts.num_ranks * self.ray_opts.cpus_per_worker + self.ray_opts.router_cpus}
        if device == "cuda":
            need["GPU"] = self.opts.num_ranks
        short = {k: v for k, v in need.items() if have.get(k, 0) < v}
        if short:
            raise LaunchError(f"the Ray cluster has {({k: have.get(k, 0) for k in need})}, the system needs {need} "
                              f"({self.opts.num_ranks} worker ranks and the router): add nodes, or lower "
                              "--ray-cpus-per-worker")

    def _bundle(self, device: str) -> dict[str, float]:
        cpus = {"CPU": self.ray_opts.cpus_per_worker}
        return {**cpus, "GPU": 1} if device == "cuda" else cpus

    def _place(self, device: str) -> None:
        from ray.util.placement_group import placement_group

        groups: list[tuple[list[str], str]] = []
        if self.opts.num_prefill:
            groups.append(([f"prefill{i}" for i in range(self.opts.num_prefill)], "PACK"))
        for i in range(self.opts.num_decode):
            groups.append(([f"decode{i}" if r == 0 else f"decode{i}-r{r}" for r in range(self.opts.decode_group_size)],
                           "STRICT_PACK"))
        for names, strategy in groups:
            pg = placement_group([self._bundle(device) for _ in names], strategy=strategy)
            self.placement_groups.append(pg)
            for k, name in enumerate(names):
                self._pg_of[name] = (pg, k)
        for pg in self.placement_groups:
            try:
                self.ray.get(pg.ready(), timeout=self.ray_opts.ready_timeout_s)
            except self.ray.exceptions.GetTimeoutError:
                raise LaunchError(f"the Ray cluster cannot place {pg.bundle_specs} ({self.ray.available_resources()} "
                                  "free): add nodes, or lower --cpus-per-worker / the worker counts") from None

    def _rendezvous(self, group: int) -> tuple[str, int]:
        """A free port on the node of decode group `group`'s bundle 0 (its leader's node)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg, _ = self._pg_of[f"decode{group}"]
        probe = self.ray.remote(num_cpus=0)(_node_port).options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0))
        host, port = self.ray.get(probe.remote())
        return str(host), int(port)

    def _actor(self, spec: ProcessSpec, setup: ActorSetup) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = self.ray.remote(ProcessActor)
        if spec.role == "router":
            options: dict[str, Any] = {"num_cpus": self.ray_opts.router_cpus}
        else:
            pg, bundle = self._pg_of[spec.name]
            options = {"num_cpus": self.ray_opts.cpus_per_worker, "num_gpus": 1 if setup.device == "cuda" else 0,
                       "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)}
        return remote.options(name=None, max_restarts=self.ray_opts.max_restarts, max_concurrency=1,
                              **options).remote(spec, setup)

    def _wait_ready(self, tracked: _Tracked) -> dict[str, Any]:
        deadline = time.monotonic() + self.ray_opts.ready_timeout_s
        while True:
            status = self._status(tracked)
            if status is not None and status["ready"]:
                tracked.incarnation, tracked.pid = status["incarnation"], int(status["pid"])
                tracked.address = str(status["ready"]["address"])
                return dict(status["ready"])
            if time.monotonic() > deadline:
                raise LaunchError(f"{tracked.spec.name} not ready after {self.ray_opts.ready_timeout_s:.0f} s "
                                  f"(its log: the actor's node, {tracked.spec.name}.log)")
            time.sleep(0.2)

    def _status(self, tracked: _Tracked, timeout_s: float = 5.0) -> dict[str, Any] | None:
        """The actor's status; None while it restarts; `LaunchError` once it is dead for good."""
        ray = self.ray
        try:
            status: dict[str, Any] = ray.get(tracked.actor.status.remote(), timeout=timeout_s)
        except ray.exceptions.ActorDiedError as exc:
            # A call caught by the death itself also reads "died": only a death that lasts is final.
            tracked.dead_since = tracked.dead_since or time.monotonic()
            if time.monotonic() - tracked.dead_since > _DEAD_FOR_GOOD_S:
                raise LaunchError(f"{tracked.spec.name} died for good (restarts: {self.ray_opts.max_restarts}): "
                                  f"{exc}") from exc
            return None
        except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
            return None
        tracked.dead_since = None
        return status

    # ------------------------------------------------------------------ supervise

    def supervise(self) -> list[str]:
        """One pass: notice restarted actors, restart the rest of a broken decode group, and register
        restarted leaders with the router. Returns what happened, one line each."""
        events: list[str] = []
        for tracked in self.workers.values():
            status = self._status(tracked)
            if status is None or status["incarnation"] == tracked.incarnation or not status["ready"]:
                continue
            old = tracked.address
            tracked.incarnation, tracked.pid = status["incarnation"], int(status["pid"])
            tracked.address = str(status["ready"]["address"])
            events.append(f"{tracked.spec.name} restarted: {old} -> {tracked.address}")
            self._on_rank_restart(tracked, events)
        self._finish_group_restarts()
        assert self.router is not None
        status = self._status(self.router)
        if status is not None and status["ready"] and status["incarnation"] != self.router.incarnation:
            self.router.incarnation, self.router.pid = status["incarnation"], int(status["pid"])
            self.router.address = str(status["ready"]["address"])
            events.append(f"router restarted at {self.router.address}; registering every worker again")
            for t in self.workers.values():
                if t.spec.rank == 0:
                    self._pending[t.spec.worker_id] = (t.spec.role, t.address)
        if self._pending and status is not None and status["ready"]:
            workers = [(wid, role, address) for wid, (role, address) in sorted(self._pending.items())]
            self.ray.get(self.router.actor.register.remote(workers), timeout=30)
            events += [f"registered {wid} ({role}) at {address} with the router" for wid, role, address in workers]
            self._pending.clear()
        self.events += events
        return events

    def _on_rank_restart(self, tracked: _Tracked, events: list[str]) -> None:
        spec = tracked.spec
        if spec.role == "decode" and self.opts.decode_group_size > 1:
            if spec.group not in self._group_restarts:
                ranks = [t for t in self.workers.values() if t.spec.role == "decode" and t.spec.group == spec.group]
                self._group_restarts[spec.group] = _GroupRestart({t.spec.name: t.incarnation for t in ranks
                                                                  if t is not tracked})
                for t in ranks:
                    if t is not tracked:  # they cannot rejoin without it: restart the whole group
                        self.ray.kill(t.actor, no_restart=False)
                events.append(f"decode group {spec.group}: restarting its other ranks so the group meets again")
            return
        self._pending[spec.worker_id] = (spec.role, tracked.address)

    def _finish_group_restarts(self) -> None:
        for group, restart in list(self._group_restarts.items()):
            ranks = {t.spec.name: t for t in self.workers.values() if t.spec.role == "decode" and t.spec.group == group}
            if all(ranks[name].incarnation != inc for name, inc in restart.before.items()):
                leader = ranks[f"decode{group}"]
                self._pending[leader.spec.worker_id] = ("decode", leader.address)
                del self._group_restarts[group]

    def router_workers(self) -> list[dict[str, Any]]:
        assert self.router is not None
        workers: list[dict[str, Any]] = self.ray.get(self.router.actor.list_workers.remote(), timeout=30)
        return workers

    # ------------------------------------------------------------------ stop

    def stop(self, grace_s: float = 30.0) -> None:
        """Router first (it drains), then the workers; then the actors and placement groups go."""
        from ray.util.placement_group import remove_placement_group

        ray = self.ray
        actors = [t.actor for t in ([self.router] if self.router else [])]
        with contextlib.suppress(ray.exceptions.RayError):
            if self.router is not None:
                ray.get(self.router.actor.stop.remote(grace_s), timeout=grace_s + 10)
        stops = [t.actor.stop.remote(grace_s) for t in self.workers.values()]
        for ref in stops:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(ref, timeout=grace_s + 10)
        for actor in [*actors, *(t.actor for t in self.workers.values())]:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(actor, no_restart=True)
        for pg in self.placement_groups:
            with contextlib.suppress(ray.exceptions.RayError):
                remove_placement_group(pg)
        if self.owns_ray:
            ray.shutdown()


def _node_port() -> tuple[str, int]:
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        return str(ray.util.get_node_ip_address()), int(s.getsockname()[1])  # type: ignore[no-untyped-call]


def serve_ray(opts: EmbeddedOptions, ray_opts: RayOptions, poll_s: float = 1.0) -> int:
    """`cedserve serve --ray`: start, keep actors registered, stop on Ctrl-C/SIGTERM."""
    system = RaySystem(opts, ray_opts)
    stop = threading.Event()
    try:
        router = system.start()  # Ctrl-C here: KeyboardInterrupt, and `finally` still cleans up
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        address = router["address"]
        print(f"cedserve is serving on {address} (Ray; {len(system.workers)} worker ranks as actors, "
              f"device {system.opts.device})", flush=True)
        print(f'try: cedserve generate "def fibonacci(" --address {address}', flush=True)
        http_port = router.get("http_port", -1)
        if isinstance(http_port, int) and http_port > 0:  # on the router actor's node, like the gRPC port
            print(f"OpenAI-compatible HTTP API: http://{address.rsplit(':', 1)[0]}:{http_port}/v1", flush=True)
        print(f"CEDSERVE_READY {{\"role\": \"system\", \"address\": \"{address}\"}}", flush=True)
        while not stop.wait(poll_s):
            for event in system.supervise():
                print(event, flush=True)
        print("shutting down", flush=True)
        return 0
    except LaunchError as exc:
        print(f"cedserve serve --ray: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        system.stop()
