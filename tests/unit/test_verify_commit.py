"""DSpark entry points of the backbone: taps, and verify + commit rolling back rejected drafts.

`commit` must leave the sequence bit-identical to one that never saw the rejected tokens: every
window, the compressors' partial groups and global KV entries formed from rejected tokens, the
Engram tail and the position. The tiny preset's window is 8 (7 stored records) and the chunk is
the anchor plus K = 5 drafts, so a verify pass pushes the oldest records the kept state still
needs out of every window; an odd prefix leaves one token pending in the m=2 compressors
(layers 2-5), so rejected tokens complete groups that must disappear; layers 6-11 (m=1) append
one global entry per rejected token.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
from cedserve.model.network import CEDModel
from cedserve.model.presets import preset
from cedserve.model.state import SequenceState
from cedserve.model.tokenizer import tiny_tokenizer_path

pytestmark = pytest.mark.unit

K = preset("tiny").dspark_block_size  # drafts per verification; the chunk has K + 1 tokens


@pytest.fixture(scope="module")
def model() -> Iterator[CEDModel]:
    config = fit_config_to_tokenizer(preset("tiny"), tiny_tokenizer_path())
    target, _ = random_model(config, tiny_tokenizer_path(), seed=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's ops are too small for intra-op threads
    yield target
    torch.set_num_threads(threads)


_PREFIXES: dict[tuple[int, ...], SequenceState] = {}


def _after_prefix(model: CEDModel, tokens: list[int]) -> SequenceState:
    """A fresh copy of the state after `tokens` (computed once per prefix)."""
    key = tuple(tokens)
    if key not in _PREFIXES:
        _PREFIXES[key] = model.new_state()
        model.prefill(tokens, _PREFIXES[key])
    return copy.deepcopy(_PREFIXES[key])


def _tokens(count: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_same_state(got: SequenceState, want: SequenceState) -> None:
    """Bit-identical sequence states."""
    assert got.position == want.position
    assert torch.equal(got.engram_tail, want.engram_tail)
    for layer, records in want.swa.items():
        assert torch.equal(got.swa[layer], records), f"window of layer {layer}"
    for layer, kv in want.global_kv.items():
        mine = got.global_kv[layer]
        assert torch.equal(mine.main, kv.main) and torch.equal(mine.index_keys, kv.index_keys), f"global KV {layer}"
        assert torch.equal(mine.pending.kv, kv.pending.kv) and torch.equal(mine.pending.gate, kv.pending.gate)


@pytest.mark.parametrize("prefix_len", [3, 10], ids=["window-filling", "window-rotating"])
@pytest.mark.parametrize("kept", [0, 1, K, K + 1])
def test_commit_equals_never_seeing_the_rejected_tokens(model: CEDModel, prefix_len: int, kept: int) -> None:
    tokens = _tokens(prefix_len + K + 1 + 2, seed=prefix_len)
    prefix, chunk, after = tokens[:prefix_len], tokens[prefix_len : prefix_len + K + 1], tokens[prefix_len + K + 1 :]
    spec, plain = _after_prefix(model, prefix), _after_prefix(model, prefix)
    verification = model.verify(chunk, spec)
    assert verification.logits.shape == (K + 1, model.config.vocab_size)
    assert spec.position == prefix_len + K + 1  # the drafts entered the state before the verdict
    model.commit(spec, verification.snapshot, kept)
    if kept:
        model.prefill(chunk[:kept], plain)
    assert_same_state(spec, plain)
    for token in after:
        assert torch.equal(model.decode_step([token], [spec]), model.decode_step([token], [plain]))


def test_verify_logits_are_the_chunks_prefill_logits(model: CEDModel) -> None:
    tokens = _tokens(9, seed=1)
    a, b = model.new_state(), model.new_state()
    model.prefill(tokens[:3], a)
    model.prefill(tokens[:3], b)
    assert torch.equal(model.verify(tokens[3:], a).logits, model.prefill(tokens[3:], b))


def test_commit_rejects_misuse(model: CEDModel) -> None:
    state = model.new_state()
    verification = model.verify(_tokens(K + 1, seed=2), state)
    with pytest.raises(ValueError, match="num_tokens_kept must be in"):
        model.commit(state, verification.snapshot, K + 2)
    model.commit(state, verification.snapshot, 2)
    with pytest.raises(ValueError, match="commit each verify once"):
        model.commit(state, verification.snapshot, 1)


def test_taps_are_the_streams_entering_the_target_layers(model: CEDModel) -> None:
    config = model.config
    tokens = _tokens(11, seed=4)
    entering: dict[int, torch.Tensor] = {}
    hooks = [
        model.layers[layer - 1].register_forward_hook(
            lambda _m, _i, out, layer=layer: entering.__setitem__(layer, out[0])
        )
        for layer in config.dspark_target_layer_ids
    ]
    try:
        out = model.prefill_with_taps(tokens, model.new_state())
    finally:
        for hook in hooks:
            hook.remove()
    taps = len(config.dspark_target_layer_ids)
    assert out.taps.shape == (len(tokens), taps, config.hc_mult, config.hidden_size)
    # No target layer of the tiny preset has Engram, so its attention input is the previous output.
    assert not set(config.dspark_target_layer_ids) & set(config.engram_layer_ids)
    for j, layer in enumerate(config.dspark_target_layer_ids):
        assert torch.equal(out.taps[:, j], entering[layer])
    assert torch.equal(out.logits, model.prefill(tokens, model.new_state()))
