"""Values shared between the layers of one forward pass over one sequence's chunk.

Nothing here outlives the call: selections and candidate pools are recomputed for each chunk's
queries, and dequantized global KV is a per-call view of the records in `SequenceState`.
`TrainContext` is the same for the full-sequence training pass, where no state exists.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

from cedserve.model.kv_format import KVFormat
from cedserve.model.state import SequenceState, StateSnapshot

if TYPE_CHECKING:
    from cedserve.model.paged_attention import PagedPass


@dataclass
class ForwardContext:
    """One forward pass over tokens at consecutive positions `positions [S]`."""

    positions: Tensor  # int64 [S]
    rope: dict[str, tuple[Tensor, Tensor]]  # "main"/"compress" -> cos, sin [S, rope_dim/2]
    state: SequenceState
    start: int
    """`positions[0]`, known on the host (reading it from the device would be a sync per layer)."""
    write_global_kv: bool = True
    """False when replaying decoder layers over tokens whose global KV is already stored."""
    engram_rows: Future[Tensor] | None = None
    """Engram table rows of the chunk, `[S, engram layers, columns, head_dim]`, started before
    layer 0 (possibly still being gathered on the store's thread); None without Engram."""
    taps: dict[int, Tensor] | None = None
    """When set, each `dspark_target_layer_ids` layer stores the streams entering its attention
    (after Engram), `[S, hc, hidden]`."""
    boundary: StateSnapshot | None = None
    """When set, every layer records the sequence's layer state (its window and, at a KV source, its
    global KV and partial group) here just before this chunk's attention runs, so the snapshot is the
    sequence as it was before this chunk even when an earlier chunk of the same sequence ran in the
    same pass (`CEDModel.forward_batch`). The caller fills position and Engram tail."""
    selections: dict[int, Tensor | None] = field(default_factory=dict)
    """Index-source layer -> bool [S, T] picked entries (None: no entry visible yet)."""
    candidates: Tensor | None = None
    """bool [S, T] candidate pool of the candidate-source layer, once it ran."""
    finite: list[Tensor] | None = None
    """When set, the records this pass encodes defer their NaN/inf check: each leaves a device flag
    here (`kv_format.encode_window`) and the entry point checks them once at the pass's end
    (`kv_format.check_finite`), one host read instead of one per record kind and layer."""
    paged: PagedPass | None = None
    """Set when the model attends through the kernels (`cedserve.model.paged_attention`): the
    chunk's picks and attention go through a paged copy of its records instead of dense masks."""
    _main_kv: dict[int, Tensor] = field(default_factory=dict)
    _index_keys: dict[int, Tensor] = field(default_factory=dict)

    def main_kv(self, kv_layer: int) -> Tensor:
        """Dequantized compressed KV of a KV source, float32 `[T, head_dim]`."""
        if kv_layer not in self._main_kv:
            self._main_kv[kv_layer] = self.state.global_kv[kv_layer].main_values()
        return self._main_kv[kv_layer]

    def index_keys(self, kv_layer: int) -> Tensor:
        """Dequantized index keys of a KV source, float32 `[T, index_head_dim]`."""
        if kv_layer not in self._index_keys:
            self._index_keys[kv_layer] = self.state.global_kv[kv_layer].key_values()
        return self._index_keys[kv_layer]

    def global_kv_changed(self, kv_layer: int) -> None:
        """Forget the dequantized views of a source whose records were just appended to."""
        self._main_kv.pop(kv_layer, None)
        self._index_keys.pop(kv_layer, None)


@dataclass
class TrainContext:
    """One full-sequence pass over a batch of sequences that all start at position 0
    (`CEDModel.forward_train`): differentiable, with no `SequenceState`. Cached values go through
    `kv_format`'s round trip with straight-through gradients, so the values every layer sees are
    those a `prefill` of each sequence would see."""

    positions: Tensor  # int64 [S]
    rope: dict[str, tuple[Tensor, Tensor]]  # "main"/"compress" -> cos, sin [S, rope_dim/2]
    kv_format: KVFormat = KVFormat.RECORDS
    engram_rows: Tensor | None = None
    """`[B, S, engram layers, columns, head_dim]`, None without Engram."""
    dense_selection: bool = False
    """Every visible compressed entry is attended to (the indexer's warm-up), instead of the top-k."""
    indexer_loss: bool = False
    """Add each index source's distillation loss (KL from the layer's attention over all visible
    compressed entries to the indexer's distribution) to `indexer_losses`."""
    taps: dict[int, Tensor] | None = None
    """When set, each `dspark_target_layer_ids` layer stores its attention input streams `[B, S, hc, D]`."""
    global_kv: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    """KV source -> (main KV `[B, T, D]`, index keys `[B, T, d]`), float32 after the round trip."""
    selections: dict[int, Tensor] = field(default_factory=dict)
    """Index source -> bool `[B, S, T]` picked entries."""
    candidates: Tensor | None = None
    """bool `[B, S, T]` candidate pool of the candidate-source layer, once it ran."""
    indexer_losses: list[Tensor] = field(default_factory=list)
