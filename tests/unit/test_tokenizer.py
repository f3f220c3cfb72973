"""The shipped tiny tokenizer loads offline and round-trips text; bad paths and ids are named."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders

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


def _byte_token_ids(codec: TextCodec) -> dict[int, int]:
    """byte -> the id of the tiny tokenizer's token for that byte alone."""
    found = {}
    for token_id in range(codec.tokenizer.get_vocab_size()):
        piece = codec.byte_pieces[token_id] if codec.byte_pieces else b""
        if len(piece) == 1:
            found.setdefault(piece[0], token_id)
    return found


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=40))
def test_byte_pieces_decode_any_bytes_as_the_tokenizer_does(data: bytes) -> None:
    """Arbitrary bytes (invalid and truncated UTF-8 included), one token per byte: the pieces joined and
    decoded with U+FFFD for each bad part are the tokenizer's own decode, so the streaming text's
    byte-level path (router/text.py) gives the same text as `decode`."""
    codec = _TINY
    ids = [_TINY_BYTES[b] for b in data]
    assert codec.byte_pieces is not None
    assert b"".join(codec.byte_pieces[i] for i in ids).decode("utf-8", "replace") == codec.decode(ids)


def test_byte_pieces_of_added_and_special_tokens() -> None:
    """An added token that is not special decodes as its text, between any bytes; special tokens
    (skipped by `decode`) have no bytes; a tokenizer that is not byte-level has no pieces."""
    tok = Tokenizer.from_file(str(tiny_tokenizer_path()))
    tok.add_tokens([AddedToken("<tool>", special=False)])
    codec = TextCodec(tok, 1 << 20)
    assert codec.byte_pieces is not None
    tool = codec.token_id("<tool>")
    assert tool is not None and codec.byte_pieces[tool] == b"<tool>"
    assert codec.byte_pieces[0] == b""  # <|bos|>
    euro = [_TINY_BYTES[b] for b in "\u20ac".encode()]
    ids = [euro[0], tool, *euro[1:], 0, *euro]
    assert b"".join(codec.byte_pieces[i] for i in ids).decode("utf-8", "replace") == codec.decode(ids)
    tok.decoder = decoders.Metaspace()
    assert TextCodec(tok, 1 << 20).byte_pieces is None


_TINY = TextCodec.from_file(tiny_tokenizer_path(), 1 << 20)
_TINY_BYTES = _byte_token_ids(_TINY)
