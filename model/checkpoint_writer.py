"""Write checkpoints in the released layout (config.json, tokenizer.json, safetensors with FP8 and
FP4 weights): tiny random ones for tests, and trained ones (`write_checkpoint`, used by the demo
trainer, `training/trainer.py`).

Formats written (what `checkpoint.load_checkpoint` reads back):

* 2-D linear weights (`*.weight` of attention, shared experts, Engram `wkv`, DSpark layers, the LM
  head and embedding excluded): FP8 E4M3 with `*.weight_scale_inv`, one power-of-two (UE8M0) scale
  per 128 x 128 tile.
* Routed expert weights (`*.experts.E.w{1,2,3}.weight`): FP4 E2M1 packed two per byte with
  `*.weight_scale` (UE8M0 per 32 input channels), as the released experts are.
* Everything else (norms, mHC mixes, sinks, router gate and biases, embeddings, LM head, Engram
  tables): float32; with `half_floats` the large float matrices (embedding, LM head, Engram tables,
  DSpark's Markov head) are bf16, as the released checkpoint stores them.

`stored_format` names each parameter's format; `snap_to_stored_formats` rounds a model's parameters
to them in place, so a trained model in memory and its written checkpoint give the same logits.

Random init follows the reference fixture's recipe: N(0, initializer_range) for matrices, and the
parameters an init would leave constant (norm weights, sinks, router biases, mHC bases and scales,
Engram q/k weights) perturbed so that mix-ups show.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from enum import Enum
from pathlib import Path

import torch
from torch import Tensor, nn

from cedserve.kernels.weight_formats import quantize_fp4_weight, quantize_fp8_weight
from cedserve.model.config import ModelConfig
from cedserve.model.dspark import Drafter
from cedserve.model.network import CEDModel
from cedserve.model.tokenizer import build_compressed_token_map, fit_config_to_tokenizer, tiny_tokenizer_path

_PERTURBED = ("norm.weight", "attn_sink", "gate.bias", "gate.bias_vl", "hc_attn_base", "hc_ffn_base",
              "hc_attn_scale", "hc_ffn_scale", "q_weight", "k_weight")
_FLOAT32_MATRICES = ("embed.weight", "lm_head.weight", "gate.weight", "hc_attn_fn", "hc_ffn_fn",
                     "engram.embed.weight", "engram.embed.scale", "markov.w1", "markov.w2")


def init_random_(module: nn.Module, std: float, generator: torch.Generator) -> None:
    """In-place random init of every parameter (see the module docstring)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
            if name.endswith(("hc_attn_scale", "hc_ffn_scale", "q_weight", "k_weight")) or "norm.weight" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(_PERTURBED):
                p.copy_(0.1 * noise)
            elif name.endswith("embed.scale"):
                p.fill_(1.0)
            else:
                p.copy_(std * noise)


def random_model(config: ModelConfig, tokenizer_json: Path, seed: int) -> tuple[CEDModel, Drafter]:
    """A randomly initialised backbone and drafter for `config` (fitted to the tokenizer)."""
    from tokenizers import Tokenizer

    token_map, _ = build_compressed_token_map(Tokenizer.from_file(str(tokenizer_json)))
    model = CEDModel(config, token_map if config.engram_layer_ids else None)
    drafter = Drafter(config)
    gen = torch.Generator().manual_seed(seed)
    init_random_(model, config.initializer_range, gen)
    init_random_(drafter, config.initializer_range, gen)
    return model.eval(), drafter.eval()


def _is_expert(name: str) -> bool:
    return ".experts." in name and name.endswith(".weight")


_HALF_MATRICES = ("embed.weight", "lm_head.weight", "markov.w1", "markov.w2")
"""Float matrices `half_floats` stores as bf16 (`embed.weight` covers the Engram tables too)."""


class StoredFormat(str, Enum):
    """How the checkpoint stores one parameter."""

    FP8 = "fp8"  # E4M3, one power-of-two scale per 128 x 128 tile
    FP4 = "fp4"  # E2M1, one UE8M0 scale per 32 input channels (routed experts)
    BF16 = "bf16"
    F32 = "f32"


def stored_format(name: str, shape: Sequence[int], quantize: bool = True, half_floats: bool = False) -> StoredFormat:
    """The format of parameter `name` (checkpoint or module name) of `shape` (module docstring)."""
    if quantize and _is_expert(name) and len(shape) == 2 and shape[1] % 32 == 0:
        return StoredFormat.FP4
    if quantize and len(shape) == 2 and name.endswith(".weight") and not name.endswith(_FLOAT32_MATRICES):
        return StoredFormat.FP8
    if half_floats and name.endswith(_HALF_MATRICES):
        return StoredFormat.BF16
    return StoredFormat.F32


def encode_tensors(named: dict[str, Tensor], quantize: bool, half_floats: bool = False) -> dict[str, Tensor]:
    """Checkpoint tensors for float parameters: FP8/FP4 where the released layout quantizes."""
    out: dict[str, Tensor] = {}
    for name, value in named.items():
        value = value.detach().float().contiguous()
        fmt = stored_format(name, value.shape, quantize, half_floats)
        if fmt is StoredFormat.FP4:
            out[name], out[name + "_scale"] = quantize_fp4_weight(value)
        elif fmt is StoredFormat.FP8:
            out[name], out[name + "_scale_inv"] = quantize_fp8_weight(value)
        elif fmt is StoredFormat.BF16:
            out[name] = value.to(torch.bfloat16)
        else:
            out[name] = value
    return out


def snap_to_stored_formats(module: nn.Module, half_floats: bool = True) -> None:
    """Round every parameter of `module` to its stored format in place (quantize, then dequantize
    as the loader does): the model in memory then equals the checkpoint written from it."""
    from cedserve.model.checkpoint import dequantize_weight

    with torch.no_grad():
        for name, param in module.named_parameters():
            encoded = encode_tensors({name: param}, True, half_floats)
            scale = encoded.get(name + "_scale", encoded.get(name + "_scale_inv"))
            param.copy_(dequantize_weight(name, encoded[name], scale, param.dtype))


def checkpoint_tensors(model: CEDModel, drafter: Drafter | None) -> dict[str, Tensor]:
    """Every parameter under its checkpoint name: `model.*` (the LM head at `lm_head.weight`) and
    `dspark.*` for the drafter."""
    named = {f"model.{k}" if k != "lm_head.weight" else k: v for k, v in model.state_dict().items()}
    if drafter is not None:
        named.update({f"dspark.{k}": v for k, v in drafter.state_dict().items()})
    return named


def write_checkpoint(model: CEDModel, drafter: Drafter | None, folder: str | Path, tokenizer_json: Path,
                     metadata: dict[str, str] | None = None, quantize: bool = True, half_floats: bool = False) -> None:
    """Write `model` (and `drafter`) as a checkpoint folder: config.json, tokenizer.json,
    generation_config.json and model.safetensors. The folder is created; existing files of the
    same names are replaced (the weights atomically: written beside, then renamed)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    tensors = {k: v.cpu() for k, v in encode_tensors(checkpoint_tensors(model, drafter), quantize, half_floats).items()}
    tmp = folder / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt", "writer": "cedserve", **(metadata or {})})
    tmp.replace(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=1))
    if Path(tokenizer_json).resolve() != (folder / "tokenizer.json").resolve():
        shutil.copyfile(tokenizer_json, folder / "tokenizer.json")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id, "do_sample": False}))


def write_random_checkpoint(config: ModelConfig, folder: str | Path, seed: int = 0, quantize: bool = True,
                            tokenizer_json: Path | None = None) -> ModelConfig:
    """Write a random checkpoint of `config` into `folder`; returns the config as written
    (its Engram vocabulary fitted to the tokenizer). The folder is created; existing files of the
    same names are replaced atomically (written beside, then renamed)."""
    tokenizer_json = tokenizer_json or tiny_tokenizer_path()
    config = fit_config_to_tokenizer(config, tokenizer_json)
    model, drafter = random_model(config, tokenizer_json, seed)
    write_checkpoint(model, drafter, folder, tokenizer_json, {"seed": str(seed)}, quantize)
    return config


def load_drafter(folder: str | Path, config: ModelConfig, dtype: torch.dtype = torch.float32) -> Drafter:
    """The DSpark drafter stored under `dspark.*` in a checkpoint folder, its weights in `dtype` (its
    sinks and router biases float32, as the backbone's: `checkpoint.cast_weights`)."""
    from cedserve.model.checkpoint import cast_weights, load_checkpoint

    holder = nn.Module()
    holder.dspark = cast_weights(Drafter(config), dtype)
    load_checkpoint(holder, folder)
    drafter = holder.dspark
    assert isinstance(drafter, Drafter)
    return drafter.eval()
