"""`flashnext.safetensors_file` on its own: header validation, truncation, overflow, metadata,
the streaming writer and its sha256, against files written by the safetensors package."""

from __future__ import annotations

import hashlib
import json
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from flashnext.errors import FlashnextError, SafetensorsError
from flashnext.safetensors_file import (
    MAX_HEADER,
    read_header,
    read_tensor,
    sha256_file,
    write_file,
)


def _raw(path, header: object, data: bytes = b"", length: int | None = None) -> None:
    """A file with ``header`` as its JSON header (no validation: for broken files)."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(blob) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + blob + data)


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def test_round_trip_against_the_safetensors_package(tmp_path, rng):
    tensors = {
        "a": rng.standard_normal((7, 5)).astype(np.float32),
        "b": rng.integers(-(2**62), 2**62, size=(3,), dtype=np.int64),
        "c": rng.standard_normal((4, 3)).astype(np.float16),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    ours = tmp_path / "ours.safetensors"
    digest = write_file(ours, tensors, metadata={"k": "v"})
    assert digest == hashlib.sha256(ours.read_bytes()).hexdigest() == sha256_file(ours)
    back = load_file(ours)  # the reference reader accepts our bytes
    for name, value in tensors.items():
        np.testing.assert_array_equal(back[name], value)
    theirs = tmp_path / "theirs.safetensors"
    save_file(tensors, theirs, metadata={"k": "v"})
    header = read_header(theirs)  # and we accept theirs
    assert header.metadata == {"k": "v"} and header.file_size == theirs.stat().st_size
    for name, value in tensors.items():
        entry = header.tensors[name]
        assert entry.shape == value.shape and entry.nbytes == value.nbytes
        np.testing.assert_array_equal(read_tensor(entry, theirs, mmap=True), value)
        np.testing.assert_array_equal(read_tensor(entry, theirs, mmap=False), value)


def test_fp8_bf16_and_scalar_tensors(tmp_path, rng):
    x = rng.standard_normal((6, 16)).astype(np.float32)
    tensors = {
        "fp8": x.astype(ml_dtypes.float8_e4m3fn),
        "bf16": x.astype(ml_dtypes.bfloat16),
        "scale_2": np.array(0.5, dtype=np.float32),  # shape [] stays []
    }
    p = tmp_path / "t.safetensors"
    write_file(p, tensors)
    header = read_header(p)
    assert header.tensors["fp8"].dtype_name == "F8_E4M3"
    assert header.tensors["bf16"].dtype_name == "BF16"
    assert header.tensors["scale_2"].shape == ()
    assert header.data_start % 8 == 0  # data area 8-byte aligned
    for name, value in tensors.items():
        got = read_tensor(header.tensors[name], p)
        assert got.dtype == value.dtype
        assert got.shape == value.shape and got.tobytes() == value.tobytes()


def test_sha256_progress_counts_every_byte(tmp_path, rng):
    p = tmp_path / "big.safetensors"
    digest = write_file(p, {"x": rng.standard_normal((1000, 300)).astype(np.float32)})
    seen: list[int] = []
    assert sha256_file(p, chunk=100_000, progress=seen.append) == digest
    assert sum(seen) == p.stat().st_size and max(seen) == 100_000


def test_unsupported_dtype_writes_nothing(tmp_path):
    p = tmp_path / "bad.safetensors"
    with pytest.raises(SafetensorsError, match="tensor z: dtype complex64 has no safetensors"):
        write_file(p, {"z": np.zeros(3, dtype=np.complex64)})
    assert list(tmp_path.iterdir()) == []  # no file, no temporary left behind


def test_error_root():
    assert issubclass(SafetensorsError, FlashnextError) and issubclass(SafetensorsError, ValueError)


BROKEN = {
    "not JSON": (b"{not json", "header is not valid JSON"),
    "JSON array": ([1, 2], "header is not a JSON object"),
    "metadata array": ({"__metadata__": ["a"]}, "__metadata__ is a JSON list, expected an object"),
    "metadata string": ({"__metadata__": "x"}, "__metadata__ is a JSON str, expected an object"),
    "entry not an object": ({"t": [1]}, "tensor t: header entry is a JSON list"),
    "entry without dtype": ({"t": {"shape": [1]}}, "tensor t: malformed header entry"),
    "unknown dtype": ({"t": _entry(dtype="F7")}, "tensor t: unknown dtype 'F7'"),
    "negative dim": ({"t": _entry(shape=(-2,))}, "negative dimension in shape [-2]"),
    "size vs shape": ({"t": _entry(shape=(3,))}, "hold 8 bytes, expected 12 for F32 [3]"),
    "infinite dim": (
        b'{"t": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 8]}}',
        "malformed",
    ),
    "overflowing shape": (
        {"t": _entry(shape=(2**62, 2**62))},
        f"expected {2**124 * 4} for F32",  # computed exactly, never wrapped
    ),
    "gap": (
        {"a": _entry(offsets=(0, 8)), "b": _entry(offsets=(12, 20))},
        "tensor b starts at data offset 12, expected 8",
    ),
    "overlap": (
        {"a": _entry(offsets=(0, 8)), "b": _entry(offsets=(4, 12))},
        "tensor b starts at data offset 4, expected 8",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_header_is_named(tmp_path, case):
    header, message = BROKEN[case]
    p = tmp_path / "x.safetensors"
    _raw(p, header, data=b"\0" * 20)
    with pytest.raises(SafetensorsError) as err:
        read_header(p)
    assert str(err.value).startswith(f"{p}: ") and message in str(err.value)


def test_truncated_and_trailing(tmp_path, rng):
    p = tmp_path / "t.safetensors"
    write_file(p, {"x": rng.standard_normal(64).astype(np.float32)})
    data = p.read_bytes()
    p.write_bytes(data[:-1])
    with pytest.raises(SafetensorsError, match=r"file is \d+ bytes .* \(truncated\); re-download"):
        read_header(p)
    p.write_bytes(data + b"\0")
    with pytest.raises(SafetensorsError, match=r"\(trailing bytes\)"):
        read_header(p)
    p.write_bytes(data[:5])
    with pytest.raises(SafetensorsError, match="5 bytes, too short for a safetensors file"):
        read_header(p)
    p.write_bytes(data[:20])  # the header is cut
    with pytest.raises(SafetensorsError, match=r"header length .* exceeds the file"):
        read_header(p)


def test_header_length_limit(tmp_path):
    """A header length over the limit is refused before it is read (sparse file: no disk)."""
    p = tmp_path / "huge.safetensors"
    with open(p, "wb") as fh:
        fh.write(struct.pack("<Q", MAX_HEADER + 1))
        fh.truncate(MAX_HEADER + 100)
    with pytest.raises(SafetensorsError, match=f"header length {MAX_HEADER + 1} is over the"):
        read_header(p)
