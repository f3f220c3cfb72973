"""The OpenAI-compatible HTTP API end to end: the real `openai` client against a real `cedserve serve`
(the shipped demo checkpoint, router + prefill + decode processes on loopback), beside the gRPC API.

One system serves the whole module (tests run in file order). Its config turns on what the error
cases need: API keys, a 1 MB body limit, one running and no queued request in the low effort class
(so a second low-effort request is refused by admission), and 64 decode blocks (so a 5,000-token
prompt fits no decode worker; `[cache] num_blocks` sizes both workers' pools).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from cedserve.bench.serve.http_client import HttpClient
from cedserve.client import AsyncClient, CedserveError, Client, Completion, Piece
from cedserve.common.credentials import token_metadata
from cedserve.launcher import TOKEN_FILE_NAME
from cedserve.proto import worker_pb2, worker_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY = "sk-test-http-api"
MODEL = "cedserve"
CONFIG = """
[router]
max_message_bytes = 1000000

[router.limits.low]
max_running = 1
max_queued = 0

[cache]
num_blocks = 64
"""


class System:
    """`cedserve serve --port 0 --http-port 0` with its own home, keys and config."""

    def __init__(self, root: Path) -> None:
        (root / "keys").write_text(f"{KEY}\n")
        (root / "serve.toml").write_text(CONFIG)
        env = {**os.environ, "CEDSERVE_HOME": str(root / "home"), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cedserve.cli", "serve", "--port", "0", "--http-port", "0", "--device", "cpu",
             "--api-key-file", str(root / "keys"), "--config", str(root / "serve.toml")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.metrics: dict[str, str] = {}
        ready = self._wait_ready()
        self.grpc_address = str(ready["address"])
        self.base_url = f"http://127.0.0.1:{ready['http_port']}/v1"

    def _wait_ready(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        lines = []
        for line in self.proc.stdout:
            lines.append(line)
            found = re.match(r"metrics of (\S+): (\S+)", line)
            if found:
                self.metrics[found.group(1)] = found.group(2)
            logs = re.search(r"\(logs: (.+)\)$", line)
            if logs:
                self.log_dir = Path(logs.group(1))
            if line.startswith("CEDSERVE_READY"):
                return dict(json.loads(line.split(" ", 1)[1]))
        raise AssertionError("cedserve serve never became ready:\n" + "".join(lines[-30:]))

    def client(self, timeout_s: float = 120.0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=KEY, max_retries=0, timeout=timeout_s)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=KEY, max_retries=0, timeout=120.0)

    def grpc(self) -> Client:
        return Client(self.grpc_address, api_key=KEY, timeout_s=120)

    def decode_load(self) -> worker_pb2.LoadReport:
        """The decode worker's own account (its ready line is in its log; calls carry the system's token)."""
        ready = next(line for line in (self.log_dir / "decode0.log").read_text().splitlines()
                     if line.startswith("CEDSERVE_READY"))
        token = (self.log_dir / "run" / TOKEN_FILE_NAME).read_text().strip()
        with grpc.insecure_channel(json.loads(ready.split(" ", 1)[1])["address"]) as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)  # type: ignore[no-untyped-call]
            load: worker_pb2.LoadReport = stub.GetLoad(worker_pb2.LoadRequest(), timeout=10,
                                                       metadata=token_metadata(token))
        return load

    def wait_decode_idle(self, within_s: float) -> None:
        """Every decode block free again within `within_s`, and no request running."""
        deadline = time.monotonic() + within_s
        while True:
            load = self.decode_load()
            if load.free_blocks == load.total_blocks and load.running_requests == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"decode worker: {load.free_blocks} of {load.total_blocks} blocks free, "
                                     f"{load.running_requests} requests running")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    s = System(tmp_path_factory.mktemp("http_api"))
    try:
        yield s
    finally:
        s.stop()


def _long_text(words: int, seed: int) -> str:
    """Text of many tokens that no other test shares a prefix with."""
    return " ".join(f"w{(i * 7919 + seed) % 100003}" for i in range(words))


@pytest.mark.parametrize("prompt", ["def fibonacci(", _long_text(150, seed=1)], ids=["decode-only", "disaggregated"])
def test_completion_equals_the_grpc_greedy_answer(system: System, prompt: str) -> None:
    with system.grpc() as grpc_client:
        expected = grpc_client.generate(prompt, max_tokens=12)
    assert expected.usage["prompt_tokens"] > (256 if prompt.startswith("w") else 0)  # the long one is not decode-only
    answer = system.client().completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert answer.choices[0].text == expected.text and expected.text
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.completion_tokens == len(expected.token_ids) == 12
    assert answer.usage.prompt_tokens == expected.usage["prompt_tokens"]
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 12


def test_streaming_sync_and_async_give_the_same_text(system: System) -> None:
    prompt = "import numpy as np\n"
    whole = system.client().completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    stream = system.client().completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True)
    pieces = list(stream)
    assert "".join(p.choices[0].text for p in pieces if p.choices) == whole.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "length"

    async def run_async() -> tuple[str, str, openai.types.CompletionUsage | None]:
        async with system.async_client() as client:
            answer = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
            texts, usage = [], None
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                                     stream=True, stream_options={"include_usage": True})
            async for piece in stream:
                texts.extend(c.text for c in piece.choices)
                usage = piece.usage or usage
            return answer.choices[0].text, "".join(texts), usage

    async_whole, async_streamed, usage = asyncio.run(run_async())
    assert async_whole == async_streamed == whole.choices[0].text
    assert usage is not None and usage.completion_tokens == 10 and usage.prompt_tokens == whole.usage.prompt_tokens  # type: ignore[union-attr]


def test_logprobs_are_the_engines(system: System) -> None:
    answer = system.client().completions.create(model=MODEL, prompt="class Node:", max_tokens=4, temperature=0,
                                                logprobs=3)
    lp = answer.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert "".join(lp.tokens) == answer.choices[0].text and len(lp.token_logprobs) == 4
    for i, (chosen, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs)):
        assert chosen is not None and chosen <= 0
        if i == 0 and not top:
            continue  # a prefill worker reports the first token's own logprob, not its alternatives
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(chosen, abs=1e-5)  # greedy: the chosen token is the likeliest


def test_usage_reports_cached_tokens_after_a_repeated_prefix(system: System) -> None:
    """The second request of a tenant (`user`) reuses the first's prefix, as the same prompts do over
    gRPC with a cache salt of their own; another tenant reuses nothing."""
    prompt = _long_text(300, seed=2)
    with system.grpc() as grpc_client:
        grpc_first = grpc_client.generate(prompt, max_tokens=2, cache_salt="grpc-tenant")
        grpc_second = grpc_client.generate(prompt + " w1 w2 w3", max_tokens=2, cache_salt="grpc-tenant")
    assert grpc_first.usage["cached_tokens"] == 0 and grpc_second.usage["cached_tokens"] > 0
    client = system.client()
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, user="tenant-a")
    second = client.completions.create(model=MODEL, prompt=prompt + " w1 w2 w3", max_tokens=2, user="tenant-a")
    other = client.completions.create(model=MODEL, prompt=prompt + " w1 w2 w3", max_tokens=2, user="tenant-b")
    cached = [u.prompt_tokens_details.cached_tokens for u in (first.usage, second.usage, other.usage)
              if u is not None and u.prompt_tokens_details is not None]
    assert cached == [0, grpc_second.usage["cached_tokens"], 0]
    assert second.usage is not None and second.usage.prompt_tokens == grpc_second.usage["prompt_tokens"]


def test_a_disconnect_mid_stream_frees_every_block(system: System) -> None:
    """400 tokens take the demo model tens of seconds on CPU: blocks free within seconds of the client
    leaving only because the router cancelled the request on both workers."""
    system.wait_decode_idle(10)
    stream = system.client().completions.create(model=MODEL, prompt=_long_text(40, seed=3), max_tokens=400,
                                                temperature=0, stream=True)
    pieces = iter(stream)
    next(pieces), next(pieces)
    assert system.decode_load().running_requests == 1  # the request is decoding
    stream.close()
    system.wait_decode_idle(8)
    # a client that gives up on a whole (non-streamed) answer is a disconnect too
    impatient = system.client(timeout_s=1.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=MODEL, prompt=_long_text(40, seed=4), max_tokens=400)
    system.wait_decode_idle(8)


def test_the_bench_http_client_reads_what_the_openai_client_reads(system: System) -> None:
    """`cedserve bench serve --api http`'s thin client: same text, the usage with the router's own time,
    the connection reused, and a refusal as the gRPC client's error."""
    prompt = list(range(100, 140))
    expected = system.client().completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)

    async def run() -> tuple[list[Completion], list[Piece], CedserveError]:
        client = HttpClient(system.base_url.removeprefix("http://").removesuffix("/v1"), MODEL, KEY, 60.0)
        pieces: list[Piece] = []
        try:
            done = [await client.generate(prompt, pieces.append, max_tokens=6, cache_salt="bench") for _ in range(2)]
            with pytest.raises(CedserveError) as info:
                await client.generate(prompt, max_tokens=100_000)
            return done, pieces, info.value
        finally:
            await client.close()

    done, pieces, refused = asyncio.run(run())
    assert [d.text for d in done] == [expected.choices[0].text] * 2 and done[0].finish_reason == "length"
    assert "".join(p.text for p in pieces) == expected.choices[0].text * 2
    usage = done[0].usage
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] == 40 and 0 < usage["total_s"] < 60
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and refused.field == "max_tokens"


def _error(exc: openai.APIStatusError) -> dict[str, object]:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"n": 2}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"extra_body": {"reasoning_effort": "extreme"}}, "reasoning_effort"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"stop": [""]}, "stop"),
    ({"prompt": ""}, "prompt"),
    ({"user": "u" * 300}, "user"),
])
def test_bad_fields_are_400_naming_the_parameter(system: System, kwargs: dict[str, object], param: str) -> None:
    args: dict[str, object] = {"model": MODEL, "prompt": "hello", "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        system.client().completions.create(**args)  # type: ignore[call-overload]
    assert info.value.status_code == 400 and _error(info.value)["param"] == param


def test_chat_on_a_checkpoint_without_a_chat_format_is_a_clear_400(system: System) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            system.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_completion_tokens=2, stream=stream)
        error = _error(info.value)
        assert error["param"] == "messages" and "no chat format" in str(error["message"])


def test_auth_model_and_body_size_errors(system: System) -> None:
    bad_key = openai.OpenAI(base_url=system.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as auth:
        bad_key.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert auth.value.status_code == 401 and _error(auth.value)["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as missing:
        system.client().completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert _error(missing.value)["param"] == "model" and _error(missing.value)["code"] == "model_not_found"
    assert [m.id for m in system.client().models.list()] == [MODEL]
    with pytest.raises(openai.APIStatusError) as huge:
        system.client().completions.create(model=MODEL, prompt="x" * 2_000_000, max_tokens=2)
    assert huge.value.status_code == 413 and _error(huge.value)["code"] == "request_too_large"
    health = urllib.request.urlopen(system.base_url.removesuffix("/v1") + "/health", timeout=10)  # no key needed
    assert json.loads(health.read()) == {"status": "ok"}


def test_a_15_mb_prompt_is_refused_alike_by_the_client_and_the_router(system: System) -> None:
    """The blocking `Client` refuses a 15 MB prompt itself in the router's words (the same prompt sent
    unchecked is the router's answer); three at once on one `AsyncClient` likewise. HTTP refuses a
    chunked body (no `Content-Length` to refuse it by) once what it read passes the limit, before the
    body ends."""
    big = "x" * 15_000_000

    def answer(check_limits: bool) -> tuple[str, str]:
        with Client(system.grpc_address, api_key=KEY, timeout_s=60, check_limits=check_limits) as client:
            try:
                client.generate(big, max_tokens=2)
            except CedserveError as exc:
                return exc.code.name, exc.message
        raise AssertionError("a 15 MB prompt was served")

    router = answer(check_limits=False)
    assert router[0] == "RESOURCE_EXHAUSTED" and answer(check_limits=True) == router

    async def three() -> list[BaseException | Completion]:
        client = AsyncClient(system.grpc_address, api_key=KEY, timeout_s=60)
        try:
            return await asyncio.gather(*(client.generate(big, max_tokens=2) for _ in range(3)),
                                        return_exceptions=True)
        finally:
            await client.close()

    assert [(e.code.name, e.message) for e in asyncio.run(three()) if isinstance(e, CedserveError)] == [router] * 3
    host, port = system.base_url.removeprefix("http://").removesuffix("/v1").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"x" * (64 << 10)
        for _ in range(6):  # 384 KiB, over the demo's 196,608-byte limit; the last chunk never sent
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert sock.recv(64).startswith(b"HTTP/1.1 413 ")


def _refused_once(system: System) -> openai.RateLimitError:
    """A request refused with 429: the low effort class runs one request and queues none (this
    module's config), so a second one beside a decoding one is turned away."""
    client = system.client()
    holder = client.completions.create(model=MODEL, prompt="def main():", max_tokens=200, stream=True,
                                       extra_body={"reasoning_effort": "low"})
    next(iter(holder))  # admitted and decoding
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"reasoning_effort": 50})
    holder.close()
    system.wait_decode_idle(8)
    return info.value


def test_admission_refusal_is_429_with_retry_after(system: System) -> None:
    client = system.client()
    refused = _refused_once(system)
    assert refused.status_code == 429 and int(refused.response.headers["retry-after"]) >= 1
    assert _error(refused)["type"] == "rate_limit_error"
    # the class is free again: the same request is served
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                     extra_body={"reasoning_effort": "low"}).usage is not None


def test_no_worker_with_room_is_503(system: System) -> None:
    """A prompt of more blocks than the decode worker has (64 here) fits nowhere."""
    prompt = _long_text(1200, seed=5)
    with system.grpc() as grpc_client:
        assert 64 * 64 < grpc_client.count_tokens(prompt) < 8192
    with pytest.raises(openai.InternalServerError) as info:
        system.client().completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert info.value.status_code == 503 and "retry-after" in info.value.response.headers
    assert _error(info.value)["code"] == "no_worker_available"


def test_router_metrics_count_http_requests(system: System) -> None:
    """Its own requests counted (whatever ran before it in the module): two served, one refused."""

    def count(status: str) -> float:
        page = urllib.request.urlopen(system.metrics["router"], timeout=10).read().decode()
        line = 'cedserve_router_http_requests_total{endpoint="completions",status="' + status + '"} '
        found = re.search("^" + re.escape(line) + r"(\S+)$", page, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    before = count("200"), count("429")
    for _ in range(2):
        system.client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
    _refused_once(system)  # its holder's stream counts as one more 200 once it is closed
    assert count("200") >= before[0] + 2 and count("429") == before[1] + 1
