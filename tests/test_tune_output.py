"""What tune prints: a kept baseline's row, the lines of a resumed run, the time of a quick bucket, `--out -`."""

from __future__ import annotations

import io
import re

from omni_accum.cli import main
from omni_accum.policy import TunedCell, TunedTable
from omni_accum.tuner.report import decision_table
from omni_accum.tuner.run import TuneOptions, tune

from tests.test_tune_cli import SMALL, _Clock  # the one-key workload and the clock of tune's own tests


def test_a_kept_baseline_row_shows_no_margin_of_a_challenger():
    """A row whose strategy is `cat` (kept) showed token_list's margin, interval and time as its own."""
    cell = TunedCell(key="embed.decode", context_len=1000, concurrency=1, strategy="cat", baseline="cat",
                     margin=0.026, ci=(-0.042, 0.069), timings_us={"cat": 10.9, "token_list": 10.6},
                     reason="token_list: +2.6% [-4.2%, +6.9%]: the interval crosses 0")  # fmt: skip
    text = decision_table(TunedTable(context_len_edges=[1000], concurrency_edges=[1], cells=[cell]))
    row = next(line for line in text.splitlines() if line.startswith(">="))
    assert "+2.6%" not in row and "-4.2%" not in row and "10.6 us" not in row and "10.9 us" in row, row
    assert "token_list: +2.6% [-4.2%, +6.9%]" in text  # under why


def test_a_resumed_run_says_once_per_bucket_that_it_was_reused_and_names_one_file(tmp_path, monkeypatch):
    """Each reused bucket printed "reused from t2.yaml" (the file read was t2.partial.yaml) and "0 round(s), 0.0 s"."""
    opts = dict(workload=SMALL, out=tmp_path / "t.yaml", context_lens=[64, 256], concurrency=[1], decode_steps=4,
                max_rounds=1, verify=False, quick=True)  # fmt: skip
    monkeypatch.setattr("omni_accum.tuner.run.time", _Clock())
    first = tune(TuneOptions(**opts, budget_s=1))
    assert not first.complete
    monkeypatch.undo()
    log = io.StringIO()
    res = tune(TuneOptions(**opts, resume=True), log=log)
    lines = log.getvalue().splitlines()
    assert res.complete
    assert f"--resume: reusing the buckets of {tmp_path / 't.partial.yaml'}" in lines
    assert [ln for ln in lines if "context_len=64 " in ln] == ["bucket context_len=64 concurrency=1: reused (--resume)"]
    (measured,) = [ln for ln in lines if "context_len=256 " in ln]
    assert re.fullmatch(r"bucket context_len=256 concurrency=1: \d+ round\(s\), \d+\.\d\d s", measured), measured


def test_out_dash_says_stdout_is_not_supported(capsys):
    assert main(["tune", "--out", "-", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "--out -: stdout is not supported" in err and "without an extension" not in err
