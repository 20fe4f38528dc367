"""``flashnext check`` on a Ray deployment: whether the plugin's switches reach the workers."""

from __future__ import annotations

import json

from flashnext.deploy.check import RULES, check_ray_switches
from flashnext.deploy.check_ray import check_ray_reach
from flashnext.deploy.serve_args import parse_serve_args

RAY = ["m", "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]
CONFIG = ["--additional-config", json.dumps({"flashnext": {"ple_sidecar": "/data/sc"}})]


def reach(argv: list[str], **env: str) -> tuple[str, str, str]:
    return check_ray_reach(parse_serve_args(argv, env))


def test_not_ray_or_plugin_off_is_skipped() -> None:
    assert (
        reach(["m", "--distributed-executor-backend", "mp"], FLASHNEXT_PLE_SIDECAR="/s")[0]
        == "skip"
    )
    assert reach(RAY)[0] == "skip"


def test_legacy_executor_and_additional_config_pass_saying_how() -> None:
    status, why, _ = reach([*RAY, *CONFIG], VLLM_USE_RAY_V2_EXECUTOR_BACKEND="0")
    assert status == "pass", why
    assert "--additional-config" in why and "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY" in why
    status, why, _ = reach(RAY, FLASHNEXT_PLE_SIDECAR="~/sc")
    assert status == "pass" and "V2 executor copies" in why, why


def test_what_cannot_reach_is_refused_in_one_line() -> None:
    status, why, fix = reach(RAY, FLASHNEXT_PLE_SIDECAR="/s", VLLM_PLUGINS="other")
    assert status == "fail" and "VLLM_PLUGINS='other' leaves flashnext out" in why and fix
    status, why, fix = reach([*RAY, "--additional-config", '{"flashnext": {"ple_sidecar": "sc"}}'])
    assert status == "fail" and "'sc' is relative" in why and "absolute" in fix
    assert "\n" not in why


def test_the_rule_is_one_of_check_s() -> None:
    assert check_ray_switches in RULES
