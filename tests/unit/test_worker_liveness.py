"""The router's rule for a failed load poll (router/workers.py, `poll_missed`): busy is not dead.
The rule at work against fake workers: tests/unit/test_router_service.py,
`test_a_busy_worker_is_not_a_dead_one`; under real load: `cedserve bench held`."""

from __future__ import annotations

import grpc
import pytest

from cedserve.router.workers import SILENT_DOWN_S, poll_missed

pytestmark = pytest.mark.unit

LATE = grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_late_poll_with_a_live_worker_is_not_missed() -> None:
    assert not poll_missed(LATE, True, silent_s=1e6)  # liveness answered SERVING: however long the silence


def test_a_late_poll_and_a_late_liveness_check_are_busy_until_the_worker_is_silent_too_long() -> None:
    assert not poll_missed(LATE, None, silent_s=2.0)
    assert not poll_missed(LATE, None, silent_s=SILENT_DOWN_S - 0.1)
    assert poll_missed(LATE, None, silent_s=SILENT_DOWN_S)  # hung: nothing answered for that long


def test_a_refusal_or_a_failed_liveness_check_is_missed() -> None:
    assert poll_missed(LATE, False, silent_s=0.5)  # liveness answered NOT_SERVING (or refused)
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAUTHENTICATED):
        assert poll_missed(code, None, silent_s=0.0)
        assert poll_missed(code, True, silent_s=0.0)
