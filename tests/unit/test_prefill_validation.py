"""Bad prefill input gets INVALID_ARGUMENT (or DEADLINE_EXCEEDED) naming the field, before any block moves."""

from __future__ import annotations

import time

import pytest

from cedserve.common.errors import DeadlineExceededError, InvalidArgumentError
from cedserve.kv_transfer.protocol import Reservation, TransferMode
from cedserve.kv_transfer.wire import reservation_to_pb
from cedserve.prefill_workers.config import PrefillWorkerConfig
from cedserve.prefill_workers.validation import RequestLimits, validate_prefill
from cedserve.proto import worker_pb2 as wpb

LIMITS = RequestLimits(vocab_size=512, max_prompt_tokens=1000, block_size=64, default_replay_span=128,
                       sender_agent="p0")


def request(n: int = 100, **kw: object) -> wpb.PrefillRequest:
    """A request as the router sends it: effort and sampling resolved."""
    fields: dict[str, object] = {"effort": 75, "sampling": wpb.SamplingParams(top_p=1.0), **kw}
    return wpb.PrefillRequest(request_id="r", token_ids=[5] * n, **fields)  # type: ignore[arg-type]


def target(n_blocks: int = 2, cached: int = 0, **changes: object) -> wpb.DecodeTarget:
    blocks = list(range(10, 10 + n_blocks))
    fields: dict[str, object] = dict(request_id="lease", receiver="d0", sender="p0", block_ids=tuple(blocks[cached:]),
                                     mode=TransferMode.WRITE)
    fields.update(changes)
    res = Reservation(**fields)  # type: ignore[arg-type]
    return wpb.DecodeTarget(agent_name="d0", lease_id="lease", num_cached_blocks=cached,
                            reservation=reservation_to_pb(res))


def field_of(req: wpb.PrefillRequest) -> str:
    with pytest.raises(InvalidArgumentError) as info:
        validate_prefill(req, LIMITS)
    return info.value.field


def test_valid_request_with_target() -> None:
    spec = validate_prefill(request(100, target=target(), effort=75), LIMITS)
    assert spec.prompt_len == 100 and spec.replay_span == 128 and spec.sampling.greedy
    assert spec.target is not None and spec.target.reservation.request_id == "lease"


@pytest.mark.parametrize(("req", "field"), [
    (wpb.PrefillRequest(request_id="", token_ids=[1]), "request_id"),
    (request(0), "token_ids"),
    (request(1001), "token_ids"),
    (wpb.PrefillRequest(request_id="r", token_ids=[1, 2, 512, 3]), "token_ids[2]"),
    (request(10, effort=101), "effort"),
    (request(10, effort=0), "effort"),  # no "unset" on the internal plane: the router decides a level
    (request(10, sampling=wpb.SamplingParams(temperature=-1)), "sampling.temperature"),
    (request(10, sampling=wpb.SamplingParams()), "sampling.top_p"),  # resolved by the router: (0, 1]
    (request(100, target=target(n_blocks=3)), "target.reservation.block_ids"),
    (request(100, target=target(n_blocks=1)), "target.reservation.block_ids"),
    (request(100, target=target(cached=3, n_blocks=2)), "target.num_cached_blocks"),
    (request(100, target=wpb.DecodeTarget(agent_name="d0", lease_id="lease")), "target.reservation"),
    (request(100, target=target(request_id="other")), "target.reservation.request_id"),
    (request(100, target=target(sender="p1")), "target.reservation.sender_agent"),
    (request(100, target=target(receiver="d1")), "target.reservation.receiver_agent"),
    (request(100, target=target(cached=1, block_ids=(10, 12))), "target.reservation.block_ids"),
    (request(100, target=target(mode=TransferMode.READ)), "target.reservation.mode"),
])
def test_bad_fields_are_named(req: wpb.PrefillRequest, field: str) -> None:
    assert field_of(req) == field


def test_empty_lease_is_named() -> None:
    t = target()
    t.lease_id = ""
    assert field_of(request(100, target=t)) == "target.lease_id"


def test_deadline_in_the_past() -> None:
    with pytest.raises(DeadlineExceededError):
        validate_prefill(request(10, deadline_unix_ms=int((time.time() - 1) * 1000)), LIMITS)


def test_config_validation_names_fields() -> None:
    with pytest.raises(ValueError, match=r"prefill\.chunk_tokens"):
        PrefillWorkerConfig(chunk_tokens=0)
    with pytest.raises(ValueError, match=r"prefill\.step_token_budget"):
        PrefillWorkerConfig(chunk_tokens=256, step_token_budget=128)
    with pytest.raises(ValueError, match=r"prefill\.bogus"):
        PrefillWorkerConfig.from_mapping({"bogus": 1})
    with pytest.raises(ValueError, match=r"prefill\.replay_span"):
        PrefillWorkerConfig.from_mapping({"replay_span": "long"})
    assert PrefillWorkerConfig.from_mapping({"drain_timeout_s": 5}).drain_timeout_s == 5.0
    with pytest.raises(ValueError, match="multiple of the block size"):
        PrefillWorkerConfig(chunk_tokens=96, step_token_budget=96).check_block_size(64)
