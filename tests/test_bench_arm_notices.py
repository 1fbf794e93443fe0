"""``omni-accum bench`` says when a policy arm decides none of the workload's keys (issue 32, item 9)."""

from __future__ import annotations

import io

import yaml

from omni_accum.bench.arms import build_arms
from omni_accum.bench.workloads import load_workload
from omni_accum.cli import main

SMALL = ["--context-lens", "16", "--concurrency", "1", "--steps", "2", "--repeats", "1", "--no-progress"]


def test_a_policy_arm_that_matches_no_key_is_named_on_stderr(capsys, tmp_path):
    """A policy whose rules name only 0.30.0's nested keys (``embed.*``, ``meta.*``) on the seed workload's flat
    keys: every key gets its default, and bench says so; the flat preset, whose rules match, gets no such note."""
    nested = tmp_path / "nested-only.yaml"
    nested.write_text(yaml.safe_dump({"default": "cat", "rules": [
        {"match": "embed.*", "strategy": "prealloc"}, {"match": "meta.*", "strategy": "replace"}]}))  # fmt: skip
    rc = main(["bench", "--workload", "qwen3-omni-seed", "--arms", str(nested), "qwen3-omni-flat", *SMALL])
    err = capsys.readouterr().err
    assert rc == 0
    notes = [line for line in err.splitlines() if "matches a key of workload" in line]
    assert len(notes) == 1, err
    assert notes[0].startswith(f"note: arm '{nested}': ") and "'qwen3-omni-seed'" in notes[0]
    assert "thinker_embeddings" in notes[0] and "default 'cat'" in notes[0]


def test_tuned_cells_count_as_a_match(tmp_path):
    """A policy whose only link to the workload is a tuned cell (no rules) is not reported; one whose cells
    name other keys is."""
    wl = load_workload("qwen3-omni-seed")

    def policy_file(key: str) -> str:
        doc = {
            "default": "cat",
            "tuned": {
                "context_len_edges": [0],
                "concurrency_edges": [1],
                "cells": [{"key": key, "context_len": 0, "concurrency": 1, "strategy": "prealloc"}],
            },
        }
        path = tmp_path / f"{key}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return str(path)

    hit, miss = policy_file("thinker_embeddings"), policy_file("embed.prefill")
    warn = io.StringIO()
    build_arms(wl, [hit, miss], warn=warn)
    lines = [line for line in warn.getvalue().splitlines() if "matches a key" in line]
    assert lines == [lines[0]] and lines[0].startswith(f"note: arm {miss!r}: "), warn.getvalue()


def test_an_arm_given_twice_is_measured_once_with_a_note_and_an_empty_item_is_refused(capsys):
    """`--arms cat cat` became one arm without a word, and `--arms upstream,,cat` dropped the empty item where
    `--context-lens 1k,,8k` is refused."""
    rc = main(["bench", "--workload", "qwen3-omni-seed", "--arms", "cat", "prealloc,cat", *SMALL])
    out, err = capsys.readouterr()
    assert rc == 0
    assert err.count("note: arm 'cat' given more than once: measured once") == 1, err
    assert [line.split()[0] for line in out.splitlines() if line.startswith(("cat ", "prealloc "))] == ["cat", "prealloc"]
    assert list(build_arms(load_workload("qwen3-omni-seed"), ["cat", "cat"], warn=io.StringIO())) == ["cat"]
    for given in ("upstream,,cat", "cat,"):
        try:
            rc = main(["bench", "--workload", "qwen3-omni-seed", "--arms", given, *SMALL])
        except SystemExit as e:
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and f"--arms: expected names such as a,b, got {given!r} (an empty item between commas)" in err
