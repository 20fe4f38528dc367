import json

import numpy as np
import pytest

from flashnext.checkpoint.sources import SidecarSource
from flashnext.errors import FormatError, SidecarError
from flashnext.host import open_table
from flashnext.ple.formats import rel_rmse
from flashnext.records import check_record
from flashnext.store import open_sidecar, write_sidecar
from flashnext.store.quantize import STATE_NAME, quantize_table
from flashnext.synthetic import embedding_rows

from ..seeding import seeded_rng


@pytest.fixture(scope="module")
def source(tmp_path_factory, request):
    rng = seeded_rng(request.node.nodeid, request.fixturename)
    x = embedding_rows(3000, 160, rng)
    root = tmp_path_factory.mktemp("src")
    write_sidecar(root / "bf16", "bf16", x, 700)
    return root / "bf16", x


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
def test_streaming_workers_and_blocks_are_byte_identical(tmp_path, source, fmt):
    src, _ = source
    one = quantize_table(SidecarSource(src), tmp_path / "a", fmt, 1000, block_rows=1000)
    two = quantize_table(SidecarSource(src), tmp_path / "b", fmt, 1000, workers=2, block_rows=1000)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert one.shards_written == 3 and two.rel_rmse == one.rel_rmse
    # blocks smaller than a shard give the same tensors (only the float sums may differ)
    small = quantize_table(SidecarSource(src), tmp_path / "c", fmt, 1000, block_rows=333)
    for name in ("shard_0.safetensors", "shard_2.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "c" / name).read_bytes()
    assert small.rel_rmse == pytest.approx(one.rel_rmse, rel=1e-9)
    # the recorded error is the error of the stored table against the bf16 source
    table = open_table(tmp_path / "a")
    bf16 = open_table(src).lookup(np.arange(3000))
    assert one.rel_rmse == pytest.approx(rel_rmse(bf16, table.lookup(np.arange(3000))), rel=1e-6)
    assert not (tmp_path / "a" / STATE_NAME).exists()


def test_resume_keeps_verified_shards_and_redoes_the_rest(tmp_path, source):
    src, _ = source
    dst = tmp_path / "q"
    quantize_table(SidecarSource(src), dst, "int4", 500)
    reference = _files(dst)
    (dst / "shard_2.safetensors").unlink()
    corrupt = dst / "shard_4.safetensors"
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 1
    corrupt.write_bytes(bytes(data))
    again = quantize_table(SidecarSource(src), dst, "int4", 500)
    assert (again.shards_kept, again.shards_written) == (4, 2)
    assert _files(dst) == reference
    # other parameters: refused, named; --force replaces and keeps nothing
    with pytest.raises(
        SidecarError, match=r"finished table that differs \(rows_per_shard 500 -> 600\)"
    ):
        quantize_table(SidecarSource(src), dst, "int4", 600)
    assert _files(dst) == reference
    other = quantize_table(SidecarSource(src), dst, "int4", 600, force=True)
    assert (other.shards_kept, other.shards_written) == (0, 5)
    assert open_table(dst).sidecar.rows_per_shard == 600


class Interrupt(KeyboardInterrupt):
    """What Ctrl-C raises, injected after a given number of finished shards."""


def _interrupt_after(n):
    done = []

    def on_shard(res, rows):
        done.append(rows)
        if len(done) == n:
            raise Interrupt

    return on_shard


def test_interrupted_run_is_unfinished_then_resumes_byte_identical(tmp_path, source):
    src, _ = source
    clean = tmp_path / "clean"
    quantize_table(SidecarSource(src), clean, "nvfp4", 500)
    dst = tmp_path / "q"
    with pytest.raises(Interrupt):
        quantize_table(SidecarSource(src), dst, "nvfp4", 500, on_shard=_interrupt_after(2))
    state = check_record(json.loads((dst / STATE_NAME).read_text()), "flashnext.ple.quantize_state")
    assert state["num_shards"] == 6 and sorted(state["shards"]) == ["0", "1"]
    assert not (dst / "META.json").exists()
    with pytest.raises(SidecarError, match=r"unfinished: 2 of 6 shards, rerun the command"):
        open_sidecar(dst)
    again = quantize_table(SidecarSource(src), dst, "nvfp4", 500)
    assert (again.shards_kept, again.shards_written) == (2, 4)
    assert _files(dst) == _files(clean)


def test_non_finite_source_rows_are_named(tmp_path, rng):
    x = embedding_rows(300, 160, rng)
    x[217, 9] = np.inf
    x[250, 0] = np.nan
    # a bf16 table written around the codec's own check, as a corrupt checkpoint would be
    from flashnext.store.destination import SidecarWriter

    w = SidecarWriter(tmp_path / "bad", "bf16", 160, 300, 100)
    for i in range(3):
        w.write_shard(i, {"weight": x[i * 100 : (i + 1) * 100].astype(np.dtype("bfloat16"))})
    w.finish()
    with pytest.raises(
        FormatError,
        match=r"source row 217 column 9 is inf \(2 non-finite row\(s\) in rows \[200, 300\)\)",
    ):
        quantize_table(
            SidecarSource(tmp_path / "bad"), tmp_path / "out", "int4", 100, block_rows=100
        )


def test_an_interrupt_leaves_no_worker_and_no_pool_thread(tmp_path, source, monkeypatch):
    """An exception out of a worker run (the CLI turns SIGTERM into one) ends the workers and
    joins the pool's manager thread before it goes on: a manager left running races the
    interpreter's exit hook for its wakeup pipe (a traceback after the CLI's error line)."""
    import multiprocessing
    import threading
    import time
    from concurrent.futures import process

    src, _ = source
    # injected fault: a manager thread slow to wind down, as on a loaded machine (idle, it ends
    # within microseconds and the race cannot be seen)
    wind_down = process._ExecutorManagerThread.join_executor_internals

    def slow_wind_down(self):
        time.sleep(0.5)
        wind_down(self)

    monkeypatch.setattr(process._ExecutorManagerThread, "join_executor_internals", slow_wind_down)

    def interrupt(result, rows):
        if result is not None:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize_table(
            SidecarSource(src), tmp_path / "q", "int4", 500, workers=2, on_shard=interrupt
        )
    managers = [t for t in threading.enumerate() if type(t).__name__ == "_ExecutorManagerThread"]
    assert managers == [] and multiprocessing.active_children() == []


def test_quantize_from_opens_the_source_under_the_destinations_lock(tmp_path, source):
    """The library takes the lock before the (long) opening of the source: a second writer is
    refused before its source is opened, and the first holds the lock while it opens."""
    from flashnext.store.destination import DestinationLock
    from flashnext.store.quantize import quantize_from

    src, _ = source
    dst = tmp_path / "q"
    opened = []

    def open_source():
        with pytest.raises(SidecarError, match="another flashnext process"):
            DestinationLock(dst).acquire()  # held by quantize_from while the source opens
        opened.append(src)
        return SidecarSource(src)

    refused = pytest.raises(SidecarError, match=r"another flashnext process \(pid \d+\)")
    with DestinationLock(dst), refused:  # another writer holds dst: the source is never opened
        quantize_from(open_source, dst, "int4")
    assert opened == [] and not dst.exists()
    seen = []
    got, result = quantize_from(open_source, dst, "int4", on_source=seen.append)
    assert opened == [src] and seen == [got] and isinstance(got, SidecarSource)
    # rows per shard default to the source's (700); the result is quantize_table's own
    assert result.shards_written == 5 and open_sidecar(dst).rows_per_shard == 700
    alone = quantize_table(SidecarSource(src), tmp_path / "t", "int4", 700)
    assert _files(dst) == _files(alone.sidecar.path)
