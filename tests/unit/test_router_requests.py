"""The router's request preparation (`cedserve.router.requests.prepare`): bounded input is refused,
naming the field, before any tokenizing, and within a few milliseconds however large the prompt."""

from __future__ import annotations

import time

import pytest

from cedserve.model.tokenizer import TextCodec, tiny_tokenizer_path
from cedserve.proto import generation_pb2
from cedserve.router.errors import RequestError
from cedserve.router.requests import BYTES_PER_TOKEN_BOUND, MAX_ID_LEN, ModelLimits, prepare

pytestmark = pytest.mark.unit

LIMITS = ModelLimits("tiny", 512, 4096, 32, 0)


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_file(tiny_tokenizer_path(), 512)


def _field(request: generation_pb2.GenerateRequest, codec: TextCodec) -> str:
    with pytest.raises(RequestError) as info:
        prepare(request, codec, LIMITS)
    return info.value.field


def test_ids_are_length_limited(codec: TextCodec) -> None:
    ok = generation_pb2.GenerateRequest(prompt=generation_pb2.Prompt(text="def f("), request_id="r" * MAX_ID_LEN)
    assert prepare(ok, codec, LIMITS).request_id == "r" * MAX_ID_LEN
    for name in ("request_id", "session_id", "cache_salt", "model"):
        request = generation_pb2.GenerateRequest(prompt=generation_pb2.Prompt(text="x"), **{name: "z" * 2_000_000})
        assert _field(request, codec) == name


def test_a_huge_prompt_is_refused_before_tokenizing(codec: TextCodec) -> None:
    """15 MB of text against a 4,096-token context: refused by its byte count in milliseconds (the
    tokenizer would take seconds and hundreds of MB); one byte under the bound is tokenized."""
    huge = "a " * (15 * 1024 * 1024 // 2)
    start = time.perf_counter()
    assert _field(generation_pb2.GenerateRequest(prompt=generation_pb2.Prompt(text=huge)), codec) == "prompt.text"
    assert time.perf_counter() - start < 0.5
    chat = generation_pb2.Prompt(chat=generation_pb2.Chat(messages=[
        generation_pb2.ChatMessage(role="user", content=huge)]))
    assert _field(generation_pb2.GenerateRequest(prompt=chat), codec) == "prompt.chat.messages"
    ids = generation_pb2.Prompt(token_ids=generation_pb2.TokenIds(ids=[5] * 4096))
    assert _field(generation_pb2.GenerateRequest(prompt=ids), codec) == "prompt.token_ids"
    # at the bound the text is tokenized, and refused (or not) by its token count
    bound = "a" * (LIMITS.max_context_tokens * BYTES_PER_TOKEN_BOUND)
    assert _field(generation_pb2.GenerateRequest(prompt=generation_pb2.Prompt(text=bound)), codec) == "prompt"
