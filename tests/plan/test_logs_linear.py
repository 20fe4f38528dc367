"""Rule (issue 42): bounded, linear work on a log a user points at. Every regex applied to user
or server text takes time linear in the line: 1 MB adversarial lines (each pattern's anchors
repeated, followed by the runs that made ``search`` rescan: letters, digits, separators, its
own middle literals) finish within a bound a quadratic pattern misses by hours."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from flashnext.deploy import record
from flashnext.plan import logs
from flashnext.validate import probes

MB = 1 << 20
#: Seconds for one 1 MB line through one pattern: linear work takes milliseconds; the old
#: ``[\w.]*ngram_embedding\.weight_scale`` took 68 s on 200,000 letters.
BOUND = 5.0
FILLERS = ("a", "1", "1,", "a.", " ", "{", "}", "\x1b[1;", 'x="', '\\"', "dtype=x,",
           "Tried to allocate ", "total capacity of ", "ngram_embedding.weight_scale ",
           "ngram_embedding.shard_", "0/")  # fmt: skip
FIXTURES = Path(__file__).parent / "fixtures"


def _fill(piece: str, size: int = MB) -> str:
    return piece * (size // len(piece))


def _lines(anchors: tuple[str, ...]) -> list[str]:
    lines = [_fill(f) for f in FILLERS] + [_fill(a) for a in anchors]
    lines += [anchors[0] + _fill(f) for f in FILLERS]
    return lines


def _timed(fn, line: str) -> float:
    t0 = time.perf_counter()
    fn(line)
    return time.perf_counter() - t0


@pytest.mark.parametrize("pattern", [*logs.PATTERNS, logs._SHARDS], ids=lambda p: p.kind)
def test_every_log_pattern_is_linear(pattern):
    slow = {}
    for line in _lines(pattern.anchors):
        took = _timed(pattern.match, line)
        if took > BOUND:
            slow[repr(line[:40])] = round(took, 1)
    assert not slow, f"{pattern.kind}: {slow}"


def test_the_issue_repro_and_a_whole_log_of_them():
    """200,000 letters before the weight_scale name (68 s before), and explain over a 4 MB log
    of adversarial lines."""
    line = _fill("x", 200_000) + "ngram_embedding.weight_scale unexpected"
    assert _timed(logs.read_log, [line]) < BOUND
    (event,) = logs.read_log([line])
    assert event.kind == "ple_weight_scale_rejected" and len(event.values["name"]) > 200_000
    lines = [_fill("ngram_embedding.weight_scale" + f) for f in ("a", "1", " ")]
    lines.append(_fill("There is no module or parameter named a"))
    t0 = time.perf_counter()
    logs.explain_log(lines)
    assert time.perf_counter() - t0 < 4 * BOUND


@pytest.mark.parametrize(
    "regex, head",
    [(logs._ANSI, "\x1b["), (record._CACHE_INFO, "vllm:cache_config_info{"),
     (record._LABEL, 'a="'), (probes._LABEL, 'a="'), (probes._SAMPLE, "vllm:x{")],
    ids=["ansi", "cache_info", "record_label", "probe_label", "probe_sample"],
)  # fmt: skip
def test_server_and_escape_patterns_are_linear(regex, head):
    slow = {}
    for start in ("", head):
        for piece in ("a", "1", " ", "{", "}", 'x="', '\\"', "\x1b[1;"):
            line = start + _fill(piece)
            took = _timed(lambda s: list(regex.finditer(s)), line)
            if took > BOUND:
                slow[repr(line[:40])] = round(took, 1)
    assert not slow, slow


def test_colour_codes_read_as_the_plain_log():
    """A coloured log gives the plain log's events and numbers (it advised "raise
    --kv-cache-memory-bytes (now 0) to about 0" when the codes hid the numbers)."""
    for name in ("vllm-cpu-tiny-qwen2-kv-capacity-error.log", "vllm-cpu-tiny-qwen2-startup.log"):
        plain = (FIXTURES / name).read_text().splitlines()
        coloured = [  # a prefix in colour, and every number too (where "now 0" came from)
            "\x1b[1;36m(EngineCore pid=7)\x1b[0;0m "
            + re.sub(r"(\d[\d.,]*)", "\x1b[1;32m\\1\x1b[0m", line)
            for line in plain
        ]
        want = [(e.kind, e.values) for e in logs.explain_log(plain)]
        assert want, name
        assert [(e.kind, e.values) for e in logs.explain_log(coloured)] == want
        data = "\n".join(coloured).encode()
        assert logs.log_lines(data, name) == [logs.strip_ansi(line) for line in coloured]
