"""Decode-worker migration with real processes: router + one prefill worker + two decode workers
(the embedded launcher's command lines, the tiny checkpoint). The decode worker serving a request
is killed mid-stream; the router re-places prompt + streamed tokens on the other decode worker (the
prefix comes from the prefill worker's cache) and the stream completes with exactly the monolithic
model's greedy tokens. Afterwards the surviving workers hold nothing for the request.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from system_rig import greedy_reference, wait_idle, worker_load

from cedserve.client import Client
from cedserve.launcher import EmbeddedOptions, LocalLauncher, Part, start_embedded
from cedserve.model.checkpoint_writer import write_random_checkpoint
from cedserve.model.presets import preset

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class TwoDecodeSystem:
    def __init__(self, root: Path) -> None:
        self.checkpoint = root / "ckpt"
        write_random_checkpoint(preset("tiny"), self.checkpoint, seed=21)
        self.launcher = LocalLauncher(root / "logs")
        ready = start_embedded(EmbeddedOptions(checkpoint=self.checkpoint, port=0, log_dir=root / "logs",
                                               num_decode=2), self.launcher)
        self.address = str(ready["address"])
        self.parts = {p.name: p for p in self.launcher.parts}


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoDecodeSystem]:
    s = TwoDecodeSystem(tmp_path_factory.mktemp("migration"))
    yield s
    s.launcher.stop_all()


def _serving(decoders: list[Part]) -> Part:
    """The decode worker running the (only) request."""
    busy = [p for p in decoders if worker_load(p).running_requests > 0]
    assert len(busy) == 1, [(p.name, worker_load(p)) for p in decoders]
    return busy[0]


def test_killed_decode_worker_migrates_and_output_is_unchanged(system: TwoDecodeSystem) -> None:
    # Longer than the decode-only threshold (256): the prefill worker serves, and caches, the prompt.
    prompt = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(8)).tolist()
    max_tokens = 12
    decoders = [system.parts["decode0"], system.parts["decode1"]]
    got: list[int] = []
    with Client(system.address, timeout_s=120) as client:
        stream = client.stream(prompt, max_tokens=max_tokens)
        while len(got) < 2:  # the first token comes from prefill; the next from the decode worker
            got += next(stream).token_ids
        victim = _serving(decoders)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        before_kill = len(got)
        for piece in stream:
            got += piece.token_ids
        done = client.last
    assert done is not None and done.finish_reason == "length"
    assert before_kill < max_tokens  # the kill came mid-stream, so the rest came from the other worker
    # The re-placed prompt (original + streamed tokens) found its prefix in the prefill worker's cache.
    assert done.usage["cached_tokens"] > 0
    assert got == greedy_reference(system.checkpoint, prompt, max_tokens)
    survivors = [system.parts["prefill0"], *(p for p in decoders if p is not victim)]
    loads = wait_idle(survivors)
    for name, load in loads.items():
        assert load.held_blocks == 0 and load.running_requests == 0 and load.queued_requests == 0, (name, load)
    survivor = next(p for p in decoders if p is not victim)
    assert loads[survivor.name].free_blocks == loads[survivor.name].total_blocks
