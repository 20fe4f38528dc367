"""The ``drop_indexer`` part: serve a QSA checkpoint as dense attention without copying it.

``flashnext checkpoint override --dense-attention`` nulls the ``indexer_*`` fields, so vLLM
builds dense attention (``Qwen3NextAttention``) where the checkpoint has QSA layers. The
checkpoint still holds every QSA layer's indexer tensors (``layers.{L}.self_attn.indexer.*``),
and vLLM 0.32/0.33's ``AutoWeightsLoader`` stops at the first of them: ``There is no module or
parameter named 'layers.1.self_attn.indexer'``. This part wraps the two ``load_weights`` that
receive decoder-layer names, ``Qwen4ExpModel`` (``vllm/models/qwen4_exp/nvidia/model.py``) and
the MTP draft's ``Qwen4ExpMultiTokenPredictor`` (``nvidia/mtp.py``), and drops those tensors by
name, only while the model's config has no ``indexer_n_heads`` (the one field vLLM reads to
build QSA), so a QSA model is never touched. It logs how many tensors and bytes it dropped.

The dropped tensors were already read from disk by vLLM's iterator (it reads each tensor before
yielding it); they are a few hundred MB of a 186 GB checkpoint. Nothing is written.

:func:`check` verifies the seams and patches nothing; :func:`install` wraps (idempotent).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from flashnext.checkpoint.override import is_indexer_tensor
from flashnext.errors import PluginError
from flashnext.integrations.vllm.versions import installed_vllm_version

#: (module, class) pairs whose ``load_weights(self, weights)`` sees ``layers.{L}.`` names.
TARGETS = (
    ("vllm.models.qwen4_exp.nvidia.model", "Qwen4ExpModel"),
    ("vllm.models.qwen4_exp.nvidia.mtp", "Qwen4ExpMultiTokenPredictor"),
)
_PARAMS = ["self", "weights"]
_PATCHED = "__flashnext_drop_indexer__"
logger = logging.getLogger("flashnext.integrations.vllm")


def _refuse(what: str) -> PluginError:
    return PluginError(
        f"flashnext plugin: drop_indexer cannot be applied to vLLM {installed_vllm_version()}: "
        f"{what}. Switch FLASHNEXT_DROP_INDEXER off, or use a checked vLLM version"
    )


def _classes() -> list[Any]:
    """The target classes, checked; nothing patched."""
    out = []
    for module_name, cls_name in TARGETS:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # vLLM raises more than ImportError on a broken install
            raise _refuse(f"{module_name} does not import ({type(exc).__name__}: {exc})") from None
        cls = getattr(module, cls_name, None)
        if cls is None:
            raise _refuse(f"{module_name}.{cls_name} is missing")
        load = getattr(cls.load_weights, _PATCHED, cls.load_weights)
        params = list(inspect.signature(load).parameters)
        if params != _PARAMS:
            raise _refuse(f"{cls_name}.load_weights takes {params}, expected {_PARAMS}")
        out.append(cls)
    return out


def check() -> None:
    """Verify that vLLM's loaders look as this part expects; patch nothing.

    Raises:
        PluginError: a module does not import, a class is missing, or its
            ``load_weights(self, weights)`` has another signature.
    """
    _classes()


def install() -> str:
    """Wrap the targets' ``load_weights`` (idempotent). Returns the part's one log line.

    Raises:
        PluginError: as :func:`check`.
    """
    names = []
    for cls in _classes():
        if not hasattr(cls.load_weights, _PATCHED):
            cls.load_weights = _wrap(cls.load_weights)
        names.append(cls.__name__)
    return (
        f"installed ({', '.join(n + '.load_weights' for n in names)} skip "
        "self_attn.indexer.* tensors while the config has no indexer_n_heads)"
    )


def has_indexer(module: Any) -> bool:
    """Whether vLLM builds QSA in ``module``: its config sets ``indexer_n_heads``."""
    return getattr(getattr(module, "config", None), "indexer_n_heads", None) is not None


def _wrap(original: Callable[..., set[str]]) -> Callable[..., set[str]]:
    @functools.wraps(original)
    def load_weights(self: Any, weights: Iterable[tuple[str, Any]]) -> set[str]:
        if has_indexer(self):
            return set(original(self, weights))
        dropped: list[tuple[str, int]] = []

        def kept() -> Iterator[tuple[str, Any]]:
            # A generator, so tensors stream to vLLM one at a time as before.
            for name, tensor in weights:
                if is_indexer_tensor(name):
                    dropped.append((name, int(tensor.numel()) * int(tensor.element_size())))
                else:
                    yield name, tensor

        loaded = set(original(self, kept()))
        if dropped:
            logger.info(dropped_line(type(self).__name__, dropped))
        return loaded

    setattr(load_weights, _PATCHED, original)
    return load_weights


def dropped_line(owner: str, dropped: list[tuple[str, int]]) -> str:
    """The log line for the tensors ``owner``'s loader dropped: ``(name, bytes)`` pairs."""
    from flashnext import __version__
    from flashnext.checkpoint.override import indexer_layer

    layers = sorted({layer for name, _ in dropped if (layer := indexer_layer(name)) is not None})
    total = sum(n for _, n in dropped)
    return (
        f"flashnext plugin: drop_indexer: {owner} skipped {len(dropped)} QSA indexer tensor(s), "
        f"{total:,} bytes, of layers {layers}: the served config has no indexer_n_heads, so "
        f"these layers are dense attention (not shown equivalent to QSA) "
        f"(vllm {installed_vllm_version()}, flashnext {__version__})"
    )
