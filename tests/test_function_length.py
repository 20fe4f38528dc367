"""No function in src/ is longer than about 60 lines unless its docstring says why.

A function is measured from its ``def`` line to its last line (docstring included). One longer
than LIMIT passes when its docstring has a line starting with ``Length:`` that gives the reason
(a kernel body that must stay one function, say).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
LIMIT = 60
# Long today in modules another branch is changing this session; split them there, then drop
# the entry (an entry that is no longer long fails the test, so the list only shrinks).
PENDING: set[str] = set()  # "file:function" a helper is splitting on another branch


def long_functions(source: str, filename: str, limit: int = LIMIT) -> dict[str, int]:
    """``{"file:Class.function": lines}`` for each function over ``limit`` lines without a
    ``Length:`` reason in its docstring."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                doc = ast.get_docstring(child) or ""
                reason = any(line.strip().startswith("Length:") for line in doc.splitlines())
                if lines > limit and not reason:
                    found[f"{filename}:{name}"] = lines
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source, filename), "")
    return found


def test_no_long_function_without_a_reason() -> None:
    found: dict[str, int] = {}
    for path in sorted(SRC.rglob("*.py")):
        found |= long_functions(path.read_text(), path.relative_to(SRC).as_posix())
    new = {k: v for k, v in found.items() if k not in PENDING}
    assert not new, "split these, or give the reason in a `Length:` docstring line: " + ", ".join(
        f"{k} ({v} lines)" for k, v in sorted(new.items())
    )
    fixed = PENDING - found.keys()
    assert not fixed, f"no longer long, drop from PENDING: {sorted(fixed)}"


def test_the_measure() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    assert long_functions(f"def f():\n{body}\n", "m.py") == {"m.py:f": 61}
    assert long_functions(f"def f():\n{body[: body.rindex(chr(10))]}\n", "m.py") == {}
    reason = '    """Why.\n\n    Length: one kernel body.\n    """\n'
    assert long_functions(f"def f():\n{reason}{body}\n", "m.py") == {}
    nested = f"class C:\n    def g(self):\n{body.replace('    ', '        ')}\n"
    assert long_functions(nested, "m.py") == {"m.py:C.g": 61}
