"""The one opener for user files: regular files only, bounded (issue 42)."""

from __future__ import annotations

import os
import socket

import pytest

from flashnext.safetensors_file import sha256_file
from flashnext.user_files import UserFileError, open_user_file, read_user_file, read_user_text


def test_reads_a_regular_file_and_a_link_to_one(tmp_path, rng):
    data = rng.integers(0, 256, 5000, dtype="u1").tobytes()
    (tmp_path / "f").write_bytes(data)
    (tmp_path / "link").symlink_to(tmp_path / "f")
    assert read_user_file(tmp_path / "link") == data
    with open_user_file(tmp_path / "f") as fh:
        assert fh.read() == data


@pytest.mark.parametrize("kind, said", [("fifo", "a FIFO"), ("zero", "a device"),
                                        ("null", "a device"), ("directory", "a directory"),
                                        ("socket", "a socket")])  # fmt: skip
def test_refuses_what_is_not_a_file_by_what_it_is(tmp_path, kind, said):
    path = tmp_path / kind
    keep = None
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        keep = socket.socket(socket.AF_UNIX)
        keep.bind(str(path))
    else:
        path.symlink_to(f"/dev/{kind}")
    for read in (read_user_file, read_user_text, open_user_file, sha256_file):
        with pytest.raises(UserFileError, match=f"^{path}: {said}, not a regular file"):
            read(path)
    if keep is not None:
        keep.close()


def test_size_bound_and_text(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 101)
    assert len(read_user_file(tmp_path / "f", limit=101)) == 101
    with pytest.raises(UserFileError, match=r"101 bytes, more than the 100 read for the prompts"):
        read_user_file(tmp_path / "f", "the prompts", limit=100)
    (tmp_path / "g").write_bytes(b"ok \xff")
    with pytest.raises(UserFileError, match=r"not UTF-8 text \(byte 3\)"):
        read_user_text(tmp_path / "g", "--prompts")
    with pytest.raises(FileNotFoundError):
        read_user_file(tmp_path / "missing")
