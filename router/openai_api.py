"""OpenAI-compatible bodies <-> the router's own messages, with nothing of HTTP in them.

A request body becomes a `GenerateRequest` (so `prepare` in router/requests.py validates it exactly
as it validates the gRPC API's) plus what only the answer's shape needs (`ApiCall`). Responses are
built from the core's `Chunk` and `Complete` messages by `Shaper`. Every refusal is an `ApiError`
in OpenAI's shape, naming the request's own parameter (`temperature`, `messages`, `user`...), never
an internal field.

What maps to what:

| OpenAI | router |
|---|---|
| `prompt` (a string, token ids, or a list of one of them) / `messages` | `prompt.text` / `token_ids` / `chat` |
| `max_completion_tokens`, else `max_tokens` | `max_tokens` |
| `temperature` (default 1, as OpenAI's), `top_p`, `seed`, `stop` | the same |
| `logprobs` (completions: top-n) / `logprobs` + `top_logprobs` (chat) | `sampling.logprobs` |
| `reasoning_effort`: none/minimal/low/medium/high/xhigh/max or 1-100 | `effort` (model/effort.py) |
| `user` | `cache_salt`, when the router is configured so (`RouterConfig.user_cache_salt`) |
| `n`: 1 only; `stream`, `stream_options.include_usage` | the answer's shape |

Parameters this server cannot honour (tools, penalties, logit bias, `echo`, `best_of`, `suffix`, a
non-text `response_format`) are refused when set to anything but their no-op default, rather than
silently ignored; unknown parameters are ignored, as OpenAI's SDKs send new ones over time.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import grpc

from cedserve.model.effort import parse_openai_effort
from cedserve.model.tokenizer import TextCodec
from cedserve.proto import generation_pb2
from cedserve.router.errors import UNPLACEABLE, RequestError

Kind = Literal["completion", "chat"]
MAX_LOGPROBS = 20
"""Alternatives per token the engine reports at most (`Sampling.logprobs`)."""
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_FINISH = {generation_pb2.FINISH_REASON_STOP: "stop", generation_pb2.FINISH_REASON_LENGTH: "length"}
_NO_OPS: Mapping[str, tuple[object, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""), "response_format": (None, {"type": "text"}),
}
"""Parameters this server does not implement, with the values that ask for nothing."""


class ApiError(Exception):
    """A refusal in OpenAI's error shape; `status` is the HTTP status, `retry_after_s` (> 0) a
    `Retry-After` header."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    """A 400 naming the parameter."""
    return ApiError(400, f"{param}: {message}" if param else message, param=param, code=code)


@dataclass(frozen=True)
class ApiCall:
    """One parsed OpenAI request."""

    kind: Kind
    request: generation_pb2.GenerateRequest
    """What the generation core runs (validated further by `prepare`)."""
    model: str
    stream: bool
    include_usage: bool
    """`stream_options.include_usage`: a last chunk with the usage and no choices."""
    logprobs: int | None
    """Alternatives per token to report (0: the chosen token's logprob only); None: no logprobs."""
    max_tokens_param: str
    """The name the client gave the output budget (errors name it)."""
    id: str
    created: int


@dataclass(frozen=True)
class ApiSettings:
    """What the router decides about OpenAI requests."""

    model_id: str
    """The only model served; any other `model` is a 404."""
    user_cache_salt: bool = True
    """`user` becomes the request's cache salt: tenants never share prefix-cache blocks."""


# ---------------------------------------------------------------------------- request fields


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"expected a number, got {value!r}")
    return float(value)


def _int(body: Mapping[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise bad(name, f"must be in [{lo}, {hi}], got {value}")
    return value


def _bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(name, f"expected true or false, got {value!r}")
    return value


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    for name, no_ops in _NO_OPS.items():
        if name in body and body[name] not in no_ops:
            raise bad(name, "is not supported by this server", code="unsupported_parameter")


def _stop(body: Mapping[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise bad("stop", f"expected a string or a list of strings, got {value!r}")


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad("stream_options", "is only allowed with stream: true")
    if not isinstance(options, dict):
        raise bad("stream_options", f"expected an object, got {options!r}")
    return stream, _bool(options, "include_usage") if "include_usage" in options else False


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt(value: object) -> generation_pb2.Prompt:
    """`prompt`: a string, a list of token ids, or a list holding one of those (one prompt per request)."""
    if isinstance(value, list) and len(value) == 1 and (isinstance(value[0], str) or _is_ids(value[0])):
        value = value[0]
    if isinstance(value, str):
        return generation_pb2.Prompt(text=value)
    if _is_ids(value):
        assert isinstance(value, list)
        if any(t < 0 for t in value):
            raise bad("prompt", "token ids must be >= 0")
        return generation_pb2.Prompt(token_ids=generation_pb2.TokenIds(ids=value))
    if isinstance(value, list) and len(value) > 1:
        raise bad("prompt", f"one prompt per request, got {len(value)} (send them as separate requests)")
    raise bad("prompt", "expected a string, a list of token ids, or a list holding one of them")


def _content(value: object, param: str) -> str:
    """A message's `content`: a string, null, or a list of text parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"{param}[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(param, f"expected a string or a list of text parts, got {type(value).__name__}")


def _messages(value: object) -> generation_pb2.Prompt:
    if not isinstance(value, list) or not value:
        raise bad("messages", "expected a non-empty list of messages")
    chat = generation_pb2.Chat()
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}]", "expected an object with `role` and `content`")
        role = message.get("role")
        if role not in _ROLES:
            raise bad(f"messages[{i}].role", f"expected one of {', '.join(_ROLES)}, got {role!r}")
        if message.get("tool_calls"):
            raise bad(f"messages[{i}].tool_calls", "tool calls are not supported by this server",
                      code="unsupported_parameter")
        chat.messages.add(role=_ROLES[role], content=_content(message.get("content"), f"messages[{i}].content"))
    return generation_pb2.Prompt(chat=chat)


def _effort(body: Mapping[str, Any]) -> generation_pb2.Effort:
    value = body.get("reasoning_effort")
    if value is None:
        return generation_pb2.Effort()
    try:
        return generation_pb2.Effort(level=parse_openai_effort(value))
    except ValueError as exc:
        raise bad("reasoning_effort", str(exc)) from None


def _logprobs(body: Mapping[str, Any], kind: Kind) -> int | None:
    if kind == "completion":
        return _int(body, "logprobs", 0, MAX_LOGPROBS)
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not _bool(body, "logprobs"):
        if top:
            raise bad("top_logprobs", "needs logprobs: true")
        return None
    return top or 0


def parse(body: object, kind: Kind, settings: ApiSettings) -> ApiCall:
    """An OpenAI `/v1/completions` (`kind` completion) or `/v1/chat/completions` (chat) body.

    Raises `ApiError`: 400 naming the parameter for a bad or unsupported one, 404 for another model.
    Range checks shared with the gRPC API (temperature, the context, id lengths) are `prepare`'s.
    """
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "required: the model's id (GET /v1/models lists it)")
    if model != settings.model_id:
        raise ApiError(404, f"The model {model!r} does not exist; this server serves {settings.model_id!r}",
                       param="model", code="model_not_found")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise bad("n", f"only 1 choice per request is supported, got {n!r} (send separate requests)",
                  code="unsupported_value")
    _refuse_unsupported(body)
    if kind == "chat":
        prompt, budget_param = _messages(body.get("messages")), "max_completion_tokens"
        if body.get(budget_param) is None:
            budget_param = "max_tokens"
    else:
        if "prompt" not in body:
            raise bad("prompt", "required")
        prompt, budget_param = _prompt(body["prompt"]), "max_tokens"
    stream, include_usage = _stream(body)
    logprobs = _logprobs(body, kind)
    sampling = generation_pb2.Sampling(temperature=1.0, top_p=1.0, logprobs=0 if logprobs is None else max(1, logprobs))
    temperature, top_p = _number(body, "temperature"), _number(body, "top_p")
    if temperature is not None:
        sampling.temperature = temperature
    if top_p is not None:
        sampling.top_p = top_p
    seed = _int(body, "seed", 0, 2**64 - 1)
    if seed is not None:
        sampling.seed = seed
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"expected a string, got {user!r}")
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    call_id = f"{prefix}-{uuid.uuid4().hex}"
    request = generation_pb2.GenerateRequest(
        model=model, prompt=prompt, effort=_effort(body), sampling=sampling,
        max_tokens=_int(body, budget_param, 1, 2**32 - 1) or 0, stop=_stop(body),
        cache_salt=user if user and settings.user_cache_salt else "", request_id=call_id)
    return ApiCall(kind, request, model, stream, include_usage, logprobs, budget_param, call_id, int(time.time()))


# ---------------------------------------------------------------------------- errors


_PARAMS = {"sampling.temperature": "temperature", "sampling.top_p": "top_p", "effort": "reasoning_effort",
           "cache_salt": "user", "stop": "stop", "model": "model", "request_id": None}


def param_of(field: str, call: ApiCall) -> str | None:
    """The OpenAI parameter behind a `prepare` field name (`prompt.token_ids[3]` -> `prompt`)."""
    if field.startswith("prompt"):
        return "messages" if call.kind == "chat" else "prompt"
    if field == "max_tokens":
        return call.max_tokens_param
    if field == "sampling.logprobs":
        return "top_logprobs" if call.kind == "chat" else "logprobs"
    return _PARAMS.get(field, field or None)


def api_error(exc: RequestError, call: ApiCall | None) -> ApiError:
    """The HTTP answer to a refusal of the generation core (its gRPC code and `reason`)."""
    code = exc.code
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        param = param_of(exc.field, call) if call is not None else exc.field or None
        message = exc.message
        if exc.field and param and message.startswith(f"{exc.field}:"):
            message = f"{param}:{message[len(exc.field) + 1:]}"
        return ApiError(400, message, param=param, code="invalid_value")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and exc.reason not in UNPLACEABLE:
        return ApiError(429, exc.message, code="rate_limit_exceeded", type="rate_limit_error",
                        retry_after_s=exc.retry_after_s)
    if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
        return ApiError(503, exc.message, code="no_worker_available", type="service_unavailable_error",
                        retry_after_s=exc.retry_after_s)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, exc.message, code="deadline_exceeded", type="timeout_error")
    if code == grpc.StatusCode.NOT_FOUND:
        return ApiError(404, exc.message, code="not_found")
    return ApiError(500, exc.message, code=code.name.lower(), type="server_error")


# ---------------------------------------------------------------------------- responses


def usage_json(usage: generation_pb2.Usage) -> dict[str, Any]:
    """OpenAI's usage, and under `cedserve` what the gRPC API's `Usage` adds (the server's own TTFT and
    total seconds, KV moved, DSpark drafts); clients ignore fields they do not know."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            "cedserve": {"ttft_s": usage.ttft_s, "total_s": usage.total_s, "kv_transfer_bytes": usage.kv_transfer_bytes,
                         "kv_transfer_s": usage.kv_transfer_s, "kv_transfer_tail_s": usage.kv_transfer_tail_s,
                         "decode_only": float(usage.decode_only),
                         "draft_tokens": usage.draft_tokens, "accepted_draft_tokens": usage.accepted_draft_tokens}}


def finish_reason(complete: generation_pb2.Complete) -> str:
    return _FINISH.get(complete.finish_reason, "stop")


@dataclass
class Shaper:
    """Builds one call's response objects: whole (`whole`) or as stream chunks (`chunk`, `last`,
    `usage_chunk`). Logprobs are shaped per API: completions' parallel lists, chat's `content` list."""

    call: ApiCall
    token_text: Callable[[int], str]
    """Text of one token (logprobs name tokens by their text)."""

    @classmethod
    def of(cls, call: ApiCall, codec: TextCodec) -> Shaper:
        return cls(call, lambda t: codec.decode([t], skip_special_tokens=False))

    @property
    def _object(self) -> str:
        if self.call.kind == "chat":
            return "chat.completion.chunk" if self.call.stream else "chat.completion"
        return "text_completion"

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.call.id, "object": self._object, "created": self.call.created, "model": self.call.model,
                "choices": choices}

    def _choice(self, text: str, logprobs: Any, finish: str | None, first: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.call.kind == "chat" and self.call.stream:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
        elif self.call.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        return choice

    def logprobs(self, chunks: list[generation_pb2.Chunk]) -> Any:
        """The `logprobs` of a choice made of `chunks` (None when not asked for)."""
        if self.call.logprobs is None:
            return None
        n = self.call.logprobs
        rows = [(t, c.logprobs[i] if i < len(c.logprobs) else None,
                 list(c.top_logprobs[i].entries)[:n] if i < len(c.top_logprobs) else [])
                for c in chunks for i, t in enumerate(c.token_ids)]
        if self.call.kind == "chat":
            return {"content": [{**self._token(t, lp), "top_logprobs": [self._token(e.token_id, e.logprob) for e in top]}
                                for t, lp, top in rows]}
        return {"tokens": [self.token_text(t) for t, _, _ in rows], "token_logprobs": [lp for _, lp, _ in rows],
                "top_logprobs": [{self.token_text(e.token_id): e.logprob for e in top} for _, _, top in rows]}

    def _token(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def whole(self, chunks: list[generation_pb2.Chunk], complete: generation_pb2.Complete) -> dict[str, Any]:
        """The non-streamed answer."""
        text = "".join(c.text for c in chunks)
        body = self._envelope([self._choice(text, self.logprobs(chunks), finish_reason(complete))])
        body["usage"] = usage_json(complete.usage)
        return body

    def chunk(self, chunk: generation_pb2.Chunk, first: bool) -> dict[str, Any]:
        """One streamed piece of text (the first chat chunk also carries the role)."""
        return self._with_usage(self._envelope([self._choice(chunk.text, self.logprobs([chunk]), None, first)]))

    def last(self, complete: generation_pb2.Complete) -> dict[str, Any]:
        """The streamed chunk that carries the finish reason."""
        return self._with_usage(self._envelope([self._choice("", None, finish_reason(complete))]))

    def usage_chunk(self, complete: generation_pb2.Complete) -> dict[str, Any]:
        """`stream_options.include_usage`: after the last choice chunk, no choices and the usage."""
        body = self._envelope([])
        body["usage"] = usage_json(complete.usage)
        return body

    def _with_usage(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.call.include_usage:
            body["usage"] = None  # OpenAI's chunks say so until the usage chunk
        return body
