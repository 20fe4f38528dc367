"""The README's Python example runs as written, and its set-up commands match CI."""

import re
from pathlib import Path

from .conftest import SERVER

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_python_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block.replace("/tmp/", f"{tmp_path}/"), "README.md", "exec"), {})


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)
    test_command, fast_tier, *_ = (c for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()
    assert fast_tier == f'.venv/bin/python -m pytest -m "not {SERVER}"'
    assert any("flashnext demo" in c for c in commands)
