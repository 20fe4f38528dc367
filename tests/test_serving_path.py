"""The serving path stays easy to call and easy to follow (issue 43), read with ``ast``.

- No function in the serving path (serve/, kernels/, the host table modules, the plugin's
  ple_layer.py) takes more than :data:`MOST_POSITIONAL` positional parameters, except the
  entry points listed in :data:`EXCEPTED`, each with its reason; an exception that is no longer
  needed fails too, so the list only shrinks.
- The walk of the plugin's settings from ``ple_layer.open_rows`` is one straight path: the
  functions that receive the settings (``PluginSettings``) or the request built from them
  (``RowsRequest``) have at most :data:`MOST_SETTINGS_RETURNS` returns together, and no function
  the walk calls in ple_layer.py or serve/ has more than one return (no early exit).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "src" / "flashnext"
MOST_POSITIONAL = 6
MOST_SETTINGS_RETURNS = 3
#: The host table modules: host/ once the ple/ split lands, until then their ple/ files.
HOST_TABLE = ("table", "mapping", "lookup_kernels", "preflight", "profile", "pageout")
PLE_LAYER = PKG / "integrations" / "vllm" / "ple_layer.py"
Def = ast.FunctionDef | ast.AsyncFunctionDef

_NUMBA = "numba entry point: each array is one argument (numba takes no struct of arrays)"
_STAGED = "numba staged-path entry point; kernels/_layout.py's declared context replaces these"
_KNOBS = "constructor knobs; kernels' frozen knobs object (i43layout) replaces them"
#: Qualified name -> why it may take more than MOST_POSITIONAL positional parameters.
EXCEPTED = {
    "page_runs": _NUMBA,
    "_mark": _NUMBA,
    "_classify": _NUMBA,
    "_dedup_range": _NUMBA,
    "dedup_misses": _NUMBA,
    "dedup_hashed": _NUMBA,
    "classify_grouped": _NUMBA,
    "_memo_pass": _NUMBA,
    "_index_group": _NUMBA,
    "classify": _NUMBA,
    "dedup_positions": _NUMBA,
    "gather_rows": _NUMBA,
    "_nvfp4_group_intrinsic.group": "numba intrinsic: its signature is the generated code's",
    "gather_records": _STAGED,
    "gather_into": _STAGED,
    "gather_parallel": _STAGED,
    "stage_cached": _STAGED,
    "stage_sorted": _STAGED,
    "_lookup_kernel": "triton kernel: every pointer, stride and constexpr is an argument",
    "pack_locator": "packs the numba lookup kernels' locator array, one argument per field",
    "GpuTable.__init__": _KNOBS,
    "GpuTable.from_records": _KNOBS,
    "StagedTable.__init__": _KNOBS,
    "GraphStagedTable.__init__": _KNOBS,
}


def serving_path_files() -> list[Path]:
    host = sorted((PKG / "host").glob("*.py")) or [PKG / "ple" / f"{m}.py" for m in HOST_TABLE]
    files = [*(PKG / "serve").glob("*.py"), *(PKG / "kernels").rglob("*.py"), *host, PLE_LAYER]
    return sorted(p for p in files if p.is_file())


def functions(tree: ast.Module) -> Iterator[tuple[str, Def]]:
    """(qualified name, node) of every function and method, nested ones included."""

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, Def]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield prefix + child.name, child
                yield from visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")
            else:
                yield from visit(child, prefix)

    yield from visit(tree, "")


def positional(fn: Def) -> int:
    names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    return len([n for n in names if n not in ("self", "cls")])


def test_no_function_in_the_serving_path_takes_more_than_six_positional_parameters() -> None:
    over: dict[str, str] = {}
    for path in serving_path_files():
        for name, fn in functions(ast.parse(path.read_text(), str(path))):
            if positional(fn) > MOST_POSITIONAL:
                over[name] = f"{path.relative_to(PKG)}:{fn.lineno} {name}: {positional(fn)}"
    assert len(serving_path_files()) > 15 and "serve/serving.py" in {
        str(p.relative_to(PKG)) for p in serving_path_files()
    }
    unexcepted = [where for name, where in over.items() if name not in EXCEPTED]
    assert not unexcepted, (
        f"more than {MOST_POSITIONAL} positional parameters (make the rest keyword-only, or pass "
        "one frozen object):\n" + "\n".join(unexcepted)
    )
    stale = sorted(set(EXCEPTED) - set(over))
    assert not stale, f"no longer needed, remove from EXCEPTED: {stale}"


# -- the walk of the plugin's settings ----------------------------------------------------------
def returns(fn: Def) -> int:
    """Return statements of ``fn`` itself (not of functions or lambdas defined inside it)."""
    count, todo = 0, list[ast.AST](fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        count += isinstance(node, ast.Return)
        todo.extend(ast.iter_child_nodes(node))
    return count


def takes_settings(fn: Def) -> bool:
    args = (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)
    marks = ("PluginSettings", "RowsRequest")
    return any(a.annotation is not None and ast.unparse(a.annotation) in marks for a in args)


def _defs(path: Path) -> dict[str, Def]:
    """Top-level functions, and each class's ``__init__`` under the class's name (a call of the
    class runs it)."""
    tree = ast.parse(path.read_text(), str(path))
    found: dict[str, Def] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            init = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
            found.update({node.name: init[0]} if init else {})
    return found


def settings_walk() -> dict[str, Def]:
    """Every function ple_layer.open_rows reaches in ple_layer.py and serve/ (by the names it
    calls: ``f(...)``, ``serving.f(...)``, a class's constructor), by ``module:name``."""
    layer = {f"ple_layer:{n}": d for n, d in _defs(PLE_LAYER).items()}
    serve = {f"{p.stem}:{n}": d for p in (PKG / "serve").glob("*.py") for n, d in _defs(p).items()}
    by_name = {k.split(":")[1]: k for k in serve}
    walk: dict[str, Def] = {}
    todo = ["ple_layer:open_rows"]
    while todo:
        key = todo.pop()
        if key in walk:
            continue
        walk[key] = fn = {**layer, **serve}[key]
        module = key.split(":")[0]
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
            f = call.func
            if isinstance(f, ast.Name):
                here = f"{module}:{f.id}"
                todo += [here] if here in layer or here in serve else [by_name.get(f.id, "")]
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                todo.append(
                    by_name.get(f.attr, "") if f.value.id in ("serving", "cache_plan") else ""
                )
        todo = [k for k in todo if k]
    return walk


def test_the_settings_walk_is_one_straight_path() -> None:
    walk = settings_walk()
    # not vacuous: it reaches the plugin's decisions
    assert {"serving:open_rows", "serving:choose_placement", "cache_plan:plan_layer_cache",
            "cache_plan:profile_path", "serving:SidecarRows"} <= set(walk)  # fmt: skip
    carriers = {k: returns(fn) for k, fn in walk.items() if takes_settings(fn)}
    assert set(carriers) >= {"ple_layer:open_rows", "serving:open_rows"}
    assert sum(carriers.values()) <= MOST_SETTINGS_RETURNS, carriers
    early = {k: returns(fn) for k, fn in walk.items() if returns(fn) > 1}
    assert not early, f"more than one return (an early exit) on the settings walk: {early}"


def test_the_walk_counts_what_it_says(tmp_path: Path) -> None:
    """The counters above on a small function: nested functions' returns are not its own."""
    fn = ast.parse(
        "def f(x: RowsRequest):\n"
        "    if x:\n        return 1\n"
        "    def g():\n        return 2\n"
        "    return (lambda: 3)()\n"
    ).body[0]
    assert isinstance(fn, ast.FunctionDef)
    assert returns(fn) == 2 and takes_settings(fn)
    assert positional(ast.parse("def h(self, a, b, *, c): pass").body[0]) == 2  # type: ignore[arg-type]
