"""``tune`` never writes over a file it reads in the same run, whatever the path spelling."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from omni_accum import cli
from omni_accum.tuner import TuneOptions, tune
from omni_accum.tuner.core import TuneError

from tests.test_tune_cli import SMALL  # the one-key workload of tune's own tests

BASE = "# hand-written\ndefault: cat\nrules:\n  - {match: speaker, strategy: send_once}\n"


@pytest.fixture
def no_measuring(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("a bucket was measured")

    monkeypatch.setattr("omni_accum.tuner.run.tune_bucket", refuse)


def _args(wl: str, out: str, *extra: str) -> list[str]:
    return [
        "tune",
        "--quick",
        "--workload",
        wl,
        "--context-lens",
        "64",
        "--concurrency",
        "1",
        "--no-verify",
        "--out",
        out,
        *extra,
    ]


def _spellings(tmp_path: Path, target: Path) -> dict[str, str]:
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    (tmp_path / "sub").mkdir(exist_ok=True)
    return {
        "same": str(target),
        "relative": os.path.relpath(target),
        "dotdot": str(tmp_path / "sub" / ".." / target.name),
        "symlink": str(link),
    }


@pytest.mark.parametrize("spelling", ["same", "relative", "dotdot", "symlink"])
def test_out_naming_the_workload_file_is_refused(tmp_path, capsys, no_measuring, spelling, monkeypatch):
    monkeypatch.chdir(tmp_path)
    wl = tmp_path / "wl.yaml"
    text = yaml.safe_dump(SMALL)
    wl.write_text(text)
    out = _spellings(tmp_path, wl)[spelling]
    assert cli.main(_args(str(wl), out)) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "--workload" in err and "overwrite" in err and "Traceback" not in err
    assert wl.read_text() == text


@pytest.mark.parametrize("spelling", ["same", "relative", "dotdot", "symlink"])
def test_out_naming_the_base_policy_is_refused(tmp_path, capsys, no_measuring, spelling, monkeypatch):
    monkeypatch.chdir(tmp_path)
    wl = tmp_path / "wl.yaml"
    wl.write_text(yaml.safe_dump(SMALL))
    base = tmp_path / "p.yaml"
    base.write_text(BASE)
    out = _spellings(tmp_path, base)[spelling]
    assert cli.main(_args(str(wl), out, "--base", str(base))) == 2
    err = capsys.readouterr().err
    assert "--base" in err and "overwrite" in err and "Traceback" not in err
    assert base.read_text() == BASE


def test_the_python_api_refuses_too(tmp_path, no_measuring):
    base = tmp_path / "p.yaml"
    base.write_text(BASE)
    with pytest.raises(TuneError, match="--base"):
        tune(TuneOptions(workload=SMALL, out=base, base=str(base), context_lens=[64], concurrency=[1], quick=True))
    assert base.read_text() == BASE


def test_resume_of_the_out_file_itself_is_not_an_overwrite(tmp_path, monkeypatch):
    """--resume reads --out and writes it again: that is what it is for, not a clash."""
    from omni_accum.tuner.run import input_overwrite_problem

    opts = TuneOptions(workload=SMALL, out=tmp_path / "t.yaml", resume=True)
    assert input_overwrite_problem(opts) is None
