"""Tuned tables: ``validate`` refuses a stale one (``--allow-stale`` warns), and the fingerprint only
depends on the strategies the table names."""

from __future__ import annotations

import json
import warnings

import yaml

import omni_accum
from omni_accum import cli
from omni_accum.policy.environment import current_fingerprint, installed_plugins
from omni_accum.policy.fingerprint import fingerprint_mismatches


def _tuned(fp: dict, strategy: str = "prealloc", timings: dict | None = None) -> dict:
    return {
        "default": "cat",
        "tuned": {
            "context_len_edges": [1000],
            "concurrency_edges": [1],
            "fingerprint": fp,
            "cells": [
                {
                    "key": "embed.decode",
                    "context_len": 1000,
                    "concurrency": 1,
                    "strategy": strategy,
                    "timings_us": timings or {"cat": 10.0, strategy: 5.0},
                }
            ],
        },
    }


def _write(tmp_path, data, name="tuned.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(p)


# -- validate ------------------------------------------------------------------------------------- #


def test_validate_refuses_a_stale_table_naming_only_what_differs(tmp_path, capsys):
    fp = dict(current_fingerprint(), torch="2.11.0")
    path = _write(tmp_path, _tuned(fp))
    assert cli.main(["validate", path]) == 1
    out, err = capsys.readouterr()
    text = out + err
    here = current_fingerprint()["torch"]
    assert "stale" in text and f"torch: table 2.11.0, here {here}" in text
    assert "device" not in text and "omni_accum:" not in text and "plugins" not in text
    assert ": ok" not in out


def test_allow_stale_downgrades_it_to_a_warning(tmp_path, capsys):
    fp = dict(current_fingerprint(), torch="2.11.0")
    path = _write(tmp_path, _tuned(fp))
    assert cli.main(["validate", "--allow-stale", path]) == 0
    out, err = capsys.readouterr()
    assert f"{path}: ok" in out and "warning" in (out + err) and "stale" in (out + err) and "torch" in (out + err)


def test_validate_json_reports_staleness(tmp_path, capsys):
    fp = dict(current_fingerprint(), torch="2.11.0")
    path = _write(tmp_path, _tuned(fp))
    assert cli.main(["validate", "--json", path]) == 1
    data = json.loads(capsys.readouterr().out)
    (rec,) = data["policies"]
    assert rec["valid"] is False and any("stale" in e["msg"] and "torch" in e["msg"] for e in rec["errors"])


def test_a_matching_table_validates(tmp_path, capsys):
    path = _write(tmp_path, _tuned(current_fingerprint()))
    assert cli.main(["validate", path]) == 0
    assert f"{path}: ok" in capsys.readouterr().out


# -- fingerprint scope ---------------------------------------------------------------------------- #


def test_an_unused_plugin_installed_later_keeps_the_table_valid():
    plugins = installed_plugins()
    fp = current_fingerprint()
    more = {**plugins, "zzz_unused": "omni-accum-zzz==1.0"}
    table = omni_accum.load_policy(_tuned(fp)).tuned
    assert fingerprint_mismatches(fp, plugins=more, strategies=table.strategy_names()) == []


def test_an_unused_plugin_removed_keeps_the_table_valid():
    """An old table recorded every installed plugin; only the ones it names count."""
    fp = dict(current_fingerprint())
    fp["plugins"] = {**fp["plugins"], "gone": "omni-accum-gone==0.1"}
    pol = omni_accum.load_policy(_tuned(fp))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pol.tuned_usable()


def test_a_named_strategys_version_change_still_makes_it_stale():
    fp = dict(current_fingerprint())
    fp["plugins"] = {**fp["plugins"], "prealloc": "omni-accum==0.0.1"}
    pol = omni_accum.load_policy(_tuned(fp))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert not pol.tuned_usable()


def test_a_candidate_the_table_records_counts_too():
    """A strategy that lost (only in timings) decided the winner as much as the winner did."""
    fp = dict(current_fingerprint())
    fp["plugins"] = {**fp["plugins"], "token_list": "omni-accum==0.0.1"}
    table = omni_accum.load_policy(
        _tuned(fp, timings={"cat": 9.0, "token_list": 8.0, "prealloc{growth_factor=4.0}": 5.0})
    ).tuned
    assert "token_list" in table.strategy_names() and "prealloc" in table.strategy_names()
    diffs = fingerprint_mismatches(fp, plugins=installed_plugins(), strategies=table.strategy_names())
    assert diffs and "token_list" in diffs[0] and "prealloc" not in diffs[0]
