"""`CEDModel.forward_batch` (decode and verify chunks attending as one padded batch, long chunks and
replays alone) equals running each sequence's chunks by itself (`prefill` / `replay` on a copy of its
state): logits, every state update (windows, global KV records, compressors' partial groups, Engram
tail, position) and the snapshots taken for rollback.

Fresh random prompts and tokens, sequences of different lengths, windows that wrap (the tiny model's
window is 8), m = 2 and m = 1 compressors completing groups at different rows, float32 on CPU. The
batched pass may round differently from one sequence alone (other matmul shapes, padded keys): the
tolerances below say how far apart they may be.
"""

from __future__ import annotations

import copy

import pytest
import torch
from decode_support import tiny

from cedserve.model import attention
from cedserve.model.batch import PADDED_ROWS_LIMIT, BatchPass
from cedserve.model.kv_format import KVFormat
from cedserve.model.network import BatchItem, CEDModel
from cedserve.model.state import SequenceState

pytestmark = pytest.mark.unit

LOGITS_ATOL = 1e-3
"""Worst absolute logit difference allowed between the batched pass and one sequence alone. Seen:
~4e-7, and up to ~2e-4 for a chunk after a cached value of the same pass rounded the other way."""
LOGITS_NOISE = 1e-5
MAX_ROUNDED_AWAY = 0.1
"""With records, at most this fraction of the chunks may differ by more than `LOGITS_NOISE` (1 of 43
here)."""
PENDING_ATOL = 1e-3
"""Worst absolute difference of a partial group's float32 projections (seen: 1.4e-4, in a layer after
a cached value of the same pass rounded the other way; ~1e-7 otherwise)."""
MAX_FLIPPED = 0.05
"""Records (FP8 windows, FP4 global KV): a ~1e-7 difference before quantization rounds a value the
other way now and then (more often in later layers of a pass once one has). At most this fraction of
a layer's cached values may differ (by more than float noise; seen: 1 of 448), each by at most
`FLIP_SIZE` of the largest value in the layer. A wrong window, group or entry changes nearly all of
them, or the shapes."""
FLIP_SIZE = 0.15
BF16_STEPS = 2.0**-6
"""bf16 cached values (`KVFormat.BF16`) may differ by two bf16 steps of the value or of the layer's
largest value (seen: ~6% of a late layer's values differ; the differences before rounding grow
through a pass, to ~2e-4 absolute, once an earlier layer's value rounded the other way)."""


def assert_cached_close(got: torch.Tensor, want: torch.Tensor, fmt: KVFormat, what: str) -> None:
    assert got.shape == want.shape, what
    diff = (got - want).abs()
    if fmt is KVFormat.BF16:
        scale = float(want.abs().max()) if want.numel() else 0.0
        torch.testing.assert_close(got, want, rtol=BF16_STEPS, atol=BF16_STEPS * scale, msg=what)
        return
    flipped = diff > 1e-6 * want.abs() + 1e-7
    assert int(flipped.sum()) <= MAX_FLIPPED * want.numel(), f"{what}: {int(flipped.sum())} of {want.numel()} differ"
    if want.numel():
        assert diff.max() <= FLIP_SIZE * want.abs().max(), f"{what}: a value moved by {float(diff.max())}"


def assert_states_close(got: SequenceState, want: SequenceState) -> None:
    assert got.position == want.position
    assert torch.equal(got.engram_tail, want.engram_tail)
    fmt = want.kv_format
    for layer, rows in want.swa.items():
        assert_cached_close(got.decode_window(got.swa[layer]), want.decode_window(rows), fmt, f"window {layer}")
    for layer, source in want.global_kv.items():
        mine = got.global_kv[layer]
        assert mine.num_entries == source.num_entries, layer
        assert_cached_close(mine.main_values(), source.main_values(), fmt, f"main KV {layer}")
        assert_cached_close(mine.key_values(), source.key_values(), fmt, f"index keys {layer}")
        torch.testing.assert_close(mine.pending.kv, source.pending.kv, atol=PENDING_ATOL, rtol=0)
        torch.testing.assert_close(mine.pending.gate, source.pending.gate, atol=PENDING_ATOL, rtol=0)


def prefilled(model: CEDModel, length: int, gen: torch.Generator, kv_format: KVFormat) -> SequenceState:
    state = model.new_state(kv_format)
    model.prefill(torch.randint(3, 500, (length,), generator=gen).tolist(), state)
    return state


@pytest.mark.parametrize("kv_format", [KVFormat.RECORDS, KVFormat.BF16])
def test_batched_pass_equals_each_sequence_alone(kv_format: KVFormat, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = tiny()
    gen = torch.Generator().manual_seed(11)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 500, (n,), generator=gen).tolist()

    group_sizes: list[int] = []
    attend_padded = attention.Attention._attend_padded

    def spy(self: attention.Attention, *args: object) -> torch.Tensor:
        batch = args[-1]
        assert isinstance(batch, BatchPass)
        group_sizes.append(len(batch.padded))
        return attend_padded(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention.Attention, "_attend_padded", spy)
    lengths = [3, 7, 12, 19, 30]  # shorter and longer than the window; odd and even (m = 2 groups)
    states = [prefilled(model, n, gen, kv_format) for n in lengths]
    alone = [copy.deepcopy(s) for s in states]
    prompt = tokens(45)
    joining = model.new_state(kv_format)  # joins by replaying its prompt's last 20 tokens
    model.prefill(prompt, joining)
    joining_alone = copy.deepcopy(joining)
    fresh, fresh_alone = model.new_state(kv_format), model.new_state(kv_format)
    chunks = rounded_away = 0
    for step in range(6):
        # (state, the copy run alone, chunk, how: "prefill", "replay" or "verify" with a snapshot)
        plan: list[tuple[SequenceState, SequenceState, list[int], str]] = []
        for i, (state, copy_) in enumerate(zip(states, alone)):
            if (step + i) % 3 == 0:  # carry + verify (anchor and 3 drafts)
                plan += [(state, copy_, tokens(2), "prefill"), (state, copy_, tokens(4), "verify")]
            elif (step + i) % 3 == 1:  # a verify chunk of K + 1 = 6
                plan.append((state, copy_, tokens(6), "verify"))
            else:
                plan.append((state, copy_, tokens(1), "prefill"))
        if step == 1:  # a REPLAY join, then its first decode token in the same pass
            plan += [(joining, joining_alone, prompt[-20:], "replay"), (joining, joining_alone, tokens(1), "prefill")]
        if step == 2:  # a long chunk: runs alone
            plan.append((fresh, fresh_alone, tokens(PADDED_ROWS_LIMIT + 3), "prefill"))
        items = [BatchItem(chunk, state, replay=how == "replay", snapshot=how == "verify")
                 for state, _, chunk, how in plan]
        outputs = model.forward_batch(items)
        for out, (state, copy_, chunk, how) in zip(outputs, plan):
            before = copy.deepcopy(copy_) if how == "verify" else None
            want = model.replay(chunk, copy_) if how == "replay" else model.prefill(chunk, copy_)
            torch.testing.assert_close(out.logits, want, atol=LOGITS_ATOL, rtol=0)
            chunks += 1
            rounded_away += int((out.logits - want).abs().max() > LOGITS_NOISE)
            if before is not None:  # rolling back from this pass's snapshot = the state before the chunk
                assert out.snapshot is not None
                rolled = copy.deepcopy(state)
                rolled.restore(out.snapshot)
                assert_states_close(rolled, before)
        for state, copy_ in zip([*states, joining, fresh], [*alone, joining_alone, fresh_alone]):
            assert_states_close(state, copy_)
        # the next pass starts both from the batched states, so a rounded-away record does not carry over
        alone, joining_alone, fresh_alone = (copy.deepcopy(states), copy.deepcopy(joining),
                                             copy.deepcopy(fresh))
    if kv_format is KVFormat.RECORDS:  # bf16 values round the other way far more often
        assert rounded_away <= MAX_ROUNDED_AWAY * chunks, (rounded_away, chunks)
    layers = model.config.num_hidden_layers
    assert len(group_sizes) == 6 * layers and min(group_sizes) >= len(lengths)  # the decode chunks batched
