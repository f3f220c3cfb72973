"""Short leases kept alive by their router (issue 32): an unattached lease lapses one lease after
its last renewal, a renewed one outlives any number of lease periods, a renewal never shortens a
lease nor revives a gone one, and the KV transfer keeps its own, longer deadline. A real engine
over the tiny model and a loopback transfer agent, its lease book on a fake clock."""

from __future__ import annotations

import pytest
from decode_support import Rig, prompt, tiny

from cedserve.common.errors import ErrorKind
from cedserve.decode_workers.loop import CommandInbox
from cedserve.decode_workers.messages import Failed, Finished, RenewCommand, Reserved
from cedserve.decode_workers.service import DecodeService, OutputRouter
from cedserve.kv_transfer.wire import reservation_from_pb
from cedserve.proto import kv_transfer_pb2
from cedserve.proto import worker_pb2 as wpb
from cedserve.serving.drain import DrainController

pytestmark = pytest.mark.unit

PROMPT = prompt(37, 1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rig_on(clock: Clock, **config: int) -> Rig:
    model, drafter = tiny()
    rig = Rig(model, drafter, **config)
    rig.engine.leases.clock = clock
    return rig


def reserve(rig: Rig, lease_ms: int) -> Reserved:
    reserved = rig.reserve(PROMPT, lease_ms=lease_ms)
    assert isinstance(reserved, Reserved)
    return reserved


def expired(rig: Rig) -> list[Failed]:
    return [o for o in rig.engine.poll() if isinstance(o, Failed)]


def test_a_renewed_lease_outlives_its_lease_and_lapses_once_renewals_stop() -> None:
    clock = Clock()
    rig = rig_on(clock)
    reserved = reserve(rig, lease_ms=1000)
    for _ in range(8):  # four lease periods, renewed every half lease
        clock.now += 0.5
        assert rig.engine.handle(RenewCommand(0, (reserved.lease_id,), 1000)) == []
        assert expired(rig) == []
    clock.now += 0.9
    assert expired(rig) == []
    clock.now += 0.2  # 1.1 s since the last renewal
    assert [f.kind for f in expired(rig)] == [ErrorKind.DEADLINE_EXCEEDED]
    rig.assert_all_free()


def test_an_unrenewed_lease_lapses_after_one_lease() -> None:
    clock = Clock()
    rig = rig_on(clock)
    reserve(rig, lease_ms=1000)
    clock.now += 0.99
    assert expired(rig) == []
    clock.now += 0.02
    assert [f.kind for f in expired(rig)] == [ErrorKind.DEADLINE_EXCEEDED]
    rig.assert_all_free()


def test_a_renewal_never_shortens_a_lease_and_a_taken_lease_stays_taken() -> None:
    clock = Clock()
    rig = rig_on(clock)
    book = rig.engine.leases
    reserved = reserve(rig, lease_ms=10_000)
    lease = book.get(reserved.lease_id)
    assert lease is not None
    assert book.renew(reserved.lease_id, 1000) and lease.deadline_s == clock.now + 10.0
    book.take(lease)
    assert book.renew(reserved.lease_id, 1000) and lease.deadline_s == float("inf")
    book.cancel(lease, "test")
    rig.assert_all_free()


def test_a_gone_lease_is_not_revived() -> None:
    clock = Clock()
    rig = rig_on(clock)
    book = rig.engine.leases
    assert not book.renew("no-such-lease", 1000)
    reserved = reserve(rig, lease_ms=1000)
    lease = book.get(reserved.lease_id)
    assert lease is not None
    book.cancel(lease, "cancelled by the router")
    assert not book.renew(reserved.lease_id, 1000)
    rig.assert_all_free()


@pytest.mark.parametrize(("lease_ms", "transfer_s"), [(1000, 30.0), (60_000, 60.0)])
def test_the_transfer_keeps_the_longer_deadline(lease_ms: int, transfer_s: float) -> None:
    """The reservation (the sender's deadline too) lasts `decode.transfer_timeout_ms`, or the lease
    asked for when that is longer: a short lease never cuts a transfer its router keeps alive."""
    rig = rig_on(Clock())
    reserved = reserve(rig, lease_ms=lease_ms)
    reservation = reservation_from_pb(kv_transfer_pb2.Reservation.FromString(reserved.reservation))
    assert reservation.lease_s == transfer_s
    lease = rig.engine.leases.get(reserved.lease_id)
    assert lease is not None
    rig.engine.leases.cancel(lease, "test")
    rig.assert_all_free()


def test_a_slow_prefill_kept_alive_by_renewals_still_decodes() -> None:
    """The KV arrives three lease periods after the Reserve: the renewed lease is still there."""
    clock = Clock()
    rig = rig_on(clock)
    reserved = reserve(rig, lease_ms=1000)
    for _ in range(12):
        clock.now += 0.25
        rig.engine.handle(RenewCommand(0, (reserved.lease_id,), 1000))
        assert expired(rig) == []
    first = rig.prefill(reserved, PROMPT)
    rig.attach(reserved, PROMPT, first, 4)
    rig.run()
    assert isinstance(rig.finished(reserved.request_id), Finished)
    rig.assert_all_free()


def test_renew_queues_one_command_per_rank_and_names_the_leases_it_does_not_know() -> None:
    inbox, router = CommandInbox(), OutputRouter(2)
    service = DecodeService("d0", inbox, router, None, lambda: None, DrainController(), 4000)  # type: ignore[arg-type]
    router.expect_reserve("a", 0)
    router.expect_reserve("b", 1)
    router.expect_reserve("c", 1)
    request = wpb.RenewRequest(leases=[wpb.LeaseRef(request_id=r, lease_id=f"lease-{r}") for r in "abcz"])
    reply = service.Renew(request, None)  # type: ignore[arg-type]
    assert list(reply.lost_lease_ids) == ["lease-z"]
    commands = inbox.take(0)
    assert commands == [RenewCommand(0, ("lease-a",), 4000), RenewCommand(1, ("lease-b", "lease-c"), 4000)]
    service.Renew(wpb.RenewRequest(leases=request.leases[:1], lease_ms=500), None)  # type: ignore[arg-type]
    assert inbox.take(0) == [RenewCommand(0, ("lease-a",), 500)]
