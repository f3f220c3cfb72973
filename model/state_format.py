"""The bounded decode state as bytes: what a prefill worker ships so that a decode worker need not replay.

A decode worker continuing a sequence at `position` needs its global KV (in the paged blocks) and its
bounded state (DESIGN section 1, "What is bounded and what is not"). `BoundedState` is the latter:

* every layer's SWA window: the newest `sliding_window - 1` records, `uint8 [n, swa_record_bytes]`;
* every KV source's compressor partial group: float32 latent and gate, `[position % m, head_dim]`;
* the Engram history: compressed ids of the last `engram_max_ngram_size - 1` tokens, int64 `[n]`;
* optionally DSpark's taps for the first draft: the attention inputs of `dspark_target_layer_ids`
  averaged over the mHC streams at the last `n <= sliding_window` positions, `[n, n_taps, hidden]` in
  the model's dtype. That is `Drafter.context_vectors`' input, so a prefill worker needs no drafter
  weights; the decode worker turns the taps into the drafter's memory (bit for bit what its own
  pass would have given for the same taps).

Byte layout (little endian; every payload starts on a 16-byte boundary; zero padding):

| offset | bytes | field |
|-------:|------:|-------|
|      0 |     8 | magic `CEDSTATE` |
|      8 |     2 | format version (`STATE_FORMAT_VERSION`) |
|     10 |     2 | header bytes (64) |
|     12 |     4 | number of sections S |
|     16 |     8 | total bytes: header, section table and payloads |
|     24 |     8 | position (tokens the state has consumed) |
|     32 |    16 | geometry digest (`geometry_digest`): the model facts every section's shape derives from |
|     48 |     4 | crc32 of bytes [64, total) |
|     52 |    12 | zero |
|     64 | 32 x S | section table, one entry per section (below) |

Section entry (32 bytes): kind u16 (`Section`), layer u16 (0 where none), dtype u8 (`DTYPE_CODES`),
3 zero bytes, rows u32, row bytes u32, payload offset u64 (from byte 0), 8 zero bytes. A tensor's
payload is its rows back to back, each row the row-major bytes of `[*row shape]`.

Nothing here depends on the paged cache: not the block size, not how many ranks either side runs
(a request's state lives whole on one rank). The bytes travel in whatever blocks the receiver
reserved for them; `max_state_bytes` is what it reserves. `decode_state` checks everything against
the reader's own model before a byte is used: magic, version, total size against the region,
checksum, geometry, and every section's kind, layer, dtype, row size and row count; a failure raises
`StateFormatError` saying what differs. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch
from torch import Tensor

from cedserve.kernels.reference import swa_record_bytes
from cedserve.model.compressor import PendingGroup
from cedserve.model.config import AttentionMode, ModelConfig
from cedserve.model.state import SequenceState

STATE_FORMAT_VERSION = 1
"""Bumped whenever the meaning of the bytes changes; a reader refuses any other version."""
MAGIC = b"CEDSTATE"
ALIGN = 16
_HEADER = struct.Struct("<8sHHIQQ16sI12x")
_ENTRY = struct.Struct("<HHB3xIIQ8x")
HEADER_BYTES = _HEADER.size  # 64
ENTRY_BYTES = _ENTRY.size  # 32

DTYPE_CODES: dict[torch.dtype, int] = {torch.uint8: 1, torch.int64: 2, torch.float32: 3, torch.bfloat16: 4,
                                       torch.float16: 5}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class Section(IntEnum):
    SWA = 1
    """One layer's window records, uint8 `[n, swa_record_bytes]`."""
    PENDING_KV = 2
    """One KV source's partial group, projected latents, float32 `[position % m, head_dim]`."""
    PENDING_GATE = 3
    """The same group's gates, float32 `[position % m, head_dim]`."""
    ENGRAM_TAIL = 4
    """Compressed ids of the last tokens, int64 `[n]`."""
    DSPARK_TAPS = 5
    """Stream-averaged attention inputs of the tapped layers, `[n, n_taps, hidden]`, model dtype."""


class StateFormatError(ValueError):
    """Shipped state bytes that this reader cannot use; the message says what differs."""


@dataclass(frozen=True)
class BoundedState:
    """A sequence's bounded state at `position` (see the module docstring); tensors on any device."""

    position: int
    swa: dict[int, Tensor]  # layer -> uint8 [n, swa_record_bytes]
    pending: dict[int, PendingGroup]  # KV-source layer -> float32 [position % m, head_dim] x 2
    engram_tail: Tensor  # int64 [<= engram_max_ngram_size - 1]
    taps: Tensor | None = None  # [n, n_taps, hidden]: positions [position - n, position)

    @staticmethod
    def capture(state: SequenceState, taps: Tensor | None = None) -> BoundedState:
        """The bounded part of `state` (by reference), with the stream-averaged DSpark taps of its
        last positions if given."""
        pending = {layer: kv.pending for layer, kv in state.global_kv.items()}
        return BoundedState(state.position, dict(state.swa), pending, state.engram_tail, taps)

    def install(self, state: SequenceState) -> None:
        """Make `state` (global KV of the first `position` tokens already loaded) continue exactly
        where the shipped sequence stood."""
        device = state.engram_tail.device
        state.position = self.position
        state.swa = {layer: records.to(device) for layer, records in self.swa.items()}
        for layer, group in self.pending.items():
            state.global_kv[layer].pending = PendingGroup(group.kv.to(device), group.gate.to(device))
        state.engram_tail = self.engram_tail.to(device)

    @property
    def taps_first_position(self) -> int:
        return self.position - (0 if self.taps is None else int(self.taps.shape[0]))


@dataclass(frozen=True)
class _Spec:
    """What one section must look like for a model."""

    dtype: torch.dtype
    row_shape: tuple[int, ...]
    max_rows: int

    @property
    def row_bytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.row_shape:
            n *= d
        return n


def geometry_digest(config: ModelConfig) -> bytes:
    """16 bytes over the model facts the sections' shapes derive from (both sides must agree)."""
    sources = ",".join(f"{s.layer_id}:{s.compress_ratio}" for s in config.layer_plan if s.mode is AttentionMode.FULL)
    text = (f"cedserve-state/v{STATE_FORMAT_VERSION};layers={config.num_hidden_layers};"
            f"window={config.sliding_window};head_dim={config.head_dim};hidden={config.hidden_size};"
            f"sources={sources};engram_n={config.engram_max_ngram_size};taps={list(config.dspark_target_layer_ids)}")
    return hashlib.sha256(text.encode()).digest()[:16]


def taps_supported(config: ModelConfig) -> bool:
    """Whether a prefill worker can produce the taps: its decoder replay runs every tapped layer."""
    taps = config.dspark_target_layer_ids
    return bool(taps) and min(taps) >= config.num_encoder_layers


def _specs(config: ModelConfig, taps_dtype: torch.dtype | None) -> dict[tuple[Section, int], _Spec]:
    """Every section a state of `config` holds (taps only with a dtype), in file order."""
    window, dim = config.sliding_window, config.head_dim
    specs = {(Section.SWA, layer): _Spec(torch.uint8, (swa_record_bytes(dim),), window - 1)
             for layer in range(config.num_hidden_layers)}
    for spec in config.layer_plan:
        if spec.mode is AttentionMode.FULL:
            for kind in (Section.PENDING_KV, Section.PENDING_GATE):
                specs[(kind, spec.layer_id)] = _Spec(torch.float32, (dim,), spec.compress_ratio - 1)
    specs[(Section.ENGRAM_TAIL, 0)] = _Spec(torch.int64, (), config.engram_max_ngram_size - 1)
    if taps_dtype is not None:
        specs[(Section.DSPARK_TAPS, 0)] = _Spec(taps_dtype, (len(config.dspark_target_layer_ids), config.hidden_size),
                                                window)
    return specs


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def max_state_bytes(config: ModelConfig, taps_dtype: torch.dtype | None = None) -> int:
    """Largest encoding of a state of `config` (with taps of `taps_dtype` when given): what a receiver
    reserves. Every section is at most `max_rows` long, whatever the position."""
    specs = _specs(config, taps_dtype)
    payload = sum(_align(s.max_rows * s.row_bytes) for s in specs.values())
    return _align(HEADER_BYTES + ENTRY_BYTES * len(specs)) + payload


def _tensors(state: BoundedState) -> dict[tuple[Section, int], Tensor]:
    out: dict[tuple[Section, int], Tensor] = {(Section.SWA, layer): t for layer, t in state.swa.items()}
    for layer, group in state.pending.items():
        out[(Section.PENDING_KV, layer)] = group.kv
        out[(Section.PENDING_GATE, layer)] = group.gate
    out[(Section.ENGRAM_TAIL, 0)] = state.engram_tail
    if state.taps is not None:
        out[(Section.DSPARK_TAPS, 0)] = state.taps
    return out


def encode_state(state: BoundedState, config: ModelConfig) -> bytes:
    """The bytes of `state` (see the module docstring). `ValueError` if `state` does not fit `config`'s
    shapes (a caller bug: the reader would refuse it)."""
    taps_dtype = None if state.taps is None else state.taps.dtype
    specs = _specs(config, taps_dtype)
    tensors = _tensors(state)
    if set(tensors) != set(specs):
        raise ValueError(f"state sections {sorted(tensors)} do not match the model's {sorted(specs)}")
    table_end = _align(HEADER_BYTES + ENTRY_BYTES * len(specs))
    entries, payloads, offset = [], [], table_end
    for key, spec in specs.items():
        t = tensors[key].detach()
        rows = int(t.shape[0])
        if t.dtype != spec.dtype or tuple(t.shape[1:]) != spec.row_shape:
            raise ValueError(f"section {key[0].name} layer {key[1]}: {t.dtype} {list(t.shape)}, expected "
                             f"{spec.dtype} [n, {', '.join(map(str, spec.row_shape))}]")
        data = t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        entries.append(_ENTRY.pack(key[0], key[1], DTYPE_CODES[spec.dtype], rows, spec.row_bytes, offset))
        payloads.append(data + bytes(_align(len(data)) - len(data)))
        offset += _align(len(data))
    body = b"".join(entries) + bytes(table_end - HEADER_BYTES - ENTRY_BYTES * len(specs)) + b"".join(payloads)
    header = _HEADER.pack(MAGIC, STATE_FORMAT_VERSION, HEADER_BYTES, len(specs), HEADER_BYTES + len(body),
                          state.position, geometry_digest(config), zlib.crc32(body))
    return header + body


def decode_state(data: bytes | np.ndarray, config: ModelConfig, taps_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> BoundedState:
    """Parse and check shipped state bytes against this reader's model. `data` may be longer than the
    encoding (the reserved region); `taps_dtype` is the dtype expected for the DSpark taps, None when
    none are expected. Raises `StateFormatError` naming what is wrong."""
    buf = np.ascontiguousarray(data) if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    if buf.dtype != np.uint8 or buf.ndim != 1:
        raise StateFormatError(f"state bytes must be a flat uint8 buffer, got {buf.dtype} {buf.shape}")
    position, count, total = _read_header(buf, config)
    specs = _specs(config, taps_dtype)
    if count != len(specs):
        raise StateFormatError(f"{count} sections, this reader expects {len(specs)} "
                               f"({'with' if taps_dtype is not None else 'without'} DSpark taps)")
    tensors: dict[tuple[Section, int], Tensor] = {}
    end = _align(HEADER_BYTES + ENTRY_BYTES * count)
    for i in range(count):
        kind, layer, code, rows, row_bytes, offset = _ENTRY.unpack_from(buf.data, HEADER_BYTES + ENTRY_BYTES * i)
        key, spec = _check_entry(specs, kind, layer, code, rows, row_bytes, position)
        if key in tensors:
            raise StateFormatError(f"section {key[0].name} layer {layer} appears twice")
        nbytes = rows * row_bytes
        if offset % ALIGN or offset < end or offset + nbytes > total:
            raise StateFormatError(f"section {key[0].name} layer {layer}: payload [{offset}, {offset + nbytes}) "
                                   f"is not aligned, overlaps the previous one or leaves the {total} bytes")
        end = offset + nbytes
        raw = torch.from_numpy(buf[offset:offset + nbytes].copy())
        values = raw.view(spec.dtype) if nbytes else torch.empty(0, dtype=spec.dtype)
        tensors[key] = values.reshape(rows, *spec.row_shape).to(device)
    return _assemble(position, tensors, config)


def _read_header(buf: np.ndarray, config: ModelConfig) -> tuple[int, int, int]:
    """(position, sections, total bytes) after checking magic, version, size, checksum, geometry."""
    if buf.size < HEADER_BYTES:
        raise StateFormatError(f"state region of {buf.size} bytes is shorter than the {HEADER_BYTES}-byte header")
    magic, version, header_bytes, count, total, position, digest, crc = _HEADER.unpack_from(buf.data, 0)
    if magic != MAGIC:
        raise StateFormatError(f"not a shipped state (magic {magic!r}, expected {MAGIC!r})")
    if version != STATE_FORMAT_VERSION:
        raise StateFormatError(f"state format version {version}; this worker reads version {STATE_FORMAT_VERSION}")
    if header_bytes != HEADER_BYTES:
        raise StateFormatError(f"header of {header_bytes} bytes, expected {HEADER_BYTES}")
    if total > buf.size or total < HEADER_BYTES + ENTRY_BYTES * count:
        raise StateFormatError(f"state of {total} bytes does not fit the {buf.size}-byte region it arrived in "
                               f"(or is shorter than its own section table)")
    if zlib.crc32(buf[HEADER_BYTES:total].tobytes()) != crc:
        raise StateFormatError(f"checksum mismatch over bytes [{HEADER_BYTES}, {total}): the state is corrupt")
    if digest != geometry_digest(config):
        raise StateFormatError("geometry digest differs: the sender's model has other layers, window, head "
                               "sizes, KV sources, Engram n-gram size or DSpark taps than this worker's")
    return position, count, total


def _check_entry(specs: dict[tuple[Section, int], _Spec], kind: int, layer: int, code: int, rows: int,
                 row_bytes: int, position: int) -> tuple[tuple[Section, int], _Spec]:
    try:
        key = (Section(kind), layer)
    except ValueError:
        raise StateFormatError(f"unknown section kind {kind} (layer {layer})") from None
    spec = specs.get(key)
    name = f"section {key[0].name} layer {layer}"
    if spec is None:
        raise StateFormatError(f"{name} is not expected by this reader's model and settings")
    if _DTYPES.get(code) != spec.dtype:
        raise StateFormatError(f"{name}: dtype code {code} ({_DTYPES.get(code)}), expected {spec.dtype}")
    if row_bytes != spec.row_bytes:
        raise StateFormatError(f"{name}: rows of {row_bytes} bytes, expected {spec.row_bytes}")
    if key[0] in (Section.PENDING_KV, Section.PENDING_GATE):
        if rows != position % (spec.max_rows + 1):
            raise StateFormatError(f"{name}: {rows} pending tokens at position {position}, expected "
                                   f"{position % (spec.max_rows + 1)}")
    elif rows > min(spec.max_rows, position):
        raise StateFormatError(f"{name}: {rows} rows, at most {min(spec.max_rows, position)} at position {position}")
    return key, spec


def _assemble(position: int, tensors: dict[tuple[Section, int], Tensor], config: ModelConfig) -> BoundedState:
    swa = {layer: t for (kind, layer), t in tensors.items() if kind is Section.SWA}
    pending = {layer: PendingGroup(t, tensors[(Section.PENDING_GATE, layer)])
               for (kind, layer), t in tensors.items() if kind is Section.PENDING_KV}
    return BoundedState(position, swa, pending, tensors[(Section.ENGRAM_TAIL, 0)],
                        tensors.get((Section.DSPARK_TAPS, 0)))
