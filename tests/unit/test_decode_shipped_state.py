"""Shipped bounded state on the decode engine: a lease that asks for it holds room after its KV blocks,
the prefill side's state (windows, partial groups, Engram history, DSpark taps) lands there over the
transfer (a loopback agent standing in for NIXL), and the request joins with no replay rows and drafts
in its first step. Output equals the reference and the replay path; a state the engine cannot read
fails the request with every block freed.
"""

from __future__ import annotations

import struct

import pytest
from decode_support import Rig, greedy_rounds, prompt, reference_greedy, tiny

from cedserve.common.errors import ErrorKind
from cedserve.decode_workers.messages import Failed, Finished, Reserved
from cedserve.model.state_format import HEADER_BYTES

pytestmark = pytest.mark.unit

PROMPTS = [prompt(37, 1), prompt(21, 2), prompt(81, 3)]


def test_shipped_state_decodes_like_the_reference_and_the_replay_path() -> None:
    model, drafter = tiny()
    prompts = [PROMPTS[0], PROMPTS[2]]  # shorter and longer than the window, both with a partial group
    reference = [reference_greedy(model, p, 8) for p in prompts]
    shipped = Rig(model, drafter, ship_state=True)
    got = greedy_rounds(shipped, prompts, 7)
    assert list(got.values()) == reference
    replayed = Rig(model, drafter)
    assert list(greedy_rounds(replayed, prompts, 7).values()) == reference
    joins = shipped.engine.metrics.joins
    assert joins.labels("shipped")._value.get() == len(prompts) and joins.labels("replay")._value.get() == 0
    for rid in got:
        done = shipped.finished(rid)
        assert isinstance(done, Finished) and done.draft_tokens > 0
    shipped.assert_all_free()
    replayed.assert_all_free()


def test_state_room_is_reserved_and_the_first_step_drafts_from_the_shipped_taps() -> None:
    model, drafter = tiny()
    tokens = PROMPTS[2]
    rigs = {}
    for name, ship in (("shipped", True), ("replay", False)):
        rig = Rig(model, drafter, ship_state=ship)
        reserved = rig.reserve(tokens)
        assert isinstance(reserved, Reserved)
        assert (reserved.state_blocks > 0) is ship and reserved.state_taps is ship
        rig.attach(reserved, tokens, rig.prefill(reserved, tokens), 8)
        rig.outputs += rig.engine.poll() + rig.engine.step()
        rigs[name] = (rig, rig.engine.sequences[reserved.request_id])
    rig, seq = rigs["shipped"]
    assert rig.engine.drafted_tokens > 0  # the join step already verified drafts
    assert rigs["replay"][0].engine.drafted_tokens == 0  # the replay join has no drafter memory yet
    # Both joins leave the drafter memory of the same positions; the values agree up to the two paths'
    # rounding: the prefill side's encoder ran in chunks, the replay ran every layer at once, and an
    # FP8 window or FP4 KV record that rounds the other way moves later activations by ~1e-3.
    a, b = seq.draft, rigs["replay"][1].draft
    assert a is not None and b is not None and a.end_position == b.end_position
    n = min(a.vectors.shape[0], b.vectors.shape[0])
    diff = (a.vectors[-n:] - b.vectors[-n:]).abs()
    assert float(diff.max()) < 2e-2 and float(diff.mean()) < 1e-3, (float(diff.max()), float(diff.mean()))
    # The scratch blocks of the state went back to the pool once read.
    assert rig.cache.pool.num_free + len(rig.cache.block_table(seq.request_id)) == rig.cache.pool.num_blocks


@pytest.mark.parametrize(("hook", "words"), [
    (lambda data: struct.pack_into("<H", data, 8, 99), "version 99"),
    (lambda data: struct.pack_into("<Q", data, 16, 1 << 30), "does not fit"),
    (lambda data: data.__setitem__(HEADER_BYTES + 40, data[HEADER_BYTES + 40] ^ 1), "checksum"),
], ids=["version", "size", "corrupt"])
def test_unreadable_state_fails_the_request_and_frees_every_block(hook: object, words: str) -> None:
    model, drafter = tiny()
    rig = Rig(model, drafter, ship_state=True)
    tokens = PROMPTS[0]
    reserved = rig.reserve(tokens)
    assert isinstance(reserved, Reserved)
    first = rig.prefill(reserved, tokens, state_hook=hook)  # type: ignore[arg-type]
    rig.attach(reserved, tokens, first, 5)
    rig.run()
    failed = rig.finished(reserved.request_id)
    assert isinstance(failed, Failed) and failed.kind is ErrorKind.TRANSFER_FAILED
    assert words in failed.message and reserved.request_id in failed.message
    rig.assert_all_free()


def test_lease_without_state_room_when_the_call_says_so() -> None:
    model, drafter = tiny()
    rig = Rig(model, drafter, ship_state=True)
    reserved = rig.reserve(PROMPTS[1], ship_state=False)
    assert isinstance(reserved, Reserved) and reserved.state_blocks == 0
    rig.attach(reserved, PROMPTS[1], rig.prefill(reserved, PROMPTS[1]), 3)
    rig.run()
    assert rig.engine.metrics.joins.labels("replay")._value.get() == 1
    rig.assert_all_free()
