"""``omni-accum bench``: tables, JSON against its schema, plot, errors as one-line messages."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import stat

import pytest

from conftest import require_vllm_omni
from omni_accum import bench
from omni_accum.cli import main
from omni_accum.bench.replay import ArmResult
from omni_accum.bench.workloads import WorkloadError, load_workload
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
    assert "steps/request=4 (1 prefill + 3 decode)" in text  # --steps 3: the prefill chunk is a step too
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
    assert rc == 2 and "keys[0].kind" in err and "Traceback" not in err


def test_unknown_arm_lists_the_choices(capsys):
    rc = main(["bench", "--arms", "fastest", *SMALL])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown arm 'fastest'" in err and "prealloc" in err and "qwen3-omni" in err


@pytest.mark.parametrize("name, said", [("nonexist.yaml", "no such file"), ("policies/", "is a directory")])
def test_an_arm_that_names_a_missing_policy_file_says_so(tmp_path, monkeypatch, capsys, name, said):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "policies").mkdir()
    rc = main(["bench", "--arms", name, *SMALL])
    err = capsys.readouterr().err
    assert rc == 2 and f"arm {name!r}: a policy file? {said} (from {tmp_path})" in err, err


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
    monkeypatch.setattr(bench.arms, "upstream_available", lambda: False)
    rc = main(["bench", *SMALL])
    captured = capsys.readouterr()
    assert rc == 0 and "upstream arm is left out" in captured.err
    assert "workload qwen3-omni-0.30: arms cat, token_list, prealloc, wire-floor, send_once, qwen3-omni;" in captured.out


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
            "--workload",
            "qwen3-omni-seed",  # the flat layout qwen3-omni-flat is for; upstream appends its keys
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


def test_negative_row_shape_is_one_line_naming_the_field(tmp_path, capsys):
    bad = tmp_path / "w.yaml"
    bad.write_text("name: w\nkeys: [{path: a.b, kind: append, carried: decode, read: newest_row, row_shape: [-5]}]\n")
    rc = main(["bench", "--workload", str(bad), "--arms", "cat", *SMALL])
    err = capsys.readouterr().err
    assert rc == 2 and "keys[0].row_shape[0]" in err and "Traceback" not in err


@pytest.mark.parametrize(("plot", "needle"), [("p.out", "extension .out"), ("noext", "has no extension")])
def test_plot_path_without_a_format_is_refused_before_measuring(tmp_path, monkeypatch, capsys, plot, needle):
    require_module("matplotlib", "the plot extra, installed by scripts/env.sh")
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("measured before checking --plot"))
    out = tmp_path / "r.json"
    rc = main(["bench", "--arms", "cat", "--json", str(out), "--plot", str(tmp_path / plot), *SMALL])
    err = capsys.readouterr().err
    assert rc == 2 and f"--plot {tmp_path / plot}: {needle}" in err
    assert "png" in err and "svg" in err and "pdf" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_plot_formats_without_matplotlib(monkeypatch):
    def missing():
        raise bench.PlotUnavailable("no matplotlib")

    monkeypatch.setattr(bench.plotting, "require_matplotlib", missing)
    assert bench.plot_formats() == ["png", "svg", "pdf"]
    assert bench.plot_path_problem("a.SVG") is None
    assert "png, svg, pdf" in bench.plot_path_problem("a.out")


def test_context_len_over_the_bound_is_refused(capsys):
    rc = main(["bench", "--arms", "cat", "--context-lens", "10000000000", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--context-lens 10000000000" in err and "1000000" in err and "Traceback" not in err


def test_out_of_memory_is_one_line_naming_the_bucket(monkeypatch, capsys):
    def measure(*a, **k):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 81920000008192 bytes. Error code 12 (Cannot allocate memory)"
        )

    monkeypatch.setattr(bench.runner, "measure", measure)
    rc = main(["bench", "--arms", "cat", *SMALL])
    err = capsys.readouterr().err
    assert rc == 1 and "context_len=16 concurrency=2: out of memory (could not allocate 81.9 TB)" in err
    assert "Traceback" not in err


def test_an_address_space_limit_is_out_of_memory_too(monkeypatch, capsys):
    """Under ``ulimit -v`` torch's C++ throws std::bad_alloc, which came out as a traceback."""
    monkeypatch.setattr(bench.runner, "measure", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("std::bad_alloc")))
    rc = main(["bench", "--arms", "cat", *SMALL])
    err = capsys.readouterr().err
    assert rc == 1 and "context_len=16 concurrency=2: out of memory;" in err and "Traceback" not in err


def test_a_bucket_larger_than_the_memory_available_is_refused_before_any_is_measured(monkeypatch, capsys):
    """Each request in flight holds what it keeps (the seed stream: every key; 0.30.0's: keys read as deltas go);
    c=100000 ran into the kernel's out-of-memory killer or a traceback from deep in building the streams."""
    wl = load_workload("qwen3-omni-seed")
    per = bench.runner.bucket_memory_problem
    monkeypatch.setattr(bench.runner, "available_memory", lambda: 100_000_000)
    assert per(wl, 1000, 1) is None  # ~8 MB
    problem = per(wl, 1000, 100)
    assert problem.startswith("context_len=1000 concurrency=100: needs at least ") and "100.0 MB is available" in problem
    kept = per(wl, 1000, 100).split("(")[1].split()[0]
    assert float(kept) > 8  # MB per request: the two [1001, 2048] bf16 prefill tensors and more
    assert per(load_workload("qwen3-omni-0.30"), 1000, 100) is None  # its tensors are taken and dropped
    monkeypatch.setattr(bench.runner, "measure", lambda *a, **k: pytest.fail("a bucket was measured"))
    rc = main(["bench", "--workload", "qwen3-omni-seed", "--arms", "cat", "--context-lens", "1k", "--concurrency",
               "1", "100", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 1 and "context_len=1000 concurrency=100: needs at least" in err and "Traceback" not in err


def test_other_runtime_errors_are_not_taken_for_memory(monkeypatch):
    monkeypatch.setattr(bench.runner, "measure", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        bench.run_bench("qwen3-omni-seed", {}, context_lens=[16], concurrency=[1], repeats=1)


def _policy_file(tmp_path):
    pol = tmp_path / "pol.yaml"
    pol.write_text("rules:\n  - {match: thinker_embeddings, strategy: prealloc}\n")
    return pol


def _workload_file(tmp_path, policy=None):
    wl = tmp_path / "w.yaml"
    extra = f"policy: {policy}\n" if policy else ""
    wl.write_text(f"name: w\ndecode_steps: 2\n{extra}keys: [{{path: a.b, kind: append, row_shape: [4]}}]\n")
    return wl


def test_json_onto_an_input_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("measured before checking --json"))
    pol = _policy_file(tmp_path)
    wl = _workload_file(tmp_path, policy=pol)
    before = {p: p.read_text() for p in (pol, wl)}
    for argv, needle in (
        (["--arms", "cat", str(pol), "--json", str(pol)], f"--json {pol} is the policy file of arm"),
        (["--workload", str(wl), "--arms", "cat", "--json", str(wl)], f"--json {wl} is the --workload file"),
        (["--workload", str(wl), "--arms", "cat", "--json", str(pol)], f"--json {pol} is the workload's policy"),
    ):
        rc = main(["bench", *argv, *SMALL])
        err = capsys.readouterr().err
        assert rc == 2 and needle in err, (argv, err)
    assert {p: p.read_text() for p in (pol, wl)} == before


def test_json_and_plot_on_one_file_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("measured before checking the outputs"))
    out = tmp_path / "r.png"
    rc = main(["bench", "--arms", "cat", "--json", str(out), "--plot", str(tmp_path / "." / "r.png"), *SMALL])
    err = capsys.readouterr().err
    assert rc == 2 and "are the same file" in err and str(out) in err


@pytest.mark.parametrize("arms", [[], ["--arms", "cat"]])
def test_workload_policy_that_names_nothing_is_reported_with_its_origin(tmp_path, capsys, arms):
    wl = _workload_file(tmp_path, policy="nopreset")
    rc = main(["bench", "--workload", str(wl), *arms, *SMALL])
    err = capsys.readouterr().err
    assert rc == 2 and f"{wl}: field 'policy': 'nopreset'" in err and "qwen3-omni-flat" in err


def test_a_workload_policy_file_that_does_not_load_is_named_as_the_workloads_not_arms(tmp_path, capsys):
    """The default arms include the workload's own policy: an invalid file there was reported as '--arms: ...'."""
    bad = tmp_path / "badpol.yaml"
    bad.write_text("default: catt\n")
    wl = _workload_file(tmp_path, policy=str(bad))
    rc = main(["bench", "--workload", str(wl), *SMALL])
    err = capsys.readouterr().err
    assert rc == 2 and f"{wl}: field 'policy': invalid policy" in err and "unknown strategy 'catt'" in err, err
    assert "--arms" not in err
    rc = main(["bench", "--workload", str(wl), "--arms", f"cat,{bad}", *SMALL])
    err = capsys.readouterr().err
    assert rc == 2 and "--arms: invalid policy" in err, err


def test_build_arms_names_the_workload_policy_field():
    wl = load_workload("qwen3-omni-seed").model_copy(update={"policy": "nopreset"})
    with pytest.raises(bench.arms.OmniAccumError, match="field 'policy': 'nopreset'"):
        bench.build_arms(wl)


def test_default_arms_add_send_once_but_not_replace_for_replace_keys():
    assert bench.default_arm_names(load_workload("talker-code2wav")) == ["upstream", "send_once", "qwen3-omni"]
    assert bench.default_arm_names(load_workload("qwen3-omni-chunked-prefill")) == [
        "upstream",
        "cat",
        "token_list",
        "prealloc",
        "send_once",
        "qwen3-omni",
    ]


def test_on_the_0_30_stream_the_default_arms_add_wire_floor_and_the_ratios_compare_with_it(capsys):
    """vllm-omni 0.30.0's own _accumulate_payload raises on its thinker -> talker stream (the 0-d
    meta.is_segment_finished); its adapter hands each chunk over as it came: the wire-floor arm is that reference."""
    wl = load_workload("qwen3-omni-0.30")
    assert bench.default_arm_names(wl) == [
        "upstream", "cat", "token_list", "prealloc", "wire-floor", "send_once", "qwen3-omni",
    ]  # fmt: skip
    rc = main(["bench", "--context-lens", "32", "--concurrency", "1", "--repeats", "1", "--steps", "3", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    table = out[out.index("arm ") :]
    assert "p50 vs wire-floor" in table and "p50 vs upstream" not in table
    lines = table.splitlines()[2:]
    rows = {ln.split()[0]: ln.split()[-1] for ln in lines[: next(i for i, ln in enumerate(lines) if ln.startswith("("))]}
    if "upstream" in rows:  # vllm-omni installed: its code ran and raised
        assert rows["upstream"] == "fails" and "raised on this stream" in out
    assert rows["wire-floor"] == "n/a" and rows["cat"] == rows["qwen3-omni"] == "ok"


def test_a_fifo_as_json_or_plot_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("the run started"))
    for option in ("--json", "--plot"):
        assert main(["bench", *SMALL, option, str(fifo)]) == 2
        err = capsys.readouterr().err
        assert f"{option} {fifo}: is a FIFO, not a regular file" in err and "Traceback" not in err
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_through_vllm_omni_leaves_wire_floor_out_of_the_default_arms(capsys):
    """docs/benchmarks.md's --through example exited 1: the default arms of the 0.30 stream hold wire-floor, which
    that path does not take."""
    require_vllm_omni()
    rc = main(["bench", "--wire", "shm", "--through", "vllm-omni", "--context-lens", "32", "--concurrency", "1",
               "--steps", "2", "--repeats", "1", "--no-progress"])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "arms upstream, cat, token_list, prealloc, send_once, qwen3-omni;" in out and "wire-floor" not in err


def test_wire_floor_named_with_through_vllm_omni_is_a_usage_error_before_the_run(capsys, monkeypatch):
    """It was run through every bucket and reported as a wrong view (exit 1); an arm that path cannot take is a
    usage error (exit 2), named with the valid arms, as any unknown arm."""
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("the run started"))
    args = ["--context-lens", "32", "--concurrency", "1", "--steps", "2", "--repeats", "1", "--no-progress"]
    rc = main(["bench", "--wire", "shm", "--through", "vllm-omni", "--arms", "upstream", "wire-floor", *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "arm 'wire-floor' is not measured through vllm-omni" in err and "--through direct" in err
    assert "Traceback" not in err


def test_help_has_examples_defaults_and_the_wire_floor_arm(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert "--repeats N" in text and "REPEATS" not in text
    assert "inproc (default)" in text and "direct (default)" in text
    assert "wire-floor (accumulates nothing" in text
    assert "examples:\n  omni-accum bench --workload qwen3-omni-seed" in text
    assert "counts the" in text and "prefill chunk(s)" in text
    # a continued example is printed on two lines, as a shell takes it (not joined into one)
    assert "qwen3-omni-flat wire-floor \\\n      --json seed.json" in text


def test_arms_take_commas_like_the_other_list_options(capsys):
    rc = main(["bench", "--arms", "cat,prealloc", "token_list", *SMALL])
    out = capsys.readouterr().out
    assert rc == 0 and "arms cat, prealloc, token_list;" in out


def test_plot_given_twice_is_refused_naming_both(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--arms", "cat", "--plot", "a.png", "--plot", "b.png", *SMALL])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "a.png" in err and "b.png" in err and "--plot" in err


def _arm(name, samples, **kw):
    return ArmResult(name, 1000, 2, "inproc", requests=2, steps=len(samples[0]), samples_us=samples, **kw)


def test_a_ratio_inside_the_noise_is_not_reported_as_a_speed_up():
    # the same algorithm, a bimodal step (prefill and decode steps): the medians fall on either mode
    upstream = _arm("upstream", [[10.0] * 5 + [30.0] * 6])
    cat = _arm("cat", [[10.0] * 6 + [30.0] * 5])
    text = bench.format_table([upstream, cat])
    row = next(line for line in text.splitlines() if line.startswith("cat "))
    assert "within noise" in row and "faster" not in row
    assert "95% CI" in text


def test_a_clear_speed_up_keeps_its_ratio_and_interval():
    upstream = _arm("upstream", [[100.0 + i % 7 for i in range(40)]])
    prealloc = _arm("prealloc", [[10.0 + i % 3 for i in range(40)]])
    row = next(line for line in bench.format_table([upstream, prealloc]).splitlines() if line.startswith("prealloc"))
    assert "within noise" not in row and "x faster" in row and "[" in row
    lo, hi = bench.p50_interval(prealloc)
    assert lo <= prealloc.step_us_p50 <= hi


def test_wire_floor_views_are_not_applicable():
    rows = bench.format_table([_arm("upstream", [[5.0, 6.0]]), _arm("wire-floor", [[1.0, 2.0]])]).splitlines()
    floor = next(line for line in rows if line.startswith("wire-floor"))
    assert floor.rstrip().endswith("n/a") and " ok" not in floor


class _Clock:
    """A fake monotonic clock: every reading is 2 s after the previous one (no wall-clock in tests)."""

    def __init__(self):
        self.t = 0.0

    def monotonic(self):
        self.t += 2.0
        return self.t


def _fake_bench_run(monkeypatch, context_lens, advance):
    """run_bench with a stand-in for measure that reports ``advance(context_len)`` steps; the progress text."""
    import io
    import types

    from omni_accum.bench import runner

    monkeypatch.setattr(runner, "time", types.SimpleNamespace(monotonic=_Clock().monotonic))
    lines = []

    def fake_measure(wl, arms, *, context_len, concurrency, progress, **kw):
        for _ in range(advance(context_len)):
            progress(concurrency)
        lines.append(buf.getvalue().splitlines()[-1] if buf.getvalue() else "")
        return []

    monkeypatch.setattr(runner, "measure", fake_measure)
    buf = io.StringIO()
    wl = load_workload("qwen3-omni-seed")
    runner.run_bench(wl, {"cat": None}, context_lens=context_lens, concurrency=[1], repeats=1, progress=buf)
    return lines, buf.getvalue().splitlines()


def test_a_finished_run_ends_its_progress_bar_at_100_percent(monkeypatch):
    # an arm that fails replays none of its steps: the bar would stop short of 100 %
    _, out = _fake_bench_run(monkeypatch, [16], lambda cl: 2)
    assert "100.0%" in out[-1] and "ETA    0.0s" in out[-1]


def test_progress_counts_a_long_context_step_for_more_than_a_short_one(monkeypatch):
    wl = load_workload("qwen3-omni-seed")
    after_bucket, _ = _fake_bench_run(monkeypatch, [16, 32000], wl.n_chunks)
    pct = float(after_bucket[0].split("%")[0].split()[-1])
    assert pct < 5.0  # the 16-row bucket is a small part of the run's time, not half of it


def test_progress_uses_tqdm_on_a_terminal_when_importable():
    import io

    pytest.importorskip("tqdm")

    class Tty(io.StringIO):
        def isatty(self):
            return True

    buf = Tty()
    bar = bench.Progress(1000, buf, use_tqdm=True)
    bar._tqdm.delay = 0
    bar.advance(3)
    bar.finish()
    assert "100%" in buf.getvalue().split("\r")[-1]


def test_plot_gives_each_arm_one_colour_and_explains_c(tmp_path):
    require_module("matplotlib", "the plot extra, installed by scripts/env.sh")
    from omni_accum.bench import plotting

    run = bench.BenchRun(load_workload("qwen3-omni-seed"), "inproc", None, 1)
    for cl in (1000, 8000, 32000):
        for c in (1, 10):
            for arm, f in (("upstream", 1.0), ("cat", 0.9), ("prealloc", 0.1)):
                run.results.append(_arm(arm, [[f * cl * c * (1 + 0.01 * i) for i in range(20)]]))
                run.results[-1].context_len, run.results[-1].concurrency = cl, c
    fig = plotting.figure(run)
    ax = fig.axes[0]
    by_arm = {}
    for (arm, c), line in zip(plotting.plot_series(run), ax.get_lines()):
        by_arm.setdefault(arm, set()).add(str(line.get_color()))
        assert (c == 10) == (line.get_linestyle() == "--")
    assert all(len(cs) == 1 for cs in by_arm.values()) and len({next(iter(cs)) for cs in by_arm.values()}) == 3
    up = [line for (arm, _), line in zip(plotting.plot_series(run), ax.get_lines()) if arm == "upstream"]
    assert all(line.get_linewidth() > 2 for line in up)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "upstream (baseline)" in legend and any(t.startswith("c=10: 10 requests") for t in legend)
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1k", "8k", "32k"]
    assert len(ax.collections) == 6  # a 95 % interval band per line


def test_a_bad_workload_field_names_its_line(tmp_path, capsys):
    bad = tmp_path / "w.yaml"
    bad.write_text("name: w\nkeys:\n  - path: x\n    kind: sideways\n")
    rc = main(["bench", "--workload", str(bad), *SMALL])
    err = capsys.readouterr().err
    assert rc == 2 and "line 4: keys[0].kind" in err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--wire", "arena", "--plot", "x.png"], "--wire arena takes none of --plot"),
        (["--wire", "arena", "--arms", "upstream", "--per-key"], "--wire arena takes none of --arms, --per-key"),
        (["--wire", "arena", "--through", "vllm-omni"], "--through vllm-omni"),
        (["--mooncake-occupancy", "3"], "--mooncake-occupancy needs --wire mooncake (this run's wire: inproc)"),
        (["--wire", "shm", "--mooncake-segment", "2GiB"], "--mooncake-segment needs --wire mooncake"),
        (["--arena-wait", "spin"], "--arena-wait needs --wire arena"),
        (["--wire", "mooncake", "--arena-wait", "spin"], "--arena-wait needs --wire arena (this run's wire: mooncake)"),
    ],
)
def test_options_a_wire_would_ignore_are_refused_before_measuring(tmp_path, monkeypatch, capsys, args, needle):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", *args]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_the_json_writer_never_creates_folders(tmp_path):
    """``bench --json /nonexist2/x.json`` created the folders (``mkdir(parents=True)``), even at ``/``; the CLI now
    refuses a missing folder up front, and the writer itself never creates one (a folder removed meanwhile)."""
    run = bench.BenchRun(load_workload("qwen3-omni-seed"), "inproc", None, 1)
    with pytest.raises(FileNotFoundError):
        bench.write_json(run, tmp_path / "gone" / "x.json")
    assert not (tmp_path / "gone").exists()
    bench.write_json(run, tmp_path / "x.json")
    assert json.loads((tmp_path / "x.json").read_text())["wire"] == "inproc"


def test_no_eta_before_one_percent_is_done():
    """``bench`` opened with "ETA 4770 s": an extrapolation from the first moments (warm-up, set-up)."""
    import io

    from omni_accum.bench.runner import Progress

    out = io.StringIO()
    bar = Progress(10_000, out, use_tqdm=False)
    bar.done = 5
    bar._draw(bar.t0 + 5.0)
    assert out.getvalue().rstrip().endswith("ETA      ?"), out.getvalue()
    bar.done = 5_000
    bar._draw(bar.t0 + 10.0)
    assert out.getvalue().rstrip().endswith("ETA   10.0s"), out.getvalue()


def test_the_json_writer_replaces_a_link_at_the_output_and_never_writes_through_it(tmp_path):
    """A link planted at --json's name must not redirect the write to its target (nor one at <out>.tmp)."""
    run = bench.BenchRun(load_workload("qwen3-omni-seed"), "inproc", None, 1)
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    (tmp_path / "out.json").symlink_to(victim)
    (tmp_path / "out.json.tmp").symlink_to(victim)
    bench.write_json(run, tmp_path / "out.json")
    assert victim.read_text() == "keep me\n"
    assert not (tmp_path / "out.json").is_symlink() and json.loads((tmp_path / "out.json").read_text())["wire"] == "inproc"


def test_names_longer_than_a_file_name_are_named_not_crashed():
    """Arms, a workload and a workload's policy field are probed as files first: a name too long for one
    (``OSError: File name too long``) is an ordinary unknown name."""
    long = "x" * 300
    wl = load_workload("qwen3-omni-seed")
    with pytest.raises(bench.arms.UnknownArmError, match="unknown arm"):
        bench.build_arms(wl, [long])
    with pytest.raises(bench.arms.OmniAccumError, match="field 'policy'"):
        bench.build_arms(wl.model_copy(update={"policy": long}))
    with pytest.raises(WorkloadError, match="neither a workload file nor a preset"):
        load_workload(long)
    from omni_accum.cli.args import workload_problem
    from omni_accum.tuner.paths import input_file

    assert input_file(long) is None and input_file("default: cat\n# " + long) is None
    assert "neither a workload file nor a preset" in workload_problem(long)


def test_a_workload_policy_field_longer_than_a_file_name_is_named(tmp_path, monkeypatch, capsys):
    """``bench`` probes the workload's policy field as a file: one too long to be a file name raised ``OSError:
    File name too long`` ("error: File name too long"); it is an unknown policy, named as such (a usage error: exit 2)."""
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("measured a workload with no policy"))
    wl = _workload_file(tmp_path, policy="p" * 300)
    rc = main(["bench", "--workload", str(wl), "--json", str(tmp_path / "o.json"), *SMALL])
    err = capsys.readouterr().err
    assert rc == 2 and "field 'policy'" in err and "is neither a policy preset" in err and "too long" not in err, err


@pytest.mark.parametrize(
    ("master", "needle"),
    [("127.0.0.1", "has no port (HOST:PORT)"), ("127.0.0.1:99999", "has port '99999', not a number from 1 to 65535")],
)
def test_a_mooncake_master_without_a_usable_port_is_refused_before_anything_waits(capsys, master, needle):
    """It was taken ("127.0.0.1:99999"), and the holder waited ~60 s before "did not start", naming no master."""
    rc = main(["bench", "--wire", "mooncake", "--mooncake-master", master, "--context-lens", "1k", "--concurrency",
               "1", "--steps", "2", "--repeats", "1"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and f"--mooncake-master {master!r} {needle}" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["bench", "tune"])
@pytest.mark.parametrize(("option", "valid"), [("--workload", "a YAML or JSON workload file"),
                                               ("--trace", "a capture folder or a capture file")])
def test_an_empty_workload_or_trace_is_a_usage_error_not_the_default_workload(tmp_path, capsys, monkeypatch, command,
                                                                             option, valid):
    """`--workload ''` and `--trace ''` ran the default workload without a word (`--arms ''` is an error)."""
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("the run started"))
    monkeypatch.setattr("omni_accum.cli.tune.tune", lambda *a, **k: pytest.fail("the run started"))
    extra = ["--out", str(tmp_path / "t.yaml")] if command == "tune" else SMALL
    for empty in ("", " "):
        assert main([command, option, empty, *extra]) == 2
        err = capsys.readouterr().err
        what = "blank" if empty else "empty"
        assert err.startswith(f"omni-accum {command}: error: {what} {option} {empty!r}: give ") and valid in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "t.yaml").exists()


# -- what --json and --plot write: atomically, keeping an existing file's mode, never over an input ------------------ #


def _plotted_run():
    run = bench.BenchRun(load_workload("qwen3-omni-seed"), "inproc", None, 1)
    for cl in (1000, 8000):
        run.results.append(_arm("cat", [[cl * (1 + 0.01 * i) for i in range(8)]]))
        run.results[-1].context_len = cl
    return run


def test_plot_replaces_a_link_at_its_path_and_never_writes_through_it(tmp_path):
    """`--plot PATH` wrote through a symlink planted at PATH, into the link's target."""
    require_module("matplotlib", "the plot extra, installed by scripts/env.sh")
    victim = tmp_path / "victim.png"
    victim.write_bytes(b"keep me")
    out = tmp_path / "p.png"
    out.symlink_to(victim)
    bench.plot(_plotted_run(), out)
    assert victim.read_bytes() == b"keep me"
    assert not out.is_symlink() and out.read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.png", "victim.png"]


def test_a_plot_that_cannot_be_written_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    """On a full disk the previous PNG was left truncated (matplotlib wrote the path itself); the error names it."""
    require_module("matplotlib", "the plot extra, installed by scripts/env.sh")
    from matplotlib.figure import Figure

    out = tmp_path / "p.png"
    out.write_bytes(b"the previous plot")

    def full_disk(self, fname, **kw):
        if isinstance(fname, (str, os.PathLike)):  # as matplotlib opens a path it is given
            with open(fname, "wb") as fh:
                fh.write(b"\x89PNG, half of it")
        else:
            fname.write(b"\x89PNG, half of it")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full_disk)
    with pytest.raises(OSError) as e:
        bench.plot(_plotted_run(), out)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(out)
    assert out.read_bytes() == b"the previous plot" and [p.name for p in tmp_path.iterdir()] == ["p.png"]


def test_json_and_plot_over_an_existing_file_keep_its_mode(tmp_path):
    """`bench --json` over an existing 0600 file made it 0644 (0666 & ~umask), unlike tune --out."""
    out = tmp_path / "r.json"
    out.write_text("{}\n")
    out.chmod(0o600)
    bench.write_json(_plotted_run(), out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600 and json.loads(out.read_text())["wire"] == "inproc"
    if os.geteuid() == 0:  # root over the service user's file: it stays the service's
        os.chown(out, 65534, 65534)
        bench.write_json(_plotted_run(), out)
        assert (out.stat().st_uid, out.stat().st_gid, stat.S_IMODE(out.stat().st_mode)) == (65534, 65534, 0o600)
    if importlib.util.find_spec("matplotlib"):
        png = tmp_path / "p.png"
        png.write_bytes(b"old")
        png.chmod(0o640)
        bench.plot(_plotted_run(), png)
        assert stat.S_IMODE(png.stat().st_mode) == 0o640 and png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    "which", ["a capture of the folder", "its salt", "the capture file given", "its salt beside the file given",
              "another process's capture beside the file given"]  # fmt: skip
)
def test_json_onto_a_file_of_the_trace_capture_is_refused(tmp_path, capsys, monkeypatch, which):
    """`bench --trace DIR --json DIR/capture-....jsonl` overwrote the capture it replayed; with `--trace` naming one
    capture file, `--json` could still replace the salt or another process's capture beside it."""
    from tests.test_trace_cli import write_capture

    write_capture(tmp_path / "cap")
    (capture,) = (tmp_path / "cap").glob("capture-*.jsonl")
    other = tmp_path / "cap" / "capture-0-99999.0.jsonl"
    other.write_bytes(capture.read_bytes())
    target = {"its salt": tmp_path / "cap" / "salt", "its salt beside the file given": tmp_path / "cap" / "salt",
              "another process's capture beside the file given": other}.get(which, capture)  # fmt: skip
    trace = capture if "file given" in which else tmp_path / "cap"
    assert target.is_file()
    before = target.read_bytes()
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("measured before checking --json"))
    rc = main(["bench", "--trace", str(trace), "--arms", "cat", "--json", str(target), "--no-progress"])
    err = capsys.readouterr().err
    what = {"the capture file given": "the --trace capture file", "its salt beside the file given":
            f"a file of the capture beside --trace {trace}"}.get(which, f"a file of the --trace folder {trace}")  # fmt: skip
    if which.startswith("another"):
        what = f"a file of the capture beside --trace {trace}"
    assert rc == 2 and f"--json {target} is {what} ({target}); writing it would overwrite an input" in err, err
    assert target.read_bytes() == before


def test_a_long_legal_output_name_is_taken_and_one_too_long_is_named(tmp_path, monkeypatch, capsys):
    """A legal 250-byte --json name was refused: the probe and temporary names beside it exceeded 255 bytes."""
    from omni_accum.bench._paths import output_path_problem

    out = tmp_path / ("r" * 245 + ".json")
    assert output_path_problem(out, "--json") is None
    bench.write_json(_plotted_run(), out)
    assert json.loads(out.read_text())["wire"] == "inproc" and [p.name for p in tmp_path.iterdir()] == [out.name]
    too_long = tmp_path / ("r" * 251 + ".json")
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("measured before checking --json"))
    assert main(["bench", "--arms", "cat", "--json", str(too_long), *SMALL]) == 2
    err = capsys.readouterr().err
    assert f"--json {too_long}: its file name is 256 bytes long, over the 255" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "option, name, content",
    [
        ("--json", "tuned.yaml", "# a tuned table\ndefault: cat\n"),
        ("--json", "notes.txt", "my notes\n"),
        ("--json", "policy.json", '{"default": "cat"}\n'),
        ("--plot", "plot.png", "not a picture\n"),
    ],
)
def test_an_output_onto_a_file_that_is_no_earlier_output_is_refused_and_left_untouched(
    tmp_path, capsys, monkeypatch, option, name, content
):
    """`bench --json tuned.yaml` replaced a tuned policy (any file) with bench's JSON; tune --out refuses as much."""
    target = tmp_path / name
    target.write_text(content)
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("measured before checking the output"))
    rc = main(["bench", "--workload", "qwen3-omni-seed", "--arms", "cat", option, str(target), "--no-progress"])
    err = capsys.readouterr().err
    what = "a PNG image" if option == "--plot" else "a bench result (a JSON document with wire and results or buckets)"
    assert rc == 2 and f"error: {option} {target}: exists and is not {what}: left untouched" in err, err
    assert target.read_text() == content


def test_an_earlier_result_an_empty_file_and_a_link_are_still_replaced(tmp_path, capsys):
    """What `--json` may replace: its own earlier output, an empty file, a symlink (replaced, its target not)."""
    args = ["bench", "--workload", "qwen3-omni-seed", "--arms", "cat", "--context-lens", "64", "--concurrency", "1",
            "--repeats", "1", "--steps", "2", "--no-progress", "--json"]  # fmt: skip
    out, empty, link, kept = tmp_path / "r.json", tmp_path / "e.json", tmp_path / "l.json", tmp_path / "kept.yaml"
    empty.touch()
    kept.write_text("default: cat\n")
    link.symlink_to(kept)
    for target in (out, out, empty, link):  # the second time over its own first output
        assert main([*args, str(target)]) == 0, capsys.readouterr().err
        assert json.loads(target.read_text())["wire"] == "inproc"
    assert not link.is_symlink() and kept.read_text() == "default: cat\n"
    arena = tmp_path / "arena.json"  # `--wire arena`'s own document (buckets, no results) is a bench result too
    arena.write_text(json.dumps({"wire": "arena", "workload": "w", "complete": True, "buckets": []}))
    assert main([*args, str(arena)]) == 0 and json.loads(arena.read_text())["wire"] == "inproc"
    deep = tmp_path / "deep.json"  # nested past the JSON parser's depth: refused, not a traceback
    deep.write_text("[" * 200_000)
    assert main([*args, str(deep)]) == 2 and "exists and is not a bench result" in capsys.readouterr().err
