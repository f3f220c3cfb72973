"""The prefill chunk runner: `encode_chunk` over static buffers at token-count buckets, one CUDA graph each.

`CEDModel.encode_chunk` runs a chunk eagerly: ~10K kernel launches for the encoder's 20 layers
whatever the chunk's length, each shaped by the chunk and the sequence's state (docs/prefill.md,
*Findings: 32K prompts on one GPU*). `PrefillRunner` runs the same computation through the decode
step's sync-free machinery (`cedserve.model.slot_step.SlotStep.encode` over `SlotPools`): a
sequence lives in a slot whose rings are long enough for a whole chunk (`max_rows_per_slot` = the
largest bucket), a chunk of n tokens is padded to the smallest bucket >= n (padding rows address
the scratch slot: they write no record a real slot reads), and every shape depends only on the
bucket, so on CUDA each bucket's pass is captured once (`capture`) and replayed. Per chunk the host:

1. stages token ids, slots and offsets in a pinned buffer and copies it to the device (one copy);
2. replays the bucket's graph (on a CPU, or before `capture`: runs the pass eagerly);
3. gathers the chunk's new global-KV records from the slot's blocks (`GlobalKVRecords`, for
   `store_records` into the cache's blocks) and the rows' boundary states (copies: the graph's
   outputs are overwritten by the next chunk).

Nothing is read back on the host. A sequence enters a slot with `load` (a fresh state, or one
restored from a prefix hit) and leaves it with `export` (a `SequenceState` for the decoder replay
and the shipped state), both whole-state copies off the chunk's path.

What differs from `encode_chunk` (float rounding, as the decode runner against `forward_batch`):
the fused projections' concatenated GEMMs, the device MoE (`cedserve.model.device_moe`), the picks
over a fixed width. The records are the same bytes where their inputs round the same.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from cedserve.model.cache.layout import BlockLayout
from cedserve.model.config import ModelConfig
from cedserve.model.network import BoundaryHidden, CEDModel, EncodedChunk, GlobalKVRecords
from cedserve.model.paged_attention import arena_block_size
from cedserve.model.runner import CaptureReport, capture_buckets, smallest_bucket
from cedserve.model.slot_step import MoeMode, SlotStep
from cedserve.model.slots import SlotPools, SlotShape, slot_pool_bytes
from cedserve.model.state import SequenceState

DEFAULT_BUCKETS = (512, 1024, 2048, 4096, 8192)
_TOKENS, _SLOTS, _OFFSETS = range(3)


@dataclass(frozen=True)
class PrefillRunnerConfig:
    """How the prefill runner sizes its pools."""

    max_context: int
    """Tokens one slot holds (the longest prompt)."""
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    """Chunk sizes (tokens) with a graph each, increasing; the largest is the longest chunk."""
    max_slots: int = 1
    """Sequences held at once (a slot each, for the whole of their prefill)."""
    cuda_graphs: bool = True
    """Replay captured graphs on CUDA (False: run the same pass eagerly)."""
    moe: MoeMode = "auto"
    """The pass's MoE (`cedserve.model.device_moe`)."""

    def __post_init__(self) -> None:
        if not self.buckets or sorted(set(self.buckets)) != list(self.buckets) or self.buckets[0] < 1:
            raise ValueError(
                f"prefill runner buckets: must be increasing positive sizes, got {list(self.buckets)}"
            )
        SlotShape(self.max_slots, self.max_context, self.buckets[-1])


def prefill_runner_bytes(model_config: ModelConfig, config: PrefillRunnerConfig) -> int:
    """Device bytes `PrefillRunner` allocates for its pools (rings, tables and its own record blocks),
    without allocating them: what a prefill worker's start-up memory check counts for it. The
    graphs' memory pool (a pass's activations at the largest bucket) comes on top."""
    shape = SlotShape(config.max_slots, config.max_context, config.buckets[-1])
    block_size = arena_block_size(model_config)
    layout = BlockLayout.from_config(model_config, block_size)
    blocks = 1 + config.max_slots * -(-config.max_context // block_size)
    return slot_pool_bytes(model_config, shape, block_size) + blocks * layout.block_bytes


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    outputs: tuple[Tensor, Tensor]


class PrefillRunner:
    """Chunk passes over slots (module docstring)."""

    def __init__(self, model: CEDModel, config: PrefillRunnerConfig) -> None:
        first_decoder = model._decoder_source()
        decoder_engram = [i for i in model.config.engram_layer_ids if i >= first_decoder]
        if decoder_engram:
            raise ValueError(
                f"the prefill runner's boundary states carry no Engram ids: decoder layers "
                f"{decoder_engram} have Engram"
            )
        self.model, self.config = model, config
        self.device = model.embed.weight.device
        self.buckets = config.buckets
        shape = SlotShape(config.max_slots, config.max_context, config.buckets[-1])
        self.pools = SlotPools(model.config, shape, self.device)
        self.slot_step = SlotStep(model, self.pools, config.moe, fused=False)
        width, pin = self.buckets[-1], self.device.type == "cuda"
        self._staging = torch.zeros(3, width, dtype=torch.long, pin_memory=pin)
        self._inputs = torch.zeros(3, width, dtype=torch.long, device=self.device)
        self._copied = torch.cuda.Event() if pin else None  # type: ignore[no-untyped-call]
        self._positions = [0] * config.max_slots  # host mirror of the slots' positions
        self._free = list(range(config.max_slots - 1, -1, -1))
        self._graphs: dict[int, _Graph] = {}
        self.chunks = 0

    @property
    def graphs_captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    # ------------------------------------------------------------------ slots

    def acquire(self) -> int | None:
        """A free slot, or None when all are held."""
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        self.pools.check_slot(slot)
        if slot not in self._free:
            self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def load(self, slot: int, state: SequenceState) -> None:
        """Put a sequence's state (fresh, or restored after a prefix hit) into `slot`."""
        self.pools.load(slot, state)
        self._positions[slot] = state.position

    def export(self, slot: int) -> SequenceState:
        """The slot's state as a `SequenceState` (copies): its encoder windows, every source's global
        KV and partial group, the Engram history. Decoder windows come back as whatever the slot's
        rings hold (`CEDModel.replay_decoder` rebuilds them)."""
        return self.pools.export(slot)

    def position(self, slot: int) -> int:
        self.pools.check_slot(slot)
        return self._positions[slot]

    def bucket_for(self, rows: int) -> int:
        return smallest_bucket(self.buckets, rows, f"prefill runner: a chunk of {rows} tokens exceeds")

    # ------------------------------------------------------------------ chunks

    def encode(self, slot: int, token_ids: Sequence[int] | np.ndarray | Tensor) -> EncodedChunk:
        """`CEDModel.encode_chunk` of the slot's next tokens: the chunk's new records of every KV source
        and its boundary states. `ValueError` for ids outside the vocabulary, an empty chunk, one longer
        than the largest bucket or past the slot's capacity, checked on the host before anything runs."""
        self.pools.check_slot(slot)
        ids = np.asarray(
            token_ids.cpu() if isinstance(token_ids, Tensor) else token_ids, dtype=np.int64
        ).ravel()
        rows, start = int(ids.size), self._positions[slot]
        if rows == 0:
            raise ValueError("prefill runner: no tokens given")
        vocab = self.model.config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}), got {ids[:16].tolist()}...")
        if start + rows > self.config.max_context:
            raise ValueError(
                f"prefill runner: slot {slot} holds {self.config.max_context} tokens; "
                f"{start} + {rows} do not fit"
            )
        bucket = self.bucket_for(rows)
        self._stage(slot, ids, bucket)
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.graph.replay()
            streams, pre = graph.outputs
        else:
            streams, pre = self._forward(bucket)
        self._positions[slot] = start + rows
        self.chunks += 1
        positions = torch.arange(start, start + rows, device=self.device)
        boundary = BoundaryHidden(positions, streams[:rows].clone(), pre[:rows].clone(), None, start)
        return EncodedChunk(self._records(slot, start, start + rows), boundary)

    def _stage(self, slot: int, ids: np.ndarray, bucket: int) -> None:
        staging, rows = self._staging, int(ids.size)
        if self._copied is not None:
            self._copied.synchronize()  # the previous chunk's copy has left the staging
        staging[:, rows:bucket] = 0
        staging[_SLOTS, rows:bucket] = self.pools.scratch_slot
        staging[_TOKENS, :rows] = torch.from_numpy(ids)
        staging[_SLOTS, :rows] = slot
        staging[_OFFSETS, :rows] = torch.arange(rows)
        self._inputs.copy_(staging, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _forward(self, bucket: int) -> tuple[Tensor, Tensor]:
        inputs = self._inputs[:, :bucket]
        return self.slot_step.encode(inputs[_TOKENS], inputs[_SLOTS], inputs[_OFFSETS])

    def _records(self, slot: int, start: int, end: int) -> dict[int, GlobalKVRecords]:
        """Each KV source's entries completed by the tokens `[start, end)`, gathered from the slot's
        blocks (copies)."""
        pools = self.pools
        table = pools.block_table[slot].long()
        out = {}
        for spec in pools.sources:
            layer, ratio = spec.layer_id, spec.compress_ratio
            first = start // ratio
            entries = torch.arange(first, end // ratio, device=self.device)
            per_block = pools.entries_per_block(layer)
            blocks, within = table[entries // per_block], entries % per_block
            main = pools.layout.pool_view(pools.storage, layer, "main")[blocks, within]
            keys = pools.layout.pool_view(pools.storage, layer, "index")[blocks, within]
            out[layer] = GlobalKVRecords(layer, first, main, keys)
        return out

    # ------------------------------------------------------------------ graphs

    def capture(self) -> CaptureReport:
        """Capture one graph per bucket (CUDA with `cuda_graphs` only; else nothing to do)."""
        start = time.perf_counter()
        if self.device.type != "cuda" or not self.config.cuda_graphs:
            return CaptureReport((), 0.0, 0)
        before = torch.cuda.memory_reserved(self.device)
        captured = capture_buckets(self.device, self.buckets, self._stage_scratch, self._forward)
        self._graphs.update({bucket: _Graph(graph, outputs) for bucket, (graph, outputs) in captured.items()})
        return CaptureReport(
            tuple(sorted(self._graphs)),
            time.perf_counter() - start,
            torch.cuda.memory_reserved(self.device) - before,
        )

    def _stage_scratch(self, bucket: int) -> None:
        """Inputs whose every row is padding: warm-ups and captures touch only the scratch slot."""
        self._staging.zero_()
        self._staging[_SLOTS] = self.pools.scratch_slot
        self._inputs.copy_(self._staging)
