"""The policy audit (out/audit-policy.md), findings 1, 10, 11 and 12: ``validate`` and ``doctor`` check every arm
of an A/B split; a tuned cell giving ``meta.override_keys`` a wire-rewriting strategy is refused; ``explain`` on a
stale table prints no Python warning and says the table is not used; every bad tuned cell is listed at its line."""

from __future__ import annotations

import json
import warnings

import pytest
import yaml

import omni_accum
from omni_accum import cli
from omni_accum.errors import PolicyError
from omni_accum.policy import fingerprint
from omni_accum.policy.environment import current_fingerprint
from omni_accum.policy.fingerprint import StaleTableWarning


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def _table(fp: dict, cells: list[dict], **extra) -> dict:
    return {"context_len_edges": [1000, 8000], "concurrency_edges": [1, 4], "fingerprint": fp, "cells": cells, **extra}


def _cell(key: str, strategy: str, context_len: int = 1000, concurrency: int = 1) -> dict:
    return {"key": key, "context_len": context_len, "concurrency": concurrency, "strategy": strategy}


def _write(path, data) -> str:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return str(path)


def _split(tmp_path, treatment: str = "arm.yaml") -> str:
    text = f"ab:\n  arms:\n    control: {{policy: default}}\n    treatment: {{policy: {treatment}}}\n"
    return _write(tmp_path / "ab.yaml", text)


BAD_ARM = """\
default: cat
rules:
  - {match: meta.override_keys, strategy: delta}
  - {match: "embed.*", strategy: prealloc}
  - {match: "embed.tts_*", strategy: send_once}
"""


# -- 1. every arm of an A/B split ----------------------------------------------------------------------------- #


def test_validate_refuses_a_split_whose_second_arm_a_sender_would_refuse(tmp_path, capsys):
    pytest.importorskip("omni_accum_delta", reason="the example plugin (scripts/env.sh installs it)")
    _write(tmp_path / "arm.yaml", BAD_ARM)
    split = _split(tmp_path)
    code, out, _ = _run(capsys, "validate", split)
    assert code == 1 and "1 error(s)" in out, out
    assert f"{split}, line 4: ab.arms.treatment.policy: arm.yaml: meta.override_keys gets strategy 'delta'" in out
    # the arm's shadowed glob: a warning, at the arm's line in the split and the rule's line in the arm's file
    assert (f"warning: {split}, line 4: ab.arms.treatment.policy: arm.yaml, line 5: rules[2].match: 'embed.tts_*' "
            "is covered by the earlier glob") in out  # fmt: skip


def test_validate_refuses_a_stale_arm_unless_allow_stale(tmp_path, capsys):
    fp = dict(current_fingerprint(), torch="2.11.0")
    _write(tmp_path / "arm.yaml", {"default": "cat", "tuned": _table(fp, [_cell("embed.decode", "prealloc")])})
    split = _split(tmp_path)
    code, out, _ = _run(capsys, "validate", split)
    assert code == 1 and "ab.arms.treatment.policy: arm.yaml, line " in out and "stale tuned table" in out, out
    assert "torch: table 2.11.0" in out
    code, out, _ = _run(capsys, "validate", "--allow-stale", split)
    assert code == 0 and f"{split}: ok" in out and "warning: " in out and "ab.arms.treatment.policy" in out, out
    code, out, _ = _run(capsys, "validate", "--json", split)
    (rec,) = json.loads(out)["policies"]
    first = rec["errors"][0]
    assert rec["valid"] is False and (first["loc"], first["line"]) == ("ab.arms.treatment.policy", 4)


def test_validate_warns_about_a_partial_arm(tmp_path, capsys):
    table = _table(current_fingerprint(), [_cell("embed.decode", "prealloc")], complete=False)
    _write(tmp_path / "arm.yaml", {"default": "cat", "tuned": table})
    split = _split(tmp_path)
    code, out, _ = _run(capsys, "validate", split)
    assert code == 0 and f"{split}: ok" in out, out
    assert "warning: " in out and "ab.arms.treatment.policy: arm.yaml" in out and "partial tuned table" in out


def test_doctor_checks_every_arm_of_a_split(tmp_path, capsys, monkeypatch, vllm_omni):
    pytest.importorskip("omni_accum_delta", reason="the example plugin (scripts/env.sh installs it)")
    fp = dict(current_fingerprint(), torch="2.11.0")
    _write(tmp_path / "arm.yaml", BAD_ARM)
    _write(tmp_path / "stale.yaml", {"default": "cat", "tuned": _table(fp, [_cell("embed.decode", "prealloc")])})
    for arm, said in (("arm.yaml", "meta.override_keys gets strategy 'delta'"), ("stale.yaml", "stale tuned table")):
        monkeypatch.setenv("OMNI_ACCUM_POLICY", _split(tmp_path, arm))
        code, out, _ = _run(capsys, "doctor")
        problems = [ln for ln in out.splitlines() if ln.startswith("PROBLEM") and "ab.arms.treatment.policy" in ln]
        assert code != 0 and problems and said in problems[0] and arm in problems[0], out


# -- 10. a tuned cell for meta.override_keys ----------------------------------------------------------------- #


def test_a_tuned_cell_giving_override_keys_a_rewriting_strategy_is_refused(tmp_path, capsys):
    pytest.importorskip("omni_accum_delta", reason="the example plugin (scripts/env.sh installs it)")
    cells = [_cell("embed.decode", "prealloc"), _cell("meta.override_keys", "delta", 8000, 4)]
    path = _write(tmp_path / "t.yaml", {"default": "cat", "tuned": _table(current_fingerprint(), cells)})
    code, out, _ = _run(capsys, "validate", path)
    line = next(n for n, t in enumerate(open(path).read().splitlines(), 1) if "strategy: delta" in t)
    said = f"{path}, line {line}: tuned.cells[1].strategy: meta.override_keys gets strategy 'delta'"
    assert code == 1 and said in out, out
    assert "context_len>=8000, concurrency>=4" in out, out
    for cls in (omni_accum.Sender, omni_accum.Receiver):  # refused when built, not at the first chunk listing keys
        with pytest.raises(PolicyError, match=r"tuned.cells\[1\].*rewrites the key's wire form"):
            cls(path)
    # a rule for the key beats the cell; honor_override_keys: false reads no list from the wire
    for extra in ({"rules": [{"match": "meta.override_keys", "strategy": "replace"}]}, {"honor_override_keys": False}):
        ok = _write(tmp_path / "ok.yaml", {"default": "cat", **extra, "tuned": _table(current_fingerprint(), cells)})
        assert _run(capsys, "validate", ok)[0] == 0
        omni_accum.Sender(ok)
    # a stale table's cells are never used at run time: such a cell does not refuse the policy (the server would
    # bind nothing for a table it ignores); validate still says the table is stale
    fp = {**current_fingerprint(), "torch": "0.0.1"}
    stale = _write(tmp_path / "stale.yaml", {"default": "cat", "tuned": _table(fp, cells)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        omni_accum.Sender(stale)
        omni_accum.Receiver(stale)
    code, out, _ = _run(capsys, "validate", stale)
    assert code == 1 and "stale" in out, out


# -- 11. explain on a stale table ---------------------------------------------------------------------------- #


def test_explain_on_a_stale_table_prints_no_python_warning_and_says_it_is_not_used(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(fingerprint, "_warned", set())  # the warning is once per process: make this the first
    fp = dict(current_fingerprint(), torch="2.11.0")
    data = {"rules": [{"match": "meta.finished", "strategy": "replace"}],
            "tuned": _table(fp, [_cell("embed.decode", "prealloc")])}  # fmt: skip
    path = _write(tmp_path / "stale.yaml", data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, out, err = _run(capsys, "explain", path, "--key", "meta.finished")
        assert code == 0 and "tuned table not used" in out
        code, out, _ = _run(capsys, "explain", path, "--key", "embed.decode", "--context-len", "2000")
    assert not [w for w in caught if issubclass(w.category, StaleTableWarning)]
    assert "StaleTableWarning" not in err
    assert code == 0 and "key 'embed.decode' -> cat" in out
    why = next(ln for ln in out.splitlines() if "why:" in ln)
    assert "no tuned cell" not in why and "tuned table not used: measured in another environment" in why, why
    code, out, _ = _run(capsys, "explain", path, "--key", "embed.decode", "--json")
    assert json.loads(out)["reason"] == {"kind": "default", "tuned_table": "stale"}


# -- 12. every bad tuned cell, at its own line ---------------------------------------------------------------- #

BAD_CELLS = """\
default: cat
tuned:
  context_len_edges: [1000, 8000]
  concurrency_edges: [1, 4]
  cells:
    - {key: embed.decode, context_len: 4000, concurrency: 1, strategy: prealloc}
    - {key: embed.decode, context_len: 8000, concurrency: 4, strategy: prealoc}
    - {key: embed.decode, context_len: 8000, concurrency: 4, strategy: cat}
    - {key: embed.prefill, context_len: 1000, concurrency: 3, strategy: cat}
"""


def test_validate_lists_every_bad_tuned_cell_at_its_own_line(tmp_path, capsys):
    path = _write(tmp_path / "bad.yaml", BAD_CELLS)
    code, out, _ = _run(capsys, "validate", path)
    assert code == 1 and "4 error(s)" in out, out
    assert f"{path}, line 6: tuned.cells[0].context_len: context_len 4000 is not one of context_len_edges" in out
    assert f"{path}, line 7: tuned.cells[1].strategy: unknown strategy 'prealoc'" in out
    assert f"{path}, line 8: tuned.cells[2]: cells[2] repeats cells[1] (key 'embed.decode'" in out
    assert f"{path}, line 9: tuned.cells[3].concurrency: concurrency 3 is not one of concurrency_edges [1, 4]" in out
    with pytest.raises(PolicyError) as e:  # the library lists them all too
        omni_accum.load_policy(yaml.safe_load(BAD_CELLS))
    assert len(e.value.errors) == 4
