"""The whole system as users run it: router + prefill worker + decode worker as real processes,
real gRPC on loopback, real NIXL (UCX) between the workers, a tiny real-format checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from system_rig import greedy_reference

from cedserve.client import CedserveError, Client
from cedserve.common.credentials import token_metadata
from cedserve.launcher import TOKEN_FILE_NAME, EmbeddedOptions, LocalLauncher, start_embedded
from cedserve.model.checkpoint import load_model
from cedserve.model.checkpoint_writer import write_random_checkpoint
from cedserve.model.presets import preset
from cedserve.proto import worker_pb2, worker_pb2_grpc

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from decode_support import greedy_ties

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class System:
    def __init__(self, root: Path) -> None:
        self.checkpoint = root / "ckpt"
        write_random_checkpoint(preset("tiny"), self.checkpoint, seed=21)
        self.launcher = LocalLauncher(root / "logs")
        # Every draft verified: with `adaptive_verify` the number verified follows the measured step times
        # and the calibrated survival of earlier drafts (the random drafter's: ~0), so on a busy host a
        # request could verify none and the draft counts below would test the host's timing.
        config = {"decode": {"adaptive_verify": False}}
        router = start_embedded(EmbeddedOptions(checkpoint=self.checkpoint, port=0, log_dir=root / "logs",
                                                config=config), self.launcher)
        self.address = router["address"]
        self.metrics = router["metrics"]
        self.parts = {p.name: p for p in self.launcher.parts}
        token = (root / "logs" / "run" / TOKEN_FILE_NAME).read_text().strip()
        self.metadata = token_metadata(token)
        """What a direct call to a worker must carry: `cedserve serve` turns the worker-plane token on."""

    def worker_address(self, name: str) -> str:
        return str(self.parts[name].ready["address"])

    def free_blocks(self, name: str) -> tuple[int, int]:
        with grpc.insecure_channel(self.worker_address(name)) as ch:
            stub = (worker_pb2_grpc.PrefillWorkerStub(ch) if name.startswith("prefill")  # type: ignore[no-untyped-call]
                    else worker_pb2_grpc.DecodeWorkerStub(ch))  # type: ignore[no-untyped-call]
            load = stub.GetLoad(worker_pb2.LoadRequest(), timeout=10, metadata=self.metadata)
        return int(load.free_blocks), int(load.total_blocks)


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    s = System(tmp_path_factory.mktemp("system"))
    yield s
    s.launcher.stop_all()


def _wait_all_free(system: System, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        states = {n: system.free_blocks(n) for n in ("prefill0", "decode0")}
        # Prefill blocks may stay in its prefix cache (evictable, not leaked): only decode must be all free.
        if states["decode0"][0] == states["decode0"][1] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert states["decode0"][0] == states["decode0"][1], states


@pytest.mark.parametrize("prompt_len", [300, 150])  # 300: prefill worker + NIXL; 150: decode-only placement
def test_greedy_equals_the_monolithic_model(system: System, prompt_len: int) -> None:
    prompt = torch.randint(3, 500, (prompt_len,), generator=torch.Generator().manual_seed(3)).tolist()
    with Client(system.address, timeout_s=120) as client:
        done = client.generate(prompt, max_tokens=12)
    assert done.finish_reason == "length" and len(done.token_ids) == 12
    # The reference's greedy tokens, but for numerical ties: the worker's passes have other shapes (verify
    # rows, batches) than the reference's one-token steps, and the random tiny model's records can round
    # the other way (`greedy_ties` accepts a token only if another legitimate computation chooses it).
    if done.token_ids != greedy_reference(system.checkpoint, prompt, 12):
        assert len(greedy_ties(load_model(system.checkpoint), prompt, done.token_ids)) <= 2
    # the router stops reading at the length limit, before the worker's completion: the drafts are
    # counted from the token chunks (the tiny checkpoint's random drafter drafts, almost never right)
    assert done.usage["draft_tokens"] > 0 and done.usage["draft_tokens"] >= done.usage["accepted_draft_tokens"]
    if prompt_len == 300:  # the KV moved over NIXL: its exposed tail is part of its time, and took some
        assert done.usage["kv_transfer_bytes"] > 0
        assert 0 < done.usage["kv_transfer_tail_s"] <= done.usage["kv_transfer_s"]
    _wait_all_free(system)


def test_repeated_prefix_is_served_from_cache(system: System) -> None:
    # Longer than the decode-only threshold (256), so the prefill worker (and its cache) serves it.
    prompt = torch.randint(3, 500, (400,), generator=torch.Generator().manual_seed(4)).tolist()
    with Client(system.address, timeout_s=120) as client:
        first = client.generate(prompt, max_tokens=2)
        second = client.generate([*prompt, 7, 8, 9], max_tokens=2)
    assert first.usage["cached_tokens"] == 0
    # Whole 64-token blocks of the shared prefix, except those inside the last 128 tokens: the decoder
    # replay that samples the first token needs those tokens' encoder outputs, so they are recomputed.
    assert second.usage["cached_tokens"] == (403 - 128) // 64 * 64


def test_a_one_token_request_is_the_prefill_workers_alone(system: System) -> None:
    """A budget of one token: the prefill worker's first token, with nothing leased on or sent to the
    decode worker (a prefill with no target), and the prompt's blocks left in the prefill cache."""
    prompt = torch.randint(3, 500, (400,), generator=torch.Generator().manual_seed(5)).tolist()
    with Client(system.address, timeout_s=120) as client:
        done = client.generate(prompt, max_tokens=1)
        again = client.generate([*prompt, 7, 8, 9], max_tokens=2)
    assert done.finish_reason == "length" and len(done.token_ids) == 1
    if done.token_ids != greedy_reference(system.checkpoint, prompt, 1):
        assert len(greedy_ties(load_model(system.checkpoint), prompt, done.token_ids)) <= 1
    assert done.usage["kv_transfer_bytes"] == 0 and not done.usage["decode_only"]
    assert again.usage["cached_tokens"] == (403 - 128) // 64 * 64  # as `test_repeated_prefix_is_served_from_cache`
    _wait_all_free(system)


def test_bad_inputs_get_precise_statuses(system: System) -> None:
    with Client(system.address, timeout_s=30) as client:
        for prompt, kwargs, field in [("", {}, "prompt"), ([1, 600], {}, "prompt.token_ids[1]"),
                                      ("hi", {"effort": 101}, "effort"), ("hi", {"model": "other"}, "model")]:
            with pytest.raises(CedserveError) as info:
                client.generate(prompt, max_tokens=2, **kwargs)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.field == field
    _wait_all_free(system)


def test_cancel_and_deadline_free_every_block(system: System) -> None:
    prompt = list(range(3, 103))
    with Client(system.address, timeout_s=120) as client:
        stream = client.stream(prompt, max_tokens=400)
        next(stream)
        stream.close()
    _wait_all_free(system)
    with Client(system.address, timeout_s=0.3) as client, pytest.raises(CedserveError) as info:
        client.generate(prompt, max_tokens=400)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_all_free(system)


def test_serve_starts_answers_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    env = {**os.environ, "CEDSERVE_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "cedserve.cli", "serve", "--port", "0", "--http-port", "0"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        address = None
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("CEDSERVE_READY"):
                address = line.split('"address": "')[1].split('"')[0]
                break
        assert address, "serve never became ready"
        with Client(address, timeout_s=60) as client:
            assert len(client.generate("hello", max_tokens=3).token_ids) == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        out = proc.stdout.read()
        assert "shutting down" in out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # Every child (their command lines name the checkpoint under this home) is gone.
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "home")], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""


def test_workers_refuse_calls_without_the_worker_token(system: System) -> None:
    """The router serves (the tests above) because it sends the token; anyone else is refused."""
    for name, stub_type in (("prefill0", worker_pb2_grpc.PrefillWorkerStub),
                            ("decode0", worker_pb2_grpc.DecodeWorkerStub)):
        with grpc.insecure_channel(system.worker_address(name)) as ch:
            stub = stub_type(ch)  # type: ignore[no-untyped-call]
            for metadata in ((), token_metadata("not-the-token")):
                with pytest.raises(grpc.RpcError) as info:
                    stub.GetLoad(worker_pb2.LoadRequest(), timeout=10, metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
            assert stub.GetLoad(worker_pb2.LoadRequest(), timeout=10, metadata=system.metadata).total_blocks > 0


def test_every_process_serves_its_metrics(system: System) -> None:
    """`cedserve serve` starts every process with a Prometheus endpoint (any free port) and reports
    where: the router's counts the requests served, each worker's its own families. (Before the
    test that kills the decode worker: tests of this module share one system, in file order.)"""
    import urllib.request

    assert set(system.metrics) == {"router", "prefill0", "decode0"}
    with Client(system.address, timeout_s=60) as client:
        client.generate(list(range(3, 40)), max_tokens=2)
    pages = {name: urllib.request.urlopen(url, timeout=10).read().decode() for name, url in system.metrics.items()}
    assert "cedserve_router_ttft_seconds_count" in pages["router"]
    assert "cedserve_decode_output_tokens_total" in pages["decode0"]
    assert "cedserve_prefill" in pages["prefill0"]


def test_killed_decode_worker_gives_a_clean_error_and_leaks_nothing(system: System) -> None:
    """Runs last in this module: it kills the only decode worker."""
    prompt = list(range(3, 303))
    decode = system.parts["decode0"]
    with Client(system.address, timeout_s=60) as client:
        stream = client.stream(prompt, max_tokens=400)
        next(stream)  # the request is decoding
        os.killpg(decode.proc.pid, signal.SIGKILL)
        with pytest.raises(CedserveError) as info:
            for _ in stream:
                pass
    # One decode worker and it is gone: no retry can succeed, so the error is UNAVAILABLE, not a hang.
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with grpc.insecure_channel(system.worker_address("prefill0")) as ch:
            load = worker_pb2_grpc.PrefillWorkerStub(ch).GetLoad(  # type: ignore[no-untyped-call]
                worker_pb2.LoadRequest(), timeout=10, metadata=system.metadata)
        if load.held_blocks == 0:
            break
        time.sleep(0.2)
    assert load.held_blocks == 0 and load.running_requests == 0  # nothing held for the dead request

