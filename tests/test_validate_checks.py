"""``validate``: every duplicate rule, shadowed globs, inline text and stdin, values in messages,
structured JSON errors; ``explain``'s wording for contexts outside the bucket edges."""

from __future__ import annotations

import io
import json

import pytest
import yaml

from omni_accum import cli
from omni_accum.errors import PolicyError
from omni_accum.policy.loader import load_policy


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def _file(tmp_path, text, name="p.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


DUPS = """\
rules:
  - {match: a.x, strategy: prealloc}
  - {match: "embed.*", strategy: prealloc}
  - {match: a.x, strategy: cat}
  - {match: "embed.*", strategy: cat}
  - {match: a.x, strategy: token_list}
"""


def test_every_duplicate_is_reported_exact_and_glob(tmp_path, capsys):
    path = _file(tmp_path, DUPS)
    code, out, _ = _run(capsys, "validate", path)
    assert code == 1
    assert "3 error(s)" in out
    assert f"{path}, line 4: rules[2].match: 'a.x' repeats rules[0].match" in out
    assert f"{path}, line 5: rules[3].match: 'embed.*' repeats rules[1].match" in out
    assert f"{path}, line 6: rules[4].match: 'a.x' repeats rules[0].match" in out


def test_the_library_refuses_a_repeated_glob_too():
    with pytest.raises(PolicyError) as e:
        load_policy({"rules": [{"match": "m.*", "strategy": "replace"}, {"match": "m.*", "strategy": "cat"}]})
    assert "rules[1].match" in str(e.value) and "never match" in str(e.value)


SHADOWED = """\
rules:
  - {match: "embed.*", strategy: prealloc}
  - {match: "embed.tts_*", strategy: send_once}
  - {match: embed.decode, strategy: cat}
  - {match: "meta.?", strategy: replace}
  - {match: "meta.*", strategy: replace}
"""


def test_a_glob_covered_by_an_earlier_glob_is_a_warning(tmp_path, capsys):
    path = _file(tmp_path, SHADOWED)
    code, out, err = _run(capsys, "validate", path)
    assert code == 0 and f"{path}: ok" in out
    text = out + err
    assert "rules[1]" in text and "'embed.tts_*'" in text and "rules[0]" in text and "warning" in text
    assert "rules[2]" not in text  # an exact rule beats every glob: never shadowed
    assert "rules[4]" not in text  # 'meta.*' is wider than the earlier 'meta.?'


def test_validate_reads_stdin_and_inline_text(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("default: prealloc\nrules: []\n"))
    code, out, _ = _run(capsys, "validate", "-")
    assert code == 0 and "<stdin>: ok" in out
    code, out, _ = _run(capsys, "validate", "default: catt")
    assert code == 1 and "unknown strategy 'catt'" in out
    assert out.startswith("<inline>: 1 error(s)\n"), out  # the header as when it is valid, not the text itself
    code, out, _ = _run(capsys, "validate", '{"default": "replace"}')
    assert code == 0 and ": ok" in out
    # stdin named twice: its second read found it empty ("no policy text", exit 1); a usage error naming it
    monkeypatch.setattr("sys.stdin", io.StringIO("default: prealloc\n"))
    code, out, err = _run(capsys, "validate", "-", "-")
    assert code == 2 and "'-' (stdin) given more than once" in err and out == ""


def test_a_missing_file_named_like_a_bracket_is_a_missing_file(tmp_path, capsys, monkeypatch):
    """``[draft].yaml`` that does not exist was read as inline YAML (a parse error, not 'no such policy file')."""
    monkeypatch.chdir(tmp_path)
    for name in ("[draft].yaml", "{a}.json"):
        code, out, _ = _run(capsys, "validate", name)
        assert code == 1 and f"{name}: no such policy file" in out and "invalid YAML" not in out, out
    (tmp_path / "[draft].yaml").write_text("default: replace\n")
    code, out, _ = _run(capsys, "validate", "[draft].yaml")
    assert code == 0 and "[draft].yaml: ok" in out
    code, out, _ = _run(capsys, "validate", "[1, 2]")  # still inline text: not a mapping
    assert code == 1 and "must be a mapping" in out


def test_pydantic_messages_name_the_bad_value(tmp_path, capsys):
    path = _file(tmp_path, "max_bytes_per_request: 1e9\nhonor_override_keys: maybe\n")
    code, out, _ = _run(capsys, "validate", path)
    assert code == 1
    assert "max_bytes_per_request" in out and "'1e9'" in out
    assert "honor_override_keys" in out and "'maybe'" in out
    path = _file(tmp_path, "rules:\n  - {match: x, strategy: prealloc, params: {growth_factor: 99}}\n", "q.yaml")
    code, out, _ = _run(capsys, "validate", path)
    assert code == 1 and "growth_factor" in out and "99" in out.split("growth_factor", 1)[1].split("(strategy")[0]


def test_validate_json_has_one_shape_with_structured_errors(tmp_path, capsys):
    bad = _file(tmp_path, "default: catt\nrules:\n  - {match: x, strategy: prealloc, params: {growth: 2}}\n")
    code, out, _ = _run(capsys, "validate", "--json", bad, "qwen3-omni")
    assert code == 1
    data = json.loads(out)
    bad_rec, good_rec = data["policies"]
    assert set(bad_rec) == set(good_rec)
    assert good_rec["valid"] is True and good_rec["errors"] == [] and good_rec["warnings"] == []
    assert bad_rec["valid"] is False
    errs = {e["loc"]: e for e in bad_rec["errors"]}
    assert set(errs) == {"default.strategy", "rules[0].params.growth"}
    assert errs["default.strategy"]["line"] == 1 and "unknown strategy 'catt'" in errs["default.strategy"]["msg"]
    assert errs["rules[0].params.growth"]["line"] == 3 and "unknown param" in errs["rules[0].params.growth"]["msg"]
    for e in bad_rec["errors"]:
        assert set(e) == {"loc", "line", "msg"} and not e["msg"].startswith(bad)


def test_validate_json_parse_error_has_a_line(tmp_path, capsys):
    bad = _file(tmp_path, "default: [cat\n")
    code, out, _ = _run(capsys, "validate", "--json", bad)
    (rec,) = json.loads(out)["policies"]
    (e,) = rec["errors"]
    assert code == 1 and e["loc"] is None and isinstance(e["line"], int) and "invalid YAML" in e["msg"]


def _tuned_file(tmp_path):
    from omni_accum.policy.environment import current_fingerprint

    data = {
        "tuned": {
            "context_len_edges": [1000, 32000],
            "concurrency_edges": [1],
            "fingerprint": current_fingerprint(),
            "cells": [{"key": "k", "context_len": c, "concurrency": 1, "strategy": "prealloc"} for c in (1000, 32000)],
        }
    }
    return _file(tmp_path, yaml.safe_dump(data))


def test_explain_above_the_last_edge_does_not_say_clamped_under_a_ge_label(tmp_path, capsys):
    path = _tuned_file(tmp_path)
    code, out, _ = _run(capsys, "explain", path, "--key", "k", "--context-len", "40000")
    assert code == 0 and "context_len>=32000" in out
    assert "clamped" not in out and "above the largest edge measured (32000)" in out


def test_explain_below_the_first_edge_does_not_claim_ge(tmp_path, capsys):
    path = _tuned_file(tmp_path)
    code, out, _ = _run(capsys, "explain", path, "--key", "k", "--context-len", "500")
    assert code == 0 and "context_len>=1000" not in out
    assert "below the smallest edge measured (1000)" in out


@pytest.mark.parametrize("where", ["stdin", "file"])
def test_an_empty_stdin_or_file_is_an_error_not_the_default_policy(capsys, monkeypatch, tmp_path, where):
    """``cat missing.yaml | omni-accum validate -`` must not pass: the pipeline's first command failed; nor must
    ``cmd > p.yaml; omni-accum validate p.yaml`` after a failed ``cmd``. Both say the same."""
    monkeypatch.setattr("sys.stdin", io.StringIO(" \n"))
    (tmp_path / "p.yaml").write_text(" \n")
    arg, label = ("-", "<stdin>") if where == "stdin" else (str(tmp_path / "p.yaml"), str(tmp_path / "p.yaml"))
    code = cli.main(["validate", arg])
    out = capsys.readouterr().out
    assert code == 1 and f"{label}: no policy text (" in out and "ok" not in out.split("no policy text")[0]
    assert "empty or holds only blanks; to name the default policy, give 'default')" in out


def test_a_repeated_match_does_not_hide_the_other_errors(tmp_path, capsys):
    p = tmp_path / "w.yaml"
    p.write_text(
        "rules:\n  - {match: a, strategy: prealloc}\n  - {match: a, strategy: cat}\n"
        "  - {match: x, strategy: catt}\n  - {match: y, strategy: prealloc, params: {growth: 2}}\n"
    )
    assert cli.main(["validate", str(p)]) == 1
    out = capsys.readouterr().out
    assert "3 error(s)" in out
    assert "line 3: rules[1].match: 'a' repeats rules[0].match" in out
    assert "line 4: rules[2].strategy: unknown strategy 'catt'" in out
    assert "line 5: rules[3].params.growth: unknown param" in out


def test_shadowed_globs_are_found_without_trying_every_pair(monkeypatch):
    """``validate`` on 2,000 glob rules took minutes: every glob was tried against every earlier one. Only the
    earlier globs whose literal prefix starts the later one's keys can cover it; the others are not tried."""
    import fnmatch

    rules = [{"match": f"g{i}.*", "strategy": "cat"} for i in range(300)]
    rules += [{"match": "g7.tts_*", "strategy": "cat"}, {"match": "h?", "strategy": "cat"}]
    policy = load_policy({"rules": rules})
    calls = [0]
    match = fnmatch.fnmatchcase

    def counting(name, pat):
        calls[0] += 1
        return match(name, pat)

    monkeypatch.setattr(fnmatch, "fnmatchcase", counting)
    assert policy.shadowed_rules() == [(300, 7)]
    assert calls[0] < 100  # all pairs: 45,000
