"""Streaming detokenization (router/text.py): what a client receives, pushed in pieces, is the text of
the whole output, cut before the first stop string, and only final text is ever sent."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders

from cedserve.model.tokenizer import TextCodec, tiny_tokenizer_path
from cedserve.router.text import StreamingText

pytestmark = pytest.mark.unit

DEMO = Path(__file__).resolve().parents[2] / "cedserve" / "assets" / "demo" / "tokenizer.json"


@pytest.fixture(params=["tiny", "demo"])
def codec(request: pytest.FixtureRequest) -> TextCodec:
    path = tiny_tokenizer_path() if request.param == "tiny" else DEMO
    return TextCodec.from_file(path, 1 << 20)


def stream(codec: TextCodec, ids: list[int], stop: list[str], rng: random.Random) -> tuple[str, StreamingText]:
    st = StreamingText(codec, stop)
    out, at = [], 0
    while at < len(ids) and not st.stopped:
        n = rng.choice([1, 1, 1, 2, 3, 7])
        out.append(st.push(ids[at : at + n]))
        at += n
        assert codec.decode(ids).startswith("".join(out))  # only final text, once, in order
        assert st.decoded() == codec.decode(st.token_ids)  # the kept text plus the window: the whole decode
    out.append(st.finish())
    return "".join(out), st


def test_pushed_pieces_give_the_whole_text(codec: TextCodec) -> None:
    rng = random.Random(0)
    vocab = codec.tokenizer.get_vocab_size()
    for _ in range(60):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        text, _ = stream(codec, ids, [], rng)
        assert text == codec.decode(ids)


def test_a_stop_string_cuts_the_text_before_it(codec: TextCodec) -> None:
    rng = random.Random(1)
    vocab = codec.tokenizer.get_vocab_size()
    checked = 0
    for _ in range(400):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(5, 60))]
        full = codec.decode(ids)
        if len(full) < 8:
            continue
        start = rng.randrange(1, len(full) - 3)
        stop = full[start : start + rng.randrange(1, 4)]
        if "\ufffd" in full[: start + len(stop)]:
            continue  # a stop string is matched on final text only
        text, st = stream(codec, ids, [stop], rng)
        assert st.stopped and text == full[: full.find(stop)]
        checked += 1
    assert checked > 40


def test_an_incomplete_character_waits_for_the_token_that_completes_it() -> None:
    codec = TextCodec.from_file(tiny_tokenizer_path(), 1 << 20)
    ids = codec.encode("a\u00e9\u4e2d b")
    pieces = [[i] for i in ids]
    st = StreamingText(codec, [])
    seen = [st.push(p) for p in pieces]
    assert "\ufffd" not in "".join(seen)
    assert "".join(seen) + st.finish() == "a\u00e9\u4e2d b"


def _not_byte_level() -> TextCodec:
    """The tiny tokenizer with another decoder: `byte_pieces` is None, so the text goes through the
    tokenizer's own decode (a window per push)."""
    tok = Tokenizer.from_file(str(tiny_tokenizer_path()))
    tok.decoder = decoders.BPEDecoder()
    return TextCodec(tok, 1 << 20)


def test_both_ways_to_the_text_give_the_whole_text() -> None:
    """The byte-level path (the shipped tokenizers) and the tokenizer path stream what `decode` gives."""
    byte_level, other = TextCodec.from_file(tiny_tokenizer_path(), 1 << 20), _not_byte_level()
    assert byte_level.byte_pieces is not None and other.byte_pieces is None
    rng = random.Random(2)
    for codec in (byte_level, other):
        for _ in range(40):
            ids = [rng.randrange(520) for _ in range(rng.randrange(1, 60))]  # a few past the tokenizer's ids
            text, _ = stream(codec, ids, [], rng)
            assert text == codec.decode(ids)


def test_an_id_outside_the_model_vocabulary_fails_as_decode_does() -> None:
    codec = TextCodec.from_file(tiny_tokenizer_path(), 600)
    assert codec.byte_pieces is not None
    st = StreamingText(codec, [])
    st.push([65, 550])  # past the tokenizer's 512 ids, within the model's 600: no text
    with pytest.raises(ValueError, match="out of range"):
        st.push([600])
