"""On-disk format of one cached block: an 80-byte header and the block's bytes.

One file per block, named by its hash: `<root>/<hash[0:2]>/<hash>.kvb` (hex). Header, little endian:

| offset | bytes | field |
|-------:|------:|-------|
|      0 |     8 | magic `CEDKVBLK` |
|      8 |     2 | format version (1) |
|     10 |     2 | header bytes (80) |
|     12 |     4 | flags (0) |
|     16 |    16 | layout compatibility hash (`BlockLayout.compat_hash`) |
|     32 |    32 | block hash (the chained prefix hash) |
|     64 |     8 | payload bytes (= `block_bytes`) |
|     72 |     4 | crc32 of the payload |
|     76 |     4 | crc32 of header bytes 0-75 |

Writes go to a temporary name in the same folder and are renamed over the final name, so a reader
sees a whole file or none; a crash leaves a `*.tmp-*` file that the next scan deletes. Without
`fsync` a power loss can still leave a torn file under the final name: the payload checksum
catches it at read time and the file is dropped, never served.

A file is *corrupt* (deleted and counted) when its header or payload fails a check, and *foreign*
(left in place, ignored and counted) when it is intact but written for another layout or format
version.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from cedserve.model.cache.errors import CorruptBlockFileError

MAGIC = b"CEDKVBLK"
DISK_FORMAT_VERSION = 1
SUFFIX = ".kvb"
TMP_MARK = ".tmp-"
_HEADER = struct.Struct("<8sHHI16s32sQII")
HEADER_BYTES = _HEADER.size


@dataclass(frozen=True)
class BlockFileHeader:
    version: int
    layout_hash: bytes
    block_hash: bytes
    payload_bytes: int
    payload_crc32: int


def block_path(root: Path, block_hash: bytes) -> Path:
    name = block_hash.hex()
    return root / name[:2] / f"{name}{SUFFIX}"


def hash_from_path(path: Path) -> bytes | None:
    """The block hash a file name claims, or None if the name is not one of ours."""
    stem = path.name[: -len(SUFFIX)] if path.name.endswith(SUFFIX) else ""
    try:
        return bytes.fromhex(stem) if len(stem) == 64 else None
    except ValueError:
        return None


def encode_header(layout_hash: bytes, block_hash: bytes, payload: memoryview) -> bytes:
    head = _HEADER.pack(MAGIC, DISK_FORMAT_VERSION, HEADER_BYTES, 0, layout_hash, block_hash,
                        payload.nbytes, zlib.crc32(payload), 0)
    return head[:-4] + struct.pack("<I", zlib.crc32(head[:-4]))


def write_block_file(path: Path, layout_hash: bytes, block_hash: bytes, payload: npt.NDArray[np.uint8],
                     fsync: bool) -> int:
    """Write atomically (temp + rename); returns payload bytes. OS errors propagate."""
    data = _buffer(np.ascontiguousarray(payload))
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}-{threading.get_ident()}")
    fd = _create(tmp)
    try:
        try:
            header = encode_header(layout_hash, block_hash, data)
            written = os.writev(fd, [header, data])
            if written != len(header) + data.nbytes:
                raise OSError(f"short write to {tmp}: {written} bytes")
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(path.parent)
    return data.nbytes


def read_header(path: Path, layout_hash: bytes, block_bytes: int) -> BlockFileHeader:
    """Validate a file's header (and that its name matches it) against this layout, without reading
    the payload. `CorruptBlockFileError`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        header = _check_header(path, os.pread(fd, HEADER_BYTES, 0), os.fstat(fd).st_size, layout_hash, block_bytes)
    finally:
        os.close(fd)
    if hash_from_path(path) not in (None, header.block_hash):
        raise CorruptBlockFileError(str(path), "file name and header disagree on the block hash")
    return header


def read_block_file(path: Path, layout_hash: bytes, block_hash: bytes, block_bytes: int,
                    out: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.uint8]:
    """The verified payload `uint8 [block_bytes]`, read into `out` when given (whose bytes are then
    undefined if this raises). `CorruptBlockFileError` on any mismatch, `OSError` from the OS."""
    payload = np.empty(block_bytes, dtype=np.uint8) if out is None else out
    fd = os.open(path, os.O_RDONLY)
    try:
        header = _check_header(path, os.pread(fd, HEADER_BYTES, 0), os.fstat(fd).st_size, layout_hash, block_bytes)
        got = os.preadv(fd, [_buffer(payload)], HEADER_BYTES)
    finally:
        os.close(fd)
    if header.block_hash != block_hash:
        raise CorruptBlockFileError(str(path), "holds another block's hash")
    if got != block_bytes:
        raise CorruptBlockFileError(str(path), f"payload truncated: {got} of {block_bytes} bytes")
    if zlib.crc32(_buffer(payload)) != header.payload_crc32:
        raise CorruptBlockFileError(str(path), "payload checksum mismatch")
    return payload


def _check_header(path: Path, raw: bytes, size: int, layout_hash: bytes, block_bytes: int) -> BlockFileHeader:
    where = str(path)
    if len(raw) < HEADER_BYTES:
        raise CorruptBlockFileError(where, f"header truncated: {len(raw)} of {HEADER_BYTES} bytes")
    magic, version, header_bytes, _flags, layout, block_hash, payload_bytes, crc, header_crc = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise CorruptBlockFileError(where, "bad magic")
    if zlib.crc32(raw[:-4]) != header_crc:
        raise CorruptBlockFileError(where, "header checksum mismatch")
    if version != DISK_FORMAT_VERSION or header_bytes != HEADER_BYTES:
        raise CorruptBlockFileError(where, f"format version {version}, expected {DISK_FORMAT_VERSION}", foreign=True)
    if layout != layout_hash or payload_bytes != block_bytes:
        raise CorruptBlockFileError(where, "written for another block layout", foreign=True)
    if size != HEADER_BYTES + payload_bytes:
        raise CorruptBlockFileError(where, f"size {size}, expected {HEADER_BYTES + payload_bytes}")
    return BlockFileHeader(version, layout, block_hash, payload_bytes, crc)


def _create(path: Path) -> int:
    """Open a new file for writing, making the fan-out folder on first use (no mkdir call per file)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        return os.open(path, flags, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, flags, 0o644)


def _buffer(array: npt.NDArray[np.uint8]) -> memoryview:
    """Byte view of a contiguous uint8 array (numpy's stubs do not declare the buffer protocol)."""
    return memoryview(array.data).cast("B")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
