"""Helpers for whole-system e2e tests that start their own router and workers as real processes
(the same command lines as `cedserve serve` and the Helm chart) with the tiny checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

import grpc

from cedserve.common.credentials import token_metadata
from cedserve.common.tls import PLAINTEXT, TLSConfig, open_channel
from cedserve.launcher import TOKEN_FILE_NAME, LocalLauncher, Part, write_worker_config
from cedserve.model.checkpoint import load_model
from cedserve.proto import worker_pb2, worker_pb2_grpc
from cedserve.serving.ready import parse_ready_line


def greedy_reference(checkpoint: Path, prompt: list[int], n: int) -> list[int]:
    """The monolithic model's greedy continuation: what the system must stream."""
    model = load_model(checkpoint)
    state = model.new_state()
    logits = model.prefill(prompt, state)[-1]
    out = []
    for _ in range(n):
        token = int(logits.argmax())
        out.append(token)
        logits = model.decode_step([token], [state])[-1]
    return out


def token_file(part: Part) -> Path:
    """The worker-plane token file of the system `part` belongs to (`start_workers` and
    `start_embedded` both write it under the launcher's log folder)."""
    return part.log_path.parent / "run" / TOKEN_FILE_NAME


def worker_metadata(part: Part) -> tuple[tuple[str, str], ...]:
    """Call metadata a direct call to `part` needs (workers refuse calls without the token)."""
    return token_metadata(token_file(part).read_text().strip())


def worker_load(part: Part, tls: TLSConfig = PLAINTEXT) -> worker_pb2.LoadReport:
    with open_channel(str(part.ready["address"]), tls) as ch:
        stub = (worker_pb2_grpc.PrefillWorkerStub(ch) if part.ready["role"] == "prefill"  # type: ignore[no-untyped-call]
                else worker_pb2_grpc.DecodeWorkerStub(ch))  # type: ignore[no-untyped-call]
        load: worker_pb2.LoadReport = stub.GetLoad(worker_pb2.LoadRequest(), timeout=10, metadata=worker_metadata(part))
    return load


def wait_idle(parts: list[Part], tls: TLSConfig = PLAINTEXT, timeout_s: float = 10.0) -> dict[str, worker_pb2.LoadReport]:
    """Until no worker holds blocks for a request or runs one; the last loads either way."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = {p.name: worker_load(p, tls) for p in parts}
        if all(x.held_blocks == 0 and x.running_requests == 0 for x in loads.values()) or time.monotonic() > deadline:
            return loads
        time.sleep(0.2)


def start_workers(launcher: LocalLauncher, checkpoint: Path, roles: dict[str, str],
                  extra_config: dict[str, str] | None = None,
                  extra_args: dict[str, list[str]] | None = None) -> dict[str, Part]:
    """Start `{name: role}` workers together, sharing a KV-transfer token; `extra_config[name]` is TOML
    added to that worker's config file, `extra_args[name]` its extra flags. Waits for every one."""
    configs = write_worker_config(launcher.log_dir / "run")
    parts = {}
    for name, role in roles.items():
        config = configs[role]
        if (extra_config or {}).get(name):
            config = config.with_name(f"{name}.toml")
            config.write_text(configs[role].read_text() + (extra_config or {})[name])
        parts[name] = launcher.spawn(name, ["worker", "--role", role, "--worker-id", name, "--checkpoint",
                                            str(checkpoint), "--config", str(config), "--host", "127.0.0.1",
                                            "--port", "0", *(extra_args or {}).get(name, [])])
    for part in parts.values():
        part.wait_ready(180.0)
    return parts


def router_args(checkpoint: Path, workers: dict[str, Part]) -> list[str]:
    args = ["router", "--checkpoint", str(checkpoint), "--host", "127.0.0.1", "--port", "0",
            "--worker-token-file", str(token_file(next(iter(workers.values()))))]
    for name, part in workers.items():
        args += [f"--{part.ready['role']}", f"{name}={part.ready['address']}"]
    return args


def rpc_code(call: object) -> grpc.StatusCode:
    """The status a call ends with (OK when it returns)."""
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def wait_ready_line(log: Path, timeout_s: float, poll_s: float = 0.2) -> dict[str, object]:
    """The ready line a process (or `cedserve serve`) printed into `log`, parsed; AssertionError with
    the log's tail when none came within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines() if log.exists() else []:
            ready = parse_ready_line(line)
            if ready is not None:
                return ready
        time.sleep(poll_s)
    raise AssertionError(f"no ready line in {log}: {log.read_text()[-3000:] if log.exists() else ''}")
