"""``omni-accum doctor`` on the host a deploy runs on and on the deploy's shape: a private directory the same-host
channels cannot use (``OMNI_ACCUM_ARENA_DIR``) or a status folder no process can write to (``OMNI_ACCUM_STATUS_DIR``)
is a problem naming the variable and its value (doctor said ready while the arena, the peer hellos and the hand-off
metric were off for the server's life); a deploy with no stage 0 (the fragments of ``config/deploy``) gets a note
saying how to merge it (``base_config:``), and a merged one is read with vllm-omni's own loader."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.test_doctor import _doctor

ROOT = Path(__file__).resolve().parents[1]
ARENA = ROOT / "config" / "deploy" / "qwen3_omni_arena_async_chunk.yaml"
SHM = ROOT / "config" / "deploy" / "qwen3_omni_async_chunk.yaml"
MOONCAKE = ROOT / "config" / "deploy" / "qwen3_omni_mooncake.yaml"


@pytest.fixture
def env(monkeypatch, vllm_omni):
    for var in ("OMNI_ACCUM_POLICY", "VLLM_PLUGINS", "OMNI_ACCUM_METRICS", "OMNI_ACCUM_ARENA_DIR",
                "OMNI_ACCUM_STATUS_DIR"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _bad_base(tmp_path: Path, bad: str) -> Path:
    base = tmp_path / "shm"
    if bad == "a plain file":
        base.write_text("")
    elif bad == "world-writable without the sticky bit":
        base.mkdir()
        os.chmod(base, 0o777)
    return base


@pytest.mark.parametrize("bad, said", [
    ("missing", "No such file or directory"),
    ("a plain file", "not a directory"),
    ("world-writable without the sticky bit", "a group- or world-writable directory without the sticky bit"),
])  # fmt: skip
@pytest.mark.parametrize("deploy", [ARENA, SHM])
def test_a_private_directory_the_stages_cannot_use_is_a_problem_naming_the_variable(env, capsys, tmp_path, deploy,
                                                                                   bad, said):
    rc, out = _doctor(capsys, "--deploy", str(deploy))
    assert rc == 0 and "ok       same-host directory:" in out, out
    base = _bad_base(tmp_path, bad)
    env.setenv("OMNI_ACCUM_ARENA_DIR", str(base))
    rc, out = _doctor(capsys, "--deploy", str(deploy))
    line = next((x for x in out.splitlines() if x.startswith("PROBLEM  same-host directory")), None)
    assert rc == 1 and line is not None, out
    assert f"OMNI_ACCUM_ARENA_DIR={str(base)!r}" in line and said in line, line
    assert ("makes no region" in line) == (deploy == ARENA) and "no peer hello is written or read" in line
    assert "fix: point OMNI_ACCUM_ARENA_DIR at an existing directory" in out
    assert not os.path.exists(base / f"omni-accum-{os.geteuid()}")  # doctor made nothing


def test_a_bad_private_directory_beside_a_mooncake_deploy_is_a_note_and_alone_a_problem(env, capsys, tmp_path):
    env.setenv("OMNI_ACCUM_ARENA_DIR", str(tmp_path / "missing"))
    rc, out = _doctor(capsys, "--deploy", str(MOONCAKE))  # its hellos go through the store
    assert "note     same-host directory: OMNI_ACCUM_ARENA_DIR=" in out, out
    rc, out = _doctor(capsys)
    assert rc == 1 and "PROBLEM  same-host directory: OMNI_ACCUM_ARENA_DIR=" in out, out
    env.delenv("OMNI_ACCUM_ARENA_DIR")
    rc, out = _doctor(capsys)
    assert "same-host directory" not in out  # not set, no deploy: nothing to say


def test_a_status_folder_no_process_can_write_to_is_a_problem(env, capsys, tmp_path):
    bad = tmp_path / "status"
    bad.mkdir()
    os.chmod(bad, 0o777)
    env.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    env.setenv("OMNI_ACCUM_STATUS_DIR", str(bad))
    rc, out = _doctor(capsys)
    assert rc == 1 and f"PROBLEM  status files: OMNI_ACCUM_STATUS_DIR={str(bad)!r}: status folder" in out, out
    assert "lets other users write to it" in out
    os.chmod(bad, 0o700)
    rc, out = _doctor(capsys)
    assert rc == 0 and "ok       status files: OMNI_ACCUM_STATUS_DIR=" in out, out


def _base_config() -> str:
    from omni_accum.cli.doctor_deploy import base_deploy

    full = base_deploy()
    assert full is not None, "vllm-omni's deploy/qwen3_omni_moe.yaml is not installed here"
    return str(full)


@pytest.mark.parametrize("fragment", sorted((ROOT / "config" / "deploy").glob("*.yaml")), ids=lambda p: p.name)
def test_a_fragment_gets_a_note_and_merged_with_base_config_loads_with_vllm_omni_s_loader(env, capsys, tmp_path,
                                                                                        fragment):
    """Every fragment of config/deploy, as shipped (no stage 0: a note naming the base_config line) and with the
    base_config line its comment gives (vllm-omni 0.30.0's load_deploy_config reads stages 0, 1, 2, the fragment's
    connector on stages 1 and 2, its extra as written)."""
    import yaml
    from vllm_omni.config.stage_config import load_deploy_config

    rc, out = _doctor(capsys, "--deploy", str(fragment), "--json")
    (note,) = [c for c in json.loads(out)["checks"] if c["name"] == "deploy stages"]
    assert note["ok"] and note["warning"] and "no stage 0 (its stages: 1, 2)" in note["detail"], note
    assert f"base_config: {_base_config()}" in note["fix"]
    text = fragment.read_text(encoding="utf-8")
    assert "# base_config: " in text  # the line to uncomment, in the fragment's own comments
    merged = tmp_path / fragment.name
    merged.write_text(f"base_config: {_base_config()}\n{text}", encoding="utf-8")
    cfg = load_deploy_config(merged)
    ours = yaml.safe_load(text)
    (name,) = ours["connectors"]
    assert [s.stage_id for s in cfg.stages] == [0, 1, 2]
    assert [s.input_connectors for s in cfg.stages] == [None, {"from_stage_0": name}, {"from_stage_1": name}]
    assert cfg.connectors[name] == ours["connectors"][name] and cfg.async_chunk == ours["async_chunk"]
    rc, out = _doctor(capsys, "--deploy", str(merged), "--json")
    (merged_check,) = [c for c in json.loads(out)["checks"] if c["name"] == "deploy stages"]
    assert merged_check["ok"] and not merged_check["warning"] and "stages 0, 1, 2" in merged_check["detail"]


def test_a_base_config_that_cannot_be_read_is_a_problem(env, capsys, tmp_path):
    f = tmp_path / "deploy.yaml"
    f.write_text("base_config: nowhere/qwen3_omni_moe.yaml\n" + ARENA.read_text(encoding="utf-8"), encoding="utf-8")
    rc, out = _doctor(capsys, "--deploy", str(f))
    assert rc == 1 and "PROBLEM  deploy stages:" in out and "base_config 'nowhere/qwen3_omni_moe.yaml'" in out, out


def test_a_bad_arena_name_from_the_environment_is_named_as_the_variable(env, capsys, tmp_path):
    """doctor (and the connector at start) called it a bad ``extra.arena_name``, a key the deploy does not have."""
    f = tmp_path / "deploy.yaml"
    f.write_text("connectors:\n  a: {name: OmniAccumArenaConnector, extra: {omni_accum_policy: qwen3-omni}}\n")
    env.setenv("OMNI_ACCUM_ARENA_NAME", "my/server")
    rc, out = _doctor(capsys, "--deploy", str(f))
    line = next(x for x in out.splitlines() if x.startswith("PROBLEM  connector"))
    assert rc == 1 and "OMNI_ACCUM_ARENA_NAME='my/server' (no extra.arena_name): use letters" in line, out
    assert "extra.arena_name =" not in line


@pytest.mark.parametrize(
    ("release", "said"),
    [
        ("0.30.0", "vllm-omni 0.30.0 merges the two (connectors by name, stages by stage_id; this file wins)"),
        # 0.28.0's resolve_deploy_yaml takes the fragment's connectors: block whole, it does not merge it by name
        ("0.28.0", "vllm-omni 0.28.0 merges the two (stages by stage_id, this file wins; its connectors: replace the"),
    ],
)
def test_the_fragment_s_fix_says_how_the_installed_release_merges(env, release, said):
    from omni_accum.cli import doctor_deploy

    env.setattr(doctor_deploy, "_release", lambda: release)
    (note,) = doctor_deploy.check_stages(str(SHM))
    assert note.ok and note.warning and said in note.fix, note


def test_under_0160_a_deploy_in_the_new_format_is_a_problem_and_its_own_stage_args_are_not(env, tmp_path):
    """0.16.0's loader reads ``stage_args:`` and refuses ``stages:`` / ``connectors:``; doctor called a fragment
    ready there, with a base_config fix that 0.16.0 does not read."""
    from omni_accum.cli import doctor_deploy

    env.setattr(doctor_deploy, "_release", lambda: "0.16.0")
    (problem,) = doctor_deploy.check_stages(str(ARENA))
    assert not problem.ok and "vllm-omni 0.16.0 is installed: its loader reads stage_args:" in problem.detail, problem
    assert "(stages:, connectors:)" in problem.detail and "base_config" not in problem.fix
    own = tmp_path / "stage_config.yaml"
    own.write_text("stage_args:\n  - stage_id: 0\n    engine_args: {model_stage: thinker}\n", encoding="utf-8")
    assert doctor_deploy.check_stages(str(own)) == []


@pytest.mark.parametrize("value", ['""', "' '", ""])
def test_an_empty_omni_accum_policy_is_the_key_left_out_as_the_stages_read_it(env, capsys, tmp_path, value):
    """The stages read an empty ``omni_accum_policy`` (``''``, blanks, an empty YAML value) as the key left out, and run
    ``OMNI_ACCUM_POLICY``; doctor loaded ``''`` as a policy and called it a problem (and an empty YAML value "off")."""
    f = tmp_path / "deploy.yaml"
    f.write_text(f"connectors:\n  a:\n    name: SharedMemoryConnector\n    extra: {{omni_accum_policy: {value}}}\n")
    env.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    rc, out = _doctor(capsys, "--deploy", str(f))
    lines = [x for x in out.splitlines() if " policy" in x[:20] or x.startswith(("ok", "PROBLEM", "WARN")) and "policy" in x]
    assert not [x for x in out.splitlines() if x.startswith("PROBLEM  policy")], out
    assert any("OMNI_ACCUM_POLICY" in x and "qwen3-omni" in x for x in lines), out


@pytest.mark.parametrize("change, said", [
    ("from_stage_0: connector_of_arena", "Undefined connector reference"),  # a misspelt reference
    ("    extra:\n", None),  # an extra: that is not a mapping
])  # fmt: skip
def test_connectors_vllm_omni_s_loader_refuses_are_a_problem(env, capsys, tmp_path, change, said):
    """A merged deploy whose connectors vllm-omni's own transfer-config loader refuses (each stage process catches
    it, logs 'Failed to load transfer config' and builds no connector from the file) was "ready", exit 0."""
    text = ARENA.read_text(encoding="utf-8")
    assert change in text
    bad = text.replace(change, change.replace("connector_of_arena", "connector_of_arenaa") if said
                       else "    extra: null\n    unused:\n", 1)  # fmt: skip
    good, merged = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(f"base_config: {_base_config()}\n{text}", encoding="utf-8")
    merged.write_text(f"base_config: {_base_config()}\n{bad}", encoding="utf-8")
    rc, out = _doctor(capsys, "--deploy", str(good))
    assert "deploy connectors" not in out and "ok       deploy stages:" in out, out
    rc, out = _doctor(capsys, "--deploy", str(merged))
    line = next((x for x in out.splitlines() if x.startswith("PROBLEM  deploy connectors")), None)
    assert rc == 1 and line is not None, out
    assert "vllm-omni's loader refuses its connectors" in line and "Failed to load transfer config" in line
    assert said is None or said in line, line


def test_a_deploy_whose_alias_holds_itself_is_one_usage_error(env, capsys, tmp_path):
    """``x: &a [*a]`` made doctor recurse until RecursionError, with a traceback; shared aliases stay fine."""
    from omni_accum.cli.doctor_policy import _read_deploy

    f = tmp_path / "deploy.yaml"
    f.write_text("x: &a [*a]\n", encoding="utf-8")
    rc, out = _doctor(capsys, "--deploy", str(f))
    assert rc == 2, out
    shared = tmp_path / "shared.yaml"
    shared.write_text("a: &s {k: [1]}\nb: *s\nc: [*s, {d: *s}]\n", encoding="utf-8")
    assert _read_deploy(str(shared))["c"][1]["d"] == {"k": [1]}


def test_an_arena_the_file_system_cannot_hold_is_a_note(env, capsys, tmp_path, monkeypatch):
    """Docker's default 64 MiB /dev/shm beside the shipped arena deploy (arena_warm 1GiB on each of its two stage
    pairs, arena_bytes 2GiB): "ready" with no word, while the warm filled the file system and most chunks 0 went the
    inner way. A note now (the connector still starts); none where the file system has the room."""
    import types

    from omni_accum.integrations.vllm_omni import arena_settings

    env.setenv("OMNI_ACCUM_ARENA_DIR", str(tmp_path))
    real = os.statvfs

    def fs(size):
        def statvfs(path):
            st = real(path)
            if os.path.realpath(path).startswith(str(tmp_path)):
                return types.SimpleNamespace(f_blocks=size // 4096, f_bavail=size // 4096, f_frsize=4096,
                                             f_flag=st.f_flag)  # fmt: skip
            return st
        return statvfs

    for size, said in ((64 << 20, "x 2 stage pairs is more than the 67108864 bytes free in"), (3 << 30, "holds"),
                       (64 << 30, None)):  # fmt: skip
        monkeypatch.setattr(arena_settings.os, "statvfs", fs(size))
        rc, out = _doctor(capsys, "--deploy", str(ARENA), "--json")
        notes = [c for c in json.loads(out)["checks"] if c["name"] == "connector" and c["warning"]]
        assert rc == 0, out
        if said is None:
            assert not notes, notes
        else:
            (note,) = notes
            assert said in note["detail"] and "shm-size" in note["fix"], note
    assert "arena_warm 1073741824 bytes" in json.dumps(notes) or said is None
