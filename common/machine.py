"""Where a figure was measured: the `machine` object of every benchmark report (JSON).

`describe_machine(device)` is taken when a run starts; `loadavg()` again at its end, so a reader
can tell a quiet machine from a busy one. Optional packages (torch, NIXL) are looked up lazily and
reported only where installed.
"""

from __future__ import annotations

import os
import platform
import socket
from typing import Any

_NIXL_DISTRIBUTIONS = ("nixl-cu13", "nixl-cu12", "nixl")


def loadavg() -> list[str]:
    """The 1/5/15-minute load averages (empty where /proc is absent)."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[:3]
    except OSError:
        return []


def describe_machine(device: str) -> dict[str, Any]:
    """Host, CPU model, cores, kernel, Python, torch, GPUs (`device == "cuda"`), the NIXL wheel,
    memory and the load averages at start."""
    info: dict[str, Any] = {"hostname": socket.gethostname(), "cpu": _cpu_model(), "cores": os.cpu_count(),
                            "kernel": platform.release(), "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if device == "cuda" and torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    info["nixl"] = next((f"{name} {v}" for name in _NIXL_DISTRIBUTIONS if (v := _dist_version(name))), "none")
    info["loadavg_at_start"] = loadavg()
    mem_gib = _mem_gib()
    if mem_gib is not None:
        info["mem_gib"] = mem_gib
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def _mem_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            return round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


def _dist_version(name: str) -> str:
    """The installed version of distribution `name` ("" when absent)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return ""
