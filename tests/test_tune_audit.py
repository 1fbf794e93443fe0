"""``omni-accum tune`` as an operator meets it (an audit): the resume message's ``--quick`` read backwards, a tuned
table's header with a placeholder and no date, ``explain`` silent on why the tuner picked a key's strategy, no bound
on ``--concurrency`` (100,000 built streams for minutes without a word), the "same command" a resume needs."""

from __future__ import annotations

import re

import pytest

from omni_accum import cli
from omni_accum.policy.environment import current_fingerprint
from omni_accum.tuner import tune
from tests.test_policy_audit import _cell, _table, _write
from tests.test_tune_cli import _opts, _remeasured_on_resume


def test_the_table_s_header_names_its_file_date_and_device(tmp_path):
    tune(_opts(tmp_path))
    text = (tmp_path / "tuned.yaml").read_text()
    assert f"Inspect with: omni-accum tune --show {tmp_path / 'tuned.yaml'}" in text and "THIS_FILE" not in text
    assert re.search(r"^# \d{4}-\d\d-\d\d \d\d:\d\d \S* ?on cpu", text, re.M), text[:400]


def test_a_resume_across_quick_says_which_way_and_blames_no_candidate_set(tmp_path, monkeypatch):
    """``--quick (params grid): tuned with False, now True`` for a file tuned *with* --quick, resumed without; and
    "its candidate set differs (strategies, plugins or params grid changed)" beside any setting that changed."""
    calls, log = _remeasured_on_resume(tmp_path, monkeypatch, {}, {"quick": False})
    assert "--quick: tuned with it, now without it" in log and "candidate set" not in log, log
    assert "to finish it instead, stop this run and give the options it was tuned with" in log


def test_a_resume_over_another_grid_says_which_buckets_of_the_file_it_leaves_out(tmp_path, monkeypatch):
    """``tune --help``'s resume example named other --context-lens than the run before it: the buckets in common were
    reused, the new ones measured, and the file's others dropped from the table without a word."""
    calls, log = _remeasured_on_resume(tmp_path, monkeypatch, {"context_lens": [64, 128]}, {"context_lens": [64, 256]})
    assert calls == [256] and "reused (--resume)" in log, (calls, log)
    assert "--resume: 1 bucket(s) of the file are not in this run's --context-lens/--concurrency" in log, log
    assert "left out of the new table: 128x1" in log, log
    from omni_accum.cli.tune import EXAMPLES

    lines = [ln.strip() for ln in EXAMPLES.splitlines()]
    (resumed,) = [ln for ln in lines if ln.endswith(" --resume")]
    assert resumed.removesuffix(" --resume") in lines  # the example is a command above it, again with --resume


def test_an_interrupt_in_a_bucket_s_verification_keeps_its_measurement_for_resume(tmp_path, monkeypatch):
    """Ctrl-C while a bucket was verified (two rounds after minutes of measuring) lost that bucket: the partial file
    was written only after the verification. It is written at the interrupt; --resume then reuses the bucket."""
    from omni_accum.policy.loader import load_policy
    from omni_accum.tuner import run as tuner_run

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(tuner_run, "verify_bucket", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tune(_opts(tmp_path, verify=True))
    part = tuner_run.partial_path(tmp_path / "tuned.yaml")
    assert part.is_file() and not (tmp_path / "tuned.yaml").exists()
    t = load_policy(part).tuned
    assert not t.complete and {(c.context_len, c.concurrency) for c in t.cells} == {(64, 1)}
    monkeypatch.undo()
    calls, log = [], __import__("io").StringIO()
    real = tuner_run.tune_bucket
    monkeypatch.setattr(tuner_run, "tune_bucket", lambda *a, **kw: calls.append(kw["context_len"]) or real(*a, **kw))
    assert tune(_opts(tmp_path, verify=True, resume=True), log=log).complete
    assert calls == [] and "reused (--resume)" in log.getvalue()


def test_an_interrupt_before_any_bucket_does_not_claim_an_earlier_run_s_partial_file(tmp_path, monkeypatch, capsys):
    """Ctrl-C before this run finished a bucket said "the buckets finished so far are in tuned.partial.yaml" of a
    partial file an earlier run left there."""
    import os

    from tests.test_tune_cli import _tune_args

    out = tmp_path / "t.yaml"
    part = tmp_path / "t.partial.yaml"
    part.write_text("# an earlier run's\n")
    os.utime(part, (1_000_000_000, 1_000_000_000))

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr("omni_accum.tuner.run.tune_bucket", interrupted)
    assert cli.main(_tune_args(tmp_path, out, "--no-progress")) == 130
    err = capsys.readouterr().err
    assert f"no bucket was finished in this run ({part} is an earlier run's)" in err, err
    part.unlink()
    assert cli.main(_tune_args(tmp_path, out, "--no-progress")) == 130
    assert "no bucket was finished: run the same command again" in capsys.readouterr().err


def test_explain_says_what_the_tuner_decided_a_cell_by(tmp_path, capsys):
    won = dict(_cell("embed.decode", "prealloc"), baseline="cat", margin=0.25, ci=[0.2, 0.3])
    kept = dict(_cell("hidden_states.output", "cat"), baseline="cat", margin=-0.03, ci=[-0.16, 0.08],
                reason="token_list: -3.0% [-16.0%, +8.0%]: the interval crosses 0 (no win beyond the noise)")  # fmt: skip
    path = _write(tmp_path / "t.yaml", {"default": "cat", "tuned": _table(current_fingerprint(), [won, kept])})
    assert cli.main(["explain", path, "--key", "embed.decode", "--context-len", "1000"]) == 0
    out = capsys.readouterr().out
    assert "tuned: 25.0% faster than 'cat' (95 % interval 20.0% to 30.0%)" in out, out
    assert cli.main(["explain", path, "--key", "hidden_states.output", "--context-len", "1000"]) == 0
    out = capsys.readouterr().out
    assert "tuned against 'cat': token_list: -3.0% [-16.0%, +8.0%]: the interval crosses 0" in out, out


@pytest.mark.parametrize("command", ["tune", "bench"])
def test_a_concurrency_beyond_the_bound_is_a_usage_error(tmp_path, capsys, command):
    out = ["--out", str(tmp_path / "t.yaml")] if command == "tune" else []
    rc = cli.main([command, "--concurrency", "100000", "--context-lens", "1000", "--no-progress", *out])
    assert rc == 2 and "--concurrency 100000: from 1 to 1024 requests at once" in capsys.readouterr().err
