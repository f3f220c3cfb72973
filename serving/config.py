"""Serving configuration: one typed, frozen struct per subsystem, decoded from TOML or JSON.

Files decode through msgspec, which names the offending field on a type error; each struct's
`__post_init__` checks values and raises `ValueError` naming the field (`cedserve.model.config_table`:
the one form of every table's errors). The `[cache]` table is the cache's own `KVCacheConfig`, the
one home of the block size. Environment variables are read in one place only,
`ServeConfig.from_env_overrides`.

It sits in the serving layer, above the model (the cache's `KVCacheConfig`, the model's config it
is checked against); the leaves it shares with lower layers (secret files, the token metadata) are
`cedserve.common.credentials`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import tomllib

from cedserve.common.credentials import read_secret_file
from cedserve.common.tls import TLSConfig
from cedserve.model.cache.config import KVCacheConfig
from cedserve.model.config import ModelConfig
from cedserve.model.config_table import decode_table, fail

WEIGHTS_DTYPES = ("float32", "bfloat16", "auto")
"""Values of `[model] dtype` (`ModelSource.dtype`)."""
ENGRAM_PLACES = ("memory", "mmap")
"""Values of `[model] engram` (`ModelSource.engram`; `cedserve.model.checkpoint.ENGRAM_MODES`)."""


def resolve_weights_dtype(dtype: str, device: str) -> str:
    """`[model] dtype` on `device`: "auto" is "bfloat16" on a CUDA device, "float32" elsewhere."""
    if dtype not in WEIGHTS_DTYPES:
        fail("model", "dtype", f"must be one of {list(WEIGHTS_DTYPES)}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


class ModelSource(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the model comes from: a named preset (random tiny weights) or a checkpoint folder, and
    the dtype the workers hold its weights in."""

    preset: str | None = "tiny"
    """Preset name (`tiny`, `mini-40`, `v4.1-flash`); ignored when `checkpoint` is set."""
    checkpoint: str | None = None
    """Folder with config.json, tokenizer.json and safetensors files."""
    dtype: str = "float32"
    """The served weights' dtype: "float32", "bfloat16", or "auto" (bfloat16 on a CUDA device, float32
    on a CPU). The parameters the reference keeps in float32 (mHC mixes, attention sinks, router
    biases) stay float32 either way, and so does the float32 arithmetic the reference keeps (router,
    norms' statistics, softmax, mHC, sampling; docs/model.md, "Weights dtype"). The prefill and decode
    workers of one system must agree (the KV-transfer handshake refuses a peer that does not). The
    default stays float32 until bf16 serving is measured on a GPU."""

    engram: str = "memory"
    """Where the Engram tables live: "memory" loads them into the model (device memory on a GPU);
    "mmap" leaves them in the checkpoint's files and serves each step's rows from host memory maps
    through an `EngramStore` (the released model's tables are ~196B parameters; docs/model.md,
    "Engram tables in host memory"). Logits are the same bit for bit. Needs `checkpoint` (a preset's
    random tables are made in memory)."""

    def __post_init__(self) -> None:
        if self.dtype not in WEIGHTS_DTYPES:
            fail("model", "dtype", f"must be one of {list(WEIGHTS_DTYPES)}, got {self.dtype!r}")
        if self.engram not in ENGRAM_PLACES:
            fail("model", "engram", f"must be one of {list(ENGRAM_PLACES)}, got {self.engram!r}")

    def weights_dtype(self, device: str) -> str:
        """`dtype` on `device`, "auto" resolved ("float32" or "bfloat16")."""
        return resolve_weights_dtype(self.dtype, device)

    def load_config(self) -> ModelConfig:
        from cedserve.model.presets import preset

        if self.checkpoint is not None:
            return ModelConfig.from_hf_json(self.checkpoint)
        if self.preset is None:
            raise ValueError("config field `model`: set `preset` or `checkpoint`")
        return preset(self.preset)


class ServeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything `cedserve serve` needs."""

    model: ModelSource = msgspec.field(default_factory=ModelSource)
    cache: KVCacheConfig = msgspec.field(default_factory=KVCacheConfig)
    host: str = "127.0.0.1"
    """Address the public gRPC API binds to."""
    port: int = 0
    """Public gRPC port; 0 picks a free one and prints it."""
    tls: TLSConfig = msgspec.field(default_factory=TLSConfig)
    """`[tls]`: the router's public port (unset: plaintext)."""
    internal_tls: TLSConfig = msgspec.field(default_factory=TLSConfig)
    """`[internal_tls]`: workers' internal gRPC service, the KV-transfer control plane, and the
    router's channels to workers (unset: plaintext)."""
    internal_token_file: str | None = None
    """File holding the worker plane's shared secret: a worker with it refuses every internal RPC
    (health and the loopback-only Drain excepted) that lacks it in `x-cedserve-token` metadata; the
    router sends it (`cedserve router --worker-token-file`, or this key in its `--config`). None: no
    check (docs/security.md). The chart and `cedserve serve` point it at the KV-transfer token file."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            fail("serve", "port", f"must be in [0, 65535], got {self.port}")

    def validate_against(self, model: ModelConfig) -> None:
        """Check the relations between the cache geometry and the model plan."""
        from cedserve.model.kv_accounting import KVAccounting, check_block_size

        check_block_size(KVAccounting.from_config(model), self.cache.block_size)
        cand = model.candidate_source_layer_id
        if cand is not None and cand >= 0:
            tokens_per_candidate = model.candidate_block_size * model.compress_ratios[cand]
            if self.cache.block_size % tokens_per_candidate:
                fail("cache", "block_size", f"{self.cache.block_size} is not a multiple of the candidate "
                     f"block ({model.candidate_block_size} entries x m={model.compress_ratios[cand]})")

    def internal_token(self) -> str:
        """The worker-plane token read from `internal_token_file` ("" when unset)."""
        return read_secret_file(self.internal_token_file, "internal_token_file") if self.internal_token_file else ""

    @classmethod
    def load(cls, path: str | Path) -> ServeConfig:
        """Decode a `.toml` or `.json` file; `ValueError` names the bad field (unknown ones included)."""
        config, _ = cls.load_with_sections(path, ())
        return config

    @classmethod
    def load_with_sections(cls, path: str | Path, sections: tuple[str, ...]) -> tuple[ServeConfig, dict[str, Any]]:
        """Like `load`, but the tables named in `sections` (a process's own, e.g. `[prefill]`) are
        taken out raw before the rest decodes as a `ServeConfig`."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise ValueError(f"serve config not found: {path}") from None
        try:
            data: Any = tomllib.loads(raw.decode()) if path.suffix == ".toml" else msgspec.json.decode(raw)
            if not isinstance(data, dict):
                raise ValueError("must hold an object")
            extra = {name: data.pop(name) for name in sections if name in data}
            return decode_table(cls, data, ""), extra
        except (ValueError, msgspec.DecodeError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"serve config {path}: {exc}") from None

    def with_env_overrides(self, environ: dict[str, str] | None = None) -> ServeConfig:
        """Apply `CEDSERVE_HOST`, `CEDSERVE_PORT`, `CEDSERVE_CHECKPOINT` (the only env vars read)."""
        env = os.environ if environ is None else environ
        out = self
        if "CEDSERVE_HOST" in env:
            out = msgspec.structs.replace(out, host=env["CEDSERVE_HOST"])
        if "CEDSERVE_PORT" in env:
            try:
                port = int(env["CEDSERVE_PORT"])
            except ValueError:
                raise ValueError(f"CEDSERVE_PORT must be an integer, got {env['CEDSERVE_PORT']!r}") from None
            out = msgspec.structs.replace(out, port=port)
        if "CEDSERVE_CHECKPOINT" in env:
            out = msgspec.structs.replace(out, model=ModelSource(preset=None, checkpoint=env["CEDSERVE_CHECKPOINT"],
                                                                 dtype=out.model.dtype))
        return out
