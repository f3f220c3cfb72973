"""Random real-format checkpoints: written in the released layout and loaded back faithfully."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cedserve.kernels.weight_formats import dequantize_fp4_weight, dequantize_fp8_weight
from cedserve.model.checkpoint import CheckpointError, load_model
from cedserve.model.checkpoint_writer import load_drafter, random_model, write_random_checkpoint
from cedserve.model.presets import preset
from cedserve.model.tokenizer import tiny_tokenizer_path


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt_fp8")
    write_random_checkpoint(preset("tiny"), folder, seed=11, quantize=True)
    return folder


def test_unquantized_round_trip_is_exact(tmp_path: Path) -> None:
    config = write_random_checkpoint(preset("tiny"), tmp_path, seed=5, quantize=False)
    loaded, drafter = load_model(tmp_path), load_drafter(tmp_path, config)
    fresh, fresh_drafter = random_model(config, tiny_tokenizer_path(), 5)
    tokens = torch.randint(3, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    assert torch.equal(loaded.prefill(tokens, loaded.new_state()), fresh.prefill(tokens, fresh.new_state()))
    for (name, a), (_, b) in zip(drafter.state_dict().items(), fresh_drafter.state_dict().items()):
        assert torch.equal(a, b), name


def test_released_formats_are_written(fp8_folder: Path) -> None:
    with safe_open(str(fp8_folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        expert = "model.layers.3.ffn.experts.1.w1.weight"
        assert f.get_tensor(expert).dtype == torch.uint8 and f.get_tensor(expert + "_scale").dtype == torch.uint8
        wkv = "model.layers.2.attn.wkv.weight"
        assert f.get_tensor(wkv).dtype == torch.float8_e4m3fn and wkv + "_scale_inv" in names
        assert f.get_tensor("model.layers.2.hc_attn_fn").dtype == torch.float32
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
    assert any(n.startswith("dspark.markov.") for n in names)
    for required in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (fp8_folder / required).is_file()


def test_loader_dequantizes_what_was_written(fp8_folder: Path) -> None:
    model = load_model(fp8_folder)
    raw = load_file(str(fp8_folder / "model.safetensors"))
    got = dict(model.named_parameters())
    wkv = "layers.2.attn.wkv.weight"
    expected = dequantize_fp8_weight(raw[f"model.{wkv}"], raw[f"model.{wkv}_scale_inv"])
    assert torch.equal(got[wkv], expected)
    w1 = "layers.3.ffn.experts.1.w1.weight"
    assert torch.equal(got[w1], dequantize_fp4_weight(raw[f"model.{w1}"], raw[f"model.{w1}_scale"]))


def test_missing_and_misshaped_tensors_are_named(fp8_folder: Path, tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((fp8_folder / name).read_bytes())
    tensors = load_file(str(fp8_folder / "model.safetensors"))
    missing = dict(tensors)
    del missing["model.layers.4.attn.wq_a.weight"]
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.4\.attn\.wq_a\.weight"):
        load_model(tmp_path)
    bad = dict(tensors)
    bad["model.norm.weight"] = torch.ones(7)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"norm\.weight"):
        load_model(tmp_path)
