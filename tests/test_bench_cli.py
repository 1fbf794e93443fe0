"""``omni-accum bench``: tables, JSON against its schema, plot, errors as one-line messages."""

from __future__ import annotations

import json

import pytest

from conftest import require_vllm_omni
from omni_accum import bench
from omni_accum.cli import main
from omni_accum.replay import ArmResult
from omni_accum.workloads import load_workload
from conftest import require_module

SMALL = ["--context-lens", "16,32", "--concurrency", "2", "--steps", "3", "--repeats", "1", "--no-progress"]


def test_bench_inproc_prints_tables_and_writes_valid_json(tmp_path, capsys):
    jsonschema = require_module("jsonschema", "the test extra validates bench JSON")
    out = tmp_path / "r.json"
    rc = main(
        [
            "bench",
            "--workload",
            "qwen3-omni-seed",
            "--arms",
            "cat",
            "prealloc",
            "qwen3-omni-flat",
            "--per-key",
            "--json",
            str(out),
            *SMALL,
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "context_len=16  concurrency=2" in text and "context_len=32  concurrency=2" in text
    assert "prealloc" in text and "p50 step" in text
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, bench.RESULT_SCHEMA)
    assert doc["workload"] == "qwen3-omni-seed" and doc["wire"] == "inproc"
    star = [r for r in doc["results"] if r["key"] == "*"]
    assert {(r["arm"], r["context_len"]) for r in star} == {
        (a, c) for a in ("cat", "prealloc", "qwen3-omni-flat") for c in (16, 32)
    }
    assert all(r["steps"] == 4 and r["requests"] == 2 for r in star)
    assert any(r["key"] == "thinker_embeddings" and r["step_us_p50"] is None for r in doc["results"])
    assert doc["machine"]["torch"] and doc["machine"]["run"]["repeats"] == 1


def test_schema_rejects_a_malformed_document():
    jsonschema = require_module("jsonschema", "the test extra validates bench JSON")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            {"workload": "w", "wire": "inproc", "machine": {}, "results": [{"arm": "x"}]}, bench.RESULT_SCHEMA
        )


def test_bad_workload_file_is_one_line_naming_the_field(tmp_path, capsys):
    bad = tmp_path / "w.yaml"
    bad.write_text("name: w\nkeys:\n  - {path: x, kind: sideways}\n")
    rc = main(["bench", "--workload", str(bad), *SMALL])
    err = capsys.readouterr().err
    assert rc == 1 and "keys[0].kind" in err and "Traceback" not in err


def test_unknown_arm_lists_the_choices(capsys):
    rc = main(["bench", "--arms", "fastest", *SMALL])
    err = capsys.readouterr().err
    assert rc == 1 and "unknown arm 'fastest'" in err and "prealloc" in err and "qwen3-omni" in err


def test_strategy_arm_that_fits_no_key_is_skipped(capsys):
    rc = main(["bench", "--workload", "talker-code2wav", "--arms", "prealloc", "send_once", *SMALL])
    captured = capsys.readouterr()
    assert rc == 0 and "arm 'prealloc' skipped" in captured.err and "send_once" in captured.out


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, capsys):
    import builtins

    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    rc = main(["bench", "--arms", "cat", "--plot", "x.png", *SMALL])
    err = capsys.readouterr().err
    assert rc == 1 and "pip install 'omni-accum[plot]'" in err


def test_plot_is_written(tmp_path, capsys):
    require_module("matplotlib", "the plot extra, installed by scripts/env.sh")
    png = tmp_path / "p.png"
    assert main(["bench", "--arms", "cat", "prealloc", "--plot", str(png), *SMALL]) == 0
    assert png.stat().st_size > 1000


def test_default_arms_leave_upstream_out_without_vllm_omni(monkeypatch, capsys):
    monkeypatch.setattr(bench, "upstream_available", lambda: False)
    rc = main(["bench", *SMALL])
    captured = capsys.readouterr()
    assert rc == 0 and "upstream arm is left out" in captured.err
    assert "arms cat, token_list, prealloc, send_once, qwen3-omni-flat" in captured.out


def test_progress_bar_draws_with_eta():
    import io

    buf = io.StringIO()
    bar = bench.Progress(100, buf)
    bar.t0 -= 10  # pretend the run has taken 10 s
    bar._min = 0
    bar.advance(50)
    assert "50.0%" in buf.getvalue() and "ETA" in buf.getvalue()


@pytest.mark.vllm
def test_bench_serializer_with_view_hop_against_upstream(tmp_path, capsys):
    require_vllm_omni()
    jsonschema = require_module("jsonschema", "the test extra validates bench JSON")
    out = tmp_path / "r.json"
    rc = main(
        [
            "bench",
            "--arms",
            "upstream",
            "token_list",
            "qwen3-omni-flat",
            "wire-floor",
            "--wire",
            "serializer",
            "--view-hop",
            "serializer",
            "--json",
            str(out),
            *SMALL,
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and "p50 vs upstream" in text and "serializer round trip" in text
    # every arm's p50 as a multiple of the round trip and of the wire-floor arm, per bucket
    ratios = [ln for ln in text.splitlines() if "p50 step =" in ln]
    assert ratios and all("qwen3-omni-flat " in ln and "x wire-floor" in ln for ln in ratios)
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, bench.RESULT_SCHEMA)
    assert doc["wire"] == "serializer" and doc["machine"]["run"]["view_hop"] == "serializer"


def test_roundtrip_lines_divide_each_p50_by_the_round_trip_and_the_floor():
    def res(arm, us):
        return ArmResult(arm, 1000, 10, "serializer", requests=10, steps=3, samples_us=[[us, us, us]])

    run = bench.BenchRun(load_workload("qwen3-omni-seed"), "serializer", None, 1)
    run.results = [res("upstream", 400.0), res("qwen3-omni-flat", 30.0), res("wire-floor", 20.0)]
    assert bench.roundtrip_lines(run) == []  # no round trip measured
    run.delta_roundtrip_us = 10.0
    (line,) = bench.roundtrip_lines(run)
    assert "context_len=1000 concurrency=10" in line
    assert "upstream 40.00x, 20.00x wire-floor" in line and "qwen3-omni-flat 3.00x, 1.50x wire-floor" in line
    assert line.endswith("; wire-floor 2.00x")  # the floor against the round trip alone
