"""Shared secrets: read from a mounted file or the environment, and carried as call metadata.

A leaf (imports nothing of the project): the KV-transfer control plane, the workers, the router and
the CLI all use it.
"""

from __future__ import annotations

import os
from pathlib import Path


def api_key_from_env(environ: dict[str, str] | None = None) -> str | None:
    """The client's API key from `CEDSERVE_API_KEY` (None when unset)."""
    env = os.environ if environ is None else environ
    return env.get("CEDSERVE_API_KEY") or None


def read_secret_file(path: str | Path, field: str) -> str:
    """A shared secret kept in a file (a mounted Secret): its text without surrounding whitespace.
    `ValueError` names `field` when the file is missing or empty."""
    try:
        secret = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"config field `{field}`: cannot read {path}: {exc.strerror}") from None
    if not secret:
        raise ValueError(f"config field `{field}`: {path} is empty")
    return secret


TOKEN_METADATA_KEY = "x-cedserve-token"
"""gRPC metadata key of the worker plane's shared secrets: the internal token (`internal_token_file`,
checked by `serving.server.TokenInterceptor`, sent by the router) and the KV-transfer token of the link probe."""


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token` in `TOKEN_METADATA_KEY` (nothing for an empty token)."""
    return ((TOKEN_METADATA_KEY, token),) if token else ()
