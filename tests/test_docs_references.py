"""Every ``flashnext.x.y`` that README.md, docs/ and BENCHMARKS.md name exists (issue 43).

The docs point at module docstrings by dotted path instead of restating them, so a module that
moves or a name that is renamed must not leave a dead pointer behind. A dotted name in a code
span is either a record kind (:data:`flashnext.records.KINDS`) or resolves in ``src/``: the
longest prefix that is a module file or package, then a top-level name of that file (a def, a
class, an assignment or an import, also under ``if TYPE_CHECKING:``), then at most one member of
that class. Resolved from the source, not imported, so modules that need torch are checked too.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from flashnext.records import KINDS

from .test_docs_commands import code_spans

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
# Record kinds that were renamed; the README names them to say so.
FORMER_KINDS = {"flashnext.explain"}


def module_file(parts: list[str]) -> Path | None:
    """The module's file, its package's ``__init__.py``, or a namespace package's folder."""
    path = SRC.joinpath(*parts)
    found = [f for f in (path.with_suffix(".py"), path / "__init__.py") if f.is_file()]
    return found[0] if found else (path if path.is_dir() else None)


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """A module's top-level statements, with those of its top-level ``if`` / ``try`` blocks and
    of a module ``__getattr__`` (lazy re-exports import there)."""
    found: list[ast.stmt] = []
    for node in body:
        found.append(node)
        if isinstance(node, ast.If):
            found += _statements(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            found += _statements(node.body + node.orelse + node.finalbody)
        elif isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            found += [n for n in ast.walk(node) if isinstance(n, ast.ImportFrom)]
    return found


def _assigned(node: ast.stmt) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return [t.id for t in targets if isinstance(t, ast.Name)]


@functools.cache
def top_level(path: Path) -> dict[str, set[str] | tuple[Path, str]]:
    """Names a module defines, each with its members when it is a class (else empty); a name
    imported from another flashnext module maps to (that module's file, its name there)."""
    names: dict[str, set[str] | tuple[Path, str]] = {}
    if path.is_dir():
        return names
    for node in _statements(ast.parse(path.read_text()).body):
        if isinstance(node, ast.ClassDef):
            members = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
            members |= {name for n in node.body for name in _assigned(n)}
            names[node.name] = members
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names[node.name] = set()
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            names.update((name, set()) for name in _assigned(node))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flashnext."):
            source = module_file((node.module or "").split("."))
            for a in node.names:
                names[a.asname or a.name] = (source, a.name) if source else set()
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name.split(".")[0], set()) for a in node.names)
    return names


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a record kind or a module, name or class member under src/."""
    if dotted in KINDS or dotted in FORMER_KINDS:
        return True
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        path = module_file(parts[:k])
        if path is None:
            continue
        rest = parts[k:]
        if not rest:
            return True
        if len(rest) > 2 or rest[0] not in top_level(path):
            return False
        return len(rest) == 1 or rest[1] in members(path, rest[0])
    return False


def members(path: Path, name: str) -> set[str]:
    """The members of class ``name`` of ``path``, following re-exports (a few hops)."""
    for _ in range(5):
        found = top_level(path).get(name, set())
        if isinstance(found, set):
            return found
        path, name = found
    return set()


def references(doc: Path) -> list[str]:
    return sorted(
        {
            m
            for span in code_spans(doc.read_text())
            for m in re.findall(r"\bflashnext(?:\.\w+)+", span)
        }
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_dotted_names_in_docs_exist(doc: Path) -> None:
    dead = [name for name in references(doc) if not resolves(name)]
    assert not dead, f"{doc.name} names what src/ does not hold: {dead}"


def test_the_check_finds_a_dead_name() -> None:
    assert resolves("flashnext.ple.formats") and resolves("flashnext.ple.PLEGeometry")
    assert resolves("flashnext.kernels.GpuTable.from_table")
    assert not resolves("flashnext.ple.no_such_module")
    assert not resolves("flashnext.kernels.GpuTable.no_such_member")
    assert not resolves("flashnext.nowhere")
