"""`cedserve serve`'s own configuration: the --config file checked before anything starts, every
process's file written from it (and read back by the processes' own decoders), the device choice."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib
import torch

from cedserve.cli import build_parser, embedded_device, router_settings
from cedserve.decode_workers.config import DecodeConfig
from cedserve.launcher import read_serve_config, toml_text, write_worker_config
from cedserve.prefill_workers.config import PrefillWorkerConfig
from cedserve.router.admission import ClassLimits
from cedserve.serving.config import ServeConfig
from cedserve.serving.worker import read_serve_file

pytestmark = pytest.mark.unit

CONFIG = """\
[model]
preset = "tiny"
[cache]
num_blocks = 96
block_size = 64
[internal_tls]
server_name = "cedserve-internal"
[prefill]
effort_queue_slack_s = 0.5
[decode]
max_running_requests = 3
device = "cuda:1"
[kv_transfer]
backends = ["UCX"]
[router]
policy = "least_loaded"
[router.limits.max]
max_running = 2
max_queued = 0
"""


def test_every_process_reads_its_part_of_the_serve_config(tmp_path: Path) -> None:
    (tmp_path / "serve.toml").write_text(CONFIG)
    configs = write_worker_config(tmp_path / "run", "cpu", "s3cret", read_serve_config(tmp_path / "serve.toml"))
    token_file = str(tmp_path / "run" / "kv_transfer.token")
    for role, cls in (("prefill", PrefillWorkerConfig.from_mapping), ("decode", DecodeConfig.from_mapping)):
        serve, tables = read_serve_file(configs[role], (role, "kv_transfer"))
        assert serve.cache.num_blocks == 96 and serve.model.preset == "tiny"
        assert serve.internal_tls.server_name == "cedserve-internal" and serve.internal_token_file == token_file
        assert tables["kv_transfer"] == {"backends": ["UCX"], "auth_token_file": token_file}
        engine = cls(tables[role])
        if role == "prefill":
            assert (engine.device, engine.effort_queue_slack_s) == ("cpu", 0.5)  # the launcher's device
        else:
            assert (engine.device, engine.max_running_requests) == ("cuda:1", 3)  # the table's own wins
    router, tables = ServeConfig.load_with_sections(configs["router"], ("router",))  # as `cedserve router`
    assert router.cache.num_blocks == 96 and router.internal_token_file == token_file
    settings = router_settings(build_parser().parse_args(["router", "--max-retries", "5"]), tables["router"])
    assert settings == {"policy": "least_loaded", "limits": {"max": ClassLimits(2, 0)}, "max_retries": 5}
    settings = router_settings(build_parser().parse_args(["router", "--policy", "round_robin"]), tables["router"])
    assert settings["policy"] == "round_robin"  # a flag given wins over the table
    assert Path(token_file).read_text() == "s3cret"


def test_without_a_config_the_files_hold_only_token_and_device(tmp_path: Path) -> None:
    configs = write_worker_config(tmp_path, "cuda")
    assert tomllib.loads(configs["decode"].read_text()) == {
        "internal_token_file": str(tmp_path / "kv_transfer.token"),
        "kv_transfer": {"auth_token_file": str(tmp_path / "kv_transfer.token")}, "decode": {"device": "cuda"}}


@pytest.mark.parametrize(("text", "field"), [
    ("[decode]\nmax_runing_requests = 4\n", "decode.max_runing_requests"),
    ("[prefill]\nchunk_tokens = \"big\"\n", "chunk_tokens"),
    ("[kv_transfer]\nbogus = 1\n", "bogus"),
    ("[cache]\nnum_blocks = 0\n", "num_blocks"),
    ("[router]\npolicy = \"x\"\n", "config field `router.policy`"),
    ("[router]\nlease = 5\n", "config field `router.lease`"),
    ("[router.limits.max]\nmax_running = 0\n", "max_running >= 1"),
    ("[router.limits.urgent]\nmax_running = 1\n", "limits.urgent"),
    ("[routr]\npolicy = \"x\"\n", "routr"),
])
def test_a_bad_field_is_named_before_anything_starts(tmp_path: Path, text: str, field: str) -> None:
    (tmp_path / "serve.toml").write_text(text)
    with pytest.raises(ValueError, match=field):
        read_serve_config(tmp_path / "serve.toml")


def test_toml_text_round_trips_nested_tables_and_escapes() -> None:
    data = {"a": 1, "s": 'quote " and \\ back', "flag": True, "x": 0.25, "l": [1, 2], "none": None,
            "t": {"k": "v", "u": {"deep": 3}}}
    expected = {k: v for k, v in data.items() if k != "none"}
    assert tomllib.loads(toml_text(data)) == expected


def test_device_auto_takes_the_gpus_and_shares_them_when_ranks_outnumber_them(monkeypatch: pytest.MonkeyPatch) -> None:
    for have, wanted, ranks, gpus, group, expected, chosen in [
        (0, "auto", 2, (), 1, "cpu", ()), (1, "auto", 2, (), 1, "cuda", (0,)), (2, "auto", 2, (), 1, "cuda", (0, 1)),
        (8, "auto", 3, (), 1, "cuda", (0, 1, 2)), (4, "cpu", 2, (), 1, "cpu", ()),
        (4, "auto", 2, (2, 3), 1, "cuda", (2, 3)), (3, "auto", 2, (2, 3), 1, "cpu", ()),
        (1, "cuda", 2, (0, 0), 1, "cuda", (0, 0)), (1, "auto", 3, (), 2, "cpu", ()), (2, "auto", 3, (), 2, "cuda", (0, 1))]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda have=have: have > 0)  # the hardware boundary
        monkeypatch.setattr(torch.cuda, "device_count", lambda have=have: have)
        device, got, why = embedded_device(wanted, ranks, gpus, group)
        assert (device, got) == (expected, chosen), (have, wanted, ranks, gpus, group, why)
        assert ("shared" in why) == (device == "cuda" and len(set(got)) < ranks), why
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match="decode group of 2 ranks needs 2 GPUs"):
        embedded_device("cuda", 3, (), group_size=2)
    with pytest.raises(SystemExit, match="--gpus 0,1 but torch sees 1 GPUs"):
        embedded_device("cuda", 2, (0, 1))
