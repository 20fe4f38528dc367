"""Issue 42: records that see what changed.

A real process (the small OpenAI-compatible server of tests/cli) listens with
``FLASHNEXT_PLE_SIDECAR`` in its environment; ``record capture`` finds it by port, as it finds
vLLM. Re-quantizing the sidecar at the same path between two captures must show in ``record
diff`` (the environment alone is equal); a directory of per-layer sidecars is compared table by
table; ``launch.source`` is compared; ``--model`` naming another checkpoint than the one served
is refused with one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from flashnext.deploy.record_diff import record_diff
from flashnext.store import write_sidecar
from flashnext.synthetic import embedding_rows

from ..cli.inputs import Inputs, deployment_record
from ..cli.runner import assert_one_line_error, run, run_ok
from ..cli.servers import openai_server


def _capture(tmp: Path, name: str, **server: object) -> Path:
    out = tmp / f"{name}.json"
    with openai_server(tmp, **server) as srv:  # type: ignore[arg-type]
        run_ok("record", "capture", "--url", srv.url, "--output", out)
    return out


def _changes(a: Path, b: Path) -> list:
    """record_diff of two captures, less the server's --port-file (new at each start)."""
    found = record_diff(json.loads(a.read_text()), json.loads(b.read_text()))
    return [c for c in found if c.name != "--port-file"]


def _table(path: Path, fmt: str, rng) -> None:
    shutil.rmtree(path, ignore_errors=True)
    write_sidecar(path, fmt, embedding_rows(300, 160, rng), 100)


def test_requantizing_the_sidecar_at_the_same_path_is_a_change(tmp_path: Path, rng) -> None:
    side = tmp_path / "ple"
    _table(side, "int4", rng)
    env = {"FLASHNEXT_PLE_SIDECAR": str(side)}
    a = _capture(tmp_path, "a", env=env)
    _table(side, "nvfp4", rng)
    b = _capture(tmp_path, "b", env=env)
    rec = json.loads(b.read_text())
    assert rec["plugin"]["sidecar"]["tables"][""]["format"] == "nvfp4"
    p = run("record", "diff", a, b)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "sidecar format: 'int4' -> 'nvfp4'" in p.stdout, p.stdout
    assert "sidecar meta_sha256" in p.stdout
    # the same table, captured again: no change at all
    c = _capture(tmp_path, "c", env=env)
    assert _changes(b, c) == []


def test_a_directory_of_layer_sidecars_is_compared_table_by_table(tmp_path: Path, rng) -> None:
    root = tmp_path / "ple"
    for layer in (3, 7):
        _table(root / f"layer_{layer}", "fp8", rng)
    env = {"FLASHNEXT_PLE_SIDECAR": str(root)}
    a = _capture(tmp_path, "a", env=env)
    _table(root / "layer_7", "fp8", rng)  # rewritten: same format, other rows
    b = _capture(tmp_path, "b", env=env)
    changes = _changes(a, b)
    assert [c.name for c in changes] == ["sidecar layer_7 meta_sha256"]
    assert changes[0].variable and changes[0].group == "model"


def test_launch_source_is_compared(cli_inputs: Inputs) -> None:
    a = json.loads(deployment_record(cli_inputs).read_text())
    b = json.loads(json.dumps(a))
    b["launch"]["source"] = "port"
    assert [(c.name, c.before, c.after) for c in record_diff(a, b)] == [
        ("launch source", "pid", "port")
    ]


def test_capture_refuses_a_model_the_server_does_not_serve(tmp_path: Path) -> None:
    served, other = tmp_path / "served", tmp_path / "other"
    served.mkdir()
    other.mkdir()
    with openai_server(tmp_path, root=str(served)) as srv:
        out = tmp_path / "r.json"
        p = run("record", "capture", "--url", srv.url, "--model", other, "--output", out)
        assert_one_line_error(p, f"--model {other} is not the checkpoint the server serves",
                              str(served))  # fmt: skip
        assert not out.exists()
        run_ok("record", "capture", "--url", srv.url, "--model", served, "--output", out)
        assert json.loads(out.read_text())["checkpoint"]["path"] == str(served.resolve())
