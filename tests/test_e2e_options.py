"""``benchmarks/e2e/run.py``'s options as a user meets them: every value checked before a server starts (a usage
error, exit 2, one line naming it), the README's own commands accepted, results kept when a run stops early,
and an arm that did not run with omni-accum as its name says failing the run. No server is started here: the
arms run through a stand-in for ``run_arm``."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from tests.test_e2e_arms import RUN_PY, run  # noqa: F401 - the fixture

E2E = RUN_PY.parent


@pytest.fixture
def model(run, tmp_path, monkeypatch):  # noqa: F811
    """A model folder for every variant name of both releases, a 0.30 virtualenv with vllm-omni 0.30.0 (the python
    running run.py) and a 0.16 one with 0.16.0, and
    ``run``'s release globals restored after the test."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    monkeypatch.setattr(run, "RELEASE", run.RELEASE)
    monkeypatch.setattr(run, "VENV_BIN", run.VENV_BIN)
    monkeypatch.setattr(run, "INTERPRETER_BIN", _venv(tmp_path / "venv", "0.30.0") / "bin")  # the harness's venv
    monkeypatch.delenv("OMNI_ACCUM_E2E_VENV", raising=False)
    for name in list(run.MODELS):
        monkeypatch.setitem(run.MODELS, name, folder)
    venv = _venv(tmp_path / "venv-016", "0.16.0")
    monkeypatch.setitem(run.RELEASES, "0.16", dataclasses.replace(
        run.RELEASES["0.16"], venv=venv, models={n: folder for n in run.RELEASES["0.16"].models}))  # fmt: skip
    return folder


def _venv(path: Path, version: str | None, torchvision: bool = True) -> Path:
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "vllm-omni").write_text("")
    if version:
        (path / "lib" / "python3.11" / "site-packages" / f"vllm_omni-{version}.dist-info").mkdir(parents=True)
    if version and torchvision:
        (path / "lib" / "python3.11" / "site-packages" / "torchvision-0.28.0.dist-info").mkdir(parents=True)
    return path


def _usage_error(run, capsys, argv: list[str]) -> str:  # noqa: F811
    with pytest.raises(SystemExit) as e:
        run.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, (argv, err)
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--arms", "bogus"], "arm 'bogus': 'bogus' is neither a policy file nor a preset"),
        (["--arms", "Off"], "a preset: default, qwen3-omni, qwen3-omni-flat, or a policy file"),
        (["--arms", "off#x"], "arm 'off#x'"),
        (["--arms", "qwen3_omni@arena"], "arm 'qwen3_omni'"),
        (["--arms", "@arena"], "arm '@arena': no arm before '@' (e.g. off@arena"),
        (["--arms", ","], "--arms ',': no arm"),
        (["--arms", "off,missing-policy.yaml"], "missing-policy.yaml: no such policy file"),
        (["--arms", f"{E2E / 'configs' / 'qwen3_omni_cpu.yaml'}"], "unknown field. Allowed fields: "),  # each problem
        (["--output-len", "0"], "--output-len: 0 is below 1"),
        (["--num-prompts", "-3"], "--num-prompts: -3 is below 0"),
        (["--num-prompts", "2", "--concurrency", "1,4"], "--num-prompts 2 is below --concurrency 4"),
        (["--start-timeout", "0"], "--start-timeout: 0 is not more than 0"),
        (["--stop-grace", "-1"], "--stop-grace: -1 is negative"),
        (["--duration-s", "inf"], "--duration-s: inf is not a number of seconds"),
        (["--sample-every-s", "nan"], "--sample-every-s: nan is not a number of seconds"),
        (["--smoke-max-tokens", "0"], "--smoke-max-tokens: 0 is below 1"),
        (["--input-len", "²"], "--input-len: '²'"),
        (["--concurrency", "x"], "e.g. 1,4"),
        (["--input-len", "40900"], "--input-len 40900 + --output-len 100 = 41000 tokens exceed --deploy-config's "
                                   "max_model_len 40960"),  # fmt: skip
        (["--kill-stage", "7"], "--kill-stage 7: --deploy-config has no stage 7 (stages [0, 1, 2])"),
        (["--smoke", "--input-len", "8000", "--seed", "3"], "--smoke runs no benchmark, so --input-len, --seed"),
        (["--kill-after-s", "5"], "--kill-after-s 5: times --kill-stage or --hosts-fault, and neither is given"),
        (["--deploy-config", str(E2E / "configs" / "0.16" / "qwen3_omni_cpu.yaml")],
         "is vllm-omni 0.16's format and this run starts a 0.30 server: run it with --release 0.16"),  # fmt: skip
        (["--release", "0.16.0", "--deploy-config", str(E2E / "configs" / "qwen3_omni_cpu.yaml")],
         "is vllm-omni 0.30's format and this run starts a 0.16 server"),  # fmt: skip
        (["--release", "0.16", "--arms", "off@arena"], "none in"),  # 0.16 has no NAMEd deploys
        (["--hosts", "4", "--hosts-fault", "link-down"], "which host? (link-down:ROLE[:SECONDS], ROLE one of"),
    ],
)
def test_a_bad_value_is_one_line_before_anything_starts(run, model, capsys, monkeypatch, argv, needle):  # noqa: F811
    monkeypatch.setattr(run, "run_arm", lambda *a: pytest.fail(f"an arm started for {argv}"))
    assert needle in _usage_error(run, capsys, ["--model", str(model), *argv])


def test_outputs_that_cannot_be_written_are_refused_first(run, model, capsys, monkeypatch, tmp_path):  # noqa: F811
    monkeypatch.setattr(run, "run_arm", lambda *a: pytest.fail("an arm started"))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for argv, needle in [
        (["--json", str(tmp_path)], f"--json {tmp_path}: is a folder (give a file name"),
        (["--json", str(a_file / "e.json")], f"{a_file} exists and is not a folder"),
        (["--keep-logs", str(a_file)], f"--keep-logs {a_file}: {a_file} exists and is not a folder"),
        (["--work-dir", str(a_file / "runs")], f"{a_file} is not a folder, so {a_file / 'runs'} cannot be made"),
        (["--capture", str(a_file)], f"--capture {a_file}"),
    ]:
        assert needle in _usage_error(run, capsys, ["--model", str(model), *argv]), argv


def test_the_interpreter_must_hold_the_release_it_runs(run, model, capsys, monkeypatch, tmp_path):  # noqa: F811
    assert run.installed_release(tmp_path / "none" / "bin") is None
    assert run.installed_release(_venv(tmp_path / "v030", "0.30.0") / "bin") == "0.30"
    assert run.installed_release(_venv(tmp_path / "v030p", "0.30.0.post1") / "bin") == "0.30"
    assert run.installed_release(_venv(tmp_path / "vx", None) / "bin") == "unknown"
    monkeypatch.setattr(run, "INTERPRETER_BIN", _venv(tmp_path / "v016", "0.16.0") / "bin")
    assert "has vllm-omni 0.16, and this run is for 0.30's server: add --release 0.16" in _usage_error(
        run, capsys, ["--model", str(model)]
    )
    monkeypatch.setattr(run, "INTERPRETER_BIN", _venv(tmp_path / "v028", "0.28.0") / "bin")
    assert "the harness runs 0.30, 0.16" in _usage_error(run, capsys, ["--model", str(model)])
    monkeypatch.setattr(run, "INTERPRETER_BIN", tmp_path / "plain" / "bin")
    assert "no vllm-omni beside" in _usage_error(run, capsys, ["--model", str(model)])
    monkeypatch.setattr(run, "INTERPRETER_BIN", _venv(tmp_path / "dotvenv", "0.30.0", torchvision=False) / "bin")
    assert "has vllm-omni but no torchvision, so `vllm-omni serve` cannot start there" in _usage_error(
        run, capsys, ["--model", str(model)]
    )
    # a run after a --release 0.16 run in the same process starts 0.30's server again
    monkeypatch.setattr(run, "INTERPRETER_BIN", _venv(tmp_path / "v030b", "0.30.0") / "bin")
    argv_016 = ["--model", str(model), "--release", "0.16", "--kill-stage", "9"]
    assert "--kill-stage 9" in _usage_error(run, capsys, argv_016)
    assert "this run starts a 0.30 server" in _usage_error(
        run, capsys, ["--model", str(model), "--deploy-config", str(E2E / "configs" / "0.16" / "qwen3_omni_cpu.yaml")]
    )


def _fake_arm(seen: list[str], interrupt_at: str | None = None):
    def run_arm(arm, args, run_dir):  # what run.run_arm returns for a server that answered and was stopped
        if arm.name == interrupt_at:
            raise KeyboardInterrupt("signal SIGTERM")
        seen.append(arm.name)
        on = arm.env["OMNI_ACCUM_VLLM_OMNI"] == "1"
        probe = {"http_status": 200, "text": "hi", "audio_bytes": 10, "audio_sha256": "ab", "token_ids": [1]}
        return {"arm": arm.name, "env": arm.env, "started": True, "stop": {"clean": True},
                "correctness": dict(probe, probes=[probe]),
                "coverage": [{"pid": 7, "installed": on, "bound": on}]}  # fmt: skip

    return run_arm


def test_the_json_is_written_after_each_arm_and_when_interrupted(run, model, monkeypatch, tmp_path):  # noqa: F811
    seen: list[str] = []
    out = tmp_path / "res" / "e2e.json"
    writes: list[dict[str, Any]] = []
    real = run.write_json
    monkeypatch.setattr(run, "write_json", lambda p, s: (writes.append(json.loads(json.dumps(s, default=str))),
                                                         real(p, s)))  # fmt: skip
    monkeypatch.setattr(run, "run_arm", _fake_arm(seen, interrupt_at="qwen3-omni"))
    argv = ["--model", str(model), "--arms", "off,default,qwen3-omni", "--json", str(out), "--work-dir", str(tmp_path)]
    assert run.main(argv) == 130
    assert seen == ["off", "default"]
    assert [(w["complete"], w.get("arms_left")) for w in writes] == [
        (False, ["default", "qwen3-omni"]), (False, ["qwen3-omni"]), (False, ["qwen3-omni"])
    ]  # fmt: skip
    last = json.loads(out.read_text())
    assert last["interrupted"] == "signal SIGTERM" and [a["arm"] for a in last["arms"]] == ["off", "default"]
    assert not list(out.parent.glob(".*tmp"))
    seen.clear()
    monkeypatch.setattr(run, "run_arm", _fake_arm(seen))
    assert run.main(argv) == 0
    done = json.loads(out.read_text())
    assert done["complete"] is True and done["ok"] is True and "arms_left" not in done and len(done["arms"]) == 3


def test_sigterm_while_a_lab_is_open_writes_the_finished_arms_and_exits_130(run, model, monkeypatch, tmp_path):  # noqa: F811
    """Opening ``--hosts``' lab replaces run.py's SIGTERM handler with the lab's, which raises ``netns.Interrupted``:
    the run ends as on Ctrl-C (the finished arms' JSON written, exit 130), not with a traceback."""
    import signal

    seen: list[str] = []
    lab_signal = run.hosts_mode.netns.Interrupted(signal.SIGTERM)  # what the lab's handler raises

    def arm(a, args, run_dir):
        if a.name == "qwen3-omni":
            raise lab_signal
        return _fake_arm(seen)(a, args, run_dir)

    monkeypatch.setattr(run, "run_arm", arm)
    out = tmp_path / "e2e.json"
    argv = ["--model", str(model), "--arms", "off,qwen3-omni,default", "--json", str(out), "--work-dir", str(tmp_path)]
    assert run.main(argv) == 130
    last = json.loads(out.read_text())
    assert last["complete"] is False and last["interrupted"] == "interrupted by SIGTERM"
    assert [a["arm"] for a in last["arms"]] == ["off"] and last["arms_left"] == ["qwen3-omni", "default"]


class _FakeHostsServer:
    """Stands in for ``hosts.HostsServer``: records that its lab was opened and stopped."""

    events: list[str] = []
    base, addresses = "http://10.231.0.11:8000", ["10.231.0.11"]

    def __init__(self, **kw: Any) -> None:
        self.events.append("made")

    def open(self) -> _FakeHostsServer:
        self.events.append("open")
        return self

    def stop(self, known: list) -> dict:
        self.events.append("stop")
        return {"clean": True}


@pytest.mark.parametrize("failure", ["error", "signal"])
def test_a_failure_right_after_the_lab_opens_still_removes_it(run, model, monkeypatch, tmp_path, failure):  # noqa: F811
    """Between ``HostsServer.open()`` (namespaces, bridge, veth, route) and the arm's own try (whose finally stops
    the server), an exception or a signal still stops it: nothing is left for ``netns.py --sweep``."""
    import argparse
    import signal

    events: list[str] = []
    monkeypatch.setattr(_FakeHostsServer, "events", events)
    monkeypatch.setattr(run.hosts_mode, "HostsServer", _FakeHostsServer)
    monkeypatch.setenv("NO_PROXY", "")  # run_arm sets it for the lab's addresses: restored after the test
    monkeypatch.setenv("no_proxy", "")
    raised = RuntimeError("injected") if failure == "error" else run.hosts_mode.netns.Interrupted(signal.SIGTERM)

    def shm_entries():  # the first call after the lab is made, before the arm's try
        raise raised

    monkeypatch.setattr(run, "shm_entries", shm_entries)
    args = argparse.Namespace(hosts=4, deploy_config=str(E2E / "configs" / "qwen3_omni_cpu_mooncake.yaml"),
                              model=str(model), start_timeout=10, stop_grace=1, idle_spin_s=None, omp_wait=None,
                              executor=None, capture=None)  # fmt: skip
    with pytest.raises(type(raised)):
        run.run_arm(run.make_arm("off"), args, tmp_path)
    assert events == ["made", "open", "stop"]


def test_an_arm_that_did_not_run_as_named_fails_the_run(run, model, capsys, monkeypatch, tmp_path):  # noqa: F811
    import e2e_procs

    def unbound(*a):
        r = _fake_arm([])(*a)
        r["coverage"] = [{"pid": 7, "installed": True, "bound": False}]  # a policy the stages refused
        return r

    monkeypatch.setattr(run, "run_arm", unbound)
    assert run.main(["--model", str(model), "--arms", "qwen3-omni", "--work-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "FAIL: arm qwen3-omni: omni-accum is on in this arm, and no server process bound it" in err
    off = {"env": {"OMNI_ACCUM_VLLM_OMNI": "0"}, "coverage": [{"pid": 9, "installed": True, "bound": False}]}
    assert e2e_procs.coverage_problem(off) == "omni-accum is off in this arm, and it installed in process 9"
    assert e2e_procs.coverage_problem({"env": {"OMNI_ACCUM_VLLM_OMNI": "0"}, "coverage": [{"pid": 9}]}) is None


def _readme_commands() -> list[list[str]]:
    """Every ``run.py`` command line of the harness's README's bash blocks, as arguments after ``run.py``."""
    text = (E2E / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0]
            if "benchmarks/e2e/run.py" in line and not line.lstrip().startswith("#"):
                words = shlex.split(line.split(">")[0].split("|")[0])
                out.append(words[words.index("benchmarks/e2e/run.py") + 1 :])
    return out


def test_every_command_of_the_readme_is_accepted(run, model, monkeypatch, tmp_path):  # noqa: F811
    """Each README command passes every check (with model folders in place; the policy files it names as
    arms are ones it writes first, made here), and reaches the first arm."""
    commands = _readme_commands()
    assert len(commands) > 40
    monkeypatch.setattr(run.hosts_mode, "prerequisites", lambda _python: None)  # root, ip, Mooncake
    monkeypatch.chdir(tmp_path)
    reached = []

    class Reached(Exception):
        pass

    def first_arm(arm, args, run_dir):
        reached.append(arm.name)
        raise Reached

    monkeypatch.setattr(run, "run_arm", first_arm)
    for argv in commands:
        if "--report" in argv:  # a saved run, printed again: nothing starts
            monkeypatch.chdir(RUN_PY.parent.parent.parent)
            assert run.main(argv) == 0, argv
            monkeypatch.chdir(tmp_path)
            continue
        argv = [a for a in argv if not a.startswith("--work-dir")] + ["--work-dir", str(tmp_path / "runs")]
        for i, a in enumerate(argv):
            if argv[i - 1] == "--model" and a not in run.MODELS:
                argv[i] = str(model)  # a model folder of the user's
        for arm in ",".join(a for i, a in enumerate(argv) if argv[i - 1] == "--arms").split(","):
            policy = arm.split("@")[0].split("#")[0]
            if policy.endswith((".yaml", ".json", ".toml")):  # a policy the README's commands tuned first
                Path(policy).parent.mkdir(parents=True, exist_ok=True)
                Path(policy).write_text("rules: []\n")
        n = len(reached)
        with pytest.raises(Reached):
            run.main(argv)
        assert len(reached) == n + 1, argv


def test_a_saved_run_is_reported_again_without_starting_anything(run, capsys, monkeypatch, tmp_path):  # noqa: F811
    """``--report FILE`` prints what the run printed (the tables per input length and concurrency, the probes),
    for every run kept under results/runs/, which the READMEs cite; a bad file or another option is one line."""
    monkeypatch.setattr(run, "run_arm", lambda *a: pytest.fail("an arm started"))
    saved = sorted((E2E / "results" / "runs").glob("*.json"))
    assert len(saved) >= 19
    for path in saved:
        assert run.main(["--report", str(path)]) == 0, path
        out = capsys.readouterr().out
        data = json.loads(path.read_text())
        arms = [a["arm"] for a in data["arms"]]
        assert out.startswith(f"run {data['run_dir']}: arms {data['args']['arms']}"), path
        # the ratios' reference: the first arm with omni-accum off (off, off@NAME), named
        ref = next((a for a in arms if a.split("@")[0].split("#")[0] == "off"), None)
        said = f"ratio: arm / {ref}" if ref else "no off arm, so no ratios"
        for n in json.loads(data["args"]["input_len"]):
            for c in json.loads(data["args"]["concurrency"]):
                assert f"input {n} tokens, concurrency {c} ({said})" in out, (path, n, c)
        header = next(line for line in out.splitlines() if line.lstrip().startswith("metric "))
        assert header.split()[1:] == arms, (path, header)  # each arm's whole name: no two columns read alike
        if ref:
            assert "x)" in out and out.count(f"equals {ref}: {{'equals_off': True") == len(arms) - 1, path
        assert out.count(" probe 0: HTTP 200") == len(arms), path
        assert out.rstrip().endswith("verdict when it ran: ok"), path
    bad = tmp_path / "bad.json"
    cases = [
        ("{", "not JSON (line 1, column 2"),
        ('{"arms": [1]}', "not a run.py --json file"),
        ('{"arms": [{"arm": "x", "correctness": 3}], "args": [1]}', "not a run.py --json file (an arm's results do not"),
    ]
    for content, needle in cases:
        bad.write_text(content)
        assert f"--report {bad}: {needle}" in _usage_error(run, capsys, ["--report", str(bad)])
    assert "cannot read it (No such file or directory)" in _usage_error(run, capsys, ["--report", str(tmp_path / "x")])
    assert "so --arms, --hosts would do nothing: drop them or --report" in _usage_error(
        run, capsys, ["--report", str(saved[0]), "--arms", "off", "--hosts", "4"]
    )


def test_help_names_the_exit_status_models_and_deploys_and_a_broken_deploy_is_one_line(
    run, model, capsys, tmp_path  # noqa: F811
):
    with pytest.raises(SystemExit):
        run.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Exit status: 0 when every arm started" in text and "130 when interrupted" in text
    assert "lean: light with a quarter of its attention work" in text
    assert "(arena, arena_chunked," in text and "Needs root, ip (iproute2)" in text
    broken = tmp_path / "deploy.yaml"
    broken.write_text("stages: [1\n  b")
    err = _usage_error(run, capsys, ["--model", str(model), "--deploy-config", str(broken)])
    assert f"{broken}: not a YAML file (line 2, column 4: expected ',' or ']'" in err


def _deploy_file(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("stages:\n- {stage_id: null}\n", "stages[0]: stage_id None is not a stage number"),
        ("stages:\n- {stage_id: 0}\n- {stage_id: abc}\n", "stages[1]: stage_id 'abc' is not a stage number"),
        ("stages:\n- {stage_id: 0, max_model_len: 40k}\n", "stage 0: max_model_len '40k' is not a number of tokens"),
        ("stages:\n- {stage_id: 0}\n- {stage_id: 0}\n", "stages[1]: stage_id 0 is given twice"),
        ("stages: []\n", "stages is empty"),
        ("stages:\n- 3\n", "stages[0] is 3, not a mapping"),
        (b"stages:\n- {stage_id: 0}\n# \xff\xfe\n", "not UTF-8 text (byte 26"),
        ("stage_args:\n- {stage_id: 0, engine_args: {max_model_len: true}}\n",
         "stage 0: engine_args.max_model_len True is not a number of tokens"),  # fmt: skip
    ],
)
def test_a_garbled_deploy_is_a_usage_error_naming_the_file_stage_and_key(run, model, capsys, monkeypatch, tmp_path,  # noqa: F811
                                                                         content, needle):  # fmt: skip
    monkeypatch.setattr(run, "run_arm", lambda *a: pytest.fail("an arm started"))
    deploy = _deploy_file(tmp_path, "deploy.yaml", content)
    err = _usage_error(run, capsys, ["--model", str(model), "--deploy-config", str(deploy)])
    assert f"--deploy-config: {deploy}: {needle}" in err, err


def test_max_model_len_minus_one_is_vllms_own_fit_not_a_garbled_value(run, tmp_path):  # noqa: F811
    """vLLM takes ``max_model_len: -1`` (fit to the memory): read as no limit the harness can check, not refused."""
    read_deploy = run.check_deploy.__globals__["read_deploy"]
    _, stages = read_deploy(_deploy_file(tmp_path, "d.yaml", "stages:\n- {stage_id: 0, max_model_len: -1}\n"))
    assert stages == {0: None}
    with pytest.raises(ValueError, match="max_model_len -2 is not a number of tokens"):
        read_deploy(_deploy_file(tmp_path, "e.yaml", "stages:\n- {stage_id: 0, max_model_len: -2}\n"))


def test_a_folder_as_deploy_config_is_named_a_folder(run, model, capsys, monkeypatch, tmp_path):  # noqa: F811
    monkeypatch.setattr(run, "run_arm", lambda *a: pytest.fail("an arm started"))
    err = _usage_error(run, capsys, ["--model", str(model), "--deploy-config", str(tmp_path)])
    assert f"--deploy-config {tmp_path}: is a folder, not a deploy file" in err, err
    err = _usage_error(run, capsys, ["--model", str(model), "--arms", f"off@{tmp_path}"])
    assert "is a folder, not a deploy config" in err, err


def test_hosts_read_a_stage_without_stage_id_as_run_py_does(run, tmp_path):  # noqa: F811
    import hosts

    assert hosts.stage_ids({"stages": [{"stage_id": 0}, {}, {"stage_id": 2}]}) == [0, 1, 2]
    _, stages = run.check_deploy.__globals__["read_deploy"](
        _deploy_file(tmp_path, "d.yaml", "stages:\n- {stage_id: 0}\n- {}\n- {stage_id: 2}\n"))
    assert sorted(stages) == [0, 1, 2]
    with pytest.raises(hosts.HostsUsageError, match=r"d.yaml: stages\[1\]: stage_id 'x' is not a stage number"):
        hosts.stage_ids({"stages": [{"stage_id": 0}, {"stage_id": "x"}]}, tmp_path / "d.yaml")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--smoke", "--smoke-max-tokens", "100000"], "--smoke-max-tokens 100000 + a correctness probe's prompt"),
        (["--input-len", "8000,8000"], "--input-len: 8000 is given twice in '8000,8000'"),
        (["--concurrency", "1,4,1"], "--concurrency: 1 is given twice in '1,4,1'"),
        (["--start-timeout", "nan"], "--start-timeout: nan is not a number of seconds (a finite number, more than 0)"),
        (["--stop-grace", "inf"], "(a finite number, 0 or more)"),
        (["--warmup-s", "30", "--sample-every-s", "0"], "--warmup-s 30: times the memory samples' flatness verdict"),
        (["--keep-logs", ""], "argument --keep-logs: '' is an empty path"),
        (["--arms", "#2"], "arm '#2': ARM#N needs an ARM before the '#' (e.g. off#2"),
        (["--arms", "@"], "arm '@': no arm before '@' (e.g. off@arena or qwen3-omni@arena: the arm's policy"),
        (["--arms", "off@"], "arm 'off@': no deploy config after '@'"),
    ],
)
def test_values_that_would_fail_only_after_a_server_started_are_refused(run, model, capsys, monkeypatch, argv,  # noqa: F811
                                                                       needle):  # fmt: skip
    monkeypatch.setattr(run, "run_arm", lambda *a: pytest.fail(f"an arm started for {argv}"))
    assert needle in _usage_error(run, capsys, ["--model", str(model), *argv])


def test_a_model_path_that_is_not_a_model_folder_says_what_it_needs(run, model, capsys, monkeypatch, tmp_path):  # noqa: F811
    monkeypatch.setattr(run, "run_arm", lambda *a: pytest.fail("an arm started"))
    empty = tmp_path / "empty"
    empty.mkdir()
    err = _usage_error(run, capsys, ["--model", str(empty)])
    assert f"--model {empty}: {empty} has no config.json, so it holds no model (give a model folder" in err, err
    assert "does not exist" in _usage_error(run, capsys, ["--model", str(tmp_path / "nowhere")])


def test_a_fraction_of_a_second_start_timeout_gives_the_stages_a_whole_second(run, model, monkeypatch, tmp_path):  # noqa: F811
    def no_server(cmd, *a, **k):
        raise RuntimeError("no server in this test")

    monkeypatch.setattr(run.subprocess, "Popen", no_server)
    monkeypatch.setattr(run, "shm_cleanup", lambda before: {})
    monkeypatch.setattr(run, "omni_accum_left", lambda before, entries: [])
    out = tmp_path / "e.json"
    argv = ["--model", str(model), "--arms", "off", "--smoke", "--start-timeout", "0.5", "--sample-every-s", "0",
            "--work-dir", str(tmp_path / "runs"), "--json", str(out)]  # fmt: skip
    assert run.main(argv) == 1
    cmd = json.loads(out.read_text())["arms"][0]["server_cmd"]
    assert cmd[cmd.index("--stage-init-timeout") + 1] == "1", cmd


def test_a_saved_run_whose_arms_left_is_not_a_list_is_one_line(run, capsys, tmp_path):  # noqa: F811
    saved = json.loads(sorted((E2E / "results" / "runs").glob("*.json"))[0].read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**saved, "complete": False, "arms_left": 5}))
    assert f"--report {bad}: not a run.py --json file (\"arms_left\" is 5, not a list" in _usage_error(
        run, capsys, ["--report", str(bad)]
    )


def test_report_help_names_where_the_saved_runs_are(run, capsys):  # noqa: F811
    with pytest.raises(SystemExit):
        run.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "benchmarks/e2e/results/runs/*.json" in text and "e2e.json)" not in text


# ---------------------------------------------------------------------- the audit of the harness's report (failures)
def _arm_result(name: str, on: bool, bench: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    probe = {"http_status": 200, "text": "hi", "text_token_ids": [1, 2], "audio_bytes": 10, "audio_sha256": "ab"}
    return {"arm": name, "started": True, "env": {"OMNI_ACCUM_VLLM_OMNI": "1" if on else "0"},
            "correctness": {"probes": [probe]}, "stop": {"clean": True},
            "coverage": [{"pid": 1, "installed": on, "bound": on}], "bench": bench, **extra}  # fmt: skip


def _cell(completed: int | None, failed: int = 0, rc: int = 0, ttfp: float = 1000.0) -> dict[str, Any]:
    raw = None if completed is None else {"p50_audio_ttfp_ms": ttfp, "completed": completed, "failed": failed}
    return {"input_len": 8000, "concurrency": 4, "num_prompts": 8, "rc": rc, **({"raw": raw} if raw else {})}


def test_unanswered_benchmark_requests_fail_the_run_and_show_in_the_table(run):  # noqa: F811
    """Failed requests were dropped silently: an arm with 2 of 8 answered printed a plain p50 (over the 2) and the
    run exited 0; a client that failed or timed out (the arm's error) too."""
    from e2e_report import answered, table_lines

    ok = _arm_result("off", False, [_cell(8, ttfp=4000.0)])
    cases = {
        "2 of 8 requests answered, 6 failed": _arm_result("qwen3-omni", True, [_cell(2, 6)]),
        "the benchmark client exited 1 without a result": _arm_result("default", True, [_cell(None, rc=1)]),
        "TimeoutExpired": _arm_result("qwen3-omni#2", True, [], error="TimeoutExpired: timed out after 3600 seconds"),
    }
    said: list[str] = []
    assert run.verdict([ok], said.append) and not said
    for needle, arm in cases.items():
        said.clear()
        assert not run.verdict([ok, arm], said.append)
        assert any(needle in s for s in said), said
    faulted = {**cases["2 of 8 requests answered, 6 failed"], "fault": {"server_running": True}}
    assert run.verdict([ok, faulted], said.append)  # a fault run reports its failed requests itself
    held = {**_cell(8), "rounds": [_cell(8)] * 3, "num_prompts": 24, "completed": 24, "failed": 0}  # --duration-s
    assert run.verdict([ok, _arm_result("default", True, [held])], said.append), said  # raw: round 1's only
    assert answered(held) == "24/24" and answered({**held, "completed": 23, "failed": 1}) == "23/24 !"
    lines = table_lines([ok, cases["2 of 8 requests answered, 6 failed"], cases["the benchmark client exited 1 without a result"]])
    (row,) = [line for line in lines if line.strip().startswith("requests answered")]
    assert row.split()[2:] == ["8/8", "2/8", "!", "rc", "1"], row


def test_the_report_of_a_saved_run_keeps_the_stage_rows(run):  # noqa: F811
    """``--json`` turns the orchestrator's stage numbers into text keys; ``--report`` then lost the 0.16 talker and
    thinker rows (README figures came from them)."""
    from e2e_report import table_lines

    def arm(name: str, on: bool, ms: float) -> dict[str, Any]:
        b = {**_cell(8), "stages": {"stages": {1: {"ms_per_token": ms, "wall_ms": 100 * ms}, 0: {"wall_ms": 5.0}}}}
        return _arm_result(name, on, [b])

    live = [arm("off", False, 250.0), arm("qwen3-omni", True, 125.0)]
    saved = json.loads(json.dumps(live))
    rows = [[line for line in table_lines(r) if "talker ms/token" in line] for r in (live, saved)]
    assert rows[0] == rows[1] and len(rows[0]) == 1 and "(0.50x)" in rows[0][0], rows


def test_two_arms_of_one_run_folder_are_refused(run, model, capsys, monkeypatch, tmp_path):  # noqa: F811
    """``pol/a.yaml`` and ``pol_a.yaml`` both became the folder ``pol_a.yaml``: the second arm's logs replaced the
    first's, and a second client without a result file read the first's as its own."""
    monkeypatch.setattr(run, "run_arm", lambda *a: pytest.fail("an arm started"))
    (tmp_path / "pol").mkdir()
    for f in (tmp_path / "pol" / "a.yaml", tmp_path / "pol_a.yaml"):
        f.write_text("default: cat\n")
    monkeypatch.chdir(tmp_path)
    err = _usage_error(run, capsys, ["--model", str(model), "--arms", "off,pol/a.yaml,pol_a.yaml"])
    assert "pol/a.yaml and pol_a.yaml would share the run folder 'pol_a.yaml'" in err, err


def test_a_talker_shorter_than_the_prompt_is_a_usage_error(run, model, capsys, monkeypatch, tmp_path):  # noqa: F811
    """Only stage 0's max_model_len was checked: a talker of 4096 tokens passed with --input-len 8000."""
    monkeypatch.setattr(run, "run_arm", lambda *a: pytest.fail("an arm started"))
    deploy = _deploy_file(tmp_path, "d.yaml", "stages:\n- {stage_id: 0, max_model_len: 40960}\n"
                          "- {stage_id: 1, max_model_len: 4096}\n- {stage_id: 2}\n")  # fmt: skip
    err = _usage_error(run, capsys, ["--model", str(model), "--deploy-config", str(deploy), "--input-len", "8000"])
    assert "--input-len 8000: the talker's prefill takes 8001 rows" in err and "max_model_len 4096 of stage 1" in err, err
