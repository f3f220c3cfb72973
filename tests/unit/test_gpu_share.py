"""Workers sharing a GPU (`cedserve serve --device auto` with fewer GPUs than worker ranks): the
ranks' GPUs and memory shares the launcher plans, the shares written into each role's config, and
the start-up check of what a worker will hold against its share. Real configs, a real tiny model
and real slot pools; only the GPU itself is faked (`torch.cuda.mem_get_info`,
`set_per_process_memory_fraction`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import tomllib
import torch

from cedserve.decode_workers.config import DecodeConfig
from cedserve.decode_workers.main import DecodeSettings, decode_memory_need
from cedserve.decode_workers.slot_book import SlotBook
from cedserve.kv_transfer.config import KVTransferConfig
from cedserve.launcher import EmbeddedOptions, plan_workers, worker_memory_fractions, write_worker_config
from cedserve.model.cache.config import KVCacheConfig
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.expert_exchange import fixed_capacity_bytes
from cedserve.model.presets import preset
from cedserve.model.slots import SlotPools, SlotShape, slot_pool_bytes
from cedserve.prefill_workers.config import PrefillWorkerConfig
from cedserve.serving.config import ServeConfig
from cedserve.serving.gpu_memory import (
    GIB,
    GpuShare,
    check_fits,
    claim_share,
    register_memory_gauges,
    staging_bytes,
)
from cedserve.serving.worker import check_gpu_share, worker_memory_need
from cedserve.serving.worker_model import LoadedModel, load_worker_model

pytestmark = pytest.mark.unit


def _rendezvous(group: int) -> tuple[str, int]:
    return "127.0.0.1", 29500 + group


# ------------------------------------------------------------------ the launcher's plan


def test_ranks_take_the_gpus_round_robin() -> None:
    opts = EmbeddedOptions(device="cuda", gpus=(0,), num_prefill=1, num_decode=1)
    assert [dict(s.env) for s in plan_workers(opts, _rendezvous)] == [{"CUDA_VISIBLE_DEVICES": "0"}] * 2
    opts = EmbeddedOptions(device="cuda", gpus=(3, 5), num_prefill=2, num_decode=1)
    assert [dict(s.env)["CUDA_VISIBLE_DEVICES"] for s in plan_workers(opts, _rendezvous)] == ["3", "5", "3"]
    opts = EmbeddedOptions(device="cuda", num_prefill=1, num_decode=2)  # no ids: one GPU per rank, as before
    assert [dict(s.env)["CUDA_VISIBLE_DEVICES"] for s in plan_workers(opts, _rendezvous)] == ["0", "1", "2"]


def test_a_decode_group_never_shares_a_gpu() -> None:
    EmbeddedOptions(device="cuda", gpus=(0, 1), num_prefill=1, num_decode=1, decode_group_size=2)  # ranks 1, 2 -> 1, 0
    with pytest.raises(ValueError, match="distinct GPUs"):
        EmbeddedOptions(device="cuda", gpus=(0, 1), num_prefill=0, num_decode=1, decode_group_size=3)


def test_one_gpu_is_split_between_prefill_and_decode() -> None:
    one_gpu = EmbeddedOptions(device="cuda", gpus=(0,))
    assert worker_memory_fractions(one_gpu) == {"prefill": 0.4, "decode": 0.5}
    assert worker_memory_fractions(EmbeddedOptions(device="cuda", gpus=(0, 1))) == {}  # one rank per GPU: no cap
    assert worker_memory_fractions(EmbeddedOptions(device="cuda")) == {}
    assert worker_memory_fractions(EmbeddedOptions(device="cpu", gpus=(0,))) == {}
    # two prefill + one decode on one GPU: each prefill 0.9 * 4/13, the decode 0.9 * 5/13
    three = worker_memory_fractions(EmbeddedOptions(device="cuda", gpus=(0,), num_prefill=2))
    assert three == {"prefill": round(0.9 * 4 / 13, 4), "decode": round(0.9 * 5 / 13, 4)}
    # uneven: GPU 0 holds prefill0 and decode0, GPU 1 prefill1 alone (0.9); a role takes its smallest share
    uneven = worker_memory_fractions(EmbeddedOptions(device="cuda", gpus=(0, 1), num_prefill=2, num_decode=1))
    assert uneven == {"prefill": 0.4, "decode": 0.5}


def test_configured_shares_win_and_an_oversubscribed_gpu_is_refused() -> None:
    config: dict[str, Any] = {"prefill": {"gpu_memory_fraction": 0.2}}
    opts = EmbeddedOptions(device="cuda", gpus=(0,), config=config)
    assert worker_memory_fractions(opts) == {"prefill": 0.2, "decode": 0.5}
    config = {"prefill": {"gpu_memory_fraction": 0.6}, "decode": {"gpu_memory_fraction": 0.6}}
    with pytest.raises(ValueError, match=r"GPU 0 holds 2 worker ranks .* add up to 1.20 > 1: lower \[prefill\] / "
                                         r"\[decode\] gpu_memory_fraction"):
        worker_memory_fractions(EmbeddedOptions(device="cuda", gpus=(0,), config=config))


def test_the_shares_reach_each_roles_config(tmp_path: Path) -> None:
    configs = write_worker_config(tmp_path, "cuda", config={"decode": {"gpu_memory_fraction": 0.55}},
                                  memory_fractions={"prefill": 0.4, "decode": 0.5})
    prefill = tomllib.loads(configs["prefill"].read_text())["prefill"]
    decode = tomllib.loads(configs["decode"].read_text())["decode"]
    assert PrefillWorkerConfig.from_mapping(prefill).gpu_memory_fraction == 0.4
    assert DecodeConfig.from_mapping(decode).gpu_memory_fraction == 0.55  # the table's own value wins
    plain = write_worker_config(tmp_path / "plain", "cuda")
    assert "gpu_memory_fraction" not in plain["prefill"].read_text()


@pytest.mark.parametrize("table, cls", [("prefill", PrefillWorkerConfig), ("decode", DecodeConfig)])
def test_a_share_outside_0_1_is_named(table: str, cls: Any) -> None:
    with pytest.raises(ValueError, match=f"{table}.*gpu_memory_fraction"):
        cls.from_mapping({"gpu_memory_fraction": 1.5})


# ------------------------------------------------------------------ the worker's check


@pytest.mark.parametrize("slots, context, rows", [(1, 1, 1), (3, 200, 1), (4, 1000, 11), (64, 4096, 5)])
def test_slot_pool_bytes_counts_what_the_pools_allocate(slots: int, context: int, rows: int) -> None:
    config = preset("tiny")
    layout = BlockLayout.from_config(config, 64)
    storage = torch.zeros(8, layout.block_bytes, dtype=torch.uint8)
    pools = SlotPools(config, SlotShape(slots, context, rows), torch.device("cpu"), storage, layout)
    assert slot_pool_bytes(config, SlotShape(slots, context, rows), 64) == pools.nbytes - storage.numel()


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_worker_model(None, "tiny", seed=0)


def _gpu(monkeypatch: pytest.MonkeyPatch, total: int, free: int) -> list[tuple[float, int]]:
    """Fake one GPU of `total` bytes with `free` free; returns the fractions the process set."""
    calls: list[tuple[float, int]] = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=0: (free, total))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, index=0: calls.append((fraction, index)))
    return calls


def test_claim_share_caps_the_process_only_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _gpu(monkeypatch, 140 * GIB, 130 * GIB)
    assert claim_share("cpu", 0.5) is None
    share = claim_share("cuda", 0.4)
    assert share == GpuShare("cuda:0", 140 * GIB, 0.4, 130 * GIB) and calls == [(0.4, 0)]
    assert share.budget_bytes == int(140 * GIB * 0.4)
    whole = claim_share("cuda:1", 0.0)
    assert whole is not None and whole.budget_bytes == 140 * GIB and calls == [(0.4, 0)]  # 0: no cap


def test_need_counts_weights_pool_staging_and_a_pass(tiny: LoadedModel) -> None:
    serve = ServeConfig(cache=KVCacheConfig(num_blocks=100))
    need = worker_memory_need("prefill", tiny, serve, KVTransferConfig(auth_token="t"), 2048, "step_token_budget")
    parts = {name: (nbytes, field) for name, nbytes, field in need.parts}
    weights = sum(t.numel() * t.element_size() for t in (*tiny.model.parameters(), *tiny.model.buffers()))
    assert parts["weights"][0] == weights
    assert parts["block pool"] == (100 * BlockLayout.from_config(tiny.model.config, 64).block_bytes, "[cache] num_blocks")
    assert parts["KV staging"] == (16 * (64 << 20), "[kv_transfer] staging_slots")  # device defaults
    assert parts["activations (estimate)"][1] == "[prefill] step_token_budget"
    assert need.total_bytes == sum(nbytes for nbytes, _ in parts.values())
    assert staging_bytes(KVTransferConfig(auth_token="t", staging_slots=0)) == 0


def test_a_worker_that_does_not_fit_its_share_names_the_fields(tiny: LoadedModel) -> None:
    serve = ServeConfig(cache=KVCacheConfig(num_blocks=100))
    need = worker_memory_need("prefill", tiny, serve, KVTransferConfig(auth_token="t"), 2048, "step_token_budget")
    roomy = GpuShare("cuda:0", 140 * GIB, 0.4, 140 * GIB)
    check_gpu_share("prefill", roomy, need)
    check_gpu_share("prefill", None, need)  # a CPU worker: nothing to check
    small = GpuShare("cuda:0", 4 * GIB, 0.4, 4 * GIB)
    with pytest.raises(ValueError, match=r"prefill worker does not fit its share of cuda:0: it needs .* its share "
                                         r"is 1.60 GiB of 4.00\. .*\[prefill\] gpu_memory_fraction \(now 0.4\); "
                                         r".*\[kv_transfer\] staging_slots.*\[cache\] num_blocks"):
        check_fits("prefill", small, need)
    crowded = GpuShare("cuda:0", 140 * GIB, 0.4, 1 * GIB)  # another process holds the GPU
    with pytest.raises(ValueError, match=r"had 1.00 GiB free at start.*other processes hold the rest"):
        check_fits("prefill", crowded, need)


def test_decode_need_counts_the_runners_pools_as_the_engine_builds_them(tiny: LoadedModel) -> None:
    serve = ServeConfig(cache=KVCacheConfig(num_blocks=40))
    kv = KVTransferConfig(auth_token="t")
    on = DecodeSettings(serve, DecodeConfig(runner="on", max_running_requests=5, cuda_graphs=False), kv)
    off = DecodeSettings(serve, msgspec.structs.replace(on.decode, runner="off"), kv)
    with_runner = {name: nbytes for name, nbytes, _ in decode_memory_need(tiny, on, 1, None, None).parts}
    without = {name: nbytes for name, nbytes, _ in decode_memory_need(tiny, off, 1, None, None).parts}
    expert_parallel = {name: nbytes for name, nbytes, _ in decode_memory_need(tiny, on, 2, None, None).parts}
    assert "runner slot pools" not in without and "runner expert-parallel buffers" not in with_runner
    layout = BlockLayout.from_config(tiny.model.config, 64)
    storage = torch.zeros(40, layout.block_bytes, dtype=torch.uint8)
    max_context = min(tiny.model.config.max_position_embeddings, 40 * 64)
    book = SlotBook.create(tiny.model, storage, layout, 5, max_context, 0, cuda_graphs=False)
    assert with_runner["runner slot pools"] == book.runner.pools.nbytes - storage.numel()
    # expert parallel: the same pools, and the exchange's buffers for the largest bucket (5 rows) of 2 ranks
    c = tiny.model.config
    assert expert_parallel["runner slot pools"] == with_runner["runner slot pools"]
    assert expert_parallel["runner expert-parallel buffers"] == fixed_capacity_bytes(
        2, book.runner.buckets[-1], c.num_experts_per_tok, c.hidden_size, tiny.model.embed.weight.element_size())


def test_the_workers_memory_is_a_metric_on_a_gpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    reserved = [3 * GIB]
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=0: reserved[0])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda index=0: 5 * GIB)
    registry = CollectorRegistry()
    register_memory_gauges(registry, GpuShare("cuda:0", 100 * GIB, 0.5, 90 * GIB))
    reserved[0] = 4 * GIB  # read at scrape time
    assert registry.get_sample_value("cedserve_gpu_memory_share_bytes") == 50 * GIB
    assert registry.get_sample_value("cedserve_gpu_memory_reserved_bytes") == 4 * GIB
    assert registry.get_sample_value("cedserve_gpu_memory_peak_bytes") == 5 * GIB
    cpu = CollectorRegistry()
    register_memory_gauges(cpu, None)
    assert "cedserve_gpu" not in generate_latest(cpu).decode()
