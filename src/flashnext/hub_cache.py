"""The Hugging Face hub cache layout, once: where ``huggingface_hub`` keeps a model.

::

    <cache>/models--<org>--<name>/      a repo folder
        blobs/<hash>                    the files' contents
        refs/main                       the revision ``main`` points at (a commit hash)
        snapshots/<revision>/           one directory per revision, its files linking into blobs/

``<cache>`` is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``.
Nothing else in flashnext spells these names (a test greps for them).
"""

from __future__ import annotations

import os
from pathlib import Path

from flashnext.errors import CheckpointError

_REPO = "models--"
_BLOBS = "blobs"
_SNAPSHOTS = "snapshots"
_MAIN_REF = ("refs", "main")


def cache_dirs() -> list[Path]:
    """Where huggingface_hub keeps downloaded models, in its own order of precedence."""
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def repo_folder(cache: Path, repo_id: str) -> Path:
    """``cache/models--org--name`` for ``repo_id`` ``org/name``."""
    return cache / (_REPO + repo_id.replace("/", "--"))


def repo_id_of(path: Path) -> str | None:
    """``org/name`` when ``path`` is or lies in a repo folder, else None."""
    for part in (path, *path.parents):
        if part.name.startswith(_REPO):
            return part.name[len(_REPO) :].replace("--", "/", 1)
    return None


def has_snapshots(path: Path) -> bool:
    """Whether ``path`` looks like a repo folder (it has ``snapshots/``)."""
    return (path / _SNAPSHOTS).is_dir()


def is_repo_folder(path: Path) -> bool:
    """Whether ``path`` is a repo folder: ``blobs/`` and ``snapshots/`` in it."""
    return (path / _BLOBS).is_dir() and has_snapshots(path)


def is_snapshot(path: Path) -> bool:
    """Whether ``path`` is ``<repo>/snapshots/<revision>`` of a repo folder."""
    return path.parent.name == _SNAPSHOTS and (path.parent.parent / _BLOBS).is_dir()


def snapshot_revision(path: Path) -> str | None:
    """The revision of a snapshot directory (its name under ``snapshots/``), else None."""
    return path.name if path.parent.name == _SNAPSHOTS else None


def blobs_of(snapshot: Path) -> Path:
    """The ``blobs/`` folder that a snapshot's files link into."""
    return snapshot.parent.parent / _BLOBS


def main_revision(repo: Path) -> str | None:
    """The revision ``refs/main`` names, or None without that file."""
    ref = repo.joinpath(*_MAIN_REF)
    return ref.read_text().strip() if ref.is_file() else None


def snapshots(repo: Path) -> list[Path]:
    """The snapshot directories of a repo folder, ``refs/main``'s first when it is there."""
    folder = repo / _SNAPSHOTS
    found = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    main = main_revision(repo)
    return sorted(found, key=lambda p: p.name != main)


def main_snapshot(repo: Path) -> Path:
    """The snapshot to use in a repo folder: ``refs/main``'s, or the only one there is.

    Raises:
        CheckpointError: ``refs/main`` names a revision with no snapshot, or there is no
            ``refs/main`` and not exactly one snapshot (the message lists them).
    """
    rev = main_revision(repo)
    folder = repo / _SNAPSHOTS
    if rev is not None:
        if not (folder / rev).is_dir():
            raise CheckpointError(
                f"{repo}: refs/main points at revision {rev}, but snapshots/{rev} is missing"
            )
        return folder / rev
    revs = sorted(p for p in folder.iterdir() if p.is_dir())
    if len(revs) != 1:
        raise CheckpointError(
            f"{repo}: {len(revs)} snapshots and no refs/main; pass one of "
            + ", ".join(str(r) for r in revs[:5])
        )
    return revs[0]
