"""The model's configuration, mirroring the released checkpoint's `text_config`.

Field names are exactly those of DeepSeek-V4.1-Flash's `config.json` (`text_config` section), so a
real checkpoint's config loads unchanged through `ModelConfig.from_hf_json`. Decoding goes through
msgspec, which checks every field's type and names the field on failure; `__post_init__` then checks
the relations between fields (list lengths, source layers, ratios) and raises `ValueError` naming the
field. Derived values (the layer plan, the encoder/decoder split) are properties.

Defaults are the released numbers; `presets.py` holds the smaller plans used by tests and demos.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import Any

import msgspec

RELEASED_COMPRESS_RATIOS: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20
RELEASED_KV_SOURCES: tuple[int, ...] = (2, 8, 14, 20)
RELEASED_INDEX_SOURCES: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)


class LayerRole(str, Enum):
    """Which half of the causal encoder-decoder a backbone layer belongs to."""

    ENCODER = "encoder"
    DECODER = "decoder"


class AttentionMode(str, Enum):
    """CSA2 mode of a layer. Every layer also runs sliding-window attention."""

    SWA = "swa"  # ratio 0: sliding window only, no compressed branch
    FULL = "full"  # owns a compressor, stores global KV and index keys, picks its own top-k
    REINDEX = "reindex"  # borrows the source's KV and index keys, scores its own top-k
    REUSE = "reuse"  # borrows KV and the picked positions of the latest index source


@dataclass(frozen=True)
class LayerSpec:
    """One backbone layer's place in the plan."""

    layer_id: int
    role: LayerRole
    mode: AttentionMode
    compress_ratio: int
    """Tokens pooled into one compressed entry (0 for SWA-only layers)."""
    kv_layer: int | None
    """The KV-source layer whose compressed main KV and index keys this layer reads."""
    index_layer: int | None
    """The index-source layer whose top-k selection this layer uses (itself for Full/Reindex)."""

    @property
    def stores_global_kv(self) -> bool:
        return self.mode is AttentionMode.FULL


RELEASED_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 65536,
}


@dataclass(frozen=True)
class ModelConfig:
    """The CED text backbone's hyper-parameters (released DeepSeek-V4.1-Flash values by default)."""

    # --- vocabulary and residual stream ---
    vocab_size: int = 129280
    """Rows of the embedding and the LM head."""
    hidden_size: int = 5120
    """Width of one residual stream (there are `hc_mult` of them)."""
    num_hidden_layers: int = 40
    """Backbone layers; DSpark draft layers come after these."""

    # --- attention ---
    num_attention_heads: int = 64
    """Query heads per layer."""
    num_key_value_heads: int = 1
    """One shared K=V latent for all heads."""
    head_dim: int = 512
    """Width of a head and of the shared KV latent (the main-KV record covers these channels)."""
    q_lora_rank: int = 1280
    """Rank of the low-rank query projection."""
    qk_rope_head_dim: int = 64
    """Trailing channels of each head that get (interleaved) RoPE."""
    rope_theta: float = 10000.0
    """RoPE base of the sliding-window branch."""
    compress_rope_theta: float = 160000.0
    """RoPE base of the compressed branch (YaRN-scaled)."""
    rope_parameters: dict[str, Any] | None = None
    """Per-branch rope settings, keys `main` and `compress`; derived from the flat fields when absent."""
    rope_scaling: dict[str, Any] | None = field(default_factory=lambda: dict(RELEASED_ROPE_SCALING))
    """YaRN settings of the compressed branch, as released."""
    max_position_embeddings: int = 1048576
    """Longest supported context in tokens."""
    attention_bias: bool = False
    """Whether projections carry a bias (the released model has none)."""
    o_groups: int = 8
    """Head groups of the grouped low-rank output projection."""
    o_lora_rank: int = 1024
    """Per-group rank of the output projection."""

    # --- sliding window and CSA2 ---
    sliding_window: int = 128
    """Tokens in every layer's local window."""
    compress_ratios: tuple[int, ...] = RELEASED_COMPRESS_RATIOS
    """Per layer: 0 = SWA only, m >= 1 = m tokens pooled per compressed entry. May carry trailing
    zeros for the draft layers."""
    kv_source_layer_ids: tuple[int, ...] = RELEASED_KV_SOURCES
    """Layers that own a compressor and store global KV (CSA2 Full)."""
    index_source_layer_ids: tuple[int, ...] = RELEASED_INDEX_SOURCES
    """Layers that score and pick top-k (Full or Reindex)."""
    candidate_source_layer_id: int | None = None
    """Index source whose top blocks form the candidate pool for later index sources (<0: off;
    None: the last KV source)."""
    candidate_topk_blocks: int = 2048
    """Candidate blocks kept by the candidate source."""
    candidate_block_size: int = 8
    """Compressed positions per candidate block."""
    index_n_heads: int = 32
    """Indexer query heads."""
    index_head_dim: int = 128
    """Indexer head width (the index-key record covers these channels)."""
    index_topk: int = 512
    """Compressed positions each query attends to."""

    # --- MoE ---
    moe_intermediate_size: int = 2304
    """Intermediate width of each expert."""
    n_routed_experts: int = 384
    """Routed experts per MoE layer."""
    n_shared_experts: int = 1
    """Experts every token passes through."""
    num_experts_per_tok: int = 6
    """Routed experts active per token."""
    scoring_func: str = "sqrtsoftplus"
    """Router activation: sqrtsoftplus, softmax or sigmoid."""
    gate_temp: float = 1.0
    """Divides router logits before scoring."""
    norm_topk_prob: bool = True
    """Renormalise the selected experts' weights."""
    routed_scaling_factor: float = 1.5
    """Multiplies the routed experts' output."""
    topk_method: str = "noaux_tc"
    """Expert selection: the bias steers selection only."""
    swiglu_limit: float = 10.0
    """Clamp on SwiGLU pre-activations."""
    hidden_act: str = "silu"
    """Expert activation."""

    # --- mHC ---
    hc_mult: int = 4
    """Parallel residual streams."""
    hc_sinkhorn_iters: int = 20
    """Sinkhorn iterations for the stream-mixing matrix."""
    hc_eps: float = 1e-6
    """Floor in the Sinkhorn normalisation and the pre gates."""

    # --- Engram ---
    engram_layer_ids: tuple[int, ...] = (1, 14)
    """Layers with an n-gram memory."""
    engram_vocab_size: int = 16000000
    """Bucket count each (n-gram size, head) prime search starts from."""
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    """Table rows per Engram layer."""
    engram_max_ngram_size: int = 4
    """Largest n-gram hashed (sizes 2..N)."""
    engram_n_heads: int = 8
    """Hash heads per n-gram size."""
    engram_head_dim: int = 256
    """Width of a table row."""
    engram_pad_id: int = 2
    """Token id for n-gram slots before the sequence start."""
    engram_compressed_vocab_size: int = 99092
    """Size of the tokenizer-normalised vocabulary the hashes read."""

    # --- DSpark ---
    num_nextn_predict_layers: int = 3
    """DSpark draft layers after the backbone."""
    dspark_block_size: int = 5
    """Positions drafted per pass (anchor + noise tokens)."""
    dspark_noise_token_id: int = 128799
    """Token filling the non-anchor draft positions."""
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    """Backbone layers whose attention inputs form the draft context."""
    dspark_markov_rank: int = 256
    """Rank of the Markov head."""
    dspark_n_routed_experts: int = 128
    """Routed experts in the draft layers."""
    dspark_num_experts_per_tok: int = 3
    """Routed experts active per token in the draft layers."""

    # --- misc ---
    rms_norm_eps: float = 1e-20
    """RMSNorm epsilon (as trained)."""
    tie_word_embeddings: bool = False
    """Whether the LM head shares the embedding."""
    initializer_range: float = 0.02
    """Std of random initialisation (used by the tiny checkpoint writer)."""
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    pad_token_id: int | None = None

    ignored_fields: tuple[str, ...] = field(default=(), compare=False)
    """Keys of the source config.json this project does not use (training-only, vision...)."""

    def __post_init__(self) -> None:
        _validate(self)
        # Draft layers are SWA-only: store the schedule with their zeros, as the released file does.
        full = self.num_hidden_layers + self.num_nextn_predict_layers
        object.__setattr__(self, "compress_ratios", tuple(self.compress_ratios) + (0,) * (full - len(self.compress_ratios)))
        if self.rope_parameters is None or not {"main", "compress"} <= set(self.rope_parameters):
            object.__setattr__(self, "rope_parameters", _derive_rope(self))
        if self.candidate_source_layer_id is None:
            object.__setattr__(self, "candidate_source_layer_id", self.kv_source_layer_ids[-1])

    # ---------------------------------------------------------------- loading

    @classmethod
    def from_hf_json(cls, source: str | Path | Mapping[str, Any]) -> ModelConfig:
        """Load a Hugging Face `config.json` (a path, a folder holding one, or its parsed dict).

        A composite config's `text_config` is used when present. Unknown keys are kept in
        `ignored_fields`; a wrong type raises `ValueError` naming the field.
        """
        raw = _read_json(source)
        if isinstance(raw.get("text_config"), Mapping):
            raw = dict(raw["text_config"])
        known = {f.name for f in dataclasses.fields(cls)} - {"ignored_fields"}
        kept = {k: v for k, v in raw.items() if k in known}
        ignored = tuple(sorted(set(raw) - known))
        try:
            config = msgspec.convert({**kept, "ignored_fields": ignored}, type=cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid model config: {exc}") from exc
        return config

    def to_hf_dict(self) -> dict[str, Any]:
        """The config as a `config.json` dict (the `text_config` layout, plus `model_type`)."""
        out: dict[str, Any] = {"model_type": "deepseek_v41_text", "architectures": ["DeepseekV41ForCausalLM"]}
        for f in dataclasses.fields(self):
            if f.name == "ignored_fields":
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["layer_types"] = [
            "shared_compressed_attention" if i in self.kv_source_layer_ids else "sliding_attention"
            for i in range(self.num_hidden_layers)
        ]
        return out

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed, validated again."""
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------- derived plan

    @property
    def backbone_ratios(self) -> tuple[int, ...]:
        """`compress_ratios` of the backbone layers only."""
        return self.compress_ratios[: self.num_hidden_layers]

    @property
    def num_encoder_layers(self) -> int:
        """Layers before the first decoder layer (the first m=1 KV source): 20 when released."""
        return _decoder_start(self)

    @property
    def decoder_kv_source(self) -> int:
        """The KV source fed by the encoder's output; the decoder's global KV comes from it."""
        return _decoder_start(self)

    @cached_property
    def layer_plan(self) -> tuple[LayerSpec, ...]:
        """Each backbone layer's role, CSA2 mode and the layers it borrows from."""
        return tuple(_layer_spec(self, i) for i in range(self.num_hidden_layers))

    @property
    def has_candidate_pool(self) -> bool:
        return self.candidate_source_layer_id is not None and self.candidate_source_layer_id >= 0


# -------------------------------------------------------------------- helpers


def _read_json(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"model config not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"model config {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model config {path} must hold a JSON object")
    return data


def _fail(name: str, message: str) -> None:
    raise ValueError(f"model config field `{name}`: {message}")


def _validate(c: ModelConfig) -> None:
    n = c.num_hidden_layers
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                 "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "hc_mult"):
        if getattr(c, name) <= 0:
            _fail(name, f"must be positive, got {getattr(c, name)}")
    if not n <= len(c.compress_ratios) <= n + c.num_nextn_predict_layers:
        _fail("compress_ratios", f"needs {n} entries (or up to {n + c.num_nextn_predict_layers} with the "
              f"draft layers), got {len(c.compress_ratios)}")
    if any(r < 0 for r in c.compress_ratios):
        _fail("compress_ratios", f"entries must be >= 0, got {list(c.compress_ratios)}")
    if any(r != 0 for r in c.compress_ratios[n:]):
        _fail("compress_ratios", "draft-layer entries (after num_hidden_layers) must be 0")
    _validate_sources(c)
    _validate_geometry(c)


def _validate_sources(c: ModelConfig) -> None:
    n, ratios = c.num_hidden_layers, c.compress_ratios[: c.num_hidden_layers]
    kv, index = c.kv_source_layer_ids, c.index_source_layer_ids
    if not kv:
        _fail("kv_source_layer_ids", "must name at least one layer")
    if all(ratios[s] != 1 for s in kv if 0 <= s < n):
        _fail("kv_source_layer_ids", f"{list(kv)} has no source with compress ratio 1 (the decoder's KV source)")
    if list(kv) != sorted(set(kv)):
        _fail("kv_source_layer_ids", f"must be strictly increasing, got {list(kv)}")
    if list(index) != sorted(set(index)):
        _fail("index_source_layer_ids", f"must be strictly increasing, got {list(index)}")
    for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index)):
        for i in ids:
            if not 0 <= i < n:
                _fail(name, f"layer {i} is outside [0, {n})")
            if ratios[i] == 0:
                _fail(name, f"layer {i} has compress_ratios[{i}] = 0: a source must be a compressed layer")
    for i in index:
        if not any(s <= i for s in kv):
            _fail("index_source_layer_ids", f"layer {i} has no KV source at or before it")
    for i in range(n):
        if ratios[i] > 0 and not any(s <= i for s in kv):
            _fail("compress_ratios", f"layer {i} is compressed but no KV source is at or before it")
        if ratios[i] > 0 and not any(s <= i for s in index):
            _fail("index_source_layer_ids", f"compressed layer {i} has no index source at or before it")
    for i in range(n):
        if ratios[i] > 0 and max(s for s in index if s <= i) < max(s for s in kv if s <= i):
            _fail("index_source_layer_ids", f"layer {i} would reuse top-k picked before its KV source")
        if ratios[i] > 0:
            src = max(s for s in kv if s <= i)
            if ratios[src] != ratios[i]:
                _fail("compress_ratios", f"layer {i} (m={ratios[i]}) reads KV source {src} whose m={ratios[src]}")
    cand = c.candidate_source_layer_id
    if cand is not None and cand >= 0 and cand not in index:
        _fail("candidate_source_layer_id", f"{cand} is not in index_source_layer_ids {list(index)}")


def _validate_geometry(c: ModelConfig) -> None:
    if c.qk_rope_head_dim % 2 or not 0 < c.qk_rope_head_dim <= c.head_dim:
        _fail("qk_rope_head_dim", f"must be even and in (0, head_dim={c.head_dim}], got {c.qk_rope_head_dim}")
    if c.head_dim % 32:
        _fail("head_dim", f"must be a multiple of 32 (FP4 scales per 16, SWA scales per 32), got {c.head_dim}")
    if c.index_head_dim % 32:
        _fail("index_head_dim", f"must be a multiple of 32 (UE8M0 scale per 32), got {c.index_head_dim}")
    if c.num_attention_heads % c.o_groups:
        _fail("o_groups", f"{c.o_groups} does not divide num_attention_heads={c.num_attention_heads}")
    if not 0 < c.num_experts_per_tok <= c.n_routed_experts:
        _fail("num_experts_per_tok", f"must be in [1, n_routed_experts={c.n_routed_experts}]")
    if c.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
        _fail("scoring_func", f"unknown scoring function {c.scoring_func!r}")
    if len(c.engram_num_embeddings) != len(c.engram_layer_ids):
        _fail("engram_num_embeddings", f"has {len(c.engram_num_embeddings)} entries for "
              f"{len(c.engram_layer_ids)} engram_layer_ids")
    for i in c.engram_layer_ids:
        if not 0 <= i < c.num_hidden_layers:
            _fail("engram_layer_ids", f"layer {i} is outside [0, {c.num_hidden_layers})")
    for i in c.dspark_target_layer_ids:
        if not 0 <= i < c.num_hidden_layers:
            _fail("dspark_target_layer_ids", f"layer {i} is outside [0, {c.num_hidden_layers})")


def _derive_rope(c: ModelConfig) -> dict[str, Any]:
    partial = c.qk_rope_head_dim / c.head_dim
    main = {"rope_type": "default", "rope_theta": c.rope_theta, "partial_rotary_factor": partial}
    yarn = {k: v for k, v in (c.rope_scaling or {}).items() if k not in ("main", "compress")}
    compress: dict[str, Any] = {**yarn, "rope_theta": c.compress_rope_theta, "partial_rotary_factor": partial}
    compress.setdefault("rope_type", "default")
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return {"main": main, "compress": compress}


def _decoder_start(c: ModelConfig) -> int:
    return min(s for s in c.kv_source_layer_ids if c.compress_ratios[s] == 1)


def _layer_spec(c: ModelConfig, i: int) -> LayerSpec:
    ratio = c.compress_ratios[i]
    role = LayerRole.ENCODER if i < _decoder_start(c) else LayerRole.DECODER
    if ratio == 0:
        return LayerSpec(i, role, AttentionMode.SWA, 0, None, None)
    kv_layer = max(s for s in c.kv_source_layer_ids if s <= i)
    index_layer = max(s for s in c.index_source_layer_ids if s <= i)
    if i in c.kv_source_layer_ids:
        mode = AttentionMode.FULL
    elif i in c.index_source_layer_ids:
        mode = AttentionMode.REINDEX
    else:
        mode = AttentionMode.REUSE
    return LayerSpec(i, role, mode, ratio, kv_layer, index_layer)
