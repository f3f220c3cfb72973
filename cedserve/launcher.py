"""Start the whole system as local processes: prefill workers, decode workers, the router.

Each part is a real process speaking real gRPC (and NIXL between the workers), started with the
same command lines the Helm chart uses (`cedserve worker ...`, `cedserve router ...`). A process
is ready when it prints `CEDSERVE_READY {json}`; the launcher starts the workers together (the ranks
of an expert-parallel decode group must meet), waits for every ready line (or a process's death,
reported with its last log lines), then starts the router. Shutdown sends SIGTERM to all,
router first, and SIGKILL to any that outlive the grace period. Logs go to `<log_dir>/<name>.log`.

What to start is planned once, for both launchers: `plan_workers` gives one `ProcessSpec` per
worker rank and `router_args` the router's command line. Specs hold `{checkpoint}` and `{run_dir}`
placeholders that the launcher fills where the process runs: here, or inside the Ray actor that
owns the process on another node (cedserve/ray_launcher.py, `cedserve serve --ray`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from cedserve.serving.ready import parse_ready_line
from cedserve.serving.worker_model import checkpoint_identity

TINY_CHECKPOINT_VERSION = "tiny-random-v1"


class LaunchError(RuntimeError):
    """A part did not become ready; the message carries its last log lines."""


def cache_home() -> Path:
    """Where first-use artefacts go: `$CEDSERVE_HOME`, else `$XDG_CACHE_HOME/cedserve`, else ~/.cache/cedserve."""
    if os.environ.get("CEDSERVE_HOME"):
        return Path(os.environ["CEDSERVE_HOME"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cedserve"


def shipped_demo_checkpoint() -> Path:
    """The trained demo checkpoint shipped in the package (`cedserve.training.demo`, docs/training.md)."""
    from importlib import resources

    return Path(str(resources.files("cedserve") / "assets" / "demo"))


def ensure_demo_checkpoint(home: Path | None = None) -> Path:
    """The embedded default's checkpoint: the shipped demo checkpoint, copied on first use to
    `<cache home>/checkpoints/demo-<identity>` (so every process's command line names the cache
    home, and a new package version brings a new folder)."""
    source = shipped_demo_checkpoint()
    if not (source / "model.safetensors").is_file():
        raise LaunchError(f"the demo checkpoint is missing from the package ({source}); pass --checkpoint DIR")
    folder = (home or cache_home()) / "checkpoints" / f"demo-{checkpoint_identity(source)}"
    if (folder / "model.safetensors").is_file() and (folder / "config.json").is_file():
        return folder
    import shutil

    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("__pycache__"))
    if folder.exists():  # another process finished first; keep its copy
        shutil.rmtree(tmp)
    else:
        tmp.replace(folder)
    return folder


def ensure_tiny_checkpoint(home: Path | None = None) -> Path:
    """A tiny real-format checkpoint with random weights, written on first use (tests, benchmarks)."""
    return ensure_preset_checkpoint("tiny", home)


def ensure_preset_checkpoint(name: str, home: Path | None = None) -> Path:
    """A real-format checkpoint of preset `name` (tiny, mini-40) with random weights (seed 0),
    written on first use under `<cache home>/checkpoints/<name>-random-v1`."""
    folder = (home or cache_home()) / "checkpoints" / TINY_CHECKPOINT_VERSION.replace("tiny", name, 1)
    if (folder / "model.safetensors").is_file() and (folder / "config.json").is_file():
        return folder
    from cedserve.model.checkpoint_writer import write_random_checkpoint
    from cedserve.model.presets import preset

    print(f"writing a {name} random checkpoint to {folder} (first use)", file=sys.stderr, flush=True)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    write_random_checkpoint(preset(name), tmp, seed=0)
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

    def wait_ready(self, timeout_s: float, cancel: threading.Event | None = None) -> dict[str, Any]:
        """The ready line's info; `LaunchError` (with the log's last lines) when the process exits
        first, `timeout_s` passes, or `cancel` is set."""
        deadline = time.monotonic() + timeout_s
        while not self._ready_event.wait(min(0.2, max(0.0, deadline - time.monotonic()))):
            if cancel is not None and cancel.is_set():
                raise LaunchError(f"{self.name}: start cancelled")
            if time.monotonic() >= deadline:
                break
        if not self.ready:
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
        return self.spawn(name, args, env).wait_ready(ready_timeout_s)

    def spawn(self, name: str, args: Sequence[str], env: dict[str, str] | None = None) -> Part:
        """Start a part without waiting for its ready line (parts that must start together)."""
        argv = [sys.executable, "-m", "cedserve.cli", *args]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                                start_new_session=True)
        part = Part(name, proc, self.log_dir / f"{name}.log")
        log = part.log_path.open("a")
        threading.Thread(target=part.pump, args=(log,), daemon=True, name=f"log-{name}").start()
        self.parts.append(part)
        return part

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
    """None: the shipped trained demo checkpoint (`preset` demo), or a random real-format
    checkpoint of `preset`, written on first use."""
    preset: str = "demo"
    """demo (the trained checkpoint), or a preset with random weights (tiny, mini-40)."""
    host: str = "127.0.0.1"
    port: int = 50051
    """Public gRPC port of the router."""
    http_port: int = -1
    """The router's OpenAI-compatible HTTP API (-1: off, 0: any free port); `cedserve serve` turns it on."""
    api_key_file: Path | None = None
    """One accepted API key per line, for the router's public APIs; None: open (loopback use)."""
    log_dir: Path | None = None
    """None: `<cache home>/logs`."""
    default_max_tokens: int = 64
    num_prefill: int = 1
    """Prefill workers; 0: colocated serving (every request prefilled by a decode worker)."""
    num_decode: int = 1
    """Decode workers, each a group of `decode_group_size` ranks."""
    decode_group_size: int = 1
    """Expert-parallel ranks per decode worker (docs/decode.md)."""
    policy: str = "cache_aware"
    """Router placement policy: cache_aware, least_loaded or round_robin (router/policy.py)."""
    device: str = "cpu"
    """Workers' device, `cpu` or `cuda` (GPUs chosen by `gpus`)."""
    gpus: tuple[int, ...] = ()
    """GPU ids handed to the ranks in start order (prefill workers, then decode ranks) through
    CUDA_VISIBLE_DEVICES, round-robin: with fewer ids than ranks, ranks share a GPU (each worker
    then under a memory share, `worker_memory_fractions`). Empty with `cuda`: 0, 1, 2, ..., one GPU
    per rank."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """A `--config` file's contents (`read_serve_config`): its ServeConfig part goes to every process,
    its `[router]` table to the router, its `[prefill]` / `[decode]` / `[kv_transfer]` tables to the
    workers (`write_worker_config`)."""

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1 or self.decode_group_size < 1:
            raise ValueError(f"embedded: need num_prefill >= 0, num_decode >= 1 and decode_group_size >= 1, got "
                             f"{self.num_prefill}, {self.num_decode}, {self.decode_group_size}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"embedded field `device`: cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and self.gpus and self.decode_group_size > 1:
            for first in range(self.num_prefill, self.num_ranks, self.decode_group_size):
                group = [self.gpu_of(first + r) for r in range(self.decode_group_size)]
                if len(set(group)) < len(group):  # NCCL refuses two ranks of a communicator on one GPU
                    raise ValueError(f"embedded field `gpus`: a decode group's {self.decode_group_size} ranks need "
                                     f"distinct GPUs, {list(self.gpus)} gives them {group}")

    @property
    def num_ranks(self) -> int:
        return self.num_prefill + self.num_decode * self.decode_group_size

    def gpu_of(self, index: int) -> int:
        """The GPU of the `index`-th rank started (with `cuda`)."""
        return self.gpus[index % len(self.gpus)] if self.gpus else index

    def rank_roles(self) -> list[str]:
        """Every rank's role, in start order."""
        return ["prefill"] * self.num_prefill + ["decode"] * (self.num_decode * self.decode_group_size)

    def rank_env(self, index: int) -> dict[str, str]:
        """Environment of the `index`-th rank started: its GPU on `cuda`."""
        if self.device != "cuda":
            return {}
        return {"CUDA_VISIBLE_DEVICES": str(self.gpu_of(index))}


GPU_MEMORY_UTILIZATION = 0.9
"""Of a GPU that workers share, the part `cedserve serve` hands out (vLLM's default): the rest holds
each process's CUDA context and the NCCL/UCX buffers outside PyTorch's allocator."""
ROLE_MEMORY_WEIGHT = {"prefill": 4, "decode": 5}
"""How a shared GPU's memory is split: one prefill and one decode worker get 0.4 and 0.5. Decode
holds more (running requests' whole contexts, the runner's slot pools and CUDA graphs, the drafter);
prefill holds the prompts in flight and its prefix cache."""


def worker_memory_fractions(opts: EmbeddedOptions) -> dict[str, float]:
    """Each role's `gpu_memory_fraction` for the config files (`write_worker_config`): where ranks share
    a GPU, `GPU_MEMORY_UTILIZATION` split by `ROLE_MEMORY_WEIGHT` (per role the smallest share over
    its ranks, since a role's ranks read one file); a `[prefill]` / `[decode]` table's own value wins.
    Empty when no GPU is shared. `ValueError` when a GPU's shares add up past 1, naming the fields."""
    if opts.device != "cuda":
        return {}
    roles = opts.rank_roles()
    on_gpu: dict[int, list[str]] = {}
    for index, role in enumerate(roles):
        on_gpu.setdefault(opts.gpu_of(index), []).append(role)
    if all(len(ranks) == 1 for ranks in on_gpu.values()):
        return {}
    shares: dict[str, float] = {}
    for ranks in on_gpu.values():
        weight = sum(ROLE_MEMORY_WEIGHT[r] for r in ranks)
        for role in ranks:
            share = round(GPU_MEMORY_UTILIZATION * ROLE_MEMORY_WEIGHT[role] / weight, 4)
            shares[role] = min(shares.get(role, 1.0), share)
    for role in shares:
        configured = dict(opts.config.get(role) or {}).get("gpu_memory_fraction")
        if configured is not None:
            shares[role] = float(configured)
    for gpu, ranks in on_gpu.items():
        total = sum(shares[r] for r in ranks)
        if total > 1.0:
            raise ValueError(f"GPU {gpu} holds {len(ranks)} worker ranks ({', '.join(ranks)}) whose memory shares add "
                             f"up to {total:.2f} > 1: lower [prefill] / [decode] gpu_memory_fraction "
                             f"(now {shares.get('prefill')} / {shares.get('decode')}) or give more GPUs (--gpus)")
    return shares


TOKEN_FILE_NAME = "kv_transfer.token"
"""The system's shared token in a run folder: the KV-transfer control plane's and the worker plane's
(router -> worker RPCs) secret both, as in the Helm chart."""


def write_token_file(run_dir: Path, token: str | None = None) -> Path:
    """`run_dir/kv_transfer.token` holding `token` (default: a fresh random one), file mode 0600."""
    import secrets

    run_dir.mkdir(parents=True, exist_ok=True)
    token_file = run_dir / TOKEN_FILE_NAME
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token or secrets.token_hex(32))
    return token_file


WORKER_TABLES = ("prefill", "decode", "kv_transfer")
"""Tables of a `cedserve serve --config` file that only workers read; besides them only the router
reads `[router]`, and the rest is the ServeConfig every process reads."""


def read_serve_config(path: Path) -> dict[str, Any]:
    """A `cedserve serve --config` file (.toml or .json) as plain data, checked the way the processes
    will decode it: its ServeConfig part (`[model]`, `[cache]`, `[tls]`, `[internal_tls]`, ...), the
    router's `[router]` table and the workers' `[prefill]`, `[decode]` and `[kv_transfer]` tables.
    `ValueError` names a bad field, before any process starts."""

    import tomllib

    from cedserve.decode_workers.config import DecodeConfig
    from cedserve.kv_transfer.config import kv_transfer_config_from_table
    from cedserve.prefill_workers.config import PrefillWorkerConfig
    from cedserve.router.config import router_table
    from cedserve.serving.config import ServeConfig

    _, tables = ServeConfig.load_with_sections(path, (*WORKER_TABLES, "router"))
    router_table(tables.get("router", {}))
    PrefillWorkerConfig.from_mapping(tables.get("prefill", {}))
    DecodeConfig.from_mapping(tables.get("decode", {}))
    kv_transfer_config_from_table({k: v for k, v in tables.get("kv_transfer", {}).items() if k != "auth_token_file"},
                                  "127.0.0.1", 0)
    raw = path.read_bytes().decode()
    data: dict[str, Any] = tomllib.loads(raw) if path.suffix == ".toml" else json.loads(raw)
    return data


def toml_text(data: Mapping[str, Any], prefix: str = "") -> str:
    """`data` as TOML: scalars and lists of scalars as `key = value` (strings in JSON's escaping,
    which TOML's basic strings share), nested mappings as `[a.b]` tables; None is left out."""

    lines, tables = [], []
    for key, value in data.items():
        if value is None:
            continue
        if isinstance(value, Mapping):
            tables.append((key, value))
        elif isinstance(value, bool | int | float | str | list | tuple):
            lines.append(f"{key} = {json.dumps(value)}")
        else:
            raise ValueError(f"config field `{prefix}{key}`: {type(value).__name__} has no TOML form here")
    text = "".join(line + "\n" for line in lines)
    for key, value in tables:
        text += f"[{prefix}{key}]\n" + toml_text(value, f"{prefix}{key}.")
    return text


def write_worker_config(run_dir: Path, device: str = "cpu", token: str | None = None,
                        config: Mapping[str, Any] | None = None,
                        memory_fractions: Mapping[str, float] | None = None) -> dict[str, Path]:
    """Every process's config file, by role ("prefill", "decode", "router"): the KV-transfer control
    plane and internal RPCs both require `token` (see `write_token_file`; the router sends it), and
    each worker's own table sets its device (each role reads only its own). `config` (a `cedserve
    serve --config` file, `read_serve_config`) adds its ServeConfig part to every file, its `[router]`
    table to the router's and its `[prefill]` / `[decode]` / `[kv_transfer]` tables to the workers'
    (a table's own `device` wins). `memory_fractions` (`worker_memory_fractions`) sets each role's
    `gpu_memory_fraction`.
    Every process of one system must share the token."""
    token_file = write_token_file(run_dir, token)
    data = dict(config or {})
    tables = {name: dict(data.pop(name, None) or {}) for name in (*WORKER_TABLES, "router")}
    common = {**data, "internal_token_file": str(token_file)}
    configs = {}

    def share(role: str) -> dict[str, float]:
        fraction = (memory_fractions or {}).get(role)
        return {} if fraction is None else {"gpu_memory_fraction": fraction}

    for role in ("prefill", "decode"):
        body = {**common, "kv_transfer": {**tables["kv_transfer"], "auth_token_file": str(token_file)},
                role: {"device": device, **share(role), **tables[role]}}
        configs[role] = run_dir / f"{role}.toml"
        configs[role].write_text(toml_text(body))
    configs["router"] = run_dir / "router.toml"
    configs["router"].write_text(toml_text({**common, **({"router": tables["router"]} if tables["router"] else {})}))
    return configs


def free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class ProcessSpec:
    """One process of the system, as both launchers start it: `cedserve <args>`."""

    name: str
    """Log and part name: prefill0, decode0, decode0-r1 (a follower rank), router."""
    role: str
    """prefill, decode or router."""
    worker_id: str
    """The worker's id (its ranks share it); "" for the router."""
    group: int
    """Index of the worker in its pool."""
    rank: int
    """Rank in the worker's group (0 leads: only it serves the worker service)."""
    args: tuple[str, ...]
    """Command line after `cedserve`, with `{checkpoint}` and `{run_dir}` placeholders."""
    env: tuple[tuple[str, str], ...] = ()

    def argv(self, checkpoint: str, run_dir: str) -> list[str]:
        return [a.replace("{checkpoint}", checkpoint).replace("{run_dir}", run_dir) for a in self.args]


def resolve_checkpoint(opts: EmbeddedOptions) -> str:
    """The served checkpoint folder, written on first use for the demo and random presets."""
    if opts.checkpoint is not None:
        return str(opts.checkpoint)
    if opts.preset == "demo":
        return str(ensure_demo_checkpoint())
    return str(ensure_preset_checkpoint(opts.preset))


def plan_workers(opts: EmbeddedOptions, rendezvous: Callable[[int], tuple[str, int]],
                 assign_gpus: bool = True) -> list[ProcessSpec]:
    """Every worker rank: prefill workers, then each decode group's ranks. `rendezvous(group)` gives
    a decode group's torch.distributed leader host and port (groups of more than one rank only);
    `assign_gpus` hands ranks GPUs through CUDA_VISIBLE_DEVICES (Ray assigns them itself)."""
    common = ("--checkpoint", "{checkpoint}", "--host", opts.host, "--port", "0", "--metrics-port", "0")
    specs = []
    for i in range(opts.num_prefill):
        specs.append(ProcessSpec(f"prefill{i}", "prefill", f"prefill{i}", i, 0, (
            "worker", "--role", "prefill", "--worker-id", f"prefill{i}", "--config", "{run_dir}/prefill.toml",
            *common)))
    for i in range(opts.num_decode):
        group: tuple[str, ...] = ()
        if opts.decode_group_size > 1:
            host, port = rendezvous(i)
            group = ("--group-size", str(opts.decode_group_size), "--leader-address", host, "--dist-port", str(port))
        for rank in range(opts.decode_group_size):
            specs.append(ProcessSpec(f"decode{i}" if rank == 0 else f"decode{i}-r{rank}", "decode", f"decode{i}", i,
                                     rank, ("worker", "--role", "decode", "--worker-id", f"decode{i}", "--config",
                                            "{run_dir}/decode.toml", *common, *group, "--rank", str(rank))))
    if assign_gpus:
        specs = [replace(s, env=tuple(opts.rank_env(k).items())) for k, s in enumerate(specs)]
    return specs


def router_args(opts: EmbeddedOptions, checkpoint: str, leaders: Sequence[tuple[str, str, str]],
                token_file: str, config_file: str | None = None) -> list[str]:
    """`cedserve router` in front of `leaders` (role, worker id, address), sending the workers' token
    from `token_file` and reading `config_file` (`write_worker_config`'s router file) when given;
    `checkpoint` may be the `{checkpoint}` placeholder (read for the context length only when it is a
    real path), `token_file` and `config_file` paths under `{run_dir}`."""
    workers = [f"--{role}={worker_id}={address}" for role, worker_id, address in leaders]
    colocated = []
    if opts.num_prefill == 0:  # every prompt the model accepts may be prefilled by a decode worker
        from cedserve.model.config import ModelConfig

        limit = ModelConfig.from_hf_json(resolve_checkpoint(opts)).max_position_embeddings
        colocated = ["--decode-only-max-tokens", str(limit)]
    config = ["--config", config_file] if config_file else []
    keys = ["--api-key-file", str(opts.api_key_file)] if opts.api_key_file else []
    return ["router", "--checkpoint", checkpoint, "--host", opts.host, "--port", str(opts.port), "--metrics-port", "0",
            "--http-port", str(opts.http_port),
            *workers,
            "--policy", opts.policy, "--default-max-tokens", str(opts.default_max_tokens),
            "--worker-token-file", token_file, *config, *keys, *colocated]


def start_embedded(opts: EmbeddedOptions, launcher: LocalLauncher) -> dict[str, Any]:
    """Start the prefill workers and decode groups (together), then the router; returns its ready
    info. Nothing restarts them: `cedserve serve` supervises (cedserve/supervise.py)."""
    from cedserve.supervise import EmbeddedSystem

    return EmbeddedSystem(opts, launcher).start()
