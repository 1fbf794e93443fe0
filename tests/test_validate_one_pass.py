"""``omni-accum validate`` lists every problem of a policy in one pass: the schema's, and the strategy names, params
and warnings of what parsed (they came in rounds: the unknown field first, the rest once it was fixed)."""

from __future__ import annotations

import json

from omni_accum.cli import main

THREE = (
    "colour: red\n"
    "default: catt\n"
    "rules:\n"
    '  - {match: "embed.*", strategy: prealloc, params: {growth: 2}}\n'
    '  - {match: "embed.d*", strategy: cat}\n'
    "  - {match: x}\n"
)


def test_an_unknown_field_a_strategy_and_a_param_are_listed_at_once_with_the_glob_warning(tmp_path, capsys):
    p = tmp_path / "p.yaml"
    p.write_text(THREE)
    assert main(["validate", "--json", str(p)]) == 1
    (rec,) = json.loads(capsys.readouterr().out)["policies"]
    found = {(e["loc"], e["line"]) for e in rec["errors"]}
    assert found == {
        ("colour", 1),
        ("default.strategy", 2),
        ("rules[0].params.growth", 4),
        ("rules[2].strategy", 6),
    }, rec["errors"]
    assert [(w["loc"], w["line"]) for w in rec["warnings"]] == [("rules[1].match", 5)]
    assert "covered by the earlier glob rules[0].match 'embed.*'" in rec["warnings"][0]["msg"]


def test_a_later_rule_keeps_its_own_index_when_an_earlier_one_does_not_parse(tmp_path, capsys):
    p = tmp_path / "p.toml"
    p.write_text('[[rules]]\nmatch = "a"\n\n[[rules]]\nmatch = "b"\nstrategy = "catt"\n')
    assert main(["validate", str(p)]) == 1
    out = capsys.readouterr().out
    assert "line 2: rules[0].strategy: Field required" in out or "rules[0].strategy: Field required" in out
    assert "line 6: rules[1].strategy: unknown strategy 'catt'" in out, out


def test_a_repeated_match_is_listed_beside_an_unknown_field(tmp_path, capsys):
    """The schema checks repeated matches only when every field passed: with an unknown field beside them they were
    reported once that was fixed. Rule 1 does not parse, so the repeat is at the file's rules[3], of rules[0]."""
    p = tmp_path / "p.yaml"
    p.write_text(
        "bogus: 1\nrules:\n"
        '  - {match: "embed.*", strategy: cat}\n'
        "  - {match: y}\n"
        "  - {match: x, strategy: cat}\n"
        '  - {match: "embed.*", strategy: prealloc}\n'
    )
    assert main(["validate", "--json", str(p)]) == 1
    (rec,) = json.loads(capsys.readouterr().out)["policies"]
    found = {(e["loc"], e["line"]) for e in rec["errors"]}
    assert found == {("bogus", 1), ("rules[1].strategy", 4), ("rules[3].match", 6)}, rec["errors"]
    repeat = next(e for e in rec["errors"] if e["loc"] == "rules[3].match")
    assert repeat["msg"].startswith("'embed.*' repeats rules[0].match"), repeat
    p.write_text('rules:\n  - {match: a, strategy: cat}\n  - {match: a, strategy: cat}\n')  # the repeat alone: once
    assert main(["validate", "--json", str(p)]) == 1
    (rec,) = json.loads(capsys.readouterr().out)["policies"]
    assert [(e["loc"], e["line"]) for e in rec["errors"]] == [("rules[1].match", 3)], rec["errors"]
