"""bench/ stands on the package and devtools/, never on tests/ (issue 7)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_bench_scripts_do_not_import_tests() -> None:
    found = []
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{path.name}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert not found, "bench/ imports from tests/: " + ", ".join(found)


def test_bench_scripts_use_public_names_only() -> None:
    """bench/ measures what users get: it imports no private module of the package
    (``flashnext.x._y``) and no private name (``from flashnext.x import _y``)."""
    found = []
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                pairs = [(a.name, "") for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                pairs = [(node.module, a.name) for a in node.names]
            else:
                continue
            for module, name in pairs:
                if not module.startswith("flashnext"):
                    continue
                private = [p for p in module.split(".") if p.startswith("_") and p != "__init__"]
                if private or (name.startswith("_") and name != "__version__"):
                    found.append(f"{path.name}:{node.lineno}: {module} {name}".rstrip())
    assert not found, "bench/ imports private names: " + ", ".join(found)
