"""The prefill runner on a GPU: each bucket's captured graph replays the eager chunk pass (several chunk
lengths, two slots, a restored prefix), and the runner's chunks equal `encode_chunk` on the paged
kernels within the kernels' bound. Skipped without CUDA (`PART=prefill-runner bash scripts/gpu.sh`
runs them, then times the engine with and without the runner)."""

from __future__ import annotations

import copy

import pytest
import torch
from decode_support import prompt, tiny

from cedserve.kernels.reference import unpack_main_kv
from cedserve.model.network import CEDModel, EncodedChunk
from cedserve.model.prefill_runner import PrefillRunner, PrefillRunnerConfig

pytestmark = [
    pytest.mark.unit,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GRAPH_ATOL = 1e-5
"""Graph replay vs the same pass run eagerly: the same kernels on the same values."""
KERNEL_ATOL = 0.25
"""Runner vs `encode_chunk`, both on the kernels (bf16 attention): as the decode runner's bound."""
CHUNKS = (37, 64, 16, 128, 5)


def cuda_model() -> CEDModel:
    model, _ = tiny()
    model = copy.deepcopy(model).cuda()
    model.use_paged_attention("kernels")
    return model


def run_chunks(runner: PrefillRunner, slot: int, tokens: list[int]) -> list[EncodedChunk]:
    out, at = [], runner.position(slot)
    for n in CHUNKS:
        out.append(runner.encode(slot, tokens[at : at + n]))
        at += n
    return out


def test_graph_replay_equals_the_eager_pass_every_bucket() -> None:
    model = cuda_model()
    config = PrefillRunnerConfig(max_context=1024, buckets=(16, 64, 128), max_slots=2)
    graphs, eager = (
        PrefillRunner(model, config),
        PrefillRunner(model, PrefillRunnerConfig(**{**config.__dict__, "cuda_graphs": False})),
    )
    assert graphs.capture().buckets == (16, 64, 128)
    tokens = prompt(600, 4)
    prefix = model.new_state()
    model.prefill(tokens[:67], prefix)
    for slot, state in ((0, model.new_state()), (1, prefix)):  # slot 1 continues a restored prefix
        for runner in (graphs, eager):
            runner.load(slot, copy.deepcopy(state))
        for got, want in zip(run_chunks(graphs, slot, tokens), run_chunks(eager, slot, tokens)):
            torch.testing.assert_close(got.boundary.streams, want.boundary.streams, atol=GRAPH_ATOL, rtol=0)
            torch.testing.assert_close(got.boundary.pre_mix, want.boundary.pre_mix, atol=GRAPH_ATOL, rtol=0)
            for layer, rec in want.global_kv.items():
                assert torch.equal(got.global_kv[layer].main, rec.main), layer
                assert torch.equal(got.global_kv[layer].index_keys, rec.index_keys), layer
    torch.cuda.synchronize()


def test_runner_equals_encode_chunk_on_the_kernels() -> None:
    model = cuda_model()
    runner = PrefillRunner(model, PrefillRunnerConfig(max_context=1024, buckets=(16, 64, 128)))
    runner.capture()
    tokens = prompt(300, 6)
    state = model.new_state()
    slot = runner.acquire()
    assert slot is not None
    runner.load(slot, state)
    at = 0
    for n in CHUNKS:
        got, want = runner.encode(slot, tokens[at : at + n]), model.encode_chunk(tokens[at : at + n], state)
        at += n
        torch.testing.assert_close(got.boundary.streams, want.boundary.streams, atol=KERNEL_ATOL, rtol=0)
        for layer, rec in want.global_kv.items():
            assert got.global_kv[layer].first_entry == rec.first_entry
            torch.testing.assert_close(
                unpack_main_kv(got.global_kv[layer].main),
                unpack_main_kv(rec.main),
                atol=KERNEL_ATOL,
                rtol=0.05,
            )
    assert runner.export(slot).position == state.position == at
