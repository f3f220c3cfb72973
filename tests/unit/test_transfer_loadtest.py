"""The load test's matrix and CLI wiring (the runs themselves are in docs/benchmarks)."""

from __future__ import annotations

import pytest

from cedserve.bench.kv_transfer.harness import FreeList, LayoutSpec, pattern_rows, read_logical, write_logical
from cedserve.bench.kv_transfer.loadtest import (
    _cpu_per_request,
    default_matrix,
    main,
    parse_tokens,
    render_phases,
    render_table,
)
from cedserve.cli import main as cli_main
from cedserve.kv_transfer.region import KVRegion


def test_token_sizes_parse() -> None:
    assert [parse_tokens(s) for s in ("4K", "32K", "128K", "1M", "100")] == [4096, 32768, 131072, 1 << 20, 100]


def test_matrix_covers_modes_fan_in_baseline_and_packing() -> None:
    cells = default_matrix([4096, 1 << 20], [1, 4], ["write", "read"], [1, 2], max_multi_tokens=131072)
    keys = {c.key() for c in cells}
    assert "cross_layer-random-auto-read-4096-b4-f2" in keys
    assert "per_layer-random-off-write-1048576-b1-f1" in keys   # baseline at every size
    assert "cross_layer-contiguous-auto-write-4096-b1-f1" in keys
    assert "cross_layer-contiguous-auto-write-4096-b4-f1" in keys  # steady state: several in flight
    assert "cross_layer-contiguous-auto-write-1048576-b1-f1" in keys
    assert "cross_layer-random-on-write-4096-b1-f1" in keys
    assert not any(c.tokens == 1 << 20 and (c.batch > 1 or c.fan_in > 1) for c in cells)


def test_no_cells_selected_exits_2_without_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--sizes", "4K", "--only", "no-such-cell"]) == 2
    assert cli_main(["bench", "kv-transfer", "--sizes", "4K", "--only", "no-such-cell"]) == 2
    assert "no cells selected" in capsys.readouterr().err


def test_table_renders_a_row() -> None:
    row = {"layout": "cross_layer", "alloc": "random", "pack": "auto", "mode": "write", "tokens": 131072,
           "batch": 1, "fan_in": 2, "gbps": 2.5, "raw_gbps": 3.0, "ratio_to_raw": 0.83,
           "nixl_same_descs_gbps": 2.6, "memcpy_gbps": 9.0, "p50_ms": 40.0, "p99_ms": 60.0,
           "fixed_ms": 1.25, "descriptors_per_request": 2048, "failures": [], "verified": True,
           "sender_cpu_us_per_request": 812.4, "receiver_cpu_us_per_request": 301.0}
    line = render_table([row]).splitlines()[-1]
    assert "128K" in line and "0.83" in line and " 1.25 " in line and "812/301" in line and line.endswith("v")


def test_phases_line_carries_the_senders_poll_cadence() -> None:
    row = {"alloc": "contiguous", "tokens": 4096, "sender_status_polls_p50": 4.0, "sender_poll_interval_us": 50.0,
           "phases_p50_ms": {"queued": 0.1, "returned_to_nixl_done": 0.2}}
    line = render_phases([row, {"alloc": "random", "tokens": 4096, "phases_p50_ms": {}}])
    assert line == "# phases contiguous 4096: queued=0.100 returned_to_nixl_done=0.200 | polls 4, every 50.0 us"


def test_cpu_per_request_spans_a_processs_round() -> None:
    # two overlapping DONE requests of one process: (latest end - earliest start) / 2; a failed one and
    # one without marks (a tree before them) do not count
    results = [{"state": "done", "cpu_start_s": 1.0, "cpu_end_s": 1.5}, {"state": "done", "cpu_start_s": 1.2,
               "cpu_end_s": 1.9}, {"state": "failed", "cpu_start_s": 0.0, "cpu_end_s": 9.0}, {"state": "done"}]
    assert _cpu_per_request(results) == [pytest.approx(0.45)]
    assert _cpu_per_request([{"state": "done"}]) == []


@pytest.mark.parametrize("kind", ["cross_layer", "per_layer"])
def test_logical_blocks_round_trip_in_both_layouts(kind: str) -> None:
    import numpy as np
    import torch

    layout = LayoutSpec(kind=kind, preset="v4.1-flash", block_size=64).build()
    region = KVRegion(torch.zeros(20 * layout.block_bytes, dtype=torch.uint8), layout.block_bytes)
    ids = np.array([3, 17, 0], dtype=np.int64)
    rows = pattern_rows(5, ids, layout.block_bytes, torch.device("cpu"))
    write_logical(layout, region, ids, rows)
    assert torch.equal(read_logical(layout, region, ids), rows)
    alloc = FreeList(20, seed=0)
    got = alloc.allocate(5, "contiguous")
    assert got.tolist() == [0, 1, 2, 3, 4] and alloc.num_free == 15
    alloc.release(got)
    assert alloc.num_free == 20
