"""Issue 22 rules 4, 6 and 9 for ple quantize, ple profile and demo.

Checks before work, errors that name the user's path (never a temporary name, never no name on a
full disk), a failed ``--force`` on a full disk that leaves nothing holding the space, SIGTERM
that cleans up (no temporary directory, no leaked semaphore), a profile of no rows refused,
coverage counted before ``--rows`` truncates, and ``--workers`` capped with a note.

Full disks are real: a 2 MiB tmpfs mounted in a private mount namespace (``unshare``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashnext.atomic import temp_name, write_json
from flashnext.store import open_sidecar, write_sidecar
from flashnext.store.profile import load_profile
from flashnext.synthetic import embedding_rows

from .inputs import ProfileInputs, build_profile_inputs
from .runner import popen, run_in_process
from .runner import run_ok_here as run_ok

LINUX = sys.platform.startswith("linux")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OPENBLAS_NUM_THREADS": "1", "COLUMNS": "200", **extra}


def _wait_for(proc: subprocess.Popen[str], condition, deadline_s: float = 180) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.02)


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and lines and lines[-1].startswith("error: "), err[-3000:]
    return lines[-1]


@pytest.fixture(scope="module")
def profile_inputs(tmp_path_factory: pytest.TempPathFactory) -> ProfileInputs:
    return build_profile_inputs(tmp_path_factory.mktemp("faults") / "in")


# -- ple profile --------------------------------------------------------------------------
def test_profile_rows_5_reports_coverage_of_the_whole_profile(profile_inputs, tmp_path, capsys):
    base = ["ple", "profile", profile_inputs.sidecar, "--text", profile_inputs.text]
    base += ["--tokenizer", profile_inputs.tokenizer, "--json"]
    code, out, err = run_in_process([*base, "--output", tmp_path / "all.safetensors"], capsys)
    assert code == 0, err
    everything = json.loads(out)
    code, out, err = run_in_process(
        [*base, "--rows", "5", "--output", tmp_path / "five.safetensors"], capsys
    )
    assert code == 0, err
    five = json.loads(out)
    assert five["rows"] == 5 and everything["rows"] > 100
    assert five["coverage_by_table_share"] == everything["coverage_by_table_share"]
    full = load_profile(tmp_path / "all.safetensors")
    for tier in five["coverage_by_table_share"].values():  # against the full counts, here
        assert tier["coverage"] == pytest.approx(full.coverage(tier["rows"]), rel=1e-12)
    assert five["coverage_of_lookups"] == pytest.approx(full.coverage(5), rel=1e-12)
    tiers = five["coverage_by_table_share"].values()  # counted past the 5 rows kept
    assert any(t["rows"] > 5 and t["coverage"] > five["coverage_of_lookups"] for t in tiers)


def test_profile_of_no_rows_is_refused_and_not_written(profile_inputs, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    target = tmp_path / "p.safetensors"
    argv = ["ple", "profile", profile_inputs.sidecar, "--text", empty, "--output", target]
    code, _, err = run_in_process([*argv, "--tokenizer", profile_inputs.tokenizer], capsys)
    line = _error_line(err)
    assert code == 1 and "no rows" in line and str(target) in line
    assert sorted(os.listdir(tmp_path)) == ["empty.txt"]


def test_profile_checks_out_before_hashing(profile_inputs, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    argv = ["ple", "profile", profile_inputs.sidecar, "--text", profile_inputs.text]
    argv += ["--tokenizer", profile_inputs.tokenizer, "--output", tmp_path / "afile" / "p"]
    code, _, err = run_in_process(argv, capsys)
    assert code == 2 and "afile" in _error_line(err) and "hashing text" not in err


def test_profile_default_output_is_beside_the_sidecar_and_quantize_resumes(
    profile_inputs, tmp_path, capsys
):
    sidecar = tmp_path / "s"
    make = ["ple", "quantize", profile_inputs.sidecar, sidecar, "--format", "fp8", "--json"]
    code, _, err = run_in_process(make, capsys)
    assert code == 0, err
    argv = ["ple", "profile", sidecar, "--text", profile_inputs.text]
    code, _, err = run_in_process([*argv, "--tokenizer", profile_inputs.tokenizer], capsys)
    assert code == 0, err
    assert (tmp_path / "s.profile.safetensors").is_file()
    assert not (sidecar / "profile.safetensors").exists()
    # the sidecar is still exactly the quantizer's output: the same command resumes (keeps all)
    code, out, err = run_in_process(make, capsys)
    assert code == 0, err
    assert json.loads(out)["shards_kept"] == json.loads(out)["num_shards"]
    code, _, err = run_in_process([*make, "--force"], capsys)
    assert code == 0 and (tmp_path / "s.profile.safetensors").is_file(), err


# -- demo ---------------------------------------------------------------------------------
def test_demo_never_replaces_a_table_it_did_not_write(tmp_path, rng, capsys):
    out = tmp_path / "dd"
    write_sidecar(out / "ple_int4", "int4", embedding_rows(300, 160, rng), 100)
    before = _digests(out / "ple_int4")
    code, _, err = run_in_process(["demo", "--base", "1000", "--out", out], capsys)
    line = _error_line(err)
    assert code == 2 and str(out / "ple_int4") in line and "not written by `flashnext demo`" in line
    assert _digests(out / "ple_int4") == before and os.listdir(out) == ["ple_int4"]


# -- errors name the user's path ----------------------------------------------------------
def test_atomic_errors_name_the_final_path_not_the_temporary_one(tmp_path):
    final = tmp_path / "v2"
    final.mkdir()
    with pytest.raises(IsADirectoryError) as caught:
        write_json(final, {"a": 1})
    assert caught.value.filename == str(final) and ".tmp-" not in str(caught.value)
    assert os.listdir(tmp_path) == ["v2"] and not temp_name(final).exists()


def _in_small_tmpfs(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (bash) with a fresh 2 MiB tmpfs at $D, in a private mount namespace."""
    if not shutil.which("unshare"):
        pytest.skip("needs util-linux unshare for a real full disk")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no unprivileged mount namespace here: {probe.stderr.decode()[:200]}")
    full = f'set -e; mount -t tmpfs -o size=2m tmpfs "$D"; set +e; {script}'
    return subprocess.run(
        ["unshare", "-rm", "bash", "-c", full],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(**env),
    )


def _digests(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


@pytest.mark.skipif(not LINUX, reason="tmpfs in a mount namespace")
def test_full_disk_force_run_frees_its_work_and_keeps_the_old_table(tmp_path, rng):
    write_sidecar(tmp_path / "src", "bf16", embedding_rows(8000, 160, rng), 2000)  # 2.6 MB
    write_sidecar(tmp_path / "old", "fp8", embedding_rows(300, 160, rng), 100)
    mount = tmp_path / "mnt"
    mount.mkdir()
    script = (
        'cp -r "$OLD" "$D/dst"; '
        f'"{sys.executable}" -m flashnext ple quantize "$SRC" "$D/dst" --format bf16 --force; '
        'echo "rc=$?"; ls -a "$D"; cd "$D/dst" && sha256sum * '
    )
    done = _in_small_tmpfs(
        script, D=str(mount), SRC=str(tmp_path / "src"), OLD=str(tmp_path / "old")
    )
    line = _error_line(done.stderr)
    assert "rc=1" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "No space left" in line and str(mount) in line and ".tmp-" not in line, line
    assert "(the old table is intact)" in line, line
    listing = done.stdout.split("rc=1", 1)[1]
    assert ".dst.flashnext-new" not in listing and ".dst.flashnext-lock" not in listing, listing
    after = dict(reversed(row.split()) for row in listing.splitlines() if "  " in row)
    assert after == _digests(tmp_path / "old")  # the old table, byte for byte


@pytest.mark.skipif(not LINUX, reason="tmpfs in a mount namespace")
def test_full_disk_error_names_a_file_and_the_rerun_resumes(tmp_path, rng):
    write_sidecar(tmp_path / "src", "bf16", embedding_rows(8000, 160, rng), 2000)
    mount = tmp_path / "mnt"
    mount.mkdir()
    script = (
        f'"{sys.executable}" -m flashnext ple quantize "$SRC" "$D/dst" --format bf16; '
        'echo "rc=$?"; ls -a "$D/dst"'
    )
    done = _in_small_tmpfs(script, D=str(mount), SRC=str(tmp_path / "src"))
    line = _error_line(done.stderr)
    assert "rc=1" in done.stdout and "No space left" in line, done.stdout + line
    assert f"{mount}/dst/" in line and ".tmp-" not in line, line
    assert "(finished shards are kept for a rerun)" in line, line
    assert ".flashnext-quantize.json" in done.stdout  # unfinished: the next run resumes


# -- SIGTERM ------------------------------------------------------------------------------
@pytest.mark.skipif(not LINUX, reason="POSIX signals")
def test_sigterm_of_demo_removes_its_temporary_directory(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = popen("demo", "--base", "1000", env={"TMPDIR": str(tmp)})
    _wait_for(proc, lambda: any(p.name.startswith("flashnext-demo-") for p in tmp.iterdir()))
    time.sleep(1.0)  # well inside the work
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert _error_line(err) == "error: terminated (SIGTERM)" and "Traceback" not in err, err
    assert os.listdir(tmp) == []


@pytest.mark.skipif(not LINUX, reason="POSIX signals")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_of_quantize_stops_workers_cleanly_and_resumes(tmp_path, rng, sig):
    from .hooks import hooked

    write_sidecar(tmp_path / "src", "bf16", embedding_rows(16000, 160, rng), 2000)
    dst = tmp_path / "dst"
    # the signal right after the first worker's shard is adopted: the pool is up and the other
    # worker busy, the case that used to leave the pool's semaphores to the resource tracker
    # (a hook, not a wait: the 8 small shards are done within ~0.1 s of the first)
    first = ("flashnext.store.destination:SidecarDestination.adopt", "after", 1)
    argv = ["ple", "quantize", tmp_path / "src", dst, "--format", "int4", "--workers", "2"]
    # SIGINT at its default in the child, as a terminal's foreground job has it (a suite started
    # as a background job inherits it ignored, and Python then installs no KeyboardInterrupt)
    proc = subprocess.Popen(hooked(first, sig.name, *argv), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert "leaked semaphore" not in err and "resource_tracker" not in err, err
    if sig == signal.SIGTERM:
        assert _error_line(err) == "error: terminated (SIGTERM)" and "Traceback" not in err, err
    # issue 42: not a bare "aborted": what was kept, and how to go on
    said = [line for line in err.splitlines() if line.startswith("interrupted: ")]
    assert len(said) == 1 and "aborted" not in err and "Traceback" not in err, err
    assert re.fullmatch(
        rf"interrupted: [0-7] of 8 shards are written and kept in {re.escape(str(dst))}; run the "
        r"same command again to resume \(finished shards are checked and kept, not redone\)",
        said[0],
    ), said
    run_ok("ple", "quantize", tmp_path / "src", dst, "--format", "int4", "--workers", "2")
    whole = tmp_path / "whole"
    run_ok("ple", "quantize", tmp_path / "src", whole, "--format", "int4")
    assert _digests(dst) == _digests(whole)  # resumed == uninterrupted, byte for byte
    assert open_sidecar(dst).format == "int4"


def test_workers_are_capped_and_the_cap_is_said(tmp_path, rng, capsys):
    write_sidecar(tmp_path / "src", "bf16", embedding_rows(400, 160, rng), 200)
    argv = ["ple", "quantize", tmp_path / "src", tmp_path / "d", "--format", "fp8"]
    code, out, err = run_in_process([*argv, "--workers", "200", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["workers"] <= 2
    assert "--workers 200: using" in err and "(2 shards," in err


@pytest.mark.skipif(not LINUX, reason="SIGKILL, flock as on Linux")
def test_demo_removes_the_temporary_directories_of_killed_runs_only(tmp_path):
    """Issue 42: a demo killed by SIGKILL leaves its /tmp/flashnext-demo-*; the next demo removes
    it, and every other dead run's, but never a live run's nor one it cannot judge."""
    from flashnext.store.destination import DestinationLock

    from .hooks import hooked

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    locked = ("flashnext.store.destination:DestinationLock.acquire", "after", 1)
    killed = subprocess.run(hooked(locked, "SIGKILL", "demo", "--base", "1000"), env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    (left,) = [p for p in tmp.iterdir() if p.is_dir()]  # its directory, its lock file beside
    dead_pid = tmp / "flashnext-demo-999999999-x"  # killed before it took its lock
    alive = tmp / f"flashnext-demo-{os.getpid()}-alive"  # a live run that has no lock yet
    held = tmp / f"flashnext-demo-{os.getpid()}-held"  # a live run holding its lock
    old = tmp / "flashnext-demo-abc123"  # an older flashnext's: no pid, no lock: not judged
    for d in (dead_pid, alive, held, old):
        d.mkdir()
        (d / "f").write_text("x")
    with DestinationLock(held):
        start = ("flashnext.demo:run_demo", "before", 1)  # after the clean-up: stop there
        again = subprocess.run(hooked(start, "SIGKILL", "demo", "--base", "1000"), env=env,
                               capture_output=True, text=True, timeout=300)  # fmt: skip
        assert again.returncode == -signal.SIGKILL, again.stderr[-2000:]
        assert f"removed {left}, left by a demo run that was killed" in again.stderr
        assert f"removed {dead_pid}" in again.stderr
        kept = {p.name for p in tmp.iterdir() if p.is_dir()}
    assert {alive.name, held.name, old.name} <= kept
    assert left.name not in kept and dead_pid.name not in kept
    assert not (tmp / f".{left.name}.flashnext-lock").exists()
