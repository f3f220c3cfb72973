"""The router's OpenAI-compatible HTTP API as `cedserve bench serve --api http` drives it.

A deliberately thin HTTP/1.1 client on asyncio streams (keep-alive connections reused from a pool,
chunked server-sent events parsed by hand), so the figures show what the server's HTTP layer adds
rather than what a heavyweight client library costs. It has the same `generate` as the gRPC
`AsyncClient` (cedserve/client.py) and returns the same `Completion`; a refusal becomes the same
`CedserveError`, under the gRPC code of the HTTP status, so reports of both APIs read alike.

Requests are streamed completions of token ids with `stream_options.include_usage` (the usage chunk
carries the cached tokens and the server's own timings, `usage.cedserve`), `temperature` 0 as the
gRPC client's default, `user` = the run's cache salt. The OpenAI API has no session id: placement
sees none (this matters only with several workers per pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from cedserve.client import CedserveError, Completion, Piece
from cedserve.router.http_api import TIMEOUT_HEADER

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
          504: grpc.StatusCode.DEADLINE_EXCEEDED}
_Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def _error(status: int, body: bytes) -> CedserveError:
    try:
        error = json.loads(body)["error"]
        message, param = str(error.get("message", "")), str(error.get("param") or "")
    except (ValueError, KeyError, TypeError):
        message, param = body.decode("utf-8", "replace")[:200], ""
    return CedserveError(_CODES.get(status, grpc.StatusCode.UNKNOWN), f"HTTP {status}: {message}", param)


class HttpClient:
    def __init__(self, address: str, model: str, api_key: str | None = None, timeout_s: float | None = None) -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port, self.model = host, int(port), model
        self.api_key, self.timeout_s = api_key, timeout_s
        self._idle: list[_Connection] = []

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()

    async def generate(self, prompt: list[int], on_piece: Callable[[Piece], None] | None = None, *,
                       effort: int | None = None, max_tokens: int = 0, cache_salt: str = "",
                       session_id: str = "") -> Completion:
        """One streamed completion; `session_id` has no place in the OpenAI API and is not sent."""
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}}
        if effort is not None:
            body["reasoning_effort"] = effort
        if max_tokens:
            body["max_tokens"] = max_tokens
        if cache_salt:
            body["user"] = cache_salt
        try:
            async with asyncio.timeout(self.timeout_s):  # (not wait_for: Python 3.11's may swallow a cancel)
                return await self._generate(json.dumps(body).encode(), on_piece)
        except TimeoutError:
            raise CedserveError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request timed out") from None
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise CedserveError(grpc.StatusCode.UNAVAILABLE, f"HTTP connection failed: {exc}") from None

    async def _generate(self, body: bytes, on_piece: Callable[[Piece], None] | None) -> Completion:
        reader, writer = await self._connection()
        try:
            writer.write(self._head(len(body)) + body)
            status, headers = await _response_head(reader)
            if status != 200:
                raise _error(status, await _whole_body(reader, headers))
            done = await _read_events(_chunks(reader), on_piece)
        except BaseException:
            writer.close()
            raise
        self._idle.append((reader, writer))
        return done

    async def _connection(self) -> _Connection:
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return await asyncio.open_connection(self.host, self.port)

    def _head(self, length: int) -> bytes:
        lines = ["POST /v1/completions HTTP/1.1", f"host: {self.host}:{self.port}",
                 "content-type: application/json", f"content-length: {length}"]
        if self.api_key:
            lines.append(f"authorization: Bearer {self.api_key}")
        if self.timeout_s:
            lines.append(f"{TIMEOUT_HEADER}: {self.timeout_s}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _response_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readuntil(b"\r\n")
    status = int(status_line.split(b" ", 2)[1])
    headers = {}
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _whole_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        return b"".join([chunk async for chunk in _chunks(reader)])
    return await reader.readexactly(int(headers.get("content-length", "0")))


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The payloads of a chunked body, until its last (empty) chunk."""
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return
        yield data[:-2]


async def _read_events(chunks: AsyncIterator[bytes], on_piece: Callable[[Piece], None] | None) -> Completion:
    """Server-sent events up to `data: [DONE]`: text pieces, then the usage chunk."""
    buffer, request_id = b"", ""
    text: list[str] = []
    usage: dict[str, float] = {}
    finish = ""
    async for chunk in chunks:
        buffer += chunk
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            data = event.removeprefix(b"data: ")
            if data == b"[DONE]":
                with contextlib.suppress(StopAsyncIteration):  # the body's last chunk follows
                    await chunks.__anext__()
                return Completion(request_id, "".join(text), [], finish, usage)
            message = json.loads(data)
            if "error" in message:
                error = message["error"]
                raise CedserveError(grpc.StatusCode.UNAVAILABLE, str(error.get("message")), str(error.get("param") or ""))
            request_id = message["id"]
            for choice in message["choices"]:
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
                if on_piece is not None:
                    on_piece(Piece([], choice["text"]))
            if message.get("usage"):
                usage = _usage(message["usage"])
    raise CedserveError(grpc.StatusCode.UNAVAILABLE, "the event stream ended before [DONE]")


def _usage(usage: dict[str, Any]) -> dict[str, float]:
    server = usage.get("cedserve", {})
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], **server}
