"""Dead and silent peers mid-transfer: the survivor ends with a clear error naming the request within
two seconds, and every one of its blocks free.

- the receiver is killed (SIGKILL) while the sender streams: UCX reports the endpoint gone;
- the sender is killed: the receiver's heartbeats fail or go unanswered;
- the sender is stopped (SIGSTOP, a hung process: no socket closes) for longer than the peer
  timeout: only the missing heartbeats tell. On SIGCONT the sender finds the receiver silent for as
  long, fails its side at once without writing into blocks the receiver has already freed, and
  frees its own blocks too: both sides end free.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from cedserve.bench.kv_transfer.harness import PeerProcess, WorkerSpec
from cedserve.kv_transfer.nixl_backend import nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")

POOL = 800
CONFIG = {"auth_token": "e2e-failures"}  # default liveness: heartbeats 0.15 s, peer timeout 0.9 s


class Workers:
    """Three workers started together (process start-up dominates these tests): `decode0` dies in
    the first test; `prefill0` then serves `decode1` in the others, the last of which kills it."""

    def __init__(self) -> None:
        self.first_receiver = PeerProcess(WorkerSpec("decode0", POOL, config=CONFIG))
        self.second_receiver = PeerProcess(WorkerSpec("decode1", POOL, config=CONFIG))
        self.sender = PeerProcess(WorkerSpec("prefill0", POOL, config=CONFIG, seed=1))
        for r in (self.first_receiver, self.second_receiver):
            self.sender.call("handshake", address=r.info["control_address"])

    def close(self) -> None:
        for p in (self.first_receiver, self.second_receiver, self.sender):
            if p.proc.poll() is None:
                p.kill(signal.SIGCONT)
            p.close(graceful=False)


@pytest.fixture(scope="module")
def workers() -> Iterator[Workers]:
    w = Workers()
    yield w
    w.close()


def start_slow_transfer(receiver: PeerProcess, sender: PeerProcess, rid: str) -> None:
    """300 blocks in 4-block pieces 50 ms apart: a prefill that runs for about 4 s."""
    requests = [{"request_id": rid, "num_blocks": 300, "sender": "prefill0"}]
    reservations = receiver.call("reserve", requests=requests)["reservations"]
    sender.call("send", reservations=reservations, stream_blocks=4, pace_s=0.05)
    time.sleep(0.6)  # mid-transfer


def wait_survivor(survivor: PeerProcess, role: str, rid: str, start: float) -> tuple[dict[str, object], float]:
    result = survivor.call("wait", role=role, request_ids=[rid], timeout_s=10)["results"][rid]
    return result, time.monotonic() - start


def assert_all_free(p: PeerProcess) -> None:
    free = p.call("free")
    assert free["free_blocks"] == POOL and free["active"] == 0 and free["held"] == 0, free


def test_receiver_killed_mid_transfer(workers: Workers) -> None:
    receiver, sender = workers.first_receiver, workers.sender
    start_slow_transfer(receiver, sender, "kill-recv")
    start = time.monotonic()
    receiver.kill(signal.SIGKILL)
    result, elapsed = wait_survivor(sender, "sender", "kill-recv", start)
    assert result["state"] == "failed", result
    assert result["cause"] in {"peer_disconnected", "peer_silent"}
    assert "kill-recv" in str(result["error"]) and "decode0" in str(result["error"])
    assert elapsed < 2.0, elapsed
    assert_all_free(sender)


def test_silent_sender_is_declared_dead_and_both_sides_end_free(workers: Workers) -> None:
    receiver, sender = workers.second_receiver, workers.sender
    start_slow_transfer(receiver, sender, "silent")
    start = time.monotonic()
    sender.kill(signal.SIGSTOP)
    result, elapsed = wait_survivor(receiver, "receiver", "silent", start)
    assert result["state"] == "failed" and result["cause"] == "peer_silent", result
    assert "silent" in str(result["error"]) and "prefill0" in str(result["error"])
    assert elapsed < 2.0, elapsed
    assert_all_free(receiver)
    time.sleep(0.5)
    sender.kill(signal.SIGCONT)
    resumed = time.monotonic()
    result, elapsed = wait_survivor(sender, "sender", "silent", resumed)
    assert result["state"] == "failed" and result["cause"] == "peer_silent", result
    assert elapsed < 2.0, elapsed
    assert_all_free(sender)
    assert_all_free(receiver)
    sender.call("handshake", address=receiver.info["control_address"])  # reconnect for the next test


def test_sender_killed_mid_transfer(workers: Workers) -> None:
    receiver, sender = workers.second_receiver, workers.sender
    start_slow_transfer(receiver, sender, "kill-send")
    start = time.monotonic()
    sender.kill(signal.SIGKILL)
    result, elapsed = wait_survivor(receiver, "receiver", "kill-send", start)
    assert result["state"] == "failed", result
    assert result["cause"] in {"peer_disconnected", "peer_silent"}
    assert "kill-send" in str(result["error"]) and "prefill0" in str(result["error"])
    assert elapsed < 2.0, elapsed
    assert_all_free(receiver)
