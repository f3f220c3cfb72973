"""Named model plans: the released geometry and smaller plans with the same layer pattern.

- `v4.1-flash`: the released DeepSeek-V4.1-Flash numbers (the `ModelConfig` defaults).
- `mini-40`: the released 40-layer plan (same sources, ratios, 512/64/128 head geometry, window 128)
  with a narrow residual stream and few experts, so a GPU runs the real attention shapes cheaply.
- `tiny`: the same mode pattern (SWA, m=2 encoder group, m=1 decoder group, Reindex and Reuse
  layers, a candidate pool, Engram, one draft layer) in 12 layers, fast enough for CPU tests.
- `demo`: the tiny layer plan at the width of the shipped trained checkpoint
  (`cedserve/assets/demo`, `python -m cedserve.training.demo`): a 4,096-token code tokenizer, a 32-token window
  (so bounded replay of 128 or 256 tokens is an approximation: the exact span is 375), top-32 sparse
  attention inside a 64-entry candidate pool.
"""

from __future__ import annotations

from collections.abc import Callable

from cedserve.model.config import ModelConfig


def _v41_flash() -> ModelConfig:
    return ModelConfig()


def _mini_40() -> ModelConfig:
    return ModelConfig(
        vocab_size=512,  # the shipped tiny tokenizer's vocabulary
        hidden_size=256,
        num_attention_heads=4,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=128,
        index_n_heads=4,
        index_topk=64,
        candidate_topk_blocks=16,
        moe_intermediate_size=128,
        n_routed_experts=8,
        num_experts_per_tok=2,
        engram_vocab_size=1000,
        engram_num_embeddings=(6126, 6332),  # the sums of each layer's table primes
        engram_n_heads=2,
        engram_head_dim=32,
        engram_compressed_vocab_size=440,  # what that tokenizer normalises to
        num_nextn_predict_layers=3,
        dspark_noise_token_id=511,
        dspark_markov_rank=32,
        dspark_n_routed_experts=8,
        dspark_num_experts_per_tok=2,
        max_position_embeddings=65536,
        rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 4096},
    )


def _tiny() -> ModelConfig:
    return ModelConfig(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=12,
        num_attention_heads=4,
        head_dim=64,
        q_lora_rank=64,
        qk_rope_head_dim=16,
        o_groups=2,
        o_lora_rank=64,
        sliding_window=8,
        compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0),
        kv_source_layer_ids=(2, 6),
        index_source_layer_ids=(2, 6, 8, 10),
        candidate_source_layer_id=6,
        candidate_topk_blocks=4,
        candidate_block_size=2,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=8,
        moe_intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        engram_layer_ids=(1, 5),
        engram_vocab_size=100,
        engram_num_embeddings=(1524, 2304),
        engram_n_heads=4,
        engram_head_dim=32,
        engram_compressed_vocab_size=423,
        num_nextn_predict_layers=1,
        dspark_noise_token_id=511,
        dspark_target_layer_ids=(9, 10, 11),
        dspark_markov_rank=32,
        dspark_n_routed_experts=8,
        dspark_num_experts_per_tok=2,
        max_position_embeddings=4096,
        rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 256},
        pad_token_id=2,
    )


def _demo() -> ModelConfig:
    return _tiny().replace(
        vocab_size=4096,  # the demo tokenizer's; ids 0-3 are bos, eos, pad and the draft noise token
        sliding_window=32,
        candidate_topk_blocks=16,
        candidate_block_size=4,
        index_topk=32,
        engram_vocab_size=300,
        engram_num_embeddings=(4064, 4944),  # the sums of each layer's table primes
        dspark_noise_token_id=3,
        max_position_embeddings=8192,
        rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 512},
        rope_parameters=None,
    )


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "v4.1-flash": _v41_flash,
    "mini-40": _mini_40,
    "tiny": _tiny,
    "demo": _demo,
}


def preset(name: str) -> ModelConfig:
    """The named preset; `ValueError` lists the known names."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None


def stretch_context(config: ModelConfig, num_tokens: int) -> ModelConfig:
    """`config` reaching at least `num_tokens` positions: YaRN's factor raised to the power of two that
    covers them over its original length (long-prompt benchmarks of the small presets; weights are
    random there, so only the shapes matter). Unchanged when it already reaches that far."""
    if num_tokens <= config.max_position_embeddings:
        return config
    scaling = dict(config.rope_scaling or {})
    original = int(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)
    factor = 1 << max(0, (-(-num_tokens // original) - 1).bit_length())
    scaling.update(rope_type=scaling.get("rope_type", "yarn"), factor=factor, original_max_position_embeddings=original)
    return config.replace(max_position_embeddings=original * factor, rope_scaling=scaling, rope_parameters=None)


def released_attention(config: ModelConfig) -> ModelConfig:
    """`config` with the released checkpoint's attention and index geometry (64 heads x 512, 32 index
    heads, top-512 inside a pool of 2,048 candidate blocks) on its narrow residual stream: a small
    preset that runs the kernels at the released shapes (benchmarks and GPU tests)."""
    return config.replace(num_attention_heads=64, index_n_heads=32, index_topk=512, candidate_topk_blocks=2048)
