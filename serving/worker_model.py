"""The model a worker serves, named for the KV compatibility hash.

* `load_worker_model(checkpoint, preset, seed, device, dtype)`: the model, its weights in `dtype`
  ("float32" or "bfloat16", `[model] dtype` resolved), and the `model_id` both sides of a transfer put
  in the KV compatibility hash (same checkpoint bytes or same preset+seed -> same id; the weights'
  dtype goes in beside it, `KVLayout.from_config`).

Importing this module does not import torch; loading a model does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from cedserve.model.network import CEDModel


@dataclass(frozen=True)
class LoadedModel:
    """The model a worker serves, and what names it."""

    model: CEDModel
    model_id: str
    """Names the weights: goes into the KV transfer compatibility hash (`KVLayout.from_config`)."""
    source: str
    weights_dtype: str = "float32"
    """The dtype the weights are held in ("float32" or "bfloat16"; `checkpoint.cast_weights`): also in
    the compatibility hash, so a prefill and a decode worker of different dtypes refuse each other."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved `[model] dtype` ("float32" or "bfloat16")."""
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"weights dtype must be one of {list(dtypes)} (\"auto\" resolved first), got {name!r}")
    return dtypes[name]


def checkpoint_identity(folder: str | Path) -> str:
    """sha256 (16 hex) over config.json and every shard's size and safetensors header (names, shapes,
    offsets, writer metadata): two copies of one checkpoint agree without hashing gigabytes."""
    folder = Path(folder)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for shard in sorted(folder.glob("*.safetensors")):
        with shard.open("rb") as f:
            head = f.read(8)
            header = f.read(int.from_bytes(head, "little")) if len(head) == 8 else b""
        digest.update(shard.name.encode() + str(shard.stat().st_size).encode() + header)
    return digest.hexdigest()[:16]


def load_worker_model(checkpoint: str | None, preset_name: str | None, seed: int = 0,
                      device: str = "cpu", dtype: str = "float32", engram: str = "memory") -> LoadedModel:
    """A checkpoint folder (`load_model`), else a preset with random weights from `seed`; weights in
    `dtype` ("float32" or "bfloat16"), the reference's float32 parameters excepted. `engram`: the
    checkpoint's Engram tables loaded ("memory") or served from its files ("mmap")."""
    weights = torch_dtype(dtype)
    if checkpoint:
        from cedserve.model.checkpoint import load_model

        return LoadedModel(load_model(checkpoint, dtype=weights, device=device, engram=engram),
                           checkpoint_identity(checkpoint),
                           checkpoint, dtype)
    if not preset_name:
        raise ValueError("config field `model`: set `checkpoint` or `preset`")
    if engram != "memory":
        raise ValueError(f"config field `model.engram`: {engram!r} needs a checkpoint (a preset's tables are made in memory)")
    from cedserve.model.checkpoint import cast_weights
    from cedserve.model.checkpoint_writer import random_model
    from cedserve.model.presets import preset
    from cedserve.model.tokenizer import fit_config_to_tokenizer, tiny_tokenizer_path

    tokenizer = tiny_tokenizer_path()
    model, _drafter = random_model(fit_config_to_tokenizer(preset(preset_name), tokenizer), tokenizer, seed)
    model = cast_weights(model, weights)  # the float32 random values rounded, as a bf16 checkpoint holds them
    return LoadedModel(model.to(device), f"preset:{preset_name}:seed{seed}", f"preset {preset_name}", dtype)
