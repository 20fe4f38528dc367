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
