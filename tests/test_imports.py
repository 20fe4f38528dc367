"""No upward or circular import anywhere in src/, function-local ones included (issue 21).

Every ``import`` and ``from ... import`` in every module of ``src/flashnext`` is read with
``ast`` (so imports inside functions and under ``TYPE_CHECKING`` count too) and resolved to the
module it loads. The layers, top to bottom, are those of ../shared/ARCHITECTURE.md: a module
may import its own layer's modules and any layer below it, never one above; and no chain of
imports may lead from a module back to itself.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

#: Top to bottom. A name is a subpackage or a root module of flashnext; root modules not listed
#: are at the bottom ("root") with the others that import nothing of ours above them.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__",),
    ("cli",),
    ("demo",),  # the demo workflow: quantizes, profiles and serves from ple
    ("deploy",),
    ("plan",),
    ("integrations",),
    ("moe",),
    ("serve",),  # vLLM-free serving policy: plan, check and the plugin import it
    ("kernels",),
    ("validate",),
    ("checkpoint",),
    ("ple",),
    ("root",),  # text, records, safetensors_file, atomic, errors, synthetic, status, ...
    ("__init__",),  # the package's own __init__: imports nothing but the version
)
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
#: Upward edges that a parallel branch of issue 43 removes: the cache-layout constants move from
#: serve/cache_plan.py to kernels/_layout.py (branch i43layout). Delete this when that lands.
PENDING = {("flashnext.kernels._staging", "flashnext.serve.cache_plan")}


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules(src: Path = SRC) -> dict[str, Path]:
    return {module_name(p, src): p for p in sorted((src / "flashnext").rglob("*.py"))}


def layer(module: str) -> str:
    """The layer of a module ``flashnext.X[.Y...]``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1] if parts[1] in RANK else "root"


def imported(path: Path, name: str, known: dict[str, Path]) -> Iterator[tuple[int, str]]:
    """(line, module) for each of our modules that ``path`` (module ``name``) imports."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join(here + ([base] if base else []))
            # `from P import m` loads the submodule P.m when there is one, else P itself
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        for target in targets:
            while target and target not in known:  # `import a.b.c` of an attribute path
                target = target.rpartition(".")[0]
            if target.startswith("flashnext") and target != name:
                yield node.lineno, target


def graph(src: Path = SRC) -> dict[str, list[tuple[int, str]]]:
    known = modules(src)
    return {name: sorted(set(imported(path, name, known))) for name, path in known.items()}


def upward_imports(full: dict[str, list[tuple[int, str]]]) -> list[str]:
    return [
        f"{name}:{line} imports {target} ({layer(name)} is below {layer(target)})"
        for name, edges in full.items()
        for line, target in edges
        if RANK[layer(target)] < RANK[layer(name)] and (name, target) not in PENDING
    ]


def test_no_upward_import() -> None:
    upward = upward_imports(graph())
    assert not upward, "upward imports:\n" + "\n".join(upward)


def cycles(edges: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(edges.get(nxt, []))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_circular_import() -> None:
    full = graph()
    edges = {name: [t for _, t in targets] for name, targets in full.items()}
    found = cycles(edges)
    detail = [
        " <-> ".join(c)
        + ": "
        + "; ".join(f"{a}:{line} -> {b}" for a in c for line, b in full[a] if b in c)
        for c in found
    ]
    assert not found, "circular imports:\n" + "\n".join(detail)


def test_the_walker_sees_function_local_and_relative_imports(tmp_path: Path) -> None:
    """The checks above would pass vacuously if the walker missed imports: on a small tree it
    finds an upward import inside a function and a cycle through a relative import."""
    files = {
        "flashnext/__init__.py": "",
        "flashnext/errors.py": "",
        "flashnext/deploy/__init__.py": "",
        "flashnext/deploy/record.py": "from flashnext import errors\n",
        "flashnext/validate/__init__.py": "",
        "flashnext/validate/ab.py": "def f():\n    from flashnext.deploy.record import x\n",
        "flashnext/ple/__init__.py": "",
        "flashnext/ple/a.py": "def g():\n    from . import b\n",
        "flashnext/ple/b.py": "import flashnext.ple.a\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    full = graph(tmp_path)
    assert upward_imports(full) == [
        "flashnext.validate.ab:2 imports flashnext.deploy.record (validate is below deploy)"
    ]
    edges = {name: [t for _, t in targets] for name, targets in full.items()}
    assert cycles(edges) == [["flashnext.ple.a", "flashnext.ple.b"]]
    # and on the real tree it sees imports made inside functions
    assert "flashnext.deploy.probe" in {t for _, t in graph()["flashnext.cli.validate"]}


def test_plan_check_and_ple_commands_do_not_load_numba() -> None:
    """numba takes seconds to import: the planner, ``flashnext check`` and the ``ple`` commands'
    module (``info``, ``slice``, ``preflight``, ``profile`` never look rows up) never need it."""
    code = (
        "import sys, flashnext.plan, flashnext.plan.planner, flashnext.deploy.check, "
        "flashnext.cli.check, flashnext.cli.ple; "
        "assert 'numba' not in sys.modules, sorted(m for m in sys.modules if 'numba' in m)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    p = subprocess.run(
        [sys.executable, "-c", "import flashnext.plan, sys; assert 'numba' not in sys.modules"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr[-2000:]


def test_ple_exports_load_lazily() -> None:
    """``flashnext.ple`` exports the quantizer beside the sidecar writer, each name from the
    module that defines it, loaded on first use."""
    code = (
        "import sys, flashnext.ple as ple\n"
        "assert 'flashnext.ple.table' not in sys.modules\n"
        "from flashnext.ple import quantize_table, write_sidecar\n"
        "from flashnext.ple.quantize import quantize_table as q\n"
        "from flashnext.ple.destination import write_sidecar as w\n"
        "assert quantize_table is q and write_sidecar is w\n"
        "for name in ple.__all__:\n"
        "    assert getattr(ple, name) is not None, name\n"
        "assert sorted(ple.__all__) == sorted(ple._EXPORTS)\n"
        "try:\n"
        "    ple.quantize_sidecar\n"
        "except AttributeError as exc:\n"
        "    assert 'quantize_sidecar' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('quantize_sidecar exists')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
