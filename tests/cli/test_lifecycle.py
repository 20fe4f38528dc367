"""Nothing lost, nothing silently wrong (issue 8): quantize destinations, unfinished and
foreign sidecars, changed or corrupt sources, absurd META.json, orphaned workers, and a table of
bad inputs that must each end in one ``error:`` line.

Everything runs the real console command in a fresh interpreter, on real files. Where file
permissions matter and the tests run as root, the child drops CAP_DAC_OVERRIDE and
CAP_DAC_READ_SEARCH (root otherwise bypasses permissions), so it is refused as any user is.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from flashnext.host import open_table
from flashnext.store import open_sidecar, write_sidecar
from flashnext.store.destination import SidecarWriter
from flashnext.synthetic import embedding_rows

from .runner import assert_one_line_error, drop_file_permission_override, popen
from .runner import run_here as run

LINUX = sys.platform.startswith("linux")


def _limit_memory() -> None:
    """preexec_fn: 2 GiB of address space, so a runaway allocation fails instead of the host."""
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def bf16_sidecar(path: Path, rng, rows=1200, per_shard=300) -> np.ndarray:
    x = embedding_rows(rows, 160, rng)
    write_sidecar(path, "bf16", x, per_shard)
    return x


# -- finding 1: a non-empty destination is never overwritten without --force ---------------
def test_1_foreign_destination_is_refused_and_kept(tmp_path, rng):
    bf16_sidecar(tmp_path / "src", rng)
    dst = tmp_path / "dst"
    write_sidecar(dst, "fp8", embedding_rows(200, 160, rng), 100)
    shutil.copy(dst / "shard_1.safetensors", dst / "shard_99.safetensors")
    (dst / "notes.txt").write_text("mine")
    before = snapshot(dst)
    proc = run("ple", "quantize", tmp_path / "src", dst, "--format", "int4")
    assert_one_line_error(proc, str(dst), "notes.txt", "shard_99.safetensors", "--force")
    assert snapshot(dst) == before
    forced = run("ple", "quantize", tmp_path / "src", dst, "--format", "int4", "--force")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert sorted(p.name for p in dst.iterdir()) == ["META.json"] + [
        f"shard_{i}.safetensors" for i in range(4)
    ]
    assert open_sidecar(dst).format == "int4"
    assert [p.name for p in tmp_path.iterdir() if "flashnext" in p.name] == []


def test_1_force_replaces_a_table_not_a_folder_of_them(tmp_path, rng):
    """The typo ``ple`` for ``ple/layer_11`` with --force: a folder holding the layers'
    sidecars (or anything that is not a table) is refused and left as it was."""
    bf16_sidecar(tmp_path / "src", rng, rows=600)
    ple = tmp_path / "ple"
    for layer in ("layer_11", "layer_23"):
        write_sidecar(ple / layer, "fp8", embedding_rows(200, 160, rng), 100)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    for dst, named in ((ple, "holds directories (layer_11, layer_23)"),
                       (notes, "holds todo.txt but no shard_N.safetensors")):  # fmt: skip
        before = snapshot(dst)
        proc = run("ple", "quantize", tmp_path / "src", dst, "--format", "int4", "--force")
        assert_one_line_error(proc, str(dst), named, "--force replaces a sidecar table")
        assert snapshot(dst) == before
    forced = run("ple", "quantize", tmp_path / "src", ple / "layer_11", "--format", "int4",
                 "--force")  # fmt: skip
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert open_sidecar(ple / "layer_11").format == "int4"
    assert open_sidecar(ple / "layer_23").format == "fp8"


def test_1_a_symlinked_destination_is_the_directory_it_names(tmp_path, rng):
    """--force through a link replaces the linked directory (the link stays a link), and the
    lock is the directory's, whichever name a writer uses."""
    bf16_sidecar(tmp_path / "src", rng, rows=600)
    target = tmp_path / "disk" / "t"
    write_sidecar(target, "fp8", embedding_rows(200, 160, rng), 100)
    link = tmp_path / "t_link"
    link.symlink_to(target)
    forced = run("ple", "quantize", tmp_path / "src", link, "--format", "int4", "--force")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert link.is_symlink() and open_sidecar(target).format == "int4"
    assert [p.name for p in tmp_path.iterdir() if "flashnext" in p.name] == []
    from flashnext.store.destination import DestinationLock

    with DestinationLock(target):  # a writer through the directory's own name
        proc = run("ple", "quantize", tmp_path / "src", link, "--format", "fp8", "--force")
    assert_one_line_error(proc, "another flashnext process", str(target))
    assert open_sidecar(target).format == "int4"


# -- finding 2: a failed rerun leaves a finished destination exactly as it was -------------
def test_2_failed_rerun_leaves_finished_table_intact(tmp_path, rng):
    bf16_sidecar(tmp_path / "a", rng)
    dst = tmp_path / "dst"
    assert run("ple", "quantize", tmp_path / "a", dst, "--format", "int4").returncode == 0
    before = snapshot(dst)
    # source b: a bf16 table with a NaN in its last shard, written around the codec's check
    x = embedding_rows(1200, 160, rng)
    x[1000, 3] = np.nan
    w = SidecarWriter(tmp_path / "b", "bf16", 160, 1200, 300)
    for i in range(4):
        w.write_shard(i, {"weight": x[i * 300 : (i + 1) * 300].astype(ml_dtypes.bfloat16)})
    w.finish()
    for extra in ([], ["--force"]):
        proc = run("ple", "quantize", tmp_path / "b", dst, "--format", "int4", *extra)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert snapshot(dst) == before, extra
        info = run("ple", "info", dst, "--json")
        assert info.returncode == 0 and json.loads(info.stdout)["checksums"] == "ok"


def _kill_when(proc, condition, deadline_s=60.0):
    """SIGKILL ``proc`` once ``condition()`` holds; assert it was still running then."""
    deadline = time.monotonic() + deadline_s
    try:
        while not condition():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "condition never held"
            time.sleep(0.01)
        assert proc.poll() is None, "finished before it could be interrupted"
    finally:
        proc.kill()
        proc.wait()


def _start_quantize(src, dst, *opts):
    return popen("ple", "quantize", src, dst, *opts)


@pytest.fixture
def long_source(tmp_path, rng):
    """A bf16 source large enough that an nvfp4 conversion takes a few seconds."""
    bf16_sidecar(tmp_path / "long", rng, rows=24 * 1024, per_shard=1024)
    return tmp_path / "long"


# -- finding 3: an interrupted output is refused as unfinished, not read as a short table -----
def test_3_interrupted_output_is_unfinished(tmp_path, long_source):
    dst = tmp_path / "dst"
    proc = _start_quantize(long_source, dst, "--format", "nvfp4")
    _kill_when(proc, lambda: (dst / "shard_1.safetensors").exists())
    for cmd in (["info", dst], ["lookup", dst, "--ids", "0"]):
        out = run("ple", *cmd)
        assert_one_line_error(out, "unfinished: ", "of 24 shards, rerun the command that made it")
    # the same command again finishes it
    again = run("ple", "quantize", long_source, dst, "--format", "nvfp4", "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    assert open_sidecar(dst).num_rows == 24 * 1024


# -- finding 4: a changed or corrupt source is noticed ------------------------------------
def test_4_regenerated_source_is_not_resumed(tmp_path, rng):
    src, dst, fresh = tmp_path / "src", tmp_path / "dst", tmp_path / "fresh"
    bf16_sidecar(src, rng)
    assert run("ple", "quantize", src, dst, "--format", "fp8").returncode == 0
    shutil.rmtree(src)
    bf16_sidecar(src, rng)  # regenerated at the same path: same sizes, other rows
    before = snapshot(dst)
    proc = run("ple", "quantize", src, dst, "--format", "fp8")
    assert_one_line_error(proc, "source changed since", "--force")
    assert snapshot(dst) == before
    assert run("ple", "quantize", src, dst, "--format", "fp8", "--force").returncode == 0
    assert run("ple", "quantize", src, fresh, "--format", "fp8").returncode == 0
    for i in range(4):
        name = f"shard_{i}.safetensors"
        assert (dst / name).read_bytes() == (fresh / name).read_bytes()


def test_4_source_failing_its_checksums_is_refused(tmp_path, rng):
    src = tmp_path / "src"
    bf16_sidecar(src, rng)
    shard = src / "shard_2.safetensors"
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x01  # same size, other bytes: only the checksum can tell
    shard.write_bytes(bytes(data))
    proc = run("ple", "quantize", src, tmp_path / "dst", "--format", "int4")
    assert_one_line_error(proc, "shard_2.safetensors", "--ignore-source-checksums")
    assert not (tmp_path / "dst").exists()
    ok = run(
        "ple", "quantize", src, tmp_path / "dst", "--format", "int4", "--ignore-source-checksums"
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    meta = json.loads((tmp_path / "dst" / "META.json").read_text())
    assert meta["source"]["checksum_mismatch_accepted"] == ["shard_2.safetensors"]
    # `ple info` keeps saying so (the table itself is whole: exit 0)
    info = run("ple", "info", tmp_path / "dst", "--json")
    assert info.returncode == 0 and json.loads(info.stdout)["source_checksums_ignored"] == [
        "shard_2.safetensors"
    ]
    human = run("ple", "info", tmp_path / "dst")
    assert "1 shards failed their own checksum" in " ".join(human.stdout.split())


# -- finding 5: without META.json, order and extent must be unambiguous ---------------------
def test_5_swapped_or_stray_shards_without_meta_are_refused(tmp_path, rng):
    root = tmp_path / "t"
    write_sidecar(root, "int4", embedding_rows(200, 160, rng), 50)
    (root / "META.json").unlink()
    assert open_sidecar(root).num_rows == 200  # unambiguous: still read
    stray = root / "shard_4.safetensors"
    shutil.copy(root / "shard_1.safetensors", stray)
    assert_one_line_error(
        run("ple", "info", root), "shard_4.safetensors", "row_start 50", "starts at row 200"
    )
    stray.unlink()
    a, b = root / "shard_0.safetensors", root / "shard_1.safetensors"
    a.rename(tmp_path / "tmp")
    b.rename(a)
    (tmp_path / "tmp").rename(b)
    assert_one_line_error(run("ple", "info", root), "shard_0.safetensors", "row_start 50")


# -- finding 7: META.json numbers are bounded before anything is allocated ------------------
@pytest.mark.parametrize(
    ("meta", "stray", "fragment"),
    [
        ({"num_shards": 10**9}, None, "num_shards=1000000000, expected an integer in [1, "),
        ({"num_rows": 2**62}, None, "num_rows=4611686018427387904"),
        ({}, "shard_999999999.safetensors", "shard_999999999.safetensors does not belong"),
    ],
)
def test_7_absurd_numbers_fail_fast(tmp_path, rng, meta, stray, fragment):
    root = tmp_path / "t"
    write_sidecar(root, "fp8", embedding_rows(100, 160, rng), 50)
    (root / "META.json").write_text(json.dumps(meta))
    if stray:
        shutil.copy(root / "shard_1.safetensors", root / stray)
    t0 = time.monotonic()
    proc = run("ple", "info", root, preexec=_limit_memory, timeout=60)
    assert_one_line_error(proc, fragment)
    assert time.monotonic() - t0 < 30


# -- finding 8: workers die with their parent ---------------------------------------------
def _children(pid: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not LINUX, reason="reads the process tree from /proc")
def test_8_sigkill_of_parent_ends_the_workers(tmp_path, long_source):
    dst = tmp_path / "dst"
    proc = _start_quantize(long_source, dst, "--format", "nvfp4", "--workers", "2")
    workers: set[int] = set()

    def working() -> bool:
        workers.update(_children(proc.pid))
        return len(workers) >= 2 and (dst / "shard_0.safetensors").exists()

    _kill_when(proc, working)
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in workers if _alive(p)]
    for p in left:  # do not leave them behind when the test fails
        os.kill(p, signal.SIGKILL)
    assert not left, f"{len(left)} of {len(workers)} child processes outlived the parent"


# -- the bad inputs that used to end in a traceback or an unclear message ------------------
def _good(root: Path, rng, fmt="int4", rows=200, per_shard=50) -> Path:
    write_sidecar(root, fmt, embedding_rows(rows, 160, rng), per_shard)
    return root


def case_shard_is_directory(tmp, rng):
    root = _good(tmp / "t", rng)
    (root / "shard_2.safetensors").unlink()
    (root / "shard_2.safetensors").mkdir()
    return ["ple", "info", root], ["shard_2.safetensors", "is not a file"]


def case_quantize_source_shard_is_directory(tmp, rng):
    args, expect = case_shard_is_directory(tmp, rng)
    return ["ple", "quantize", args[2], tmp / "out", "--format", "fp8"], expect


def case_unreadable_shard(tmp, rng):
    root = _good(tmp / "t", rng)
    (root / "shard_1.safetensors").chmod(0)
    return ["ple", "info", root], ["shard_1.safetensors", "cannot read", "Permission denied"]


def case_unreadable_directory(tmp, rng):
    root = _good(tmp / "t", rng)
    root.chmod(0)
    return ["ple", "info", root], [str(root), "not readable"], 2


def case_unreadable_source_for_quantize(tmp, rng):
    root = _good(tmp / "t", rng)
    (root / "shard_3.safetensors").chmod(0)
    return ["ple", "quantize", root, tmp / "out", "--format", "fp8"], ["shard_3", "cannot read"]


def case_unwritable_destination(tmp, rng):
    root = _good(tmp / "t", rng)
    locked = tmp / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    # The DST type checks writability before any work: a usage error (exit 2).
    return ["ple", "quantize", root, locked / "out", "--format", "fp8"], [
        str(locked),
        "not writable",
    ], 2


def case_stray_shard_7(tmp, rng):
    root = _good(tmp / "t", rng, rows=150)
    (root / "META.json").unlink()
    shutil.copy(root / "shard_1.safetensors", root / "shard_7.safetensors")
    return ["ple", "info", root], ["shard_7.safetensors does not belong", "missing"]


def case_unreadable_meta(tmp, rng):
    root = _good(tmp / "t", rng)
    (root / "META.json").chmod(0)
    return ["ple", "info", root], ["META.json: cannot read", "Permission denied"]


def case_width_error_names_path(tmp, rng):
    root = _good(tmp / "t", rng)
    meta = json.loads((root / "META.json").read_text())
    (root / "META.json").write_text(json.dumps({**meta, "width": 150}))
    return ["ple", "info", root], [str(root), "width 150"]


def case_zero_row_sidecar(tmp, rng):
    root = tmp / "t"
    root.mkdir()
    from safetensors.numpy import save_file

    save_file(
        {"weight_fp8": np.zeros((0, 160), np.uint8), "weight_scale": np.zeros(0, np.float32)},
        str(root / "shard_0.safetensors"),
    )
    return ["ple", "info", root], ["shard_0.safetensors", "0 rows"]


CASES = [
    case_shard_is_directory,
    case_quantize_source_shard_is_directory,
    case_unreadable_shard,
    case_unreadable_directory,
    case_unreadable_source_for_quantize,
    case_unwritable_destination,
    case_stray_shard_7,
    case_unreadable_meta,
    case_width_error_names_path,
    case_zero_row_sidecar,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.removeprefix("case_") for c in CASES])
def test_bad_input_is_one_line(tmp_path, rng, case):
    args, fragments, *code = case(tmp_path, rng)
    try:
        proc = run(*args, unprivileged=True)
    finally:
        for p in [tmp_path / "t", tmp_path / "locked", *tmp_path.rglob("*")]:  # for cleanup
            if p.exists() and not p.is_symlink():
                p.chmod(0o700)
    assert_one_line_error(proc, *fragments, code=code[0] if code else 1)


def test_reader_refuses_unreadable_directory_in_one_error(tmp_path, rng):
    """The library itself (not only click's path check) names an unreadable directory."""
    root = _good(tmp_path / "t", rng)
    root.chmod(0)
    code = (
        "import sys\nfrom flashnext.store import open_sidecar\nfrom flashnext.errors import "
        "SidecarError\ntry:\n    open_sidecar(sys.argv[1])\nexcept SidecarError as e:\n"
        "    print(e)\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(root)],
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=drop_file_permission_override if os.geteuid() == 0 else None,
        )
    finally:
        root.chmod(0o700)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert str(root) in proc.stdout and "Permission denied" in proc.stdout, proc.stdout


@pytest.mark.parametrize("ids", ["99999999999999999999", "18446744073709551615", "-2"])
def test_ids_outside_int64_or_below_padding(tmp_path, rng, ids):
    root = _good(tmp_path / "t", rng)
    proc = run("ple", "lookup", root, "--ids", f"0,{ids}")
    assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr, proc.stderr
    assert ids in proc.stderr


def test_unsigned_ids_that_would_wrap_are_refused(tmp_path, rng):
    root = _good(tmp_path / "t", rng)
    table = open_table(root)
    with pytest.raises(IndexError, match="does not fit in int64"):
        table.lookup(np.array([3, 2**64 - 1], dtype=np.uint64))
    np.testing.assert_array_equal(
        table.lookup(np.array([3], dtype=np.uint64)), table.lookup(np.array([3]))
    )
