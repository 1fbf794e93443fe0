"""explain and show: a context length past bench's bound is refused, an invalid policy under --json still prints JSON,
and explain says which tuned bucket it used when no --context-len was given."""

from __future__ import annotations

import json

import pytest

from omni_accum.cli import main

BROKEN = "default: catt\nrules:\n  - match: x\n    strategy: prealloc\n    params: {growth: 2}\n"


def test_a_context_len_past_benchs_bound_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["explain", "qwen3-omni", "--key", "embed.decode", "--context-len", "99999999999999999999999"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--context-len: 99999999999999999999999 is over 1000000 (1000k)" in err


def test_explain_and_show_json_on_an_invalid_policy_print_its_errors_on_stdout(tmp_path, capsys):
    p = tmp_path / "broken.yaml"
    p.write_text(BROKEN)
    for argv in (["explain", str(p), "--key", "x", "--json"], ["show", str(p), "--json"]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        doc = json.loads(out)
        assert doc["valid"] is False and doc["policy"] == str(p)
        found = [(e["loc"], e["line"]) for e in doc["errors"]]
        assert found == [("default.strategy", 1), ("rules[0].params.growth", 5)]
        assert "invalid policy" in err


def test_explain_says_which_tuned_bucket_it_used_without_a_context_len(tmp_path, capsys):
    from omni_accum.policy import load_policy
    from omni_accum.policy.environment import current_fingerprint
    from omni_accum.policy.loader import dump_policy

    policy = load_policy({"tuned": {"context_len_edges": [1000, 8000], "concurrency_edges": [1],
                                    "fingerprint": current_fingerprint("cpu"),
                                    "cells": [{"key": "embed.decode", "context_len": 1000, "concurrency": 1,
                                               "strategy": "token_list", "baseline": "cat"}]}})  # fmt: skip
    path = tmp_path / "t.yaml"
    path.write_text(dump_policy(policy))
    assert main(["explain", str(path), "--key", "embed.decode"]) == 0
    out = capsys.readouterr().out
    assert "-> token_list" in out
    assert "no --context-len given: the table's first context bucket (context_len>=1000) is used" in out


def test_an_invalid_input_named_on_the_command_line_is_a_usage_error_in_bench_and_tune(tmp_path, capsys):
    """An invalid workload file exited 1 while an unknown workload name exited 2; an arm's invalid policy file 1."""
    bad = tmp_path / "w.yaml"
    bad.write_text("name: w\nkeys:\n  - {path: x, kind: sideways}\n")
    pol = tmp_path / "p.yaml"
    pol.write_text(BROKEN)
    for argv in (["bench", "--workload", str(bad)], ["tune", "--workload", str(bad), "--out", str(tmp_path / "t.yaml")],
                 ["bench", "--arms", str(pol)]):  # fmt: skip
        assert main([*argv, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"omni-accum {argv[0]}: error: ") and "Traceback" not in err


def test_an_empty_path_is_named_as_empty_not_as_the_current_folder(capsys):
    """``--json ''`` and ``--out ''`` said "--json .: is a directory", ``ab --metrics ''`` ": is a directory", and
    ``tune --show ''`` "--out FILE is required (or --show POLICY)"."""
    cases = (
        (["bench", "--json", ""], "--json '': an empty path"),
        (["tune", "--out", "", "--quick"], "argument --out: '': an empty path"),
        (["tune", "--out", "  ", "--quick"], "argument --out: '  ': a blank path"),
        (["tune", "--show", ""], "an empty policy argument"),
        (["ab", "--metrics", ""], "an empty --metrics"),
    )
    for argv, said in cases:
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's own usage error
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and said in err and "Traceback" not in err and "is a directory" not in err, (argv, err)


def test_explain_of_an_ab_split_names_the_arm_and_its_rule(tmp_path, capsys):
    """An A/B split was explained as the split: the first arm's strategy with "why: the policy's default (no rule
    matches, no tuned table)", though the arm's rule decided it, and nothing said it was a split or which arm."""
    p = tmp_path / "ab.yaml"
    p.write_text("ab:\n  arms:\n    treatment: {policy: qwen3-omni}\n    control: {policy: default}\n")
    assert main(["explain", str(p), "--key", "embed.prefill"]) == 0
    out = capsys.readouterr().out
    assert "-> prealloc" in out and "why: arm 'treatment': rules[0] exact match 'embed.prefill'" in out
    assert "A/B split (arms treatment, control)" in out
    assert main(["explain", str(p), "--key", "embed.prefill", "--arm", "control", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["strategy"], d["arm"], d["arms"], d["reason"]["kind"]) == ("cat", "control", ["treatment", "control"], "default")
    assert d["source"].startswith("ab arm 'control': ")
    assert main(["explain", str(p), "--key", "embed.prefill", "--arm", "contrl"]) == 2
    assert "--arm 'contrl': the split has no such arm (arms: treatment, control)" in capsys.readouterr().err
    assert main(["explain", "qwen3-omni", "--key", "embed.prefill", "--arm", "control"]) == 2
    assert "the policy has no ab section" in capsys.readouterr().err


def test_show_of_an_ab_split_with_an_arm_file_beside_it_loads_from_another_folder(tmp_path, capsys, monkeypatch):
    """`show sub/ab.yaml > other/s.yaml` kept the arm's `policy: b.yaml` relative, read from the split's folder: the
    saved output did not load ("does not load ... looked for in the split's folder other"), though `show` says its
    output is itself a valid policy. The arm file is an absolute path now; a preset stays a name."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("default: prealloc\n")
    (tmp_path / "sub" / "ab.yaml").write_text("ab:\n  arms:\n    t: {policy: b.yaml}\n    c: {policy: default}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["show", "sub/ab.yaml"]) == 0
    shown = capsys.readouterr().out
    (tmp_path / "other" / "s.yaml").write_text(shown)
    assert main(["validate", "other/s.yaml"]) == 0, capsys.readouterr()
    capsys.readouterr()
    assert main(["show", "sub/ab.yaml", "--json"]) == 0
    arms = json.loads(capsys.readouterr().out)["ab"]["arms"]
    assert (arms["t"]["policy"], arms["c"]["policy"]) == (str(tmp_path / "sub" / "b.yaml"), "default")


def test_show_keeps_an_arm_named_as_a_preset_and_leaves_dot_dot_to_the_kernel(tmp_path, capsys, monkeypatch):
    """An arm `policy: qwen3-omni` beside a file named `qwen3-omni` is the preset (a name without a policy suffix
    is read as a preset first): show wrote the file's absolute path, which did not load. An arm `../b.yaml` of a
    split in a linked folder is the file beside the link's target: show wrote the one beside the link."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen3-omni").write_text("default: prealloc\n")
    (tmp_path / "split.yaml").write_text("ab:\n  arms:\n    a: {policy: default}\n    b: {policy: qwen3-omni}\n")
    assert main(["show", "split.yaml", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ab"]["arms"]["b"]["policy"] == "qwen3-omni"
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "real" / "b.yaml").write_text("default: cat\n")  # what the split reads
    (tmp_path / "b.yaml").write_text("default: prealloc\n")  # beside the link, by the path's text
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    (tmp_path / "real" / "sub" / "split.yaml").write_text("ab:\n  arms:\n    a: {policy: default}\n    b: {policy: ../b.yaml}\n")
    assert main(["show", "link/split.yaml", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["ab"]["arms"]["b"]["policy"]
    from omni_accum.policy import load_policy

    assert load_policy(shown).default.strategy == "cat"
