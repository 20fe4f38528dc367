"""Every seam the plugin patches or imports, read from each checked vLLM wheel's Python files.

No vLLM import (the CUDA wheels cannot import here): the files are parsed with ``ast`` from
``pip download --no-deps vllm==X`` (devtools/vllm_wheel_sources.py: one download per release,
ever, kept under ~/.cache/flashnext/). The expected names and signatures are the plugin's own
constants, so a change on either side fails here. A release whose wheel cannot be fetched is
skipped, and the skip says so.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from devtools.vllm_wheel_sources import WheelUnavailable, ensure_vllm_sources
from flashnext.integrations.vllm import b12x, indexer, loader
from flashnext.integrations.vllm.engram import ENGRAM_KEYS, KEYS_BEFORE_034
from flashnext.integrations.vllm.versions import CHECKED

PLE_LAYER = Path(loader.__file__).with_name("ple_layer.py")
COMMON = "vllm/models/qwen4_exp/common/ngram_embedding.py"
NVIDIA = "vllm/models/qwen4_exp/nvidia/ngram_embedding.py"
#: Every checked release, and 0.34.0 whether or not it is in CHECKED yet.
RELEASES = sorted(set(CHECKED) | {"0.34.0"})


@dataclass
class Tree:
    """The parsed files of one release: modules by path, classes by name (first definition)."""

    root: Path
    modules: dict[str, ast.Module] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)

    def module(self, rel: str) -> ast.Module:
        if rel not in self.modules:
            path = self.root / rel
            assert path.exists(), f"{rel} is missing from the wheel"
            self.modules[rel] = ast.parse(path.read_text(), filename=str(path))
        return self.modules[rel]

    def cls(self, rel: str, name: str) -> ast.ClassDef:
        for node in self.module(rel).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise AssertionError(f"{rel} has no class {name}")

    def method(self, rel: str, cls_name: str, name: str) -> ast.FunctionDef:
        """``cls_name.name``, following bases defined in the kept files (vLLM's MRO order)."""
        node = self.cls(rel, cls_name)
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == name:
                return item
        for base in node.bases:
            base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            where = self.defining_file(base_name) if base_name else None
            if where is not None:
                try:
                    return self.method(where, base_name, name)  # type: ignore[arg-type]
                except AssertionError:
                    continue
        raise AssertionError(f"{rel}: {cls_name}.{name} is missing (own or inherited)")

    def defining_file(self, cls_name: str) -> str | None:
        for path in sorted(self.root.rglob("*.py")):
            rel = path.relative_to(self.root).as_posix()
            if any(
                isinstance(n, ast.ClassDef) and n.name == cls_name for n in self.module(rel).body
            ):
                return rel
        return None


def params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


def defines(module: ast.Module, name: str) -> bool:
    """A top-level def, class, assignment or import binding ``name``."""
    for node in module.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, ast.ImportFrom | ast.Import) and any(
            (alias.asname or alias.name) == name for alias in node.names
        ):
            return True
    return False


def plugin_constant(name: str) -> Any:
    """A literal constant of ple_layer.py (which imports vLLM, so is read, not imported)."""
    for node in ast.parse(PLE_LAYER.read_text()).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            if isinstance(target, ast.Name) and target.id == name and node.value is not None:
                return ast.literal_eval(node.value)
    raise AssertionError(f"ple_layer.py has no constant {name}")


def self_assignments(fn: ast.FunctionDef) -> dict[str, str]:
    """``self.X = expr`` in ``fn`` (annotated too): X -> the expression's source."""
    out = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                is_self = isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                if is_self and t.value.id == "self" and node.value is not None:  # type: ignore[attr-defined]
                    out[t.attr] = ast.unparse(node.value)  # type: ignore[attr-defined]
    return out


@pytest.fixture(scope="session", params=RELEASES)
def tree(request: pytest.FixtureRequest) -> Tree:
    try:
        return Tree(ensure_vllm_sources(request.param))
    except WheelUnavailable as exc:
        pytest.skip(f"vllm=={request.param} wheel not fetched, its seams NOT checked: {exc}")


def test_ple_sidecar_seams(tree: Tree) -> None:
    """ple_layer.py's imports, the replaced classes' constructor arguments and methods, and the
    pinned class's prefetch state, as the replacement assigns it."""
    assert defines(tree.module("vllm/config/__init__.py"), "get_current_vllm_config")
    custom_op = tree.module("vllm/model_executor/custom_op.py")
    assert defines(custom_op, "op_registry_oot") and defines(custom_op, "PluggableLayer")
    tree.method("vllm/model_executor/custom_op.py", "PluggableLayer", "register_oot")
    assert defines(
        tree.module("vllm/compilation/breakable_cudagraph.py"), "eager_break_during_capture"
    )
    for name in ("Qwen4ExpPLEEmbedding", "Qwen4ExpPLEEmbeddingMethod"):
        tree.cls(COMMON, name)
    read_args = plugin_constant("READ_ARGS")
    for name in ("Qwen4ExpPLEDeviceEmbedding", "Qwen4ExpPLEPinnedHostEmbedding"):
        init = params(tree.method(COMMON, name, "__init__"))
        assert [a for a in read_args if a not in init] == [], f"{name}.__init__ takes {init}"
        for method in ("start_prefetch", "finalize_prefetch", "_get_dp_gather_slot"):
            tree.method(COMMON, name, method)
    # The replacement sets vLLM's prefetch state as vLLM does and leaves out the table views: a
    # release that assigns anything else (0.33 dropped _row_bytes and _block_d: fine) fails here.
    pinned = self_assignments(tree.method(COMMON, "Qwen4ExpPLEPinnedHostEmbedding", "__init__"))
    ours: dict[str, str] = plugin_constant("PINNED_ATTRS")
    for attr, source in ours.items():
        assert pinned.get(attr) == source, f"pinned __init__: self.{attr} = {pinned.get(attr)}"
    left_out = set(plugin_constant("PINNED_TABLE_ATTRS"))
    assert set(pinned) - set(ours) <= left_out, sorted(set(pinned) - set(ours) - left_out)


def test_loader_and_indexer_seams(tree: Tree) -> None:
    load = tree.method(NVIDIA, "Qwen4ExpNGramEmbedding", "load_weights")
    assert params(load) == loader._LOAD_WEIGHTS_PARAMS
    rel = loader.PLE_MODULE.replace(".", "/") + ".py"
    assert "checkpoint_start" in params(
        tree.method(rel, "PLEVocabParallelEmbedding", "weight_loader")
    )
    for module_name, cls_name in indexer.TARGETS:
        rel = module_name.replace(".", "/") + ".py"
        assert params(tree.method(rel, cls_name, "load_weights")) == indexer._PARAMS, cls_name


def test_b12x_guard_seams(tree: Tree) -> None:
    rel = b12x.B12X_MODULE.replace(".", "/") + ".py"
    assert params(tree.method(rel, "FlashInferB12xExperts", "apply")) == b12x.APPLY_PARAMS
    assert params(tree.method(rel, "FlashInferB12xExperts", "_ensure_wrapper")) == ["self"]
    init = self_assignments(tree.method(rel, "FlashInferB12xExperts", "__init__"))
    assert [a for a in b12x.EXPERT_ATTRS if a not in init] == []


def test_engram_config_keys_are_the_ones_check_reads(tree: Tree) -> None:
    """check refuses keys a release lacks: the lists must be each release's own fields."""
    where = tree.defining_file("EngramConfig")
    assert where is not None, "no EngramConfig class in the kept files"
    fields = [
        n.target.id
        for n in tree.cls(where, "EngramConfig").body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    ]
    version = tree.root.name.removeprefix("vllm-src-")
    newer = tuple(int(x) for x in version.split(".")[:2]) >= (0, 34)
    assert sorted(fields) == sorted(ENGRAM_KEYS if newer else KEYS_BEFORE_034)
    disk = any(
        isinstance(n, ast.ClassDef) and n.name == "Qwen4ExpPLEDiskOffloadEmbedding"
        for n in tree.module(NVIDIA).body
    )
    # the class the sidecar does not replace, hence the refusal, exists from 0.34 on
    assert disk == newer, version
