"""The safetensors file format, read directly: header parsing and read-only memory maps of one
tensor's bytes, so a multi-gigabyte table can be served row by row without loading it.

Layout of a `.safetensors` file:

    [0, 8)            header length N, unsigned 64-bit little-endian
    [8, 8 + N)        JSON: {name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
                             "__metadata__": {..}}
    [8 + N, ...)      tensor bytes, row-major; a tensor occupies [8 + N + begin, 8 + N + end)
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, mis-shaped or in a format this loader cannot read."""


# safetensors dtype -> (numpy dtype of the raw bytes, torch dtype they reinterpret as)
RAW_DTYPES: dict[str, tuple[np.dtype[np.generic], torch.dtype]] = {
    "F32": (np.dtype(np.float32), torch.float32),
    "BF16": (np.dtype(np.int16), torch.bfloat16),
    "F8_E4M3": (np.dtype(np.uint8), torch.float8_e4m3fn),
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie in a safetensors file."""

    name: str
    path: Path
    dtype: str  # safetensors dtype name: "F32", "BF16", "F8_E4M3", ...
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the first element in the file
    nbytes: int


def _header_bytes(path: Path, file_size: int) -> bytes:
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path} is not a safetensors file: {file_size} bytes, no header length")
        (length,) = struct.unpack("<Q", prefix)
        if 8 + length > file_size:
            raise CheckpointError(f"{path} is truncated: its {length}-byte header runs past the file's end")
        return f.read(length)


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of one safetensors file, by name. Raises `CheckpointError` naming the file
    for a malformed header, and naming the tensor when its bytes run past the file's end."""
    path = Path(path)
    file_size = path.stat().st_size
    raw = _header_bytes(path, file_size)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from exc
    data_start = 8 + len(raw)
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        info = TensorInfo(name, path, entry["dtype"], tuple(entry["shape"]), data_start + begin, end - begin)
        if info.offset + info.nbytes > file_size:
            raise CheckpointError(
                f"tensor {name}: its bytes end at {info.offset + info.nbytes}, but {path} has only "
                f"{file_size} bytes (truncated checkpoint: copy it again)"
            )
        out[name] = info
    return out


RawArray = np.ndarray[tuple[int, ...], np.dtype[np.generic]]


def memmap_tensor(info: TensorInfo) -> RawArray:
    """A read-only numpy view, shaped `info.shape`, of the tensor's raw elements (see
    `RAW_DTYPES`) in a memory map of its byte range (`.base` is the `mmap.mmap`). Nothing is
    read until rows are indexed. The map is advised for random access: a lookup then reads the
    pages of its rows only, not a readahead window around each (128 KiB or more per 512-B row)."""
    if info.dtype not in RAW_DTYPES:
        raise CheckpointError(f"tensor {info.name}: dtype {info.dtype} cannot be memory-mapped; "
                              f"supported: {', '.join(RAW_DTYPES)}")
    raw_dtype = RAW_DTYPES[info.dtype][0]
    if int(np.prod(info.shape)) * raw_dtype.itemsize != info.nbytes:
        raise CheckpointError(f"tensor {info.name}: {info.nbytes} bytes do not hold {info.dtype} {list(info.shape)}")
    if info.nbytes == 0:
        return np.empty(info.shape, dtype=raw_dtype)
    start = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY  # map offsets must be aligned
    with info.path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), info.offset + info.nbytes - start, access=mmap.ACCESS_READ, offset=start)
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return np.ndarray(info.shape, dtype=raw_dtype, buffer=mapped, offset=info.offset - start)


def raw_to_torch(values: RawArray, dtype: str) -> Tensor:
    """Rows gathered from a memory map (an in-memory copy) as a torch tensor of the stored dtype."""
    return torch.from_numpy(np.ascontiguousarray(values)).view(RAW_DTYPES[dtype][1])
