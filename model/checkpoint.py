"""Load a Hugging Face safetensors checkpoint into `CEDModel`, one tensor at a time.

Names follow the reference (`model.layers.2.attn.wkv.weight`, `lm_head.weight`); the `model.`
prefix is optional. Every parameter of the model must be found with its exact shape, or
`CheckpointError` names the tensor. Tensors the model has no place for (DSpark `mtp.*`, vision)
are ignored. Float weights are cast to the parameter's dtype. FP8 weights go through
`dequantize_weight`, the one place block-scaled formats are handled.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from cedserve.model.config import ModelConfig
from cedserve.model.engram import load_compressed_token_map
from cedserve.model.network import CEDModel

FP8_BLOCK = 128  # DeepSeek's FP8 linear weights: one float32 scale per 128 x 128 block
ENGRAM_SCALE_BLOCK = 32  # Engram FP8 table rows: one scale per 32 channels of a row


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, mis-shaped or in a format this loader cannot read."""


def _shard_paths(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return shards


def dequantize_weight(name: str, raw: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Turn a stored tensor into the parameter's dtype. Float tensors are cast; FP8 E4M3
    tensors need their block scale (`<name>_scale_inv` or `<module>.scale`: one float per
    128 x 128 block, or per 32 channels of an Engram row) and are dequantized as `fp8 * scale`. New stored formats
    (FP4 experts) belong here."""
    if raw.dtype != torch.float8_e4m3fn:
        return raw.to(dtype)
    if scale is None:
        raise CheckpointError(f"tensor {name} is FP8 but has no block scale (`{name}_scale_inv`)")
    block_rows, block_cols = _scale_blocks(name, tuple(raw.shape), tuple(scale.shape))
    rows, cols = raw.shape
    expanded = scale.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return (raw.float() * expanded).to(dtype)


def _scale_blocks(name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, int]:
    """Block size of a scale tensor: 128 x 128 (linear weights) or 1 x 32 (Engram table rows)."""
    rows, cols = shape
    if scale_shape == (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)):
        return FP8_BLOCK, FP8_BLOCK
    if scale_shape == (rows, cols // ENGRAM_SCALE_BLOCK):
        return 1, ENGRAM_SCALE_BLOCK
    raise CheckpointError(f"tensor {name}: scale shape {scale_shape} fits no known block layout for {shape}")


class _TensorIndex:
    """Name -> open safetensors handle, over all shards."""

    def __init__(self, stack: ExitStack, path: Path) -> None:
        from safetensors import safe_open

        self.handles: dict[str, Any] = {}
        for shard in _shard_paths(path):
            handle = stack.enter_context(safe_open(str(shard), framework="pt"))
            for key in handle.keys():
                self.handles[key] = handle

    def find(self, name: str) -> str | None:
        for candidate in (name, f"model.{name}", name.removeprefix("model.")):
            if candidate in self.handles:
                return candidate
        return None

    def get(self, key: str) -> Tensor:
        tensor: Tensor = self.handles[key].get_tensor(key)
        return tensor

    def scale_for(self, key: str) -> Tensor | None:
        for candidate in (f"{key}_scale_inv", key.removesuffix(".weight") + ".scale"):
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
            if tuple(raw.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"tensor {key}: checkpoint shape {tuple(raw.shape)}, model expects {tuple(param.shape)}"
                )
            scale = index.scale_for(key) if raw.dtype == torch.float8_e4m3fn else None
            param.copy_(dequantize_weight(key, raw, scale, param.dtype))


def load_model(folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> CEDModel:
    """Build a `CEDModel` from a checkpoint folder holding `config.json`, `tokenizer.json` (needed
    when the config has Engram layers) and `*.safetensors`."""
    folder = Path(folder)
    config = ModelConfig.from_hf_json(folder)
    token_map = load_compressed_token_map(str(folder / "tokenizer.json"), config) if config.engram_layer_ids else None
    model = CEDModel(config, token_map).to(dtype=dtype)
    load_checkpoint(model, folder)
    return model.to(device).eval()
