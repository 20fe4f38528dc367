"""``flashnext demo``: the PLE pipeline end to end on synthetic data, timed.

1. Train a byte-level BPE on text found on this machine (the Python standard library's
   sources and licence texts), so token streams have the statistics of real text.
2. Build a BF16 table with the real geometry scaled down (``ngram_vocab_size_base`` 20,000
   instead of 20,000,000: 16 heads, width 160, 128 shards) and embedding-like values.
3. Quantize it to fp8, int4 and nvfp4 with the streaming quantizer.
4. Hash token streams (32 decode requests x 1 token; one 8K-token prefill) and time the
   lookups of every format, memory-mapped and resident.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flashnext.checkpoint.sources import SidecarSource
from flashnext.errors import SidecarError
from flashnext.host.table import open_table
from flashnext.placement import RESIDENCIES
from flashnext.ple.formats import BF16, FORMATS, rel_rmse
from flashnext.ple.geometry import PLEGeometry
from flashnext.ple.hashing import ngram_ids, ngram_ids_packed
from flashnext.store.destination import DestinationLock, recorded_source, write_sidecar
from flashnext.store.quantize import quantize_table
from flashnext.synthetic import embedding_rows, flash_next_config
from flashnext.text import EOS, corpus_files, token_stream, train_tokenizer

DECODE_REQUESTS = 32
PREFILL_TOKENS = 8192


@dataclass
class FormatRow:
    format: str
    size_bytes: int
    bytes_per_row: int
    rel_rmse: float
    decode_us: dict[str, float] = field(default_factory=dict)  # residency -> median µs
    prefill_ms: dict[str, float] = field(default_factory=dict)
    open_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class DemoResult:
    out_dir: str
    geometry: dict[str, Any]
    tokenizer_vocab: int
    corpus_bytes: int
    tokens_hashed: int
    hash_decode_us: float
    hash_prefill_ms: float
    rows: list[FormatRow]
    numpy_take_decode_us: float
    numpy_take_prefill_ms: float
    seconds: float


def _median_time(repeats: int, fn: Callable[..., object], *args: object) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_demo(
    out_dir: str | os.PathLike[str],
    base: int = 20_000,
    workers: int | None = None,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr),
) -> DemoResult:
    """Run the demo in ``out_dir`` (created) and return every number it measured.

    ``out_dir`` must be new, empty or an earlier demo's output (:func:`demo_output_problem`);
    an earlier demo's tables are rebuilt.

    The whole run holds ``out_dir``'s :class:`~flashnext.store.destination.DestinationLock`.

    Raises:
        SidecarError: ``out_dir`` holds anything else, or another process is writing it.
    """
    with DestinationLock(Path(out_dir)):  # two demos into one --out would mix their tables
        return _run_demo(Path(out_dir), base, workers, log)


def _run_demo(
    out_dir: Path, base: int, workers: int | None, log: Callable[[str], None]
) -> DemoResult:
    t0 = time.perf_counter()
    out = _prepare_out(out_dir)
    workers = workers or min(4, os.cpu_count() or 1)
    rng = np.random.default_rng()

    files = corpus_files()
    corpus_bytes = sum(p.stat().st_size for p in files)
    log(f"training a byte-level BPE on {len(files)} local files ({corpus_bytes / 1e6:.1f} MB)")
    tok = train_tokenizer(files)
    eos_id = tok.token_to_id(EOS)
    config = flash_next_config(
        vocab_size=tok.get_vocab_size(), eos_token_id=eos_id, ngram_vocab_size_base=base
    )
    geo = PLEGeometry.from_config(config)
    log(
        f"geometry: {geo.num_rows:,} rows x {geo.width} ({geo.num_heads} heads, "
        f"{geo.split_ngram_parts} shards of {geo.shard_rows():,} rows)"
    )
    tokens = token_stream(tok, files[-40:], eos_id)
    ids = _hashed_ids(geo, tokens, rng)

    log("building the synthetic BF16 table")
    source_rows = embedding_rows(geo.num_rows, geo.width, rng)
    bf16_dir = _write_bf16_source(out / "ple_bf16", geo, source_rows)
    bf16_rows = open_table(bf16_dir, "resident").lookup(np.arange(geo.num_rows))
    bf16_array = bf16_rows.astype(BF16)
    numpy_decode = _median_time(50, np.take, bf16_array, ids.decode, 0)
    numpy_prefill = _median_time(5, np.take, bf16_array, ids.prefill, 0)

    bf16_rmse = rel_rmse(source_rows, bf16_rows)
    rows = [_format_row(fmt, out, geo, bf16_rmse, ids, workers, log) for fmt in FORMATS]

    return DemoResult(
        out_dir=str(out),
        geometry=geo.to_dict(),
        tokenizer_vocab=tok.get_vocab_size(),
        corpus_bytes=corpus_bytes,
        tokens_hashed=int(tokens.size),
        hash_decode_us=ids.hash_decode_s * 1e6,
        hash_prefill_ms=ids.hash_prefill_s * 1e3,
        rows=rows,
        numpy_take_decode_us=numpy_decode * 1e6,
        numpy_take_prefill_ms=numpy_prefill * 1e3,
        seconds=time.perf_counter() - t0,
    )


def _format_row(
    fmt: str,
    out: Path,
    geo: PLEGeometry,
    bf16_rmse: float,
    ids: _HashedIds,
    workers: int,
    log: Callable[[str], None],
) -> FormatRow:
    """The BF16 table's row, or ``fmt``'s after quantizing the BF16 table into ``out``."""
    directory = out / f"ple_{fmt}"
    rmse = bf16_rmse
    if fmt != "bf16":
        log(f"quantizing to {fmt} ({workers} workers)")
        rmse = _quantize(out / "ple_bf16", directory, fmt, geo, workers)
    return _time_lookups(fmt, directory, geo.width, rmse, ids)


def _prepare_out(out: Path) -> Path:
    """``out`` created, with an earlier demo's tables removed (anything else refused)."""
    problem = demo_output_problem(out)
    if problem:
        raise SidecarError(problem)
    for name in DEMO_TABLES:  # the demo's own tables (checked above): rebuilt from scratch
        shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    return out


#: The temporary directories of runs without --out: ``flashnext-demo-PID-XXXX`` in the system's
#: temporary directory, each locked (:class:`DestinationLock`) while its run lives.
TEMP_PREFIX = "flashnext-demo-"


def demo_temp_prefix() -> str:
    """The prefix of this process's temporary demo directory (its pid inside)."""
    return f"{TEMP_PREFIX}{os.getpid()}-"


def remove_stale_temp_dirs(tmp: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the temporary directories of demo runs that died without cleaning up (SIGKILL,
    an OOM kill): only those whose lock no live process holds, or, without a lock file, whose
    pid is gone. Returns the directories removed."""
    root = Path(tmp if tmp is not None else tempfile.gettempdir())
    removed = []
    for entry in sorted(root.glob(f"{TEMP_PREFIX}*")):
        lock = DestinationLock(entry)
        dead = lock.abandoned()
        if dead is None:  # killed before it took the lock: its pid says
            pid = entry.name[len(TEMP_PREFIX) :].partition("-")[0]
            dead = pid.isdigit() and not _alive(int(pid))
        if dead and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            lock.path.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


#: The directories the demo writes in its output directory, one table per format.
DEMO_TABLES = tuple(f"ple_{fmt}" for fmt in FORMATS)
_GENERATOR = "flashnext.synthetic.embedding_rows"


def demo_output_problem(out: str | os.PathLike[str]) -> str | None:
    """Why the demo may not write into ``out``, or None: it must be missing, empty, or hold
    only tables an earlier demo wrote there (the demo never replaces anything else)."""
    root = Path(out)
    if not root.is_dir():
        return None
    bf16 = (root / "ple_bf16").resolve()
    for entry in sorted(root.iterdir()):
        table = entry.name in DEMO_TABLES and entry.is_dir() and not entry.is_symlink()
        source = recorded_source(entry) if table else None
        ours = source is not None and (
            source.get("generator") == _GENERATOR
            if entry.name == "ple_bf16"
            else source.get("kind") == "sidecar" and source.get("path") == str(bf16)
        )
        if not ours:
            return (
                f"{entry} was not written by `flashnext demo`; the demo only writes into a new "
                "or empty directory, or rebuilds its own tables: choose another --out"
            )
    return None


def _write_bf16_source(directory: Path, geo: PLEGeometry, source_rows: np.ndarray) -> Path:
    """Write ``source_rows`` (float32 [num_rows, width]) as the demo's BF16 sidecar."""
    write_sidecar(
        directory,
        "bf16",
        source_rows,
        geo.shard_rows(),
        geometry=geo.to_dict(),
        source={"kind": "synthetic", "generator": _GENERATOR},
    )
    return directory


def _quantize(bf16_dir: Path, directory: Path, fmt: str, geo: PLEGeometry, workers: int) -> float:
    """Quantize the BF16 sidecar to ``fmt`` in ``directory``; the relative RMSE."""
    result = quantize_table(
        SidecarSource(bf16_dir),
        directory,
        fmt,
        geo.shard_rows(),
        workers=workers,
        geometry=geo.to_dict(),
    )
    return result.rel_rmse


@dataclass
class _HashedIds:
    decode: np.ndarray  # int64 [DECODE_REQUESTS, heads]: one decode step of a batch
    prefill: np.ndarray  # int64 [PREFILL_TOKENS, heads]: one prefill
    hash_decode_s: float  # median time to hash ``decode``
    hash_prefill_s: float  # median time to hash ``prefill``


def _hashed_ids(geo: PLEGeometry, tokens: np.ndarray, rng: np.random.Generator) -> _HashedIds:
    """Row ids of a decode step (random positions of ``tokens``) and a prefill, timed."""
    prefill = tokens[:PREFILL_TOKENS]
    starts = rng.integers(2, tokens.size, size=DECODE_REQUESTS)
    decode_tokens = tokens[starts]
    decode_ctx = np.stack([tokens[s - 2 : s] for s in starts])
    qsl = np.arange(DECODE_REQUESTS + 1)
    return _HashedIds(
        decode=ngram_ids_packed(geo, decode_tokens, qsl, decode_ctx),
        prefill=ngram_ids(geo, prefill),
        hash_decode_s=_median_time(50, ngram_ids_packed, geo, decode_tokens, qsl, decode_ctx),
        hash_prefill_s=_median_time(5, ngram_ids, geo, prefill),
    )


def _time_lookups(fmt: str, directory: Path, width: int, rmse: float, ids: _HashedIds) -> FormatRow:
    """Size on disk and open/decode/prefill lookup times of the table in ``directory``."""
    size = sum(p.stat().st_size for p in directory.glob("shard_*.safetensors"))
    row = FormatRow(fmt, size, open_table(directory).codec.bytes_per_row(width), rmse)
    for residency in RESIDENCIES:
        t = time.perf_counter()
        table = open_table(directory, residency)
        row.open_ms[residency] = (time.perf_counter() - t) * 1e3
        table.lookup(ids.prefill)  # warm the page cache / first touch
        row.decode_us[residency] = _median_time(30, table.lookup, ids.decode) * 1e6
        row.prefill_ms[residency] = _median_time(3, table.lookup, ids.prefill) * 1e3
        table.close()
    return row
