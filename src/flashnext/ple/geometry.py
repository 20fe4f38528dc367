"""PLE n-gram table geometry: head sizes, offsets, multipliers and row counts.

One PLE layer owns one table. Its geometry follows from the model config alone
(see FACTS.md, "PLE: the n-gram embedding table"):

- ``heads = (ngram_size - 1) * heads_per_ngram``; head ``h`` hashes an n-gram of order
  ``h // heads_per_ngram + 2``; ``width = ple_embed_dim // heads``.
- ``sizes[h]`` is the ``(heads * d + h + 1)``-th prime ``>= ngram_vocab_size_base``, with
  ``d`` the layer's ordinal among ``sorted(set(ple_layer_ids))``; ``offsets`` are the running
  sum of ``sizes``; ``num_rows`` is the sum rounded up to ``make_ngram_vocab_size_divisible_by``.
- ``multipliers[i] = 2 * (splitmix64(seed + 10007 * d + GOLDEN * (i + 1)) % half) + 1`` with
  ``half = ((2**63 - 1) // vocab_size) // 2`` (uint64 wrapping arithmetic), so every product
  ``token * multiplier`` fits in int64.

A checkpoint may carry the buffers ``layer_multipliers``, ``ngram_heads_vocab_sizes`` and
``ngram_heads_offsets``; :meth:`PLEGeometry.with_buffers` makes them win over the computed values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from flashnext.errors import GeometryError

_MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15

#: Defaults of the released Flash-Next configs, used when a config omits a field.
DEFAULTS: dict[str, int] = {
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20_000_000,
    "make_ngram_vocab_size_divisible_by": 128,
    "seed": 1234,
    "split_ngram_parts": 128,
    "ple_embed_dim": 2560,
}


def splitmix64(x: int) -> int:
    """The standard splitmix64 finalizer on a uint64 (Python int in [0, 2**64))."""
    z = (x + GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def compute_multipliers(
    vocab_size: int, seed: int, layer_ordinal: int, ngram_size: int
) -> list[int]:
    """Per-position hash multipliers of one PLE layer: odd ints in [1, (2**63-1)//vocab_size]."""
    half = ((2**63 - 1) // vocab_size) // 2
    if half < 1:
        raise GeometryError(f"vocab_size={vocab_size} is too large for int64 n-gram hashing")
    out = []
    for i in range(ngram_size):
        x = (seed + 10007 * layer_ordinal + GOLDEN * (i + 1)) & _MASK64
        out.append(2 * (splitmix64(x) % half) + 1)
    return out


def _small_primes(limit: int) -> np.ndarray:
    sieve = np.ones(limit + 1, dtype=bool)
    sieve[:2] = False
    for p in range(2, math.isqrt(limit) + 1):
        if sieve[p]:
            sieve[p * p :: p] = False
    return np.flatnonzero(sieve)


@lru_cache(maxsize=64)
def primes_from(base: int, count: int) -> tuple[int, ...]:
    """The first ``count`` primes ``>= base``, by a segmented sieve (64 primes near 2e7: ~ms)."""
    if count <= 0:
        return ()
    found: list[int] = []
    lo = max(base, 2)
    # Prime gaps near n average ln(n); sieve a window a few times larger than needed.
    span = max(1024, int(count * max(math.log(lo), 1.0) * 2))
    while len(found) < count:
        hi = lo + span
        small = _small_primes(math.isqrt(hi) + 1)
        seg = np.ones(hi - lo, dtype=bool)
        for p in small:
            p = int(p)
            start = max(p * p, ((lo + p - 1) // p) * p)
            if start >= hi:
                continue
            seg[start - lo :: p] = False
        if lo < 2:
            seg[: 2 - lo] = False
        found.extend(int(v) + lo for v in np.flatnonzero(seg))
        lo = hi
        span *= 2
    return tuple(found[:count])


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's fields: ``config["text_config"]`` over the top-level fields.

    Multimodal configs keep the text model's fields under ``text_config``; a field found only
    at the top level still counts, so a mixed config never falls back to a default silently.
    """
    inner = config.get("text_config")
    if isinstance(inner, Mapping):
        merged = {k: v for k, v in config.items() if k != "text_config"}
        merged.update(inner)
        return merged
    return config


def ple_layer_ids(config: Mapping[str, Any]) -> list[int]:
    """Sorted, de-duplicated 1-based decoder layer numbers that carry a PLE table."""
    ids = text_config(config).get("ple_layer_ids")
    if ids is None:
        return []
    if (
        not isinstance(ids, Sequence)
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        or any(i < 1 for i in ids)
    ):
        raise GeometryError(
            f"config field ple_layer_ids must list 1-based decoder layer numbers (ints >= 1), "
            f"found {ids!r}"
        )
    return sorted(set(ids))


@dataclasses.dataclass(frozen=True)
class PLEGeometry:
    """Geometry of one PLE layer's n-gram table.

    Attributes:
        vocab_size: token vocabulary size (int).
        ngram_size: largest n-gram order; orders 2..ngram_size are hashed.
        heads_per_ngram: heads per order.
        num_heads: ``(ngram_size - 1) * heads_per_ngram`` (16 for Flash-Next).
        width: row length, ``ple_embed_dim // num_heads`` (160).
        layer_ordinal: ``d``, the layer's position among the sorted PLE layers.
        seed: hashing seed.
        multipliers: list[int], len ``ngram_size``.
        sizes: list[int], len ``num_heads``: rows of each head's sub-table.
        offsets: list[int], len ``num_heads``: first row of each head's sub-table.
        num_rows: total rows, padded to ``divisible_by``.
        divisible_by: the padding multiple.
        split_ngram_parts: checkpoint shard count (128 in the released checkpoints).
        eos_token_id: the EOS token that cuts n-gram windows.
        base: ``ngram_vocab_size_base``.
    """

    vocab_size: int
    ngram_size: int
    heads_per_ngram: int
    num_heads: int
    width: int
    layer_ordinal: int
    seed: int
    multipliers: list[int]
    sizes: list[int]
    offsets: list[int]
    num_rows: int
    divisible_by: int
    split_ngram_parts: int
    eos_token_id: int
    base: int

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        layer_ordinal: int = 0,
        *,
        layer_id: int | None = None,
    ) -> PLEGeometry:
        """Build the geometry of one PLE layer from a model ``config.json`` dict.

        Accepts a flat text config or one with the fields under ``text_config``. Pass either
        ``layer_ordinal`` (position among ``sorted(set(ple_layer_ids))``) or ``layer_id`` (the
        1-based decoder layer number listed in ``ple_layer_ids``).

        Raises:
            GeometryError: a required field is missing or a value is out of range.
        """
        cfg = text_config(config)
        vocab_size = _positive_field(cfg, "vocab_size", required=True)
        eos = _eos_token_id(cfg, vocab_size)
        ngram_size = _positive_field(cfg, "ngram_size")
        if ngram_size < 2:
            raise GeometryError(f"config field 'ngram_size' must be >= 2, found {ngram_size}")
        heads_per_ngram = _positive_field(cfg, "heads_per_ngram")
        num_heads = (ngram_size - 1) * heads_per_ngram
        embed = _positive_field(cfg, "ple_embed_dim")
        if embed % num_heads:
            raise GeometryError(
                f"ple_embed_dim={embed} is not divisible by the {num_heads} PLE heads "
                f"((ngram_size-1) * heads_per_ngram)"
            )
        layer_ordinal = _layer_ordinal(ple_layer_ids(config), layer_ordinal, layer_id)

        base = _positive_field(cfg, "ngram_vocab_size_base")
        divisible_by = _positive_field(cfg, "make_ngram_vocab_size_divisible_by")
        seed = cfg.get("seed", DEFAULTS["seed"])
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise GeometryError(f"config field 'seed' must be an int, found {seed!r}")
        primes = primes_from(base, num_heads * (layer_ordinal + 1))
        sizes = list(primes[num_heads * layer_ordinal :])
        offsets = [int(v) for v in np.cumsum([0, *sizes[:-1]])]
        return cls(
            vocab_size=vocab_size,
            ngram_size=ngram_size,
            heads_per_ngram=heads_per_ngram,
            num_heads=num_heads,
            width=embed // num_heads,
            layer_ordinal=layer_ordinal,
            seed=seed,
            multipliers=compute_multipliers(vocab_size, seed, layer_ordinal, ngram_size),
            sizes=sizes,
            offsets=offsets,
            num_rows=_round_up(sum(sizes), divisible_by),
            divisible_by=divisible_by,
            split_ngram_parts=_positive_field(cfg, "split_ngram_parts"),
            eos_token_id=eos,
            base=base,
        )

    def with_buffers(
        self,
        layer_multipliers: Any = None,
        ngram_heads_vocab_sizes: Any = None,
        ngram_heads_offsets: Any = None,
    ) -> PLEGeometry:
        """A copy in which the checkpoint's int64 buffers win over the computed values.

        Each buffer is optional (array-like of ints): ``layer_multipliers`` [ngram_size],
        ``ngram_heads_vocab_sizes`` [num_heads], ``ngram_heads_offsets`` [num_heads]. ``num_rows``
        is recomputed from the resulting sizes and offsets.

        Raises:
            GeometryError: a buffer has the wrong length or values that cannot hash safely.
        """
        mult = self._buffer(
            "layer_multipliers", layer_multipliers, self.ngram_size, self.multipliers
        )
        sizes = self._buffer(
            "ngram_heads_vocab_sizes", ngram_heads_vocab_sizes, self.num_heads, self.sizes
        )
        if ngram_heads_offsets is None and ngram_heads_vocab_sizes is not None:
            offsets = [int(v) for v in np.cumsum([0, *sizes[:-1]])]
        else:
            offsets = self._buffer(
                "ngram_heads_offsets", ngram_heads_offsets, self.num_heads, self.offsets
            )
        limit = (2**63 - 1) // self.vocab_size
        if any(m <= 0 or m > limit for m in mult):
            raise GeometryError(
                f"buffer layer_multipliers {mult} has a value outside [1, {limit}] "
                f"((2**63-1) // vocab_size): token * multiplier would overflow int64"
            )
        if any(s <= 0 for s in sizes) or any(o < 0 for o in offsets):
            raise GeometryError(
                f"buffers ngram_heads_vocab_sizes {sizes} / ngram_heads_offsets {offsets} "
                "must hold positive sizes and non-negative offsets"
            )
        end = max(o + s for o, s in zip(offsets, sizes))
        return dataclasses.replace(
            self,
            multipliers=mult,
            sizes=sizes,
            offsets=offsets,
            num_rows=_round_up(end, self.divisible_by),
        )

    @staticmethod
    def _buffer(name: str, value: Any, length: int, default: list[int]) -> list[int]:
        if value is None:
            return list(default)
        arr = np.asarray(value)
        if arr.dtype.kind not in "iu":
            raise GeometryError(f"buffer {name} must hold integers, found dtype {arr.dtype}")
        flat = arr.reshape(-1)
        if flat.size != length:
            raise GeometryError(f"buffer {name} has shape {list(arr.shape)}, expected [{length}]")
        return [int(v) for v in flat]

    @property
    def head_orders(self) -> list[int]:
        """The n-gram order hashed by each head: ``h // heads_per_ngram + 2``."""
        return [h // self.heads_per_ngram + 2 for h in range(self.num_heads)]

    @property
    def num_params(self) -> int:
        """``num_rows * width``."""
        return self.num_rows * self.width

    def shard_rows(self, parts: int | None = None) -> int:
        """Rows per checkpoint shard, ``ceil(num_rows / parts)`` (the last shard may be shorter).

        ``parts`` defaults to ``split_ngram_parts``.
        """
        parts = self.split_ngram_parts if parts is None else parts
        if parts <= 0:
            raise GeometryError(f"shard count must be positive, found {parts}")
        return -(-self.num_rows // parts)

    def tp_rows(self, tp_size: int, rank: int) -> tuple[int, int]:
        """The contiguous row range ``[start, end)`` that tensor-parallel ``rank`` owns."""
        if tp_size <= 0 or not 0 <= rank < tp_size:
            raise GeometryError(f"rank {rank} is not in a tensor-parallel group of size {tp_size}")
        if self.num_rows % tp_size:
            raise GeometryError(
                f"num_rows={self.num_rows} does not split evenly across tp_size={tp_size}"
            )
        per = self.num_rows // tp_size
        return rank * per, (rank + 1) * per

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field (recorded in sidecar META.json)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PLEGeometry:
        """Inverse of :meth:`to_dict`; raises :class:`GeometryError` on missing fields."""
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in data]
        if missing:
            raise GeometryError(f"geometry record lacks fields {missing}")
        return cls(**{n: data[n] for n in names})


def _positive_field(cfg: Mapping[str, Any], name: str, required: bool = False) -> int:
    """``cfg[name]`` (or its default unless ``required``) as a positive int; GeometryError if not."""
    value = cfg.get(name, None if required else DEFAULTS.get(name))
    if value is None:
        raise GeometryError(f"model config has no field '{name}' (needed for PLE geometry)")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise GeometryError(f"config field '{name}' must be a positive int, found {value!r}")
    return value


def _eos_token_id(cfg: Mapping[str, Any], vocab_size: int) -> int:
    """The primary EOS id (first of a list, as HF allows); GeometryError if not in the vocab."""
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list) and eos and all(isinstance(e, int) for e in eos):
        eos = eos[0]  # HF allows a list; the PLE hash cuts on the primary EOS
    if isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < vocab_size:
        raise GeometryError(
            f"config field 'eos_token_id' must be a token id in [0, {vocab_size}), found {eos!r}"
        )
    return eos


def _layer_ordinal(layers: list[int], layer_ordinal: int, layer_id: int | None) -> int:
    """The PLE layer's position among ``layers`` (from ``layer_id`` when given); GeometryError
    when the id is not listed or the ordinal is out of range."""
    if layer_id is not None:
        if layers and layer_id not in layers:
            raise GeometryError(f"layer_id={layer_id} is not in ple_layer_ids {layers}")
        layer_ordinal = layers.index(layer_id) if layers else 0
    if layer_ordinal < 0 or (layers and layer_ordinal >= len(layers)):
        raise GeometryError(
            f"layer_ordinal={layer_ordinal} is out of range: the config lists "
            f"{len(layers)} PLE layers {layers}"
        )
    return layer_ordinal
