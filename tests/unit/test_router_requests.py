"""The router's request preparation (`cedserve.router.requests.prepare`): bounded input is refused,
naming the field, before any tokenizing, and within a few milliseconds however large the prompt."""

from __future__ import annotations

import pytest

from cedserve.common.request_limits import BYTES_PER_TOKEN_BOUND, MAX_ID_LEN, MESSAGE_SLACK_BYTES
from cedserve.model.tokenizer import TextCodec, tiny_tokenizer_path
from cedserve.proto import generation_pb2
from cedserve.router.errors import RequestError
from cedserve.router.requests import ModelLimits, message_limit, prepare

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


class CountingCodec(TextCodec):
    """The tiny tokenizer, counting the characters it is asked to encode."""

    encoded_chars = 0

    def encode(self, text: str) -> list[int]:
        CountingCodec.encoded_chars += len(text)
        return super().encode(text)


def test_a_huge_prompt_is_refused_before_tokenizing(codec: TextCodec) -> None:
    """15 MB of text against a 4,096-token context: refused by its byte count, never tokenized (the
    tokenizer would take seconds and hundreds of MB); at the bound the text is tokenized."""
    huge = "a " * (15 * 1024 * 1024 // 2)
    counting = CountingCodec.from_file(tiny_tokenizer_path(), 512)
    assert isinstance(counting, CountingCodec)
    assert _field(generation_pb2.GenerateRequest(prompt=generation_pb2.Prompt(text=huge)), counting) == "prompt.text"
    assert CountingCodec.encoded_chars == 0
    chat = generation_pb2.Prompt(chat=generation_pb2.Chat(messages=[
        generation_pb2.ChatMessage(role="user", content=huge)]))
    assert _field(generation_pb2.GenerateRequest(prompt=chat), codec) == "prompt.chat.messages"
    ids = generation_pb2.Prompt(token_ids=generation_pb2.TokenIds(ids=[5] * 4096))
    assert _field(generation_pb2.GenerateRequest(prompt=ids), codec) == "prompt.token_ids"
    # at the bound the text is tokenized, and refused (or not) by its token count
    bound = "a" * (LIMITS.max_context_tokens * BYTES_PER_TOKEN_BOUND)
    assert _field(generation_pb2.GenerateRequest(prompt=generation_pb2.Prompt(text=bound)), codec) == "prompt"


def test_the_message_limit_is_what_the_context_can_use() -> None:
    """gRPC and HTTP refuse a request from its length prefix when it is larger than any prompt that
    could fit the context (plus the rest of a request), so its bytes are never read or parsed."""
    assert message_limit(LIMITS, 16 << 20) == 4096 * BYTES_PER_TOKEN_BOUND + MESSAGE_SLACK_BYTES
    assert message_limit(LIMITS, 1000) == 1000  # a configured limit below it stands
