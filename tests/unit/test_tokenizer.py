"""The shipped tiny tokenizer loads offline and round-trips text; bad paths and ids are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from cedserve.model.tokenizer import TextCodec, tiny_tokenizer_path


def test_tiny_tokenizer_round_trip() -> None:
    codec = TextCodec.from_file(tiny_tokenizer_path(), model_vocab_size=512)
    text = "Reasoning Effort: 75\ndef fibonacci(n):\n    return n  # ünïcödé ✓"
    ids = codec.encode(text)
    assert all(0 <= t < 512 for t in ids)
    assert codec.decode(ids) == text
    assert (codec.token_id("<|bos|>"), codec.token_id("<|eos|>"), codec.token_id("<|pad|>")) == (0, 1, 2)


def test_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer not found"):
        TextCodec.from_file(tmp_path, 512)
    with pytest.raises(ValueError, match="more than the model's vocab_size"):
        TextCodec.from_file(tiny_tokenizer_path(), 100)
    codec = TextCodec.from_file(tiny_tokenizer_path(), 512)
    with pytest.raises(ValueError, match="out of range"):
        codec.decode([5, 512])
