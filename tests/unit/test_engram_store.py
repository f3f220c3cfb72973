"""Engram tables served from the checkpoint through memory maps: same logits as in-memory tables,
rows read lazily, prefetched on the store's thread before layer 0, clear errors on bad files."""

from __future__ import annotations

import json
import mmap
import struct
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from safetensors.torch import save_file

from cedserve.model.checkpoint import CheckpointError, dequantize_weight, load_model
from cedserve.model.checkpoint_writer import write_random_checkpoint
from cedserve.model.config import ModelConfig
from cedserve.model.engram_store import EngramStore
from cedserve.model.presets import preset

if TYPE_CHECKING:
    from conftest import ReferenceA

pytestmark = pytest.mark.unit


def _table_name(layer_id: int) -> str:
    return f"model.layers.{layer_id}.engram.embed.weight"


def _write_tables(path: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A safetensors file holding only the Engram tables (and FP8 scales); returns what it wrote."""
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer_id, rows in zip(config.engram_layer_ids, config.engram_num_embeddings):
        values = torch.randn(rows, config.engram_head_dim, generator=gen)
        tensors[_table_name(layer_id)] = values.to(dtype)
        if dtype == torch.float8_e4m3fn:
            scale = torch.rand(rows, config.engram_head_dim // 32, generator=gen) + 0.5
            tensors[f"model.layers.{layer_id}.engram.embed.scale"] = scale
    save_file(tensors, str(path))
    return tensors


def _hash_ids(config: ModelConfig, tokens: int, seed: int = 1) -> torch.Tensor:
    """Random row ids `[S, engram layers, columns]`, each column within its layer's table."""
    columns = (config.engram_max_ngram_size - 1) * config.engram_n_heads
    gen = torch.Generator().manual_seed(seed)
    per_layer = [torch.randint(0, rows, (tokens, columns), generator=gen) for rows in config.engram_num_embeddings]
    return torch.stack(per_layer, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["F32", "BF16", "F8_E4M3"])
def test_rows_equal_the_loaders_dequantized_table(tmp_path: Path, dtype: torch.dtype) -> None:
    config = preset("tiny")
    written = _write_tables(tmp_path / "tables.safetensors", config, dtype)
    hash_ids = _hash_ids(config, tokens=9)
    with EngramStore.open([tmp_path / "tables.safetensors"], config) as store:
        rows = store.prefetch(hash_ids).result()
    assert rows.shape == (*hash_ids.shape, config.engram_head_dim) and rows.dtype == torch.float32
    for i, layer_id in enumerate(config.engram_layer_ids):
        name = _table_name(layer_id)
        table = dequantize_weight(name, written[name], written.get(name.replace("weight", "scale")), torch.float32)
        assert torch.equal(rows[:, i], table[hash_ids[:, i]])


def test_mmap_logits_equal_memory_on_the_reference_fixture(reference_a: ReferenceA) -> None:
    mapped = load_model(reference_a.folder, engram="mmap")
    try:
        assert mapped.engram_store is not None
        assert not any("engram.embed" in name for name, _ in mapped.named_parameters())
        prompt = reference_a.prompts[0]
        a, b = reference_a.model.new_state(), mapped.new_state()
        assert torch.equal(mapped.prefill(prompt, b), reference_a.model.prefill(prompt, a))
        for token in (5, 77, 300):
            assert torch.equal(mapped.decode_step([token], [b]), reference_a.model.decode_step([token], [a]))
    finally:
        mapped.close()


def test_mmap_logits_equal_memory_on_a_random_checkpoint(tmp_path: Path) -> None:
    write_random_checkpoint(preset("tiny"), tmp_path, seed=2)
    memory, mapped = load_model(tmp_path), load_model(tmp_path, engram="mmap")
    tokens = torch.randint(3, 500, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    try:
        assert torch.equal(mapped.prefill(tokens, mapped.new_state()), memory.prefill(tokens, memory.new_state()))
    finally:
        mapped.close()


def test_prefetch_starts_before_layer_0_and_runs_on_the_stores_thread(reference_a: ReferenceA) -> None:
    mapped = load_model(reference_a.folder, engram="mmap")
    store = mapped.engram_store
    assert store is not None
    events: list[str] = []
    original_gather = store.gather

    def gather(hash_ids: torch.Tensor) -> torch.Tensor:
        events.append(f"gather on {threading.current_thread().name}")
        return original_gather(hash_ids)

    original_prefetch = store.prefetch

    def prefetch(hash_ids: torch.Tensor) -> Future[torch.Tensor]:
        events.append("prefetch")
        return original_prefetch(hash_ids)

    store.gather, store.prefetch = gather, prefetch  # type: ignore[method-assign]
    hook = mapped.layers[0].register_forward_pre_hook(lambda *_: events.append("layer 0"))
    try:
        mapped.prefill(reference_a.prompts[0][:6], mapped.new_state())
    finally:
        hook.remove()
        mapped.close()
    assert events.index("prefetch") < events.index("layer 0")
    assert any(e.startswith("gather on engram-prefetch") for e in events)


def _write_sparse_table(path: Path, name: str, rows: int, head_dim: int) -> None:
    """A safetensors file with one F32 table of zeros, written as a sparse file (no data blocks)."""
    header = json.dumps({name: {"dtype": "F32", "shape": [rows, head_dim], "data_offsets": [0, rows * head_dim * 4]}})
    header += " " * (-len(header) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode())
        f.truncate(8 + len(header) + rows * head_dim * 4)


def _resident_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc for resident memory")
def test_the_table_is_memory_mapped_and_never_loaded(tmp_path: Path) -> None:
    rows = 8_000_000  # 1 GiB of float32 at head_dim 32 (a sparse file: no disk used)
    config = preset("tiny").replace(engram_layer_ids=(1,), engram_num_embeddings=(rows,))
    path = tmp_path / "big.safetensors"
    _write_sparse_table(path, _table_name(1), rows, config.engram_head_dim)
    before = _resident_bytes()
    with EngramStore.open([path], config) as store:
        table = store.tables[0].weight
        assert isinstance(table.base, mmap.mmap) and not table.flags.writeable
        out = store.gather(_hash_ids(config, tokens=64))
        grown = _resident_bytes() - before
    assert out.shape == (64, 1, 12, config.engram_head_dim) and not out.any()
    # 768 rows: a page each (3 MiB), plus the output and allocator noise; the table is 1 GiB.
    assert grown < 32 * 2**20, f"resident memory grew {grown / 2**20:.0f} MiB reading 768 rows of a 1 GiB table"


def test_a_truncated_file_names_the_tensor(tmp_path: Path) -> None:
    config = preset("tiny")
    path = tmp_path / "tables.safetensors"
    _write_tables(path, config, torch.float32)
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.\d\.engram\.embed\.weight: .*truncated checkpoint"):
        EngramStore.open([path], config)


def test_missing_or_misshaped_tables_are_named(tmp_path: Path) -> None:
    config = preset("tiny")
    path = tmp_path / "tables.safetensors"
    _write_tables(path, config.replace(engram_num_embeddings=(1524, 100)), torch.float32)
    with pytest.raises(CheckpointError, match=r"layers\.5\.engram\.embed\.weight: checkpoint shape"):
        EngramStore.open([path], config)
    with pytest.raises(CheckpointError, match=r"no Engram table layers\.3\.engram\.embed\.weight"):
        EngramStore.open([path], config.replace(engram_layer_ids=(3,), engram_num_embeddings=(1,)))


def test_a_closed_store_refuses_work(tmp_path: Path) -> None:
    config = preset("tiny")
    _write_tables(tmp_path / "t.safetensors", config, torch.float32)
    store = EngramStore.open([tmp_path / "t.safetensors"], config)
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.prefetch(_hash_ids(config, tokens=2))


def test_load_model_rejects_an_unknown_engram_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="engram must be one of"):
        load_model(tmp_path, engram="disk")


def test_workers_serve_the_tables_from_the_files_when_the_config_says_mmap(tmp_path: Path) -> None:
    """`[model] engram = "mmap"` reaches the workers' loader: the tables stay in the files, the logits
    are those of the loaded tables; a preset (random tables made in memory) or an unknown value is refused."""
    import msgspec

    from cedserve.serving.config import ServeConfig
    from cedserve.serving.worker import WorkerOptions, model_source
    from cedserve.serving.worker_model import load_worker_model

    write_random_checkpoint(preset("tiny"), tmp_path, seed=3)
    serve = msgspec.convert({"model": {"checkpoint": str(tmp_path), "engram": "mmap"}}, ServeConfig)
    source = model_source(WorkerOptions(role="decode"), serve)
    assert source.engram == "mmap"
    mapped = load_worker_model(source.checkpoint, None, engram=source.engram).model
    loaded = load_worker_model(str(tmp_path), None).model
    assert mapped.engram_store is not None and loaded.engram_store is None
    tokens = list(range(3, 40))
    with torch.no_grad():
        assert torch.equal(mapped.prefill(tokens, mapped.new_state()), loaded.prefill(tokens, loaded.new_state()))
    mapped.close()
    with pytest.raises(ValueError, match="needs a checkpoint"):
        load_worker_model(None, "tiny", engram="mmap")
    with pytest.raises(ValueError, match="engram"):
        msgspec.convert({"model": {"engram": "disk"}}, ServeConfig)
