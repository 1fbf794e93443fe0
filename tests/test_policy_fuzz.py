"""Property-based: random policy documents and YAML fragments through ``omni-accum validate``.

Whatever the input: no traceback, exit 0 (valid) or 1 (invalid), and every error names its
place (a field path, or the line of a syntax error). More than 1000 inputs per run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fuzzing import examples
from omni_accum import cli
from omni_accum.manager import get_manager
from omni_accum.policy.loader import load_policy
from omni_accum.policy import Policy

BUILTINS = ["cat", "prealloc", "replace", "send_once", "token_list"]
AVAILABLE = ", ".join(get_manager().names())  # built-ins and any installed plugins
SUPPRESS = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much]


def SETTINGS(n: int) -> settings:  # noqa: N802 - reads like the decorator it returns
    return settings(deadline=None, database=None, max_examples=examples(n), suppress_health_check=SUPPRESS)


# -- generators -------------------------------------------------------------------------------- #

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(BUILTINS + ["catt", "", "embed.*", "meta.finished", "1", "yes"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6) | st.integers(), inner, max_size=3),
    max_leaves=8,
)
param_values = st.one_of(
    st.sampled_from([1.5, 2.0, 0.5, 1.0, 16.0, 17, 64, 0, -1, "2.0", "x", True, None, [], {}]), values
)
params = st.one_of(
    st.dictionaries(
        st.sampled_from(["growth_factor", "initial_capacity", "bogus", "growth"]), param_values, max_size=3
    ),
    values,
)
strategy_names = st.one_of(st.sampled_from(BUILTINS + ["catt", "", "Cat"]), scalars)
matches = st.one_of(
    st.sampled_from(["embed.decode", "embed.*", "meta.*", "speaker", "a", "[", "tts_?", ""]),
    st.text(max_size=10),
    scalars,
)
rules = st.fixed_dictionaries(
    {"match": matches, "strategy": strategy_names},
    optional={"params": params, "description": values, "param": values, "stratgy": values},
)
strategy_refs = st.one_of(
    strategy_names,
    st.fixed_dictionaries({"strategy": strategy_names}, optional={"params": params, "x": values}),
    values,
)
cells = st.fixed_dictionaries(
    {
        "key": matches,
        "context_len": st.sampled_from([0, 8000, 5, -1, "0"]),
        "concurrency": st.sampled_from([1, 10, 0, 3]),
        "strategy": strategy_names,
    },
    optional={"params": params, "margin": values, "ci": values, "timings_us": values, "excluded": values},
)
tuned = st.one_of(
    st.fixed_dictionaries(
        {
            "context_len_edges": st.sampled_from([[0, 8000], [0], [], [8000, 0], [-1], "x"]),
            "concurrency_edges": st.sampled_from([[1, 10], [1], [0], [10, 1]]),
        },
        optional={
            "cells": st.lists(cells, max_size=3) | values,
            "fingerprint": values,
            "wire": values,
            "bogus": values,
        },
    ),
    values,
)
documents = (
    st.fixed_dictionaries(
        {},
        optional={
            "version": st.sampled_from([1, 2, 0, "1", True, None]) | values,
            "description": values,
            "default": strategy_refs,
            "max_bytes_per_request": st.sampled_from([0, 10, -1, True, "10", 1.5]) | values,
            "honor_override_keys": st.sampled_from([True, False, "yes", 1]) | values,
            "rules": st.lists(rules, max_size=4) | values,
            "tuned": tuned,
            "defaults": values,
            "rule": values,
        },
    )
    | values
)

YAML_TOKENS = [
    "default",
    "rules",
    "match",
    "strategy",
    "params",
    "version",
    "tuned",
    "description",
    "growth_factor",
    "cat",
    "prealloc",
    "send_once",
    "embed.*",
    ":",
    ": ",
    "- ",
    "-",
    "[",
    "]",
    "{",
    "}",
    ",",
    "\n",
    "\n  ",
    "\n    ",
    "  ",
    "\t",
    "#",
    "'",
    '"',
    "&a ",
    "*a",
    "!!str ",
    "!!int ",
    "!!binary ",
    "!!python/object:os.system ",
    "!!python/object/apply:os.system ['true'] ",
    "!!python/name:os.system ",
    "!foo ",
    "? ",
    "|",
    ">",
    "---",
    "...",
    "%YAML 1.1\n",
    "%TAG ! tag:x,2000:\n",
    "1",
    "2.0",
    "-1",
    "null",
    "~",
    "true",
    "yes",
    ".nan",
    "1e400",
    "\x00",
    "\ufeff",
    "\u2028",
    "é",
    "<<: ",
    "=",
    "\\",
]
fragments = st.one_of(
    st.lists(st.sampled_from(YAML_TOKENS), max_size=30).map("".join),
    st.text(max_size=60),
    documents.map(lambda d: yaml.safe_dump(d, default_flow_style=False)).flatmap(
        lambda t: st.integers(0, max(len(t), 1)).map(lambda i: t[:i])  # truncated documents
    ),
)

# -- oracle ------------------------------------------------------------------------------------ #


def _text(path: object, e: dict) -> str:
    """A ``validate --json`` error record as the line ``validate`` prints: ``PATH[, line N]: [LOC: ]MSG``."""
    where = f"{path}, line {e['line']}" if e.get("line") else f"{path}"
    return f"{where}: {e['loc']}: {e['msg']}" if e.get("loc") else f"{where}: {e['msg']}"


PREFIX_RE = r"^{src}(?:, line \d+)?: "
LOC_RE = re.compile(
    r"""^(?P<loc>(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^'":\s])+|\(top level\)): (?P<msg>.+)$""", re.S
)


def validate(path: Path) -> tuple[int, dict, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["validate", "--json", str(path)])
    assert "Traceback" not in out.getvalue() + err.getvalue()
    return code, json.loads(out.getvalue()), err.getvalue()


def check_result(path: Path, code: int, report: dict, parsed_ok: bool) -> None:
    assert code in (0, 1)
    (result,) = report["policies"]
    assert result["valid"] is (code == 0)
    if code == 0:
        assert result["errors"] == []
        return
    assert result["errors"], "exit 1 must list at least one error"
    for e in (_text(path, r) for r in result["errors"]):
        assert e.startswith(str(path)), e
        if "invalid YAML" in e or "invalid JSON" in e:
            assert not parsed_ok
            assert "line " in e or "position " in e or "nested too deeply" in e, e
            continue
        if "a policy must be a mapping" in e or "nested too deeply" in e:
            continue
        prefix = re.match(PREFIX_RE.format(src=re.escape(str(path))), e)
        assert prefix, e
        m = LOC_RE.match(e[prefix.end() :])
        assert m, f"error does not name a field: {e!r}"
        top = re.split(r"[.\[]", m.group("loc"), maxsplit=1)[0] or m.group("loc")
        if top not in Policy.model_fields:
            assert "unknown field" in m.group("msg") or "eys should be strings" in m.group("msg"), e
        if "unknown strategy" in m.group("msg"):
            assert "Available: " + AVAILABLE in m.group("msg")
        if "unknown field" in m.group("msg"):
            assert "Allowed fields: " in m.group("msg")
        if ".params." in m.group("loc"):
            assert "allowed params:" in m.group("msg") or "keys must be strings" in m.group("msg"), e


# -- properties -------------------------------------------------------------------------------- #


@pytest.fixture
def policy_path(tmp_path):
    return tmp_path


@SETTINGS(600)
@given(doc=documents, fmt=st.sampled_from(["yaml", "json"]))
@example(doc={"default": "catt"}, fmt="yaml")
@example(doc={"rules": [{"match": "a", "strategy": "prealloc", "params": {"growth_factor": 0.5}}]}, fmt="json")
def test_random_documents(policy_path, doc, fmt):
    path = policy_path / f"p.{fmt}"
    path.write_text(yaml.safe_dump(doc) if fmt == "yaml" else json.dumps(doc), encoding="utf-8")
    code, report, _ = validate(path)
    check_result(path, code, report, parsed_ok=True)
    if code == 0:  # the CLI and the library agree
        assert isinstance(load_policy(path), Policy)


@SETTINGS(600)
@given(text=fragments)
@example(text="default: cat\nrules:\n  - match: [a\n")
@example(text="!!python/object/apply:os.system ['true']\n")
def test_random_yaml_fragments(policy_path, text):
    path = policy_path / "p.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        yaml.safe_load(text)
        parsed_ok = True
    except Exception:  # noqa: BLE001 - the oracle only needs to know whether it parses
        parsed_ok = False
    code, report, _ = validate(path)
    if not text.strip():  # blank text is an error (a failed write, say), never the default policy by accident
        assert code == 1 and "no policy text" in report["policies"][0]["errors"][0]["msg"]
        return
    check_result(path, code, report, parsed_ok)


@SETTINGS(50)
@given(line=st.integers(1, 40), junk=st.sampled_from(["key: [unclosed", "a: 'open", "- : : ]", "{x", "\t- tab"]))
def test_yaml_error_on_line_n_names_line_n(policy_path, line, junk):
    lines = ["default: cat", "rules:"] + [f"  - {{match: k{i}, strategy: replace}}" for i in range(line)]
    text = "\n".join(lines[: line - 1] + [junk] + lines[line - 1 :]) + "\n"
    path = policy_path / "p.yaml"
    path.write_text(text, encoding="utf-8")
    code, report, _ = validate(path)
    assert code == 1
    (rec,) = report["policies"][0]["errors"]
    err = _text(path, rec)
    lines = [int(n) for n in re.findall(r"line (\d+)", err)]
    # the line of the error is named (where the parser noticed it, or where the broken construct began)
    assert line in lines or (line + 1 in lines and len(lines) == 1), (line, err)


@SETTINGS(60)
@given(
    tag=st.sampled_from(
        [
            "!!python/object/apply:os.system",
            "!!python/object/new:os.system",
            "!!python/object/apply:subprocess.call",
            "!!python/object/apply:builtins.exec",
        ]
    ),
    where=st.sampled_from(
        [
            "{v}\n",
            "default: {v}\n",
            "description: {v}\n",
            "rules:\n  - match: a\n    strategy: {v}\n",
            "rules:\n  - match: a\n    strategy: prealloc\n    params:\n      growth_factor: {v}\n",
        ]
    ),
)
def test_python_tags_never_execute(policy_path, tag, where):
    marker = policy_path / "executed"
    marker.unlink(missing_ok=True)
    cmd = f"open({str(marker)!r}, 'w').close()" if tag.endswith("exec") else f"touch {marker}"
    arg = f"[{json.dumps(cmd)}]" if not tag.endswith("call") else f"[[touch, {json.dumps(str(marker))}]]"
    path = policy_path / "p.yaml"
    path.write_text(where.format(v=f"{tag} {arg}"), encoding="utf-8")
    code, report, _ = validate(path)
    assert code == 1 and not marker.exists()
    assert "YAML tags that build Python objects are not allowed" in report["policies"][0]["errors"][0]["msg"]
