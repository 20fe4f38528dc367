"""Verify a Hugging Face snapshot on disk: is the download complete and intact?

A progress counter is not evidence that a 186 GB download finished. :func:`verify_snapshot`
checks what can be checked without the network:

- ``config.json`` is there and parses;
- the weights are described by ``model.safetensors.index.json`` (or are one
  ``model.safetensors``); every file the index names exists;
- no partial download is left over (``*.incomplete`` anywhere under the directory, including
  ``.cache/huggingface/download/`` of ``hf download --local-dir`` and ``blobs/`` of the cache);
- every safetensors header parses and its data size equals the file size (truncation);
- the index's tensor-to-file map agrees with the headers, both ways;
- optionally (``hash=True``) each file's sha256 (git-sha1 for small non-LFS files) against
  the value the snapshot records.

Where the expected hashes come from
-----------------------------------
- ``hf download --local-dir DIR`` leaves ``DIR/.cache/huggingface/download/<file>.metadata``,
  three lines: commit hash, etag, timestamp. For LFS files the etag is the file's sha256
  (64 hex digits); for small files it is the git blob sha1 (40 hex digits),
  ``sha1(b"blob <size>\\0" + content)``.
- The hub cache (``models--org--name/snapshots/<rev>/<file>`` -> ``../../blobs/<hash>``) names
  each blob by that same etag, so the symlink target is the expected hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from flashnext import hub_cache
from flashnext.checkpoint.config import read_config
from flashnext.errors import CheckpointError
from flashnext.records import CHECKPOINT_VERIFY
from flashnext.safetensors_file import SafetensorsError, TensorEntry, hash_file, read_header
from flashnext.user_files import UserFileError

RECORD_KIND = CHECKPOINT_VERIFY
SCHEMA_VERSION = 1
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
HF_META_DIR = Path(".cache") / "huggingface" / "download"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX40 = re.compile(r"^[0-9a-f]{40}$")

Severity = Literal["error", "warning"]


@dataclass
class Finding:
    """One thing wrong (``error``: the snapshot is not complete) or odd (``warning``)."""

    severity: Severity
    file: str  # path relative to the snapshot root, or "-" for the snapshot as a whole
    message: str


@dataclass
class FileCheck:
    """What was found for one file of the snapshot."""

    file: str
    size: int
    tensors: int | None = None  # safetensors files: tensors in the header
    expected: str | None = None  # expected sha256 / git-sha1 hex digest
    expected_from: str | None = None  # where ``expected`` was read
    algorithm: str | None = None  # "sha256" | "git-sha1"
    digest: str | None = None  # computed (only with hash=True)
    hash_ok: bool | None = None


@dataclass
class VerifyReport:
    """Result of :func:`verify_snapshot`; ``ok`` is True only for a complete snapshot."""

    root: Path
    layout: str  # "local-dir" (hf download --local-dir), "hf-cache", or "plain"
    weights: str  # "index" | "single" | "none"
    files: list[FileCheck] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    hashed: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    def error(self, file: str, message: str) -> None:
        self.findings.append(Finding("error", file, message))

    def warn(self, file: str, message: str) -> None:
        self.findings.append(Finding("warning", file, message))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready payload of the ``flashnext.checkpoint.verify`` record (version
        :data:`SCHEMA_VERSION`)."""
        return {
            "root": str(self.root),
            "layout": self.layout,
            "weights": self.weights,
            "ok": self.ok,
            "hashed": self.hashed,
            "seconds": round(self.seconds, 3),
            "total_bytes": sum(f.size for f in self.files),
            "files": [asdict(f) for f in self.files],
            "findings": [asdict(f) for f in self.findings],
        }


# -- locating the snapshot --------------------------------------------------------------------


def resolve_snapshot(path: str | os.PathLike[str]) -> tuple[Path, str]:
    """The snapshot directory to check and its layout.

    ``path`` may be a plain or ``--local-dir`` download, a cache snapshot
    (``models--org--name/snapshots/<rev>``), or the cache repo folder ``models--org--name``
    (then ``refs/main`` picks the revision, or the only snapshot there is).

    Raises:
        CheckpointError: ``path`` is not a directory, or a cache repo folder has no or several
            snapshots and no ``refs/main``.
    """
    root = Path(path)
    if not root.is_dir():
        what = "not a directory" if root.exists() else "does not exist"
        raise CheckpointError(f"{root}: {what} (expected a downloaded model snapshot)")
    if hub_cache.is_repo_folder(root):
        return hub_cache.main_snapshot(root), "hf-cache"
    if hub_cache.is_snapshot(root):
        return root, "hf-cache"
    if (root / HF_META_DIR).is_dir():
        return root, "local-dir"
    return root, "plain"


def _rel(root: Path, p: Path) -> str:
    return p.relative_to(root).as_posix()


def _snapshot_files(root: Path) -> list[Path]:
    """Every file under ``root`` except the ``.cache`` bookkeeping, sorted."""
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here == root:
            dirnames[:] = [d for d in dirnames if d != ".cache"]
        dirnames.sort()
        out.extend(here / f for f in filenames)
    return sorted(out)


def _incomplete_files(root: Path, layout: str) -> list[Path]:
    places = [root]
    if layout == "hf-cache":
        places.append(hub_cache.blobs_of(root))
    found: list[Path] = []
    for place in places:
        for dirpath, _dirs, filenames in os.walk(place):
            found.extend(Path(dirpath) / f for f in filenames if f.endswith(".incomplete"))
    return sorted(found)


def _read_hf_metadata(path: Path) -> tuple[str, str, float] | None:
    """``(commit, etag, timestamp)`` from a ``hf download --local-dir`` ``.metadata`` file."""
    try:
        lines = path.read_text().splitlines()
        return lines[0].strip(), lines[1].strip(), float(lines[2].strip())
    except (OSError, UnicodeDecodeError, IndexError, ValueError):
        return None


def _algorithm(digest: str) -> str | None:
    if _HEX64.match(digest):
        return "sha256"
    if _HEX40.match(digest):
        return "git-sha1"
    return None


def file_digest(
    path: str | os.PathLike[str],
    algorithm: str,
    progress: Callable[[int], None] | None = None,
    chunk: int = 8 << 20,
) -> str:
    """Hex digest of a file: ``sha256`` of its bytes, or ``git-sha1`` (git's blob hash).

    ``progress(n)`` is called after each ``chunk``-byte piece. Raises ``OSError``.
    """
    p = Path(path)
    if algorithm == "sha256":
        digest = hashlib.sha256()
    elif algorithm == "git-sha1":
        digest = hashlib.sha1()
        digest.update(b"blob %d\0" % p.stat().st_size)
    else:
        raise CheckpointError(f"unknown hash algorithm {algorithm!r}")
    return hash_file(p, digest, chunk, progress)


# -- the checks -------------------------------------------------------------------------------


def verify_snapshot(
    path: str | os.PathLike[str],
    *,
    hash: bool = False,
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check that the snapshot at ``path`` is complete (see the module docstring).

    Args:
        path: snapshot directory (any layout accepted by :func:`resolve_snapshot`).
        hash: also hash every file that has an expected digest and compare.
        workers: hashing threads (default: CPU count, at most 8).
        progress: ``progress(done_bytes, total_bytes)`` while hashing, from any thread.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is False when anything is missing or corrupt.

    Raises:
        CheckpointError: ``path`` is not a directory (everything else is reported, not raised).
    """
    t0 = time.perf_counter()
    root, layout = resolve_snapshot(path)
    report = VerifyReport(root=root, layout=layout, weights="none")
    on_disk = _snapshot_files(root)
    checks: dict[str, FileCheck] = {}
    for p in on_disk:
        rel = _rel(root, p)
        if rel.endswith(".incomplete"):
            continue
        if not p.exists():  # a dangling cache symlink: the blob never arrived
            report.error(
                rel,
                f"symlink to {os.readlink(p)} is dangling: the blob is missing; re-download",
            )
            continue
        checks[rel] = FileCheck(file=rel, size=p.stat().st_size)

    for p in _incomplete_files(root, layout):
        where = _rel(root, p) if p.is_relative_to(root) else str(p)
        report.error(
            where,
            f"partial download left over ({p.stat().st_size} bytes): the download did not "
            "finish; re-run the download, then verify again",
        )

    _check_config(root, report)
    _check_weights(root, report, checks)
    _expected_hashes(root, layout, report, checks)
    report.files = [checks[k] for k in sorted(checks)]
    if hash:
        _hash_files(root, report, workers, progress)
    report.seconds = time.perf_counter() - t0
    return report


def _check_config(root: Path, report: VerifyReport) -> None:
    if not (root / CONFIG_NAME).exists():
        report.error(CONFIG_NAME, "missing: every model snapshot needs config.json")
        return
    try:
        read_config(root)
    except CheckpointError as exc:
        report.error(CONFIG_NAME, str(exc).removeprefix(f"{root / CONFIG_NAME}: "))


def _load_index(root: Path, report: VerifyReport) -> dict[str, str] | None:
    """The index's tensor -> file map, or None (with an error in ``report``) when it cannot be
    read or names a file outside the snapshot."""
    p = root / INDEX_NAME
    try:
        doc = json.loads(p.read_text())
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise TypeError("weight_map must map tensor names to file names")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        report.error(
            INDEX_NAME, f"cannot read the tensor-to-file map ({exc!s}); re-download the index"
        )
        return None
    for tensor, fname in weight_map.items():
        if not _inside_snapshot(fname):
            report.error(
                INDEX_NAME,
                f"entry {tensor!r} names the file {fname!r}, which is outside the snapshot; "
                "an index may only name files inside its own directory: re-download the index",
            )
            return None
    return weight_map


def _inside_snapshot(name: str) -> bool:
    """Whether an index file name stays inside the snapshot (relative, no ``..``)."""
    parts = PurePosixPath(name).parts
    return bool(parts) and not name.startswith("/") and ".." not in parts


def _check_weights(root: Path, report: VerifyReport, checks: dict[str, FileCheck]) -> None:
    """Weights: which files should exist, their headers, and index/header agreement."""
    found = _named_weight_files(root, report, checks)
    if found is None:
        return
    weight_map, named = found
    headers = _read_headers(root, report, checks, named, weight_map)
    for name in sorted(k for k in checks if k.endswith(".safetensors")):
        if name not in named:
            report.warn(
                name,
                f"not named by {INDEX_NAME if weight_map is not None else 'the snapshot'}: "
                "loaders ignore it (a leftover from another revision?)",
            )
    if weight_map is not None:
        # A loader trusts the index to find a tensor, then loads every tensor of each file it
        # names: the two must agree both ways.
        _index_entries_in_headers(report, weight_map, headers)
        _header_tensors_in_index(report, weight_map, headers)


def _named_weight_files(
    root: Path, report: VerifyReport, checks: dict[str, FileCheck]
) -> tuple[dict[str, str] | None, list[str]] | None:
    """``(index map or None for a single file, the weight files that should exist)``; None
    (with an error reported) when the weights cannot even be listed. Sets ``report.weights``."""
    if (root / INDEX_NAME).exists():
        report.weights = "index"
        weight_map = _load_index(root, report)
        return None if weight_map is None else (weight_map, sorted(set(weight_map.values())))
    if (root / SINGLE_NAME).exists() or SINGLE_NAME in checks:
        report.weights = "single"
        return None, [SINGLE_NAME]
    others = sum(1 for k in checks if k.endswith(".safetensors"))
    report.error(
        "-",
        f"no {INDEX_NAME} and no {SINGLE_NAME}: the weights are missing "
        + (f"(found {others} other .safetensors files) " if others else "")
        + "; re-download",
    )
    return None


def _read_headers(
    root: Path,
    report: VerifyReport,
    checks: dict[str, FileCheck],
    named: list[str],
    weight_map: dict[str, str] | None,
) -> dict[str, dict[str, TensorEntry]]:
    """The header of every named file that exists and parses; the others are reported."""
    headers: dict[str, dict[str, TensorEntry]] = {}
    for name in named:
        if name not in checks and (root / name).exists():  # a directory where a file goes
            report.error(name, f"{root / name}: not a regular file (a FIFO, device, socket or "
                         "directory is never read); replace it with the real file")  # fmt: skip
            continue
        if name not in checks:
            report.error(
                name,
                f"missing: named by {INDEX_NAME if weight_map is not None else 'the snapshot'} "
                f"({sum(1 for v in (weight_map or {}).values() if v == name)} tensors); "
                "re-download this file",
            )
            continue
        try:
            header = read_header(root / name)
        except SafetensorsError as exc:
            report.error(name, str(exc))
            continue
        except OSError as exc:
            report.error(name, f"cannot read ({exc.strerror or exc}); check its mode")
            continue
        headers[name] = header.tensors
        checks[name].tensors = len(header.tensors)
    return headers


def _index_entries_in_headers(
    report: VerifyReport, weight_map: dict[str, str], headers: dict[str, dict[str, TensorEntry]]
) -> None:
    """Every tensor the index places in a readable file is in that file's header."""
    misplaced: dict[tuple[str, str], list[str]] = {}
    absent: dict[str, list[str]] = {}
    where: dict[str, str] = {}
    for fname, tensors in headers.items():
        for t in tensors:
            where.setdefault(t, fname)
    for tensor, fname in weight_map.items():
        if fname not in headers:
            continue  # missing or unreadable file: already reported
        if tensor not in headers[fname]:
            if tensor in where:
                misplaced.setdefault((fname, where[tensor]), []).append(tensor)
            else:
                absent.setdefault(fname, []).append(tensor)
    for (fname, actual), moved in sorted(misplaced.items()):
        report.error(
            fname,
            f"{INDEX_NAME} places {len(moved)} tensor(s) here that the header does not hold; "
            f"they are in {actual} (e.g. {moved[0]}): the index and the shards come from "
            "different revisions; re-download both",
        )
    for fname, phantom in sorted(absent.items()):
        report.error(
            fname,
            f"{INDEX_NAME} places {len(phantom)} tensor(s) here that no file holds "
            f"(e.g. {phantom[0]}); re-download this file and the index",
        )


def _header_tensors_in_index(
    report: VerifyReport, weight_map: dict[str, str], headers: dict[str, dict[str, TensorEntry]]
) -> None:
    """Every tensor a header holds is placed in that file by the index."""
    for fname, tensors in headers.items():
        extra = [t for t in tensors if weight_map.get(t) != fname]
        if not extra:
            continue
        elsewhere = (
            f", which the index places in {weight_map[extra[0]]}" if extra[0] in weight_map else ""
        )
        report.error(
            fname,
            f"header holds {len(extra)} tensor(s) that {INDEX_NAME} does not place in this "
            f"file (e.g. {extra[0]}{elsewhere}): the index and the shards disagree; "
            "re-download both",
        )


def _expected_hashes(
    root: Path, layout: str, report: VerifyReport, checks: dict[str, FileCheck]
) -> None:
    if layout == "hf-cache":
        for rel, check in checks.items():
            p = root / rel
            if p.is_symlink():
                blob = Path(os.readlink(p)).name
                algo = _algorithm(blob)
                if algo:
                    check.expected, check.algorithm = blob, algo
                    check.expected_from = f"blob name {blob[:12]}..."
        return
    meta_dir = root / HF_META_DIR
    if not meta_dir.is_dir():
        return
    for dirpath, _dirs, filenames in os.walk(meta_dir):
        for fname in filenames:
            if not fname.endswith(".metadata"):
                continue
            mpath = Path(dirpath) / fname
            rel = _rel(meta_dir, mpath)[: -len(".metadata")]
            meta_rel = _rel(root, mpath)
            parsed = _read_hf_metadata(mpath)
            if parsed is None:
                report.warn(meta_rel, "not a 3-line download metadata file (commit, etag, time)")
                continue
            _commit, etag, stamp = parsed
            if rel not in checks:
                report.error(
                    rel,
                    f"missing: {meta_rel} records a download of it (etag {etag[:12]}...); "
                    "re-download this file",
                )
                continue
            algo = _algorithm(etag)
            if algo is None:
                report.warn(meta_rel, f"etag {etag!r} is not a sha256 or git-sha1; not checked")
                continue
            check = checks[rel]
            check.expected, check.algorithm, check.expected_from = etag, algo, meta_rel
            if (root / rel).stat().st_mtime - 1 > stamp:
                report.warn(rel, "modified after hf download recorded it (mtime > metadata time)")


def _hash_files(
    root: Path,
    report: VerifyReport,
    workers: int | None,
    progress: Callable[[int, int], None] | None,
) -> None:
    report.hashed = True
    todo = [c for c in report.files if c.expected]
    total = sum(c.size for c in todo)
    done = 0
    lock = threading.Lock()

    def tick(n: int) -> None:
        nonlocal done
        with lock:
            done += n
            if progress is not None:
                progress(done, total)

    def one(check: FileCheck) -> None:
        try:
            check.digest = file_digest(root / check.file, check.algorithm or "sha256", tick)
        except OSError as exc:
            check.hash_ok = False
            report.error(check.file, f"cannot read ({exc})")
            return
        except UserFileError as exc:  # a shard linked to /dev/zero, a FIFO: never read
            check.hash_ok = False
            report.error(check.file, str(exc))
            return
        check.hash_ok = check.digest == check.expected

    n = workers or min(8, os.cpu_count() or 1)
    # Largest first, so one huge file does not start last and leave the others idle.
    todo.sort(key=lambda c: -c.size)
    with ThreadPoolExecutor(max_workers=max(1, n)) as pool:
        list(pool.map(one, todo))
    for check in todo:
        if check.hash_ok is False and check.digest:
            report.error(
                check.file,
                f"{check.algorithm} {check.digest[:16]}..., expected {(check.expected or '')[:16]}... "
                f"({check.expected_from}): the file is corrupt or from another revision; "
                "delete and re-download it",
            )
    unhashed = [c.file for c in report.files if not c.expected and c.file.endswith(".safetensors")]
    if unhashed:
        report.warn(
            "-",
            f"{len(unhashed)} safetensors file(s) have no recorded hash to compare with "
            f"(e.g. {unhashed[0]}); only their headers and sizes were checked",
        )


# -- the tensor map other modules use -----------------------------------------------------------


def weight_files(root: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files that hold the weights: those the index names, or the single file.

    Raises:
        CheckpointError: no index and no ``model.safetensors``, or the index is unreadable.
    """
    root = Path(root)
    if (root / INDEX_NAME).exists():
        report = VerifyReport(root=root, layout="plain", weights="index")
        weight_map = _load_index(root, report)
        if weight_map is None:
            raise CheckpointError(f"{root / INDEX_NAME}: {report.findings[0].message}")
        return [root / f for f in sorted(set(weight_map.values()))]
    if (root / SINGLE_NAME).exists():
        return [root / SINGLE_NAME]
    raise CheckpointError(
        f"{root}: no {INDEX_NAME} and no {SINGLE_NAME}; is this a model snapshot? "
        f"Run `flashnext checkpoint verify {root}`"
    )


def tensor_map(root: str | os.PathLike[str]) -> dict[str, tuple[Path, TensorEntry]]:
    """Every tensor of the checkpoint: name -> (file, header entry). Reads headers only.

    Raises:
        CheckpointError: a weight file is missing or its header is invalid or truncated (the
            message names the file and suggests ``flashnext checkpoint verify``).
    """
    root, _layout = resolve_snapshot(root)
    out: dict[str, tuple[Path, TensorEntry]] = {}
    for p in weight_files(root):
        if not p.exists():
            raise CheckpointError(
                f"{p}: missing (named by {INDEX_NAME}); run `flashnext checkpoint verify {root}`"
            )
        try:
            header = read_header(p)
        except SafetensorsError as exc:
            raise CheckpointError(
                f"{exc}; run `flashnext checkpoint verify {root}` for the full list"
            ) from None
        for name, entry in header.tensors.items():
            out[name] = (p, entry)
    return out
