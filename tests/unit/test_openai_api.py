"""OpenAI request translation and validation (router/openai_api.py), the chat format's detection
(model/chat_format.py) and the `reasoning_effort` scale, on the real tokenizers and `prepare`."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from tokenizers import Tokenizer

from cedserve.model.chat_format import MARKERS, ChatFormat
from cedserve.model.effort import BOS, OPENAI_EFFORT_NAMES, parse_openai_effort
from cedserve.model.tokenizer import TextCodec, tiny_tokenizer_path
from cedserve.proto import generation_pb2
from cedserve.router.errors import ADMISSION, CAPACITY_WAIT, NO_CAPACITY, TOKENIZE_QUEUE, RequestError
from cedserve.router.openai_api import ApiError, ApiSettings, Shaper, api_error, parse, usage_json
from cedserve.router.requests import ModelLimits, prepare

pytestmark = pytest.mark.unit

SETTINGS = ApiSettings("tiny")


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_file(tiny_tokenizer_path(), 512)


@pytest.fixture(scope="module")
def chat_codec(tmp_path_factory: pytest.TempPathFactory) -> TextCodec:
    """The tiny tokenizer with the released format's markers added as special tokens."""
    tok = Tokenizer.from_file(str(tiny_tokenizer_path()))
    tok.add_special_tokens(list(MARKERS))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return TextCodec.from_file(path, 520)


def _param(body: dict[str, Any], kind: str = "completion") -> str | None:
    with pytest.raises(ApiError) as info:
        parse(body, kind, SETTINGS)  # type: ignore[arg-type]
    assert info.value.status == 400
    return info.value.param


def test_a_completion_body_becomes_the_grpc_request() -> None:
    call = parse({"model": "tiny", "prompt": "def f(", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3,
                  "stop": "\n", "user": "acme", "reasoning_effort": "medium", "stream": True,
                  "stream_options": {"include_usage": True}, "logprobs": 2, "frequency_penalty": 0}, "completion",
                 SETTINGS)
    r = call.request
    assert r.prompt.text == "def f(" and r.max_tokens == 7 and list(r.stop) == ["\n"] and r.cache_salt == "acme"
    assert r.sampling.temperature == 0 and r.sampling.top_p == 0.5 and r.sampling.seed == 3
    assert r.sampling.logprobs == 2 and call.logprobs == 2
    assert r.effort.level == OPENAI_EFFORT_NAMES["medium"]
    assert call.stream and call.include_usage and r.request_id == call.id and call.id.startswith("cmpl-")


def test_defaults_follow_openai() -> None:
    r = parse({"model": "tiny", "prompt": [[5, 6, 7]]}, "completion", SETTINGS).request
    assert list(r.prompt.token_ids.ids) == [5, 6, 7]
    assert r.sampling.temperature == 1.0 and not r.sampling.HasField("seed") and r.max_tokens == 0
    assert not r.effort.HasField("level") and r.cache_salt == ""
    # `user` salts the cache only where the router is configured so
    assert parse({"model": "tiny", "prompt": "x", "user": "acme"}, "completion",
                 ApiSettings("tiny", user_cache_salt=False)).request.cache_salt == ""


def test_chat_body_and_its_budget_name() -> None:
    call = parse({"model": "tiny", "messages": [{"role": "developer", "content": "Be brief."},
                                                {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                                             {"type": "text", "text": "there"}]}],
                  "max_completion_tokens": 5, "logprobs": True}, "chat", SETTINGS)
    messages = [(m.role, m.content) for m in call.request.prompt.chat.messages]
    assert messages == [("system", "Be brief."), ("user", "hi there")]
    assert call.request.max_tokens == 5 and call.max_tokens_param == "max_completion_tokens"
    assert call.logprobs == 0 and call.request.sampling.logprobs == 1  # the chosen token's, no alternatives
    assert call.id.startswith("chatcmpl-")
    assert parse({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}, "chat",
                 SETTINGS).max_tokens_param == "max_tokens"


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"prompt": "x", "reasoning_effort": 0}, "reasoning_effort"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "user": 7}, "user"),
    ({"prompt": "x", "tools": [{"type": "function"}]}, "tools"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "model": ""}, "model"),
])
def test_bad_completion_fields_are_named(body: dict[str, Any], param: str) -> None:
    assert _param({"model": "tiny", **body}) == param


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                                      "tool_calls": [{"id": "1"}]}]}, "messages[1].tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
])
def test_bad_chat_fields_are_named(body: dict[str, Any], param: str) -> None:
    assert _param({"model": "tiny", **body}, "chat") == param


def test_another_model_is_404() -> None:
    with pytest.raises(ApiError) as info:
        parse({"model": "gpt-4o", "prompt": "x"}, "completion", SETTINGS)
    assert info.value.status == 404 and info.value.code == "model_not_found"
    assert info.value.body() == {"error": {"message": info.value.message, "type": "invalid_request_error",
                                           "param": "model", "code": "model_not_found"}}


@pytest.mark.parametrize(("body", "kind", "param"), [
    ({"prompt": "x", "temperature": 101}, "completion", "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "completion", "top_p"),
    ({"prompt": "x", "max_tokens": 5000}, "completion", "max_tokens"),
    ({"prompt": "x", "stop": ["a"] * 17}, "completion", "stop"),
    ({"prompt": "x", "user": "u" * 300}, "completion", "user"),
    ({"prompt": [600]}, "completion", "prompt"),
    ({"prompt": ""}, "completion", "prompt"),
    ({"messages": [{"role": "user", "content": "x"}]}, "chat", "messages"),  # no chat format
])
def test_prepares_refusals_name_the_openai_parameter(codec: TextCodec, body: dict[str, Any], kind: str,
                                                     param: str) -> None:
    call = parse({"model": "tiny", **body}, kind, SETTINGS)  # type: ignore[arg-type]
    with pytest.raises(RequestError) as info:
        prepare(call.request, codec, ModelLimits("tiny", 512, 4096, 32, 0))
    error = api_error(info.value, call)
    assert error.status == 400 and error.param == param and error.message.startswith(f"{param}:")


def test_statuses_of_the_cores_refusals() -> None:
    busy = api_error(RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", retry_after_s=0.3,
                                  reason=ADMISSION), None)
    assert (busy.status, busy.type, busy.retry_after_s) == (429, "rate_limit_error", 0.3)
    queue = api_error(RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "tokenizing", reason=TOKENIZE_QUEUE), None)
    assert queue.status == 429
    for exc in (RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room", retry_after_s=1.0, reason=NO_CAPACITY),
                RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "waited", retry_after_s=1.0, reason=CAPACITY_WAIT),
                RequestError(grpc.StatusCode.UNAVAILABLE, "no decode worker", retry_after_s=1.0)):
        error = api_error(exc, None)
        assert error.status == 503 and error.code == "no_worker_available" and error.retry_after_s == 1.0
    assert api_error(RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "late"), None).status == 504
    assert api_error(RequestError(grpc.StatusCode.INTERNAL, "boom"), None).status == 500


def test_reasoning_effort_scale() -> None:
    assert [parse_openai_effort(n) for n in ("none", "minimal", "low", "medium", "high", "xhigh", "max")] == \
        [1, 25, 50, 62, 75, 90, 100]
    assert parse_openai_effort(37) == 37 and parse_openai_effort("88") == 88 and parse_openai_effort(" High ") == 75
    for bad in (0, 101, True, 2.5, "extreme", None):
        with pytest.raises(ValueError):
            parse_openai_effort(bad)


def test_chat_format_comes_from_the_tokenizer(codec: TextCodec, chat_codec: TextCodec) -> None:
    assert ChatFormat.of(codec) is None  # the tiny/demo tokenizers have no chat markers
    fmt = ChatFormat.of(chat_codec)
    assert fmt is not None and fmt.eos_token_id == chat_codec.token_id(MARKERS[-1])
    limits = ModelLimits("tiny", 520, 4096, 32, 0, fmt)
    call = parse({"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "hi"}], "reasoning_effort": "low"},
                 "chat", SETTINGS)
    ids = prepare(call.request, chat_codec, limits).token_ids
    markers = {chat_codec.token_id(m) for m in MARKERS}
    assert ids[0] == chat_codec.token_id(BOS) and sum(t in markers for t in ids) == 3  # BOS, User, Assistant
    assert chat_codec.decode(list(ids), skip_special_tokens=False).startswith(BOS + "Reasoning Effort: 50\nBe brief.")
    too_long = parse({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                      "max_completion_tokens": 5000}, "chat", SETTINGS)
    with pytest.raises(RequestError) as info:
        prepare(too_long.request, chat_codec, limits)
    assert api_error(info.value, too_long).param == "max_completion_tokens"


def test_shaped_responses(codec: TextCodec) -> None:
    ids = codec.encode("def main")
    chunk = generation_pb2.Chunk(token_ids=ids, text="def main", logprobs=[-0.5] * len(ids))
    for entry in chunk.logprobs:
        chunk.top_logprobs.add().entries.add(token_id=ids[0], logprob=entry)
    usage = generation_pb2.Usage(prompt_tokens=9, completion_tokens=len(ids), cached_tokens=4)
    complete = generation_pb2.Complete(finish_reason=generation_pb2.FINISH_REASON_LENGTH, usage=usage)
    call = parse({"model": "tiny", "prompt": "x", "logprobs": 1}, "completion", SETTINGS)
    whole = Shaper.of(call, codec).whole([chunk], complete)
    choice = whole["choices"][0]
    assert choice["text"] == "def main" and choice["finish_reason"] == "length"
    assert "".join(choice["logprobs"]["tokens"]) == "def main" and choice["logprobs"]["token_logprobs"][0] == -0.5
    standard = {k: v for k, v in whole["usage"].items() if k != "cedserve"}
    assert standard == {"prompt_tokens": 9, "completion_tokens": len(ids), "total_tokens": 9 + len(ids),
                        "prompt_tokens_details": {"cached_tokens": 4}}
    assert whole["usage"] == usage_json(usage) and whole["usage"]["cedserve"]["decode_only"] == 0.0
    chat = parse({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True,
                  "stream_options": {"include_usage": True}}, "chat", SETTINGS)
    shaper = Shaper.of(chat, codec)
    first = shaper.chunk(chunk, first=True)
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "def main"}
    assert shaper.last(complete)["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert shaper.usage_chunk(complete)["choices"] == [] and json.dumps(shaper.usage_chunk(complete))


def test_the_shipped_demo_checkpoint_has_no_chat_format() -> None:
    from cedserve.launcher import shipped_demo_checkpoint

    demo = shipped_demo_checkpoint()
    assert ChatFormat.of(TextCodec.from_file(demo, 4096)) is None
