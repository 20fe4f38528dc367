"""The words for where a PLE table's rows live and how they are read, defined once.

Two independent questions, each with its own word set; every module, flag, plan and plugin
switch uses these (import them, never retype them):

**Placement**: where a GPU reads a table's rows from.

- ``device``: the rows (their per-row records) are copied into GPU memory; fastest reads, but
  the table takes memory vLLM would otherwise give the KV cache.
- ``pinned``: the rows stay in page-locked (pinned) host memory and the GPU reads them over PCIe
  through unified virtual addressing (UVA); the whole table is committed host RAM.
- ``staged``: the rows stay in an ordinary host table (see residency) and each batch's rows are
  gathered on the host into small pinned staging buffers, then copied to the GPU.
- ``auto`` is a *choice*, not a placement: ``pinned`` when the host can hold the table pinned,
  else ``staged`` (decided by :func:`flashnext.serve.serving.choose_placement`).

**Residency**: how a host table holds its rows (what ``staged`` reads from; a CPU lookup too).

- ``mmap``: zero-copy memory maps of the sidecar's shard files; rows sit in the page cache,
  reclaimable under memory pressure, read from disk when cold.
- ``resident``: an anonymous-memory copy of the rows; committed RAM, never read from disk again.

Old spellings of ``flashnext plan --ple-placement`` (``host``, ``gpu``, ``mmap``, ``resident``)
are translated by :func:`from_old_plan_word`, with a deprecation line from the caller.
"""

from __future__ import annotations

from typing import Literal, cast

Placement = Literal["device", "pinned", "staged"]
PlacementSetting = Literal["auto"] | Placement
Residency = Literal["mmap", "resident"]

#: Every placement, in order of GPU memory taken (most first).
PLACEMENTS: tuple[Placement, ...] = ("device", "pinned", "staged")
#: What a setting or flag may ask for: a placement or ``auto``.
PLACEMENT_SETTINGS: tuple[PlacementSetting, ...] = ("auto", *PLACEMENTS)
#: Every residency.
RESIDENCIES: tuple[Residency, ...] = ("mmap", "resident")

#: ``flashnext plan --ple-placement`` words before the one vocabulary (documented in
#: docs/plan.md), each -> (placement, residency or None when the placement has no host table).
OLD_PLAN_WORDS: dict[str, tuple[Placement, Residency | None]] = {
    "host": ("pinned", None),
    "gpu": ("device", None),
    "mmap": ("staged", "mmap"),
    "resident": ("staged", "resident"),
}


def _one_of(what: str, word: str, words: tuple[str, ...]) -> str:
    """``word`` when it is in ``words``; the ValueError names ``what`` and lists ``words``."""
    if word not in words:
        raise ValueError(f"{what} {word!r}: expected one of {', '.join(words)}")
    return word


def as_placement(word: str) -> Placement:
    """``word`` typed as a :data:`Placement`.

    Raises:
        ValueError: ``word`` is not one of :data:`PLACEMENTS` (the message lists them).
    """
    return cast(Placement, _one_of("placement", word, PLACEMENTS))


def as_residency(word: str) -> Residency:
    """``word`` typed as a :data:`Residency`.

    Raises:
        ValueError: ``word`` is not one of :data:`RESIDENCIES` (the message lists them).
    """
    return cast(Residency, _one_of("residency", word, RESIDENCIES))


def from_old_plan_word(word: str) -> tuple[Placement, Residency | None] | None:
    """The (placement, residency) an old ``plan --ple-placement`` word stood for, else None."""
    return OLD_PLAN_WORDS.get(word)


def deprecation_line(flag: str, old: str, placement: str, residency: str | None) -> str:
    """The one stderr line that says an old word was translated, and to what."""
    new = f"{flag} {placement}" + (f" --ple-residency {residency}" if residency else "")
    return f"warning: {flag} {old} is deprecated; it now means `{new}` (see README)"
