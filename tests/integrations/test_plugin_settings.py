"""The plugin's switches, version gate, sidecar lookup and placement (no vLLM needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashnext.errors import PluginError
from flashnext.integrations.vllm.settings import PluginSettings, command_line_config
from flashnext.integrations.vllm.versions import CHECKED, is_checked, release, require_checked


def test_nothing_set_means_every_part_off():
    settings = PluginSettings.from_env({"PATH": "/usr/bin"})
    assert settings == PluginSettings() and settings.parts == ()


def test_env_switches_each_part(tmp_path):
    env = {
        "FLASHNEXT_PLE_SIDECAR": str(tmp_path),
        "FLASHNEXT_PLE_PLACEMENT": "staged",
        "FLASHNEXT_MOE_GUARD": "1",
    }
    settings = PluginSettings.from_env(env)
    assert settings.ple_sidecar == tmp_path and settings.ple_placement == "staged"
    assert settings.parts == ("ple_sidecar", "moe_guard")
    fix = PluginSettings.from_env({"FLASHNEXT_PLE_LOADER_FIX": "true", "FLASHNEXT_MOE_GUARD": "0"})
    assert fix.parts == ("ple_loader_fix",)
    drop = PluginSettings.from_env({"FLASHNEXT_DROP_INDEXER": "1"})
    assert drop.drop_indexer and drop.parts == ("drop_indexer",)
    config = {"flashnext": {"drop_indexer": True}}
    assert PluginSettings.resolve(env={}, additional_config=config).parts == ("drop_indexer",)


def test_additional_config_section_is_read(tmp_path):
    config = {
        "other_plugin": {"x": 1},
        "flashnext": {"ple_sidecar": str(tmp_path), "moe_guard": True},
    }
    settings = PluginSettings.resolve(env={}, additional_config=config)
    assert settings.ple_sidecar == tmp_path and settings.moe_guard
    assert PluginSettings.resolve(env={}, additional_config={"other": 1}) == PluginSettings()


def test_command_line_switches_a_part_on_at_startup(tmp_path):
    """vLLM calls the plugin before it has a config: the serve command's JSON is what it sees."""
    section = json.dumps({"flashnext": {"ple_sidecar": str(tmp_path), "ple_placement": "staged"}})
    for argv in (
        ["vllm", "serve", "/m", "--additional-config", section],
        ["vllm", "serve", "/m", f"--additional-config={section}"],
    ):
        settings = PluginSettings.at_startup(env={}, argv=argv)
        assert settings.parts == ("ple_sidecar",) and settings.ple_placement == "staged"
    assert PluginSettings.at_startup(env={}, argv=["vllm", "serve", "/m"]).parts == ()
    # Not JSON, or no value: vLLM reports it; the plugin stays off rather than guess.
    assert command_line_config(["vllm", "--additional-config", "{bad"]) is None
    assert command_line_config(["vllm", "--additional-config"]) is None
    on = PluginSettings.at_startup(env={"FLASHNEXT_MOE_GUARD": "1"}, argv=["vllm"])
    assert on.parts == ("moe_guard",)


@pytest.mark.parametrize(
    ("env", "config", "named"),
    [
        ({"FLASHNEXT_MOE_GUARD": "maybe"}, None, "FLASHNEXT_MOE_GUARD='maybe': expected 1 or 0"),
        (
            {"FLASHNEXT_PLE_PLACEMENT": "gpu"},
            None,
            "FLASHNEXT_PLE_PLACEMENT='gpu': expected one of",
        ),
        ({}, {"flashnext": {"ple_sidecars": "/x"}}, "unknown key(s) ['ple_sidecars']"),
        ({}, {"flashnext": ["ple_sidecar"]}, "--additional-config flashnext must be an object"),
        (
            {},
            {"flashnext": {"ple_sidecar": 3}},
            "flashnext.ple_sidecar must be a sidecar directory",
        ),
        (
            {"FLASHNEXT_PLE_PLACEMENT": "pinned"},
            {"flashnext": {"ple_placement": "staged"}},
            "FLASHNEXT_PLE_PLACEMENT=pinned and --additional-config flashnext.ple_placement=staged",
        ),
        (
            {"FLASHNEXT_PLE_SIDECAR": "/s", "FLASHNEXT_PLE_LOADER_FIX": "1"},
            None,
            "ple_sidecar and ple_loader_fix are both on",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_source(env, config, named):
    with pytest.raises(PluginError) as exc:
        PluginSettings.resolve(env=env, additional_config=config)
    assert named in str(exc.value)


def test_same_value_in_both_sources_is_fine(tmp_path):
    env = {"FLASHNEXT_MOE_GUARD": "1"}
    assert PluginSettings.resolve(env, {"flashnext": {"moe_guard": True}}).moe_guard


def test_versions_checked_and_refused():
    assert set(CHECKED) == {"0.32.0", "0.33.0", "0.34.0"}
    assert not is_checked("0.32.1")  # a patch release is another release
    assert release("0.32.0+cpu") == "0.32.0" and is_checked("0.32.0+cpu")
    assert is_checked("0.34.0") and not is_checked("0.35.0")
    require_checked("0.34.0", allow_untested=False)
    require_checked("0.35.0", allow_untested=True)
    with pytest.raises(PluginError, match=r"vLLM 0\.35\.0 is not a version .* nothing was applied"):
        require_checked("0.35.0", allow_untested=False)


def test_cache_and_profile_switches_from_either_source(tmp_path):
    env = {"FLASHNEXT_PLE_SIDECAR": str(tmp_path), "FLASHNEXT_PLE_DEVICE_CACHE": "2GiB"}
    settings = PluginSettings.resolve(env=env)
    assert settings.ple_device_cache == 2 * 2**30 and settings.ple_profile is None
    section = {"ple_sidecar": str(tmp_path), "ple_device_cache": "512MiB", "ple_profile": "~/p.st"}
    settings = PluginSettings.resolve(env={}, additional_config={"flashnext": section})
    assert settings.ple_device_cache == 512 * 2**20
    assert settings.ple_profile == Path("~/p.st").expanduser()
    both = {"flashnext": {"ple_device_cache": "1000MB"}}
    assert PluginSettings.resolve({**env, "FLASHNEXT_PLE_DEVICE_CACHE": "1GB"}, both).ple_device_cache == 10**9
    assert (
        PluginSettings.resolve(
            {**env, "FLASHNEXT_PLE_DEVICE_CACHE": "0"}, {"flashnext": {"ple_device_cache": 0}}
        ).ple_device_cache
        == 0
    )
    off = PluginSettings.resolve({**env, "FLASHNEXT_PLE_DEVICE_CACHE": "0"})
    assert off.ple_device_cache == 0 and off.parts == ("ple_sidecar",)


@pytest.mark.parametrize(
    ("env", "config", "named"),
    [
        ({"FLASHNEXT_PLE_DEVICE_CACHE": "2 gigs"}, None, "FLASHNEXT_PLE_DEVICE_CACHE='2 gigs': expected a cache"),
        ({"FLASHNEXT_PLE_DEVICE_CACHE": "-1GiB"}, None, "FLASHNEXT_PLE_DEVICE_CACHE='-1GiB': expected a cache"),
        ({}, {"flashnext": {"ple_device_cache": -5}}, "flashnext.ple_device_cache=-5: expected a cache size"),
        # A bare number could be bytes or GiB: only 0 needs no unit.
        ({}, {"flashnext": {"ple_device_cache": 10**9}}, "ple_device_cache=1000000000: expected a cache size"),
        ({"FLASHNEXT_PLE_DEVICE_CACHE": "4096"}, None, "FLASHNEXT_PLE_DEVICE_CACHE='4096': expected a cache"),
        ({}, {"flashnext": {"ple_device_cache": True}}, "flashnext.ple_device_cache=True: expected a cache"),
        ({}, {"flashnext": {"ple_profile": 3}}, "flashnext.ple_profile must be a profile file"),
        ({"FLASHNEXT_PLE_DEVICE_CACHE": "1GiB"}, None, "set without FLASHNEXT_PLE_SIDECAR"),
        ({"FLASHNEXT_PLE_PROFILE": "/p"}, None, "set without FLASHNEXT_PLE_SIDECAR"),
        (
            {"FLASHNEXT_PLE_SIDECAR": "/s", "FLASHNEXT_PLE_DEVICE_CACHE": "1GiB"},
            {"flashnext": {"ple_placement": "device"}},
            "with FLASHNEXT_PLE_PLACEMENT=device",
        ),
        (
            {"FLASHNEXT_PLE_SIDECAR": "/s", "FLASHNEXT_PLE_DEVICE_CACHE": "1GiB"},
            {"flashnext": {"ple_device_cache": "2GiB"}},
            "FLASHNEXT_PLE_DEVICE_CACHE=1073741824 and --additional-config flashnext.ple_device_cache=2147483648",
        ),
    ],
)
def test_bad_cache_switches_are_refused_in_one_line(env, config, named):
    with pytest.raises(PluginError) as exc:
        PluginSettings.resolve(env=env, additional_config=config)
    assert named in str(exc.value) and "\n" not in str(exc.value)


REGISTER = (
    "import sys\n"
    "from flashnext.errors import PluginError\n"
    "from flashnext.integrations.vllm import _installed, register\n"
    "try:\n"
    "    register()\n"
    "except PluginError as exc:\n"
    "    print('refused:', exc, '| installed:', sorted(_installed))\n"
)


@pytest.mark.parametrize(
    "engram",
    [
        ["--engram-config", '{"disk_offload": true}'],
        ['--engram-config={"disk_offload": true, "cpu_offload": false}'],
        ["--engram-config.disk_offload", "true"],
        ["--engram_config.disk_offload=true"],
    ],
)
def test_register_refuses_the_sidecar_with_vllms_disk_offload(tmp_path, engram):
    """vLLM 0.34 builds its disk-offload layer, which the sidecar does not replace: refused in
    one line naming both switches, before anything is applied (a real process, its argv)."""
    import os
    import subprocess
    import sys

    section = json.dumps({"flashnext": {"ple_sidecar": str(tmp_path)}})
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHNEXT_")}
    for how_on, extra_env in (
        (["--additional-config", section], {}),
        ([], {"FLASHNEXT_PLE_SIDECAR": str(tmp_path)}),
    ):
        argv = ["serve", "/m", *how_on, *engram]
        out = subprocess.run(
            [sys.executable, "-c", REGISTER, *argv], env={**env, **extra_env},
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout  # fmt: skip
        assert out.count("\n") == 1 and "refused:" in out, out
        assert "FLASHNEXT_PLE_SIDECAR" in out and "disk_offload=true" in out, out
        assert out.rstrip().endswith("| installed: []"), out


def test_disk_offload_off_or_no_sidecar_is_not_refused():
    from flashnext.integrations.vllm.engram import EngramSettings, command_line_engram, ple_path

    for argv in (
        ["--engram-config", '{"disk_offload": false}'],
        ["--engram-config.cpu_offload", "false"],
        [],
    ):
        engram = EngramSettings.from_mapping(command_line_engram(argv))
        assert ple_path(engram, sidecar_on=True) == "sidecar"
    # vLLM's argparse keeps the last --engram-config whole; the dotted keys become one last JSON
    argv = ["--engram-config", '{"disk_offload": true}', "--engram-config", '{"use_thp": false}']
    assert command_line_engram(argv) == {"use_thp": False}
    argv = ["--engram-config", '{"cpu_offload": false}', "--engram-config.disk_offload", "true"]
    assert command_line_engram(argv) == {"disk_offload": True}
    on = EngramSettings.from_mapping(command_line_engram(argv))
    assert ple_path(on, sidecar_on=False) == "disk_offload"


def test_register_reads_the_yaml_config_file_for_disk_offload(tmp_path):
    import os
    import subprocess
    import sys

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("engram-config:\n  disk_offload: true\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHNEXT_")}
    env["FLASHNEXT_PLE_SIDECAR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", REGISTER, "serve", "/m", "--config", str(cfg)], env=env,
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert "refused:" in out and "disk_offload=true" in out and "| installed: []" in out, out


def test_old_cache_spellings_still_set_the_device_cache(tmp_path, monkeypatch, caplog):
    """FLASHNEXT_PLE_CACHE and the ``ple_cache`` key are the old spellings of the device cache:
    the same setting, one deprecation line each per process, and a disagreement refused."""
    from flashnext import words

    monkeypatch.setattr(words, "_said", set())
    side = {"FLASHNEXT_PLE_SIDECAR": str(tmp_path)}
    new = PluginSettings.resolve({**side, "FLASHNEXT_PLE_DEVICE_CACHE": "64MiB"})
    for _ in range(2):
        assert PluginSettings.resolve({**side, "FLASHNEXT_PLE_CACHE": "64MiB"}) == new
        old_key = {"flashnext": {"ple_cache": "64MiB"}}
        assert PluginSettings.resolve(side, old_key) == new
    said = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert said == [
        "warning: FLASHNEXT_PLE_CACHE is deprecated; it is now spelled FLASHNEXT_PLE_DEVICE_CACHE",
        "warning: --additional-config flashnext.ple_cache is deprecated; it is now spelled "
        "--additional-config flashnext.ple_device_cache",
    ]
    both = {**side, "FLASHNEXT_PLE_CACHE": "1MiB", "FLASHNEXT_PLE_DEVICE_CACHE": "2MiB"}
    with pytest.raises(PluginError, match="FLASHNEXT_PLE_DEVICE_CACHE=2MiB and its old spelling"):
        PluginSettings.resolve(both)
    keys = {"flashnext": {"ple_cache": "1MiB", "ple_device_cache": "2MiB"}}
    with pytest.raises(PluginError, match="ple_device_cache and its old spelling"):
        PluginSettings.resolve(side, keys)
