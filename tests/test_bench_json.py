"""``bench --json``: one schema for every wire, each arm's status, nulls for what was not measured, atomic writes,
and the buckets a Ctrl-C leaves."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from conftest import require_module, require_vllm_omni
from omni_accum import bench
from omni_accum.bench.replay import ArmResult, KeyStats
from omni_accum.bench.report import BenchRun, p50_interval, ratio_vs
from omni_accum.bench.workloads import load_workload
from omni_accum.cli import main

TINY = ["--context-lens", "16", "--concurrency", "1", "--steps", "2", "--repeats", "1", "--no-progress"]


def _validate(doc):
    jsonschema = require_module("jsonschema", "the test extra validates bench JSON")
    jsonschema.validate(doc, bench.RESULT_SCHEMA)


def _bench_json(tmp_path, wire, *extra):
    out = tmp_path / f"{wire}.json"
    rc = main(["bench", "--wire", wire, "--arms", "upstream", "cat", "wire-floor", "--json", str(out), *TINY, *extra])
    assert rc == 0
    doc = json.loads(out.read_text())
    _validate(doc)
    return doc


@pytest.mark.parametrize("wire", ["inproc", "serializer", "shm"])
def test_every_wire_writes_the_schema_and_an_upstream_that_raised_is_failed_not_zero_bytes(tmp_path, wire):
    """The default workload makes upstream's code raise: it was written as wire_bytes_per_step 0.0, peak_bytes 0."""
    require_vllm_omni()
    doc = _bench_json(tmp_path, wire)
    rows = {r["arm"]: r for r in doc["results"]}
    up = rows["upstream"]
    assert up["status"] == "failed" and "zero-dimensional tensor" in up["error"]
    assert up["step_us_p50"] is None and up["wire_bytes_per_step"] is None and up["peak_bytes"] is None
    assert rows["cat"]["status"] == "ok" and rows["cat"]["error"] is None and rows["cat"]["step_us_p50"] > 0
    assert doc["wire"] == wire and doc["complete"] is True and all(r["store"] is None for r in doc["results"])


@pytest.mark.mooncake
def test_the_mooncake_wire_writes_the_same_schema_and_reports_a_failing_arm_in_the_table(tmp_path, capsys):
    """`--wire mooncake --json` wrote "wire": "mooncake" and fields of its own, against the schema, with plain
    write_text; an arm that raised in the receiver aborted the bench with the child's traceback. The run starts its
    own stage host (the doc examples' runs are handed the test process's) and leaves none running."""
    require_vllm_omni()
    from tests.mooncake_fixtures import require_mooncake

    require_mooncake()
    before = _stage_hosts()
    doc = _bench_json(tmp_path, "mooncake")
    assert _stage_hosts() == before  # the run's own host is gone (another test's may live on)
    out = capsys.readouterr().out
    assert "fails" in out and "stage process failed" not in out
    rows = {r["arm"]: r for r in doc["results"]}
    assert rows["upstream"]["status"] == "failed" and rows["upstream"]["store"] is None
    assert rows["cat"]["status"] == "ok" and rows["cat"]["store"]["puts"] == 3
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def _stage_hosts() -> set[int]:
    """This process's children that run a stage host (``python -m omni_accum.bench.mooncake stage-host``)."""
    found = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == os.getpid() and b"stage-host" in argv:
            found.add(int(d.name))
    return found


def _arm(name, samples, **kw):
    return ArmResult(name, 16, 1, "inproc", requests=1, steps=3, samples_us=samples, **kw)


def test_each_arm_says_whether_it_ran_and_what_was_not_measured_is_null():
    run = BenchRun(load_workload("qwen3-omni-seed"), "inproc", None, 1)
    run.results = [
        _arm("upstream", [], correct=False, error="RuntimeError: no", mismatch="RuntimeError: no"),
        _arm("token_list", [[1.0, 2.0, 3.0]], correct=False, mismatch="request 0: thinker_embeddings differs"),
        _arm("cat", [[1.0, 2.0, 3.0]], wire_bytes_per_step=10.0, peak_bytes=30),
        _arm("odd", [[float("nan")]]),
    ]
    doc = bench.to_json(run)
    _validate(doc)
    rows = {r["arm"]: r for r in doc["results"]}
    assert (rows["upstream"]["status"], rows["upstream"]["error"]) == ("failed", "RuntimeError: no")
    assert rows["upstream"]["peak_bytes"] is None and rows["upstream"]["total_us_per_request"] is None
    assert rows["token_list"]["status"] == "wrong views" and "differs" in rows["token_list"]["error"]
    assert rows["cat"]["status"] == "ok" and rows["cat"]["peak_bytes"] == 30 and rows["cat"]["step_us_p50"] == 2.0
    assert rows["odd"]["step_us_p50"] is None  # NaN is no JSON
    json.dumps(doc, allow_nan=False)


def test_ctrl_c_writes_the_buckets_that_finished_marked_incomplete(tmp_path, monkeypatch, capsys):
    """Ctrl-C on a multi-bucket bench with --json exited 130 and wrote nothing, without a word."""
    real = bench.runner.measure
    calls = []

    def measure(*a, **k):
        calls.append(k["context_len"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(bench.runner, "measure", measure)
    out = tmp_path / "r.json"
    args = ["bench", "--workload", "qwen3-omni-seed", "--arms", "cat", "--json", str(out), "--context-lens", "16,32",
            "--concurrency", "1", "--steps", "2", "--repeats", "1", "--no-progress"]  # fmt: skip
    assert main(args) == 130
    err = capsys.readouterr().err
    assert f"wrote {out} with the 1 bucket(s) finished before the interrupt (complete: false)" in err
    doc = json.loads(out.read_text())
    _validate(doc)
    assert doc["complete"] is False and doc["stopped"] == "interrupted"
    assert {r["context_len"] for r in doc["results"]} == {16}

    calls.clear()
    calls.append(0)  # the first bucket is interrupted
    out.unlink()
    assert main(args) == 130
    assert f"no bucket finished before the interrupt: --json {out} was not written" in capsys.readouterr().err
    assert not out.exists()


def test_the_schema_refuses_a_made_up_wire_and_a_missing_status():
    doc = bench.to_json(BenchRun(load_workload("qwen3-omni-seed"), "inproc", None, 1, [_arm("cat", [[1.0]])]))
    _validate(doc)
    jsonschema = require_module("jsonschema", "the test extra validates bench JSON")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**doc, "wire": "carrier-pigeon"}, bench.RESULT_SCHEMA)
    row = dict(doc["results"][0])
    del row["status"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**doc, "results": [row]}, bench.RESULT_SCHEMA)
    assert not math.isnan(doc["results"][0]["step_us_p50"])


def test_the_arena_wire_replaces_a_link_at_its_json_as_the_other_wires_do(tmp_path, monkeypatch):
    """`--wire arena --json` went through tune's writer, which writes through a link at the output."""
    from types import SimpleNamespace

    from omni_accum.arena import pairbench

    monkeypatch.setattr(pairbench, "run_pair", lambda *a, **k: [])
    victim = tmp_path / "victim.json"
    victim.write_text("mine\n")
    out = tmp_path / "out.json"
    out.symlink_to(victim)
    args = SimpleNamespace(context_lens=[16], concurrency=[1], arena_wait=None, repeats=1, json=str(out))
    assert pairbench.run_cli(args, load_workload("qwen3-omni-0.30")) == 0
    assert victim.read_text() == "mine\n" and not out.is_symlink() and json.loads(out.read_text())["wire"] == "arena"


def test_each_row_holds_the_table_s_interval_and_ratio_column():
    """The rows held the p50 but not its interval, nor the ratio to the baseline and its interval: a saved run could
    not check the table's noise statements. Each timed row holds the table's figures now, computed the same way (the
    baseline upstream, or wire-floor where upstream's code raised), null where the table prints ``-``."""
    base = [[10.0 + i % 3 for i in range(8)], [11.0 + i % 3 for i in range(8)], [10.0 + i % 2 for i in range(8)]]
    half = [[x / 2 for x in rep] for rep in base]
    same = [[x + 0.01 * (j % 2 * 2 - 1) for j, x in enumerate(rep)] for rep in base]
    rs = [_arm("upstream", [], correct=False, error="RuntimeError: no"), _arm("wire-floor", base),
          _arm("cat", half, per_key={}), _arm("token_list", same)]  # fmt: skip
    rs[2].per_key["a"] = KeyStats(wire_bytes_per_step=1.0, peak_bytes=2)
    doc = bench.to_json(BenchRun(load_workload("qwen3-omni-seed"), "inproc", None, 3, rs))
    _validate(doc)
    rows = {(r["arm"], r["key"]): r for r in doc["results"]}
    assert rows[("upstream", "*")]["vs"] is None and rows[("upstream", "*")]["step_us_p50_ci"] is None
    floor = rows[("wire-floor", "*")]
    assert floor["vs"] == {"baseline": "wire-floor", "ratio": 1.0, "low": 1.0, "high": 1.0, "within_noise": True}
    for arm, r in zip(("cat", "token_list"), rs[2:]):
        row = rows[(arm, "*")]
        ratio, low, high, noise = ratio_vs(rs[1], r)
        assert row["vs"]["baseline"] == "wire-floor" and row["vs"]["within_noise"] is noise
        assert [row["vs"][k] for k in ("ratio", "low", "high")] == pytest.approx([ratio, low, high], rel=1e-3)
        assert row["vs"]["low"] <= row["vs"]["ratio"] <= row["vs"]["high"]
        lo, hi = row["step_us_p50_ci"]
        assert lo <= row["step_us_p50"] <= hi and [lo, hi] == pytest.approx(list(p50_interval(r)))
        assert row["repeat_p50_us"] == pytest.approx(r.repeat_medians()) and len(row["repeat_p50_us"]) == 3
    assert rows[("cat", "*")]["vs"]["ratio"] == 0.5 and not rows[("cat", "*")]["vs"]["within_noise"]
    assert rows[("token_list", "*")]["vs"]["within_noise"]
    assert rows[("cat", "a")]["vs"] is None and rows[("cat", "a")]["repeat_p50_us"] is None
