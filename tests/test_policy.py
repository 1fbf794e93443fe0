"""Policy schema and resolution: exact beats glob, first glob wins, protocol keys, tuned buckets, default."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

import omni_accum
from omni_accum.context import StreamContext
from omni_accum.policy import Policy, Rule, StrategyRef, TunedTable, is_glob


def test_defaults_are_upstream_cat():
    p = Policy()
    assert p.version == 1
    assert p.default == StrategyRef(strategy="cat")
    assert p.rules == [] and p.tuned is None and p.max_bytes_per_request == 0 and p.honor_override_keys


def test_default_accepts_a_name_or_a_mapping():
    assert Policy.model_validate({"default": "prealloc"}).default.strategy == "prealloc"
    d = Policy.model_validate({"default": {"strategy": "prealloc", "params": {"growth_factor": 1.5}}}).default
    assert d.strategy == "prealloc" and d.params == {"growth_factor": 1.5}


@pytest.mark.parametrize(
    "data",
    [
        {"bogus": 1},
        {"rules": [{"match": "a", "strategy": "cat", "param": {}}]},
        {"default": {"strategy": "cat", "extra": 1}},
        {"tuned": {"context_len_edges": [0], "concurrency_edges": [1], "cels": []}},
    ],
)
def test_extra_fields_are_forbidden_everywhere(data):
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        Policy.model_validate(data)


@pytest.mark.parametrize(
    "data",
    [
        {"version": 2},
        {"version": True},
        {"max_bytes_per_request": -1},
        {"max_bytes_per_request": True},
        {"max_bytes_per_request": "10"},
        {"max_bytes_per_request": 1.5},
        {"honor_override_keys": "yes"},
        {"rules": [{"match": "", "strategy": "cat"}]},
        {"rules": [{"match": "a", "strategy": ""}]},
        {"rules": [{"match": "a"}]},
        {"rules": "embed.*"},
        {"default": 3},
    ],
)
def test_invalid_values_are_rejected(data):
    with pytest.raises(ValidationError):
        Policy.model_validate(data)


def test_models_are_frozen():
    p = Policy()
    with pytest.raises(ValidationError):
        p.default = StrategyRef(strategy="prealloc")  # type: ignore[misc]
    with pytest.raises(ValidationError):
        Rule(match="a", strategy="cat").strategy = "x"  # type: ignore[misc]


def test_repeated_exact_match_is_an_error_naming_both_rules():
    with pytest.raises(ValidationError, match=r"rules\[2\]\.match 'a' repeats rules\[0\]\.match"):
        Policy.model_validate(
            {
                "rules": [
                    {"match": "a", "strategy": "cat"},
                    {"match": "b*", "strategy": "cat"},
                    {"match": "a", "strategy": "replace"},
                ]
            }
        )


@pytest.mark.parametrize(
    "pattern,glob",
    [("embed.*", True), ("tts_?", True), ("x[ab]", True), ("embed.decode", False), ("thinker_embeddings", False)],
)
def test_is_glob(pattern, glob):
    assert is_glob(pattern) is glob


POLICY = Policy.model_validate(
    {
        "default": "cat",
        "rules": [
            {"match": "embed.*", "strategy": "token_list"},
            {"match": "embed.dec*", "strategy": "replace"},
            {"match": "embed.decode", "strategy": "prealloc", "params": {"growth_factor": 4.0}},
            {"match": "meta.*", "strategy": "send_once"},
        ],
    }
)


def test_exact_beats_any_glob_even_listed_later():
    c = POLICY.resolve("embed.decode")
    assert (c.strategy, dict(c.params)) == ("prealloc", {"growth_factor": 4.0})
    assert c.source == "rules[2] (exact match 'embed.decode')"


def test_first_listed_glob_wins():
    c = POLICY.resolve("embed.decoder")
    assert c.strategy == "token_list" and c.source.startswith("rules[0] (glob")


def test_rule_beats_protocol_key_and_protocol_beats_default():
    assert POLICY.resolve("meta.finished").strategy == "send_once"
    c = Policy().resolve("meta.finished")
    assert c.strategy == "replace" and c.source.startswith("protocol key")


def test_unmatched_key_gets_the_default():
    c = POLICY.resolve("codes.audio")
    assert (c.strategy, c.source) == ("cat", "default")


def test_glob_is_case_sensitive_and_does_not_match_a_prefix_only():
    p = Policy.model_validate({"rules": [{"match": "embed.*", "strategy": "replace"}]})
    assert p.resolve("EMBED.decode").strategy == "cat"
    assert p.resolve("embed").strategy == "cat"
    assert p.resolve("thinker_embed.x").strategy == "cat"


def _tuned(fingerprint):
    return {
        "context_len_edges": [0, 8000, 32000],
        "concurrency_edges": [1, 10],
        "fingerprint": fingerprint,
        "cells": [
            {"key": "embed.decode", "context_len": 8000, "concurrency": 1, "strategy": "prealloc"},
            {"key": "embed.decode", "context_len": 8000, "concurrency": 10, "strategy": "token_list"},
            {"key": "embed.decode", "context_len": 0, "concurrency": 1, "strategy": "replace"},
        ],
    }


def test_tuned_buckets_floor_and_clamp(monkeypatch):
    monkeypatch.setattr(Policy, "tuned_usable", lambda self: True)
    p = Policy.model_validate({"tuned": _tuned({"x": 1})})
    assert p.resolve("embed.decode", StreamContext(context_len=8000)).strategy == "prealloc"
    assert p.resolve("embed.decode", StreamContext(context_len=31999, concurrency=9)).strategy == "prealloc"
    assert p.resolve("embed.decode", StreamContext(context_len=9000, concurrency=64)).strategy == "token_list"
    assert p.resolve("embed.decode", StreamContext(context_len=10)).strategy == "replace"
    # no cell for the 32000 bucket: the default applies
    assert p.resolve("embed.decode", StreamContext(context_len=40000)).source == "default"
    assert p.resolve("embed.decode", StreamContext(context_len=8000)).source.startswith(
        "tuned bucket context_len>=8000"
    )
    assert p.tuned.bucket(StreamContext(context_len=50000, concurrency=1)) == (32000, 1, True)


def test_rules_beat_the_tuned_table(monkeypatch):
    monkeypatch.setattr(Policy, "tuned_usable", lambda self: True)
    p = Policy.model_validate({"tuned": _tuned({}), "rules": [{"match": "embed.*", "strategy": "cat"}]})
    assert p.resolve("embed.decode", StreamContext(context_len=8000)).strategy == "cat"


def test_stale_tuned_table_is_not_used():
    p = Policy.model_validate({"tuned": _tuned({"omni_accum": "0.0.0-other", "torch": "0"})})
    with pytest.warns(UserWarning, match="tuned table ignored"):
        assert p.resolve("embed.decode", StreamContext(context_len=8000)).source == "default"


@pytest.mark.parametrize(
    "tuned,msg",
    [
        ({"context_len_edges": [8000, 0], "concurrency_edges": [1]}, "strictly ascending"),
        ({"context_len_edges": [0, 0], "concurrency_edges": [1]}, "strictly ascending"),
        ({"context_len_edges": [-1], "concurrency_edges": [1]}, ">= 0"),
        ({"context_len_edges": [], "concurrency_edges": [1]}, "at least 1"),
        (
            {
                "context_len_edges": [0],
                "concurrency_edges": [1],
                "cells": [{"key": "a", "context_len": 5, "concurrency": 1, "strategy": "cat"}],
            },
            "not one of context_len_edges",
        ),
        (
            {
                "context_len_edges": [0],
                "concurrency_edges": [1],
                "cells": [{"key": "a", "context_len": 0, "concurrency": 2, "strategy": "cat"}],
            },
            "not one of concurrency_edges",
        ),
    ],
)
def test_tuned_table_checks(tuned, msg):
    with pytest.raises(ValidationError, match=msg):
        TunedTable.model_validate(tuned)


def test_strategy_refs_lists_every_place():
    p = Policy.model_validate({"rules": [{"match": "a", "strategy": "replace"}], "tuned": _tuned({})})
    where = [w for w, _, _ in p.strategy_refs()]
    assert where == ["default", "rules[0]", "tuned.cells[0]", "tuned.cells[1]", "tuned.cells[2]"]


def test_every_field_is_documented():
    from omni_accum.policy import StrategyRef as SR
    from omni_accum.policy import TunedCell

    for model in (Policy, Rule, SR, TunedTable, TunedCell):
        assert model.model_config.get("extra") == "forbid", model
        assert model.__doc__, model


def test_public_names():
    assert omni_accum.Policy is Policy and omni_accum.Rule is Rule
