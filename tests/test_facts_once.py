"""Facts spelled in one module only (issue 43): checkpoint tensor names in
``checkpoint/ple_tensors.py``, the Hugging Face cache layout in ``hub_cache.py``.

Every string literal in ``src/flashnext`` (f-string parts and regexes included, docstrings not:
they may explain a name) is read with ``ast``; one that spells such a fact outside its module
fails, naming the file and line. Import the name from the owner instead.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

#: owner module (relative to src/) -> the spellings only it may hold
FACTS: dict[str, tuple[re.Pattern[str], ...]] = {
    "flashnext/checkpoint/ple_tensors.py": (
        # the table module in a tensor name (vLLM's python module of the same name aside)
        re.compile(r"(?<!nvidia\.)\bngram_embedding\b"),
        re.compile(r"\bple_embedding\b(?!_)"),  # ple_embedding_dtype is a config field
        # the decoder layers' prefixes: model.layers., model.language_model.layers., VL's
        re.compile(r"\b(?:model|language_model)\\?\.(?:(?:language_model|model)\\?\.)?layers\b"),
    ),
    "flashnext/hub_cache.py": (
        re.compile(r"models--"),
        re.compile(r"\bsnapshots\b"),
        re.compile(r"\bblobs\b"),
        re.compile(r"\brefs\b"),
    ),
}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def restatements(src: Path = SRC) -> list[str]:
    """``file:line: 'literal' spells what OWNER owns`` for each literal outside its owner."""
    out = []
    for path in sorted((src / "flashnext").rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
                continue
            if id(node) in docs:
                continue
            for owner, patterns in FACTS.items():
                if rel != owner and any(p.search(node.value) for p in patterns):
                    out.append(f"{rel}:{node.lineno}: {node.value[:80]!r} spells what {owner} owns")
    return out


def test_tensor_names_and_the_hub_cache_layout_live_in_one_module_each() -> None:
    found = restatements()
    assert not found, "\n".join(found)


def test_the_check_finds_a_restatement(tmp_path: Path) -> None:
    """The test above would pass vacuously if the walker missed literals: on a small tree it
    finds a prefix in an f-string, a cache folder and a regex, and passes docstrings and the
    owners themselves."""
    files = {
        "flashnext/deploy/a.py": 'def f(i):\n    """model.layers.N names it"""\n'
        '    return f"model.layers.{i}.ple"\n',
        "flashnext/plan/b.py": 'import re\nX = re.compile(r"ngram_embedding\\.weight")\n',
        "flashnext/store/c.py": 'def g(p):\n    return p / "snapshots"\n',
        "flashnext/integrations/d.py": 'M = "vllm.models.qwen4_exp.nvidia.ngram_embedding"\n'
        'D = "ple_embedding_dtype"\n',
        "flashnext/checkpoint/ple_tensors.py": 'P = "model.layers."\n',
        "flashnext/hub_cache.py": 'S = "snapshots"\n',
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = [line.split(": ", 1)[0] for line in restatements(tmp_path)]
    assert found == ["flashnext/deploy/a.py:3", "flashnext/plan/b.py:2", "flashnext/store/c.py:2"]
