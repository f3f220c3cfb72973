"""The client's own size check (`cedserve.client.size_refusal`): the request's bytes computed without
building it, exact at the router's limit, and the router's refusal words. Against a real router, the
answers are compared with the router's own in tests/unit/test_router_service.py."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from cedserve.client import (
    _OVER_LIMIT,
    CHECK_FROM_BYTES,
    CedserveError,
    Client,
    build_request,
    request_without_prompt,
    size_refusal,
)
from cedserve.common.request_limits import RequestLimits, over_receive_limit, request_limits
from cedserve.proto import generation_pb2

pytestmark = pytest.mark.unit

PROMPTS: list[Any] = [
    "",
    "def f(",
    "x" * 200_000,
    "é€𝄞\n" * 30_000,  # 1-4 UTF-8 bytes a character
    [],
    [0, 127, 128, 16_383, 16_384, 2**21, 2**28, 2**32 - 1],  # each varint length
    list(range(100_000)),
    [
        {"role": "user", "content": "x" * 70_000},
        {"role": "", "content": ""},
        {"role": "system", "content": "é"},
    ],
]
KWARGS: list[dict[str, Any]] = [
    {},
    {"max_tokens": 8, "stop": ["\n"], "seed": 3, "effort": "high", "request_id": "r"},
]


def _message_bytes(prompt: Any, **kwargs: Any) -> int:
    return build_request(prompt, **kwargs).ByteSize()


@pytest.mark.parametrize("kwargs", KWARGS)
@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"{type(p).__name__}-{len(p)}")
def test_the_limit_holds_to_the_byte(prompt: Any, kwargs: dict[str, Any]) -> None:
    """A request exactly at the router's receive limit passes that check; one byte less of limit and it
    is refused, naming its exact size, as gRPC would. The prompt limits are set out of the way."""
    size = _message_bytes(prompt, **kwargs)
    shell = request_without_prompt(**kwargs)
    at = RequestLimits(max_request_bytes=size, max_prompt_bytes=1 << 40, max_context_tokens=1 << 40)
    assert size_refusal(shell, prompt, at) is None
    under = RequestLimits(max_request_bytes=size - 1, max_prompt_bytes=1 << 40, max_context_tokens=1 << 40)
    error = size_refusal(shell, prompt, under)
    assert error is not None and error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.message.startswith(over_receive_limit(size, size - 1) + " bytes: the request is larger")


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        ("x" * 1001, "prompt.text"),
        ([{"role": "user", "content": "é" * 501}], "prompt.chat.messages"),
        ([5] * 100, "prompt.token_ids"),
    ],
)
def test_a_prompt_over_its_own_bound_is_invalid_argument_naming_the_field(prompt: Any, field: str) -> None:
    limits = RequestLimits(max_request_bytes=1 << 20, max_prompt_bytes=1000, max_context_tokens=100)
    error = size_refusal(request_without_prompt(), prompt, limits)
    assert error is not None and error.code == grpc.StatusCode.INVALID_ARGUMENT and error.field == field
    assert error.message.startswith(f"{field}: ")
    just_in = {
        "prompt.text": "x" * 1000,
        "prompt.chat.messages": [{"role": "user", "content": "é" * 500}],
        "prompt.token_ids": [5] * 99,
    }[field]
    assert size_refusal(request_without_prompt(), just_in, limits) is None


def test_ids_are_checked_before_the_prompt_and_count_tokens_requests_too() -> None:
    limits = request_limits(4096, 16 << 20)
    error = size_refusal(request_without_prompt(request_id="r" * 257), "x" * 70_000, limits)
    assert error is not None and error.field == "request_id"
    count = generation_pb2.CountTokensRequest(model="m" * 257)
    error = size_refusal(count, "x" * 70_000, limits)
    assert error is not None and error.field == "model"


def test_the_client_words_its_refusal_as_it_words_the_routers() -> None:
    """The client recognises gRPC's refusal by `_OVER_LIMIT` to add which setting the limit is: its own
    refusal must start the same way, or the two would read differently."""
    assert over_receive_limit(15_000_021, 131_072).startswith(_OVER_LIMIT)


def test_a_short_prompt_goes_without_asking_for_the_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below `CHECK_FROM_BYTES` no limits are read: the request goes as it is (here to no server)."""

    def no_read(self: Client, refresh: bool = False) -> None:
        raise AssertionError("the limits were read for a short prompt")

    monkeypatch.setattr(Client, "request_limits", no_read)
    with Client("127.0.0.1:1", timeout_s=2) as client, pytest.raises(CedserveError) as info:
        client.generate("x" * (CHECK_FROM_BYTES - 1), max_tokens=2)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_without_the_routers_limits_the_request_goes_as_it_is() -> None:
    """A router that cannot be asked (here: none listens) leaves the call to say what is wrong."""
    with Client("127.0.0.1:1", timeout_s=2) as client, pytest.raises(CedserveError) as info:
        client.generate("x" * 200_000, max_tokens=2)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
