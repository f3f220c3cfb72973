"""KV-cache byte accounting derived from a `ModelConfig` and the record formats.

Only KV-source (CSA2 Full) layers store global KV. Each stores, per compressed entry, one main-KV
record and one index-key record; an entry stands for `compress_ratio` tokens. So

    global bytes per token = sum over sources (main_record + index_record) / ratio

which is 3 x 356 / 2 + 356 / 1 = 890 for the released plan. SWA state is bounded: every layer keeps
`sliding_window` SWA records, whatever the context length.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from cedserve.kernels.record_sizes import index_key_record_bytes, main_kv_record_bytes, swa_record_bytes
from cedserve.model.config import AttentionMode, ModelConfig


@dataclass(frozen=True)
class SourceLayerBytes:
    """The global KV one KV-source layer stores."""

    layer_id: int
    compress_ratio: int
    main_kv_record_bytes: int
    index_key_record_bytes: int

    @property
    def entry_bytes(self) -> int:
        """Bytes of one compressed entry (main-KV record + index-key record)."""
        return self.main_kv_record_bytes + self.index_key_record_bytes

    @property
    def bytes_per_token(self) -> Fraction:
        return Fraction(self.entry_bytes, self.compress_ratio)


@dataclass(frozen=True)
class KVAccounting:
    """Byte figures for one model plan."""

    sources: tuple[SourceLayerBytes, ...]
    swa_record_bytes: int
    sliding_window: int
    num_backbone_layers: int
    num_draft_layers: int

    @classmethod
    def from_config(cls, config: ModelConfig) -> KVAccounting:
        sources = tuple(
            SourceLayerBytes(
                layer_id=spec.layer_id,
                compress_ratio=spec.compress_ratio,
                main_kv_record_bytes=main_kv_record_bytes(config.head_dim),
                index_key_record_bytes=index_key_record_bytes(config.index_head_dim),
            )
            for spec in config.layer_plan
            if spec.mode is AttentionMode.FULL
        )
        return cls(
            sources=sources,
            swa_record_bytes=swa_record_bytes(config.head_dim),
            sliding_window=config.sliding_window,
            num_backbone_layers=config.num_hidden_layers,
            num_draft_layers=config.num_nextn_predict_layers,
        )

    @property
    def global_bytes_per_token(self) -> Fraction:
        """Global KV bytes per context token, exact."""
        return sum((s.bytes_per_token for s in self.sources), Fraction(0))

    @property
    def swa_bytes_per_request(self) -> int:
        """SWA ring bytes of one request over all backbone layers (bounded by the window)."""
        return self.num_backbone_layers * self.sliding_window * self.swa_record_bytes

    @property
    def draft_swa_bytes_per_request(self) -> int:
        """SWA ring bytes of the DSpark draft layers for one request."""
        return self.num_draft_layers * self.sliding_window * self.swa_record_bytes

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one paged block of `block_size` tokens holding every source's records."""
        check_block_size(self, block_size)
        return sum(block_size // s.compress_ratio * s.entry_bytes for s in self.sources)

    def global_bytes(self, num_tokens: int) -> int:
        """Global KV bytes of a context of `num_tokens` (entries are whole: partial groups round down)."""
        return sum(num_tokens // s.compress_ratio * s.entry_bytes for s in self.sources)


def check_block_size(accounting: KVAccounting, block_size: int) -> None:
    """`ValueError` unless `block_size` holds a whole number of entries of every source."""
    if block_size <= 0:
        raise ValueError(f"cache field `block_size`: must be positive, got {block_size}")
    for s in accounting.sources:
        if block_size % s.compress_ratio:
            raise ValueError(
                f"cache field `block_size`: {block_size} is not a multiple of compress ratio "
                f"{s.compress_ratio} of KV-source layer {s.layer_id}"
            )
