"""The placement formula of router/placement.py, term by term and in its decisions."""

from __future__ import annotations

import numpy as np
import pytest

from cedserve.router.placement import (
    DecodeLoad,
    LinkRates,
    MeasuredLinks,
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


# ------------------------------------------------------------------ measured per-pair link rates


def test_link_rate_is_the_ratio_of_byte_and_second_ewmas() -> None:
    links = MeasuredLinks(default_bytes_per_s=1e9, alpha=0.25, tier_bytes_per_s={})
    assert links.rate("p0", "d0") == 1e9  # unmeasured: the configured default
    links.observe("p0", "d0", num_bytes=8_000_000_000, seconds=1.0)  # first sample: taken as is
    assert links.rate("p0", "d0") == pytest.approx(8e9)
    # A small, latency-bound transfer (1 MB in 10 ms = 0.1 GB/s) moves the estimate by its bytes' share,
    # not as a quarter-weight rate sample: (0.25 x 1e6 + 0.75 x 8e9) / (0.25 x 0.01 + 0.75 x 1.0).
    links.observe("p0", "d0", num_bytes=1_000_000, seconds=0.01)
    assert links.rate("p0", "d0") == pytest.approx((0.25e6 + 6e9) / (0.0025 + 0.75))
    links.observe("p0", "d0", num_bytes=0, seconds=0.0)  # nothing sent (prefix cached): no measurement
    links.observe("p0", "d0", num_bytes=5, seconds=0.0)
    assert links.rate("p0", "d0") == pytest.approx((0.25e6 + 6e9) / (0.0025 + 0.75))
    assert links.rate("p0", "d1") == links.rate("p1", "d0") == 1e9  # per pair, not per worker


def test_ewma_converges_to_a_changed_link() -> None:
    links = MeasuredLinks(1e9, 0.5, {})
    links.observe("p0", "d0", 10_000_000_000, 1.0)
    for _ in range(20):
        links.observe("p0", "d0", 1_000_000_000, 1.0)  # the link dropped to 1 GB/s
    assert links.rate("p0", "d0") == pytest.approx(1e9, rel=1e-4)


def test_matrix_gathers_measured_pairs_and_defaults_the_rest() -> None:
    links = MeasuredLinks(1.5e9, 0.3, {})
    for i in range(5):  # enough workers to grow the dense arrays twice
        links.observe(f"p{i}", f"d{i}", (i + 1) * 10**9, 1.0)
    m = links.matrix(["p4", "p1", "unknown"], ["d1", "d4"])
    assert m.tolist() == [[1.5e9, 5e9], [2e9, 1.5e9], [1.5e9, 1.5e9]]
    links.forget("d4")  # a departed worker's pairs fall back to the default; others keep theirs
    assert links.rate("p4", "d4") == 1.5e9 and links.rate("p1", "d1") == 2e9
    assert links.matrix([], []).shape == (0, 0)


@pytest.mark.parametrize("model", ["constructed", "constructed, none listed", "measured"])
def test_numbered_rates_are_the_matrix_and_the_fastest(model: str) -> None:
    """`LinkModel.numbered`, which the request path's compiled loops read, gives the rates of
    `matrix` and the maxima of `max_rates`, for listed, unlisted and unknown workers."""
    pairs = {("p2", "d1"): 3e9, ("p0", "d1"): 5e8, ("p1", "d3"): 2e9}
    links: LinkRates | MeasuredLinks
    if model == "measured":
        links = MeasuredLinks(1e9, 0.3, {})
        for (p, d), rate in pairs.items():
            links.observe(p, d, int(rate), 1.0)
        links.forget("d3")
    else:
        links = LinkRates({} if "none" in model else pairs, {}, default_transfer_bytes_per_s=1e9)
    prefill, decode = ["p1", "p0", "unknown", "p2"], ["d3", "d0", "d1", "unknown"]
    view = links.numbered(prefill, decode)
    assert view.rates[np.ix_(view.rows, view.cols)].tolist() == links.matrix(prefill, decode).tolist()
    assert view.fastest[view.cols].tolist() == links.max_rates(decode).tolist()


def test_placement_follows_measured_links() -> None:
    req = RequestShape(prompt_len=64_000, effort=75, block_size=64, block_bytes=56_960)
    p = PrefillLoad("p0", 0, 10_000.0)
    links = MeasuredLinks(default_bytes_per_s=1e9, alpha=0.3, tier_bytes_per_s={})
    # Unmeasured, both pairs cost the default transfer; ties go to the smaller id.
    before = place(req, [p], [_decode("d0"), _decode("d1")], links, 0)
    assert before.decode_id == "d0" and before.parts["transfer"] == pytest.approx(1000 * 56_960 / 1e9)
    # d0's link measured slow (0.1 GB/s), d1's fast (20 GB/s): the transfer term moves the request to d1.
    links.observe("p0", "d0", 100_000_000, 1.0)
    links.observe("p0", "d1", 20_000_000_000, 1.0)
    after = place(req, [p], [_decode("d0"), _decode("d1")], links, 0)
    assert after.decode_id == "d1" and after.parts["transfer"] == pytest.approx(1000 * 56_960 / 2e10)


@pytest.mark.parametrize("name", ["round_robin", "least_loaded"])
def test_baseline_policies_serve_colocated_pools_decode_only(name: str) -> None:
    """With no prefill worker, the baselines place the request on a decode worker that prefills it
    itself (colocated serving), within the same suffix limit as the formula; beyond it they refuse."""
    from cedserve.router.placement import NoWorkerError
    from cedserve.router.policy import make_policy

    short = RequestShape(prompt_len=640, effort=50, block_size=64, block_bytes=56_960)
    pool = [_decode("d0", running=1), _decode("d1", running=6)]
    policy = make_policy(name, 1024)
    placements = [policy.choose(short, [], pool, LINKS) for _ in range(4)]
    assert all(p.prefill_id is None for p in placements)
    assert {p.decode_id for p in placements} == ({"d0", "d1"} if name == "round_robin" else {"d0"})
    with pytest.raises(NoWorkerError, match="no prefill worker"):
        make_policy(name, 512).choose(short, [], pool, LINKS)
