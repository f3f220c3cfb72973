"""mHC, MoE routing, Engram hashing, RoPE and the indexer's selections, against direct
computations on small hand-made inputs."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cedserve.model.config import ModelConfig
from cedserve.model.engram import EngramHasher, hash_multipliers, is_prime, table_primes
from cedserve.model.indexer import select_candidate_blocks, select_topk
from cedserve.model.mhc import hc_collapse, hc_expand, hc_mixes, sinkhorn
from cedserve.model.moe import MoE, route
from cedserve.model.rope import RopeTable, apply_rope

pytestmark = pytest.mark.unit


def _tiny_config(**changes: object) -> ModelConfig:
    """The fixture's geometry without reading the fixture (hidden 128, 8 experts top-2, ...)."""
    base = ModelConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=12, num_attention_heads=4, head_dim=64,
        q_lora_rank=64, qk_rope_head_dim=16, o_groups=2, o_lora_rank=64, sliding_window=8,
        compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1), kv_source_layer_ids=(2, 6),
        index_source_layer_ids=(2, 6, 8, 10), candidate_source_layer_id=6, candidate_topk_blocks=4,
        candidate_block_size=2, index_n_heads=16, index_head_dim=32, index_topk=8,
        moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
        engram_layer_ids=(1, 5), engram_vocab_size=100, engram_num_embeddings=(1524, 2304),
        engram_n_heads=4, engram_head_dim=32, engram_compressed_vocab_size=423,
        dspark_target_layer_ids=(9, 10, 11), num_nextn_predict_layers=1,
    )
    return dataclasses.replace(base, **changes) if changes else base


# ------------------------------------------------------------------ mHC


def test_sinkhorn_is_doubly_stochastic() -> None:
    torch.manual_seed(0)
    # Unit-scale logits, like the trained mixes: 20 iterations converge to float32 rounding.
    # (Columns are normalised last, so they are exact; rows converge.)
    m = sinkhorn(torch.randn(6, 4, 4), iters=20, eps=1e-6)
    assert (m > 0).all()
    torch.testing.assert_close(m.sum(dim=-2), torch.ones(6, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(m.sum(dim=-1), torch.ones(6, 4), atol=1e-4, rtol=0)


def test_hc_mixes_ranges_and_expand_collapse() -> None:
    torch.manual_seed(1)
    hc, dim, tokens = 4, 16, 5
    streams = torch.randn(tokens, hc, dim)
    fn = torch.randn((2 + hc) * hc, hc * dim) * 0.1
    mix = hc_mixes(streams, fn, torch.ones(3), torch.zeros((2 + hc) * hc), 20, 1e-6, 1e-20)
    assert ((mix.pre > 0) & (mix.pre <= 1 + 1e-6)).all()
    assert ((mix.post > 0) & (mix.post < 2)).all()
    x = torch.randn(tokens, dim)
    out = hc_expand(x, streams, mix.post, mix.comb)
    for k in range(hc):
        direct = mix.post[:, k, None] * x + sum(mix.comb[:, j, k, None] * streams[:, j] for j in range(hc))
        torch.testing.assert_close(out[:, k], direct, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hc_collapse(streams, mix.pre), (mix.pre.unsqueeze(-1) * streams).sum(1))


# ------------------------------------------------------------------ MoE


def test_route_equals_direct_computation() -> None:
    config = _tiny_config()
    torch.manual_seed(2)
    x, weight, bias = torch.randn(9, 128), torch.randn(8, 128) * 0.1, torch.randn(8) * 0.5
    weights, indices = route(x, weight, bias, config)
    for t in range(x.shape[0]):
        scores = [math.sqrt(math.log1p(math.exp(float(x[t] @ weight[e])))) for e in range(8)]
        chosen = sorted(range(8), key=lambda e: scores[e] + float(bias[e]), reverse=True)[:2]
        assert sorted(indices[t].tolist()) == sorted(chosen)
        total = sum(scores[e] for e in chosen)
        for slot, e in enumerate(indices[t].tolist()):
            assert weights[t, slot].item() == pytest.approx(scores[e] / total * 1.5, rel=1e-5)


def test_moe_output_equals_sum_over_selected_experts() -> None:
    config = _tiny_config()
    torch.manual_seed(3)
    moe = MoE(config)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(5, 128)
    weights, indices = route(x, moe.gate.weight, moe.gate.bias, config)

    def expert(i: int | None, v: torch.Tensor) -> torch.Tensor:
        e = moe.shared_experts if i is None else moe.experts[i]
        gate = (v @ e.w1.weight.t()).clamp(max=10.0)
        up = (v @ e.w3.weight.t()).clamp(-10.0, 10.0)
        return (F.silu(gate) * up) @ e.w2.weight.t()

    with torch.no_grad():
        got = moe(x)
        for t in range(5):
            want = expert(None, x[t]) + sum(
                weights[t, s] * expert(int(indices[t, s]), x[t]) for s in range(2)
            )
            torch.testing.assert_close(got[t], want, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ Engram


def test_primes_fill_the_configured_tables() -> None:
    config = _tiny_config()
    assert [p for p in range(90, 130) if is_prime(p)] == [97, 101, 103, 107, 109, 113, 127]
    assert is_prime(2**61 - 1) and not is_prime(2**61 + 1)
    primes = table_primes(config)
    assert primes[0][0] == [101, 103, 107, 109]
    assert [sum(sum(row) for row in layer) for layer in primes] == list(config.engram_num_embeddings)


def test_hash_matches_hand_computation_and_is_deterministic() -> None:
    config = _tiny_config()
    token_map = [(7 * i) % 423 for i in range(512)]
    hasher = EngramHasher(config, token_map)
    tokens = torch.tensor([5, 300, 42, 42, 9])
    ids = hasher.hash_ids(torch.zeros(0, dtype=torch.long), hasher.compress(tokens), start=0)
    assert ids.shape == (5, 2, 12)
    assert torch.equal(ids, EngramHasher(config, token_map).hash_ids(torch.zeros(0, dtype=torch.long),
                                                                     hasher.compress(tokens), 0))
    # Layer 1 (index 0), position 3: look-back ids c[3], c[2], c[1], c[0]; pad id from token 2.
    bound = (np.iinfo(np.int64).max // 423) // 2
    mult = [int(v) * 2 + 1 for v in np.random.default_rng(10007 * 1).integers(0, bound, size=4, dtype=np.int64)]
    assert hash_multipliers((1,), 4, 423)[0].tolist() == mult
    compressed = [token_map[t] for t in tokens.tolist()]
    rolling, expected, offset = compressed[3] * mult[0], [], 0
    primes = table_primes(config)[0]
    for n in range(1, 4):
        rolling ^= compressed[3 - n] * mult[n]
        for p in primes[n - 1]:
            expected.append(rolling % p + offset)
            offset += p
    assert ids[3, 0].tolist() == expected
    # Position 0 has no history: its look-back slots hold the pad token's id.
    pad = token_map[config.engram_pad_id]
    first = (compressed[0] * mult[0]) ^ (pad * mult[1])
    assert ids[0, 0, 0].item() == first % primes[0][0]


def test_hash_with_carried_history_equals_one_shot() -> None:
    config = _tiny_config()
    hasher = EngramHasher(config, list(range(423)) + [0] * 89)
    compressed = hasher.compress(torch.tensor([11, 12, 13, 14, 15, 16, 17]))
    whole = hasher.hash_ids(torch.zeros(0, dtype=torch.long), compressed, 0)
    tail = hasher.hash_ids(compressed[1:4], compressed[4:], 4)
    assert torch.equal(tail, whole[4:])


# ------------------------------------------------------------------ RoPE and selection


def test_rope_inverse_and_partial_channels() -> None:
    table = RopeTable({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}, 64, 4096)
    cos, sin = table.cos_sin(torch.arange(5))
    x = torch.randn(5, 64)
    rotated = apply_rope(x, cos, sin)
    assert torch.equal(rotated[:, :48], x[:, :48])
    torch.testing.assert_close(apply_rope(rotated, cos, sin, inverse=True), x, atol=1e-6, rtol=0)
    # Channel pair (48, 49) rotates at angle position * theta^0.
    angle = torch.arange(5.0)
    torch.testing.assert_close(rotated[:, 48], x[:, 48] * angle.cos() - x[:, 49] * angle.sin())


def test_yarn_keeps_high_frequencies_and_interpolates_low() -> None:
    params = {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.25, "factor": 16,
              "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 256, "attention_factor": 1.0}
    table = RopeTable(params, 64, 4096)
    plain = 1.0 / (160000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert table.inv_freq[0] == plain[0]
    torch.testing.assert_close(table.inv_freq[-1], plain[-1] / 16)


def test_topk_and_candidate_blocks() -> None:
    inf = float("inf")
    scores = torch.tensor([[3.0, 1.0, 2.0, -inf, -inf, -inf], [0.5, 4.0, 1.0, 2.0, 3.0, -1.0]])
    picked = select_topk(scores, 4)
    assert picked[0].tolist() == [True, True, True, False, False, False]  # -inf never picked
    assert picked[1].tolist() == [False, True, True, True, True, False]
    visible = torch.tensor([[3], [6]])
    pool = select_candidate_blocks(scores, visible, topk_blocks=1, block_size=2)
    # One block each: the newest visible block is always kept.
    assert pool[0].tolist() == [False, False, True, True, False, False]
    assert pool[1].tolist() == [False, False, False, False, True, True]
