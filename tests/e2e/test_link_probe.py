"""The link probe between two RUNNING workers: `cedserve bench kv-transfer --prefill-address
--decode-address` (what the chart's `helm test` runs) against real prefill and decode worker
processes (`--preset tiny`) on loopback, real gRPC and real NIXL (UCX) between them.

- the CLI reports verified bytes (the decode worker hashed what arrived) and exits 0, and afterwards
  both workers hold no block;
- `--min-gbps` above the achievable rate exits 1 naming the shortfall;
- a wrong token is refused (UNAUTHENTICATED) by both new RPCs, and the CLI says so;
- sizes beyond free blocks are refused RESOURCE_EXHAUSTED on either side, leaving nothing held.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from decode_rig import DecodeProcess
from prefill_rig import BLOCK, TOKEN, WorkerProcess, tiny_config

from cedserve.cli import main as cli_main
from cedserve.common.credentials import token_metadata
from cedserve.kv_transfer.nixl_backend import nixl_available
from cedserve.model.cache.layout import BlockLayout
from cedserve.proto import worker_pb2 as wpb

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")]
PREFILL_BLOCKS = 128
DECODE_BLOCKS = 64  # smaller than the prefill pool: a probe between the two sizes is refused by the decode side
BLOCK_BYTES = BlockLayout.from_config(tiny_config(), BLOCK).block_bytes


class Pair:
    def __init__(self) -> None:
        started: dict[str, object] = {}

        def start_decode() -> None:
            try:
                started["decode"] = DecodeProcess(num_blocks=DECODE_BLOCKS)
            except Exception as exc:  # re-raised below, in the test's thread
                started["error"] = exc

        thread = threading.Thread(target=start_decode)  # both load the model at once
        thread.start()
        self.prefill = WorkerProcess(num_blocks=PREFILL_BLOCKS)
        thread.join()
        if "error" in started:
            self.prefill.close()
            raise started["error"]  # type: ignore[misc]
        self.decode: DecodeProcess = started["decode"]  # type: ignore[assignment]

    def args(self, *extra: str) -> list[str]:
        return ["bench", "kv-transfer", f"--prefill-address={self.prefill.ready['address']}",
                f"--decode-address={self.decode.ready['address']}", "--timeout-s=60", *extra]

    def assert_nothing_held(self) -> None:
        decode = self.decode.wait_all_free()
        assert (decode.held_blocks, decode.free_blocks, decode.queued_requests) == (0, DECODE_BLOCKS, 0)
        prefill = self.prefill.load()
        for _ in range(100):  # the engine publishes its load after its next step
            if prefill.held_blocks == 0:
                break
            time.sleep(0.05)
            prefill = self.prefill.load()
        assert (prefill.held_blocks, prefill.free_blocks, prefill.running_requests) == (0, PREFILL_BLOCKS, 0)

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_cli_moves_verified_bytes_between_running_workers(pair: Pair, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "link.json"
    code = cli_main(pair.args("--size-mib=0.2", "--iterations=2", f"--token={TOKEN}", f"--json={out}"))
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "OK: 2 x 0.2 MiB verified" in printed.out
    result = json.loads(out.read_text())
    assert result["ok"] and result["error"] == "" and result["median_gbps"] > 0
    assert TOKEN not in result["command"]  # the token is redacted
    blocks = -(-int(0.2 * (1 << 20)) // BLOCK_BYTES)  # rounded up to whole blocks
    assert [it["index"] for it in result["iterations"]] == [-1, 0, 1]  # one warm-up
    for it in result["iterations"]:
        assert it["verified"] and (it["num_blocks"], it["block_bytes"]) == (blocks, BLOCK_BYTES)
        assert it["num_bytes"] == blocks * BLOCK_BYTES and it["transfer_s"] > 0 and it["descriptors"] >= 1
    timed = [it["gbps"] for it in result["iterations"] if it["index"] >= 0]
    assert result["median_gbps"] == pytest.approx(statistics.median(timed))
    pair.assert_nothing_held()


def test_min_gbps_above_the_link_fails_with_a_clear_message(pair: Pair, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    code = cli_main(pair.args("--size-mib=0.1", "--iterations=1", "--warmup=0", "--min-gbps=1000000",
                              f"--token-file={token_file}"))
    printed = capsys.readouterr()
    assert code == 1, printed.err
    assert "is below --min-gbps 1e+06" in printed.err and "FAILED" in printed.err
    pair.assert_nothing_held()


def test_wrong_token_is_refused(pair: Pair, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CEDSERVE_KV_TRANSFER_TOKEN", "not-the-token")
    code = cli_main(pair.args("--size-mib=0.1", "--iterations=1"))
    printed = capsys.readouterr()
    assert code == 1 and "refused the token (UNAUTHENTICATED)" in printed.err
    check = wpb.CheckProbeRequest(request_id="x", lease_id="y", sha256="0" * 64)
    for stub, call, request in ((pair.prefill.stub, "ProbeLink", wpb.ProbeLinkRequest(
            decode_address=pair.decode.ready["address"], num_bytes=1)), (pair.decode.stub, "CheckProbe", check)):
        for metadata in ((), token_metadata("not-the-token")):
            with pytest.raises(grpc.RpcError) as err:
                getattr(stub, call)(request, timeout=10, metadata=metadata)
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED, call
    pair.assert_nothing_held()


@pytest.mark.parametrize("blocks, side", [(DECODE_BLOCKS + 8, "decode"), (PREFILL_BLOCKS + 1, "prefill")])
def test_sizes_beyond_free_blocks_are_resource_exhausted(pair: Pair, blocks: int, side: str) -> None:
    request = wpb.ProbeLinkRequest(decode_address=pair.decode.ready["address"], num_bytes=blocks * BLOCK_BYTES,
                                   timeout_ms=20_000)
    with pytest.raises(grpc.RpcError) as err:
        pair.prefill.stub.ProbeLink(request, timeout=30, metadata=token_metadata(TOKEN))
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("decode worker at" in err.value.details()) == (side == "decode"), err.value.details()
    pair.assert_nothing_held()
