"""`cedserve inspect`: a model plan and its KV byte accounting, as a table or a dict."""

from __future__ import annotations

from typing import Any

from cedserve.model.config import AttentionMode, ModelConfig
from cedserve.model.kv_accounting import KVAccounting


def inspect_dict(config: ModelConfig, block_size: int) -> dict[str, Any]:
    acc = KVAccounting.from_config(config)
    return {
        "num_hidden_layers": config.num_hidden_layers,
        "num_encoder_layers": config.num_encoder_layers,
        "layer_plan": [
            {"layer": s.layer_id, "role": s.role.value, "mode": s.mode.value, "compress_ratio": s.compress_ratio,
             "kv_layer": s.kv_layer, "index_layer": s.index_layer}
            for s in config.layer_plan
        ],
        "global_kv_sources": [
            {"layer": s.layer_id, "compress_ratio": s.compress_ratio, "main_kv_record_bytes": s.main_kv_record_bytes,
             "index_key_record_bytes": s.index_key_record_bytes, "bytes_per_token": float(s.bytes_per_token)}
            for s in acc.sources
        ],
        "global_kv_bytes_per_token": float(acc.global_bytes_per_token),
        "swa_bytes_per_request": acc.swa_bytes_per_request,
        "draft_swa_bytes_per_request": acc.draft_swa_bytes_per_request,
        "block_size": block_size,
        "block_bytes": acc.block_bytes(block_size),
    }


def _fmt(value: float) -> str:
    return f"{value:g}"


def render_inspect(config: ModelConfig, block_size: int, source: str) -> str:
    acc = KVAccounting.from_config(config)
    lines = [f"model plan ({source}): {config.num_hidden_layers} layers, encoder 0-{config.num_encoder_layers - 1}, "
             f"decoder {config.num_encoder_layers}-{config.num_hidden_layers - 1}, "
             f"{config.num_nextn_predict_layers} DSpark draft layers", ""]
    lines.append("layer  role     mode     m  kv_from  index_from")
    for s in config.layer_plan:
        lines.append(f"{s.layer_id:>5}  {s.role.value:<7}  {s.mode.value:<7}  {s.compress_ratio}  "
                     f"{'-' if s.kv_layer is None else s.kv_layer:>7}  {'-' if s.index_layer is None else s.index_layer:>10}")
    modes = [s.mode for s in config.layer_plan]
    lines.append("modes: " + ", ".join(f"{m.value} x{modes.count(m)}" for m in AttentionMode))
    lines += ["", "global KV (stored only at KV-source layers):",
              "layer  m  main_kv_B  index_key_B  B/token"]
    for src in acc.sources:
        lines.append(f"{src.layer_id:>5}  {src.compress_ratio}  {src.main_kv_record_bytes:>9}  "
                     f"{src.index_key_record_bytes:>11}  {_fmt(float(src.bytes_per_token)):>7}")
    lines += [
        f"global KV per token: {_fmt(float(acc.global_bytes_per_token))} bytes",
        f"SWA state per request (bounded): {acc.swa_bytes_per_request:,} bytes "
        f"({config.num_hidden_layers} layers x {config.sliding_window} tokens x {acc.swa_record_bytes} B)"
        f" + {acc.draft_swa_bytes_per_request:,} bytes for the draft layers",
        f"paged block of {block_size} tokens: {acc.block_bytes(block_size):,} bytes",
        f"global KV at 1M tokens: {acc.global_bytes(1 << 20) / 2**30:.3f} GiB",
    ]
    return "\n".join(lines)
