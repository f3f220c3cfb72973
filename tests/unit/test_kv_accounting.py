"""KV byte accounting is computed from the plan and the record formats."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from cedserve.model.kv_accounting import KVAccounting
from cedserve.model.presets import preset


def test_released_is_890_bytes_per_token() -> None:
    acc = KVAccounting.from_config(preset("v4.1-flash"))
    assert acc.global_bytes_per_token == 890
    assert [(s.layer_id, s.compress_ratio, s.entry_bytes) for s in acc.sources] == [
        (2, 2, 356), (8, 2, 356), (14, 2, 356), (20, 1, 356)]
    assert [s.bytes_per_token for s in acc.sources] == [178, 178, 178, 356]
    assert acc.block_bytes(64) == 56_960
    assert acc.swa_bytes_per_request == 40 * 128 * 528


def test_one_m2_and_one_m1_source_is_534() -> None:
    config = preset("v4.1-flash").replace(kv_source_layer_ids=(2, 20), index_source_layer_ids=(2, 20))
    assert KVAccounting.from_config(config).global_bytes_per_token == 534


def test_tiny_plan_accounting() -> None:
    acc = KVAccounting.from_config(preset("tiny"))
    # head_dim 64: 32 B of E2M1 + 4 E4M3 scales; index dim 32: 16 B + 1 UE8M0 scale.
    assert acc.global_bytes_per_token == Fraction(53, 2) + 53
    assert acc.global_bytes(5) == 2 * 53 + 5 * 53  # the partial m=2 group holds no entry yet


def test_block_size_must_hold_whole_entries() -> None:
    acc = KVAccounting.from_config(preset("v4.1-flash"))
    with pytest.raises(ValueError, match="block_size"):
        acc.block_bytes(33)


def test_inspect_cli_prints_890() -> None:
    out = subprocess.run([sys.executable, "-m", "cedserve.cli", "inspect", "--preset", "v4.1-flash"],
                         capture_output=True, text=True, check=True).stdout
    assert "global KV per token: 890 bytes" in out
    assert "paged block of 64 tokens: 56,960 bytes" in out
    js = subprocess.run([sys.executable, "-m", "cedserve.cli", "inspect", "--json", "--preset", "tiny"],
                        capture_output=True, text=True, check=True).stdout
    assert json.loads(js)["global_kv_bytes_per_token"] == 79.5


def test_cli_reports_bad_input(tmp_path: object) -> None:
    no_cluster = not Path("/tmp/ray/ray_current_cluster").exists() and "RAY_ADDRESS" not in os.environ
    if no_cluster and importlib.util.find_spec("ray") is not None:  # `auto` finds no running cluster
        proc = subprocess.run([sys.executable, "-m", "cedserve.cli", "serve", "--ray", "auto"], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 1 and "no Ray cluster at 'auto'" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cedserve.cli", "generate", "hi", "--address", "127.0.0.1:1",
                           "--timeout-s", "2"], capture_output=True, text=True)
    assert proc.returncode == 1 and "UNAVAILABLE" in proc.stderr  # no server there: a clear error, no traceback
    proc = subprocess.run([sys.executable, "-m", "cedserve.cli", "inspect", "--preset", "huge"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown preset" in proc.stderr
