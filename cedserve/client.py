"""Python client for the public API: `Client` (blocking) and `AsyncClient` (asyncio).

    from cedserve.client import Client
    with Client("127.0.0.1:50051") as client:
        for piece in client.stream("def fibonacci(", effort="high", max_tokens=32):
            print(piece.text, end="", flush=True)

Errors raise `CedserveError` with the gRPC code, the offending field (INVALID_ARGUMENT) and the
retry hint (RESOURCE_EXHAUSTED), read from the standard rich-status trailer. For a TLS router pass
`tls=TLSConfig(ca="ca.pem")` (plus `cert`/`key` under mTLS); a handshake that fails (unknown CA, no
client certificate) raises `CedserveError` UNAVAILABLE.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

from cedserve.common.tls import TLSConfig, open_aio_channel, open_channel
from cedserve.proto import generation_pb2, generation_pb2_grpc

PromptLike = str | Sequence[int] | Sequence[dict[str, str]]


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


def _prompt(prompt: PromptLike) -> generation_pb2.Prompt:
    if isinstance(prompt, str):
        return generation_pb2.Prompt(text=prompt)
    items = list(prompt)
    if items and isinstance(items[0], dict):
        msgs = [generation_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in items]  # type: ignore[index]
        return generation_pb2.Prompt(chat=generation_pb2.Chat(messages=msgs))
    return generation_pb2.Prompt(token_ids=generation_pb2.TokenIds(ids=[int(str(t)) for t in items]))


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


def build_request(prompt: PromptLike, *, effort: int | str | None = None, max_tokens: int = 0,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                  stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (), cache_salt: str = "",
                  session_id: str = "", request_id: str = "", logprobs: int = 0,
                  model: str = "") -> generation_pb2.GenerateRequest:
    sampling = generation_pb2.Sampling(temperature=temperature, top_p=top_p, top_k=top_k, logprobs=logprobs)
    if seed is not None:
        sampling.seed = seed
    return generation_pb2.GenerateRequest(model=model, prompt=_prompt(prompt), effort=_effort(effort),
                                          sampling=sampling, max_tokens=max_tokens, stop=list(stop),
                                          stop_token_ids=list(stop_token_ids), cache_salt=cache_salt,
                                          session_id=session_id, request_id=request_id)


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
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith(_OVER_LIMIT):
        details += (" bytes: the request is larger than the router accepts (`[router] max_message_bytes`, and at"
                    " most what the model's context can use); send a shorter prompt")
    return CedserveError(code, details, field_name, retry)


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
                     "decode_only": float(u.decode_only)}
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
    """Blocking client over one channel."""

    def __init__(self, address: str, api_key: str | None = None, timeout_s: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None, tls: TLSConfig | None = None) -> None:
        self.channel = (grpc.secure_channel(address, credentials) if credentials
                        else open_channel(address, tls or TLSConfig()))
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)  # type: ignore[no-untyped-call]
        self.metadata = _metadata(api_key)
        self.timeout_s = timeout_s
        self.last: Completion | None = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def stream(self, prompt: PromptLike, **kwargs: Any) -> Iterator[Piece]:
        """Yield pieces as they arrive; `self.last` holds the `Completion` afterwards."""
        collector = _Collector()
        try:
            for response in self.stub.Generate(build_request(prompt, **kwargs), timeout=self.timeout_s,
                                               metadata=self.metadata):
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
        try:
            reply = self.stub.CountTokens(generation_pb2.CountTokensRequest(prompt=_prompt(prompt),
                                                                            effort=_effort(effort)),
                                          timeout=self.timeout_s, metadata=self.metadata)
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
    """asyncio client over one channel."""

    def __init__(self, address: str, api_key: str | None = None, timeout_s: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None, tls: TLSConfig | None = None) -> None:
        self.channel = (grpc.aio.secure_channel(address, credentials) if credentials
                        else open_aio_channel(address, tls or TLSConfig()))
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)  # type: ignore[no-untyped-call]
        self.metadata = _metadata(api_key)
        self.timeout_s = timeout_s
        self.last: Completion | None = None

    async def close(self) -> None:
        await self.channel.close()

    async def _pieces(self, collector: _Collector, prompt: PromptLike, kwargs: dict[str, Any]) -> AsyncIterator[Piece]:
        try:
            async for response in self.stub.Generate(build_request(prompt, **kwargs), timeout=self.timeout_s,
                                                     metadata=self.metadata):
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
