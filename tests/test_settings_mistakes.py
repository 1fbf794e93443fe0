"""Settings an operator can get wrong: each is refused naming the value, never taken as something else."""

from __future__ import annotations

import json

import logging
import os
import re
from types import SimpleNamespace

import pytest

from omni_accum.switches import SWITCHES, SettingError, env_flag, switch_problems
from omni_accum.errors import PolicyError

SWITCH_NAMES = sorted(SWITCHES)


@pytest.fixture
def no_switches(monkeypatch):
    for name in (*SWITCHES, "OMNI_ACCUM_POLICY", "VLLM_PLUGINS", "OMNI_ACCUM_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("name", SWITCH_NAMES)
def test_a_switch_neither_on_nor_off_is_named(no_switches, name):
    for value, want in (("1", True), ("ON", True), (" yes ", True), ("0", False), ("Off", False), ("no", False)):
        no_switches.setenv(name, value)
        assert env_flag(name) is want
    no_switches.setenv(name, "")
    assert env_flag(name) is SWITCHES[name]
    no_switches.setenv(name, "disable")
    with pytest.raises(SettingError, match=rf"{name}='disable' is neither on \(1, true, yes, on\) nor off"):
        env_flag(name)
    assert switch_problems() == [f"environment variable {name}='disable' is neither on (1, true, yes, on) nor off (0, false, no, off)"]


def test_install_refuses_a_bad_switch_and_patches_nothing(vo, no_switches):
    no_switches.setenv("OMNI_ACCUM_METRICS", "disabled")
    with pytest.raises(SettingError, match="OMNI_ACCUM_METRICS='disabled'"):
        vo.install("qwen3-omni")
    assert not vo.is_installed()


def test_a_mistyped_required_ends_the_process(vo, no_switches):
    """``OMNI_ACCUM_REQUIRED=y`` used to read as off: a bad policy was then logged and served without omni-accum."""
    from omni_accum.integrations.vllm_omni.activation import activate

    no_switches.setenv("OMNI_ACCUM_REQUIRED", "y")
    no_switches.setenv("OMNI_ACCUM_POLICY", "qwen3-omn")
    with pytest.raises(SystemExit, match="OMNI_ACCUM_REQUIRED='y'"):
        activate()
    assert not vo.is_installed()


def test_a_mistyped_off_switch_installs_nothing(vo, no_switches, caplog):
    """``OMNI_ACCUM_VLLM_OMNI=disable`` used to leave omni-accum on; now it does nothing and says why."""
    from omni_accum.integrations.vllm_omni.activation import activate

    no_switches.setenv("OMNI_ACCUM_VLLM_OMNI", "disable")
    no_switches.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    with caplog.at_level(logging.ERROR, logger="omni_accum"):
        activate()
    assert not vo.is_installed()
    assert "OMNI_ACCUM_VLLM_OMNI='disable'" in caplog.text
    no_switches.setenv("OMNI_ACCUM_REQUIRED", "1")
    with pytest.raises(SystemExit, match="OMNI_ACCUM_VLLM_OMNI='disable'"):
        activate()


def test_connector_extra_values_that_are_not_a_policy_or_key_list_are_named(vllm_omni):
    from omni_accum.integrations.vllm_omni import binding_settings

    for value in (True, 5, ["qwen3-omni"]):
        with pytest.raises(PolicyError, match=re.escape(f"omni_accum_policy={value!r} is not a policy")):
            binding_settings.check_extra({"omni_accum_policy": value})
    assert binding_settings._policy_source({"omni_accum_policy": False})[0] is None  # YAML's unquoted off
    # a string used to be split into characters: no key was accumulated, and nothing said so
    for keys in ("embed.prefill", [5], [""]):
        with pytest.raises(PolicyError, match=r"omni_accum_adapter_keys=.* is not a list of key paths"):
            binding_settings.check_extra({"omni_accum_policy": "qwen3-omni", "omni_accum_adapter_keys": keys})
    binding_settings.check_extra({"omni_accum_policy": "qwen3-omni", "omni_accum_adapter_keys": ["embed.prefill"]})


def test_an_omni_accum_key_it_does_not_read_is_named_not_ignored(vo, no_switches, caplog):
    """``omni_accum_polcy: qwen3-omni`` left omni-accum off without a word (no policy named), and a misspelt capture
    or context key ran without its setting; ``omni_accum_adapter_keys: []`` was read as "not given" (the defaults).
    Each is an error naming the key (and the closest one read); at construction, so REQUIRED ends the process."""
    from omni_accum.integrations.vllm_omni import binding_settings
    from omni_accum.integrations.vllm_omni.activation import _on_extra_policy
    from omni_accum.integrations.vllm_omni.families.base import wrap_probe

    for key, close in (("omni_accum_polcy", "omni_accum_policy"), ("Omni-Accum-Context-Len", "omni_accum_context_len"),
                       ("omni_accum_capture_dir", "omni_accum_capture"), ("omni_accum_zzz", None)):  # fmt: skip
        with pytest.raises(PolicyError, match=re.escape(f"unknown key(s) {key!r}")) as e:
            binding_settings.check_extra({"omni_accum_policy": "qwen3-omni", key: "x"})
        assert (f"did you mean {close!r}?" in str(e.value)) if close else "did you mean" not in str(e.value)
        assert "omni-accum reads omni_accum_policy, omni_accum_adapter_keys" in str(e.value)
    with pytest.raises(PolicyError, match=r"omni_accum_adapter_keys=\[\] names no key: .*embed.prefill"):
        binding_settings.check_extra({"omni_accum_policy": "qwen3-omni", "omni_accum_adapter_keys": []})
    # vllm-omni's own keys beside them are not omni-accum's business
    assert binding_settings.check_extra({"omni_accum_policy": "qwen3-omni", "shm_threshold_bytes": 65536}) is not None
    # the constructor probe reports an extra whose only omni-accum key is misspelt (no policy is named)
    seen = []
    no_switches.setattr("omni_accum.integrations.vllm_omni.families.base.ProbeHook.on_extra_policy", seen.append)
    no_switches.setattr("omni_accum.integrations.vllm_omni.families.base.ProbeHook.on_made", lambda obj: None)

    class Adapter:
        def __init__(self, config):
            self.connector = SimpleNamespace(config=config)

    Adapter.__init__ = wrap_probe(Adapter.__init__)
    made = Adapter({"omni_accum_polcy": "qwen3-omni"})
    Adapter({"shm_threshold_bytes": 1})
    assert seen == [made]
    no_switches.setenv("OMNI_ACCUM_REQUIRED", "1")
    with pytest.raises(SystemExit, match="connector extra.*unknown key.*'omni_accum_polcy'"):
        _on_extra_policy(made)


def test_required_ends_the_process_at_construction_for_a_bad_connector_extra(vo, no_switches, caplog):
    """A bad policy in a deploy YAML's connector extra used to be logged only, even with OMNI_ACCUM_REQUIRED=1
    (the binding is made on first use, on vllm-omni's threads: the check runs when the adapter is built)."""
    from omni_accum.integrations.vllm_omni.activation import _on_extra_policy

    obj = SimpleNamespace(connector=SimpleNamespace(config={"omni_accum_policy": "qwen3-omn"}))
    with caplog.at_level(logging.ERROR, logger="omni_accum"):
        _on_extra_policy(obj)  # without REQUIRED: logged, and the process goes on
    assert "qwen3-omn" in caplog.text
    no_switches.setenv("OMNI_ACCUM_REQUIRED", "1")
    with pytest.raises(SystemExit, match="OMNI_ACCUM_REQUIRED=1 and SimpleNamespace's connector extra.*qwen3-omn"):
        _on_extra_policy(obj)


def _doctor(capsys, *args: str) -> tuple[int, str]:
    from omni_accum.cli.main import main

    rc = main(["doctor", *args])
    return rc, capsys.readouterr().out


def test_doctor_names_a_bad_switch(vllm_omni, no_switches, capsys):
    no_switches.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    no_switches.setenv("OMNI_ACCUM_METRICS", "disabled")
    rc, out = _doctor(capsys)
    assert rc == 1 and "PROBLEM  switch: environment variable OMNI_ACCUM_METRICS='disabled'" in out, out


def test_doctor_is_not_ready_when_omni_accum_is_switched_off_beside_a_policy(vllm_omni, no_switches, capsys):
    no_switches.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    no_switches.setenv("OMNI_ACCUM_VLLM_OMNI", "0")
    rc, out = _doctor(capsys)
    assert rc == 1 and "OMNI_ACCUM_VLLM_OMNI=0: omni-accum installs nothing, so the policy below is not applied" in out
    no_switches.delenv("OMNI_ACCUM_POLICY")
    rc, out = _doctor(capsys)
    assert rc == 0 and "note     switch: OMNI_ACCUM_VLLM_OMNI=0: omni-accum installs nothing" in out, out


@pytest.mark.parametrize(("value", "rc", "said"), [("off", 0, "will change nothing"), ("true", 1, "True is not a policy")])
def test_doctor_reads_an_unquoted_yaml_off_or_true_in_a_deploy_yaml(vllm_omni, no_switches, capsys, tmp_path, value, rc, said):
    """``omni_accum_policy: off`` unquoted is YAML's false (the documented opt-out): doctor used to end in a
    TypeError traceback on it, and on ``true``."""
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(f"connectors:\n  c:\n    name: SharedMemoryConnector\n    extra:\n      omni_accum_policy: {value}\n")
    got, out = _doctor(capsys, "--deploy", str(deploy))
    assert got == rc and said in out, out


def test_a_tuned_bucket_with_two_cells_for_one_key_is_refused():
    """The last cell used to win silently (validate said ok, explain showed the second strategy)."""
    from omni_accum.policy import load_policy

    cell = {"key": "embed.decode", "context_len": 1000, "concurrency": 1}
    tuned = {"context_len_edges": [1000], "concurrency_edges": [1],
             "cells": [{**cell, "strategy": "prealloc"}, {**cell, "strategy": "token_list"}]}  # fmt: skip
    with pytest.raises(PolicyError, match=r"cells\[1\] repeats cells\[0\] \(key 'embed.decode', context_len 1000"):
        load_policy({"tuned": tuned})


@pytest.mark.parametrize("match", [" embed.decode", "embed.decode ", "embed.decode\t"])
def test_a_rule_match_with_an_outer_space_is_refused(match):
    """Such a rule never matched anything, and validate said ok."""
    from omni_accum.policy import load_policy

    with pytest.raises(PolicyError, match="has a leading or trailing space, which no key path has"):
        load_policy({"rules": [{"match": match, "strategy": "prealloc"}]})


@pytest.mark.parametrize("text", ["inf", "0", "0.3", "-0.5", "nan"])
def test_a_mooncake_segment_that_is_no_size_is_refused(text):
    """``inf`` ended in an OverflowError traceback; 0, 0.3 and -0.5 were taken as 0 bytes."""
    from omni_accum.bench.mooncake_services import parse_size
    from omni_accum.errors import OmniAccumError

    with pytest.raises(OmniAccumError, match="not a size"):
        parse_size(text)
    assert parse_size("512MiB") == 512 << 20


def test_an_inline_policy_string_loads_wherever_a_policy_name_does(vllm_omni, no_switches, capsys):
    """``OMNI_ACCUM_POLICY='default: prealloc'`` installs, but doctor called it "neither a policy file nor a
    preset", and a block string in a connector extra failed the same way at run time."""
    from omni_accum.integrations.vllm_omni import binding_settings
    from omni_accum.policy import load_policy

    assert load_policy("default: prealloc").default.strategy == "prealloc"
    assert load_policy("rules:\n  - {match: embed.decode, strategy: token_list}\n").rules[0].strategy == "token_list"
    binding_settings.check_extra({"omni_accum_policy": "default: prealloc\n"})
    no_switches.setenv("OMNI_ACCUM_POLICY", "default: prealloc")
    rc, out = _doctor(capsys)
    assert rc == 0 and "default prealloc" in out, out


def test_install_from_code_writes_the_status_file(vo, no_switches, tmp_path):
    """README: with OMNI_ACCUM_STATUS_DIR every process where omni-accum activated writes DIR/<pid>.json;
    only the plugin entry point used to, not install() from code."""
    import json
    import os

    no_switches.setenv("OMNI_ACCUM_STATUS_DIR", str(tmp_path))
    vo.install("qwen3-omni")
    data = json.loads((tmp_path / f"{os.getpid()}.json").read_text())
    assert data["installed"] is True


def test_smaller_messages_name_what_is_wrong(tmp_path, capsys):
    """validate '' said ".: is a directory"; tune --base bogus did not name --base; a tuned cell off the edges
    did not list them."""
    from omni_accum.cli.main import main
    from omni_accum.policy import load_policy

    assert main(["validate", ""]) == 2  # a usage mistake, as every other command's empty argument (was 1)
    assert "'': 1 error(s)\n  an empty POLICY argument" in capsys.readouterr().out
    assert main(["validate", "default", " ", "--json"]) == 2
    assert [p["valid"] for p in json.loads(capsys.readouterr().out)["policies"]] == [True, False]
    assert main(["tune", "--base", "no-such-base", "--out", str(tmp_path / "t.yaml"), "--quick"]) == 2
    err = capsys.readouterr().err
    assert "--base 'no-such-base'" in err and "Traceback" not in err
    assert not (tmp_path / "t.yaml").exists()
    tuned = {"context_len_edges": [1000, 8000], "concurrency_edges": [1],
             "cells": [{"key": "k", "context_len": 2000, "concurrency": 1, "strategy": "cat"}]}  # fmt: skip
    with pytest.raises(PolicyError, match=r"context_len 2000 is not one of context_len_edges \[1000, 8000\]"):
        load_policy({"tuned": tuned})


def test_an_allowlist_entry_naming_no_installed_plugin_is_warned_about(no_switches, caplog):
    """A typo in OMNI_ACCUM_PLUGINS only showed later as "unknown strategy 'delta'", not as the filter's doing."""
    from omni_accum.manager import StrategyManager

    no_switches.setenv("OMNI_ACCUM_PLUGINS", "deltaa,omni-accum-delta,cat")  # cat: a built-in, always loaded
    no_switches.setenv("OMNI_ACCUM_DISABLED_PLUGINS", "dleta,prealloc")
    with caplog.at_level(logging.WARNING, logger="omni_accum"):
        StrategyManager()
    said = [r.getMessage() for r in caplog.records if "_PLUGINS lists" in r.getMessage()]
    assert said == [
        "omni_accum: OMNI_ACCUM_PLUGINS lists 'deltaa', but no installed strategy plugin has that name (plugins: "
        "delta, omni-accum-delta)",
        "omni_accum: OMNI_ACCUM_DISABLED_PLUGINS lists 'dleta', but no installed strategy plugin has that name "
        "(plugins: delta, omni-accum-delta)",
        "omni_accum: OMNI_ACCUM_DISABLED_PLUGINS lists 'prealloc', a built-in: built-ins cannot be disabled",
    ]


def test_a_prometheus_multiproc_dir_that_cannot_be_written_turns_metrics_off_in_one_line(tmp_path):
    """prometheus_client raised (PermissionError, then DuplicateTimeseries on every later call) out of
    omni-accum's hooks, the binding and activate() itself: metrics are off instead, said once, naming the folder."""
    import subprocess
    import sys

    code = (
        "import logging; logging.basicConfig(level=logging.ERROR)\n"
        "from omni_accum.integrations.vllm_omni import prometheus as p, reporting\n"
        "assert p.enabled() is False and p.enabled() is False\n"
        "assert reporting.status().installed is False\n"
        "print('fine')\n"
    )
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR="/proc/no-such-folder", OMNI_ACCUM_METRICS="1")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert got.returncode == 0 and "fine" in got.stdout, got.stderr
    lines = [ln for ln in got.stderr.splitlines() if "cannot create the metrics" in ln]
    assert len(lines) == 1 and "PROMETHEUS_MULTIPROC_DIR=/proc/no-such-folder: a folder this user can write" in lines[0]
    assert "Traceback" not in got.stderr


def test_status_files_go_only_where_no_other_user_can_write_and_a_problem_is_said_once(vo, no_switches, tmp_path,
                                                                                        caplog):
    """The status folder was any folder (0777 kept, another user's accepted), the temporary file a predictable
    name that followed a planted link, the file 0644, and an unwritable folder warned on every write."""
    import json
    import stat

    from omni_accum.integrations.vllm_omni import reporting

    d = tmp_path / "status"
    no_switches.setenv("OMNI_ACCUM_STATUS_DIR", str(d))
    path = reporting.write()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads(open(path).read())["installed"] in (True, False)
    assert sorted(os.listdir(d)) == [f"{os.getpid()}.json"]  # no temporary file left
    os.chmod(d, 0o777)
    caplog.set_level(logging.WARNING, "omni_accum.vllm_omni")
    for _ in range(3):
        reporting._safe_write()
    said = [r.getMessage() for r in caplog.records if "cannot write the status file" in r.getMessage()]
    assert len(said) == 1 and "mode 0777 lets other users write to it" in said[0] and "OMNI_ACCUM_STATUS_DIR" in said[0]


def test_a_refused_activation_says_why_in_the_status_file(tmp_path):
    """The status file of a process whose activation installed nothing read installed: false with no reason."""
    import json
    import subprocess
    import sys

    code = "from omni_accum.integrations.vllm_omni import activate\nactivate()\n"
    env = dict(os.environ, OMNI_ACCUM_POLICY="qwen3-omni", OMNI_ACCUM_HANDOFF_SAMPLE="abc",
               OMNI_ACCUM_STATUS_DIR=str(tmp_path / "status"))
    env.pop("OMNI_ACCUM_REQUIRED", None)
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert got.returncode == 0, got.stderr
    (f,) = (tmp_path / "status").glob("*.json")
    data = json.loads(f.read_text())
    assert data["installed"] is False and "OMNI_ACCUM_HANDOFF_SAMPLE='abc'" in data["refused"], data


def test_a_later_install_clears_the_refusal(vo, no_switches):
    """status() read installed: true beside the reason of an earlier refused activation."""
    from omni_accum.integrations.vllm_omni import reporting
    from omni_accum.integrations.vllm_omni.binding_settings import Settings

    Settings.refused = "an earlier activation's reason"
    vo.install("qwen3-omni")
    st = reporting.status()
    assert st.installed and st.refused is None


def test_one_size_parser_reads_the_arena_s_and_mooncake_s_sizes_ascii_digits_only():
    """The Mooncake connector's copy of the arena's size parser had drifted: the arena took '٤٠٩٦' (Arabic-Indic
    digits: ``\\d`` matches any Unicode digit) as 4096 bytes, the copy refused it. One parser now, ASCII digits only,
    exact (a float rounded a large byte count); each connector's messages as before."""
    from omni_accum.integrations.vllm_omni import arena_settings, mooncake_settings

    for value in ("\u0664\u0660\u0669\u0666", "4\u0660\u0669\u0666KiB", "\uff14\uff10\uff19\uff16"):
        with pytest.raises(ValueError, match="is not a size"):
            arena_settings.parse_settings({"arena_bytes": value})
        with pytest.raises(ValueError, match="is not a size"):
            mooncake_settings.parse_settings({"mooncake_buffer_bytes": value})
    assert mooncake_settings.parse_size is arena_settings.parse_size
    assert arena_settings.parse_size("9007199254740993", "arena_bytes") == 9007199254740993  # 2**53 + 1, exact
    assert arena_settings.parse_size(" 1.5 KiB ", "x", minimum=1) == 1536
    with pytest.raises(ValueError, match=r"extra.x = '2KiB' is 2048 bytes, over the maximum of 1024"):
        arena_settings.parse_size("2KiB", "x", minimum=1, maximum=1024)
    with pytest.raises(ValueError, match=r"^N: extra.x = '2KiB' is 2048 bytes; it takes from 1 to 1024 bytes$"):
        arena_settings.parse_size("2KiB", "x", name="N", minimum=1, maximum=1024, say_range=True)
    assert mooncake_settings.parse_settings({"mooncake_buffer_bytes": "4KiB"}).buffer_bytes == 4096
