"""Load a Hugging Face safetensors checkpoint into `CEDModel`, one tensor at a time.

Names follow the reference (`model.layers.2.attn.wkv.weight`, `lm_head.weight`); the `model.`
prefix is optional. Every parameter of the model must be found with its exact shape, or
`CheckpointError` names the tensor. Tensors the model has no place for (DSpark `mtp.*`, vision,
scale tensors) are ignored. Stored formats, all turned into the parameter's dtype by
`dequantize_weight`:

* float32 / bfloat16: cast.
* FP8 linear weight + `<name>_scale_inv` (float32 per 128 x 128 tile): `kernels.weight_formats`.
* FP4 expert weight (uint8 `[out, in/2]`) + `<name>_scale` (UE8M0 per 32): `kernels.weight_formats`.
* FP8 Engram table + `<module>.scale` (one float per 32 channels of a row).

With `load_model(..., engram="mmap")` the Engram tables are not loaded: an `EngramStore` serves
their rows from memory maps of the same files, dequantized with the same arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from cedserve.kernels.weight_formats import dequantize_fp4_weight, dequantize_fp8_weight
from cedserve.model.config import ModelConfig
from cedserve.model.engram import ENGRAM_SCALE_BLOCK as ENGRAM_SCALE_BLOCK
from cedserve.model.engram import dequantize_engram_rows, load_compressed_token_map
from cedserve.model.engram_store import EngramStore
from cedserve.model.network import CEDModel
from cedserve.model.safetensors_file import CheckpointError as CheckpointError

ENGRAM_MODES = ("memory", "mmap")
ModuleT = TypeVar("ModuleT", bound=nn.Module)
FLOAT32_PARAMETERS = frozenset(
    {"hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale", "attn_sink"}
    | {"gate.bias", "gate.bias_vl"}
)
"""Parameter name endings the released checkpoint stores in float32 and the reference keeps there
(`_keep_in_fp32_modules_strict`): the raw mHC mixes, the attention sinks and the router's correction
biases. Matched on whole name components, so the drafter's `confidence.bias` follows the model's
dtype while its router biases and sinks stay float32 as the backbone's do."""


def _shard_paths(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return shards


def dequantize_weight(name: str, raw: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The stored tensor `raw` (with its `scale` companion, if any) as a `dtype` tensor."""
    quantized = raw.dtype in (torch.float8_e4m3fn, torch.uint8, torch.int8)
    if not quantized:
        return raw.to(dtype)
    if scale is None:
        raise CheckpointError(f"tensor {name} is stored as {raw.dtype} but has no scale tensor beside it")
    try:
        if raw.dtype != torch.float8_e4m3fn:
            value: Tensor = dequantize_fp4_weight(raw, scale, dtype)
        elif tuple(scale.shape) == (raw.shape[0], raw.shape[1] // ENGRAM_SCALE_BLOCK):
            value = dequantize_engram_rows(raw, scale, dtype)
        else:
            value = dequantize_fp8_weight(raw, scale, dtype)
    except ValueError as exc:
        raise CheckpointError(f"tensor {name}: {exc}") from exc
    return value


class _TensorIndex:
    """Name -> open safetensors handle, over all shards."""

    def __init__(self, stack: ExitStack, path: Path) -> None:
        from safetensors import safe_open

        self.handles: dict[str, Any] = {}
        for shard in _shard_paths(path):
            handle = stack.enter_context(safe_open(str(shard), framework="pt"))
            names: list[str] = handle.keys()  # a safetensors handle is not iterable
            self.handles.update(dict.fromkeys(names, handle))

    def find(self, name: str) -> str | None:
        for candidate in (name, f"model.{name}", name.removeprefix("model.")):
            if candidate in self.handles:
                return candidate
        return None

    def get(self, key: str) -> Tensor:
        tensor: Tensor = self.handles[key].get_tensor(key)
        return tensor

    def scale_for(self, key: str) -> Tensor | None:
        """The companion scale of a quantized tensor, under any of the known names."""
        module = key.removesuffix(".weight")
        for candidate in (f"{key}_scale_inv", f"{key}_scale", f"{module}.scale"):
            if candidate in self.handles and candidate != key:
                return self.get(candidate)
        return None


def _parameters(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def load_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Copy every parameter of `model` from the safetensors file or folder at `path`."""
    with ExitStack() as stack, torch.no_grad():
        index = _TensorIndex(stack, Path(path))
        for name, param in _parameters(model):
            key = index.find(name)
            if key is None:
                raise CheckpointError(f"checkpoint {path} has no tensor {name} (nor model.{name})")
            raw = index.get(key)
            scale = index.scale_for(key) if raw.dtype in (torch.float8_e4m3fn, torch.uint8, torch.int8) else None
            value = dequantize_weight(key, raw, scale, param.dtype)
            if tuple(value.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"tensor {key}: checkpoint shape {tuple(value.shape)}, model expects {tuple(param.shape)}"
                )
            param.copy_(value)


def is_float32_parameter(name: str) -> bool:
    """Whether parameter `name` stays float32 whatever the served dtype (`FLOAT32_PARAMETERS`)."""
    return any(name == p or name.endswith("." + p) for p in FLOAT32_PARAMETERS)


def cast_weights(module: ModuleT, dtype: torch.dtype) -> ModuleT:
    """`module` (a `CEDModel` or a `Drafter`) with its weights in `dtype`, those the reference keeps
    in float32 excepted (`is_float32_parameter`; their values kept, not rounded through `dtype`), as the
    reference keeps them (`_keep_in_fp32_modules_strict`). `load_model` builds the model so. In place;
    returns `module` (the modules here hold no buffers)."""
    for name, param in module.named_parameters():
        param.data = param.data.to(torch.float32 if is_float32_parameter(name) else dtype)
    return module


def load_model(folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               engram: str = "memory") -> CEDModel:
    """Build a `CEDModel` from a checkpoint folder holding `config.json`, `tokenizer.json` (needed
    when the config has Engram layers) and `*.safetensors`.

    `engram`: "memory" loads the Engram tables into the model's parameters; "mmap" leaves them in
    the checkpoint files and serves rows through an `EngramStore` (read-only memory maps, gathered on
    a background thread), owned by the model and released by `model.close()`. Both give the same
    logits bit for bit."""
    if engram not in ENGRAM_MODES:
        raise ValueError(f"engram must be one of {ENGRAM_MODES}, got {engram!r}")
    folder = Path(folder)
    config = ModelConfig.from_hf_json(folder)
    token_map = load_compressed_token_map(str(folder / "tokenizer.json"), config) if config.engram_layer_ids else None
    mapped = engram == "mmap" and bool(config.engram_layer_ids)
    store = EngramStore.open(_shard_paths(folder), config, dtype) if mapped else None
    model = cast_weights(CEDModel(config, token_map, engram_store=store), dtype)
    load_checkpoint(model, folder)
    return model.to(device).eval()
