"""Python client for the public API: `Client` (blocking) and `AsyncClient` (asyncio).

    from cedserve.client import Client
    with Client("127.0.0.1:50051") as client:
        for piece in client.stream("def fibonacci(", effort="high", max_tokens=32):
            print(piece.text, end="", flush=True)

Errors raise `CedserveError` with the gRPC code, the offending field (INVALID_ARGUMENT) and the
retry hint (RESOURCE_EXHAUSTED), read from the standard rich-status trailer. For a TLS router pass
`tls=TLSConfig(ca="ca.pem")` (plus `cert`/`key` under mTLS); a handshake that fails (unknown CA, no
client certificate) raises `CedserveError` UNAVAILABLE.

A prompt the router would refuse for its size (`cedserve.common.request_limits`) is refused here,
before its request is built, with the router's status and words: the client reads the router's
limits once (its model card, `ListModels`; kept `LIMITS_TTL_S`) when a prompt of `CHECK_FROM_BYTES`
or more first comes. Building, serializing and copying a 15 MB prompt costs ~70 ms of CPU, which on a
busy 2-core host became 0.6-2 s before the router's refusal could arrive (docs/routing.md, *Errors*).
`check_limits=False` sends every request as it is (the router still refuses it).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2

from cedserve.common.request_limits import (
    ID_FIELDS,
    RequestLimits,
    id_violation,
    over_receive_limit,
    prompt_violation,
)
from cedserve.common.tls import TLSConfig, open_aio_channel, open_channel
from cedserve.proto import generation_pb2, generation_pb2_grpc

PromptLike = str | Sequence[int] | Sequence[dict[str, str]]
CHECK_FROM_BYTES = 64 << 10
"""A prompt shorter than this (characters, or token ids) goes to the router unchecked: sending it
costs less than asking the router for its limits."""
LIMITS_TTL_S = 60.0
"""How long the router's limits, once read, are trusted (a restarted router may have others)."""


class CedserveError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, field: str = "", retry_after_s: float = 0.0) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code, self.message, self.field, self.retry_after_s = code, message, field, retry_after_s


@dataclass
class Piece:
    """One streamed chunk."""

    token_ids: list[int]
    text: str
    logprobs: list[float] = field(default_factory=list)


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict[str, float]


def _fill_prompt(target: generation_pb2.Prompt, prompt: PromptLike) -> None:
    """Set the request's own `Prompt` in place: a `Prompt` built apart and then passed to the request's
    constructor is copied whole again (~40 ms of CPU for 15 MB of text)."""
    if isinstance(prompt, str):
        target.text = prompt
        return
    items = list(prompt)
    if items and isinstance(items[0], dict):
        for m in items:
            target.chat.messages.add(role=m["role"], content=m["content"])  # type: ignore[index]
        return
    target.token_ids.SetInParent()  # an empty list is still a token-ids prompt
    target.token_ids.ids.extend(cast(list[int], items))  # checked in C (ints, numpy's too): 20x a Python loop


def _effort(effort: int | str | None) -> generation_pb2.Effort:
    if effort is None:
        return generation_pb2.Effort()
    if isinstance(effort, str) and not effort.isdigit():
        names = {"low": generation_pb2.EFFORT_NAME_LOW, "high": generation_pb2.EFFORT_NAME_HIGH,
                 "max": generation_pb2.EFFORT_NAME_MAX}
        if effort.lower() not in names:
            raise ValueError(f"effort must be 1-100 or one of {sorted(names)}, got {effort!r}")
        return generation_pb2.Effort(name=names[effort.lower()])
    return generation_pb2.Effort(level=int(effort))


def build_request(prompt: PromptLike, **kwargs: Any) -> generation_pb2.GenerateRequest:
    """The `GenerateRequest` for `prompt`; `kwargs` as `request_without_prompt`'s."""
    request = request_without_prompt(**kwargs)
    _fill_prompt(request.prompt, prompt)
    return request


def request_without_prompt(*, effort: int | str | None = None, max_tokens: int = 0, temperature: float = 0.0,
                           top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: Sequence[str] = (),
                           stop_token_ids: Sequence[int] = (), cache_salt: str = "", session_id: str = "",
                           request_id: str = "", logprobs: int = 0,
                           model: str = "") -> generation_pb2.GenerateRequest:
    """A `GenerateRequest` with every field but its prompt (checked against the router's limits
    before the prompt goes in)."""
    sampling = generation_pb2.Sampling(temperature=temperature, top_p=top_p, top_k=top_k, logprobs=logprobs)
    if seed is not None:
        sampling.seed = seed
    return generation_pb2.GenerateRequest(model=model, effort=_effort(effort), sampling=sampling,
                                          max_tokens=max_tokens, stop=list(stop), stop_token_ids=list(stop_token_ids),
                                          cache_salt=cache_salt, session_id=session_id, request_id=request_id)


# ---------------------------------------------------------------------------- the router's limits, here


def _varint_len(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _field_len(payload: int) -> int:
    """Bytes of a length-delimited protobuf field numbered 1-15 (a one-byte tag) with `payload` bytes."""
    return 1 + _varint_len(payload) + payload


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _prompt_hint(prompt: PromptLike) -> int:
    """No more than the prompt's bytes on the wire (a fifth of them at worst), in O(messages): its
    characters, or its count of token ids."""
    if isinstance(prompt, str):
        return len(prompt)
    if len(prompt) and isinstance(prompt[0], dict):  # len(): a numpy array of ids has no truth value
        chars = 0
        for m in prompt:
            chars += len(m["content"]) + len(m["role"])  # type: ignore[index]
        return chars
    return len(prompt)


def _prompt_size(prompt: PromptLike, exact: bool = True) -> tuple[str, int, int]:
    """(the `Prompt` oneof's case, the size the router bounds: UTF-8 bytes of a text or the chat's
    contents, or the count of token ids; the serialized `Prompt`'s bytes), computed without building
    it. Not `exact`: token ids count 5 bytes each (their most), not what each takes."""
    if isinstance(prompt, str):
        size = _utf8_len(prompt)
        return "text", size, _field_len(size)
    items = list(prompt)
    if items and isinstance(items[0], dict):
        chat, content_bytes = 0, 0
        for m in items:
            role, content = _utf8_len(m["role"]), _utf8_len(m["content"])  # type: ignore[index]
            content_bytes += content
            chat += _field_len((_field_len(role) if role else 0) + (_field_len(content) if content else 0))
        return "chat", content_bytes, _field_len(chat)
    if exact:
        return "token_ids", len(items), _field_len(generation_pb2.TokenIds(ids=cast(list[int], items)).ByteSize())
    return "token_ids", len(items), _field_len(_field_len(5 * len(items)) if items else 0)  # 1-5 bytes an id


def size_refusal(request: Message, prompt: PromptLike, limits: RequestLimits) -> CedserveError | None:
    """The error the router would answer `request` with once `prompt` is in it (`request` holds
    every other field), for the sizes it bounds (`cedserve.common.request_limits`), in its order
    and words; None when the router would take it up."""
    shell = request.ByteSize()
    kind, size, prompt_bytes = _prompt_size(prompt, exact=False)
    message_bytes = shell + _field_len(prompt_bytes)  # `prompt` is field 2 of both request types
    if message_bytes > limits.max_request_bytes and kind == "token_ids":  # ids counted at their most: count them
        kind, size, prompt_bytes = _prompt_size(prompt)
        message_bytes = shell + _field_len(prompt_bytes)
    if message_bytes > limits.max_request_bytes:
        return CedserveError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             _worded(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     over_receive_limit(message_bytes, limits.max_request_bytes)))
    for name in ID_FIELDS:
        found = id_violation(name, len(getattr(request, name, "")))
        if found is not None:
            break
    else:
        found = prompt_violation(kind, size, limits)
    if found is None:
        return None
    field_name, message = found
    return CedserveError(grpc.StatusCode.INVALID_ARGUMENT, f"{field_name}: {message}", field_name)


def _card_limits(reply: generation_pb2.ListModelsResponse) -> RequestLimits | None:
    """The limits a router publishes in its (one) model card; None from a router that publishes none."""
    if not reply.models or not reply.models[0].max_request_bytes or not reply.models[0].max_prompt_bytes:
        return None
    card = reply.models[0]
    return RequestLimits(int(card.max_request_bytes), int(card.max_prompt_bytes), int(card.max_context_tokens))


@dataclass
class _KnownLimits:
    """A client's copy of the router's limits and when it was read."""

    value: RequestLimits | None = None
    read_at: float = -math.inf

    def fresh(self) -> bool:
        return time.monotonic() - self.read_at < LIMITS_TTL_S

    def keep(self, value: RequestLimits | None) -> RequestLimits | None:
        self.value, self.read_at = value, time.monotonic()
        return value


_OVER_LIMIT = "SERVER: Received message larger than max"
"""How gRPC itself words the refusal of a request over the router's receive limit ("... (15000021 vs.
131072)"): the router never sees such a request, so it cannot word it."""


def _error(exc: grpc.RpcError) -> CedserveError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else str(exc)) or ""
    field_name, retry = "", 0.0
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == "grpc-status-details-bin":
            rich = status_pb2.Status.FromString(value)
            for detail in rich.details:
                bad, info = error_details_pb2.BadRequest(), error_details_pb2.RetryInfo()
                if detail.Unpack(bad) and bad.field_violations:
                    field_name = bad.field_violations[0].field
                elif detail.Unpack(info):
                    retry = info.retry_delay.ToMilliseconds() / 1000
    return CedserveError(code, _worded(code, details), field_name, retry)


def _worded(code: grpc.StatusCode, details: str) -> str:
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith(_OVER_LIMIT):
        return details + (" bytes: the request is larger than the router accepts (`[router] max_message_bytes`, and"
                          " at most what the model's context can use); send a shorter prompt")
    return details


class _Collector:
    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.request_id = ""
        self.done: Completion | None = None

    def take(self, response: generation_pb2.GenerateResponse) -> Piece | None:
        self.request_id = response.request_id
        kind = response.WhichOneof("response")
        if kind == "chunk":
            piece = Piece(list(response.chunk.token_ids), response.chunk.text, list(response.chunk.logprobs))
            self.text.append(piece.text)
            self.token_ids.extend(piece.token_ids)
            return piece
        if kind == "error":
            e = response.error
            raise CedserveError(grpc.StatusCode(_code_tuple(e.grpc_code)), e.message, e.field, e.retry_after_ms / 1000)
        if kind == "complete":
            u = response.complete.usage
            usage = {"prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
                     "completion_tokens": u.completion_tokens, "draft_tokens": u.draft_tokens,
                     "accepted_draft_tokens": u.accepted_draft_tokens, "ttft_s": u.ttft_s, "total_s": u.total_s,
                     "kv_transfer_bytes": u.kv_transfer_bytes, "kv_transfer_s": u.kv_transfer_s,
                     "kv_transfer_tail_s": u.kv_transfer_tail_s, "decode_only": float(u.decode_only)}
            reason = generation_pb2.FinishReason.Name(response.complete.finish_reason).removeprefix("FINISH_REASON_")
            self.done = Completion(self.request_id, "".join(self.text), self.token_ids, reason.lower(), usage)
        return None


def _code_tuple(value: int) -> tuple[int, str]:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            found: tuple[int, str] = code.value
            return found
    unknown: tuple[int, str] = grpc.StatusCode.UNKNOWN.value
    return unknown


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class Client:
    """Blocking client over one channel. `check_limits`: refuse here what the router would refuse for
    its size (module docstring)."""

    def __init__(self, address: str, api_key: str | None = None, timeout_s: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None, tls: TLSConfig | None = None,
                 check_limits: bool = True) -> None:
        self.channel = (grpc.secure_channel(address, credentials) if credentials
                        else open_channel(address, tls or TLSConfig()))
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)  # type: ignore[no-untyped-call]
        self.metadata = _metadata(api_key)
        self.timeout_s = timeout_s
        self.check_limits = check_limits
        self.last: Completion | None = None
        self._limits = _KnownLimits()

    def request_limits(self, refresh: bool = False) -> RequestLimits | None:
        """The router's request limits, read from its model card and kept `LIMITS_TTL_S`; None when
        it publishes none (an older router) or did not answer (the next large prompt asks again)."""
        if refresh or not self._limits.fresh():
            try:
                reply = self.stub.ListModels(generation_pb2.ListModelsRequest(), timeout=self.timeout_s,
                                             metadata=self.metadata)
            except grpc.RpcError:
                return None  # the call itself will say what is wrong
            return self._limits.keep(_card_limits(reply))
        return self._limits.value

    def _checked(self, request: Message, prompt: PromptLike) -> None:
        """Raise the router's refusal of `request` once `prompt` is in it, if it would refuse it for its size."""
        if self.check_limits and _prompt_hint(prompt) >= CHECK_FROM_BYTES:
            limits = self.request_limits()
            error = size_refusal(request, prompt, limits) if limits is not None else None
            if error is not None:
                raise error

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def stream(self, prompt: PromptLike, **kwargs: Any) -> Iterator[Piece]:
        """Yield pieces as they arrive; `self.last` holds the `Completion` afterwards."""
        collector = _Collector()
        request = request_without_prompt(**kwargs)
        self._checked(request, prompt)
        _fill_prompt(request.prompt, prompt)
        try:
            for response in self.stub.Generate(request, timeout=self.timeout_s, metadata=self.metadata):
                piece = collector.take(response)
                if piece is not None:
                    yield piece
        except grpc.RpcError as exc:
            raise _error(exc) from None
        self.last = collector.done

    def generate(self, prompt: PromptLike, **kwargs: Any) -> Completion:
        for _ in self.stream(prompt, **kwargs):
            pass
        assert self.last is not None
        return self.last

    def count_tokens(self, prompt: PromptLike, effort: int | str | None = None) -> int:
        request = generation_pb2.CountTokensRequest(effort=_effort(effort))
        self._checked(request, prompt)
        _fill_prompt(request.prompt, prompt)
        try:
            reply = self.stub.CountTokens(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return int(reply.num_tokens)

    def list_models(self) -> list[str]:
        try:
            reply = self.stub.ListModels(generation_pb2.ListModelsRequest(), timeout=self.timeout_s,
                                         metadata=self.metadata)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return [m.id for m in reply.models]


class AsyncClient:
    """asyncio client over one channel. `check_limits`: refuse here what the router would refuse for
    its size (module docstring)."""

    def __init__(self, address: str, api_key: str | None = None, timeout_s: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None, tls: TLSConfig | None = None,
                 check_limits: bool = True) -> None:
        self.channel = (grpc.aio.secure_channel(address, credentials) if credentials
                        else open_aio_channel(address, tls or TLSConfig()))
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)  # type: ignore[no-untyped-call]
        self.metadata = _metadata(api_key)
        self.timeout_s = timeout_s
        self.check_limits = check_limits
        self.last: Completion | None = None
        self._limits = _KnownLimits()
        self._reading: asyncio.Future[RequestLimits | None] | None = None
        """The read of the limits in flight: concurrent calls wait for one."""

    async def close(self) -> None:
        await self.channel.close()

    async def request_limits(self, refresh: bool = False) -> RequestLimits | None:
        """`Client.request_limits`; concurrent callers share one read."""
        if refresh or not self._limits.fresh():
            if self._reading is None or self._reading.done():
                self._reading = asyncio.ensure_future(self._read_limits())
            return await asyncio.shield(self._reading)
        return self._limits.value

    async def _read_limits(self) -> RequestLimits | None:
        try:
            reply = await self.stub.ListModels(generation_pb2.ListModelsRequest(), timeout=self.timeout_s,
                                               metadata=self.metadata)
        except grpc.RpcError:
            return None
        return self._limits.keep(_card_limits(reply))

    async def _pieces(self, collector: _Collector, prompt: PromptLike, kwargs: dict[str, Any]) -> AsyncIterator[Piece]:
        request = request_without_prompt(**kwargs)
        if self.check_limits and _prompt_hint(prompt) >= CHECK_FROM_BYTES:
            limits = await self.request_limits()
            error = size_refusal(request, prompt, limits) if limits is not None else None
            if error is not None:
                raise error
        _fill_prompt(request.prompt, prompt)
        try:
            async for response in self.stub.Generate(request, timeout=self.timeout_s, metadata=self.metadata):
                piece = collector.take(response)
                if piece is not None:
                    yield piece
        except grpc.RpcError as exc:
            raise _error(exc) from None

    async def stream(self, prompt: PromptLike, **kwargs: Any) -> AsyncIterator[Piece]:
        collector = _Collector()
        async for piece in self._pieces(collector, prompt, kwargs):
            yield piece
        self.last = collector.done

    async def generate(self, prompt: PromptLike, on_piece: Callable[[Piece], None] | None = None,
                       **kwargs: Any) -> Completion:
        """The whole completion. Safe to await concurrently on one client (each call collects its own
        stream); `on_piece` sees every chunk as it arrives (e.g. to time the first token)."""
        collector = _Collector()
        async for piece in self._pieces(collector, prompt, kwargs):
            if on_piece is not None:
                on_piece(piece)
        if collector.done is None:
            raise CedserveError(grpc.StatusCode.INTERNAL, "the stream ended without a complete message")
        self.last = collector.done
        return collector.done
