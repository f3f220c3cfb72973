"""The machine-readable line a process prints once it serves, which launchers wait for:
`CEDSERVE_READY {"role": ..., "address": ..., ...}` (one line of JSON after the marker)."""

from __future__ import annotations

import json
from typing import Any

READY_MARKER = "CEDSERVE_READY"


def ready_line(role: str, address: str, **fields: object) -> str:
    """`CEDSERVE_READY {json}`: printed (and flushed) once a process serves."""
    return f"{READY_MARKER} " + json.dumps({"role": role, "address": address, **fields}, sort_keys=True)


def parse_ready_line(line: str) -> dict[str, Any] | None:
    """The JSON of a ready line, or None for any other line."""
    if not line.startswith(READY_MARKER + " "):
        return None
    value: dict[str, Any] = json.loads(line[len(READY_MARKER) + 1:])
    return value
