"""The shell scripts' usage as a user meets it: ``scripts/main.sh``, ``scripts/release.sh``, ``scripts/test.sh``,
``benchmarks/e2e/abort_orphans.sh`` and ``benchmarks/e2e/setup_env.sh``. Nothing real runs here: each script runs
either from a copy in a stand-in tree whose ``env.sh`` / ``vllm-omni`` / ``python`` only record that they were called,
or with ``PYTHON=/bin/false`` so that going on to real work would fail at its first step (and be seen)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
E2E = ROOT / "benchmarks" / "e2e"


def _env(**extra: str) -> dict[str, str]:
    drop = ("OMNI_ACCUM_", "CI", "PYTHON")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: Path | None = None, timeout: int = 60):
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)  # fmt: skip


def _exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _fake_root(tmp: Path, script: str) -> tuple[Path, Path]:
    """A stand-in tree with a copy of ``scripts/<script>``, an env.sh that records that it was sourced and puts a
    stub bin/ first on PATH, a disk.sh whose check passes; the calls go to ``calls.log``."""
    root = tmp / "root"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / script, root / "scripts" / script)
    calls = tmp / "calls.log"
    stub_bin = tmp / "bin"
    for name in ("omni-accum", "python"):
        _exe(stub_bin / name, f'#!/bin/sh\necho "{name} ${{OMNI_ACCUM_VLLM_VERSION:-}} $*" >> "{calls}"\n'
                              'echo "1 passed in 0.01s"\n')  # fmt: skip
    (root / "scripts" / "env.sh").write_text(f'echo "env.sh" >> "{calls}"\nexport PATH="{stub_bin}:$PATH"\n')
    (root / "scripts" / "disk.sh").write_text("omni_accum_need_disk() { return 0; }\n")
    return root, calls


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_main_sh_help_prints_its_usage_and_runs_nothing(tmp_path, flag):
    root, calls = _fake_root(tmp_path, "main.sh")
    r = _run(["bash", str(root / "scripts" / "main.sh"), "--quick", flag], _env(OMNI_ACCUM_OUT=str(tmp_path / "o")))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: bash scripts/main.sh") and "Extra arguments go to `omni-accum tune`" in r.stdout
    assert not calls.exists(), calls.read_text()  # neither env.sh nor omni-accum
    assert not (tmp_path / "o").exists()


def _tune_call(calls: Path) -> str:
    """The arguments main.sh gave ``omni-accum tune`` (its line in calls.log)."""
    line = next(ln for ln in calls.read_text().splitlines() if ln.startswith("omni-accum ") and " tune " in ln)
    return line.split(" ", 1)[1].strip()


def test_main_sh_names_the_workload_it_tunes(tmp_path):
    root, calls = _fake_root(tmp_path, "main.sh")
    env = _env(OMNI_ACCUM_OUT=str(tmp_path / "o"))
    r = _run(["bash", str(root / "scripts" / "main.sh"), "--quick", "--workload", "my.yaml"], env)
    assert r.returncode == 0, r.stderr
    assert "== 1. omni-accum tune --workload my.yaml (accumulation per key)" in r.stdout, r.stdout
    assert "tune --out" in calls.read_text() and "--workload my.yaml" in calls.read_text()
    assert "qwen3-omni-0.30" not in _tune_call(calls)  # the workload given, not the default too
    r = _run(["bash", str(root / "scripts" / "main.sh"), "--workload=other.yaml"], env)
    assert "== 1. omni-accum tune --workload other.yaml (" in r.stdout, r.stdout
    calls.write_text("")
    r = _run(["bash", str(root / "scripts" / "main.sh"), "--trace", "caps"], env)  # tune refuses both together
    assert "== 1. omni-accum tune --trace caps (" in r.stdout, r.stdout
    assert "--workload" not in _tune_call(calls) and "--trace caps" in _tune_call(calls)
    calls.write_text("")
    r = _run(["bash", str(root / "scripts" / "main.sh")], env)
    assert "== 1. omni-accum tune --workload qwen3-omni-0.30 (" in r.stdout, r.stdout
    assert _tune_call(calls).startswith("tune --workload qwen3-omni-0.30 --out "), calls.read_text()


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_release_sh_help_prints_its_usage(tmp_path, flag):
    r = _run(["bash", str(ROOT / "scripts" / "release.sh"), flag], _env(PYTHON="/bin/false"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: bash scripts/release.sh [OUT_DIR]") and "OMNI_ACCUM_RELEASE_REF" in r.stdout
    assert "[release]" not in r.stderr  # no step started


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["OUT1", "OUT2"], {}, "release.sh: one OUT_DIR at most, got 2 arguments"),
        (["--out"], {}, "release.sh: unknown option '--out'"),
        ([], {"OMNI_ACCUM_RELEASE_REF": "no-such-ref-xyz"}, "OMNI_ACCUM_RELEASE_REF=no-such-ref-xyz is not a commit"),
    ],
)
def test_release_sh_refuses_bad_arguments_before_building(tmp_path, argv, env, needle):
    (tmp_path / "OUT1").mkdir()
    (tmp_path / "OUT2").mkdir()
    r = _run(["bash", str(ROOT / "scripts" / "release.sh"), *argv], _env(PYTHON="/bin/false", **env), cwd=tmp_path)
    assert r.returncode == 2 and needle in r.stderr, (r.returncode, r.stderr)
    assert "[release]" not in r.stderr  # the throwaway environment was not started
    assert not list((tmp_path / "OUT1").iterdir())


@pytest.mark.parametrize("word", ["1", "true", "TRUE", "yes", " Yes "])
def test_test_sh_switches_take_the_words_ci_takes(tmp_path, word):
    root, calls = _fake_root(tmp_path, "test.sh")
    env = _env(OMNI_ACCUM_TEST_028=word, OMNI_ACCUM_TEST_016="no", OMNI_ACCUM_VENV_028=str(tmp_path / "v028"),
               OMNI_ACCUM_VENV=str(tmp_path / "venv"))  # fmt: skip
    r = _run(["bash", str(root / "scripts" / "test.sh"), "-q"], env, cwd=root)
    said = calls.read_text()
    assert "python 0.28.0 -m pytest -m not once" in said, (word, said, r.stdout[-2000:], r.stderr[-2000:])
    assert "0.16.0" not in said


@pytest.mark.parametrize(("args", "pytest_args"), [
    (["tests/test_x.py", "-q"], "tests/test_x.py -q"),
    (["tests/test_x.py::test_a", "-x"], "tests/test_x.py::test_a -x"),
    (["-k", "foo"], "tests -k foo"),
    (["--basetemp", "tests", "-q"], "tests --basetemp tests -q"),  # an option's value is not a test path
])  # fmt: skip
def test_test_sh_runs_the_test_files_given_instead_of_the_whole_suite(tmp_path, args, pytest_args):
    """``bash scripts/test.sh tests/test_x.py`` ran the whole suite and that file again (its arguments were added
    to the default paths)."""
    root, calls = _fake_root(tmp_path, "test.sh")
    (root / "tests").mkdir()
    (root / "tests" / "test_x.py").write_text("")
    r = _run(["bash", str(root / "scripts" / "test.sh"), *args], _env(OMNI_ACCUM_VENV=str(tmp_path / "venv")),
             cwd=root)  # fmt: skip
    runs = [ln.split("-m pytest ", 1)[1] for ln in calls.read_text().splitlines() if "-m pytest" in ln]
    assert runs == [pytest_args], (runs, r.stdout[-2000:], r.stderr[-2000:])


def _lanes_root(tmp_path: Path) -> tuple[Path, Path]:
    root, calls = _fake_root(tmp_path, "test.sh")
    shutil.copy(ROOT / "scripts" / "test_lanes.py", root / "scripts" / "test_lanes.py")
    (root / "tests").mkdir()
    for name, secs in (("a", 50), ("b", 40), ("c", 30), ("d", 5)):
        (root / "tests" / f"test_{name}.py").write_text("")
    (root / "tests" / "durations.txt").write_text("50 tests/test_a.py\n40 tests/test_b.py\n30 tests/test_c.py\n")
    return root, calls


def test_test_sh_runs_the_whole_suite_in_two_lanes_that_share_the_files_out(tmp_path):
    """Two pytest runs side by side, each file in exactly one, balanced by tests/durations.txt; the closing line
    sums both runs."""
    root, calls = _lanes_root(tmp_path)
    env = _env(OMNI_ACCUM_VENV=str(tmp_path / "venv"), OMNI_ACCUM_TEST_028="0", OMNI_ACCUM_TEST_016="0",
               OMNI_ACCUM_TEST_LANES="2")  # fmt: skip
    r = _run(["bash", str(root / "scripts" / "test.sh")], env, cwd=root)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    runs = sorted(ln.split("-m pytest ", 1)[1].split() for ln in calls.read_text().splitlines() if "-m pytest" in ln)
    assert runs == [["tests/test_a.py", "tests/test_d.py"], ["tests/test_b.py", "tests/test_c.py"]], runs
    assert "== lanes: lane 1 runs 2 test files; lane 2 2" in r.stdout, r.stdout
    assert "== all 2 runs together" in r.stdout and "2 passed in" in r.stdout.splitlines()[-1], r.stdout[-500:]


@pytest.mark.parametrize(("lanes", "args"), [("1", []), ("", ["-q"])])
def test_test_sh_runs_one_lane_when_asked_or_given_arguments(tmp_path, lanes, args):
    root, calls = _lanes_root(tmp_path)
    env = _env(OMNI_ACCUM_VENV=str(tmp_path / "venv"), OMNI_ACCUM_TEST_028="0", OMNI_ACCUM_TEST_016="0",
               **({"OMNI_ACCUM_TEST_LANES": lanes} if lanes else {}))  # fmt: skip
    r = _run(["bash", str(root / "scripts" / "test.sh"), *args], env, cwd=root)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    runs = [ln.split("-m pytest ", 1)[1] for ln in calls.read_text().splitlines() if "-m pytest" in ln]
    assert runs == [" ".join(["tests", *args])], runs


def test_test_sh_refuses_a_number_of_lanes_it_cannot_run(tmp_path):
    root, calls = _lanes_root(tmp_path)
    r = _run(["bash", str(root / "scripts" / "test.sh")], _env(OMNI_ACCUM_TEST_LANES="3"), cwd=root)
    assert r.returncode == 2 and "OMNI_ACCUM_TEST_LANES='3' is not a number of lanes (1 or 2)" in r.stderr, r.stderr
    assert not calls.exists()


def test_test_sh_refuses_a_switch_it_cannot_read(tmp_path):
    root, calls = _fake_root(tmp_path, "test.sh")
    r = _run(["bash", str(root / "scripts" / "test.sh")], _env(OMNI_ACCUM_TEST_028="maybe"), cwd=root)
    assert r.returncode == 2 and "OMNI_ACCUM_TEST_028='maybe' is not a switch" in r.stderr, r.stderr
    assert not calls.exists()


def _abort_tree(tmp: Path, model: bool = True, server: str | None = None) -> Path:
    """A stand-in repository for abort_orphans.sh: its configs, a model folder, a venv whose vllm-omni is
    ``server`` (a shell script body)."""
    root = tmp / "repo"
    e2e = root / "benchmarks" / "e2e"
    (e2e / "configs").mkdir(parents=True)
    shutil.copy(E2E / "abort_orphans.sh", e2e / "abort_orphans.sh")
    for name in ("arena_replicas", "arena"):
        shutil.copy(E2E / "configs" / f"qwen3_omni_cpu_{name}.yaml", e2e / "configs")
    if model:
        (e2e / ".work" / "model-lean").mkdir(parents=True)
        (e2e / ".work" / "model-lean" / "config.json").write_text("{}")
    bin_ = e2e / ".work" / "venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").symlink_to(sys.executable)
    _exe(bin_ / "vllm-omni", f"#!/bin/sh\n{server or 'exit 0'}\n")
    return root


def test_abort_orphans_help_and_bad_arguments_start_nothing(tmp_path):
    started = tmp_path / "started"
    root = _abort_tree(tmp_path, server=f"touch {started}; exit 0")
    script = str(root / "benchmarks" / "e2e" / "abort_orphans.sh")
    r = _run(["bash", script, "--help"], _env(), cwd=tmp_path)
    assert r.returncode == 0 and "abort_orphans.sh [DEPLOY]" in r.stdout and "Exit status" in r.stdout, r.stderr
    (tmp_path / "a-folder").mkdir()
    for argv, needle in [
        (["nosuch"], "DEPLOY 'nosuch': no such file (give a deploy YAML, or NAME of"),
        (["a-folder"], "is a folder, not a deploy file"),
        (["-x"], "unknown option '-x'"),
        (["a", "b"], "one DEPLOY at most"),
    ]:
        r = _run(["bash", script, *argv], _env(), cwd=tmp_path)
        assert r.returncode == 2 and needle in r.stderr, (argv, r.returncode, r.stderr)
        assert "arena, arena_replicas" in r.stderr or "DEPLOY '" not in needle, r.stderr
    no_model = _abort_tree(tmp_path / "nomodel", model=False, server=f"touch {started}; exit 0")
    r = _run(["bash", str(no_model / "benchmarks" / "e2e" / "abort_orphans.sh")], _env(), cwd=tmp_path)
    assert r.returncode == 2 and "no model at" in r.stderr and "--variant lean" in r.stderr, r.stderr
    assert not started.exists()


def test_abort_orphans_takes_a_deploy_relative_to_the_caller_or_a_name_and_stops_when_the_server_dies(tmp_path):
    args = tmp_path / "args"
    root = _abort_tree(tmp_path, server=f'echo "$@" > {args}; echo "boom: the server failed"; exit 1')
    script = str(root / "benchmarks" / "e2e" / "abort_orphans.sh")
    mine = tmp_path / "cwd" / "mine.yaml"
    mine.parent.mkdir()
    mine.write_text("stages: []\n")
    for deploy, expect in [("mine.yaml", mine), ("arena", root / "benchmarks/e2e/configs/qwen3_omni_cpu_arena.yaml"),
                           (str(mine), mine)]:  # fmt: skip
        r = _run(["bash", script, deploy], _env(), cwd=mine.parent, timeout=40)
        assert r.returncode == 1, (deploy, r.returncode, r.stdout, r.stderr)
        assert "ended before it was ready" in r.stderr and "boom: the server failed" in r.stderr, r.stderr
        assert "ready after" not in r.stdout
        assert f"--deploy-config {expect} " in args.read_text(), (deploy, args.read_text())


def _setup_env(tmp: Path, **env: str):
    # PYTHON=/bin/false: a script that went on would fail at its first virtualenv, before pip
    full = _env(OMNI_ACCUM_E2E_VENV=str(tmp / "venv"), OMNI_ACCUM_E2E_SEED_VENV="none", PYTHON="/bin/false", **env)
    return _run(["bash", str(E2E / "setup_env.sh")], full, cwd=tmp)


@pytest.mark.parametrize("value", ["abc", "1.5", "-3"])
def test_setup_env_refuses_a_need_gb_that_is_not_a_number(tmp_path, value):
    r = _setup_env(tmp_path, OMNI_ACCUM_E2E_NEED_GB=value)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert f"OMNI_ACCUM_E2E_NEED_GB='{value}' is not a whole number of GB" in r.stderr, r.stderr
    assert not (tmp_path / "venv").exists()


def test_setup_env_names_the_variable_a_bad_release_came_from(tmp_path):
    r = _setup_env(tmp_path, OMNI_ACCUM_E2E_RELEASE="bad")
    assert r.returncode == 2 and "OMNI_ACCUM_E2E_RELEASE='bad': unknown release 'bad'" in r.stderr, r.stderr
    r = _run(["bash", str(E2E / "setup_env.sh"), "--help"], _env())
    assert "before pip installs anything" in " ".join(r.stdout.split()), r.stdout
