"""Engram tables in host memory: rows served from the checkpoint through read-only memory maps.

The released tables hold about 196B parameters, far more than a GPU (or a process's heap) should
carry. Their rows are looked up by token ids only (hash ids of the n-grams ending at each
position), so a chunk's rows are known before layer 0 runs. `EngramStore.prefetch` gathers them
on the store's own thread while the layers before the first Engram layer compute; the forward
waits on the future only when it reaches that layer.

Nothing is read at open time but the safetensors headers: each table is a read-only numpy view of
a memory map of its tensor's byte range (advised for random access), and indexing it with the
chunk's ids touches only those rows' pages (the OS page cache keeps hot rows resident). Rows come back dequantized to the model's dtype with the same
arithmetic as the in-memory path (`checkpoint.dequantize_weight`), so logits are bit-identical.

Stored formats: F32 and BF16 tables (cast), F8_E4M3 tables with a `scale` companion
`[rows, head_dim / 32]` (F32 or BF16; `engram.dequantize_engram_rows`).

Lifecycle: `open` -> `prefetch`/`gather` any number of times, from one forward at a time or
several -> `close` (or leave the `with` block), which stops the thread and drops the maps.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np
import torch
from torch import Tensor

from cedserve.model.config import ModelConfig
from cedserve.model.engram import ENGRAM_SCALE_BLOCK, dequantize_engram_rows
from cedserve.model.safetensors_file import (
    CheckpointError,
    RawArray,
    TensorInfo,
    memmap_tensor,
    raw_to_torch,
    read_header,
)


@dataclass(frozen=True)
class MappedTable:
    """One Engram layer's table: `weight [rows, head_dim]` and, for F8 tables, `scale
    [rows, head_dim / 32]`, both memory-mapped raw elements."""

    name: str
    weight: RawArray
    weight_dtype: str  # safetensors dtype of `weight`
    scale: RawArray | None
    scale_dtype: str

    @property
    def num_rows(self) -> int:
        return int(self.weight.shape[0])

    def stored_rows(self, ids: np.ndarray[tuple[int], np.dtype[np.int64]]) -> tuple[Tensor, Tensor | None]:
        """Rows `ids [n]` as stored: `weight [n, head_dim]` in the stored dtype and, for F8 tables,
        their `scale [n, head_dim / 32]`; reads only those rows from the map. `ValueError` for an id
        outside `[0, num_rows)` (numpy would wrap a negative one to the table's end)."""
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_rows):
            raise ValueError(f"Engram table {self.name}: row ids must be in [0, {self.num_rows}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        raw = raw_to_torch(self.weight[ids], self.weight_dtype)
        return raw, None if self.scale is None else raw_to_torch(self.scale[ids], self.scale_dtype)

    def rows(self, ids: np.ndarray[tuple[int], np.dtype[np.int64]], dtype: torch.dtype) -> Tensor:
        """Rows `ids [n]` as `dtype [n, head_dim]` (`stored_rows`, dequantized)."""
        raw, scale = self.stored_rows(ids)
        return raw.to(dtype) if scale is None else dequantize_engram_rows(raw, scale, dtype)


def _find(headers: dict[str, TensorInfo], name: str) -> TensorInfo | None:
    for candidate in (name, f"model.{name}"):
        if candidate in headers:
            return headers[candidate]
    return None


def _map_table(headers: dict[str, TensorInfo], layer_id: int, rows: int, head_dim: int) -> MappedTable:
    module = f"layers.{layer_id}.engram.embed"
    weight = _find(headers, f"{module}.weight")
    if weight is None:
        raise CheckpointError(f"checkpoint has no Engram table {module}.weight (nor model.{module}.weight)")
    if weight.shape != (rows, head_dim):
        raise CheckpointError(f"tensor {weight.name}: checkpoint shape {weight.shape}, model expects {(rows, head_dim)}")
    if weight.dtype != "F8_E4M3":
        return MappedTable(weight.name, memmap_tensor(weight), weight.dtype, None, "")
    scale = next((s for n in ("weight_scale_inv", "weight_scale", "scale") if (s := _find(headers, f"{module}.{n}"))),
                 None)
    expected = (rows, head_dim // ENGRAM_SCALE_BLOCK)
    if scale is None or scale.shape != expected:
        found = "none" if scale is None else f"{scale.name} {scale.shape}"
        raise CheckpointError(f"tensor {weight.name} is F8_E4M3 and needs a scale {expected} beside it; found {found}")
    return MappedTable(weight.name, memmap_tensor(weight), weight.dtype, memmap_tensor(scale), scale.dtype)


class EngramStore:
    """All Engram tables of one model, memory-mapped; owns one prefetch thread."""

    def __init__(self, tables: Sequence[MappedTable], dtype: torch.dtype) -> None:
        self.tables = tuple(tables)
        self.dtype = dtype
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-prefetch")

    @staticmethod
    def open(shards: Sequence[str | Path], config: ModelConfig, dtype: torch.dtype = torch.float32) -> EngramStore:
        """Map the tables of `config.engram_layer_ids` from the checkpoint's safetensors files.
        Raises `CheckpointError` naming the tensor when one is missing, mis-shaped, truncated or
        in an unsupported dtype."""
        headers: dict[str, TensorInfo] = {}
        for shard in shards:
            headers.update(read_header(shard))
        tables = [
            _map_table(headers, layer_id, rows, config.engram_head_dim)
            for layer_id, rows in zip(config.engram_layer_ids, config.engram_num_embeddings)
        ]
        return EngramStore(tables, dtype)

    def gather(self, hash_ids: Tensor) -> Tensor:
        """Rows for `hash_ids [S, engram layers, columns]` (int64, on any device) ->
        `[S, engram layers, columns, head_dim]` in the store's dtype, on the CPU. `ValueError` for
        an id outside its layer's table."""
        if self._pool is None:
            raise RuntimeError("EngramStore is closed")
        ids = hash_ids.detach().cpu().numpy()
        per_layer = []
        for i, table in enumerate(self.tables):
            flat = np.ascontiguousarray(ids[:, i]).reshape(-1)
            per_layer.append(table.rows(flat, self.dtype).view(ids.shape[0], ids.shape[2], -1))
        return torch.stack(per_layer, dim=1)

    def prefetch(self, hash_ids: Tensor) -> Future[Tensor]:
        """Start `gather(hash_ids)` on the store's thread; the future holds its result (or error)."""
        if self._pool is None:
            raise RuntimeError("EngramStore is closed")
        return self._pool.submit(self.gather, hash_ids.detach().cpu())

    def close(self) -> None:
        """Stop the prefetch thread (after running what was submitted) and drop the maps."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.tables = ()

    def __enter__(self) -> EngramStore:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
