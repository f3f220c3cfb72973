"""`cedserve worker --role decode --local-ranks N`: N ranks of a decode group in one pod, one GPU each.

A decode group's ranks exchange tokens at every MoE layer. Ranks in separate pods reach each other
over the network (or RDMA) even on one node; ranks in one pod share its IPC namespace, so NCCL can
use NVLink between them. This supervisor turns one pod (or host) into N ranks: it starts N
`cedserve worker` processes with the pod's flags, except that

* local rank `i` of the pod at group rank `r` (`--rank`, the pod's index in its group) is group rank
  `r x N + i`, and the group has `--group-size x N` ranks;
* its ports are the pod's plus `i` (`--grpc-port`, `--nixl-port`, `--metrics-port`, `--health-port`;
  0 and -1 keep their meaning: any port, none), so local rank 0 answers on the pod's own ports: the
  probes, the preStop drain and, in the group's first pod, the router;
* it sees one GPU: the `i`-th of the pod's `CUDA_VISIBLE_DEVICES` (else GPU `i`);
* without `--leader-address` (a one-pod group) the leader is local rank 0, on loopback.

Children die with the supervisor (PR_SET_PDEATHSIG). SIGTERM and SIGINT are passed on to every
child (each drains as a worker does; the leader ends the group). When one child exits, the others
get SIGTERM, then SIGKILL after `STOP_GRACE_S`; the supervisor exits with the first non-zero code,
so the pod restarts and the group forms again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import fields, replace

from cedserve.serving.worker import WorkerOptions

# Runs in the child before `cedserve`: die with the supervisor (PR_SET_PDEATHSIG = 1), and not
# outlive a parent that died before the call. PDEATHSIG survives execve.
CHILD_TRAMPOLINE = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))\n"
    "os.getppid() == int(sys.argv[1]) or os._exit(1)\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'cedserve.cli', *sys.argv[2:]])\n"
)
STOP_GRACE_S = 300.0
"""How long the others may drain after one child exited, before SIGKILL."""


def local_rank_options(opts: WorkerOptions, local_ranks: int, index: int) -> WorkerOptions:
    """The flags of local rank `index` of `local_ranks` in the pod `opts` describes."""
    if opts.role != "decode":
        raise ValueError("--local-ranks: only decode groups have ranks (prefill runs one worker per GPU)")
    if not 0 <= index < local_ranks:
        raise ValueError(f"--local-ranks: index {index} is not in [0, {local_ranks})")

    def port(value: int) -> int:
        return value + index if value > 0 else value

    leader = opts.leader_address or ("127.0.0.1" if opts.group_size == 1 else None)
    return replace(opts, rank=opts.rank * local_ranks + index, group_size=opts.group_size * local_ranks,
                   grpc_port=port(opts.grpc_port), nixl_port=port(opts.nixl_port),
                   metrics_port=port(opts.metrics_port), health_port=port(opts.health_port), leader_address=leader)


_FLAGS = {"config": "--config", "checkpoint": "--checkpoint", "preset": "--preset", "seed": "--seed",
          "host": "--host", "grpc_port": "--grpc-port", "nixl_port": "--nixl-port",
          "metrics_port": "--metrics-port", "dist_port": "--dist-port", "advertise_host": "--advertise-host",
          "group_size": "--group-size", "rank": "--rank", "leader_address": "--leader-address",
          "worker_id": "--worker-id", "health_port": "--health-port", "tls_cert": "--tls-cert",
          "tls_key": "--tls-key", "tls_ca": "--tls-ca", "tls_server_name": "--tls-server-name"}


def worker_argv(opts: WorkerOptions) -> list[str]:
    """`cedserve worker` arguments that parse back to `opts`."""
    argv = ["worker", "--role", opts.role]
    for f in fields(opts):
        value = getattr(opts, f.name)
        if f.name == "role" or value is None:
            continue
        if f.name == "tls_require_client_cert":
            argv += ["--tls-require-client-cert"] if value else []
            continue
        argv += [_FLAGS[f.name], str(value)]
    return argv


def child_env(index: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Local rank `index`'s environment: one GPU, the `index`-th the pod was given."""
    env = dict(os.environ if environ is None else environ)
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible and index >= len(visible):
        raise ValueError(f"--local-ranks: rank {index} has no GPU: CUDA_VISIBLE_DEVICES lists {len(visible)}")
    env["CUDA_VISIBLE_DEVICES"] = visible[index] if visible else str(index)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_local_ranks(opts: WorkerOptions, local_ranks: int) -> int:
    """Start the pod's ranks and supervise them (see the module docstring); returns the exit code."""
    plans = [worker_argv(local_rank_options(opts, local_ranks, i)) for i in range(local_ranks)]
    envs = [child_env(i) for i in range(local_ranks)]
    children: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()

    def forward(signum: int, _frame: object) -> None:
        stop.set()
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for argv, env in zip(plans, envs):
            children.append(subprocess.Popen([sys.executable, "-c", CHILD_TRAMPOLINE, str(os.getpid()), *argv],
                                             env=env))
        return _supervise(children, stop)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for child in children:
            if child.poll() is None:
                child.kill()


def _supervise(children: Sequence[subprocess.Popen[bytes]], stop: threading.Event) -> int:
    """Wait for the first child to exit; then stop the others (SIGTERM unless a stop was already
    passed on, which they are serving; SIGKILL after the grace). A signal's death counts as 128 + it."""
    while all(c.poll() is None for c in children):
        time.sleep(0.2)
    first = next(c for c in children if c.poll() is not None)
    if not stop.is_set():
        if first.returncode != 0:
            print(f"cedserve worker: local rank {children.index(first)} exited with {first.returncode}; "
                  "stopping the pod's other ranks", file=sys.stderr, flush=True)
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    codes = [c.returncode if c.returncode >= 0 else 128 - c.returncode for c in children]
    return codes[children.index(first)] or next((c for c in codes if c), 0)
