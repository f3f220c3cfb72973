"""The embedded supervisor's restart policy (cedserve/supervise.py): backoff doubling per restart in
the window, a limit per part, the window sliding. The processes themselves: tests/e2e/test_supervise.py."""

from __future__ import annotations

import pytest

from cedserve.supervise import RestartLedger, RestartPolicy

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_up_to_its_cap_and_the_limit_is_per_part() -> None:
    ledger = RestartLedger(RestartPolicy(max_restarts=5, window_s=100, backoff_s=1, max_backoff_s=4), Clock())
    assert [ledger.next_delay("decode0") for _ in range(5)] == [1, 2, 4, 4, 4]
    assert ledger.next_delay("decode0") is None  # a sixth death in the window
    assert ledger.next_delay("router") == 1  # other parts keep their own count
    assert ledger.count("decode0") == 5 and ledger.count("prefill0") == 0


def test_restarts_leave_the_window() -> None:
    clock = Clock()
    ledger = RestartLedger(RestartPolicy(max_restarts=2, window_s=60, backoff_s=0.5, max_backoff_s=30), clock)
    assert ledger.next_delay("p") == 0.5
    clock.now = 30
    assert ledger.next_delay("p") == 1.0
    assert ledger.next_delay("p") is None
    clock.now = 61  # the first restart (t=0) has left the window; the second (t=30) is still in it
    assert ledger.next_delay("p") == 1.0
    assert ledger.count("p") == 2


def test_zero_restarts_stops_at_the_first_death() -> None:
    assert RestartLedger(RestartPolicy(max_restarts=0), Clock()).next_delay("x") is None


@pytest.mark.parametrize("bad", [{"max_restarts": -1}, {"window_s": 0}, {"backoff_s": -1},
                                 {"backoff_s": 10, "max_backoff_s": 5}])
def test_bad_policies_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="restart policy"):
        RestartPolicy(**bad)  # type: ignore[arg-type]
