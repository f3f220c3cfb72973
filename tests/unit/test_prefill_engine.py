"""The prefill engine with real objects (tiny model, cache manager, block pool) and the loopback transfer
fake standing in for NIXL: the shipped KV decodes to the monolithic model's tokens, prefix hits skip
compute, and every failure path (unknown lease, dead target, cancel, deadline, no blocks) frees
every block on the prefill side."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from cedserve.common.errors import InvalidArgumentError
from cedserve.kv_transfer.loopback import LoopbackAgent, LoopbackHub
from cedserve.kv_transfer.protocol import Reservation, TransferMode
from cedserve.kv_transfer.region import KVLayout, KVRegion
from cedserve.kv_transfer.wire import reservation_to_pb
from cedserve.model.cache.config import KVCacheConfig
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.manager import KVCacheManager
from cedserve.model.network import CEDModel
from cedserve.model.paged_kv import load_bytes, load_state
from cedserve.model.state_format import STATE_FORMAT_VERSION, decode_state
from cedserve.prefill_workers.config import PrefillWorkerConfig
from cedserve.prefill_workers.engine import PrefillEngine
from cedserve.prefill_workers.job import PrefillJob
from cedserve.prefill_workers.service import wire_event
from cedserve.prefill_workers.validation import RequestLimits, state_limits, validate_prefill
from cedserve.proto import worker_pb2 as wpb
from cedserve.serving.worker_model import LoadedModel, load_worker_model

ROUTED: dict[str, object] = {"effort": 75, "sampling": wpb.SamplingParams(top_p=1.0)}
"""Effort and sampling as the router resolves them (the internal plane has no "unset")."""
BLOCK = 64
POOL = 32


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_worker_model(None, "tiny", seed=0)


@dataclass
class Rig:
    model: CEDModel
    layout: BlockLayout
    cache: KVCacheManager
    engine: PrefillEngine
    hub: LoopbackHub
    decode: LoopbackAgent
    decode_pool: torch.Tensor
    limits: RequestLimits
    next_block: int = 0

    def target(self, rid: str, prompt_len: int) -> wpb.DecodeTarget:
        n = -(-prompt_len // BLOCK)
        blocks = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        res = self.decode.receiver().reserve(rid, blocks, sender="p0")
        return wpb.DecodeTarget(agent_name="d0", lease_id=rid, reservation=reservation_to_pb(res))

    def submit(self, rid: str, tokens: list[int], with_target: bool = True, **kw: object) -> PrefillJob:
        target = self.target(f"lease-{rid}", len(tokens)) if with_target else None
        req = wpb.PrefillRequest(request_id=rid, token_ids=tokens, target=target, **{**ROUTED, **kw})  # type: ignore[arg-type]
        return self.engine.submit(validate_prefill(req, self.limits))

    def run(self, job: PrefillJob, steps: int = 50) -> list[wpb.PrefillEvent]:
        events: list[wpb.PrefillEvent] = []
        for _ in range(steps):
            self.engine.step()
            while not job.events.empty():
                events.append(wire_event(job.events.get(), job.request_id))
            if events and events[-1].WhichOneof("event") in ("done", "error"):
                self.engine.step()  # let releases land
                return events
        raise AssertionError(f"request did not end: {events}")

    def assert_all_free(self) -> None:
        stats = self.engine.stats()
        assert stats.held_blocks == 0 and stats.free_blocks == POOL and stats.running_requests == 0, stats
        self.cache.check_invariants()


@pytest.fixture()
def rig(loaded: LoadedModel) -> Iterator[Rig]:
    yield from make_rig(loaded)


def make_rig(loaded: LoadedModel, paged_attention: str = "auto", **config_fields: object) -> Iterator[Rig]:
    model = loaded.model
    layout = BlockLayout.from_config(model.config, BLOCK)
    cache = KVCacheManager(layout, KVCacheConfig(block_size=BLOCK, num_blocks=POOL), "p0")
    kv_layout = KVLayout.from_config(model.config, BLOCK, model_id=loaded.model_id)
    hub = LoopbackHub()
    sender = LoopbackAgent(hub, KVRegion(cache.pool.storage, layout.block_bytes), kv_layout, "p0")
    decode_pool = torch.zeros(64, layout.block_bytes, dtype=torch.uint8)
    decode = LoopbackAgent(hub, KVRegion(decode_pool, layout.block_bytes), kv_layout, "d0")
    decode.handshake("p0")
    config = PrefillWorkerConfig(worker_id="p0", chunk_tokens=64, step_token_budget=128,
                                 paged_attention=paged_attention, **config_fields)  # type: ignore[arg-type]
    engine = PrefillEngine(model, cache, sender.sender(), config)
    limits = RequestLimits(model.config.vocab_size, 4096, BLOCK, config.replay_span, "p0", layout.block_bytes,
                           *state_limits(model.config, model.embed.weight.dtype, config.ship_state))
    yield Rig(model, layout, cache, engine, hub, decode, decode_pool, limits)
    cache.close()
    model.use_paged_attention(None)  # the model is shared by the module's tests


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy_monolithic(model: CEDModel, tokens: list[int], n: int) -> list[int]:
    state = model.new_state()
    out = [int(model.prefill(tokens, state)[-1].argmax())]
    while len(out) < n:
        out.append(int(model.decode_step([out[-1]], [state])[-1].argmax()))
    return out


def greedy_from_blocks(rig: Rig, tokens: list[int], block_ids: list[int], n: int, span: int = 128) -> list[int]:
    """The decode side's reference path: received blocks -> state, replay the last tokens, decode."""
    state = rig.model.new_state()
    load_state(rig.layout, rig.decode_pool, block_ids, len(tokens), state)
    state.position = len(tokens)
    out = [int(rig.model.replay(tokens[-span:], state)[-1].argmax())]
    while len(out) < n:
        out.append(int(rig.model.decode_step([out[-1]], [state])[-1].argmax()))
    return out


def kinds(events: list[wpb.PrefillEvent]) -> list[str | None]:
    return [e.WhichOneof("event") for e in events]


def test_prefill_then_decode_matches_monolithic(rig: Rig) -> None:
    tokens = prompt(200, seed=1)
    job = rig.submit("a", tokens)
    events = rig.run(job)
    assert kinds(events) == ["first_token", "done"]
    done = events[1].done
    assert (done.prompt_tokens, done.cached_tokens, done.computed_tokens) == (200, 0, 200)
    assert done.handoff.num_tokens == 200 and done.handoff.num_blocks_sent == 4
    assert done.bytes_sent == 4 * rig.layout.block_bytes
    assert 0 <= done.transfer_tail_s <= done.transfer_s  # the part after the last handoff, within the whole
    expected = greedy_monolithic(rig.model, tokens, 6)
    assert events[0].first_token.token_id == expected[0] == done.handoff.first_token
    assert rig.decode.receiver().wait("lease-a", 1).state.value == "done"
    blocks = list(rig.decode.receiver().wait("lease-a", 1).block_ids)
    assert greedy_from_blocks(rig, tokens, blocks, 6) == expected
    rig.assert_all_free()


def test_prefill_on_the_paged_path(loaded: LoadedModel) -> None:
    """`paged_attention = "reference"`: prompt chunks, the prefix replay and the decoder replay attend
    through the paged path (the kernels' addressing on their torch references); the decode side gets
    what the dense monolithic model decodes, and the arena's blocks come back with each request."""
    import gc

    rig = next(make_rig(loaded, "reference"))
    assert rig.engine.paged_attention == "reference"
    arena = rig.model.paged_arena
    assert arena is not None and rig.model.paged_chunks
    first = prompt(200, seed=1)
    second = first[:128] + prompt(136, seed=3)  # a prefix hit: the encoder's replay runs too
    for rid, tokens in (("a", first), ("b", second)):
        events = rig.run(rig.submit(rid, tokens))
        assert kinds(events) == ["first_token", "done"]
        expected = greedy_monolithic(rig.model, tokens, 4)  # on the paged path too: a check of both
        rig.model.use_paged_attention(None)
        assert greedy_monolithic(rig.model, tokens, 4) == expected  # the dense model agrees
        rig.model.paged_arena = arena
        assert events[0].first_token.token_id == expected[0]
        blocks = list(rig.decode.receiver().wait(f"lease-{rid}", 1).block_ids)
        assert greedy_from_blocks(rig, tokens, blocks, 4) == expected
    assert events[0].first_token.cached_tokens == 128
    rig.assert_all_free()
    copied = rig.engine.metrics.registry.get_sample_value("cedserve_prefill_paged_attention_copied_entries")
    assert copied is not None and copied > 0
    gc.collect()
    rig.engine.step()  # idle: the arena gives back what it grew to
    assert arena.num_free == arena.num_blocks
    assert rig.engine.metrics.registry.get_sample_value("cedserve_prefill_paged_attention_blocks") == 0
    rig.cache.close()
    rig.model.use_paged_attention(None)


def test_prefill_paged_attention_setting(loaded: LoadedModel) -> None:
    from cedserve.decode_workers import config as decode_config
    from cedserve.model.paged_attention import MODES
    from cedserve.prefill_workers import config as prefill_config

    assert prefill_config.PAGED_ATTENTION == decode_config.PAGED_ATTENTION == MODES  # the configs stay light
    with pytest.raises(ValueError, match=r"prefill\.paged_attention"):
        PrefillWorkerConfig(paged_attention="fast")
    rig = next(make_rig(loaded))  # auto on a CPU: the dense path (a chunk's per-row gathers cost more)
    assert rig.engine.paged_attention == "off" and rig.model.paged_arena is None
    rig.cache.close()


def test_repeated_prefix_reports_cached_tokens_and_computes_the_rest(rig: Rig) -> None:
    first = prompt(192, seed=2)
    rig.run(rig.submit("a", first))
    second = first[:128] + prompt(136, seed=3)  # 2 cached blocks; 136 new tokens >= the replay span
    events = rig.run(rig.submit("b", second))
    done = events[-1].done
    assert events[0].first_token.cached_tokens == 128
    assert (done.cached_tokens, done.computed_tokens) == (128, 136)
    expected = greedy_monolithic(rig.model, second, 4)
    assert events[0].first_token.token_id == expected[0]
    blocks = list(rig.decode.receiver().wait("lease-b", 1).block_ids)
    assert greedy_from_blocks(rig, second, blocks, 4) == expected
    rig.assert_all_free()


def test_short_suffix_recomputes_enough_for_the_replay_span(rig: Rig) -> None:
    first = prompt(192, seed=4)
    rig.run(rig.submit("a", first))
    second = first + prompt(10, seed=5)  # 3 cached blocks, 10 new tokens: the span needs 2 blocks more
    events = rig.run(rig.submit("b", second))
    done = events[-1].done
    assert (done.cached_tokens, done.computed_tokens) == (64, 138)
    assert events[0].first_token.token_id == greedy_monolithic(rig.model, second, 1)[0]
    rig.assert_all_free()


def test_unknown_lease_is_not_found_and_leaves_no_blocks(rig: Rig) -> None:
    res = Reservation("ghost", "d0", "p0", (0, 1), TransferMode.WRITE, compat_hash=rig.decode.layout.compatibility().compat_hash)
    target = wpb.DecodeTarget(agent_name="d0", lease_id="ghost", reservation=reservation_to_pb(res))
    req = wpb.PrefillRequest(request_id="g", token_ids=prompt(100, 6), target=target, **ROUTED)
    events = rig.run(rig.engine.submit(validate_prefill(req, rig.limits)))
    assert kinds(events) == ["error"] and events[0].error.code == wpb.ERROR_CODE_NOT_FOUND
    rig.assert_all_free()


def test_killed_decode_target_frees_all_blocks(rig: Rig) -> None:
    job = rig.submit("k", prompt(300, seed=7))
    rig.engine.step()  # admitted, first chunks shipped
    rig.hub.kill("d0")
    events = rig.run(job)
    assert kinds(events) == ["error"] and events[0].error.code == wpb.ERROR_CODE_TRANSFER_FAILED
    assert "d0" in events[0].error.message
    rig.assert_all_free()


def test_cancel_and_deadline_free_blocks(rig: Rig) -> None:
    job = rig.submit("c", prompt(300, seed=8))
    rig.engine.step()
    assert rig.engine.cancel("lease-c")  # by lease id, as the router's Cancel may
    events = rig.run(job)
    assert events[-1].error.code == wpb.ERROR_CODE_CANCELLED
    assert rig.decode.receiver().state("lease-c").value == "aborted"  # the decode side was told
    job = rig.submit("d", prompt(300, seed=9), deadline_unix_ms=int((time.time() + 0.2) * 1000))
    rig.engine.step()
    time.sleep(0.25)
    events = rig.run(job)
    assert events[-1].error.code == wpb.ERROR_CODE_DEADLINE_EXCEEDED
    rig.assert_all_free()


def test_prompt_larger_than_the_pool_is_resource_exhausted(rig: Rig) -> None:
    job = rig.submit("big", prompt(POOL * BLOCK + 1, seed=10), with_target=False)
    events = rig.run(job)
    assert events[-1].error.code == wpb.ERROR_CODE_RESOURCE_EXHAUSTED and events[-1].error.retry_after_ms > 0
    rig.assert_all_free()


def test_prefill_only_request_warms_the_cache_and_publishes_events(rig: Rig) -> None:
    batches = []
    rig.cache.events._sink = batches.append  # the worker wires the sink to its KVEventFeed
    events = rig.run(rig.submit("w", prompt(130, seed=11), with_target=False))
    assert kinds(events) == ["first_token", "done"] and not events[-1].done.HasField("handoff")
    stored = [e for b in batches for e in b.events if type(e).__name__ == "BlockStored"]
    assert sum(len(e.block_hashes) for e in stored) == 2  # two whole blocks of 130 tokens
    assert rig.engine.stats().cached_blocks == 2
    rig.assert_all_free()


@pytest.mark.parametrize("slack_s", [0.0, 2.0])
def test_effort_sets_the_queue_order(loaded: LoadedModel, slack_s: float) -> None:
    """One running slot, three requests queued together: with slack the cheapest effort is served first
    (due = arrival + slack x effort / 100), without it arrival order; every class's wait is measured."""
    rig = next(gen := make_rig(loaded, max_running_requests=1, effort_queue_slack_s=slack_s))
    jobs = {name: rig.submit(name, prompt(130, seed=20 + i), with_target=False, effort=effort)
            for i, (name, effort) in enumerate([("max", 100), ("high", 75), ("low", 50)])}
    firsts: list[str] = []
    for _ in range(60):
        rig.engine.step()
        for name, job in jobs.items():
            while not job.events.empty():
                if wire_event(job.events.get(), job.request_id).WhichOneof("event") == "first_token":
                    firsts.append(name)
        if len(firsts) == 3:
            break
    assert firsts == (["low", "high", "max"] if slack_s else ["max", "high", "low"])
    registry = rig.engine.metrics.registry
    waits = {k: registry.get_sample_value("cedserve_prefill_queue_seconds_sum", {"effort_class": k}) for k in jobs}
    assert all(registry.get_sample_value("cedserve_prefill_queue_seconds_count", {"effort_class": k}) == 1
               for k in jobs)
    first, last = firsts[0], firsts[-1]
    assert waits[first] is not None and waits[last] is not None and waits[first] < waits[last]
    rig.engine.step()
    rig.assert_all_free()
    next(gen, None)


def test_draining_engine_refuses_and_hands_back(rig: Rig) -> None:
    job = rig.submit("h", prompt(300, seed=12))
    rig.engine.step()
    rig.engine.stop_accepting()
    with pytest.raises(Exception, match="draining"):
        rig.submit("late", prompt(10, seed=13), with_target=False)
    rig.engine.hand_back("draining")
    events = rig.run(job)
    assert events[-1].error.code == wpb.ERROR_CODE_UNAVAILABLE
    rig.assert_all_free()


def test_shipped_bounded_state_decodes_like_the_monolithic_model(rig: Rig) -> None:
    """With room reserved after the KV blocks, the decoder replay's bounded state (windows, partial
    groups, Engram history, DSpark taps) arrives there: installed over the received global KV it
    continues as the monolithic model does, with no replay on the decode side."""
    tokens = prompt(201, seed=11)  # odd: layer 2's compressor holds a partial group
    kv_blocks, room = [0, 1, 2, 3], -(-rig.limits.max_state_bytes_with_taps // rig.layout.block_bytes)
    state_blocks = list(range(40, 40 + room))
    res = rig.decode.receiver().reserve("lease-s", kv_blocks + state_blocks, sender="p0")
    target = wpb.DecodeTarget(agent_name="d0", lease_id="lease-s",
                              reservation=reservation_to_pb(res),
                              state_room=wpb.StateRoom(num_blocks=room, format_version=STATE_FORMAT_VERSION,
                                                       dspark_taps=True))
    events = rig.run(rig.engine.submit(validate_prefill(
        wpb.PrefillRequest(request_id="s", token_ids=tokens, target=target, **ROUTED), rig.limits)))
    assert kinds(events) == ["first_token", "done"]
    handoff = events[1].done.handoff
    assert handoff.num_blocks_sent == 4 and handoff.state_format_version == STATE_FORMAT_VERSION
    assert 0 < handoff.state_bytes <= room * rig.layout.block_bytes
    shipped = decode_state(load_bytes(rig.decode_pool, state_blocks), rig.model.config, rig.model.embed.weight.dtype)
    config = rig.model.config
    assert shipped.position == 201 and shipped.taps is not None
    assert shipped.taps.shape == (config.sliding_window, len(config.dspark_target_layer_ids), config.hidden_size)
    assert shipped.pending[2].kv.shape[0] == 1  # 201 % m=2
    state = rig.model.new_state()
    load_state(rig.layout, rig.decode_pool, kv_blocks, len(tokens), state)
    shipped.install(state)
    out = [events[0].first_token.token_id]
    while len(out) < 6:
        out.append(int(rig.model.decode_step([out[-1]], [state])[-1].argmax()))
    assert out == greedy_monolithic(rig.model, tokens, 6)
    rig.assert_all_free()


def test_state_room_too_small_or_of_another_version_is_refused(rig: Rig) -> None:
    tokens = prompt(100, seed=12)
    for room, field in ((wpb.StateRoom(num_blocks=1, format_version=STATE_FORMAT_VERSION), "target.state_room.num_blocks"),
                        (wpb.StateRoom(num_blocks=50, format_version=99), "target.state_room.format_version")):
        res = rig.decode.receiver().reserve(f"lease-{field}", list(range(2 + room.num_blocks)), sender="p0")
        target = wpb.DecodeTarget(agent_name="d0", lease_id=res.request_id,
                                  reservation=reservation_to_pb(res), state_room=room)
        with pytest.raises(InvalidArgumentError) as info:
            validate_prefill(wpb.PrefillRequest(request_id="v", token_ids=tokens, target=target, **ROUTED), rig.limits)
        assert info.value.field == field
        rig.decode.receiver().abort(res.request_id)
    rig.assert_all_free()
