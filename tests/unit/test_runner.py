"""The model runner (`cedserve.model.runner`) and its slot step (`cedserve.model.slot_step`):
buckets and staging, slot pools that load and export states unchanged, and the static, sync-free
step equal to `CEDModel.forward_batch` on the paged reference path, step after step, with rows
joining and leaving and padded buckets that leave other slots untouched.

On a CPU the runner runs its step eagerly (no graphs); the GPU tests (tests/kernels/test_runner_gpu.py)
compare graph replays with this eager path."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from decode_support import tiny

from cedserve.model.device_sampling import sample_rows, uniform_noise
from cedserve.model.network import BatchItem, CEDModel
from cedserve.model.runner import ModelRunner, RunnerConfig, batch_buckets
from cedserve.model.sampling import SamplingParams, probabilities
from cedserve.model.state import SequenceState

pytestmark = pytest.mark.unit

ATOL = 2e-4
"""Runner vs `forward_batch` logits, both float32 on the kernels' torch references (seen ~1e-6:
the same values summed in another order; the dense MoE sums every expert, zeros included)."""


@pytest.fixture
def model() -> Iterator[CEDModel]:
    m, _ = tiny()
    m.use_paged_attention("reference")
    yield m
    m.use_paged_attention(None)


def prefilled(model: CEDModel, length: int, gen: torch.Generator) -> tuple[SequenceState, int]:
    state = model.new_state()
    tokens = torch.randint(3, 500, (length,), generator=gen).tolist()
    logits = model.prefill(tokens, state)
    return state, int(logits[-1].argmax())


def test_buckets() -> None:
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert batch_buckets(1) == (1,)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert batch_buckets(256) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    with pytest.raises(ValueError, match="buckets"):
        RunnerConfig(max_slots=8, buckets=(1, 4))
    with pytest.raises(ValueError, match="max_slots"):
        RunnerConfig(max_slots=0)


def test_load_export_round_trip(model: CEDModel) -> None:
    gen = torch.Generator().manual_seed(1)
    runner = ModelRunner(model, RunnerConfig(max_slots=3, max_context=256))
    for slot, length in enumerate([5, 37, 70]):  # windows part full and full; pending groups; tails
        state, _ = prefilled(model, length, gen)
        runner.load(slot, state)
        back = runner.export(slot)
        assert back.position == state.position
        for layer, rows in state.swa.items():
            assert torch.equal(back.swa[layer], rows), layer
        for layer, kv in state.global_kv.items():
            got = back.global_kv[layer]
            assert torch.equal(got.main, kv.main) and torch.equal(got.index_keys, kv.index_keys)
            assert torch.equal(got.pending.kv, kv.pending.kv) and torch.equal(got.pending.gate, kv.pending.gate)
        assert torch.equal(back.engram_tail, state.engram_tail)


def test_step_equals_forward_batch(model: CEDModel) -> None:
    """Four sequences of different lengths, six steps, one leaving after two and one joining
    after three: logits within ATOL of `forward_batch`'s and the same greedy tokens every step."""
    gen = torch.Generator().manual_seed(2)
    runner = ModelRunner(model, RunnerConfig(max_slots=6, max_context=256))
    seqs = {}
    for slot, length in enumerate([3, 17, 40, 101]):
        state, token = prefilled(model, length, gen)
        runner.load(slot, copy.deepcopy(state))
        seqs[slot] = [state, token]
    joiner = prefilled(model, 64, gen)
    for step in range(6):
        if step == 2:
            seqs.pop(1)
        if step == 3:
            runner.load(5, copy.deepcopy(joiner[0]))
            seqs[5] = list(joiner)
        slots = sorted(seqs)
        items = [BatchItem([seqs[s][1]], seqs[s][0], taps=True) for s in slots]
        outs = model.forward_batch(items)
        expected = torch.cat([out.logits for out in outs])
        got, taps = runner.step_outputs(slots, [seqs[s][1] for s in slots])
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(taps, torch.cat([out.taps for out in outs]), atol=ATOL, rtol=0)
        tokens = expected.argmax(-1).tolist()
        assert got.argmax(-1).tolist() == tokens
        for s, t in zip(slots, tokens):
            seqs[s][1] = t
    for slot in seqs:  # the pools hold what the states hold (records to float noise: compare decoded)
        back, state = runner.export(slot), seqs[slot][0]
        assert back.position == state.position
        for layer, kv in state.global_kv.items():
            assert back.global_kv[layer].num_entries == kv.num_entries
            torch.testing.assert_close(back.global_kv[layer].main_values(), kv.main_values(), atol=0.1, rtol=0.05)


def test_padding_leaves_other_slots_alone(model: CEDModel) -> None:
    """Three rows run in the bucket of 4: the padding row writes only the scratch slot."""
    gen = torch.Generator().manual_seed(3)
    runner = ModelRunner(model, RunnerConfig(max_slots=4, max_context=128))
    for slot in range(4):
        runner.load(slot, prefilled(model, 20 + slot, gen)[0])
    before = runner.export(3)
    runner.step([0, 1, 2], [5, 6, 7])
    after = runner.export(3)
    assert after.position == before.position
    assert all(torch.equal(after.swa[i], before.swa[i]) for i in before.swa)
    assert runner.position(0) == 21


def test_step_checks_input(model: CEDModel) -> None:
    runner = ModelRunner(model, RunnerConfig(max_slots=2, max_context=32))
    with pytest.raises(ValueError, match="max_rows_per_slot"):
        runner.step([0, 0], [1, 2])
    wide = ModelRunner(model, RunnerConfig(max_slots=2, max_context=32, max_rows_per_slot=3))
    with pytest.raises(ValueError, match="not adjacent"):
        wide.step([0, 1, 0], [1, 2, 3])
    with pytest.raises(ValueError, match="cannot go"):
        wide.rewind(0, 5)
    with pytest.raises(ValueError, match="token id"):
        runner.step([0], [100_000])
    with pytest.raises(ValueError, match="slot 5"):
        runner.step([5], [1])
    with pytest.raises(ValueError, match="does not fit"):
        runner.load(0, prefilled(model, 40, torch.Generator().manual_seed(0))[0])


def test_device_sampling_distribution() -> None:
    """Greedy rows take the argmax; sampled rows follow `probabilities` (temperature, top-k, top-p)
    within a total-variation bound over 4,000 counters; no draw outside the kept set."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 16, generator=gen) * 2
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
                   SamplingParams(temperature=1.0, top_p=0.6)):
        n = 4000
        rows = logits.expand(n, -1)
        tokens = sample_rows(rows, torch.full((n,), params.temperature), torch.full((n,), params.top_k),
                             torch.full((n,), params.top_p), torch.full((n,), 1234), torch.arange(n))
        want = probabilities(logits[0], params)
        got = torch.bincount(tokens, minlength=16).float() / n
        assert (got[want == 0] == 0).all(), params
        assert 0.5 * (got - want).abs().sum() < 0.04, params
    greedy = sample_rows(logits, torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.ones(1),
                         torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    assert greedy.item() == logits.argmax().item()
    noise = uniform_noise(torch.tensor([7, 7, 8]), torch.tensor([1, 1, 1]), 64)
    assert torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert bool((noise > 0).all() and (noise < 1).all())


def test_verify_rows_and_rollback_equal_forward_batch(model: CEDModel) -> None:
    """Chunks of 1-4 rows per slot (an anchor and drafts, or carried tokens) in one step, and half
    of them rolled back afterwards (the engine restores the state from before the chunk; the runner
    only rewinds the position): logits and taps within ATOL of `forward_batch` over eight steps."""
    gen = torch.Generator().manual_seed(6)
    runner = ModelRunner(model, RunnerConfig(max_slots=4, max_context=256, max_rows_per_slot=4))
    seqs = {}
    for slot, length in enumerate([6, 33, 64, 90]):
        state, _ = prefilled(model, length, gen)
        runner.load(slot, copy.deepcopy(state))
        seqs[slot] = state
    for _ in range(8):
        chunks = {s: torch.randint(3, 500, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist()
                  for s in seqs}
        starts = {s: seqs[s].position for s in seqs}
        outs = model.forward_batch([BatchItem(chunks[s], seqs[s], taps=True, snapshot=True) for s in seqs])
        rows = [s for s in seqs for _ in chunks[s]]
        got, taps = runner.step_outputs(rows, [t for s in seqs for t in chunks[s]])
        torch.testing.assert_close(got, torch.cat([o.logits for o in outs]), atol=ATOL, rtol=0)
        torch.testing.assert_close(taps, torch.cat([o.taps for o in outs]), atol=ATOL, rtol=0)
        for s, out in zip(seqs, outs):
            if bool(torch.rand(1, generator=gen) < 0.5):  # rejected: back to before the chunk
                assert out.snapshot is not None
                seqs[s].restore(out.snapshot)
                runner.rewind(s, starts[s])
            assert runner.position(s) == seqs[s].position
