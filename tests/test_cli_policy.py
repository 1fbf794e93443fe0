"""``omni-accum strategies | validate | explain | show`` (in-process through cli.main)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

import omni_accum
from omni_accum import cli
from omni_accum.policy.loader import load_policy
from omni_accum.manager import get_manager
from omni_accum.policy import Policy

STRATEGIES = ["cat", "prealloc", "replace", "send_once", "token_list"]  # built-ins; plugins may add more


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def usage(capsys, *argv):
    with pytest.raises(SystemExit) as ei:
        cli.main(list(argv))
    out, err = capsys.readouterr()
    return ei.value.code, out, err


@pytest.mark.parametrize("command", ["strategies", "validate", "explain", "show"])
def test_every_command_has_help_with_examples(capsys, command):
    code, out, _ = usage(capsys, command, "--help")
    assert code == 0
    assert f"usage: omni-accum {command}" in out and "examples:" in out and f"omni-accum {command}" in out


def test_top_level_help_lists_the_commands(capsys):
    code, out, _ = usage(capsys, "--help")
    assert code == 0
    for c in ("strategies", "validate", "explain", "show"):
        assert c in out


# -- strategies -------------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--bogus"], "unrecognized arguments: --bogus (before COMMAND: -h, --version and -v;"),
        (["-x", "validate", "default"], "unrecognized arguments: -x (before COMMAND"),
        (["--ver"], "ambiguous option: --ver could match --version, --verbose"),
        (["-vx", "strategies"], "unrecognized arguments: -vx (before COMMAND"),
    ],
)
def test_an_option_before_the_command_that_omni_accum_lacks_is_named(capsys, argv, said):
    """`omni-accum --bogus` said only "the following arguments are required: COMMAND"."""
    code, _, err = usage(capsys, *argv)
    assert code == 2 and said in err and "required: COMMAND" not in err, err


def test_short_flags_together_before_the_command_are_still_taken(capsys):
    """-vv / -vh (argparse's short flags together) were not refused before the check of unknown options."""
    assert cli.main(["-vv", "strategies"]) == 0
    assert "prealloc" in capsys.readouterr().out
    code, out, _ = usage(capsys, "-vh")
    assert code == 0 and "usage: omni-accum" in out


def test_strategies_text(capsys):
    code, out, _ = run(capsys, "strategies")
    assert code == 0
    for name in STRATEGIES:
        assert f"\n{name}  [" in "\n" + out
    assert "prealloc  [append]  plugin 'prealloc' from omni-accum 0.1.0" in out
    assert "param growth_factor: float (default 2.0, > 1.0 and <= 16.0)" in out
    assert "param initial_capacity: int (default 64, >= 1 and <= 16777216)" in out


def test_strategies_json(capsys):
    code, out, _ = run(capsys, "strategies", "--json")
    assert code == 0
    data = json.loads(out)
    by_name = {s["name"]: s for s in data["strategies"]}
    assert set(STRATEGIES) <= set(by_name)
    pre = by_name["prealloc"]
    assert pre["kinds"] == ["append"] and pre["plugin"] == "prealloc"
    assert pre["distribution"] == {"name": "omni-accum", "version": "0.1.0"}
    params = {p["name"]: p for p in pre["params"]}
    assert params["growth_factor"]["default"] == 2.0 and params["growth_factor"]["constraints"] == ["> 1.0", "<= 16.0"]
    assert by_name["send_once"]["kinds"] == ["replace", "static"] and by_name["send_once"]["params"] == []
    assert data["problems"] == []
    assert params["initial_capacity"]["description"] == (
        "Rows allocated at the first append, at least (more when the key already holds more)."
    )


def test_field_docstrings_are_read_when_printed_not_when_a_model_is_built():
    """pydantic's use_attribute_docstrings read every model's field docstrings when its class was built: about a
    second of each stage process (its frame search scans every module vLLM loaded). No model of omni-accum or of a
    built-in strategy asks for it; ``strategies`` reads the docstrings from the source, a base's too, and a model
    with no source has none (no error)."""
    import inspect

    from pydantic import BaseModel, Field, create_model

    import omni_accum
    from omni_accum.cli.policy import field_docstrings
    from omni_accum.manager import get_manager

    built = [s.params_model for s in get_manager().specs() if (s.distribution or ("",))[0] == "omni-accum"]
    for mod in [m for name, m in sys.modules.items() if name == "omni_accum" or name.startswith("omni_accum.")]:
        built += [c for _, c in inspect.getmembers(mod, inspect.isclass) if issubclass(c, BaseModel)]
    assert len(built) > 10
    asked = {f"{c.__module__}.{c.__qualname__}" for c in built if c.model_config.get("use_attribute_docstrings")}
    assert sorted(asked) == [], asked
    assert omni_accum.Policy in built

    assert field_docstrings(create_model("Runtime", x=(int, 1))) == {}  # built at run time: no source
    PreallocParams = get_manager().spec("prealloc").params_model
    docs = field_docstrings(PreallocParams)
    assert docs["growth_factor"] == "Capacity multiplier when the buffer is full (> 1)."
    assert set(docs) == {"initial_capacity", "growth_factor", "reuse_bytes"}

    class Sub(PreallocParams):
        growth_factor: float = Field(default=3.0, gt=1.0)
        """Overridden."""

    sub = field_docstrings(Sub)
    assert sub["growth_factor"] == "Overridden." and sub["initial_capacity"] == docs["initial_capacity"]

    class Again(PreallocParams):
        growth_factor: float = 3.0  # declared again, no docstring: none (as pydantic's flag gives)

    class Nested(BaseModel):
        a: int = 1
        """A docstring whose second line
is less indented than the class."""

    assert "growth_factor" not in field_docstrings(Again) and "initial_capacity" in field_docstrings(Again)
    assert field_docstrings(Nested) == {"a": "A docstring whose second line\nis less indented than the class."}


# -- validate ---------------------------------------------------------------------------------- #


def test_validate_presets_and_files(capsys, tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"default": "prealloc"}))
    code, out, err = run(capsys, "validate", "default", "qwen3-omni", "qwen3-omni-flat", str(good))
    assert code == 0 and err == ""
    assert "qwen3-omni: ok (13 rules)" in out and f"{good}: ok (0 rules)" in out


def test_validate_lists_every_error_of_every_file(capsys, tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text("default: catt\nrules:\n  - match: x\n    strategy: prealloc\n    params: {growth: 2}\n")
    b = tmp_path / "b.yaml"
    b.write_text("rules:\n  - match: [x\n")
    code, out, err = run(capsys, "validate", str(a), "qwen3-omni", str(b), "no-such-preset", str(tmp_path / "c.toml"))
    assert code == 1
    assert f"{a}: 2 error(s)" in out
    assert (
        f"{a}, line 1: default.strategy: unknown strategy 'catt'. Available: {', '.join(get_manager().names())}" in out
    )
    assert f"{a}, line 5: rules[0].params.growth: unknown param (strategy 'prealloc'" in out
    assert "qwen3-omni: ok" in out
    assert f"{b}: line 3" in out and "invalid YAML" in out
    assert "'no-such-preset' is neither a policy file nor a preset. Available presets: default" in out
    assert "c.toml: no such policy file" in out
    assert "4 of 5 policies invalid" in err


def test_validate_json(capsys, tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text("version: 3\n")
    code, out, _ = run(capsys, "validate", "--json", str(a), "default")
    assert code == 1
    data = json.loads(out)
    assert data["valid"] is False
    assert data["policies"][0] == {  # one shape for valid and invalid policies; errors as loc, line, msg
        "policy": str(a),
        "valid": False,
        "rules": None,
        "note": None,
        "errors": [{"loc": "version", "line": 1, "msg": "Input should be 1 (got 3)"}],
        "warnings": [],
    }
    assert data["policies"][1]["valid"] is True


@pytest.mark.parametrize(
    "argv",
    [
        ["validate"],
        ["validate", "--bogus", "default"],
        ["explain", "default"],
        ["explain", "default", "--key", "a", "--concurrency", "0"],
        ["explain", "default", "--key", "a", "--context-len", "-5"],
        ["explain", "default", "--key", "a", "--context-len", "0"],
        ["explain", "default", "--key", "a", "--context-len", "1k,2k"],
        ["explain", "default", "--key", "a", "--value-type", "int"],
        ["show"],
        ["nope"],
        [],
    ],
)
def test_usage_errors_exit_2(capsys, argv):
    code, out, err = usage(capsys, *argv)
    assert code == 2 and "usage: omni-accum" in err and "Traceback" not in err


def test_validate_python_tag_is_not_executed(capsys, tmp_path):
    marker = tmp_path / "pwned"
    p = tmp_path / "evil.yaml"
    p.write_text(f"default: !!python/object/apply:os.system ['touch {marker}']\n")
    code, out, _ = run(capsys, "validate", str(p))
    assert code == 1 and "YAML tags that build Python objects are not allowed" in out and "line 1" in out
    assert not marker.exists()


# -- explain ----------------------------------------------------------------------------------- #


def explain(capsys, *argv):
    code, out, _ = run(capsys, "explain", *argv, "--json")
    assert code == 0
    return json.loads(out)


@pytest.mark.parametrize(
    "command, needed",
    [("validate", []), ("bench", []), ("tune", ["--out", "t.yaml"]), ("trace", []), ("doctor", []),
     ("ab", ["--metrics", "m.txt"])],
)  # fmt: skip
def test_an_unknown_option_after_a_command_is_that_commands_usage_error(capsys, command, needed):
    """It was reported as the top-level parser's ("omni-accum: error: ...", its usage naming no command)."""
    with pytest.raises(SystemExit) as e:
        cli.main([command, *needed, "--jsn", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"omni-accum {command}: error: unrecognized arguments: --jsn" in err, err
    assert f"usage: omni-accum {command} " in err


@pytest.mark.parametrize(
    "argv, said",
    [(["bench", "--context-lens", "-1k"], "argument --context-lens: expected positive integers such as 1000,8000 or "
      "1k,8k, got '-1k'"),
     (["bench", "--concurrency", "-5,8"], "argument --concurrency: expected positive integers such as 1,10, got "
      "'-5,8'"),
     (["bench", "--context-lens", "1k,,8k"], "argument --context-lens: expected positive integers such as 1000,8000 "
      "or 1k,8k, got '1k,,8k' (an empty item between commas)"),
     (["tune", "--out", "t.yaml", "--concurrency", "1,"], "got '1,' (an empty item between commas)")],
)  # fmt: skip
def test_a_negative_looking_value_is_named_as_a_bad_value_not_a_missing_one(capsys, argv, said):
    """argparse took '-1k' for an option ("expected at least one argument"), naming no value."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_explain_exact_rule(capsys):
    d = explain(capsys, "qwen3-omni", "--key", "embed.decode")
    assert d["strategy"] == "prealloc" and d["params"] == {"initial_capacity": 64, "growth_factor": 2.0, "reuse_bytes": 0}
    assert d["reason"] == {
        "kind": "rule",
        "rule_index": 2,
        "match": "embed.decode",
        "glob": False,
        "description": "one [1, 2048] row per decode step",
    }
    assert d["value_type"] == "tensor" and d["kinds"] == ["append"]


def test_explain_glob_default_and_protocol(capsys, tmp_path):
    d = explain(capsys, "qwen3-omni", "--key", "embed.tts_pad")
    assert d["strategy"] == "send_once" and d["reason"]["glob"] and d["reason"]["match"] == "embed.tts_*"
    d = explain(capsys, "qwen3-omni", "--key", "ids.all", "--value-type", "list")
    assert d["strategy"] == "cat" and d["reason"] == {"kind": "default"} and d["value_type"] == "list"
    p = tmp_path / "p.yaml"
    p.write_text(
        "default: token_list\nrules:\n  - {match: 'a.*', strategy: cat}\n  - {match: 'a.b*', strategy: replace}\n"
    )
    d = explain(capsys, str(p), "--key", "meta.finished")
    assert d["strategy"] == "replace" and d["reason"]["kind"] == "protocol"
    d = explain(capsys, str(p), "--key", "a.bc")
    assert d["reason"]["rule_index"] == 0 and any("a.b*" in n for n in d["notes"])


def test_explain_of_a_key_no_release_sends_says_so_and_suggests_the_closest(capsys):
    """A typo silently took the policy's default."""
    d = explain(capsys, "qwen3-omni", "--key", "embed.decod")
    assert d["reason"] == {"kind": "default"}
    assert any("'embed.decod' is not a key a supported vllm-omni release sends" in n and "'embed.decode'" in n
               for n in d["notes"]), d["notes"]  # fmt: skip
    d = explain(capsys, "qwen3-omni", "--key", "ids.all", "--value-type", "list")  # sent, default: no such note
    assert not any("is not a key" in n for n in d["notes"])
    d = explain(capsys, "qwen3-omni", "--key", "thinker_embeddings")  # 0.16's flat key: sent by a supported release
    assert not any("is not a key" in n for n in d["notes"])


def test_explain_text_says_why_and_what_it_assumed(capsys):
    code, out, _ = run(capsys, "explain", "qwen3-omni", "--key", "speaker", "--context-len", "8000")
    assert code == 0
    assert "key 'speaker' -> send_once (no params)" in out
    assert "why: rules[4] exact match 'speaker'" in out
    assert "assumed: value type 'tensor' (--value-type), context_len 8000, concurrency 1" in out
    assert "no tuned table" in out
    code, out, _ = run(capsys, "explain", "default", "--key", "codes.audio")
    assert "why: the policy's default (no rule matches, no tuned table)" in out


def test_explain_tuned_bucket(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(Policy, "tuned_usable", lambda self: True)
    p = tmp_path / "tuned.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "default": "cat",
                "tuned": {
                    "context_len_edges": [0, 8000],
                    "concurrency_edges": [1, 10],
                    "cells": [
                        {
                            "key": "embed.prefill",
                            "context_len": 8000,
                            "concurrency": 10,
                            "strategy": "prealloc",
                            "params": {"growth_factor": 1.5},
                        }
                    ],
                },
            }
        )
    )
    d = explain(capsys, str(p), "--key", "embed.prefill", "--context-len", "9000", "--concurrency", "12")
    assert d["strategy"] == "prealloc" and d["params"]["growth_factor"] == 1.5
    assert d["reason"] == {"kind": "tuned", "context_len_bucket": 8000, "concurrency_bucket": 10, "clamped": True,
                           "baseline": "default", "margin": None, "ci": None, "decision": None}  # the cell's record
    d = explain(capsys, str(p), "--key", "embed.prefill", "--context-len", "100")
    assert d["reason"] == {"kind": "default"} and "tuned table has no cell" in " ".join(d["notes"])


def test_explain_stale_tuned_table_says_so(capsys, tmp_path):
    p = tmp_path / "tuned.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "tuned": {
                    "context_len_edges": [0],
                    "concurrency_edges": [1],
                    "fingerprint": {"torch": "0.0"},
                    "cells": [{"key": "k", "context_len": 0, "concurrency": 1, "strategy": "prealloc"}],
                },
            }
        )
    )
    d = explain(capsys, str(p), "--key", "k")
    assert d["strategy"] == "cat" and any("tuned table not used" in n for n in d["notes"])


def test_explain_plugin_override(capsys):
    import omni_accum
    from omni_accum.manager import StrategyManager, reset_manager
    from omni_accum.policy import StrategyChoice

    class Override:
        @omni_accum.hookimpl
        def omni_accum_select_strategy(self, key, meta, context, policy):
            return StrategyChoice("token_list", {}, "plugin") if meta.value_type == "list" else None

    m = StrategyManager()
    m.pm.register(Override(), name="override")
    reset_manager(m)
    d = explain(capsys, "default", "--key", "ids.all", "--value-type", "list")
    assert d["strategy"] == "token_list" and d["reason"]["kind"] == "plugin"
    assert explain(capsys, "default", "--key", "ids.all")["strategy"] == "cat"


def test_explain_does_not_say_the_context_is_unused_when_a_selection_plugin_may_read_it(capsys):
    import omni_accum
    from omni_accum.manager import StrategyManager, reset_manager
    from omni_accum.policy import StrategyChoice

    class ByContext:  # docs/plugins.md's example: prealloc from 16k on
        @omni_accum.hookimpl
        def omni_accum_select_strategy(self, key, meta, context, policy):
            long = (context.context_len or 0) >= 16000
            return StrategyChoice("prealloc", {}, "plugin") if long and key == "embed.prefill" else None

    plain = explain(capsys, "default", "--key", "embed.prefill", "--context-len", "32k")
    assert any("do not change the choice" in n for n in plain["notes"]), plain["notes"]  # no plugin: it is so
    m = StrategyManager()
    m.pm.register(ByContext(), name="by-context")
    reset_manager(m)
    long, short = (explain(capsys, "default", "--key", "embed.prefill", "--context-len", n) for n in ("32k", "8k"))
    assert (long["strategy"], short["strategy"]) == ("prealloc", "cat")  # the context did change the choice
    for d in (long, short):
        assert not any("do not change the choice" in n for n in d["notes"]), d["notes"]
        assert any("only through the selection plugin(s)" in n and "by-context" in n for n in d["notes"]), d["notes"]


def test_explain_and_show_invalid_policy_is_a_usage_error_without_traceback(capsys, tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("default: nope\n")
    for argv in (["explain", str(p), "--key", "a"], ["show", str(p)], ["show", "nope"]):
        code, _, err = run(capsys, *argv)
        assert code == 2 and err.startswith(f"omni-accum {argv[0]}: error: ")  # the command's own prefix, exit 2


# -- show -------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", ["default", "qwen3-omni", "qwen3-omni-flat"])
def test_show_is_a_valid_equivalent_policy(capsys, tmp_path, name):
    code, out, _ = run(capsys, "show", name)
    assert code == 0 and out.startswith(f"# {name}, resolved")
    data = yaml.safe_load(out)
    assert all("params" in r for r in data["rules"]) and "params" in data["default"]
    original = load_policy(name)
    shown = load_policy(data)
    for key in ["embed.decode", "embed.tts_bos", "meta.finished", "ids.all", "thinker_embeddings", "speaker"]:
        a, b = original.resolve(key), shown.resolve(key)
        assert a.strategy == b.strategy and a.source == b.source
    code, out, _ = run(capsys, "show", name, "--json")
    assert json.loads(out) == data


def test_show_fills_param_defaults(capsys, tmp_path):
    p = tmp_path / "p.toml"
    p.write_text('default = "prealloc"\n')
    code, out, _ = run(capsys, "show", str(p), "--json")
    assert json.loads(out)["default"] == {
        "strategy": "prealloc",
        "params": {"initial_capacity": 64, "growth_factor": 2.0, "reuse_bytes": 0},
    }


def test_console_script_runs(tmp_path):
    """The installed ``omni-accum`` entry point, as a user runs it."""
    r = subprocess.run(
        [sys.executable, "-m", "omni_accum.cli", "validate", "qwen3-omni"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "qwen3-omni: ok (13 rules)"


# -- docs/policies.md (the README's former "Policies" section): the commands shown work as written -- #


def _readme_policies() -> str:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "policies.md").read_text(encoding="utf-8")
    return text.split("<!-- section: policies -->", 1)[1].split("<!-- /section: policies -->", 1)[0]


def test_readme_policies_section_runs_as_written(capsys, tmp_path, monkeypatch):
    import re

    section = _readme_policies()
    example = re.search(r"```yaml\n(# my-policy.yaml.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-policy.yaml").write_text(example)
    sessions = re.findall(r"```console\n(.*?)```", section, re.S)
    assert len(sessions) == 2
    checked = 0
    for session in sessions:
        for block in re.split(r"^\$ ", session, flags=re.M)[1:]:
            cmd, _, expected = block.partition("\n")
            argv = cmd.split()
            if argv[0] == "cat":  # the shown file content: create it
                (tmp_path / argv[1]).write_text(expected)
                continue
            assert argv[0] == "omni-accum"
            code, out, _ = run(capsys, *argv[1:])
            want = expected.rstrip("\n")
            if "Available: " in want:  # installed plugins may add strategies to the list
                want = re.sub(r"Available: [^\n]*", "Available: " + ", ".join(get_manager().names()), want)
            assert out.rstrip("\n") == want, cmd
            checked += 1
    assert checked == 3


def test_validate_refuses_a_policy_a_sender_or_receiver_would_refuse(capsys, tmp_path):
    """A strategy that rewrites meta.override_keys' wire form passes the schema, but no endpoint accepts it."""
    import omni_accum_delta  # noqa: F401 - the example plugin (scripts/env.sh installs it): a rewriting strategy

    for text in ("default: delta\n", "rules:\n  - {match: meta.override_keys, strategy: delta}\n"):
        f = tmp_path / "p.yaml"
        f.write_text(text)
        code, out, err = run(capsys, "validate", str(f))
        assert code == 1 and "1 error(s)" in out and f"{f}: meta.override_keys gets strategy 'delta'" in out, out
        with pytest.raises(omni_accum.PolicyError):
            omni_accum.Receiver(str(f))
    f.write_text("default: delta\nhonor_override_keys: false\n")
    assert run(capsys, "validate", str(f))[0] == 0


def test_validate_says_when_a_file_is_the_default_policy(capsys, tmp_path):
    """An empty (or truncated to nothing) file is valid, and means the default policy: validate says so."""
    f = tmp_path / "p.yaml"
    f.write_text("# nothing yet\n")
    code, out, _ = run(capsys, "validate", str(f), "default", "qwen3-omni")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"{f}: ok (0 rules; same as the default policy: vllm-omni 0.30.0's behaviour)"
    assert "same as" not in lines[1] + lines[2]


def test_explain_takes_8k_and_verbose_after_the_command(capsys):
    code, out, _ = run(capsys, "explain", "qwen3-omni", "--key", "embed.decode", "--context-len", "8k", "-v")
    assert code == 0 and "context_len 8000" in out


def test_strategies_lists_the_policy_presets_with_their_descriptions(capsys):
    from omni_accum.cli import main as cli_main
    from omni_accum.policy.loader import preset_names

    assert cli_main(["strategies"]) == 0
    out = capsys.readouterr().out.split("\npresets", 1)
    assert len(out) == 2
    for name in preset_names():
        assert f"\n{name}\n    " in out[1]
    assert cli_main(["strategies", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {p["name"] for p in doc["presets"]} == set(preset_names()) and all(p["description"] for p in doc["presets"])


def test_a_reader_that_stops_reading_is_not_an_error(monkeypatch, capsys):
    """``omni-accum strategies | head -1``: the closed pipe ends the command quietly, exit 0."""

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert cli.main(["strategies"]) == 0
    assert "error" not in capsys.readouterr().err


def test_an_unknown_strategy_is_reported_on_its_own_line(tmp_path, capsys):
    """It was reported on the rule's first line (the match), not the strategy's."""
    from omni_accum.cli import main

    f = tmp_path / "p.yaml"
    f.write_text("rules:\n  - match: embed.prefill\n    strategy: prealoc\n")
    assert main(["validate", str(f)]) == 1
    assert f"{f}, line 3: rules[0].strategy: unknown strategy 'prealoc'" in capsys.readouterr().out


def test_show_of_policy_text_on_several_lines_is_itself_a_valid_policy(capsys, tmp_path):
    """Its header comment copied the text, so its second line fell outside the comment: not valid YAML."""
    code, out, _ = run(capsys, "show", "default: cat\nrules: []")
    assert code == 0 and out.startswith("# <inline>, resolved")
    f = tmp_path / "shown.yaml"
    f.write_text(out)
    assert run(capsys, "validate", str(f))[0] == 0 and load_policy(str(f)).default.strategy == "cat"


def test_validate_takes_policy_text_longer_than_a_file_name(capsys):
    long_text = "description: " + "x" * 300 + "\ndefault: replace\n"
    code, out, err = run(capsys, "validate", long_text)
    assert code == 0 and "<inline>" in out and "OSError" not in out + err and "too long" not in out + err
    code, out, err = run(capsys, "show", long_text)
    assert code == 0 and "replace" in out
    code, out, err = run(capsys, "validate", "default: catt\n# " + "x" * 300)
    assert code == 1 and "unknown strategy 'catt'" in out + err and "OSError" not in out + err


def test_the_installed_command_takes_long_policy_text():
    """The console script (``omni-accum = omni_accum.cli:main``), as a user runs it."""
    long_text = "description: " + "x" * 300 + "\ndefault: replace\n"
    script = "import sys, omni_accum.cli; sys.exit(omni_accum.cli.main())"
    r = subprocess.run(
        [sys.executable, "-c", script, "validate", long_text],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_a_list_and_a_binary_file_are_named_for_what_they_are(capsys, tmp_path):
    """``validate '[1,2]'`` is policy text that is not a mapping (it read "neither a policy file nor a preset"); a
    file that is not UTF-8 names the byte (it read "'utf-8' codec can't decode byte 0xc1 ...")."""
    code, out, err = run(capsys, "validate", "[1,2]")
    assert code == 1 and "a policy must be a mapping with keys like 'default' and 'rules', got list" in out + err
    binary = tmp_path / "p.yaml"
    binary.write_bytes(b"default: cat\n\xc1\xc2")
    code, out, err = run(capsys, "validate", str(binary))
    assert code == 1 and "not UTF-8 text (byte 0xc1 at offset 13)" in out + err and "codec" not in out + err


@pytest.mark.parametrize("key", ["", " ", "\t"])
def test_explain_of_a_blank_key_names_what_was_given(capsys, key):
    """A key of blanks was reported as got '' (the value given was not the one named)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["explain", "qwen3-omni", "--key", key])
    err = capsys.readouterr().err
    said = f"argument --key: expected a key path such as embed.decode or thinker_embeddings, got {key!r} (a blank key)"
    assert e.value.code == 2 and said in err, err


@pytest.mark.parametrize("command", ["show", "explain"])
def test_show_and_explain_read_a_policy_from_stdin_as_validate_does(command, monkeypatch, capsys):
    """``validate -`` read stdin; ``show -`` and ``explain -`` said "'-' is neither a policy file nor a preset", and
    their --help did not say inline text works."""
    import io

    extra = ["--key", "x"] if command == "explain" else []
    monkeypatch.setattr(sys, "stdin", io.StringIO("default: prealloc\n"))
    assert cli.main([command, "-", *extra]) == 0
    out = capsys.readouterr().out
    assert ("key 'x' -> prealloc" in out) if command == "explain" else out.startswith("# <stdin>, resolved"), out
    monkeypatch.setattr(sys, "stdin", io.StringIO("default: nope\n"))
    assert cli.main([command, "-", *extra]) == 2
    assert "<stdin>, line 1: default.strategy: unknown strategy 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    assert "'-' reads stdin; inline YAML/JSON text" in " ".join(capsys.readouterr().out.split())


def test_explain_json_names_stdin_as_show_and_validate_do(monkeypatch, capsys):
    """``explain - --json`` said ``"policy": "-"`` where ``show -`` prints ``<stdin>``: its answer and its errors."""
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("default: prealloc\n"))
    assert cli.main(["explain", "-", "--key", "x", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == "<stdin>"
    monkeypatch.setattr(sys, "stdin", io.StringIO("default: nope\n"))
    assert cli.main(["explain", "-", "--key", "x", "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "<stdin>" and out["valid"] is False and "unknown strategy 'nope'" in out["errors"][0]["msg"]


def test_a_command_hides_vllm_s_info_lines_unless_asked(monkeypatch):
    """vLLM logs its platform and vllm-omni's patches at INFO when a command imports it (five lines before doctor's
    report): a command runs with VLLM_LOGGING_LEVEL=WARNING unless -v or the user's own value, unset after."""
    import argparse
    import importlib
    import os

    cli_main = importlib.import_module("omni_accum.cli.main")  # (the package's ``main`` is the function)

    seen = []
    real = cli_main.build_parser

    def build():
        parser = real()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices["strategies"].set_defaults(func=lambda args: seen.append(os.environ.get("VLLM_LOGGING_LEVEL")))
        return parser

    monkeypatch.setattr(cli_main, "build_parser", build)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    assert cli_main.main(["strategies"]) == 0
    assert "VLLM_LOGGING_LEVEL" not in os.environ  # the caller's environment as it was
    assert cli_main.main(["strategies", "-v"]) == 0
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert cli_main.main(["strategies"]) == 0
    assert seen == ["WARNING", None, "DEBUG"] and os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
