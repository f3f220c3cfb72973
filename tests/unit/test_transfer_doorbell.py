"""The progress loop's doorbell (`kv_transfer/doorbell.py`): real UDP sockets on loopback."""

from __future__ import annotations

import threading
import time

import pytest

from cedserve.kv_transfer.doorbell import Doorbell, peer_doorbell

pytestmark = pytest.mark.unit


def test_wait_sleeps_its_timeout_when_nobody_rings() -> None:
    bell = Doorbell("127.0.0.1")
    try:
        t0 = time.monotonic()
        assert bell.wait(0.02) is False
        assert time.monotonic() - t0 >= 0.015
    finally:
        bell.close()


def test_a_wake_from_another_thread_ends_the_sleep_early() -> None:
    bell = Doorbell("127.0.0.1")
    try:
        threading.Timer(0.01, bell.wake).start()
        t0 = time.monotonic()
        assert bell.wait(2.0) is False  # our own wake, not a peer's ring
        assert time.monotonic() - t0 < 1.0
        bell.wake()
        bell.wake()  # pending already: one datagram, consumed by one wait
        assert bell.wait(0.0) is False
        t0 = time.monotonic()
        bell.wait(0.02)
        assert time.monotonic() - t0 >= 0.015  # nothing left over to end the next sleep
    finally:
        bell.close()


def test_a_peer_ring_ends_the_sleep_and_says_so() -> None:
    ours, theirs = Doorbell("127.0.0.1"), Doorbell("127.0.0.1")
    try:
        threading.Timer(0.01, theirs.ring, args=(("127.0.0.1", ours.port),)).start()
        t0 = time.monotonic()
        assert ours.wait(2.0) is True
        assert time.monotonic() - t0 < 1.0
    finally:
        ours.close()
        theirs.close()


def test_ringing_a_closed_or_absent_doorbell_is_harmless() -> None:
    bell, gone = Doorbell("127.0.0.1"), Doorbell("127.0.0.1")
    port = gone.port
    gone.close()
    try:
        bell.ring(("127.0.0.1", port))  # nobody listens there: UDP drops it
        gone.ring(("127.0.0.1", bell.port))  # a closed bell sends nothing
        gone.wake()
        assert bell.wait(0.01) is False
    finally:
        bell.close()


@pytest.mark.parametrize(("address", "port", "want"), [
    ("10.0.0.7:5100", 4242, ("10.0.0.7", 4242)),
    ("[::1]:5100", 4242, ("::1", 4242)),
    ("10.0.0.7:5100", 0, None),  # an older peer announces no doorbell
    ("", 4242, None),
])
def test_peer_doorbell_takes_the_host_of_the_control_address(address: str, port: int,
                                                             want: tuple[str, int] | None) -> None:
    assert peer_doorbell(address, port) == want
