"""Concurrent first requests to a fresh system whose KV link blips right after its first handshake.

Router, two prefill workers (or the embedded default's one) and a decode worker as real processes (real gRPC on loopback, real NIXL
between the workers). A burst of concurrent first requests makes the decode worker handshake with
the prefill workers; one worker is then stalled (SIGSTOP) for longer than `peer_timeout_s`, what a
heavily loaded host does to a process (the failure was first seen at load ~16 on a 2-core VM).
Both sides declare the other dead and fail the transfers in flight, as they must; what must not
happen is what did: prefill jobs already queued met the dead peer at `open` and failed with a
non-retryable INVALID_ARGUMENT ("... is not connected (handshake first)"), a reconnection could be
read as a restart by the other side, and the router's retries were answered by their failed
attempts ("lease cancelled", "cancelled before its Reserve ran", "already holds a lease"). Now each
such request fails retryably, the router places it again (on the same worker after a pause where
it is the only one of its role), and every request completes.
See docs/kv_transfer.md, *Handshakes: one connection per peer incarnation*.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from system_rig import wait_idle

from cedserve.client import CedserveError, Client
from cedserve.launcher import EmbeddedOptions, LocalLauncher, Part, start_embedded
from cedserve.model.checkpoint_writer import write_random_checkpoint
from cedserve.model.presets import preset

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_REQUESTS = 32
_EOS = preset("tiny").eos_token_id
EOS_IDS = {_EOS} if isinstance(_EOS, int) else set(_EOS or ())
PROMPT_LEN = 300  # above the decode-only threshold (256): every request is prefilled and sent over NIXL
STALL_AFTER_S = 0.3
STALL_S = 1.5  # > peer_timeout_s (0.9 s): the decode worker is declared dead and declares its peers dead


class FreshSystem:
    def __init__(self, root: Path, num_prefill: int) -> None:
        checkpoint = root / "ckpt"
        write_random_checkpoint(preset("tiny"), checkpoint, seed=21)
        self.launcher = LocalLauncher(root / "logs")
        router = start_embedded(EmbeddedOptions(checkpoint=checkpoint, port=0, log_dir=root / "logs",
                                                num_prefill=num_prefill), self.launcher)
        self.address = str(router["address"])
        self.parts: dict[str, Part] = {p.name: p for p in self.launcher.parts}

    def log(self, name: str) -> str:
        return self.parts[name].log_path.read_text()


@pytest.fixture()
def fresh(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[FreshSystem]:
    s = FreshSystem(tmp_path, num_prefill=request.param)
    yield s
    s.launcher.stop_all()


def _burst(address: str, seed: int, during: threading.Event | None = None) -> list[str]:
    """`NUM_REQUESTS` concurrent requests; each one's outcome ("ok" or the error's code and message).
    `during` is set once every request has been sent."""
    outcomes = [""] * NUM_REQUESTS
    start = threading.Barrier(NUM_REQUESTS + 1)

    def one(i: int) -> None:
        prompt = torch.randint(3, 500, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed + i)).tolist()
        with Client(address, timeout_s=120) as client:
            start.wait()
            try:
                done = client.generate(prompt, max_tokens=4)
                # all 4 tokens, or fewer ending in the model's end of sequence: the random checkpoint's
                # own greedy answer to one of these prompts is [258, EOS] (checked against the model
                # alone); a stream cut short by the stall ends without it
                full = done.finish_reason == "length" and len(done.token_ids) == 4
                ended = done.finish_reason == "stop" and bool(done.token_ids) and done.token_ids[-1] in EOS_IDS
                outcomes[i] = "ok" if full or ended else f"short: {done.token_ids} ({done.finish_reason})"
            except CedserveError as exc:
                outcomes[i] = f"{exc.code.name}: {exc}"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_REQUESTS)]
    for t in threads:
        t.start()
    start.wait()
    if during is not None:
        during.set()
    for t in threads:
        t.join()
    return outcomes


def _stall(part: Part, after_s: float, for_s: float, go: threading.Event) -> None:
    go.wait()
    time.sleep(after_s)
    os.kill(part.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(for_s)
    finally:
        os.kill(part.proc.pid, signal.SIGCONT)


@pytest.mark.parametrize(("fresh", "stalled"), [(2, "decode0"), (2, "prefill0"), (1, "decode0")], indirect=["fresh"],
                         ids=["decode-stalled", "prefill-stalled", "decode-stalled-one-prefill-worker"])
def test_first_requests_survive_a_stall_after_the_first_handshake(fresh: FreshSystem, stalled: str) -> None:
    go = threading.Event()
    staller = threading.Thread(target=_stall, args=(fresh.parts[stalled], STALL_AFTER_S, STALL_S, go))
    staller.start()
    outcomes = _burst(fresh.address, seed=100, during=go)
    staller.join()
    # the stall really cut the link: the stalled worker declared its peers dead (else this tests nothing)
    assert "declared dead" in fresh.log(stalled)
    failed = [o for o in outcomes if o != "ok"]
    assert not failed, "\n".join(failed)
    # no side read a reconnection of a live incarnation as a restart
    workers = [name for name in ("decode0", "prefill0", "prefill1") if name in fresh.parts]
    for name in workers:
        assert "restarted" not in fresh.log(name), name
    # the link is back: a second burst completes, and nothing is held for any request
    assert _burst(fresh.address, seed=1000) == ["ok"] * NUM_REQUESTS
    loads = wait_idle([fresh.parts[n] for n in workers])
    assert all(x.held_blocks == 0 and x.running_requests == 0 for x in loads.values()), loads
