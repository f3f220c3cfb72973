"""The serving benchmark's pure parts: the Mooncake trace format, token synthesis, the prefix-reuse
oracle (checked against a token-level simulation over the cache's real block hashes), the agent
session generator, and the report's summaries and invariants."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from cedserve.bench.serve.agentic import AgentWorkload, generate_sessions, parse_effort_mix, parse_range
from cedserve.bench.serve.driver import LoadPoint, RequestResult, RunOutput, Sessions
from cedserve.bench.serve.main import assign_efforts, http_vs_grpc, parse_apis
from cedserve.bench.serve.metrics import Slo, percentile, summarize, summarize_run
from cedserve.bench.serve.trace import (
    PrefixOracle,
    TokenSynth,
    TraceFormatError,
    TraceRecord,
    check_block_size,
    infer_block_size,
    oracle_cached_tokens,
    read_trace,
    write_trace,
)
from cedserve.model.cache.hashing import hash_blocks

# The first lines of the public Mooncake trace format (512-token blocks).
MOONCAKE_LINES = """\
{"timestamp": 0, "input_length": 6755, "output_length": 500, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}
{"timestamp": 0, "input_length": 7319, "output_length": 490, "hash_ids": [0, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]}
{"timestamp": 3052, "input_length": 7234, "output_length": 794, "hash_ids": [0, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]}
{"timestamp": 3052, "input_length": 2287, "output_length": 316, "hash_ids": [0, 42, 43, 44, 45]}
"""


def test_mooncake_lines_read_with_their_block_size(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.jsonl"
    path.write_text(MOONCAKE_LINES)
    records = read_trace(path)
    assert [r.input_length for r in records] == [6755, 7319, 7234, 2287]
    assert records[2].timestamp_ms == 3052 and records[3].hash_ids == (0, 42, 43, 44, 45)
    assert all(r.session_id is None and r.effort is None for r in records)
    assert infer_block_size(records) == 512
    # Every later request shares block 0 only; the oracle reuses exactly that block.
    assert oracle_cached_tokens(records, 512, 64) == [0, 512, 512, 512]


def test_trace_round_trip_keeps_every_field(tmp_path: Path) -> None:
    records = generate_sessions(AgentWorkload(sessions=5, seed=3))
    path = tmp_path / "agent.jsonl"
    write_trace(path, records)
    assert read_trace(path) == records
    first = json.loads(path.read_text().splitlines()[0])
    assert {"timestamp", "input_length", "output_length", "hash_ids", "session_id", "effort"} <= set(first)
    later = json.loads(path.read_text().splitlines()[1])
    assert later["session_id"] == first["session_id"] and later["delay"] > 0


@pytest.mark.parametrize(("line", "message"), [
    ('{"timestamp": 0, "input_length": 10, "output_length": 2}', "missing field(s) ['hash_ids']"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [-1]}', "`hash_ids`"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 2, "hash_ids": [1]}', "`input_length`"),
    ('{"timestamp": -5, "input_length": 10, "output_length": 2, "hash_ids": [1]}', "`timestamp`"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1], "effort": 101}', "`effort`"),
    ('{"timestamp": 0, "input_length": 10', "not JSON"),
    ('[1, 2]', "expected a JSON object"),
])
def test_malformed_lines_name_the_line_and_field(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [7]}\n\n' + line + "\n")
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    assert f"{path}:3" in str(info.value) and message in str(info.value)


def test_block_size_inference_refuses_what_does_not_fit() -> None:
    assert infer_block_size([TraceRecord(0, 100, 1, (1, 2))]) == 64
    with pytest.raises(ValueError, match="several block sizes"):
        infer_block_size([TraceRecord(0, 100, 1, (1,))])  # 128 ... 2048 all fit
    with pytest.raises(ValueError, match="no block size"):
        infer_block_size([TraceRecord(0, 100, 1, (1, 2)), TraceRecord(0, 100, 1, (1, 2, 3))])
    with pytest.raises(ValueError, match="trace record 1"):
        check_block_size([TraceRecord(0, 64, 1, (1,)), TraceRecord(0, 65, 1, (1,))], 64)


def test_equal_ids_give_equal_blocks_and_the_caches_hashes_agree() -> None:
    synth = TokenSynth(64, 512, seed=5)
    a = synth.prompt(TraceRecord(0, 64 * 3 + 10, 1, (4, 9, 2, 11)))
    b = synth.prompt(TraceRecord(0, 64 * 3, 1, (4, 9, 8)))
    assert len(a) == 202 and len(b) == 192 and min(a + b) >= 3 and max(a + b) < 512
    assert a[:128] == b[:128] and a[128:158] != b[128:158]
    assert synth.prompt(TraceRecord(0, 64, 1, (4,))) == a[:64]  # deterministic, independent of position
    assert TokenSynth(64, 512, seed=6).block(4).tolist() != synth.block(4).tolist()
    ha, hb = hash_blocks(a, "", 64), hash_blocks(b, "", 64)
    assert ha[:2] == hb[:2] and ha[2] != hb[2]


def _token_level_oracle(records: list[TraceRecord], synth: TokenSynth, block_size: int) -> list[int]:
    """An unbounded prefix cache keyed by the serving system's own chained block hashes."""
    held: set[bytes] = set()
    out = []
    for r in records:
        hashes = hash_blocks(synth.prompt(r), "salt", block_size)
        run = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
        out.append(run * block_size)
        held.update(hashes)
    return out


@pytest.mark.parametrize("trace_block", [64, 128])
def test_oracle_equals_an_unbounded_cache_of_real_block_hashes(trace_block: int) -> None:
    records = generate_sessions(AgentWorkload(sessions=12, turns=(1, 5), block_size=trace_block, seed=1,
                                              system_prompt_tokens=300, max_prompt_tokens=8192))
    order = list(range(len(records)))
    random.Random(2).shuffle(order)  # any send order: the oracle follows it
    shuffled = [records[i] for i in order]
    synth = TokenSynth(trace_block, 512, seed=0)
    oracle = oracle_cached_tokens(shuffled, trace_block, 64)
    assert oracle == _token_level_oracle(shuffled, synth, 64)
    assert sum(oracle) > 0 and all(o <= r.input_length for o, r in zip(oracle, shuffled))


def test_oracle_counts_only_leading_runs_and_whole_system_blocks() -> None:
    oracle = PrefixOracle(trace_block_size=100, system_block_size=64)
    assert oracle.observe(TraceRecord(0, 250, 1, (1, 2, 3))) == 0
    assert oracle.observe(TraceRecord(0, 250, 1, (1, 2, 3))) == 192  # 250 shared -> 3 whole 64-blocks
    assert oracle.observe(TraceRecord(0, 300, 1, (1, 5, 3))) == 64  # a run stops at the first new id
    assert oracle.observe(TraceRecord(0, 150, 1, (9, 2))) == 0  # id 2 after a new id is not a prefix
    assert oracle.observe(TraceRecord(0, 150, 1, (1, 5))) == 128


def test_agent_sessions_grow_their_prefix_and_share_the_system_prompt_by_effort() -> None:
    w = AgentWorkload(sessions=20, turns=(2, 4), system_prompt_tokens=512, user_tokens=(256, 768),
                      tool_result_tokens=(128, 512), output_tokens=(16, 48), max_prompt_tokens=3584, block_size=64,
                      seed=7)
    records = generate_sessions(w)
    assert records == generate_sessions(w)  # deterministic
    sessions = Sessions.of(records)
    assert len(sessions.keys) == 20
    system_blocks = 512 // 64
    by_effort: dict[int, tuple[int, ...]] = {}
    for turns in sessions.turns:
        rs = [records[i] for i in turns]
        assert len({r.effort for r in rs}) == 1
        assert min(r.output_length for r in rs) >= 16 and max(r.output_length for r in rs) <= 48
        prefix = by_effort.setdefault(rs[0].effort or 0, rs[0].hash_ids[:system_blocks])
        assert rs[0].hash_ids[:system_blocks] == prefix
        for prev, cur in itertools.pairwise(rs):
            whole = prev.input_length // 64
            assert cur.hash_ids[:whole] == prev.hash_ids[:whole]  # the context only grows
            assert cur.input_length >= prev.input_length + prev.output_length + 128
            assert cur.delay_ms > 0 and cur.timestamp_ms >= prev.timestamp_ms
        assert all(r.input_length + r.output_length <= w.max_prompt_tokens for r in rs)
    prefixes = list(by_effort.values())
    assert len(prefixes) == 3 and not set(prefixes[0]) & set(prefixes[1])  # effort partitions the cache


def test_flag_parsers_name_the_flag() -> None:
    assert parse_range("128,512", "x") == (128, 512) and parse_range("64", "x") == (64, 64)
    assert parse_effort_mix("low:1,90:2") == ((50, 1.0), (90, 2.0))
    for bad in ("5,1", "a", "1,2,3"):
        with pytest.raises(ValueError, match="--turns"):
            parse_range(bad, "turns")
    with pytest.raises(ValueError, match="--effort-mix"):
        parse_effort_mix("huge:1")
    with pytest.raises(ValueError, match="poisson"):
        LoadPoint("poisson", 0)


def test_efforts_come_from_the_trace_else_one_per_session() -> None:
    records = [TraceRecord(0, 10, 1, (1,), "a"), TraceRecord(0, 10, 1, (1,), "a"), TraceRecord(0, 10, 1, (2,), None, 0, 20)]
    efforts = assign_efforts(records * 10, [(50, 1.0), (100, 1.0)], seed=0)
    assert efforts[0] == efforts[1] and efforts[2] == 20


def _result(effort: int, ttft: float, e2e: float, out: int, cached: int = 0, oracle: int = 0,
            error: str | None = None) -> RequestResult:
    r = RequestResult("s", 0, effort, 100, out, oracle, 0.0, error=error)
    if error is None:
        r.ttft_s, r.e2e_s, r.output_tokens, r.cached_tokens = ttft, e2e, out, cached
    return r


def test_summary_figures_and_goodput() -> None:
    results = [_result(50, 0.1, 1.0, 10, 64, 64), _result(75, 0.5, 1.4, 5, 0, 64), _result(100, 2.0, 3.0, 3),
               _result(75, 0, 0, 0, error="RESOURCE_EXHAUSTED")]
    s = summarize(results, wall_s=4.0, slo=Slo(ttft_s=1.0, tpot_s=0.15))
    assert (s["sent"], s["completed"], s["errored"]) == (4, 3, 1)
    assert s["errors_by_status"] == {"RESOURCE_EXHAUSTED": 1}
    assert s["ttft_s"]["p50"] == pytest.approx(0.5) and s["e2e_s"]["p99"] == pytest.approx(2.968)
    # TPOT: 0.1 and 0.225 and 0.5 s; only the first request meets TTFT <= 1 s and TPOT <= 0.15 s.
    assert s["slo_met"] == 1 and s["goodput_rps"] == pytest.approx(0.25) and s["slo_attainment"] == 0.25
    assert s["hit_rate"] == pytest.approx(64 / 300) and s["oracle_hit_rate"] == pytest.approx(128 / 300)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0], 99) == pytest.approx(1.99)


def test_the_transfers_exposed_tail_as_a_share_of_ttft() -> None:
    """`kv_transfer_share_of_ttft` is how long a transfer was open (it streams beside the prefill's
    compute); `kv_transfer_tail_share_of_ttft` the part after the prefill's last handoff, which
    nothing overlapped. Requests that moved nothing take no part in either."""
    moved = [_result(50, 2.0, 3.0, 4), _result(50, 1.0, 2.0, 4)]
    for r, (open_s, tail_s) in zip(moved, [(1.8, 0.1), (0.9, 0.02)]):
        r.kv_transfer_bytes, r.kv_transfer_s, r.kv_transfer_tail_s = 10 << 20, open_s, tail_s
    s = summarize([*moved, _result(50, 0.5, 1.0, 4)], wall_s=4.0, slo=Slo(1.0, 1.0))
    assert s["kv_transfer_share_of_ttft"]["p50"] == pytest.approx(0.9)
    assert s["kv_transfer_tail_share_of_ttft"]["mean"] == pytest.approx((0.1 / 2.0 + 0.02 / 1.0) / 2)
    assert s["kv_transfer_tail_s"]["mean"] == pytest.approx(0.06)


def test_invariants_hold_for_consistent_runs_and_catch_broken_ones() -> None:
    slo = Slo(1.0, 1.0)
    good = [_result(50, 0.1, 1.0, 4, 64, 128), _result(100, 0.1, 1.0, 4, 0, 0), _result(75, 0, 0, 0, error="UNAVAILABLE")]
    report = summarize_run(RunOutput(good, sent=3, wall_s=2.0, expected=3), slo)
    assert report["invariant_violations"] == []
    assert set(report["by_effort"]) == {"low", "high", "max"}
    assert sum(c["sent"] for c in report["by_effort"].values()) == 3
    lost = summarize_run(RunOutput(good, sent=4, wall_s=2.0, expected=4), slo)
    assert any("sent 4" in v for v in lost["invariant_violations"])
    over = summarize_run(RunOutput([_result(50, 0.1, 1.0, 4, 128, 64)], sent=1, wall_s=1.0, expected=1), slo)
    assert any("outside [0, oracle" in v for v in over["invariant_violations"])


def test_write_trace_verb_writes_a_replayable_trace(tmp_path: Path) -> None:
    from cedserve.bench.serve.main import main

    path = tmp_path / "agent.jsonl"
    assert main(["--write-trace", str(path), "--sessions", "4", "--turns", "3,3", "--seed", "9"]) == 0
    records = read_trace(path)
    assert len(Sessions.of(records).keys) == 4 and len(records) == 12
    assert infer_block_size(records) == 64
    assert main(["--trace", str(path), "--rates", "x"]) == 2  # a bad flag is refused before anything starts


def test_arms_share_devices_and_ranks_get_their_gpus_in_start_order() -> None:
    from cedserve.bench.serve.systems import plan_arms
    from cedserve.launcher import EmbeddedOptions

    arms = plan_arms(["cache_aware", "round_robin"], num_prefill=1, num_decode=1, decode_group_size=2, colocated=True)
    assert [a.name for a in arms] == ["cache_aware", "round_robin", "colocated"]
    colocated = arms[-1]
    assert colocated.colocated and colocated.num_decode == 3 and colocated.policy == "cache_aware"
    opts = EmbeddedOptions(num_prefill=1, num_decode=1, decode_group_size=2, device="cuda", gpus=(4, 5, 6))
    assert [opts.rank_env(i) for i in range(opts.num_ranks)] == [{"CUDA_VISIBLE_DEVICES": g} for g in "456"]
    assert EmbeddedOptions(device="cpu").rank_env(0) == {}
    shared = EmbeddedOptions(num_prefill=1, num_decode=1, decode_group_size=2, device="cuda", gpus=(0, 1))
    assert [shared.rank_env(i) for i in range(3)] == [{"CUDA_VISIBLE_DEVICES": g} for g in "010"]  # round-robin
    with pytest.raises(ValueError, match="a decode group's 2 ranks need distinct GPUs"):
        EmbeddedOptions(num_prefill=1, num_decode=1, decode_group_size=2, device="cuda", gpus=(0,))
    with pytest.raises(ValueError, match="--policies"):
        plan_arms(["fastest"], 1, 1, 1, colocated=False)


def test_machine_description_names_the_host_and_its_software() -> None:
    """`describe_machine` (shared by `bench serve`, `bench kv-transfer` and benchmarks/): the fields a
    reader compares figures by, read from this host."""
    import os
    import platform

    import torch

    from cedserve.common.machine import describe_machine, loadavg

    info = describe_machine("cpu")
    assert info["cores"] == os.cpu_count() and info["python"] == platform.python_version()
    assert info["kernel"] == platform.release() and info["torch"] == torch.__version__
    assert "gpus" not in info and info["nixl"].startswith(("nixl", "none"))
    assert len(info["loadavg_at_start"]) == len(loadavg()) == 3 and float(info["mem_gib"]) > 0
    json.dumps(info)  # it goes into the JSON report as it is


def test_api_overhead_is_client_time_minus_the_routers_and_http_is_compared_with_grpc() -> None:
    def run(api: str, overheads_s: list[float]) -> dict[str, object]:
        results = []
        for o in overheads_s:
            r = _result(75, 0.1, 1.0, 4)
            assert r.e2e_s is not None
            r.server_s = r.e2e_s - o
            results.append(r)
        summary = summarize(results, wall_s=4.0, slo=Slo(ttft_s=1.0, tpot_s=0.15))
        return {"load": {"kind": "closed", "value": 1.0, "label": f"closed x1 {api}"}, "api": api, "summary": summary}

    grpc_run, http_run = run("grpc", [0.003, 0.002, 0.004]), run("http", [0.0025, 0.0015, 0.0035])
    assert grpc_run["summary"]["api_overhead_s"]["p50"] == pytest.approx(0.003)  # type: ignore[index]
    figures = http_vs_grpc([grpc_run, http_run])["closed x1"]
    assert figures["grpc_api_overhead_s_p50_ms"] == pytest.approx(3.0)
    assert figures["http_minus_grpc_api_overhead_s_p50_ms"] == pytest.approx(-0.5)
    assert http_vs_grpc([grpc_run]) == {}  # one API alone: nothing to compare
    assert parse_apis("grpc,http") == ("grpc", "http")
    for bad in ("", "rest", "http,http"):
        with pytest.raises(ValueError, match="--api"):
            parse_apis(bad)


def test_config_file_is_checked_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--config` hands a serve config's worker tables to every arm; a bad field stops the command
    (exit 2, the field named) before any process starts."""
    from cedserve.bench.serve.main import main

    bad = tmp_path / "bad.toml"
    bad.write_text("[decode]\nship_state = \"yes\"\n")
    assert main(["--config", str(bad), "--concurrency", "1", "--sessions", "1", "--no-plots",
                 "--out", str(tmp_path / "out.json")]) == 2
    assert "ship_state" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_each_finished_arm_is_reported_before_the_next_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run cut by a time limit keeps what it finished: `run_arms` hands the reports so far to
    `on_arm` after every arm, before the next arm's processes start (the launch and the load are
    faked here; tests/e2e/test_bench_serve_e2e.py runs them for real)."""
    import contextlib
    from collections.abc import Iterator

    import cedserve.bench.serve.main as bench_main
    from cedserve.bench.serve.systems import plan_arms

    events: list[str] = []

    @contextlib.contextmanager
    def fake_arm(arm: object, base: object, log_dir: Path) -> Iterator[tuple[str, None]]:
        events.append(f"start {log_dir.name}")
        yield f"address-of-{log_dir.name}", None

    async def fake_bench(address: str, name: str, plan: object, http: object) -> list[dict[str, object]]:
        return [{"load": {"kind": "closed", "value": 1.0, "label": "closed x1"}, "api": "grpc", "summary": {},
                 "address": address}]

    monkeypatch.setattr(bench_main, "embedded_arm", fake_arm)
    monkeypatch.setattr(bench_main, "bench_address", fake_bench)
    arms = plan_arms(["cache_aware", "round_robin"], 1, 1, 1, True)
    seen: list[list[str]] = []

    def on_arm(done: list[dict[str, object]]) -> None:
        seen.append([str(d["arm"]["name"]) for d in done])  # type: ignore[index]
        events.append(f"done {seen[-1][-1]}")

    out = bench_main.run_arms(arms, object(), Path("/logs"), object(), on_arm)  # type: ignore[arg-type]
    assert [a["arm"]["name"] for a in out] == ["cache_aware", "round_robin", "colocated"]
    assert seen == [["cache_aware"], ["cache_aware", "round_robin"], ["cache_aware", "round_robin", "colocated"]]
    assert events == ["start cache_aware", "done cache_aware", "start round_robin", "done round_robin",
                      "start colocated", "done colocated"]
    assert out[1]["runs"][0]["address"] == "address-of-round_robin"
