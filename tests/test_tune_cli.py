"""``omni-accum tune`` as a user meets it: budget, output formats and files, --resume safety, --help, bad values."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import yaml

import omni_accum
from omni_accum import cli
from omni_accum.tuner import TuneOptions, tune, write_atomic
from omni_accum.tuner.core import TuneError
from omni_accum.tuner.run import output_problem
from omni_accum.bench.workloads import workload_names

SMALL = {
    "name": "small",
    "context_len": 64,
    "decode_steps": 4,
    "concurrency": [1],
    "keys": [{"path": "embed.decode", "kind": "append", "carried": "every", "row_shape": [8], "read": "newest_row"}],
}


def _opts(tmp_path: Path, **kw) -> TuneOptions:
    base = dict(
        workload=SMALL,
        out=tmp_path / "tuned.yaml",
        context_lens=[64],
        concurrency=[1],
        decode_steps=4,
        max_rounds=1,
        verify=False,
        quick=True,
    )
    base.update(kw)
    return TuneOptions(**base)


def _tune_args(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    wl = tmp_path / "small-workload.yaml"
    wl.write_text(yaml.safe_dump(SMALL))
    return [
        "tune",
        "--quick",
        "--workload",
        str(wl),
        "--context-lens",
        "64",
        "--concurrency",
        "1",
        "--decode-steps",
        "4",
        "--no-verify",
        "--out",
        str(out),
        *extra,
    ]


@pytest.fixture
def no_measuring(monkeypatch):
    """Fail the test if a bucket is measured (for checks that must come before any measurement)."""

    def refuse(*a, **kw):
        raise AssertionError("a bucket was measured")

    monkeypatch.setattr("omni_accum.tuner.run.tune_bucket", refuse)


class _Clock:
    """A stand-in for ``time`` in the tuner: every reading is 100 s after the previous one."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 100.0
        return self.now


# -- 1. --budget-s -------------------------------------------------------------------------------- #


def test_a_spent_budget_still_measures_one_bucket_and_leaves_a_partial_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("omni_accum.tuner.run.time", _Clock())  # the budget is spent before the first bucket
    res = tune(_opts(tmp_path, context_lens=[64, 256], budget_s=1))
    assert not res.complete and "budget" in res.stopped
    assert res.policy.tuned is not None and res.policy.tuned.complete is False
    assert {c.context_len for c in res.policy.tuned.cells} == {64}
    assert res.out == tmp_path / "tuned.partial.yaml" and not (tmp_path / "tuned.yaml").exists()
    assert omni_accum.load_policy(tmp_path / "tuned.partial.yaml").tuned.complete is False

    out = tmp_path / "cli.yaml"
    rc = cli.main(_tune_args(tmp_path, out, "--context-lens", "256", "--budget-s", "0.001"))
    captured = capsys.readouterr()
    assert rc == 3 and "Traceback" not in captured.err and "PARTIAL" in captured.out
    assert f"{out} was not written" in captured.out and "--resume" in captured.out
    part = tmp_path / "cli.partial.yaml"
    assert {c.context_len for c in omni_accum.load_policy(part).tuned.cells} == {64} and not out.exists()
    assert cli.main(["validate", str(part)]) == 0
    assert "partial" in capsys.readouterr().out  # validate says so


def test_budget_zero_means_no_budget(tmp_path, monkeypatch):
    monkeypatch.setattr("omni_accum.tuner.run.time", _Clock())
    res = tune(_opts(tmp_path, context_lens=[64, 256], budget_s=0))
    assert res.complete and {c.context_len for c in res.policy.tuned.cells} == {64, 256}


def test_negative_budget_is_refused(tmp_path, capsys, no_measuring):
    with pytest.raises(SystemExit) as e:
        cli.main(_tune_args(tmp_path, tmp_path / "x.yaml", "--budget-s", "-1"))
    assert e.value.code == 2 and "--budget-s" in (err := capsys.readouterr().err) and "-1" in err
    with pytest.raises(TuneError, match="budget"):
        tune(_opts(tmp_path, budget_s=-1))
    assert not (tmp_path / "x.yaml").exists()


# -- 2. output formats ---------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", ["tuned.json", "tuned.yml", "TUNED.YAML"])
def test_output_format_follows_the_extension_and_reads_back(tmp_path, monkeypatch, capsys, name):
    out = tmp_path / name
    assert cli.main(_tune_args(tmp_path, out)) == 0
    if name.endswith(".json"):
        assert json.loads(out.read_text())["tuned"]["complete"] is True
    else:
        assert yaml.safe_load(out.read_text())["tuned"]["complete"] is True
    assert cli.main(["validate", str(out)]) == 0
    assert cli.main(["tune", "--show", str(out)]) == 0
    assert "embed.decode" in capsys.readouterr().out
    assert cli.main(["tune", "--show", str(tmp_path / "nope.yaml")]) == 2  # a usage error, as `omni-accum show`'s
    assert "no such policy file" in capsys.readouterr().err
    # options of a run beside --show were ignored without a word; --no-progress and --threads mean nothing either way
    assert cli.main(["tune", "--show", str(out), "--workload", "nosuch", "--budget-s", "5", "--no-verify"]) == 2
    err = capsys.readouterr().err
    assert "--show prints a tuned policy's table and measures nothing: it takes none of --workload, --budget-s, " \
        "--no-verify" in err
    assert cli.main(["tune", "--show", str(out), "--no-progress", "--threads", "2"]) == 0
    capsys.readouterr()

    def refuse(*a, **kw):
        raise AssertionError("--resume should have reused the bucket")

    monkeypatch.setattr("omni_accum.tuner.run.tune_bucket", refuse)
    assert cli.main(_tune_args(tmp_path, out, "--resume")) == 0
    assert "reused (--resume)" in capsys.readouterr().err
    assert cli.main(["validate", str(out)]) == 0


@pytest.mark.parametrize("name", ["tuned.toml", "tuned.txt", "tuned"])
def test_other_extensions_are_refused_before_measuring(tmp_path, capsys, no_measuring, name):
    out = tmp_path / name
    assert cli.main(_tune_args(tmp_path, out)) == 2
    err = capsys.readouterr().err
    assert str(out) in err and ".yaml" in err and ".json" in err and "Traceback" not in err
    assert not out.exists()
    with pytest.raises(TuneError, match=".json"):
        tune(_opts(tmp_path, out=out))


# -- 3. writing the file -------------------------------------------------------------------------- #


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_write_atomic_keeps_modes_and_writes_through_symlinks(tmp_path, umask_022):
    new = tmp_path / "new.yaml"
    write_atomic(new, "a: 1\n")
    assert stat.S_IMODE(new.stat().st_mode) == 0o644  # 0666 & ~umask, not mkstemp's 0600

    existing = tmp_path / "existing.yaml"
    existing.write_text("old\n")
    existing.chmod(0o640)
    write_atomic(existing, "a: 2\n")
    assert existing.read_text() == "a: 2\n" and stat.S_IMODE(existing.stat().st_mode) == 0o640

    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "policy.yaml"
    target.write_text("old\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    write_atomic(link, "a: 3\n")
    assert link.is_symlink() and target.read_text() == "a: 3\n"
    assert not [p for p in tmp_path.rglob(".*") if p.name.endswith(".tmp")]  # no temporary file left


def test_tune_writes_through_a_symlinked_out(tmp_path, umask_022):
    target = tmp_path / "deployed.yaml"
    tune(_opts(tmp_path, out=target))  # the table deployed
    target.chmod(0o664)
    before = target.read_text()
    link = tmp_path / "tuned.yaml"
    link.symlink_to(target)
    tune(_opts(tmp_path, out=link, min_gain_us=2.0))
    assert link.is_symlink() and omni_accum.load_policy(target).tuned is not None and target.read_text() != before
    assert stat.S_IMODE(target.stat().st_mode) == 0o664


@pytest.mark.parametrize("text", ["default: cat\n", "rules: [\n", "notes from yesterday\n"])
def test_tune_refuses_to_overwrite_a_file_that_is_not_a_tuned_policy(tmp_path, capsys, no_measuring, text):
    """A hand-written policy (or any other file) given as --out was replaced without a word."""
    out = tmp_path / "my-policy.yaml"
    out.write_text(text)
    assert cli.main(_tune_args(tmp_path, out)) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: holds a policy that is not a tuned one" in err and "left it untouched" in err
    assert out.read_text() == text and "Traceback" not in err
    out.write_text("")  # an empty file is taken (touch-ed beforehand)
    assert omni_accum.tuner.run.hand_written_problem(out) is None


def test_write_errors_name_the_users_path(tmp_path):
    (tmp_path / "file").write_text("x")
    path = tmp_path / "file" / "x.yaml"
    with pytest.raises(OSError) as e:
        write_atomic(path, "a: 1\n")
    assert e.value.filename == str(path) and ".tmp" not in str(e.value)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not Path("/proc/self").is_dir(), reason="needs /proc")
def test_unwritable_folder_is_caught_before_measuring(tmp_path, capsys, no_measuring):
    assert "/proc" in (output_problem("/proc/t.yaml") or "")
    assert cli.main(_tune_args(tmp_path, Path("/proc/t.yaml"))) == 2
    err = capsys.readouterr().err
    assert "--out /proc/t.yaml" in err and ".tmp" not in err and "Traceback" not in err


def test_a_device_or_fifo_as_out_is_refused_before_measuring_and_left_as_it_is(tmp_path, capsys, no_measuring):
    """The rename behind every output used to put a regular file in place of a FIFO or a device (``--out
    /dev/null`` run as root replaced /dev/null), and said it wrote the policy."""
    assert "is a character device, not a regular file" in (output_problem("/dev/null") or "")  # a stat, no write
    fifo = tmp_path / "tuned.yaml"
    os.mkfifo(fifo)
    assert cli.main(_tune_args(tmp_path, fifo)) == 2
    err = capsys.readouterr().err
    assert f"--out {fifo}: is a FIFO, not a regular file" in err and "Traceback" not in err
    with pytest.raises(OSError, match="is a FIFO, not a regular file") as e:
        write_atomic(fifo, "a: 1\n")
    assert e.value.filename == str(fifo)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_directory_or_fifo_where_the_partial_file_goes_is_refused_before_measuring(tmp_path, capsys, no_measuring):
    """It was found only when the first bucket was written: "error: Is a directory: x8.partial.yaml", exit 1."""
    out = tmp_path / "x8.yaml"
    (tmp_path / "x8.partial.yaml").mkdir()
    assert cli.main(_tune_args(tmp_path, out)) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: {tmp_path / 'x8.partial.yaml'} is a directory; tune keeps a stopped run's buckets" in err
    os.mkfifo(tmp_path / "x9.partial.yaml")
    assert cli.main(_tune_args(tmp_path, tmp_path / "x9.yaml")) == 2
    assert "x9.partial.yaml is not a regular file" in capsys.readouterr().err
    assert not out.exists() and (tmp_path / "x8.partial.yaml").is_dir()


def test_a_bucket_larger_than_the_memory_available_is_refused_before_measuring(tmp_path, capsys, no_measuring,
                                                                               monkeypatch):
    monkeypatch.setattr("omni_accum.bench.runner.available_memory", lambda: 1)
    out = tmp_path / "t.yaml"
    assert cli.main(_tune_args(tmp_path, out)) == 1  # as bench: the same command fits a larger machine
    err = capsys.readouterr().err
    assert "concurrency=" in err and "needs at least" in err and "and 1 B is available" in err
    assert "Traceback" not in err and not out.exists()


def test_decode_steps_beyond_the_workload_or_too_few_to_tune_are_named(tmp_path, capsys, no_measuring):
    """--decode-steps 100000 was capped to the workload's 4 without a word (and recorded as 100000); --decode-steps 1
    failed with "nothing to tune" without pointing at it."""
    assert cli.main(_tune_args(tmp_path, tmp_path / "t.yaml", "--decode-steps", "5")) == 2
    err = capsys.readouterr().err
    assert "--decode-steps 5: workload 'small' has 4 decode steps per request; give at most 4" in err
    decode_only = dict(SMALL, keys=[dict(SMALL["keys"][0], carried="decode")])
    with pytest.raises(TuneError, match=r"--decode-steps 1 leaves too few decode chunks"):
        tune(_opts(tmp_path, workload=decode_only, decode_steps=1))
    assert not (tmp_path / "t.yaml").exists() and not (tmp_path / "tuned.yaml").exists()


# -- 4. --resume never replaces a policy that is not a tuned one ---------------------------------- #


@pytest.mark.parametrize("text", ["default: cat\n", "default: [not, a, strategy\n"])
def test_resume_refuses_to_overwrite_a_policy_that_is_not_tuned(tmp_path, capsys, no_measuring, text):
    out = tmp_path / "hand-written.yaml"
    out.write_text(text)
    assert cli.main(_tune_args(tmp_path, out, "--resume")) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "--out" in err and "remove it first" in err and "Traceback" not in err
    assert out.read_text() == text


def _partial(out: Path) -> None:
    """Mark a tuned file partial, as a stopped run leaves it (``--resume`` measures such a file again when a
    setting differs; a complete one it refuses to replace)."""
    data = yaml.safe_load(out.read_text())
    data["tuned"]["complete"] = False
    out.write_text(yaml.safe_dump(data))


def _remeasured_on_resume(tmp_path: Path, monkeypatch, first: dict, second: dict) -> tuple[list[int], str]:
    """Tune with ``first`` (left partial), then ``--resume`` with ``second``: the buckets measured again, and the log."""
    import io

    from omni_accum.tuner import run as tuner_run

    tune(_opts(tmp_path, **first))
    if first or second:
        _partial(tmp_path / "tuned.yaml")
    real = tuner_run.tune_bucket
    calls: list[int] = []
    monkeypatch.setattr(tuner_run, "tune_bucket", lambda *a, **kw: calls.append(kw["context_len"]) or real(*a, **kw))
    log = io.StringIO()
    res = tune(_opts(tmp_path, resume=True, **second), log=log)
    assert res.complete
    return calls, log.getvalue()


def test_resume_reuses_buckets_when_every_setting_matches(tmp_path, monkeypatch):
    calls, log = _remeasured_on_resume(tmp_path, monkeypatch, {}, {})
    assert calls == [] and "reused (--resume)" in log and "not reusing" not in log
    settings = omni_accum.load_policy(tmp_path / "tuned.yaml").tuned.fingerprint["settings"]
    from omni_accum.tuner.files import SETTING_OPTIONS

    assert set(SETTING_OPTIONS) | {"workload", "base"} <= set(settings)
    assert settings["min_gain_us"] == 1.0 and settings["decode_steps"] == 4 and settings["params_grid"] is False


def test_resume_keeps_the_reason_of_every_kept_baseline(tmp_path, monkeypatch):
    """A reused bucket was written back without its reasons ("no reason recorded (a table from an older
    omni-accum)" in place of "the interval crosses 0")."""
    tune(_opts(tmp_path, min_gain_us=100000.0))  # no gain that large: every baseline is kept, with its reason
    out = tmp_path / "tuned.yaml"
    before = {(c.key, c.context_len, c.concurrency): c.reason for c in omni_accum.load_policy(out).tuned.cells}
    assert before and all(before.values()), before
    monkeypatch.setattr("omni_accum.tuner.run.tune_bucket", lambda *a, **k: pytest.fail("a bucket was measured"))
    tune(_opts(tmp_path, min_gain_us=100000.0, resume=True))
    after = {(c.key, c.context_len, c.concurrency): c.reason for c in omni_accum.load_policy(out).tuned.cells}
    assert after == before and "no reason recorded" not in out.read_text()


@pytest.mark.parametrize(
    ("first", "second", "said"),
    [
        ({}, {"min_gain_us": 100000.0}, "--min-gain-us: tuned with 1.0, now 100000.0"),
        ({}, {"memory_factor": 3.0}, "--memory-budget: tuned with 2.0, now 3.0"),
        ({}, {"decode_steps": 3}, "--decode-steps: tuned with 4, now 3"),
        ({"decode_steps": None}, {"decode_steps": 3}, "--decode-steps: tuned with 'auto (at least 3"),
        ({}, {"max_rounds": 2}, "--max-rounds: tuned with 1, now 2"),
        ({}, {"quick": False}, "--quick: tuned with it, now without it"),
        ({}, {"workload": dict(SMALL, decode_steps=5)}, "--workload: the content of 'small' changed"),
        ({}, {"workload": dict(SMALL, name="other")}, "--workload: tuned on 'small', now 'other'"),
        ({}, {"base": "BASE_FILE"}, "--base: tuned against 'default' (content hash"),
    ],
)
def test_resume_starts_over_when_a_setting_differs_and_says_which(tmp_path, monkeypatch, first, second, said):
    if second.get("base") == "BASE_FILE":
        (tmp_path / "base.yaml").write_text("version: 1\ndefault: token_list\n")
        second = dict(second, base=str(tmp_path / "base.yaml"))
    calls, log = _remeasured_on_resume(tmp_path, monkeypatch, first, second)
    assert calls == [64], log  # measured again under the new settings, not reused
    assert f"--resume: not reusing {tmp_path / 'tuned.yaml'}" in log and said in log
    if "base" in second:
        assert f"now {second['base']!r}" in log
        cell = omni_accum.load_policy(tmp_path / "tuned.yaml").tuned.cells[0]
        assert cell.baseline == "token_list"  # measured against the new baseline


def test_resume_starts_over_with_other_threads_or_an_edited_base_file(tmp_path, monkeypatch):
    import io

    import torch

    from omni_accum.tuner import run as tuner_run

    n = torch.get_num_threads()
    with monkeypatch.context() as m:
        m.setattr(torch, "get_num_threads", lambda: n + 1)  # as if tuned with --threads n+1
        tune(_opts(tmp_path))
    _partial(tmp_path / "tuned.yaml")
    real = tuner_run.tune_bucket
    calls: list[int] = []
    monkeypatch.setattr(tuner_run, "tune_bucket", lambda *a, **kw: calls.append(kw["context_len"]) or real(*a, **kw))
    log = io.StringIO()
    tune(_opts(tmp_path, resume=True), log=log)
    assert calls == [64] and f"--threads: tuned with {n + 1}, now {n}" in log.getvalue()

    base = tmp_path / "base.yaml"
    base.write_text("version: 1\ndefault: cat\n")
    tune(_opts(tmp_path, base=str(base)))
    _partial(tmp_path / "tuned.yaml")
    base.write_text("version: 1\ndefault: token_list\n")  # same name, other content
    calls.clear()
    log = io.StringIO()
    tune(_opts(tmp_path, base=str(base), resume=True), log=log)
    assert calls == [64] and f"--base: tuned against {str(base)!r} (content hash" in log.getvalue()


def test_resume_starts_over_on_a_file_that_records_no_settings(tmp_path, monkeypatch):
    out = tmp_path / "tuned.yaml"
    tune(_opts(tmp_path))
    data = yaml.safe_load(out.read_text())
    del data["tuned"]["fingerprint"]["settings"]  # as an older omni-accum wrote it
    data["tuned"]["complete"] = False  # (a complete one is left alone: see the test below)
    out.write_text(yaml.safe_dump(data))
    from omni_accum.tuner import run as tuner_run

    real = tuner_run.tune_bucket
    calls: list[int] = []
    monkeypatch.setattr(tuner_run, "tune_bucket", lambda *a, **kw: calls.append(kw["context_len"]) or real(*a, **kw))
    import io

    log = io.StringIO()
    tune(_opts(tmp_path, resume=True), log=log)
    assert calls == [64] and "records no tuning settings" in log.getvalue()


def test_a_stopped_run_never_replaces_a_finished_file(tmp_path, monkeypatch, capsys):
    """cp tuned.yaml good.yaml; tune --out good.yaml; Ctrl-C: good.yaml keeps the finished table, the buckets
    measured so far go beside it, validate and doctor say the partial file is partial, --resume finishes."""
    from omni_accum.tuner import run as tuner_run

    good = tmp_path / "good.yaml"
    tune(_opts(tmp_path, context_lens=[64, 256]))
    (tmp_path / "tuned.yaml").rename(good)
    before = good.read_bytes()
    real, calls = tuner_run.tune_bucket, []

    def stop_at_second(*a, **kw):
        calls.append(kw["context_len"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(tuner_run, "tune_bucket", stop_at_second)
    rc = cli.main(_tune_args(tmp_path, good, "--context-lens", "64", "256"))
    err = capsys.readouterr().err
    part = tmp_path / "good.partial.yaml"
    assert rc == 130 and good.read_bytes() == before
    assert f"{good} is as it was" in err and str(part) in err and "--resume" in err
    assert omni_accum.load_policy(part).tuned.complete is False
    assert cli.main(["validate", str(good)]) == 0 and "partial" not in capsys.readouterr().out
    assert cli.main(["validate", str(part)]) == 0
    out = capsys.readouterr().out
    assert "partial" in out and "--resume" in out
    monkeypatch.setattr(tuner_run, "tune_bucket", real)
    assert cli.main(_tune_args(tmp_path, good, "--context-lens", "64", "256", "--resume")) == 0
    assert omni_accum.load_policy(good).tuned.complete is True and not part.exists()


def test_two_runs_on_one_out_the_second_is_refused(tmp_path, capsys):
    from omni_accum.tuner.files import OutputLock

    out = tmp_path / "same.yaml"
    with OutputLock(out):  # as a first run holds it
        assert cli.main(_tune_args(tmp_path, out)) == 2
        err = capsys.readouterr().err
        assert f"{out} is being written by another omni-accum tune run (pid {os.getpid()}" in err
        assert "give another --out" in err and not out.exists()
    assert cli.main(_tune_args(tmp_path, out)) == 0  # the lock went with the first run
    assert not (tmp_path / ".same.yaml.lock").exists()


def test_resume_leaves_a_complete_table_alone_when_a_setting_differs(tmp_path, capsys):
    """A stop or a --budget-s would leave a partial table where the good one was: refused, file untouched."""
    out = tmp_path / "tuned.yaml"
    tune(_opts(tmp_path))
    before = out.read_bytes()
    with pytest.raises(TuneError) as e:
        tune(_opts(tmp_path, resume=True, min_gain_us=5.0))
    msg = str(e.value)
    assert "is a complete tuned policy that this run would not reuse" in msg
    assert "--min-gain-us: tuned with 1.0, now 5.0" in msg and "drop --resume" in msg
    assert out.read_bytes() == before


# -- 5. and 6. help and bad values ---------------------------------------------------------------- #


def test_help_says_what_the_options_do(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # no wrapping inside names
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "%%" not in text and "its whole 95 % interval above 5 %: Student's t over the rounds' ratios" in text
    assert "(--out FILE | --show POLICY)" in text and "required unless --show" in text
    assert all(name in text for name in workload_names())
    assert "default: inproc" in text and "default: cpu" in text
    assert "(and 0): no budget" in text and "exit status 3" in text


@pytest.mark.parametrize(
    ("option", "value"),
    [("--min-gain-us", "-5"), ("--memory-budget", "-1"), ("--memory-budget", "0"), ("--budget-s", "nan")],
)
def test_bad_numbers_are_usage_errors_naming_the_value(tmp_path, capsys, no_measuring, option, value):
    with pytest.raises(SystemExit) as e:
        cli.main(_tune_args(tmp_path, tmp_path / "x.yaml", option, value))
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {option}" in err and repr(value) in err and "usage:" in err


def test_the_python_api_checks_the_same_values(tmp_path):
    with pytest.raises(TuneError, match="min-gain-us"):
        tune(_opts(tmp_path, min_gain_us=-5))
    with pytest.raises(TuneError, match="memory-budget"):
        tune(_opts(tmp_path, memory_factor=-1))


def test_context_lens_over_benchs_bound_are_refused_before_tuning(tmp_path, capsys):
    out = tmp_path / "t.yaml"
    assert cli.main(["tune", "--out", str(out), "--quick", "--context-lens", "2000k"]) == 2
    assert "--context-lens 2000000: context lengths go from 1 to 1000000" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("command", [["tune", "--out", "t.yaml"], ["bench"]])
def test_an_unknown_workload_is_a_usage_error(tmp_path, capsys, monkeypatch, command):
    """A bad --workload exited 1 (a bad --base 2): every usage error exits 2, with the command's own prefix."""
    monkeypatch.chdir(tmp_path)
    os.mkfifo(tmp_path / "w.yaml")
    for name, says in (("nope", "'nope' is neither a workload file nor a preset"), ("w.yaml", "not a regular file")):
        assert cli.main([*command, "--workload", name]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"omni-accum {command[0]}: error: --workload {name}: ") and says in err, err
    assert not (tmp_path / "t.yaml").exists()


def test_tune_help_has_examples_and_no_progress(capsys):
    with pytest.raises(SystemExit):
        cli.main(["tune", "--help"])
    out = capsys.readouterr().out
    assert "examples:\n  omni-accum tune --quick --out tuned.yaml" in out and "--no-progress" in out
    assert cli.build_parser().parse_args(["tune", "--out", "t.yaml", "--no-progress"]).no_progress is True


def test_a_base_with_an_ab_section_is_tuned_from_its_first_arm(tmp_path, capsys):
    """`tune --base ab.yaml` refused a policy `validate` accepts ("a policy with an ab section also sets rules"):
    as in bench and explain, the split runs as its first arm."""
    ab = tmp_path / "ab.yaml"
    ab.write_text("ab:\n  arms:\n    control: {policy: default}\n    treatment: {policy: qwen3-omni}\n")
    out = tmp_path / "t.yaml"
    assert cli.main(_tune_args(tmp_path, out, "--base", str(ab), "--no-progress")) == 0
    err = capsys.readouterr().err
    assert f"--base {ab}: an A/B split; tuning from its first arm, 'control'" in err and "Traceback" not in err
    tuned = omni_accum.load_policy(out)
    assert tuned.ab is None and tuned.tuned is not None


def test_the_gain_table_keeps_the_step_gain_and_the_request_totals_apart_and_says_when_to_deploy_nothing():
    """A row read "4.1x (-237.9% p50, CI [...])": a per-request speed-up beside a per-step loss, and a run slower in
    every bucket ended with "wrote ... (complete)" and nothing else."""
    from omni_accum.tuner.candidates import Candidate
    from omni_accum.tuner.core import BucketOutcome, KeyDecision
    from omni_accum.tuner.report import gain_table

    def outcome(gain, low, high, ref_total, tuned_total, strategy="token_list", reference="upstream"):
        d = KeyDecision("embed.decode", Candidate(strategy, {}), "cat", gain, (low, high), {}, {}, {})
        return BucketOutcome(1000, 1, decisions={d.key: d},
                             verify={"reference_p50_us": 10.0, "tuned_p50_us": 10.0 * (1 - gain), "gain": gain,
                                     "gain_low": low, "gain_high": high, "reference_total_us": ref_total,
                                     "tuned_total_us": tuned_total, "reference": reference})

    slower = gain_table([outcome(-2.379, -2.572, -2.284, 4100.0, 1000.0)], "default")
    assert "-237.9% [-257.2%, -228.4%]" in slower and "1.0 ms (0.24x)" in slower
    assert "slower per step than default in every bucket" in slower and "not this file" in slower
    noise = gain_table([outcome(0.01, -0.05, 0.06, 1000.0, 990.0)], "upstream")
    assert "no bucket differs from upstream beyond the noise" in noise and "slower per step" not in noise
    better = gain_table([outcome(0.5, 0.4, 0.6, 1000.0, 500.0)], "upstream")
    assert "beyond the noise" not in better and "slower per step" not in better


def test_a_table_that_keeps_the_baseline_everywhere_is_said_to_run_as_the_baseline_not_to_be_slower():
    """`tune --out tuned.yaml` kept `cat` in every cell (the file runs as `default`) and said "slower per step than
    upstream in every bucket ... not this file"; its "upstream step p50" column was wire-floor's."""
    from omni_accum.tuner.candidates import Candidate
    from omni_accum.tuner.core import BucketOutcome, KeyDecision
    from omni_accum.tuner.report import gain_table

    def outcome(strategy):
        d = KeyDecision("embed.decode", Candidate(strategy, {}), "cat", 0.0, (-0.1, 0.1), {}, {}, {})
        return BucketOutcome(1000, 1, decisions={d.key: d},
                             verify={"reference_p50_us": 4.1, "tuned_p50_us": 17.5, "gain": -3.27, "gain_low": -3.55,
                                     "gain_high": -3.17, "reference_total_us": 700.0, "tuned_total_us": 1400.0,
                                     "reference": "wire-floor"})  # fmt: skip

    kept = gain_table([outcome("cat"), outcome("cat")], "upstream", "default")
    assert "slower per step" not in kept and "not this file" not in kept
    assert "every cell keeps the baseline (default): this file runs as default does" in kept
    head = kept.splitlines()[0]
    assert "wire-floor step p50" in head and "upstream step p50" not in head and "wire-floor /req" in head
    changed = gain_table([outcome("token_list"), outcome("cat")], "upstream", "default")
    assert "slower per step than wire-floor in every bucket where it leaves the baseline" in changed


def test_a_table_too_large_for_a_policy_file_is_refused_before_measuring(tmp_path, capsys, no_measuring):
    """Bucket edges were unbounded: a table of thousands of cells took minutes and gigabytes to read back (a 15 MiB
    policy took 83 s and 1.9 GB to validate), in every process that serves it."""
    from omni_accum.tuner.buckets import MAX_TUNED_CELLS

    edges = ",".join(str(1000 + i) for i in range(MAX_TUNED_CELLS))  # and _tune_args' 64: one too many
    rc = cli.main(_tune_args(tmp_path, tmp_path / "t.yaml", "--context-lens", edges))
    err = capsys.readouterr().err
    assert rc == 2 and f"= {MAX_TUNED_CELLS + 1} cells; a tuned table holds at most {MAX_TUNED_CELLS}" in err, err
    assert not (tmp_path / "t.yaml").exists()


def test_a_link_planted_at_the_partial_file_is_replaced_not_written_through(tmp_path, monkeypatch):
    """--out is written through a link (a deployed table); the partial file beside it is tune's own, and followed a
    link planted at its name as well."""
    victim = tmp_path / "victim.yaml"
    victim.write_text("mine\n")
    (tmp_path / "tuned.partial.yaml").symlink_to(victim)
    monkeypatch.setattr("omni_accum.tuner.run.time", _Clock())
    res = tune(_opts(tmp_path, context_lens=[64, 256], budget_s=1))
    assert not res.complete and victim.read_text() == "mine\n"
    part = tmp_path / "tuned.partial.yaml"
    assert not part.is_symlink() and omni_accum.load_policy(part).tuned is not None


def test_a_candidate_slower_beyond_the_noise_is_not_said_to_cross_0():
    """'-7.6% [-10.9%, -4.0%]: the interval crosses 0' was printed for a candidate slower than the baseline."""
    from omni_accum.tuner.core import keep_reason
    from omni_accum.tuner.stats import Gain

    assert keep_reason(Gain(-0.076, -0.109, -0.040), 100.0, 1.0) == (
        "-7.6% [-10.9%, -4.0%]: slower than the baseline beyond the noise"
    )
    assert keep_reason(Gain(0.008, -0.047, 0.079), 100.0, 1.0).endswith("the interval crosses 0 (no win beyond the noise)")
    assert keep_reason(Gain(-0.02, -0.05, 0.0), 100.0, 1.0).endswith("the interval crosses 0 (no win beyond the noise)")
    assert keep_reason(Gain(0.30, 0.20, 0.40), 100.0, 1.0) is None
