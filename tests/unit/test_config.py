"""Model config: loads a released-format config.json unchanged, derives the plan, names bad fields."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cedserve.model.cache.config import KVCacheConfig
from cedserve.model.config import AttentionMode, LayerRole, ModelConfig
from cedserve.model.presets import PRESETS, preset, stretch_context
from cedserve.serving.config import ServeConfig

RELEASED = Path(__file__).parents[1] / "fixtures" / "v41_flash_config.json"


def _released_text() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RELEASED.read_text())["text_config"]
    return data


def test_released_config_loads_and_matches_preset() -> None:
    loaded = ModelConfig.from_hf_json(RELEASED)
    assert loaded == preset("v4.1-flash")
    assert loaded.layer_plan == preset("v4.1-flash").layer_plan
    assert "quantization_config" in loaded.ignored_fields
    assert loaded.rope_parameters is not None and loaded.rope_parameters["compress"]["rope_type"] == "yarn"


def test_released_plan() -> None:
    plan = preset("v4.1-flash").layer_plan
    modes = {s.layer_id: s.mode for s in plan}
    assert [i for i, m in modes.items() if m is AttentionMode.FULL] == [2, 8, 14, 20]
    assert [i for i, m in modes.items() if m is AttentionMode.REINDEX] == [24, 28, 32, 36]
    assert [i for i, m in modes.items() if m is AttentionMode.SWA] == [0, 1]
    assert sum(m is AttentionMode.REUSE for m in modes.values()) == 30
    assert all(s.role is LayerRole.ENCODER for s in plan[:20])
    assert all(s.role is LayerRole.DECODER for s in plan[20:])
    # Reuse layers borrow KV and top-k from the latest sources before them.
    assert (plan[9].kv_layer, plan[9].index_layer) == (8, 8)
    assert (plan[27].kv_layer, plan[27].index_layer) == (20, 24)
    assert (plan[39].kv_layer, plan[39].index_layer) == (20, 36)
    assert preset("v4.1-flash").num_encoder_layers == 20


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_keep_the_mode_pattern(name: str) -> None:
    config = preset(name)
    modes = {s.mode for s in config.layer_plan}
    assert modes == set(AttentionMode)
    roles = [s.role for s in config.layer_plan]
    assert roles == sorted(roles, key=lambda r: r is LayerRole.DECODER)  # encoder then decoder
    assert ModelConfig.from_hf_json(config.to_hf_dict()) == config


def test_mini40_keeps_released_geometry() -> None:
    mini, full = preset("mini-40"), preset("v4.1-flash")
    assert mini.layer_plan == full.layer_plan
    assert (mini.head_dim, mini.qk_rope_head_dim, mini.index_head_dim) == (512, 64, 128)
    assert mini.hidden_size < full.hidden_size and mini.n_routed_experts < full.n_routed_experts


def test_stretch_context_raises_the_yarn_factor_to_cover_long_prompts() -> None:
    mini = preset("mini-40")  # 4,096 original positions x 16 = 65,536
    assert stretch_context(mini, 65_536) is mini
    long = stretch_context(mini, 100_000)
    assert long.max_position_embeddings == 131_072 and long.rope_scaling is not None
    assert long.rope_scaling["factor"] == 32 and long.rope_scaling["original_max_position_embeddings"] == 4096
    assert long.rope_parameters is not None and long.rope_parameters["compress"]["factor"] == 32  # re-derived


def test_unknown_preset_lists_known() -> None:
    with pytest.raises(ValueError, match="tiny"):
        preset("nope")


BAD_CASES: list[tuple[dict[str, Any], str]] = [
    ({"compress_ratios": [0, 0, 2]}, "compress_ratios"),
    ({"kv_source_layer_ids": [0, 20]}, "kv_source_layer_ids"),  # layer 0 is SWA-only
    ({"kv_source_layer_ids": [2, 8, 14]}, "kv_source_layer_ids"),  # no m=1 decoder source
    ({"index_source_layer_ids": [2, 8, 14, 20, 41]}, "index_source_layer_ids"),
    ({"index_source_layer_ids": [1, 2, 8, 14, 20]}, "index_source_layer_ids"),
    ({"candidate_source_layer_id": 9}, "candidate_source_layer_id"),
    ({"hidden_size": "wide"}, "hidden_size"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"o_groups": 7}, "o_groups"),
    ({"engram_num_embeddings": [1, 2, 3]}, "engram_num_embeddings"),
    ({"dspark_target_layer_ids": [37, 38, 40]}, "dspark_target_layer_ids"),
    ({"scoring_func": "relu"}, "scoring_func"),
]


@pytest.mark.parametrize(("change", "field"), BAD_CASES)
def test_bad_config_names_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_json({**_released_text(), **change})


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        ModelConfig.from_hf_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_hf_json(tmp_path)


def test_serve_config_block_size_must_fit_the_plan(tmp_path: Path) -> None:
    model = preset("v4.1-flash")
    ServeConfig().validate_against(model)
    with pytest.raises(ValueError, match="block_size"):
        ServeConfig(cache=KVCacheConfig(block_size=63)).validate_against(model)
    with pytest.raises(ValueError, match="candidate block"):
        ServeConfig(cache=KVCacheConfig(block_size=4)).validate_against(model)  # candidate block is 8 tokens


def test_serve_config_files(tmp_path: Path) -> None:
    toml = tmp_path / "serve.toml"
    toml.write_text('port = 7000\n[cache]\nblock_size = 128\nnum_blocks = 10\n[model]\npreset = "mini-40"\n')
    config = ServeConfig.load(toml)
    assert (config.port, config.cache.block_size, config.model.load_config()) == (7000, 128, preset("mini-40"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"cache": {"block_size": "big"}}')
    with pytest.raises(ValueError, match=r"block_size"):
        ServeConfig.load(bad)
    bad.write_text('{"cache": {"num_blocks": -1}}')
    with pytest.raises(ValueError, match=r"num_blocks"):
        ServeConfig.load(bad)
    bad.write_text('{"cahce": {}}')
    with pytest.raises(ValueError, match="cahce"):
        ServeConfig.load(bad)


def test_env_overrides_are_read_in_one_place() -> None:
    config = ServeConfig().with_env_overrides({"CEDSERVE_PORT": "9000", "CEDSERVE_CHECKPOINT": "/ckpt"})
    assert config.port == 9000 and config.model.checkpoint == "/ckpt"
    with pytest.raises(ValueError, match="CEDSERVE_PORT"):
        ServeConfig().with_env_overrides({"CEDSERVE_PORT": "x"})


def test_engram_tables_must_match_their_buckets() -> None:
    from cedserve.model.engram import check_table_sizes

    for name in PRESETS:
        check_table_sizes(preset(name))
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        check_table_sizes(preset("mini-40").replace(engram_num_embeddings=(6000, 6000)))
