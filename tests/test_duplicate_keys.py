"""Duplicate mapping keys in policy and workload files are refused, with both line numbers."""

from __future__ import annotations

import json

import pytest

from omni_accum import cli
from omni_accum.bench.workloads import WorkloadError, load_workload
from omni_accum.errors import PolicyError
from omni_accum.policy.loader import ENV_POLICY, load_policy, parse_text

TOP = "default: cat\nrules: []\ndefault: prealloc\n"
NESTED = "default: cat\nrules:\n  - match: x\n    strategy: cat\n    strategy: prealloc\n"
DEEP = "rules:\n  - match: x\n    strategy: prealloc\n    params:\n      growth_factor: 2.0\n      growth_factor: 3.0\n"


@pytest.mark.parametrize(
    "text,key,first,second",
    [(TOP, "default", 1, 3), (NESTED, "strategy", 4, 5), (DEEP, "growth_factor", 5, 6)],
)
def test_yaml_policy_duplicate_key_names_both_lines(tmp_path, text, key, first, second):
    p = tmp_path / "dup.yaml"
    p.write_text(text)
    with pytest.raises(PolicyError) as e:
        load_policy(p)
    msg = str(e.value)
    assert str(p) in msg and f"duplicate key {key!r}" in msg
    assert f"line {first}" in msg and f"line {second}" in msg


def test_yaml_flow_mapping_duplicate_and_merge_keys(tmp_path):
    with pytest.raises(PolicyError, match="duplicate key 'a'"):
        parse_text("x: {a: 1, a: 2}\n", "yaml", "s")
    # a merge key (<<) may be overridden by an explicit key: not a duplicate
    assert parse_text("base: &b {a: 1}\nx:\n  <<: *b\n  a: 2\n", "yaml", "s")["x"] == {"a": 2}


def test_safe_loader_still_refuses_python_tags():
    with pytest.raises(PolicyError, match="YAML tags that build Python objects are not allowed"):
        parse_text("default: !!python/object/apply:os.system ['true']\n", "yaml", "s")


@pytest.mark.parametrize(
    "data,key",
    [
        ('{"default": "cat",\n "default": "prealloc"}', "default"),
        ('{"rules": [{"match": "x",\n "strategy": "cat",\n "strategy": "prealloc"}]}', "strategy"),
    ],
)
def test_json_policy_duplicate_key(tmp_path, data, key):
    p = tmp_path / "dup.json"
    p.write_text(data)
    with pytest.raises(PolicyError) as e:
        load_policy(p)
    msg = str(e.value)
    assert str(p) in msg and f"duplicate key {key!r}" in msg and "line 2" in msg


def test_json_without_duplicates_still_loads(tmp_path):
    p = tmp_path / "ok.json"
    p.write_text(json.dumps({"default": "cat", "rules": [{"match": "x", "strategy": "prealloc"}]}))
    assert load_policy(p).default.strategy == "cat"


def test_inline_env_policy_duplicate_key(monkeypatch):
    monkeypatch.setenv(ENV_POLICY, "default: cat\ndefault: prealloc\n")
    with pytest.raises(PolicyError, match="duplicate key 'default'"):
        load_policy()


def test_validate_reports_duplicate_key_without_traceback(capsys, tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text(NESTED)
    code = cli.main(["validate", str(p)])
    out, err = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in out + err
    assert "duplicate key 'strategy'" in out and "line 4" in out and "line 5" in out


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_workload_duplicate_key(tmp_path, suffix):
    if suffix == "yaml":
        text = "name: w\nkeys:\n  a: {kind: tensor}\nname: w2\n"
    else:
        text = '{"name": "w",\n "keys": {},\n "name": "w2"}'
    p = tmp_path / f"dup.{suffix}"
    p.write_text(text)
    with pytest.raises(WorkloadError) as e:
        load_workload(str(p))
    msg = str(e.value)
    assert str(p) in msg and "duplicate key 'name'" in msg and "line 1" in msg
    assert ("line 4" if suffix == "yaml" else "line 3") in msg


def test_workload_nested_duplicate_key(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("name: w\nkeys:\n  a: {kind: tensor}\n  a: {kind: tensor}\n")
    with pytest.raises(WorkloadError, match="duplicate key 'a'"):
        load_workload(str(p))


def test_deploy_yaml_duplicate_key(tmp_path):
    from omni_accum.cli.doctor import _deploy_policy
    from omni_accum.errors import OmniAccumError

    f = tmp_path / "deploy.yaml"
    f.write_text(
        "connectors:\n  a:\n    extra: {omni_accum_policy: default}\n    extra: {omni_accum_policy: qwen3-omni}\n"
    )
    with pytest.raises(OmniAccumError, match="duplicate key 'extra'.*line 3.*line 4"):
        _deploy_policy(str(f))
