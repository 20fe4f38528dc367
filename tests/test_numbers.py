"""Numbers that mean something (issue 42): one parser per kind, refusing nan and inf."""

from __future__ import annotations

import pytest

from flashnext.deploy.serve_args import ServeArgsError, parse_serve_args
from flashnext.numbers import NumberError, finite_float, human_int, model_len


@pytest.mark.parametrize(
    "text", ["nan", "NaN", " -nan ", "inf", "-inf", "Infinity", "1e999", float("nan"), "", "x"]
)
def test_finite_float_refuses_what_bounds_cannot(text):
    with pytest.raises(NumberError, match="not a"):
        finite_float(text)


@pytest.mark.parametrize("text, value", [("0.5", 0.5), (" 3 ", 3.0), ("1e-3", 1e-3), (2, 2.0)])
def test_finite_float_reads_plain_numbers(text, value):
    assert finite_float(text) == value


@pytest.mark.parametrize(
    "text, value",
    [("2048", 2048), ("128k", 128_000), ("32K", 32_768), ("25.6k", 25_600), ("1m", 10**6),
     ("auto", None), ("AUTO", None), ("-1", None)],
)  # fmt: skip
def test_model_len_reads_as_vllm(text, value):
    assert model_len(text) == value
    # check reads it the same way: one parser
    assert parse_serve_args(["--max-model-len", text]).max_model_len == value


@pytest.mark.parametrize("text", ["0", "-2", "1.5K", "nan", "inf", "12q", "", "k"])
def test_model_len_refuses(text):
    with pytest.raises(NumberError, match="expected a positive integer"):
        model_len(text)
    with pytest.raises(ServeArgsError, match=r"^--max-model-len"):
        _ = parse_serve_args(["--max-model-len", text], strict=True).max_model_len


def test_human_int_without_suffixes():
    assert human_int("12", human=False) == 12
    with pytest.raises(NumberError):
        human_int("12k", human=False)
