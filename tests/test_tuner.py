"""The auto-tuner: statistics, buckets, candidates, gates, output file, resume, runtime use, CLI."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from conftest import CI

import omni_accum
from omni_accum import cli
from omni_accum.policy import TunedTable
from omni_accum.policy.environment import current_fingerprint
from omni_accum.policy.fingerprint import StaleTableWarning
from omni_accum.tuner import TuneOptions, tune
from omni_accum.tuner import core as tuner_core
from omni_accum.tuner.buckets import log_edges
from omni_accum.tuner.candidates import candidate_set_hash, candidates_for
from omni_accum.tuner.core import keep_reason
from omni_accum.tuner.stats import bootstrap_gain, median, round_gain

TINY = {
    "name": "tiny",
    "context_len": 64,
    "decode_steps": 6,
    "concurrency": [1],
    "keys": [
        {"path": "embed.decode", "kind": "append", "carried": "every", "row_shape": [16], "read": "newest_row"},
        {"path": "embed.tts_bos", "kind": "static", "carried": "every", "rows": 1, "row_shape": [1, 16]},
        {"path": "embed.once", "kind": "append", "carried": "first", "row_shape": [16], "read": "never"},
        {"path": "meta.finished", "kind": "replace", "value": "flag", "carried": "every"},
    ],
}


def _opts(tmp_path: Path, **kw) -> TuneOptions:
    base = dict(
        workload=TINY,
        out=tmp_path / "tuned.yaml",
        context_lens=[64, 256],
        concurrency=[1, 2],
        decode_steps=6,
        max_rounds=2,
        verify=False,
    )
    base.update(kw)
    return TuneOptions(**base)


# -- statistics and buckets --------------------------------------------------------------------- #


def test_bootstrap_gain_separates_clear_wins_from_noise():
    slow = [100.0 + (i % 7) for i in range(40)]
    fast = [10.0 + (i % 5) for i in range(40)]
    g = bootstrap_gain(slow, fast)
    assert keep_reason(g, 100.0, 1.0) is None and 0.85 < g.gain < 0.92 and g.low > 0.8
    same = bootstrap_gain(slow, list(reversed(slow)))
    assert "crosses 0" in keep_reason(same, 100.0, 1.0) and same.low <= 0 <= same.high
    slightly = bootstrap_gain(slow, [x * 0.97 for x in slow])  # a 3 % win is below the 5 % bar
    assert "below +5%" in keep_reason(slightly, 100.0, 1.0)
    assert median([3.0, 1.0, 2.0]) == 2.0


def test_a_gain_over_rounds_counts_the_drift_between_rounds():
    """Two arms of the same speed, each round's level moved by the machine (+-8 % between rounds, each arm's own
    rounds apart): over the pooled steps the interval excluded 0 (a false win); over the rounds it does not. A real
    2x win is found either way, and the point gain is that of the pooled medians."""
    levels = [1.00, 1.08, 0.93, 1.05, 0.95]
    steps = [1.0 + 0.002 * (i % 5) for i in range(200)]
    base = [[100.0 * lv * x for x in steps] for lv in levels]
    same = [[100.0 * lv * x for x in steps] for lv in (1.06, 0.97, 1.04, 0.92, 1.07)]
    pooled = bootstrap_gain([x for r in base for x in r], [x for r in same for x in r])
    assert not pooled.low <= 0 <= pooled.high  # the step-level interval is too narrow for this drift
    g = round_gain(base, same)
    assert g.low <= 0 <= g.high and g.gain == pytest.approx(pooled.gain)
    fast = [[50.0 * lv * x for x in steps] for lv in levels]
    win = round_gain(base, fast)
    assert keep_reason(win, 100.0, 1.0) is None and win.low > 0.4
    assert round_gain([steps], [steps]).low <= 0 <= round_gain([steps], [steps]).high  # one round: over its steps


def test_log_edges_and_floor_semantics_with_clamping():
    assert log_edges(1000, 32000, 4) == [1000, 3175, 10079, 32000]
    with pytest.raises(ValueError):
        log_edges(0, 10, 3)
    t = TunedTable(
        context_len_edges=[1000, 8000],
        concurrency_edges=[1, 10],
        cells=[
            {"key": "k", "context_len": 1000, "concurrency": 1, "strategy": "cat"},
            {"key": "k", "context_len": 8000, "concurrency": 10, "strategy": "prealloc"},
        ],
    )
    ctx = omni_accum.StreamContext
    assert t.lookup("k", ctx(context_len=7999, concurrency=9)).strategy == "cat"  # floor, not nearest
    assert t.clamped_lookups == 0
    assert t.lookup("k", ctx(context_len=8000, concurrency=10)).strategy == "prealloc"
    assert t.lookup("k", ctx(context_len=100, concurrency=1)).strategy == "cat"  # below the first edge
    assert t.lookup("k", ctx(context_len=99999, concurrency=50)).strategy == "prealloc"  # above the last
    assert t.clamped_lookups == 2
    with pytest.raises(ValueError, match="ascending"):
        TunedTable(context_len_edges=[8000, 1000], concurrency_edges=[1])


# -- candidates --------------------------------------------------------------------------------- #


def test_candidates_are_filtered_by_declared_kinds():
    mgr = omni_accum.get_manager()
    append = {c.label for c in candidates_for("append", mgr)}
    assert {"cat", "token_list", "prealloc", "prealloc{growth_factor=1.5}", "prealloc{growth_factor=4.0}"} <= append
    assert not append & {"replace", "send_once", "delta"}
    static = {c.strategy for c in candidates_for("static", mgr)}
    replace = {c.strategy for c in candidates_for("replace", mgr)}
    assert {"replace", "send_once"} <= static and not static & {"cat", "prealloc", "token_list"}
    assert "replace" in replace
    if CI or mgr.get_spec("delta") is not None:  # the example third-party plugin, installed by scripts/env.sh
        assert mgr.get_spec("delta") is not None, "omni-accum-delta must be installed when CI=true"
        assert "delta" in replace and "delta" in static
    a = candidate_set_hash({"k": candidates_for("append", mgr)}, mgr)
    b = candidate_set_hash({"k": candidates_for("append", mgr, grid=False)}, mgr)
    assert a != b


# -- a whole run -------------------------------------------------------------------------------- #


def test_tune_writes_a_valid_auditable_policy(tmp_path, capsys):
    res = tune(_opts(tmp_path))
    out = tmp_path / "tuned.yaml"
    assert res.complete and out.is_file()
    assert cli.main(["validate", str(out)]) == 0
    pol = omni_accum.load_policy(out)
    t = pol.tuned
    assert t.complete and t.workload == "tiny" and t.context_len_edges == [64, 256] and t.concurrency_edges == [1, 2]
    assert set(t.skipped) == {"embed.once", "meta.finished"}  # carried once; decided by an explicit rule
    assert {(c.key, c.context_len, c.concurrency) for c in t.cells} == {
        (k, cl, c) for k in ("embed.decode", "embed.tts_bos") for cl in (64, 256) for c in (1, 2)
    }
    for c in t.cells:
        assert c.baseline == "cat" and c.baseline in c.timings_us
        if c.key == "embed.decode":
            assert {"token_list", "prealloc"} <= set(c.timings_us) | set(c.excluded)
        else:
            measured = set(c.timings_us) | set(c.excluded)
            assert {"replace", "send_once"} <= measured
            if omni_accum.get_manager().get_spec("delta") is not None:
                assert "delta" in measured  # a third-party plugin strategy is a candidate like the built-ins
    fp = t.fingerprint
    assert fp["torch"] == torch.__version__.split("+")[0] or fp["torch"] == current_fingerprint()["torch"]
    assert {"omni_accum", "torch", "vllm_omni", "device", "plugins", "candidates"} <= set(fp)
    assert not list(tmp_path.glob(".tuned.yaml.*"))  # no temporary file left
    assert cli.main(["tune", "--show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "embed.decode" in shown and "matches this environment" in shown and "margin" in shown


def test_memory_budget_rejects_a_greedy_candidate(tmp_path):
    res = tune(_opts(tmp_path, context_lens=[64], concurrency=[1]))
    cell = next(c for c in res.policy.tuned.cells if c.key == "embed.decode")
    # growth factor 4 allocates 256 rows for 64 + 7 -> over 2x the 71 rows cat holds
    assert "prealloc{growth_factor=4.0}" in cell.excluded
    assert "memory budget" in cell.excluded["prealloc{growth_factor=4.0}"]


class _Wrong(omni_accum.Strategy):
    name = "wrong"

    def new_accumulator(self, key):
        from omni_accum.strategies.replace import ReplaceAccumulator

        return ReplaceAccumulator()  # declares append-kind but keeps only the latest chunk


class _Boom(omni_accum.Strategy):
    name = "boom"

    def new_accumulator(self, key):
        raise RuntimeError("boom")


class _BadPlugin:
    @omni_accum.hookimpl
    def omni_accum_register_strategies(self):
        return [
            omni_accum.StrategySpec("wrong", _Wrong, kinds=frozenset({"append"})),
            omni_accum.StrategySpec("boom", _Boom, kinds=frozenset({"append"})),
        ]


def test_correctness_gate_excludes_wrong_and_raising_candidates(tmp_path):
    mgr = omni_accum.StrategyManager()
    mgr.register(_BadPlugin(), name="bad-plugin")
    omni_accum.reset_manager(mgr)
    res = tune(_opts(tmp_path, context_lens=[64], concurrency=[1]))
    cell = next(c for c in res.policy.tuned.cells if c.key == "embed.decode")
    assert "views differ from the cat reference" in cell.excluded["wrong"]
    assert "raised" in cell.excluded["boom"]
    assert cell.strategy not in ("wrong", "boom")


def test_interrupt_leaves_a_valid_partial_file_and_resume_finishes(tmp_path, monkeypatch):
    real = tuner_core.tune_bucket
    calls = []

    def flaky(*a, **kw):
        calls.append(kw["context_len"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr("omni_accum.tuner.run.tune_bucket", flaky)
    with pytest.raises(KeyboardInterrupt):
        tune(_opts(tmp_path, context_lens=[64, 256], concurrency=[1]))
    assert not (tmp_path / "tuned.yaml").exists()  # only a complete table goes to --out
    partial = omni_accum.load_policy(tmp_path / "tuned.partial.yaml")
    assert partial.tuned.complete is False
    assert {c.context_len for c in partial.tuned.cells} == {64}
    monkeypatch.setattr(
        "omni_accum.tuner.run.tune_bucket", lambda *a, **kw: calls.append(kw["context_len"]) or real(*a, **kw)
    )
    calls.clear()
    res = tune(_opts(tmp_path, context_lens=[64, 256], concurrency=[1], resume=True))
    assert calls == [256]  # the measured bucket was reused
    assert res.complete and {c.context_len for c in res.policy.tuned.cells} == {64, 256}
    assert omni_accum.load_policy(tmp_path / "tuned.yaml").tuned.complete and not (tmp_path / "tuned.partial.yaml").exists()


def test_interrupt_before_any_bucket_keeps_the_previous_file(tmp_path, monkeypatch):
    out = tmp_path / "tuned.yaml"
    tune(_opts(tmp_path))  # the previous run's table
    before = out.read_text()

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr("omni_accum.tuner.run.tune_bucket", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tune(_opts(tmp_path))
    assert out.read_text() == before


# -- runtime use -------------------------------------------------------------------------------- #


def _tuned_policy(fingerprint: dict) -> dict:
    return {
        "default": "cat",
        "rules": [{"match": "embed.pinned", "strategy": "token_list"}],
        "tuned": {
            "context_len_edges": [1000, 8000],
            "concurrency_edges": [1],
            "fingerprint": fingerprint,
            "cells": [
                {"key": "embed.decode", "context_len": 8000, "concurrency": 1, "strategy": "prealloc"},
                {"key": "embed.pinned", "context_len": 8000, "concurrency": 1, "strategy": "prealloc"},
            ],
        },
    }


def test_runtime_uses_the_bucket_and_rules_still_win():
    pol = omni_accum.load_policy(_tuned_policy(current_fingerprint()))
    long = omni_accum.Receiver(pol, context=omni_accum.StreamContext(context_len=9000))
    short = omni_accum.Receiver(pol, context=omni_accum.StreamContext(context_len=2000))
    row = torch.ones(1, 4)
    assert long.strategy_for("embed.decode", row) == "prealloc"
    assert short.strategy_for("embed.decode", row) == "cat"
    assert long.strategy_for("embed.pinned", row) == "token_list"  # an explicit rule beats the table
    assert "tuned bucket" in pol.resolve("embed.decode", omni_accum.StreamContext(context_len=8000)).source


def test_stale_table_warns_once_and_falls_back(monkeypatch):
    from omni_accum.policy import fingerprint

    monkeypatch.setattr(fingerprint, "_warned", set())
    fp = dict(current_fingerprint(), torch="0.0.1")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(2):  # two policies, many lookups: one warning
            pol = omni_accum.load_policy(_tuned_policy(fp))
            rx = omni_accum.Receiver(pol, context=omni_accum.StreamContext(context_len=9000))
            assert rx.strategy_for("embed.decode", torch.ones(1, 4)) == "cat"
            assert pol.resolve("embed.decode", omni_accum.StreamContext(context_len=9000)).source == "default"
    stale = [x for x in w if issubclass(x.category, StaleTableWarning)]
    assert len(stale) == 1
    assert "torch" in str(stale[0].message) and "0.0.1" in str(stale[0].message)


@pytest.mark.parametrize("plugins", [5, "omni-accum==0.1.0", ["prealloc"]])
def test_a_hand_edited_fingerprint_whose_plugins_is_not_a_map_of_versions_is_a_policy_error(plugins, tmp_path, capsys):
    """``plugins: 5`` in a tuned table's fingerprint was a ``TypeError`` traceback from every command that loads the
    policy (validate, explain, show, bench, doctor, load_policy); it is a schema error at its place."""
    fp = dict(current_fingerprint(), plugins=plugins)
    with pytest.raises(omni_accum.PolicyError, match=r"tuned.fingerprint: .*'plugins' must map each strategy to its"):
        omni_accum.load_policy(_tuned_policy(fp))
    import yaml

    f = tmp_path / "t.yaml"
    f.write_text(yaml.safe_dump(_tuned_policy(fp)))
    assert cli.main(["validate", str(f)]) == 1
    got = capsys.readouterr()
    assert "'plugins' must map each strategy" in got.out + got.err and "Traceback" not in got.out + got.err


@pytest.mark.parametrize(
    ("edit", "place", "got"),
    [
        (lambda t: t.update(context_len_edges=[1000, "8000"]), "tuned.context_len_edges[1]", "'8000'"),
        (lambda t: t.update(concurrency_edges=[True]), "tuned.concurrency_edges[0]", "True"),
        (lambda t: t.update(complete="yes"), "tuned.complete", "'yes'"),
        (lambda t: t["cells"][0].update(context_len="8000"), "tuned.cells[0].context_len", "'8000'"),
        (lambda t: t["cells"][1].update(concurrency=True), "tuned.cells[1].concurrency", "True"),
    ],
)
def test_a_tuned_tables_numbers_are_numbers_not_strings_or_booleans(edit, place, got):
    """A hand edit (``concurrency: true``, ``context_len: "8000"``) was taken: a cell keyed 1 or 8000 (or a table
    marked complete) from a string or a boolean; like the policy's own numbers, it is an error naming the place."""
    pol = _tuned_policy(current_fingerprint())
    edit(pol["tuned"])
    with pytest.raises(omni_accum.PolicyError) as e:
        omni_accum.load_policy(pol)
    assert f"{place}: Input should be a valid" in str(e.value) and f"(got {got})" in str(e.value), str(e.value)
    assert omni_accum.load_policy(_tuned_policy(current_fingerprint())).tuned is not None  # as tune writes it


def test_a_fingerprint_map_with_a_version_of_another_type_is_a_stale_table_not_an_error(monkeypatch):
    """Loaded as before (the table ignored with one warning, the rules and default apply): only a ``plugins`` that is
    not a map is refused."""
    from omni_accum.policy import fingerprint

    monkeypatch.setattr(fingerprint, "_warned", set())
    with pytest.warns(StaleTableWarning, match="plugins: prealloc: table 1"):
        pol = omni_accum.load_policy(_tuned_policy(dict(current_fingerprint(), plugins={"prealloc": 1})))
        assert pol.resolve("embed.decode", omni_accum.StreamContext(context_len=9000)).source == "default"


# -- command line ------------------------------------------------------------------------------- #


def test_cli_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--workload", "qwen3-omni-seed"])
    assert e.value.code == 2
    assert "--out" in capsys.readouterr().err
    assert cli.main(["tune", "--workload", "no-such-workload", "--out", str(tmp_path / "x.yaml")]) == 2  # a usage error, as a bad --base
    err = capsys.readouterr().err
    assert "no-such-workload" in err and "qwen3-omni-seed" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--context-lens", "ten", "--out", str(tmp_path / "x.yaml")])
    assert e.value.code == 2
    if not torch.cuda.is_available():
        assert cli.main(["tune", "--device", "cuda", "--out", str(tmp_path / "x.yaml")]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_cli_checks_output_paths_before_measuring_and_takes_int_lists(tmp_path, capsys):
    assert cli.main(["tune", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert cli.main(["tune", "--out", str(tmp_path / "file" / "x.yaml")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert cli.main(["bench", "--json", str(tmp_path / "file" / "r.json")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    from omni_accum.bench._paths import output_path_problem

    missing = output_path_problem(tmp_path / "new" / "dir" / "x.yaml", "--out")  # never created: named
    assert missing.endswith(f"no such folder: {tmp_path / 'new' / 'dir'} (create it first)")
    assert cli.main(["bench", "--json", str(tmp_path / "nonexist2" / "x.json")]) == 2
    assert f"no such folder: {tmp_path / 'nonexist2'}" in capsys.readouterr().err
    assert not (tmp_path / "new").exists() and not (tmp_path / "nonexist2").exists()
    args = cli.build_parser().parse_args(
        ["tune", "--context-lens", "1000", "8k,32000", "--concurrency", "1", "10", "--out", "x.yaml"]
    )
    assert args.context_lens == [1000, 8000, 32000] and args.concurrency == [1, 10]


def test_decision_prefers_less_memory_among_equivalents_and_ignores_tiny_wins():
    from omni_accum.policy import StrategyChoice
    from omni_accum.tuner.candidates import Candidate
    from omni_accum.tuner.core import BASE, _decide

    noisy = [(i % 7) * 0.1 for i in range(60)]
    base_choice = StrategyChoice("cat", {})
    owner = {
        "prealloc": Candidate("prealloc"),
        "prealloc{growth_factor=1.5}": Candidate("prealloc", {"growth_factor": 1.5}),
    }
    samples = {
        BASE: [100.0 + x for x in noisy],
        "prealloc": [10.0 + x for x in noisy],
        "prealloc{growth_factor=1.5}": [10.3 + x for x in noisy],  # 3 % slower: noise-level
    }
    peak = {"cat": 100, "prealloc": 200, "prealloc{growth_factor=1.5}": 150}
    d = _decide("k", "cat", base_choice, owner, samples, {}, peak)
    assert d.winner == Candidate("prealloc", {"growth_factor": 1.5})  # fewer bytes among equivalents
    assert d.margin > 0.85 and d.ci[0] > 0.8

    samples[BASE] = [5.0 + x for x in noisy]
    samples["prealloc"] = [4.5 + x for x in noisy]  # 10 % and significant, but only 0.5 us per step
    samples["prealloc{growth_factor=1.5}"] = [4.6 + x for x in noisy]
    d = _decide("k", "cat", base_choice, owner, samples, {}, peak)
    assert d.winner == Candidate("cat")
    d = _decide("k", "cat", base_choice, owner, samples, {}, peak, min_gain_us=0.1)
    assert d.winner.strategy == "prealloc"


def test_decision_picks_a_leaner_candidate_only_if_it_passes_every_gate():
    from omni_accum.policy import StrategyChoice
    from omni_accum.tuner.candidates import Candidate
    from omni_accum.tuner.core import BASE, _decide

    owner = {"fast": Candidate("fast"), "lean": Candidate("lean")}
    peak = {"cat": 100, "fast": 200, "lean": 50}
    samples = {BASE: [10.0, 10.01, 9.99] * 8, "fast": [8.9, 8.91, 8.89] * 8, "lean": [9.2, 9.21, 9.19] * 8}
    # lean is within 5 % of fast and holds fewer bytes, but saves only 0.8 us per step: below --min-gain-us
    d = _decide("k", "cat", StrategyChoice("cat"), owner, samples, {}, peak, None, 1.0)
    assert d.winner == Candidate("fast") and d.timings_us["cat"] - d.timings_us["fast"] >= 1.0
    assert d.margin == pytest.approx(0.11, abs=1e-6)  # the margin is the picked candidate's
    d = _decide("k", "cat", StrategyChoice("cat"), owner, samples, {}, peak, None, 0.5)
    assert d.winner == Candidate("lean")  # both pass every gate: the leaner wins
    # lean saves enough microseconds but only 4 % (< 5 %): not picked either
    samples = {BASE: [20.0, 20.01, 19.99] * 8, "fast": [18.9, 18.91, 18.89] * 8, "lean": [19.2, 19.21, 19.19] * 8}
    d = _decide("k", "cat", StrategyChoice("cat"), owner, samples, {}, peak, None, 0.5)
    assert d.winner == Candidate("fast")
    for gate in (1.0, 1.5):  # fast saves 1.1 us: it passes the first, not the second, and lean never
        d = _decide("k", "cat", StrategyChoice("cat"), owner, samples, {}, peak, None, gate)
        saved = d.timings_us["cat"] - d.timings_us.get(d.winner.label, d.timings_us["cat"])
        assert d.winner == Candidate("cat") or (saved >= gate and d.margin > 0.05 and d.ci[0] > 0)
        assert d.winner == (Candidate("fast") if gate == 1.0 else Candidate("cat"))


def _starred(cell) -> bool:
    from omni_accum.tuner.report import decision_table

    table = TunedTable(context_len_edges=[1000], concurrency_edges=[1], cells=[cell])
    row = next(line for line in decision_table(table).splitlines() if line.startswith(">="))
    return " * " in row


@pytest.mark.parametrize(
    ("strategy", "params", "baseline", "changed"),
    [
        ("prealloc", {"growth_factor": 4.0}, "prealloc{growth_factor=4.0}", False),  # a kept baseline with params
        ("prealloc", {"growth_factor": 4.0}, "prealloc{growth_factor=4}", False),  # written 4 in the base policy
        ("prealloc", {}, "prealloc{growth_factor=2.0}", False),  # an explicit default is no change
        ("prealloc", {"growth_factor": 1.5}, "prealloc{growth_factor=4.0}", True),
        ("prealloc", {"growth_factor": 4.0}, "cat", True),
        ("cat", {}, "cat", False),
        ("token_list", {}, "cat", True),
    ],
)
def test_decision_table_stars_only_cells_that_leave_the_baseline(strategy, params, baseline, changed):
    from omni_accum.policy import TunedCell

    cell = TunedCell(
        key="k", context_len=1000, concurrency=1, strategy=strategy, params=params, baseline=baseline,
        timings_us={baseline: 10.0},
    )  # fmt: skip
    assert _starred(cell) is changed


def test_a_grid_candidate_equal_to_the_baseline_is_not_timed_twice(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("version: 1\ndefault: {strategy: prealloc, params: {growth_factor: 4}}\n")
    wl = dict(TINY, keys=[TINY["keys"][0]])
    res = tune(_opts(tmp_path, workload=wl, base=str(base), context_lens=[64], concurrency=[1], max_rounds=1))
    cell = res.policy.tuned.cells[0]
    assert cell.baseline == "prealloc{growth_factor=4}"
    timed = set(cell.timings_us) | set(cell.excluded)
    assert "prealloc{growth_factor=1.5}" in timed and "prealloc{growth_factor=4.0}" not in timed


def test_cli_tune_end_to_end_and_a_missing_folder_is_an_error(tmp_path, capsys):
    import yaml

    wl = tmp_path / "tiny.yaml"
    wl.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "new" / "folder" / "tuned.yaml"
    rc = cli.main(
        [
            "tune",
            "--workload",
            str(wl),
            "--context-lens",
            "64",
            "--concurrency",
            "1",
            "--no-verify",
            "--decode-steps",
            "4",
            "--out",
            str(out),
        ]
    )
    assert rc == 2 and not (tmp_path / "new").exists()  # a missing folder is an error, never created
    err = capsys.readouterr().err
    assert str(tmp_path / "new") in err and "Traceback" not in err
    (tmp_path / "new" / "folder").mkdir(parents=True)
    rc = cli.main(["tune", "--workload", str(wl), "--context-lens", "64", "--concurrency", "1", "--no-verify",
                   "--decode-steps", "4", "--out", str(out)])
    assert rc == 0 and out.is_file()
    printed = capsys.readouterr().out
    assert "embed.decode" in printed and f"wrote {out}" in printed
    assert cli.main(["validate", str(out)]) == 0


def test_show_names_the_cells_that_never_apply():
    """A cell whose key an explicit rule or the protocol decides first is listed as never applying."""
    from omni_accum.tuner.report import show

    data = _tuned_policy(current_fingerprint())
    data["tuned"]["cells"].append({"key": "meta.finished", "context_len": 8000, "concurrency": 1, "strategy": "cat"})
    shown = show(omni_accum.load_policy(data), "p.yaml")
    assert "never applies: embed.pinned: decided by rules[0] (match 'embed.pinned'), before the table" in shown
    assert "never applies: meta.finished: decided by the protocol (vllm-omni always replaces it)" in shown
    assert "never applies: embed.decode" not in shown


def test_a_protocol_key_is_not_tuned():
    from omni_accum.bench.workloads import build_workload
    from omni_accum.tuner.core import tunable_keys

    keys, skipped = tunable_keys(build_workload(TINY), omni_accum.load_policy("default: cat"), [64])
    assert "meta.finished" not in keys and "protocol key" in skipped["meta.finished"]
    assert "embed.decode" in keys


def test_a_gain_within_the_noise_keeps_the_baseline_and_says_why():
    """`finished cat +8.1% [+0.7%, +19.2%]`: a win whose interval reaches below 5 % is noise, not a switch (it
    flipped between runs); the kept baseline says why, in the cell and under the decision table."""
    from omni_accum.policy import StrategyChoice
    from omni_accum.tuner.candidates import Candidate
    from omni_accum.tuner.core import BASE, BucketOutcome, _decide
    from omni_accum.tuner.report import decision_table

    base = [100.0 + 40.0 * ((i * 7) % 13) / 13 for i in range(40)]
    cand = [0.91 * x + (6.0 if i % 3 else -6.0) for i, x in enumerate(base)]
    g = bootstrap_gain(base, cand)
    assert g.gain > 0.05 and 0.0 < g.low < 0.05, g  # what the old gate took as a significant win
    owner = {"send_once": Candidate("send_once")}
    d = _decide("flag", "cat", StrategyChoice("cat"), owner, {BASE: base, "send_once": cand}, {}, {}, None, 1.0)
    assert d.winner == Candidate("cat")
    assert d.reason.startswith("send_once: ") and "within the noise" in d.reason
    cells = BucketOutcome(1000, 1, decisions={"flag": d}).cells()
    assert cells[0].reason == d.reason
    text = decision_table(TunedTable(context_len_edges=[1000], concurrency_edges=[1], cells=cells))
    assert "why:" in text and ">=1000 x >=1 flag: kept the baseline: send_once: " in text
    # interval crossing 0, and a clear win that saves under --min-gain-us: each kept with its own reason
    d = _decide("flag", "cat", StrategyChoice("cat"), owner, {BASE: base, "send_once": base[::-1]}, {}, {}, None, 1.0)
    assert d.winner == Candidate("cat") and "crosses 0" in d.reason
    tiny = {BASE: [2.0, 2.01, 1.99] * 8, "send_once": [1.5, 1.51, 1.49] * 8}
    d = _decide("flag", "cat", StrategyChoice("cat"), owner, tiny, {}, {}, None, 1.0)
    assert d.winner == Candidate("cat") and "--min-gain-us 1" in d.reason
    d = _decide("flag", "cat", StrategyChoice("cat"), owner, tiny, {}, {}, None, 0.1)
    assert d.winner == Candidate("send_once") and d.reason is None


def test_a_baseline_that_raises_on_a_flag_is_left_for_replace():
    """A 0-d flag key under cat (the default baseline) is refused, so the tuner picks a correct replace-kind
    candidate and says why instead of failing (vllm-omni 0.30.0's own flags are protocol keys, always replaced:
    this one is not)."""
    from omni_accum.bench.workloads import load_workload
    from omni_accum.policy import load_policy
    from omni_accum.tuner.core import all_candidates, tune_bucket

    base = load_workload("qwen3-omni-0.30")
    keys = [k.model_copy(update={"path": "meta.other_flag"}) if k.path == "meta.is_segment_finished" else k
            for k in base.keys]  # fmt: skip
    wl = base.model_copy(update={"decode_steps": 4, "keys": keys})
    key = "meta.other_flag"
    # the built-in strategies only: a third-party one installed beside them (the example `delta`, which the
    # suite installs) can be correct on a flag and time as fast, and the pick among equals is then the clock's
    builtin = ("cat", "token_list", "prealloc", "replace", "send_once")
    cands = {k: [c for c in v if c.strategy in builtin] for k, v in all_candidates(wl, [key], grid=False).items()}
    out = tune_bucket(
        wl, load_policy("default"), [key], cands,
        context_len=16, concurrency=1, wire="inproc", max_rounds=1, memory_factor=2.0,
    )  # fmt: skip
    d = out.decisions[key]
    assert d.winner.strategy in ("replace", "send_once") and d.reason.startswith("baseline left: it raised")
    assert "0-d" in d.reason and d.excluded["cat"].startswith("baseline kept out")


def test_the_0_30_flags_are_protocol_keys_not_tuned():
    """meta.is_segment_finished (a 0-d bool tensor in every 0.30.0 chunk) is replaced whatever the policy says by
    default; the tuner lists it as skipped (the protocol decides it)."""
    import torch

    from omni_accum.bench.workloads import load_workload
    from omni_accum.policy import load_policy
    from omni_accum.tuner.core import tunable_keys

    for name in ("default", "qwen3-omni"):
        assert load_policy(name).resolve("meta.is_segment_finished").strategy == "replace"
    rx = omni_accum.Receiver("default")
    for flag in (False, True):
        view = rx.merge("r", {"meta": {"is_segment_finished": torch.tensor(flag)}})
        assert view["meta"]["is_segment_finished"].item() is flag
    keys, skipped = tunable_keys(load_workload("qwen3-omni-0.30"), load_policy("default"), [8000])
    assert "meta.is_segment_finished" not in keys and "meta.is_segment_finished" in skipped


def test_every_keys_first_round_is_timed_warm(tmp_path, monkeypatch):
    """Cold, a bucket's first arm (the baseline, first in round 0) faults fresh pages: a null test (every candidate
    the baseline itself) read +94 % for the candidate and the clear-win stop ended the key on that round. Round 0
    of every key replays each arm once untimed first; later rounds do not."""
    calls = []
    real = tuner_core.measure

    def spy(wl, arms, **kw):
        calls.append((tuple(arms), kw.get("warmup", False), kw.get("check")))
        return real(wl, arms, **kw)

    monkeypatch.setattr(tuner_core, "measure", spy)
    tune(_opts(tmp_path, context_lens=[64], concurrency=[1], max_rounds=2))
    decisions = [c for c in calls if c[2] is not None and not {"reference", "tuned"} <= set(c[0])]
    firsts = [c for c in decisions if c[2]]  # check=True: a key's round 0
    assert firsts and all(warm for _, warm, _ in firsts), calls
    assert all(not warm for _, warm, check in decisions if not check), calls


def test_a_leaner_candidate_twice_as_slow_is_not_picked_at_two_rounds():
    """Among candidates that beat the baseline the leanest of the equivalent ones wins; 'equivalent' must not come
    from the rounds' t, which at 2 rounds (--quick, or an arm successive halving dropped) is 12.7 wide: a candidate
    1.85x and 2.15x the fastest's time in its two rounds was picked for holding fewer bytes."""
    from omni_accum.policy import StrategyChoice
    from omni_accum.tuner.candidates import Candidate
    from omni_accum.tuner.core import BASE, _decide

    noise = [(i % 7) * 0.01 for i in range(60)]
    rounds_of = {
        BASE: [[100.0 + x for x in noise], [101.0 + x for x in noise]],
        "fast": [[10.0 + x for x in noise], [10.0 + x for x in noise]],
        "lean": [[18.5 + x for x in noise], [21.5 + x for x in noise]],
    }
    samples = {lab: [x for r in rounds for x in r] for lab, rounds in rounds_of.items()}
    owner = {"fast": Candidate("fast"), "lean": Candidate("lean")}
    peak = {"cat": 100, "fast": 200, "lean": 50}
    d = _decide("k", "cat", StrategyChoice("cat"), owner, samples, {}, peak, None, 1.0, rounds_of)
    assert d.winner == Candidate("fast"), d
