"""Large prompts are validated and tokenized on the router's bounded thread pool
(router/tokenize_pool.py): the result is `prepare`'s, the event loop keeps running meanwhile, and
past the bound a request is refused with RESOURCE_EXHAUSTED and a retry delay."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from cedserve.model.checkpoint_writer import fit_config_to_tokenizer
from cedserve.model.presets import preset
from cedserve.model.tokenizer import TextCodec, tiny_tokenizer_path
from cedserve.proto import generation_pb2
from cedserve.router.errors import RequestError
from cedserve.router.requests import ModelLimits, prepare
from cedserve.router.tokenize_pool import TokenizePool

pytestmark = pytest.mark.unit

LINE = "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"


@pytest.fixture(scope="module")
def codec_and_limits() -> tuple[TextCodec, ModelLimits]:
    model = fit_config_to_tokenizer(preset("tiny"), tiny_tokenizer_path())
    return TextCodec.from_file(tiny_tokenizer_path(), model.vocab_size), ModelLimits("m", model.vocab_size,
                                                                                     1_000_000, 16, 0)


def _request(text: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=generation_pb2.Prompt(text=text), max_tokens=1, request_id="r")


def test_a_large_prompt_is_prepared_as_inline_while_the_loop_runs(codec_and_limits: tuple[TextCodec, ModelLimits]) -> None:
    codec, limits = codec_and_limits

    async def run(request: generation_pb2.GenerateRequest) -> tuple[object, float, float]:
        pool = TokenizePool(codec, limits)
        gaps = [0.0]

        async def ticker() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.002)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticking = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        start = time.monotonic()
        try:
            prepared = await pool.prepare(request)
        finally:
            ticking.cancel()
            pool.close()
        return prepared, time.monotonic() - start, max(gaps)

    # the comparison means something only if tokenizing takes long against the loop's 2 ms ticks: a
    # quiet machine tokenizes ~115 KB in well under 0.1 s, so the prompt grows until it does not
    for lines in (1500, 6000, 24000):
        request = _request(LINE * lines)
        prepared, took_s, worst_gap_s = asyncio.run(run(request))
        if took_s > 0.1:
            break
    assert prepared == prepare(request, codec, limits)
    # tokenized on the loop, one gap would span the whole call; on the pool the loop stalls only briefly
    assert took_s > 0.1 and worst_gap_s < took_s / 2, (took_s, worst_gap_s)


def test_past_the_bound_a_large_prompt_is_refused_with_a_retry_delay(
        codec_and_limits: tuple[TextCodec, ModelLimits]) -> None:
    codec, limits = codec_and_limits

    async def run() -> list[object]:
        pool = TokenizePool(codec, limits, threads=1, max_pending=1)
        try:
            return list(await asyncio.gather(pool.prepare(_request(LINE * 500)), pool.prepare(_request(LINE * 500)),
                                             pool.prepare(_request("short")), return_exceptions=True))
        finally:
            pool.close()

    first, second, short = asyncio.run(run())
    assert not isinstance(first, BaseException) and not isinstance(short, BaseException)
    assert isinstance(second, RequestError) and second.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert second.retry_after_s > 0


def test_a_refusal_is_prepares_own(codec_and_limits: tuple[TextCodec, ModelLimits]) -> None:
    codec, limits = codec_and_limits
    bad = _request(LINE * 100)
    bad.sampling.temperature = -1.0

    async def run() -> None:
        pool = TokenizePool(codec, limits)
        try:
            await pool.prepare(bad)
        finally:
            pool.close()

    with pytest.raises(RequestError) as caught:
        asyncio.run(run())
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and caught.value.field == "sampling.temperature"
