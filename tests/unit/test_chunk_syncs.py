"""The prefill engine's eager chunk pass reads the device on the host once: shapes and positions come
from the host-known chunk, token ids are checked on the host, and the records' NaN/inf checks are
deferred to one read at the pass's end (issue 28). `MoE.forward`'s rows per expert (a `tolist` each
layer) is the eager path's other host read; the prefill runner's pass has none (test_prefill_runner.py)."""

from __future__ import annotations

import pytest
import torch
from decode_support import prompt, tiny

from cedserve.model.capture_trace import trace
from cedserve.model.network import BoundaryHidden


def _host_reads(fn: object) -> list[str]:
    recorded, _ = trace(fn)  # type: ignore[arg-type]
    return [op.name for op in recorded.host_reads]


def test_encode_chunk_and_replay_read_the_device_once() -> None:
    model, _ = tiny()
    state, tokens = model.new_state(), prompt(96, 3)
    spans: list[BoundaryHidden] = []
    for start in (0, 40):  # the second chunk meets stored windows and global KV
        chunk = tokens[start : start + 40]
        reads = _host_reads(lambda c=chunk: spans.append(model.encode_chunk(c, state).boundary))
        assert reads == ["aten._local_scalar_dense.default"], reads  # the deferred finiteness check
    span = BoundaryHidden.concat(spans).last(32)
    assert span.start == 48 and span.end == state.position == 80
    assert _host_reads(lambda: model.replay_decoder(span, state)) == ["aten._local_scalar_dense.default"]


def test_a_non_finite_record_input_still_fails_the_pass() -> None:
    model, _ = tiny()
    state = model.new_state()
    block = model.layers[1]
    saved = block.attn.wkv.weight.detach().clone()
    try:
        with torch.no_grad():
            block.attn.wkv.weight[0, 0] = float("nan")
        with pytest.raises(ValueError, match="encode_chunk: a record's input contains NaN or inf"):
            model.encode_chunk(prompt(16, 1), state)
    finally:
        with torch.no_grad():
            block.attn.wkv.weight.copy_(saved)


def test_token_ids_are_checked_on_the_host() -> None:
    model, _ = tiny()
    vocab = model.config.vocab_size
    for bad in ([1, vocab], torch.tensor([-1, 2])):
        with pytest.raises(ValueError, match="token ids must be in"):
            model.encode_chunk(bad, model.new_state())
