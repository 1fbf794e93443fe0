"""Loading policies: YAML (safe only), JSON, TOML, presets, mappings, OMNI_ACCUM_POLICY; error places."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

import omni_accum
from omni_accum.errors import PolicyArgumentError, PolicyError
from omni_accum.manager import get_manager
from omni_accum.policy.loader import ENV_POLICY, POLICY_OFF, dump_policy, load_policy, parse_text, preset_names, read_source

STRATEGIES = ", ".join(get_manager().names())  # built-ins and any installed plugins

POLICY_DATA = {
    "version": 1,
    "description": "test",
    "default": "cat",
    "rules": [
        {"match": "embed.decode", "strategy": "prealloc", "params": {"growth_factor": 1.5}},
        {"match": "meta.*", "strategy": "replace"},
    ],
}
TOML = """
version = 1
description = "test"
default = "cat"

[[rules]]
match = "embed.decode"
strategy = "prealloc"
params = { growth_factor = 1.5 }

[[rules]]
match = "meta.*"
strategy = "replace"
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


@pytest.mark.parametrize("ext", [".yaml", ".yml", ".json", ".toml", ".YAML"])
def test_every_format_gives_the_same_policy(tmp_path, ext):
    text = {".json": json.dumps(POLICY_DATA), ".toml": TOML}.get(ext.lower(), yaml.safe_dump(POLICY_DATA))
    p = load_policy(write(tmp_path, "p" + ext, text))
    assert p == load_policy(POLICY_DATA)
    assert load_policy(str(tmp_path / ("p" + ext))) == p


def test_mapping_policy_instance_and_model():
    p = load_policy(POLICY_DATA)
    assert load_policy(p) is p
    assert load_policy(p.model_copy()) == p


def test_unsupported_extension_and_missing_file(tmp_path):
    with pytest.raises(PolicyError, match=r"unsupported policy file type '\.txt'"):
        load_policy(write(tmp_path, "p.txt", "default: cat"))
    with pytest.raises(PolicyError, match="no such policy file"):
        load_policy(str(tmp_path / "missing.yaml"))
    with pytest.raises(PolicyError, match="neither a policy file nor a preset. Available presets: default"):
        load_policy("qwen4-omni")


def test_presets_load_by_name_and_have_comment_headers():
    assert {"default", "qwen3-omni", "qwen3-omni-flat"} <= set(preset_names())
    for name in preset_names():
        label, text, fmt = read_source(name)
        assert label == f"preset {name!r}" and fmt == "yaml"
        first = text.splitlines()[0]
        assert first.startswith(f"# {name} "), f"preset {name} needs a comment header naming it"
        assert load_policy(name).description


def test_default_preset_is_upstream():
    p = load_policy("default")
    assert p.default.strategy == "cat" and p.honor_override_keys
    assert p.resolve("meta.finished").strategy == "replace"
    for key in ("embed.decode", "ids.output", "thinker_embeddings", "meta.override_keys"):
        assert p.resolve(key).strategy == "cat"


QWEN_EXPECTED = {
    "embed.prefill": "prealloc",
    "hidden_states.output": "prealloc",
    "embed.decode": "prealloc",
    "embed.tts_bos": "send_once",
    "embed.tts_eos": "send_once",
    "embed.tts_pad": "send_once",
    "speaker": "send_once",
    "language": "send_once",
    "ids.prompt": "send_once",
    "meta.override_keys": "send_once",
    "meta.finished": "replace",
    "meta.is_segment_finished": "replace",
    "meta.left_context_size": "replace",
    "codes.audio": "replace",
    "ids.all": "cat",
}
QWEN_FLAT_EXPECTED = {
    "thinker_embeddings": "prealloc",
    "thinker_prefill_embeddings": "prealloc",
    "thinker_hidden_states": "prealloc",
    "thinker_decode_embeddings": "prealloc",
    "tts_bos_embed": "send_once",
    "tts_eos_embed": "send_once",
    "tts_pad_embed": "send_once",
    "thinker_input_ids": "send_once",
    "speaker": "send_once",
    "language": "send_once",
    "override_keys": "send_once",
    "finished": "replace",
}


@pytest.mark.parametrize("name,expected", [("qwen3-omni", QWEN_EXPECTED), ("qwen3-omni-flat", QWEN_FLAT_EXPECTED)])
def test_qwen_presets_follow_design_section_2(name, expected):
    p = load_policy(name)
    got = {k: p.resolve(k).strategy for k in expected}
    assert got == expected


def test_qwen3_omni_preset_matches_upstream_views_with_override_keys():
    """send_once on meta.override_keys must not stop the list applying on later chunks (2026-03..05 payloads)."""
    import torch

    views = {}
    for name in ("default", "qwen3-omni"):
        tx, rx = omni_accum.Sender(name), omni_accum.Receiver(name)
        out = []
        for step in range(4):
            chunk = {
                "embed": {"decode": torch.full((1, 8), float(step)), "tts_bos": torch.ones(1, 1, 8)},
                "ids": {"output": list(range(step + 1))},
                "meta": {"finished": step == 3, "override_keys": [["embed", "decode"], ["ids", "output"]]},
                "speaker": "ethan",
            }
            v = rx.merge("r", tx.encode("r", chunk))
            out.append((v["embed"]["decode"].clone(), list(v["ids"]["output"]), v["meta"]["finished"], v["speaker"]))
        views[name] = out
    for a, b in zip(views["default"], views["qwen3-omni"]):
        assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_env_var_path_preset_and_inline(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_POLICY, raising=False)
    assert load_policy() == load_policy("default")
    monkeypatch.setenv(ENV_POLICY, "qwen3-omni")
    assert load_policy() == load_policy("qwen3-omni")
    monkeypatch.setenv(ENV_POLICY, str(write(tmp_path, "p.json", json.dumps(POLICY_DATA))))
    assert load_policy() == load_policy(POLICY_DATA)
    monkeypatch.setenv(ENV_POLICY, json.dumps(POLICY_DATA))
    assert load_policy() == load_policy(POLICY_DATA)
    monkeypatch.setenv(ENV_POLICY, "default: prealloc\nrules: []\n")
    assert load_policy().default.strategy == "prealloc"
    monkeypatch.setenv(ENV_POLICY, "default: nope\n")
    with pytest.raises(PolicyError, match=f"{ENV_POLICY}.*unknown strategy 'nope'. Available: {STRATEGIES}"):
        load_policy()
    monkeypatch.setenv(ENV_POLICY, "   ")
    assert load_policy() == load_policy("default")
    for off in ("off", "None", "FALSE", "0"):  # the plugin's "off" (these raised "neither a policy file nor a preset")
        monkeypatch.setenv(ENV_POLICY, off)
        assert load_policy() == load_policy("default")


# -- errors: every problem, each with its place ------------------------------------------------ #


def errors_of(tmp_path, text, name="p.yaml"):
    with pytest.raises(PolicyError) as ei:
        load_policy(write(tmp_path, name, text))
    return ei.value.errors, str(ei.value)


def test_unknown_strategy_lists_the_available_ones_with_line(tmp_path):
    errs, _ = errors_of(tmp_path, "default: cat\nrules:\n  - match: a\n    strategy: catt\n")
    assert len(errs) == 1
    assert ", line 4: rules[0].strategy: unknown strategy 'catt'. Available: " + STRATEGIES in errs[0]


def test_bad_params_name_rule_field_line_and_allowed_params(tmp_path):
    text = (
        "rules:\n  - match: a\n    strategy: cat\n  - match: b\n    strategy: prealloc\n    params:\n"
        "      growth_factor: 0.5\n      bogus: 1\n"
    )
    errs, msg = errors_of(tmp_path, text)
    assert len(errs) == 2
    assert "line 7: rules[1].params.growth_factor: Input should be greater than 1" in errs[0]
    assert "line 8: rules[1].params.bogus: unknown param" in errs[1]
    for e in errs:
        assert (
            "strategy 'prealloc'; allowed params: initial_capacity (default 64), growth_factor (default 2.0), "
            "reuse_bytes (default 0)"
        ) in e
    assert msg.count("\n") == 2


def test_prealloc_params_are_numbers_not_bools_or_strings(tmp_path):
    """``initial_capacity: yes`` loaded as 1, ``growth_factor: "2"`` as 2.0 and ``reuse_bytes: true`` as 1 byte."""
    text = (
        "rules:\n  - match: a\n    strategy: prealloc\n    params:\n      initial_capacity: yes\n"
        "      growth_factor: '2'\n      reuse_bytes: true\n"
    )
    errs, _ = errors_of(tmp_path, text)
    assert len(errs) == 3, errs
    assert "line 5: rules[0].params.initial_capacity: Input should be a valid integer (got True) (strategy" in errs[0]
    assert "line 6: rules[0].params.growth_factor: Input should be a valid number (got '2')" in errs[1]
    assert "line 7: rules[0].params.reuse_bytes: Input should be a number of bytes or a size such as" in errs[2]
    good = "rules: [{match: a, strategy: prealloc, params: {initial_capacity: 9, growth_factor: 2, reuse_bytes: 1MiB}}]"
    params = load_policy(write(tmp_path, "good.yaml", good)).rules[0].params
    assert params == {"initial_capacity": 9, "growth_factor": 2, "reuse_bytes": "1MiB"}
    with pytest.raises(omni_accum.PluginError, match="initial_capacity: Input should be a valid integer"):
        get_manager().build("prealloc", {"initial_capacity": True})


def test_every_error_is_listed_at_once(tmp_path):
    text = "version: 2\nfoo: 1\nrules:\n  - match: a\n  - {match: b, strategy: cat, x: 1}\n"
    errs, _ = errors_of(tmp_path, text)
    joined = "\n".join(errs)
    assert "line 1: version: Input should be 1 (got 2)" in joined
    assert "line 2: foo: unknown field. Allowed fields: version, description, default" in joined
    assert "line 4: rules[0].strategy: Field required" in joined
    assert "line 5: rules[1].x: unknown field. Allowed fields: match, strategy, params, description" in joined


def test_duplicate_exact_rule_names_line(tmp_path):
    errs, _ = errors_of(
        tmp_path, "rules:\n- {match: a, strategy: cat}\n- {match: b, strategy: cat}\n- {match: a, strategy: replace}\n"
    )
    assert errs[0].endswith(", line 4: rules[2].match: 'a' repeats rules[0].match; remove one")


def test_wrong_shapes_say_what_is_expected(tmp_path):
    errs, _ = errors_of(tmp_path, "default: 3\nrules: [3]\ntuned: x\n")
    joined = "\n".join(errs)
    assert "default: expected a strategy name or {strategy: NAME, params: {...}}, got int" in joined
    assert "rules[0]: expected a mapping with fields match, strategy, params, description, got int" in joined
    assert "tuned: expected a mapping with fields context_len_edges" in joined
    _, msg = errors_of(tmp_path, "- default: cat\n")
    assert "a policy must be a mapping" in msg and "got list" in msg and "TOML" not in msg
    _, msg = errors_of(tmp_path, 'default = "cat"\n')  # TOML in a .yaml file: YAML reads one string
    assert "a policy must be a mapping" in msg and "got str (TOML? name the file .toml)" in msg


@pytest.mark.parametrize(
    "text,line",
    [
        ("default: cat\nrules:\n  - match: [a\n", 4),
        ("default: cat\nrules:\n  - match: a\n   strategy: x\n", 4),
        ("default: cat\n\n\nrules: {a: 1\n  b\n", 6),
        ("a: 'unterminated\n", 2),
        ("default: cat\ndefault:\t- x\n", 2),
    ],
)
def test_yaml_syntax_error_names_file_and_line(tmp_path, text, line):
    _, msg = errors_of(tmp_path, text)
    assert str(tmp_path / "p.yaml") in msg and f"line {line}" in msg and "invalid YAML" in msg


def test_json_and_toml_errors_name_the_line(tmp_path):
    _, msg = errors_of(tmp_path, '{\n  "default": "cat",\n  "rules": [\n}\n', "p.json")
    assert "p.json: line 4" in msg and "invalid JSON" in msg
    _, msg = errors_of(tmp_path, 'default = "cat"\nrules = \nversion = 1\n', "p.toml")
    assert "invalid TOML" in msg and "line 2" in msg


def test_toml_validation_errors_name_the_line(tmp_path):
    """A TOML policy's field errors carry lines as a YAML one's do: tables, arrays of tables (the n-th
    ``[[rules]]`` is rules[n-1]), dotted and quoted keys."""
    text = (
        'version = 1\n\n[default]\nstrategy = "prealloc"\n\n[[rules]]\nmatch = "a"\nstrategy = "cat"\n\n'
        '[[rules]]\n"match" = "b"\nstrategy = "prealloc"\nparams.growth_factor = 0.5\n'
    )
    errs, _ = errors_of(tmp_path, text, "p.toml")
    joined = "\n".join(errs)
    assert "p.toml, line 13: rules[1].params.growth_factor: Input should be greater than 1" in joined
    errs, _ = errors_of(tmp_path, 'version = 1\nfoo = 1\n', "p.toml")
    assert "p.toml, line 2: foo: unknown field" in errs[0]
    twice = '[[rules]]\nmatch = "a"\nstrategy = "cat"\n' * 2
    errs, _ = errors_of(tmp_path, twice, "p.toml")
    assert errs[0].endswith(", line 5: rules[1].match: 'a' repeats rules[0].match; remove one")


def test_toml_line_finds_the_longest_defined_prefix():
    from omni_accum.policy.parsing import toml_line

    text = (
        'default = "cat"\n[tuned]\ncontext_len_edges = [\n  [1], 8000,\n]\n[[tuned.cells]]\nkey = "a"\n'
        "[[tuned.cells]] # the second\nkey = 'b'\n"
    )
    assert toml_line(text, ("tuned", "cells", 1, "key")) == 9
    assert toml_line(text, ("tuned", "cells", 1, "strategy")) == 8  # not written: its table's header
    assert toml_line(text, ("tuned", "context_len_edges", 1)) == 3  # a line inside an array is no header
    assert toml_line(text, ("default",)) == 1
    assert toml_line(text, ("nothing",)) is None


@pytest.mark.parametrize(
    "tag",
    [
        "!!python/object/apply:os.system ['touch {marker}']",
        "!!python/object/apply:subprocess.check_call [['touch', '{marker}']]",
        "!!python/object/new:os.system ['touch {marker}']",
        "!!python/name:os.system",
        "!!python/module:os",
        "!!python/object:builtins.dict {{}}",
    ],
)
@pytest.mark.parametrize("place", ["top", "default", "params", "description"])
def test_python_tags_are_rejected_never_executed(tmp_path, tag, place):
    marker = tmp_path / "executed"
    value = tag.format(marker=marker)
    text = {
        "top": f"{value}\n",
        "default": f"default: {value}\n",
        "params": f"rules:\n  - match: a\n    strategy: prealloc\n    params:\n      growth_factor: {value}\n",
        "description": f"description: {value}\n",
    }[place]
    _, msg = errors_of(tmp_path, text)
    assert "invalid YAML" in msg and "could not determine a constructor" in msg
    assert "YAML tags that build Python objects are not allowed" in msg
    assert not marker.exists()


def test_deep_nesting_is_an_error_not_a_crash(tmp_path):
    for name, text in [
        ("p.yaml", "[" * 5000 + "]" * 5000),
        ("p.json", "[" * 5000 + "]" * 5000),
        ("q.yaml", "default: " + "[" * 3000 + "]" * 3000),
    ]:
        _, msg = errors_of(tmp_path, text, name)
        assert "nested too deeply" in msg


def test_unreadable_and_binary_files(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PolicyError, match="p.yaml"):
        load_policy(p)
    d = tmp_path / "dir.yaml"
    d.mkdir()
    with pytest.raises(PolicyError):
        load_policy(d)


def _count_composes(monkeypatch) -> list[int]:
    calls = [0]
    compose = yaml.compose

    def counting(*a, **kw):
        calls[0] += 1
        return compose(*a, **kw)

    monkeypatch.setattr(yaml, "compose", counting)
    return calls


def test_a_policy_is_parsed_once_and_lines_are_looked_up_only_for_problems(tmp_path, monkeypatch):
    """Loading was quadratic: the YAML was composed again for the line of every strategy reference, valid or not
    (300 rules: ~10 s; 2,000 globs: minutes). A valid policy needs no line at all; many problems need one parse."""
    rules = "".join(f"  - {{match: k{i}, strategy: prealloc, params: {{growth_factor: 2.0}}}}\n" for i in range(60))
    calls = _count_composes(monkeypatch)
    assert len(load_policy(write(tmp_path, "ok.yaml", "default: cat\nrules:\n" + rules)).rules) == 60
    assert calls[0] == 0
    bad = rules.replace("growth_factor: 2.0", "growth: 2")
    with pytest.raises(PolicyError) as e:
        load_policy(write(tmp_path, "bad.yaml", "default: catt\nrules:\n" + bad))
    assert len(e.value.errors) == 61 and "bad.yaml, line 62: rules[59].params.growth: unknown param" in str(e.value)
    assert calls[0] == 1


def test_a_policy_file_over_the_size_cap_is_refused_naming_file_size_and_cap(tmp_path, monkeypatch):
    """A 100 MB file of comments took 104 s to load; a file over the cap is refused before it is parsed."""
    import omni_accum.policy.sources as sources

    monkeypatch.setattr(sources, "MAX_POLICY_BYTES", 1024)
    p = write(tmp_path, "big.yaml", "# a comment\n" * 100)  # 1200 bytes
    with pytest.raises(PolicyError) as e:
        load_policy(p)
    assert str(e.value).startswith(
        f"{p}: too large for a policy (1200 bytes; the limit is 1024 bytes (0 MiB)): a policy is a few KiB"
    )
    assert "tune it again with fewer --context-lens or --concurrency" in str(e.value)  # a table of an older tune
    assert load_policy(write(tmp_path, "small.yaml", "# a comment\n" * 80)) == omni_accum.Policy()


def test_a_fifo_or_device_is_not_a_regular_file_not_a_missing_one(tmp_path):
    """``/dev/zero`` and a FIFO exist: "no such policy file" was wrong, and a FIFO must never be opened (it blocks)."""
    fifo = tmp_path / "p.yaml"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a character device")):
        with pytest.raises(PolicyError) as e:
            read_source(path)
        assert str(e.value) == f"{path}: not a regular file ({kind}); give a .yaml, .yml, .json or .toml file"


def test_parse_text_plain_values():
    assert parse_text("a: 1", "yaml", "x") == {"a": 1}
    assert parse_text('{"a": 1}', "json", "x") == {"a": 1}
    assert parse_text("a = 1", "toml", "x") == {"a": 1}


def test_empty_yaml_file_is_the_default_policy(tmp_path):
    assert load_policy(write(tmp_path, "p.yaml", "# nothing\n")) == omni_accum.Policy()


@pytest.mark.parametrize("fmt", ["yaml", "json"])
@pytest.mark.parametrize("name", ["default", "qwen3-omni", "qwen3-omni-flat"])
def test_dump_round_trips(tmp_path, fmt, name):
    p = load_policy(name)
    text = dump_policy(p, fmt)
    assert load_policy(write(tmp_path, "p." + fmt, text)) == p


def test_validation_against_a_given_manager():
    from omni_accum.manager import StrategyManager

    m = StrategyManager(load_entrypoints=False)
    with pytest.raises(PolicyError, match="unknown strategy 'cat'"):
        load_policy({"default": "cat"}, manager=m)


def test_a_preset_name_is_a_preset_even_beside_a_file_of_that_name_and_a_missing_relative_file_names_the_cwd(
    tmp_path, monkeypatch
):
    """OMNI_ACCUM_POLICY=default with a file named 'default' in the server's working directory failed ("unsupported
    policy file type ''": no file without a .yaml/.json/.toml suffix is a policy), so omni-accum installed nothing."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").write_text("not a policy\n")
    assert load_policy("default").default.strategy == "cat"
    with pytest.raises(PolicyError, match=f"policies/mine.yaml: no such policy file \\(a relative path, read from the "
                                          f"working directory {tmp_path}\\)"):
        load_policy("policies/mine.yaml")


LONG_TEXT = "description: " + "x" * 300 + "\ndefault: replace\n"  # longer than any file name may be (255)


def test_policy_text_longer_than_a_file_name_loads_as_text(monkeypatch):
    """``Path(text).exists()`` raised ``OSError: File name too long``: a probe that fails is 'not a file'."""
    assert load_policy(LONG_TEXT).default.strategy == "replace"
    qwen = load_policy("qwen3-omni")
    for fmt in ("yaml", "json"):
        text = omni_accum.dump_policy(qwen, fmt)
        assert len(text) > 255 and load_policy(text) == qwen  # dump -> load round trips as text, too
    as_json = json.dumps({"description": "y" * 300, "default": "prealloc"})
    assert load_policy(as_json).default.strategy == "prealloc"
    monkeypatch.setenv(ENV_POLICY, LONG_TEXT)
    assert load_policy().default.strategy == "replace"
    assert omni_accum.Receiver().policy.default.strategy == "replace"
    with pytest.raises(PolicyError, match="neither a policy file nor a preset"):
        load_policy("y" * 300)  # a long name that is no policy text: the usual error, not an OSError
    with pytest.raises(PolicyError, match="no such policy file"):
        load_policy("a/" * 200 + "p.yaml")


def test_an_ab_arm_given_as_long_text_is_reported_not_crashed():
    with pytest.raises(PolicyError, match="does not load as an arm's policy"):
        load_policy({"ab": {"arms": {"a": {"policy": LONG_TEXT}, "b": {"policy": "default"}}}})


def test_a_policy_object_is_checked_as_a_file_would_be():
    """``load_policy(Policy)`` returned it unchecked: an unknown strategy or bad params failed only at the first
    chunk, and an unknown default was blamed on 'default for meta.override_keys' by Sender/Receiver."""
    unknown_default = omni_accum.Policy.model_validate({"default": "nosuch"})
    for call in (load_policy, omni_accum.Sender, omni_accum.Receiver):
        with pytest.raises(PolicyError) as e:
            call(unknown_default)
        assert "<Policy>: default.strategy: unknown strategy 'nosuch'. Available: " in str(e.value)
        assert "override_keys" not in str(e.value)
        assert e.value.details[0]["loc"] == "default.strategy"
    rule = {"match": "x", "strategy": "prealloc", "params": {"g": 3}}
    bad_params = omni_accum.Policy.model_validate({"rules": [rule]})
    with pytest.raises(PolicyError, match=r"<Policy>: rules\[0\]\.params\.g: unknown param \(strategy 'prealloc'"):
        omni_accum.Sender(bad_params)
    good = load_policy("qwen3-omni")
    assert load_policy(good) is good  # a valid one is returned as it is


def test_dump_policy_refuses_a_format_it_cannot_write():
    """``dump_policy(p, "toml")`` returned YAML silently."""
    policy = load_policy("default")
    for fmt in ("toml", "xml", "YAML"):
        with pytest.raises(PolicyError, match=f"unknown format {fmt!r}; valid formats: yaml, json"):
            dump_policy(policy, fmt)


def test_dump_policy_of_something_not_a_policy_names_it_and_says_to_load_it():
    """``dump_policy("qwen3-omni")`` (or a dict, or None) was a bare AttributeError: no attribute 'model_dump'."""
    for bad, got in (("qwen3-omni", "str 'qwen3-omni'"), (POLICY_DATA, "dict {"), (None, "NoneType None")):
        with pytest.raises(PolicyArgumentError, match="dump_policy: expected a Policy, got ") as e:
            dump_policy(bad)  # type: ignore[arg-type]
        assert got in str(e.value) and "load_policy(...)" in str(e.value) and isinstance(e.value, TypeError)


def test_a_path_like_whose_fspath_gives_no_str_is_a_policy_argument_error():
    """``__fspath__`` returning bytes or an int was a bare TypeError from ``Path()``."""

    class Fs:
        def __init__(self, value):
            self.value = value

        def __fspath__(self):
            return self.value

    with pytest.raises(PolicyArgumentError, match=r"a path-like Fs whose __fspath__ returns bytes \(b'p.yaml'\): give"):
        load_policy(Fs(b"p.yaml"))
    with pytest.raises(PolicyArgumentError, match="a path-like Fs whose __fspath__ gives no str path: .*not int"):
        load_policy(Fs(5))
    with pytest.raises(PolicyArgumentError, match="whose __fspath__ returns bytes"):
        read_source(Fs(b"default"))
    assert load_policy(Fs("qwen3-omni")) == load_policy("qwen3-omni")


def test_a_bad_env_policy_names_the_variable(monkeypatch):
    """``OMNI_ACCUM_POLICY=nope`` said "'nope' is neither a policy file nor a preset", not where 'nope' came from."""
    monkeypatch.setenv(ENV_POLICY, "nope")
    for call in (load_policy, omni_accum.Sender, omni_accum.Receiver):
        with pytest.raises(PolicyError, match=f"^{ENV_POLICY}=nope: 'nope' is neither a policy file nor a preset. "
                           "Available presets: "):  # fmt: skip
            call()
    monkeypatch.setenv(ENV_POLICY, "missing/p.yaml")
    with pytest.raises(PolicyError, match=f"^{ENV_POLICY}=missing/p.yaml: missing/p.yaml: no such policy file"):
        load_policy(None)
    with pytest.raises(PolicyError, match="^'nope' is neither"):  # given as an argument: no variable to name
        load_policy("nope")


@pytest.mark.parametrize("word", ["off", "None", "false", "NO", "0"])
def test_every_off_word_of_the_switches_is_no_policy_in_omni_accum_policy(monkeypatch, word):
    """``OMNI_ACCUM_POLICY=no`` was "'no' is neither a policy file nor a preset" (the plugin then installed nothing
    and logged an error), though every on/off switch takes ``no`` for off."""
    from omni_accum.switches import OFF

    monkeypatch.setenv(ENV_POLICY, word)
    assert load_policy(None) == load_policy("default")
    assert set(OFF) <= set(POLICY_OFF)


def test_an_empty_policy_argument_says_so():
    """``load_policy("")`` said "'.': is a directory"."""
    for empty in ("", "   "):
        with pytest.raises(PolicyError, match="an empty policy argument"):
            load_policy(empty)
        with pytest.raises(PolicyError, match="an empty policy argument"):
            read_source(empty)


def test_a_policy_error_names_its_source_once_per_problem():
    """``<mapping>: invalid policy:\\n  <mapping>: rules[0]...`` named the source twice."""
    with pytest.raises(PolicyError) as e:
        load_policy({"default": "catt", "rules": [{"match": "x", "strategy": "nope"}]})
    assert str(e.value).count("<mapping>") == 2 == len(e.value.errors)
    assert str(e.value).startswith("invalid policy:\n  <mapping>: default.strategy: unknown strategy 'catt'")
