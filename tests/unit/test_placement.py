"""The placement formula of router/placement.py, term by term and in its decisions."""

from __future__ import annotations

import pytest

from cedserve.router.placement import (
    DecodeLoad,
    LinkRates,
    PrefillLoad,
    RequestShape,
    decode_pressure,
    expected_output_tokens,
    place,
)

REQ = RequestShape(prompt_len=64_000, effort=75, block_size=64, block_bytes=56_960)
LINKS = LinkRates({("p0", "d0"): 1e10, ("p1", "d0"): 1e10, ("p0", "d1"): 1e9, ("p1", "d1"): 1e9},
                  {"dram": 5e10, "disk": 2e9})


def _decode(wid: str, running: int = 4, free: int = 100_000) -> DecodeLoad:
    return DecodeLoad(wid, running, free, step_s=[0.02, 0.02, 0.021, 0.022, 0.023, 0.024, 0.025],
                      prefill_tokens_per_s=5_000.0)


def test_terms_are_seconds_from_measured_rates() -> None:
    p = PrefillLoad("p0", queued_tokens=20_000, prefill_tokens_per_s=10_000.0, cached_blocks=500)
    d = _decode("d0")
    out = place(REQ, [p], [d], LINKS, decode_only_max_tokens=0)
    assert out.parts["prefill_wait"] == pytest.approx(2.0)
    assert out.parts["compute"] == pytest.approx((64_000 - 500 * 64) / 10_000)
    assert out.parts["transfer"] == pytest.approx(1000 * 56_960 / 1e10)
    assert out.parts["decode_pressure"] == pytest.approx(decode_pressure(d, 75))
    assert out.cost_s == pytest.approx(sum(out.parts.values()))


def test_prefix_locality_beats_an_idle_cold_worker() -> None:
    warm = PrefillLoad("p0", queued_tokens=8_000, prefill_tokens_per_s=10_000.0, cached_blocks=900)
    cold = PrefillLoad("p1", queued_tokens=0, prefill_tokens_per_s=10_000.0)
    assert place(REQ, [warm, cold], [_decode("d0")], LINKS, 0).prefill_id == "p0"
    busy_warm = PrefillLoad("p0", queued_tokens=200_000, prefill_tokens_per_s=10_000.0, cached_blocks=900)
    assert place(REQ, [busy_warm, cold], [_decode("d0")], LINKS, 0).prefill_id == "p1"


def test_offloaded_prefix_costs_its_onload() -> None:
    disk = PrefillLoad("p0", 0, 10_000.0, cached_blocks=0, offloaded_blocks={"disk": 900})
    out = place(REQ, [disk], [_decode("d0")], LINKS, 0)
    assert out.parts["compute"] == pytest.approx((64_000 - 900 * 64) / 10_000 + 900 * 56_960 / 2e9)


def test_slow_link_and_full_decode_workers_are_avoided() -> None:
    p = PrefillLoad("p0", 0, 10_000.0)
    assert place(REQ, [p], [_decode("d0"), _decode("d1")], LINKS, 0).decode_id == "d0"
    assert place(REQ, [p], [_decode("d0", free=10), _decode("d1")], LINKS, 0).decode_id == "d1"
    with pytest.raises(LookupError, match="free blocks"):
        place(REQ, [p], [_decode("d0", free=10)], LINKS, 0)


def test_decode_only_for_short_uncached_suffix() -> None:
    short = RequestShape(prompt_len=6_400, effort=50, block_size=64, block_bytes=56_960)
    d = DecodeLoad("d0", 4, 100_000, [0.02] * 8, prefill_tokens_per_s=5_000.0, cached_blocks=98)
    busy_p = PrefillLoad("p0", queued_tokens=50_000, prefill_tokens_per_s=10_000.0)
    out = place(short, [busy_p], [d], LINKS, decode_only_max_tokens=256)
    assert out.prefill_id is None and out.parts["compute"] == pytest.approx(128 / 5_000)
    # Above the threshold, decode-only is not an option even if it were cheaper.
    assert place(short, [busy_p], [d], LINKS, decode_only_max_tokens=64).prefill_id == "p0"


def test_effort_raises_expected_output_and_pressure() -> None:
    assert expected_output_tokens(100) == pytest.approx(2.5 * expected_output_tokens(25))
    d = _decode("d0", running=5)
    assert decode_pressure(d, 100) > decode_pressure(d, 50) > decode_pressure(d, 1)


def test_step_profile_extrapolates() -> None:
    d = _decode("d0")
    assert d.step_at(6) == 0.025 and d.step_at(8) == pytest.approx(0.027)
