"""Checkpoint loading: prefixed or bare names, and errors that name the offending tensor."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from safetensors.torch import load_file, save_file

from cedserve.kernels.weight_formats import quantize_fp4_weight, quantize_fp8_weight
from cedserve.model.checkpoint import CheckpointError, load_checkpoint, load_model
from cedserve.model.config import ModelConfig
from cedserve.model.network import CEDModel

if TYPE_CHECKING:
    from conftest import ReferenceA

pytestmark = pytest.mark.unit


def _small_model() -> CEDModel:
    config = ModelConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, head_dim=32,
        q_lora_rank=16, qk_rope_head_dim=8, o_groups=1, o_lora_rank=16, sliding_window=4,
        compress_ratios=(0, 2, 1), kv_source_layer_ids=(1, 2), index_source_layer_ids=(1, 2),
        candidate_source_layer_id=-1, index_n_heads=2, index_head_dim=32, index_topk=4,
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, engram_layer_ids=(),
        engram_num_embeddings=(), dspark_target_layer_ids=(2,), num_nextn_predict_layers=0,
    )
    model = CEDModel(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.1)
    return model


def _save(model: CEDModel, path: Path, prefix_body: bool, drop: str | None = None,
          reshape: str | None = None) -> None:
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == drop:
            continue
        value = tensor.clone()[:1] if name == reshape else tensor.clone()
        key = f"model.{name}" if prefix_body and name != "lm_head.weight" else name
        tensors[key] = value.contiguous()
    save_file(tensors, str(path))


@pytest.mark.parametrize("prefix_body", [True, False])
def test_loads_prefixed_and_bare_names(tmp_path: Path, prefix_body: bool) -> None:
    source = _small_model()
    _save(source, tmp_path / "model.safetensors", prefix_body)
    target = CEDModel(source.config)
    load_checkpoint(target, tmp_path)
    for (name, a), (_, b) in zip(source.state_dict().items(), target.state_dict().items()):
        assert torch.equal(a, b), name
    tokens = [1, 2, 3, 4, 5]
    assert torch.equal(source.prefill(tokens, source.new_state()), target.prefill(tokens, target.new_state()))


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    source = _small_model()
    _save(source, tmp_path / "model.safetensors", True, drop="layers.1.attn.compressor.wgate.weight")
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.compressor\.wgate\.weight"):
        load_checkpoint(CEDModel(source.config), tmp_path / "model.safetensors")


def test_misshaped_tensor_is_named(tmp_path: Path) -> None:
    source = _small_model()
    _save(source, tmp_path / "model.safetensors", True, reshape="layers.2.attn.indexer.wk.weight")
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.attn\.indexer\.wk\.weight: checkpoint shape"):
        load_checkpoint(CEDModel(source.config), tmp_path)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_quantized_weights_load_through_weight_formats(tmp_path: Path, fmt: str) -> None:
    source = _small_model()
    _save(source, tmp_path / "model.safetensors", True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.ffn.experts.0.w1.weight"
    if fmt == "fp8":
        tensors[name], tensors[f"{name}_scale_inv"] = quantize_fp8_weight(tensors[name])
    else:
        tensors[name], tensors[f"{name}_scale"] = quantize_fp4_weight(tensors[name])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    target = CEDModel(source.config)
    load_checkpoint(target, tmp_path)
    loaded = target.state_dict()["layers.1.ffn.experts.0.w1.weight"]
    original = source.state_dict()["layers.1.ffn.experts.0.w1.weight"]
    assert loaded.shape == original.shape
    torch.testing.assert_close(loaded, original, atol=0.05, rtol=0.3)
    del tensors[f"{name}_scale_inv" if fmt == "fp8" else f"{name}_scale"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight .* no scale"):
        load_checkpoint(CEDModel(source.config), tmp_path)


def test_bfloat16_load_keeps_float32_mixing_parameters(reference_a: ReferenceA) -> None:
    """bf16 weights run end to end; the tensors the reference keeps in float32 stay float32.
    No bf16 reference exists, so only a loose agreement with float32 is asserted (logits have
    std ~0.22 here; bf16 rounding through 12 layers moves them by up to ~0.4)."""
    model = load_model(reference_a.folder, dtype=torch.bfloat16)
    float32_names = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert "layers.3.hc_ffn_fn" in float32_names and "layers.3.ffn.gate.bias" in float32_names
    assert "layers.3.attn.wkv.weight" not in float32_names
    prompt = reference_a.prompts[0]
    got = model.prefill(prompt, model.new_state())
    want = reference_a.tensor("logits_0")
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() < 1.0
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.5
