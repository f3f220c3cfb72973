"""The shipped bounded-state byte format (`cedserve.model.state_format`): a round trip is bit-exact for
every section and dtype, the size bound is what a full state takes, and every malformed input is
refused with a `StateFormatError` saying what differs."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from decode_support import prompt, tiny

from cedserve.model.checkpoint_writer import fit_config_to_tokenizer
from cedserve.model.presets import preset
from cedserve.model.state import SequenceState
from cedserve.model.state_format import (
    HEADER_BYTES,
    STATE_FORMAT_VERSION,
    BoundedState,
    StateFormatError,
    decode_state,
    encode_state,
    max_state_bytes,
)
from cedserve.model.tokenizer import tiny_tokenizer_path

pytestmark = pytest.mark.unit


def prefilled(n: int) -> tuple[SequenceState, torch.Tensor]:
    """A real state after `n` tokens, and random stream-averaged taps of its last positions."""
    model, _ = tiny()
    state = model.new_state()
    model.prefill(prompt(n, n), state)
    c = model.config
    rows = min(n, c.sliding_window)
    taps = torch.randn(rows, len(c.dspark_target_layer_ids), c.hidden_size, generator=torch.Generator().manual_seed(n))
    return state, taps


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("n", [1, 5, 37])
@pytest.mark.parametrize("taps_dtype", [None, torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(n: int, taps_dtype: torch.dtype | None) -> None:
    config = tiny()[0].config
    state, taps = prefilled(n)
    taps = None if taps_dtype is None else taps.to(taps_dtype)
    original = BoundedState.capture(state, taps)
    data = encode_state(original, config)
    assert len(data) <= max_state_bytes(config, taps_dtype)
    region = data + bytes(1000)  # the reserved blocks are larger than the encoding
    got = decode_state(region, config, taps_dtype)
    assert got.position == n and set(got.swa) == set(original.swa) and set(got.pending) == set(original.pending)
    for layer, records in original.swa.items():
        assert same_bits(got.swa[layer], records)
    for layer, group in original.pending.items():
        assert same_bits(got.pending[layer].kv, group.kv) and same_bits(got.pending[layer].gate, group.gate)
    assert same_bits(got.engram_tail, original.engram_tail)
    if taps is None:
        assert got.taps is None
    else:
        assert got.taps is not None and same_bits(got.taps, taps)


def test_a_full_state_takes_exactly_the_bound_and_installs_to_the_same_logits() -> None:
    model, _ = tiny()
    config = model.config
    n = 41  # past the window, odd (layer 2's compressor holds one token), Engram history full
    state, taps = prefilled(n)
    data = encode_state(BoundedState.capture(state, taps), config)
    assert len(data) == max_state_bytes(config, torch.float32)
    assert data[:8] == b"CEDSTATE" and struct.unpack_from("<H", data, 8)[0] == STATE_FORMAT_VERSION
    fresh = model.new_state()
    for layer, kv in state.global_kv.items():  # the global KV the blocks would deliver
        fresh.global_kv[layer].set_records(kv.main, kv.index_keys)
    decode_state(data, config, torch.float32).install(fresh)
    token = prompt(1, 99)
    assert torch.equal(model.prefill(token, fresh), model.prefill(token, state))


def header_patch(fmt: str, offset: int, value: int) -> object:
    return lambda data: struct.pack_into(fmt, data, offset, value)


@pytest.mark.parametrize(("tamper", "words"), [
    (lambda d: d.__setitem__(slice(0, 8), b"NOTSTATE"), "magic"),
    (header_patch("<H", 8, STATE_FORMAT_VERSION + 1), f"version {STATE_FORMAT_VERSION + 1}"),
    (header_patch("<Q", 16, 1 << 40), "does not fit"),
    (lambda d: d.__setitem__(-1, d[-1] ^ 0x40), "checksum"),
    (header_patch("<I", 12, 3), "sections"),
])
def test_malformed_bytes_are_refused_with_a_reason(tamper: object, words: str) -> None:
    config = tiny()[0].config
    state, taps = prefilled(20)
    data = bytearray(encode_state(BoundedState.capture(state, taps), config))
    tamper(data)  # type: ignore[operator]
    with pytest.raises(StateFormatError, match=words):
        decode_state(bytes(data), config, torch.float32)


def test_truncated_region_geometry_taps_and_dtype_are_refused() -> None:
    config = tiny()[0].config
    state, taps = prefilled(20)
    data = encode_state(BoundedState.capture(state, taps), config)
    with pytest.raises(StateFormatError, match="does not fit"):
        decode_state(data[:-1], config, torch.float32)  # a region one byte too small
    with pytest.raises(StateFormatError, match="shorter than"):
        decode_state(data[:10], config, torch.float32)
    other = fit_config_to_tokenizer(preset("mini-40"), tiny_tokenizer_path())
    with pytest.raises(StateFormatError, match="geometry"):
        decode_state(data, other, torch.float32)
    with pytest.raises(StateFormatError, match="without DSpark taps"):
        decode_state(data, config, None)  # the reader did not ask for taps
    with pytest.raises(StateFormatError, match="dtype"):
        decode_state(data, config, torch.bfloat16)


def test_a_section_with_a_wrong_row_count_is_refused() -> None:
    config = tiny()[0].config
    state, taps = prefilled(20)
    data = bytearray(encode_state(BoundedState.capture(state, taps), config))
    first_rows = HEADER_BYTES + 8  # rows of the first section (layer 0's window)
    struct.pack_into("<I", data, first_rows, config.sliding_window)  # one more than a window keeps
    struct.pack_into("<I", data, 48, zlib.crc32(bytes(data[HEADER_BYTES:])))  # a well-formed lie
    with pytest.raises(StateFormatError, match="SWA layer 0: 8 rows, at most 7"):
        decode_state(bytes(data), config, torch.float32)


def test_encoding_a_state_of_another_model_is_a_caller_error() -> None:
    state, _ = prefilled(5)
    other = fit_config_to_tokenizer(preset("mini-40"), tiny_tokenizer_path())
    with pytest.raises(ValueError, match="sections"):
        encode_state(BoundedState.capture(state), other)
