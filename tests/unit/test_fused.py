"""The slot step's fused chains (`cedserve.model.fused`) and stacked MoE weights (`cedserve.model.device_moe`)
against the modules they stand for, float32 on a CPU, fresh random inputs each.

Tolerances: where the math is the same and only the summation order differs (one GEMM over
concatenated weights instead of two, the shared expert summed with the routed ones) the outputs agree
to float32 rounding, ATOL = RTOL = 1e-5; the grouped MoE runs in bf16 (`kernels.moe`), compared at
bf16's resolution. `torch.compile` of the compressor step (it writes its pending rings in place) is
checked against the same function as written."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from cedserve.model.attention import Attention
from cedserve.model.compressor import Compressor
from cedserve.model.config import AttentionMode, ModelConfig
from cedserve.model.device_moe import DeviceMoE
from cedserve.model.fused import (
    ARGMAX_TOPK,
    FusedOps,
    global_kv,
    pick_topk,
    route_topk,
    route_with_shared,
    window_slots,
)
from cedserve.model.indexer import INDEX_QUANT_BLOCK, Indexer
from cedserve.model.moe import MoE, route
from cedserve.model.presets import preset
from cedserve.model.rope import RopeTable, apply_rope

pytestmark = pytest.mark.unit

ATOL = RTOL = 1e-5
"""Same math, another summation order (float32)."""


@pytest.fixture
def config() -> ModelConfig:
    return preset("tiny").replace(swiglu_limit=0.5)  # the clamps bite at 0.5 with std-0.2 weights


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_dense_moe_with_the_shared_expert_stacked_equals_the_module(config: ModelConfig, rows: int) -> None:
    """The shared expert as expert E of the stacked weights, weight 1, in the same GEMMs as the routed
    ones: the module's output (routed experts it picks plus the separate shared expert)."""
    moe = MoE(config)
    _randomize(moe, rows)
    x = torch.randn(rows, config.hidden_size, generator=torch.Generator().manual_seed(rows))
    device_moe = DeviceMoE(moe, "dense")
    w13, w2 = device_moe.dense
    assert w13.shape == (config.n_routed_experts + 1, 2 * config.moe_intermediate_size, config.hidden_size)
    assert torch.equal(w13[-1], torch.cat([moe.shared_experts.w1.weight, moe.shared_experts.w3.weight]))
    assert torch.equal(w2[-1], moe.shared_experts.w2.weight)
    with torch.no_grad():
        torch.testing.assert_close(device_moe(x, FusedOps(compiled=False)), moe(x), atol=ATOL, rtol=RTOL)


def test_shared_expert_alone_as_the_extra_expert(config: ModelConfig) -> None:
    """With every routed expert's weights zero, the stacked layer is exactly the shared expert."""
    moe = MoE(config)
    _randomize(moe, 1)
    with torch.no_grad():
        for expert in moe.experts:
            for p in expert.parameters():
                p.zero_()
        x = torch.randn(7, config.hidden_size, generator=torch.Generator().manual_seed(2))
        got = DeviceMoE(moe, "dense")(x, FusedOps(compiled=False))
        torch.testing.assert_close(got, moe.shared_experts(x), atol=ATOL, rtol=RTOL)


def test_grouped_moe_with_the_shared_expert_stacked_equals_the_module(config: ModelConfig) -> None:
    """Grouped mode: the shared expert is pair k of every row in `moe_experts` (bf16 weights)."""
    moe = MoE(config)
    _randomize(moe, 3)
    x = torch.randn(6, config.hidden_size, generator=torch.Generator().manual_seed(3))
    device_moe = DeviceMoE(moe, "grouped")
    assert device_moe.grouped[0].num_experts == config.n_routed_experts + 1
    with torch.no_grad():
        want = moe(x.bfloat16().float())
        got = device_moe(x.bfloat16().float(), FusedOps(compiled=False))
    torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0.02)


def test_route_with_shared_appends_expert_e_weight_one(config: ModelConfig) -> None:
    moe = MoE(config)
    _randomize(moe, 4)
    x = torch.randn(3, config.hidden_size)
    c = config
    weights, indices = route_with_shared(x, moe.gate.weight, moe.gate.bias, c.scoring_func, c.gate_temp,
                                         c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor)
    want_w, want_i = route(x, moe.gate.weight, moe.gate.bias, config)
    assert torch.equal(indices[:, :-1], want_i) and torch.equal(weights[:, :-1], want_w)
    assert (indices[:, -1] == c.n_routed_experts).all() and (weights[:, -1] == 1).all()


@pytest.mark.parametrize(("experts", "k"), [(8, 1), (8, 2), (16, 4), (9, 3), (64, 4), (8, 6)])
def test_pick_topk_by_argmax_picks_topks_experts_in_descending_order(experts: int, k: int) -> None:
    """`pick_topk`'s rounds of argmax pick what `topk` picks, largest first; past `ARGMAX_TOPK` it is
    `topk` itself. Fresh scores with distinct values, rows from 1 to 37."""
    gen = torch.Generator().manual_seed(experts * 10 + k)
    for rows in (1, 5, 37):
        scores = torch.randn(rows, experts, generator=gen)
        got = pick_topk(scores, k, by_argmax=True)
        want = scores.topk(k, dim=-1).indices  # sorted: descending
        if k <= ARGMAX_TOPK:
            assert torch.equal(got, want), (rows, got, want)
        else:
            assert torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values)
        assert got.dtype == torch.long and got.shape == (rows, k)


def test_pick_topk_by_argmax_breaks_ties_towards_the_lower_index() -> None:
    """Equal scores: the rounds take the lower index first and never the same expert twice."""
    scores = torch.tensor([[0.5, 0.9, 0.9, 0.1, 0.9], [0.0, 0.0, 0.0, 0.0, 0.0]])
    assert pick_topk(scores, 3, by_argmax=True).tolist() == [[1, 2, 4], [0, 1, 2]]


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_route_topk_by_argmax_equals_the_modules_routing(config: ModelConfig, scoring: str) -> None:
    """The compiled ops' routing (`by_argmax=True`, as written and under Inductor on this CPU) equals
    `moe.route` (sorted `topk`): the same experts in the same order, the same weights."""
    moe = MoE(config)
    _randomize(moe, 7)
    x = torch.randn(11, config.hidden_size, generator=torch.Generator().manual_seed(3))
    c = config
    rules = (scoring, c.gate_temp, c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor)
    want_w, want_i = route(x, moe.gate.weight, moe.gate.bias, dataclasses.replace(config, scoring_func=scoring))
    weights, indices = route_topk(x, moe.gate.weight, moe.gate.bias, *rules, by_argmax=True)
    assert torch.equal(indices, want_i) and torch.equal(weights, want_w)
    ops = FusedOps(compiled=True)
    with torch.no_grad():
        weights, indices = ops.route_with_shared(x, moe.gate.weight.detach().float(), moe.gate.bias.detach().float(),
                                                 *rules)
    assert torch.equal(indices[:, :-1], want_i)
    torch.testing.assert_close(weights[:, :-1], want_w, rtol=1e-6, atol=0)


def _compress_rope(config: ModelConfig) -> RopeTable:
    return RopeTable((config.rope_parameters or {})["compress"], config.head_dim, config.max_position_embeddings)


def _attention(config: ModelConfig, mode: AttentionMode) -> Attention:
    spec = next(s for s in config.layer_plan if s.mode is mode)
    attn = Attention(config, spec, _compress_rope(config))
    _randomize(attn, spec.layer_id)
    return attn


@pytest.mark.parametrize("mode", [AttentionMode.SWA, AttentionMode.FULL])
def test_project_over_concatenated_weights_equals_the_module(config: ModelConfig, mode: AttentionMode) -> None:
    """One GEMM over `[wq_a; wkv; weights_proj]`: `Attention._project` and the index head weights."""
    attn = _attention(config, mode)
    rows = 4
    x = torch.randn(rows, config.hidden_size)
    table = _compress_rope(config)
    cos, sin = table.cos_sin(torch.arange(rows) * 5)
    extra = [attn.indexer.weights_proj.weight] if attn.indexer is not None else []
    wa = torch.cat([attn.wq_a.weight, attn.wkv.weight, *extra])
    ops = FusedOps(compiled=False)
    with torch.no_grad():
        q_residual, q, kv, head_logits = ops.project(x, wa, config.q_lora_rank, attn.q_norm.weight, attn.wq_b.weight,
                                                     attn.kv_norm.weight, cos, sin, config.num_attention_heads,
                                                     config.rms_norm_eps, torch.float32)
        for got, want in zip((q_residual, q, kv), attn._project(x, cos, sin)):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        if attn.indexer is None:
            assert head_logits.shape == (rows, 0)
            return
        index_q, weights = ops.index_query(q_residual, attn.indexer.wq_b.weight, head_logits, cos, sin,
                                           attn.indexer.num_heads, INDEX_QUANT_BLOCK)
        torch.testing.assert_close(weights, attn.indexer.head_weights(x), atol=ATOL, rtol=RTOL)
        assert index_q.dtype == torch.bfloat16
        torch.testing.assert_close(index_q.float(), attn.indexer.query(q_residual, cos, sin), atol=0, rtol=0)


def test_window_slots_of_every_layer_equal_each_layer_alone() -> None:
    gen = torch.Generator().manual_seed(5)
    window, ring, layers, slots = 8, 10, 3, 4
    positions = torch.tensor([0, 3, 9, 40])
    rows = torch.tensor([2, 0, 3, 1])
    first = torch.randint(0, 12, (layers, slots), generator=gen)
    ring_slot, tables = window_slots(positions, rows, first, window, ring)
    assert torch.equal(ring_slot, rows * ring + positions % ring)
    for layer in range(layers):
        for b in range(4):
            p = int(positions[b])
            want = [int(rows[b]) * ring + k % ring if k >= 0 and k >= int(first[layer, rows[b]]) else -1
                    for k in range(p - window + 1, p + 1)]
            assert tables[layer, b].tolist() == want


def _global_kv_args(config: ModelConfig, ratio: int, gen: torch.Generator) -> tuple[object, ...]:
    rows, slots, dim = 5, 4, config.head_dim
    compressor = Compressor(config, ratio)
    indexer = Indexer(config, owns_keys=True)
    _randomize(compressor, ratio)
    _randomize(indexer, ratio + 1)
    assert indexer.wk is not None and indexer.k_norm is not None
    table = _compress_rope(config)
    ring = ratio + 1
    pending = (torch.randn(slots + 1, ring, dim, generator=gen), torch.randn(slots + 1, ring, dim, generator=gen)) \
        if ratio > 1 else (None, None)
    w = torch.cat([compressor.wkv.weight, compressor.wgate.weight]).detach() if compressor.wgate is not None \
        else compressor.wkv.weight.detach()
    # slot 1 feeds two rows (positions 6 and 7: one group), slot 4 is the scratch slot
    row_slots = torch.tensor([0, 1, 1, 2, 4])
    positions = torch.tensor([3, 6, 7, 10, 5])
    block_table = torch.arange(5 * 3, dtype=torch.int32).view(5, 3)
    return (torch.randn(rows, config.hidden_size, generator=gen), w, compressor.norm.weight.detach(),
            indexer.wk.weight.detach(), indexer.k_norm.weight.detach(), *pending, row_slots, positions,
            block_table[row_slots], slots, table.inv_freq, table.scaling, ratio, 4, config.rms_norm_eps), \
        (compressor, indexer, table)


@pytest.mark.parametrize("ratio", [1, 2])
def test_global_kv_equals_the_compressor_and_indexer(config: ModelConfig, ratio: int) -> None:
    """Each complete group's main KV and index keys as the modules compute them from its rows."""
    args, (compressor, indexer, table) = _global_kv_args(config, ratio, torch.Generator().manual_seed(6))
    x, positions, row_slots = args[0], args[8], args[7]
    before = [None if t is None else t.clone() for t in args[5:7]]  # type: ignore[union-attr]
    with torch.no_grad():
        main, keys, slot_map = global_kv(*args)  # type: ignore[arg-type]
        for b in range(x.shape[0]):
            p, slot = int(positions[b]), int(row_slots[b])
            complete = p % ratio == ratio - 1 and slot != 4
            assert (int(slot_map[b]) >= 0) == complete
            if not complete:
                continue
            if ratio == 1:
                latent = compressor.norm(compressor.wkv(x[b:b + 1]))
            else:  # the group's earlier row: this step's (slot 1) or the pending ring's
                projected = compressor.project(x)
                kv, gate = before[0][slot].clone(), before[1][slot].clone()  # type: ignore[index]
                for r in range(x.shape[0]):
                    if int(row_slots[r]) == slot:
                        kv[int(positions[r]) % kv.shape[0]] = projected.kv[r]
                        gate[int(positions[r]) % kv.shape[0]] = projected.gate[r]
                group = torch.arange(p - ratio + 1, p + 1) % kv.shape[0]
                latent = compressor.pool(kv[group], gate[group], x.dtype)
            cos, sin = table.cos_sin(torch.tensor([p - ratio + 1]))
            torch.testing.assert_close(main[b:b + 1], apply_rope(latent, cos, sin), atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(keys[b:b + 1], indexer.keys(latent, cos, sin), atol=ATOL, rtol=RTOL)
            entry = p // ratio
            assert int(slot_map[b]) == int(args[9][b, entry // 4]) * 4 + entry % 4  # type: ignore[index]
    if ratio > 1:
        written = args[5][row_slots, positions % args[5].shape[1]]  # type: ignore[index]
        torch.testing.assert_close(written[:4], F.linear(x[:4], args[1][:config.head_dim]), atol=ATOL, rtol=RTOL)


def test_compiled_global_kv_writes_its_rings_as_written(config: ModelConfig) -> None:
    """`FusedOps(compiled=True).global_kv` (the ring writes eager, the rest compiled by Inductor):
    the rings and outputs of the function as written."""
    eager, _ = _global_kv_args(config, 2, torch.Generator().manual_seed(7))
    compiled, _ = _global_kv_args(config, 2, torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = global_kv(*eager)  # type: ignore[arg-type]
        got = FusedOps(compiled=True).global_kv(*compiled)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(compiled[5], eager[5], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(compiled[6], eager[6], atol=ATOL, rtol=RTOL)


def test_a_cpu_runner_runs_the_chains_as_written() -> None:
    """`compile_fused` compiles only on CUDA: a CPU runner asked for it runs the functions as written.
    No server's CPU path loads Inductor code, whose CPU kernels follow ATEN_CPU_CAPABILITY while its
    FX-graph cache key leaves that out (tests/conftest.py: a shared cache gave NaN under another ISA)."""
    from decode_support import tiny

    from cedserve.model import fused
    from cedserve.model.runner import ModelRunner, RunnerConfig

    runner = ModelRunner(tiny()[0], RunnerConfig(max_slots=2, max_context=64, compile_fused=True))
    ops = runner.slot_step.ops
    assert ops.project is fused.project and ops.dense_moe is fused.dense_moe
    assert ops.global_kv.keywords["from_rings"] is fused.global_kv_from_rings


def test_engram_hashes_equal_the_hashers_own_ids_compiled_or_not() -> None:
    """`fused.engram_hashes` (the history gather, masks and hash arithmetic the decode step compiles)
    on fresh random id rings: bit-exact with the hasher's `hash_ids` over each row's known history,
    and `FusedOps(compiled=True)`'s (Inductor on this CPU) bit-exact with the function as written.
    Rows sit at positions with every count of known ids (0 to N-1) and with ring wrap-around."""
    from cedserve.model.engram import EngramHasher
    from cedserve.model.fused import engram_hashes

    config = preset("tiny")
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    gen = torch.Generator().manual_seed(seed)
    vocab = config.engram_compressed_vocab_size
    hasher = EngramHasher(config, torch.randint(0, vocab, (config.vocab_size,), generator=gen).tolist())
    keep, slots_n, ring = config.engram_max_ngram_size - 1, 12, config.engram_max_ngram_size - 1 + 2
    ids = torch.randint(0, vocab, (slots_n, ring), generator=gen)
    first = torch.randint(0, 40, (slots_n,), generator=gen)
    slots = torch.randperm(slots_n, generator=gen)[:10]
    positions = first[slots] + torch.arange(10) % (keep + 2)  # 0 .. keep + 1 known ids
    compressed = torch.randint(0, vocab, (10,), generator=gen)
    args = (compressed, slots, positions, ids, first, keep, hasher.multipliers, hasher.primes, hasher.offsets,
            hasher.pad_id)
    want = engram_hashes(*args)
    for b in range(10):
        p, s = int(positions[b]), int(slots[b])
        known = min(keep, p - int(first[s]))
        history = torch.tensor([int(ids[s, q % ring]) for q in range(p - known, p)], dtype=torch.long)
        own = hasher.hash_ids(history.unsqueeze(0), compressed[b:b + 1].view(1, 1), start=known)
        assert torch.equal(want[b], own[0, 0]), f"seed {seed}, row {b}: {known} known ids"
    assert torch.equal(FusedOps(compiled=True).engram_hashes(*args), want), f"seed {seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engram_mix_compiled_equals_the_module_against_float64(dtype: torch.dtype) -> None:
    """`FusedOps.engram` (`engram_mix`, which the decode step compiles) on fresh random streams and
    table rows: as written it is the module's forward bit for bit; compiled (Inductor on this CPU) and
    as written both sit within the dtype's rounding of the module run in float64 (float32: 1e-5
    relative to the output's scale; bf16: two ulps of bf16 at that scale, the final cast's rounding)."""
    from cedserve.model.engram import Engram

    config = preset("tiny")
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    gen = torch.Generator().manual_seed(seed)
    engram = Engram(config, rows=64, with_table=False)
    with torch.no_grad():
        for p in engram.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    columns = (config.engram_max_ngram_size - 1) * config.engram_n_heads
    streams = torch.randn(9, config.hc_mult, config.hidden_size, generator=gen).to(dtype)
    rows = torch.randn(9, columns, config.engram_head_dim, generator=gen)
    with torch.no_grad():
        want64 = copy.deepcopy(engram).double()(streams.double(), rows.double())
        module = engram.to(dtype)(streams, rows)
        args = (streams, rows, engram.wkv.weight, engram.q_weight, engram.k_weight, engram.eps)
        plain = FusedOps(compiled=False).engram(*args)
        compiled = FusedOps(compiled=True).engram(*args)
    assert torch.equal(plain, module), f"seed {seed}"
    scale = want64.abs().max().item()
    bound = 1e-5 * scale if dtype == torch.float32 else 2 * 2.0**-8 * scale
    for got in (plain, compiled):
        assert got.dtype == dtype and got.shape == streams.shape
        err = (got.double() - want64).abs().max().item()
        assert err <= bound, f"seed {seed}: max error {err:.3g} > {bound:.3g}"
