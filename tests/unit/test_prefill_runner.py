"""The prefill runner (`cedserve.model.prefill_runner`) on a CPU, where it runs its pass eagerly: each
chunk equals `CEDModel.encode_chunk` of it (boundary states within float rounding, records the same
bytes but where that rounding crosses a quantization boundary) for chunks of several lengths padded to several buckets, from an empty state
and from one holding a prefix; the prefill engine with `runner = "on"` sends the eager engine's
records and first token. The captured graphs are checked on a GPU (test_prefill_runner_gpu.py).

The eager side attends on the paged path (`use_paged_attention("reference")`, the GPU's eager
path): its picks come from the same top-k as the runner's, so equal scores (the indexer's ReLU
makes ties at zero common with random weights) resolve alike; the dense path's `torch.topk` may
pick another of the tied entries, and the outputs then differ by more than rounding."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from decode_support import prompt, tiny
from near_ties import SEEDS, assert_close_but_near_ties, nudged_quantizers
from test_prefill_engine import Rig, kinds, make_rig

from cedserve.kernels.reference import unpack_index_key, unpack_main_kv, unpack_swa
from cedserve.model.network import CEDModel, EncodedChunk
from cedserve.model.paged_kv import load_state
from cedserve.model.prefill_runner import PrefillRunner, PrefillRunnerConfig, prefill_runner_bytes
from cedserve.model.state import SequenceState
from cedserve.prefill_workers.config import PrefillWorkerConfig
from cedserve.serving.worker_model import LoadedModel

STREAMS_ATOL = 1e-5
"""Boundary streams (|values| < 1 on the tiny model): the runner's fused projections and dense
device MoE round differently from the modules (measured: <= 2e-7), where no near-tie is reached."""
FLIP_MARGIN = 2.0
"""Where one is, a row may differ by this many times what the nudges moved rows (`near_ties`)."""
STEP = 0.34
"""A record row that rounded a near-tie apart decodes within one E2M1 step of the other: the grid's
widest (4 -> 6) is a third of its block's largest magnitude."""

Records = dict[int, tuple[torch.Tensor, torch.Tensor]]
"""KV source layer -> (main KV records, index-key records)."""


def reachable_rows(want: Records, nudged: Callable[[], Records]) -> Records:
    """Per layer and kind, bool per record row: whether some nudged rerun (`near_ties`) writes other
    bytes there, i.e. a near-tie reaches it."""
    reach = {layer: (torch.zeros(m.shape[0], dtype=torch.bool), torch.zeros(k.shape[0], dtype=torch.bool))
             for layer, (m, k) in want.items()}
    for seed in range(SEEDS):
        with nudged_quantizers(seed):
            other = nudged()
        for layer, rows in reach.items():
            for j in (0, 1):
                rows[j].logical_or_(other[layer][j].ne(want[layer][j]).any(dim=-1))
    return reach


def assert_records_within_ties(
    want: Records, got: Records, nudged: Callable[[], Records], what: object
) -> None:
    """The same bytes in every row no near-tie reaches (`reachable_rows`, computed only if some row
    differs); the others within one quantization step (`STEP`)."""
    assert want.keys() == got.keys(), what
    for layer in want:
        for j in (0, 1):
            assert got[layer][j].shape == want[layer][j].shape, (what, layer, j)
    if all(torch.equal(want[layer][j], got[layer][j]) for layer in want for j in (0, 1)):
        return
    reach = reachable_rows(want, nudged)
    for layer in want:
        for j, decode in ((0, unpack_main_kv), (1, unpack_index_key)):
            a, b = want[layer][j], got[layer][j]
            differ = (a != b).any(dim=-1)
            stray = differ & ~reach[layer][j]
            assert not bool(stray.any()), (what, layer, j, "rows no near-tie reaches differ", stray.nonzero().flatten())
            values = decode(a)
            bound = STEP * values.abs().amax(dim=-1, keepdim=True) + 1e-6
            assert bool(((decode(b) - values).abs() <= bound).all()), (what, layer, j)


def chunk_records(chunk: EncodedChunk) -> Records:
    return {layer: (kv.main, kv.index_keys) for layer, kv in chunk.global_kv.items()}


def boundary_rows(chunk: EncodedChunk) -> torch.Tensor:
    """`[n, hc * hidden + hc]`: each token's boundary streams and pre-mix."""
    return torch.cat([chunk.boundary.streams.flatten(1), chunk.boundary.pre_mix], dim=-1)


def assert_same_chunk(eager: EncodedChunk, ran: EncodedChunk, rerun: Callable[[], EncodedChunk]) -> bool:
    """`ran` is `eager` but where float noise rounds a near-tie apart; `rerun()` recomputes `eager`.
    Returns whether they agree without one (the same records, boundary rows within STREAMS_ATOL)."""
    assert eager.boundary.start == ran.boundary.start and torch.equal(
        eager.boundary.positions, ran.boundary.positions
    )
    assert_close_but_near_ties(
        boundary_rows(eager), boundary_rows(ran), lambda: boundary_rows(rerun()), STREAMS_ATOL, FLIP_MARGIN, "boundary"
    )
    for layer, want in eager.global_kv.items():
        assert ran.global_kv[layer].first_entry == want.first_entry, layer
    assert_records_within_ties(chunk_records(eager), chunk_records(ran), lambda: chunk_records(rerun()), "chunk")
    close = bool(((boundary_rows(eager) - boundary_rows(ran)).abs() <= STREAMS_ATOL).all())
    return close and same_records(chunk_records(eager), chunk_records(ran))


def assert_same_state(
    eager: SequenceState, exported: SequenceState, ran: Records, encoder_layers: int, tied: bool
) -> None:
    """The runner's exported state: the eager state's position and Engram history, the records the
    runner's chunks wrote (`ran`, already compared with the eager ones), windows within one
    quantization step of the eager ones (their rows are the chunks' last tokens') and pending groups
    within float noise, or where a near-tie was rounded apart (`tied`), within one step's reach."""
    assert exported.position == eager.position
    for layer in range(encoder_layers):
        want, got = unpack_swa(eager.swa[layer]), unpack_swa(exported.swa[layer])
        assert got.shape == want.shape, layer
        assert bool(((got - want).abs() <= STEP * want.abs().amax(-1, keepdim=True) + 1e-6).all()), layer
    assert torch.equal(exported.engram_tail, eager.engram_tail)
    for layer, kv in eager.global_kv.items():
        got = exported.global_kv[layer]
        assert torch.equal(got.main, ran[layer][0]) and torch.equal(got.index_keys, ran[layer][1]), layer
        assert got.main.shape == kv.main.shape, layer
        scale = float(kv.pending.kv.abs().amax()) if kv.pending.kv.numel() else 0.0
        atol = STEP * scale if tied else STREAMS_ATOL
        torch.testing.assert_close(got.pending.kv, kv.pending.kv, atol=atol, rtol=0)


@pytest.fixture
def model() -> Iterator[CEDModel]:
    m, _ = tiny()
    m.use_paged_attention("reference")
    yield m
    m.use_paged_attention(None)


def run_both(
    model: CEDModel, runner: PrefillRunner, tokens: Sequence[int], state: SequenceState, chunks: Sequence[int]
) -> None:
    slot = runner.acquire()
    assert slot is not None
    runner.load(slot, state)
    ran_records = {layer: (kv.main, kv.index_keys) for layer, kv in state.global_kv.items()}
    at, tied = state.position, False
    for n in chunks:
        span, before = tokens[at : at + n], copy.deepcopy(state)

        def rerun(span: Sequence[int] = span, before: SequenceState = before) -> EncodedChunk:
            return model.encode_chunk(span, copy.deepcopy(before))

        ran = runner.encode(slot, span)
        tied |= not assert_same_chunk(model.encode_chunk(span, state), ran, rerun)
        ran_records = {layer: (torch.cat([m, ran.global_kv[layer].main]), torch.cat([k, ran.global_kv[layer].index_keys]))
                       for layer, (m, k) in ran_records.items()}
        at += n
    assert runner.position(slot) == state.position == at
    assert_same_state(state, runner.export(slot), ran_records, model.config.num_encoder_layers, tied)
    runner.release(slot)


@pytest.mark.parametrize(
    ("buckets", "chunks"),
    [
        ((16, 32, 64), (37, 64, 16, 50)),  # padded to 64, full, the smallest, padded again
        ((64,), (1, 63, 64)),  # one row; a chunk that leaves the compressor's group open
        ((8, 24), (24, 7, 24, 1)),  # buckets that are not powers of two
    ],
)
def test_runner_chunks_equal_encode_chunk(
    model: CEDModel, buckets: tuple[int, ...], chunks: tuple[int, ...]
) -> None:
    runner = PrefillRunner(model, PrefillRunnerConfig(max_context=256, buckets=buckets))
    run_both(model, runner, prompt(sum(chunks), 3), model.new_state(), chunks)


def test_runner_continues_a_restored_prefix(model: CEDModel) -> None:
    """A state that already holds a prefix (as after a prefix-cache hit: records loaded, windows
    rebuilt by replay) goes into a slot, and the runner's chunks continue it as `encode_chunk` does."""
    tokens = prompt(160, 5)
    prefix = model.new_state()
    model.prefill(tokens[:67], prefix)  # an odd length: a partial group and a partial Engram history
    runner = PrefillRunner(model, PrefillRunnerConfig(max_context=256, buckets=(32, 64), max_slots=2))
    run_both(model, runner, tokens, copy.deepcopy(prefix), (32, 61))
    run_both(model, runner, tokens, copy.deepcopy(prefix), (1,))  # the slot is reused: a fresh load


def test_runner_refuses_what_it_cannot_run() -> None:
    model, _ = tiny()
    runner = PrefillRunner(model, PrefillRunnerConfig(max_context=64, buckets=(16, 32)))
    slot = runner.acquire()
    assert slot is not None and runner.acquire() is None  # one slot
    runner.load(slot, model.new_state())
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        runner.encode(slot, prompt(33, 1))
    with pytest.raises(ValueError, match="token ids must be in"):
        runner.encode(slot, [1, model.config.vocab_size])
    with pytest.raises(ValueError, match="no tokens"):
        runner.encode(slot, [])
    runner.encode(slot, prompt(32, 1))
    runner.encode(slot, prompt(30, 2))
    with pytest.raises(ValueError, match="do not fit"):
        runner.encode(slot, prompt(3, 3))
    with pytest.raises(ValueError, match="increasing"):
        PrefillRunnerConfig(max_context=64, buckets=(32, 16))


def test_runner_config_fields() -> None:
    with pytest.raises(ValueError, match=r"prefill\.runner\b"):
        PrefillWorkerConfig(runner="fast")
    with pytest.raises(ValueError, match=r"prefill\.runner_buckets"):
        PrefillWorkerConfig(chunk_tokens=8192, runner="auto", runner_buckets=(512, 4096))
    PrefillWorkerConfig(chunk_tokens=8192, runner="off", runner_buckets=(512, 4096))  # unused: fine


def received(rig: Rig, lease: str, num_tokens: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The prompt's records as the decode worker received them (a block's bytes past the prompt's
    last entry are whatever the prefill side's block held before)."""
    blocks = list(rig.decode.receiver().wait(lease, 1).block_ids)
    state = rig.model.new_state()
    load_state(rig.layout, rig.decode_pool, blocks, num_tokens, state)
    return {layer: (kv.main, kv.index_keys) for layer, kv in state.global_kv.items()}


Outcome = tuple[int, int, Records]
"""A request's first token, its cached tokens, and its records as the decode worker received them."""


def engine_outcomes(loaded: LoadedModel, runner: str) -> list[Outcome]:
    """Two requests, the second a prefix hit, then two more at once (the first takes the runner's
    only slot, so the second runs eagerly), through an engine with `prefill.runner = runner`."""
    first = prompt(200, 1)
    second = first[:128] + prompt(100, 3)
    rig = next(make_rig(loaded, "reference", runner=runner, runner_buckets=(32, 64)))
    assert (rig.engine.runner is not None) == (runner == "on")
    results = []
    for rid, tokens in (("a", first), ("b", second)):
        events = rig.run(rig.submit(rid, tokens))
        assert kinds(events) == ["first_token", "done"]
        ft = events[0].first_token
        results.append((ft.token_id, ft.cached_tokens, received(rig, f"lease-{rid}", len(tokens))))
    both = [rig.submit("c", prompt(150, 7)), rig.submit("d", prompt(90, 8))]  # c takes the slot
    for job in both:
        events = rig.run(job)
        results.append(
            (events[0].first_token.token_id, 0, received(rig, f"lease-{job.request_id}", job.spec.prompt_len))
        )
    if runner == "on":
        assert rig.engine.runner is not None and rig.engine.runner.num_free == 1
        assert [job.eager for job in both] == [False, True]
    rig.assert_all_free()
    rig.cache.close()
    return results


def test_engine_with_the_runner_sends_the_eager_engines_records(loaded: LoadedModel) -> None:
    """Two requests, the second a prefix hit, through an engine with the runner (one slot) and one
    without: the same first tokens and the same bytes in the decode worker's blocks. A third request
    runs while the first holds the only slot: it runs eagerly, with the same results.

    "The same" but where float noise rounds a near-tie apart (`near_ties`): the runner's
    projections round differently from the modules', so a record whose input lies that close to a
    quantization boundary may take the neighbouring code, and the step reaches later layers' and
    positions' records. So a record row may differ only if nudging the eager engine's quantizer
    inputs (as another rounding would) changes that row too, and then within one quantization step;
    a first token only to one a nudged eager engine also picks."""
    eager, ran = engine_outcomes(loaded, "off"), engine_outcomes(loaded, "on")
    # the prefix hit: 128 tokens shared, the last of their blocks recomputed for the 128-token replay
    # span (the suffix is 100), so the runner's first chunk meets a restored state and shared blocks
    assert ran[1][1] == 64
    assert [r[1] for r in ran] == [e[1] for e in eager]
    if all(e[0] == r[0] and same_records(e[2], r[2]) for e, r in zip(eager, ran)):
        return
    nudged = []
    for seed in range(SEEDS):
        with nudged_quantizers(seed):
            nudged.append(engine_outcomes(loaded, "off"))
    for i, (want, got) in enumerate(zip(eager, ran)):
        assert got[0] in {want[0]} | {n[i][0] for n in nudged}, (i, got[0], want[0])
        runs = iter([n[i][2] for n in nudged])  # reachable_rows reads them in seed order
        assert_records_within_ties(want[2], got[2], lambda runs=runs: next(runs), i)


def same_records(a: Records, b: Records) -> bool:
    return a.keys() == b.keys() and all(torch.equal(x, y) for k in a for x, y in zip(a[k], b[k]))


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    from cedserve.serving.worker_model import load_worker_model

    return load_worker_model(None, "tiny", seed=0)


def test_runner_bytes_counts_what_the_pools_allocate() -> None:
    model, _ = tiny()
    config = PrefillRunnerConfig(max_context=300, buckets=(16, 48), max_slots=2)
    assert prefill_runner_bytes(model.config, config) == PrefillRunner(model, config).pools.nbytes
