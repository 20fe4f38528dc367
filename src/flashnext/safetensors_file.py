"""Read and write safetensors files at the byte level, validating before trusting.

Layout (the safetensors spec): 8-byte little-endian header length ``N``; ``N`` bytes of JSON
mapping tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative
to the data area, which starts at ``8 + N``) plus an optional ``"__metadata__"`` of strings;
then the data area. :func:`read_header` checks that every tensor's byte size matches its shape
and dtype, that the offsets tile the data area without gaps or overlaps, and that the file is
exactly as long as the header says (a truncated download fails here, naming the file).

We write the files ourselves rather than through ``safetensors.numpy`` so a shard streams to
disk with its sha256 computed on the way, and so fp8 tensors (which ``safetensors.numpy``
cannot load) read back as numpy arrays through ml_dtypes.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from flashnext.atomic import atomic_write
from flashnext.errors import SafetensorsError
from flashnext.user_files import open_user_file

#: safetensors dtype names -> numpy dtypes.
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


def dtype_name(dtype: np.dtype) -> str:
    """The safetensors name of a numpy dtype ("BF16", "F8_E4M3", ...), else ``str(dtype)``."""
    return _NAMES.get(np.dtype(dtype), str(dtype))


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are and what they mean."""

    name: str
    dtype_name: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the first element in the file
    nbytes: int

    @property
    def dtype(self) -> np.dtype:
        return DTYPES[self.dtype_name]


@dataclass(frozen=True)
class Header:
    """A parsed, validated safetensors header."""

    path: Path
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def read_header(path: str | os.PathLike[str]) -> Header:
    """Parse and validate the header of ``path`` without reading tensor data.

    Raises:
        SafetensorsError: the file is too short, the header is not a JSON object, its
            ``__metadata__`` is not an object, a dtype is unknown, a tensor's byte range
            disagrees with its shape, the ranges leave gaps or overlap, or the file is shorter
            or longer than the header says (truncated download).
        OSError: the file cannot be read.
    """
    p = Path(path)
    mode = p.stat().st_mode
    if not stat.S_ISREG(mode):  # a FIFO or device has no size: not "truncated", not ours to read
        raise SafetensorsError(
            f"{p}: not a regular file (a FIFO, device, socket or directory is never read); "
            "a safetensors file is a file: replace it with the real one"
        )
    size = p.stat().st_size
    doc, n = _read_json_header(p, size)
    meta = doc.pop("__metadata__", None)
    if meta is None:
        meta = {}
    elif not isinstance(meta, dict):
        raise SafetensorsError(
            f"{p}: __metadata__ is a JSON {type(meta).__name__}, expected an object of strings; "
            "the file was not written by a safetensors writer: re-write it"
        )
    data_start = 8 + n
    entries = {name: _parse_entry(p, name, info, data_start) for name, info in doc.items()}
    data_end = _check_tiling(p, entries, data_start)
    if data_end != size:
        raise SafetensorsError(
            f"{p}: file is {size} bytes but its header describes {data_end} "
            f"({'truncated' if size < data_end else 'trailing bytes'}); "
            "re-download or re-write this file"
        )
    return Header(p, entries, {str(k): str(v) for k, v in meta.items()}, data_start, size)


def _read_json_header(p: Path, size: int) -> tuple[dict[str, Any], int]:
    """The header's JSON object and its length ``N`` (bounded before it is read)."""
    if size < 8:
        raise SafetensorsError(f"{p}: {size} bytes, too short for a safetensors file (truncated?)")
    with open(p, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > size - 8:
            raise SafetensorsError(
                f"{p}: header length {n} exceeds the file ({size} bytes): truncated or not safetensors"
            )
        if n > MAX_HEADER:
            raise SafetensorsError(
                f"{p}: header length {n} is over the {MAX_HEADER}-byte limit: not a safetensors file"
            )
        raw = fh.read(n)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise SafetensorsError(f"{p}: header is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise SafetensorsError(f"{p}: header is not a JSON object")
    return doc, n


def _parse_entry(p: Path, name: str, info: object, data_start: int) -> TensorEntry:
    """One tensor's entry, its byte size checked (exactly, in Python ints) against its shape."""
    if not isinstance(info, dict):
        raise SafetensorsError(
            f"{p}: tensor {name}: header entry is a JSON {type(info).__name__}, expected an "
            "object with dtype, shape and data_offsets"
        )
    try:
        dtype_name = info["dtype"]
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(v) for v in info["data_offsets"])
    except (KeyError, TypeError, ValueError, OverflowError):
        raise SafetensorsError(f"{p}: tensor {name}: malformed header entry {info!r}") from None
    if dtype_name not in DTYPES:
        raise SafetensorsError(f"{p}: tensor {name}: unknown dtype {dtype_name!r}")
    if any(d < 0 for d in shape):
        raise SafetensorsError(f"{p}: tensor {name}: negative dimension in shape {list(shape)}")
    expect = int(np.prod(shape, dtype=object)) * DTYPES[dtype_name].itemsize
    if end - begin != expect or begin < 0:
        raise SafetensorsError(
            f"{p}: tensor {name}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
            f"expected {expect} for {dtype_name} {list(shape)}"
        )
    return TensorEntry(name, dtype_name, shape, data_start + begin, expect)


def _check_tiling(p: Path, entries: dict[str, TensorEntry], data_start: int) -> int:
    """Check that the tensors tile the data area without gaps or overlaps; return its end."""
    pos = 0
    for entry in sorted(entries.values(), key=lambda e: (e.offset, e.offset + e.nbytes)):
        begin = entry.offset - data_start
        if begin != pos:
            raise SafetensorsError(
                f"{p}: tensor {entry.name} starts at data offset {begin}, expected {pos} "
                "(tensors must tile the data area without gaps or overlaps)"
            )
        pos = begin + entry.nbytes
    return data_start + pos


def read_tensor(entry: TensorEntry, path: str | os.PathLike[str], mmap: bool = True) -> np.ndarray:
    """The tensor's data: a read-only memory map (zero-copy) or an in-memory copy."""
    if mmap:
        if entry.nbytes == 0:
            return np.empty(entry.shape, dtype=entry.dtype)
        return np.memmap(path, dtype=entry.dtype, mode="r", offset=entry.offset, shape=entry.shape)
    count = int(np.prod(entry.shape, dtype=np.int64))
    arr = np.fromfile(path, dtype=entry.dtype, count=count, offset=entry.offset)
    return arr.reshape(entry.shape)


def write_file(
    path: str | os.PathLike[str],
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> str:
    """Write ``tensors`` (in the given order) to ``path`` atomically; return the file's sha256.

    Raises:
        SafetensorsError: a tensor's dtype has no safetensors name.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    pos = 0
    arrays = []
    for name, value in tensors.items():
        # np.ascontiguousarray would turn a scalar [] into [1]; the card's scale_2 is [].
        arr = np.require(np.asarray(value), requirements="C")
        if arr.dtype not in _NAMES:
            raise SafetensorsError(
                f"{path}: tensor {name}: dtype {arr.dtype} has no safetensors name"
            )
        header[name] = {
            "dtype": _NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [pos, pos + arr.nbytes],
        }
        pos += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data area starts 8-byte aligned
    digest = hashlib.sha256()
    with atomic_write(path) as fh:
        chunks: list[bytes | np.ndarray] = [struct.pack("<Q", len(blob)), blob]
        chunks += [a.reshape(-1).view(np.uint8) for a in arrays]
        for chunk in chunks:
            data = chunk if isinstance(chunk, bytes) else chunk.data
            digest.update(data)
            fh.write(data)
    return digest.hexdigest()


def hash_file(
    path: str | os.PathLike[str], digest: Any, chunk: int = 8 << 20, progress=None
) -> str:
    """Feed a file to the hashlib object ``digest`` in ``chunk``-byte pieces; return the hex digest.

    ``progress(n)`` is called per piece. hashlib releases the GIL, so threads hash in parallel.
    Only a regular file is read (:func:`flashnext.user_files.open_user_file`: a shard linked to
    /dev/zero or a FIFO is refused), and no more than its size when it was opened.

    Raises:
        UserFileError: not a regular file.
        OSError: missing or unreadable.
    """
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open_user_file(path, "a file to hash") as fh:
        left = os.fstat(fh.fileno()).st_size
        while left > 0:
            got = fh.readinto(view[: min(chunk, left)])
            if not got:
                break
            left -= got
            digest.update(view[:got])
            if progress is not None:
                progress(got)
    return digest.hexdigest()


def sha256_file(path: str | os.PathLike[str], chunk: int = 8 << 20, progress=None) -> str:
    """sha256 of a file, read in ``chunk``-byte pieces; ``progress(n)`` is called per piece."""
    return hash_file(path, hashlib.sha256(), chunk, progress)
