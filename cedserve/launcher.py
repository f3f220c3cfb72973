"""Start the whole system as local processes: one prefill worker, one decode worker, the router.

Each part is a real process speaking real gRPC (and NIXL between the workers), started with the
same command lines the Helm chart uses (`cedserve worker ...`, `cedserve router ...`). A process
is ready when it prints `CEDSERVE_READY {json}`; the launcher waits for that line (or the process's
death, reported with its last log lines), then starts the next. Shutdown sends SIGTERM to all,
router first, and SIGKILL to any that outlive the grace period. Logs go to `<log_dir>/<name>.log`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from cedserve.serving import parse_ready_line

TINY_CHECKPOINT_VERSION = "tiny-random-v1"


class LaunchError(RuntimeError):
    """A part did not become ready; the message carries its last log lines."""


def cache_home() -> Path:
    """Where first-use artefacts go: `$CEDSERVE_HOME`, else `$XDG_CACHE_HOME/cedserve`, else ~/.cache/cedserve."""
    if os.environ.get("CEDSERVE_HOME"):
        return Path(os.environ["CEDSERVE_HOME"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cedserve"


def ensure_tiny_checkpoint(home: Path | None = None) -> Path:
    """The embedded default's checkpoint: a tiny real-format one, written on first use."""
    folder = (home or cache_home()) / "checkpoints" / TINY_CHECKPOINT_VERSION
    if (folder / "model.safetensors").is_file() and (folder / "config.json").is_file():
        return folder
    from cedserve.model.checkpoint_writer import write_random_checkpoint
    from cedserve.model.presets import preset

    print(f"writing a tiny random checkpoint to {folder} (first use)", file=sys.stderr, flush=True)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    write_random_checkpoint(preset("tiny"), tmp, seed=0)
    if folder.exists():  # another process finished first; keep its copy
        import shutil

        shutil.rmtree(tmp)
    else:
        tmp.replace(folder)
    return folder


@dataclass
class Part:
    """One started process."""

    name: str
    proc: subprocess.Popen[str]
    log_path: Path
    ready: dict[str, Any] = field(default_factory=dict)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    _ready_event: threading.Event = field(default_factory=threading.Event)

    def pump(self, log: TextIO) -> None:
        """Copy the process's output to its log, watching for the ready line."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            log.write(line)
            log.flush()
            self.tail.append(line.rstrip())
            info = parse_ready_line(line)
            if info is not None and not self._ready_event.is_set():
                self.ready = info
                self._ready_event.set()
        self._ready_event.set()  # exited: wake the waiter

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        if not self._ready_event.wait(timeout_s) or not self.ready:
            code = self.proc.poll()
            state = f"exited with {code}" if code is not None else f"not ready after {timeout_s:.0f} s"
            raise LaunchError(f"{self.name} {state}; its log {self.log_path} ends with:\n" + "\n".join(self.tail))
        return self.ready


class LocalLauncher:
    """Starts parts as child processes and stops them all, whatever happens."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.parts: list[Part] = []

    def start(self, name: str, args: Sequence[str], env: dict[str, str] | None = None,
              ready_timeout_s: float = 180.0) -> dict[str, Any]:
        argv = [sys.executable, "-m", "cedserve.cli", *args]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                                start_new_session=True)
        part = Part(name, proc, self.log_dir / f"{name}.log")
        log = part.log_path.open("a")
        threading.Thread(target=part.pump, args=(log,), daemon=True, name=f"log-{name}").start()
        self.parts.append(part)
        return part.wait_ready(ready_timeout_s)

    def first_exit(self) -> Part | None:
        return next((p for p in self.parts if p.proc.poll() is not None), None)

    def stop_all(self, grace_s: float = 10.0) -> None:
        for part in reversed(self.parts):  # router first, then decode, then prefill
            if part.proc.poll() is None:
                part.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for part in reversed(self.parts):
            try:
                part.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(part.proc.pid, signal.SIGKILL)
                part.proc.wait(5)


@dataclass(frozen=True)
class EmbeddedOptions:
    checkpoint: Path | None = None
    """None: the tiny checkpoint written on first use."""
    host: str = "127.0.0.1"
    port: int = 50051
    """Public gRPC port of the router."""
    log_dir: Path | None = None
    """None: `<cache home>/logs`."""
    default_max_tokens: int = 64


def write_worker_config(run_dir: Path) -> Path:
    """A worker config whose KV-transfer control plane uses a fresh random token (file mode 0600)."""
    import secrets

    run_dir.mkdir(parents=True, exist_ok=True)
    token = run_dir / "kv_transfer.token"
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    config = run_dir / "worker.toml"
    config.write_text(f'[kv_transfer]\nauth_token_file = "{token}"\n')
    return config


def start_embedded(opts: EmbeddedOptions, launcher: LocalLauncher) -> dict[str, Any]:
    """Start prefill, decode and router; returns the router's ready info."""
    checkpoint = str(opts.checkpoint or ensure_tiny_checkpoint())
    worker_config = write_worker_config(launcher.log_dir / "run")
    common = ["--checkpoint", checkpoint, "--config", str(worker_config), "--host", opts.host, "--port", "0"]
    prefill = launcher.start("prefill", ["worker", "--role", "prefill", "--worker-id", "prefill0", *common])
    decode = launcher.start("decode", ["worker", "--role", "decode", "--worker-id", "decode0", *common])
    return launcher.start("router", [
        "router", "--checkpoint", checkpoint, "--host", opts.host, "--port", str(opts.port),
        "--prefill", f"prefill0={prefill['address']}", "--decode", f"decode0={decode['address']}",
        "--default-max-tokens", str(opts.default_max_tokens)])


def serve_embedded(opts: EmbeddedOptions) -> int:
    """`cedserve serve`: run everything here until Ctrl-C/SIGTERM or a part dies."""
    launcher = LocalLauncher(opts.log_dir or cache_home() / "logs")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        router = start_embedded(opts, launcher)
        address = router["address"]
        print(f"cedserve is serving on {address} (logs: {launcher.log_dir})", flush=True)
        print(f'try: cedserve generate "def fibonacci(" --address {address}', flush=True)
        print(f"CEDSERVE_READY {{\"role\": \"system\", \"address\": \"{address}\"}}", flush=True)
        while not stop.wait(0.5):
            dead = launcher.first_exit()
            if dead is not None:
                print(f"{dead.name} exited with {dead.proc.returncode}; shutting down. Last log lines:\n"
                      + "\n".join(dead.tail), file=sys.stderr, flush=True)
                return 1
        print("shutting down", flush=True)
        return 0
    except LaunchError as exc:
        print(f"cedserve serve: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        launcher.stop_all()
