"""Validation and tokenization off the router's event loop, on a bounded pool of threads.

The router serves every request on one asyncio loop: a prompt tokenized on it stalls every other
request's stream for as long as the tokenizer runs (three 15 MB prompts once held a normal request
32 s). `TokenizePool.prepare` runs `router.requests.prepare` on `threads` threads instead (the
`tokenizers` library's encode runs in Rust without the GIL), with at most `max_pending` requests
waiting for or holding a thread; one more is refused with RESOURCE_EXHAUSTED and a retry delay.
Prompts of at most `inline_bytes` are prepared on the loop: a thread hop would cost more than they do.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc

from cedserve.model.tokenizer import TextCodec
from cedserve.proto import generation_pb2
from cedserve.router.errors import TOKENIZE_QUEUE, RequestError
from cedserve.router.requests import ModelLimits, PreparedRequest, prepare

INLINE_BYTES = 4096
"""Prompt bytes (text or chat contents; 4 per token id) prepared on the loop itself."""


def prompt_bytes(request: generation_pb2.GenerateRequest) -> int:
    """What tokenizing the prompt costs, roughly: its text's length (4 bytes per token id)."""
    kind = request.prompt.WhichOneof("kind")
    if kind == "text":
        return len(request.prompt.text)
    if kind == "chat":
        return sum(len(m.content) for m in request.prompt.chat.messages)
    if kind == "token_ids":
        return 4 * len(request.prompt.token_ids.ids)
    return 0


class TokenizePool:
    """See the module docstring. Call `prepare` on the router's loop; `close` when the router stops."""

    def __init__(self, codec: TextCodec, limits: ModelLimits, threads: int = 2, max_pending: int = 64,
                 inline_bytes: int = INLINE_BYTES) -> None:
        if threads < 1 or max_pending < threads:
            raise ValueError(f"tokenize pool: need threads >= 1 and max_pending >= threads, got {threads}, {max_pending}")
        self.codec, self.limits = codec, limits
        self.max_pending, self.inline_bytes = max_pending, inline_bytes
        self.pending = 0
        """Requests queued for or running on a thread now."""
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")

    async def prepare(self, request: generation_pb2.GenerateRequest) -> PreparedRequest:
        """`router.requests.prepare` (its `RequestError`s unchanged), on a thread for a large prompt;
        RESOURCE_EXHAUSTED when `max_pending` are already waiting."""
        if prompt_bytes(request) <= self.inline_bytes:
            return prepare(request, self.codec, self.limits)
        if self.pending >= self.max_pending:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{self.pending} large prompts are being tokenized; retry later",
                               retry_after_s=0.5, request_id=request.request_id, reason=TOKENIZE_QUEUE)
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, prepare, request, self.codec, self.limits)
        finally:
            self.pending -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
