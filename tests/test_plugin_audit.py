"""What a plugin author's audit found: the kit passing views that are not bit for bit torch.cat's, a Params validator
raising a raw traceback, unclear messages for a non-plugin entry point and bad kit params, and docs that misled."""

from __future__ import annotations

import re
import sys
import types
from importlib import metadata
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel, ConfigDict, field_validator

import omni_accum
from omni_accum import cli
from omni_accum.errors import PluginError, PolicyError
from omni_accum.manager import reset_manager
from omni_accum.strategy import Strategy, StrategySpec
from omni_accum.testing import check_conformance
from tests.test_conformance import _Chunks as _Cat  # chunks kept apart, torch.cat on read: the reference's bits
from tests.test_docs_hooks import example_plugin  # noqa: F401 - the fixture: docs/plugins.md's example, registered

DOC = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


class _P(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _PlusZero(_Cat):
    def read_tensor(self):  # the bug: -0.0 + 0.0 is 0.0 (equal, not the same bits)
        t = super().read_tensor()
        return t + 0.0 if t.is_floating_point() else t


class _IntViaFloat(_Cat):
    def read_tensor(self):  # the bug: int64 through float32 is exact only below 2**24
        t = super().read_tensor()
        return t.float().to(t.dtype) if t.dtype == torch.int64 else t


class _ModeParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    mode: str = "ok"

    @field_validator("mode")
    @classmethod
    def _check(cls, v):  # the plugin's bug: errors other than ValueError escape pydantic as they are
        if v == "typeerror":
            raise TypeError("validator bug: TypeError")
        if v == "keyerror":
            raise KeyError("validator bug")
        return v


def _manager(*specs: StrategySpec) -> omni_accum.StrategyManager:
    mgr = omni_accum.StrategyManager(load_entrypoints=False)
    mgr.load_entrypoints([])

    class Plugin:
        @omni_accum.hookimpl
        def omni_accum_register_strategies(self):
            return list(specs)

    mgr.register(Plugin(), name="audit", distribution=("audit-strategies", "0.1.0"))
    return mgr


def _strategy(name: str, acc: type, params: type[BaseModel] = _P, **attrs) -> StrategySpec:
    cls = type(name, (Strategy,), {"name": name, "Params": params, "new_accumulator": lambda self, key: acc(key),
                                   **attrs})  # fmt: skip
    return StrategySpec(name=name, factory=cls, params_model=params, kinds=frozenset({"append"}))


# 1 ------------------------------------------------------------------------------------------------------------ #


@pytest.mark.parametrize(
    ("name", "acc", "mismatch"),
    [
        ("plus_zero", _PlusZero, r"(-0\.0 != 0\.0|nan \(bits 0x[0-9a-f]+\) != nan \(bits 0x[0-9a-f]+\))"),  # a NaN's sign
        # and payload: bf16 + 0.0 loses them (the message gives two such NaNs' bits)
        ("int_via_float", _IntViaFloat, r"-?\d{10,} != -?\d{10,}"),
    ],
)
def test_the_kit_fails_a_view_that_is_equal_but_not_bit_for_bit_torch_cat(name, acc, mismatch):
    mgr = _manager(_strategy(name, acc))
    with pytest.raises(AssertionError, match=rf"(?s)view differs from the reference.*{mismatch}"):
        check_conformance(name, manager=mgr, max_examples=30, max_chunks=12)


def test_the_kit_s_streams_carry_edge_values_that_torch_cat_keeps():
    from hypothesis import given, settings

    from omni_accum.testing import payload_streams, same_bits

    seen: set[str] = set()

    @settings(max_examples=60, database=None)
    @given(stream=payload_streams(max_chunks=8))
    def collect(stream):
        for chunk in stream:
            for v in chunk.values():
                for t in v.values() if isinstance(v, dict) else [v]:
                    if not isinstance(t, torch.Tensor) or not t.numel() or t.dtype == torch.bool:
                        continue
                    if t.is_floating_point():
                        f = t.float()
                        seen.update(k for k, hit in (("-0.0", (f == 0) & f.signbit()), ("nan", f.isnan()),
                                                     ("inf", f.isinf())) if bool(hit.any()))  # fmt: skip
                    elif bool((t.abs() > 2**24).any()):
                        seen.add("int64 beyond float32")
                    assert same_bits(torch.cat([t, t]), torch.cat([t.clone(), t.clone()]))

    collect()
    assert seen == {"-0.0", "nan", "inf", "int64 beyond float32"}


# 2 ------------------------------------------------------------------------------------------------------------ #


@pytest.mark.parametrize(("mode", "exc"), [("typeerror", "TypeError"), ("keyerror", "KeyError")])
def test_a_params_validator_raising_another_error_is_a_policy_error(tmp_path, capsys, mode, exc):
    mgr = _manager(_strategy("moded", _Cat, _ModeParams))
    reset_manager(mgr)
    policy = {"default": "cat", "rules": [{"match": "x", "strategy": "moded", "params": {"mode": mode}}]}
    path = tmp_path / "p.yaml"
    path.write_text(f"default: cat\nrules:\n  - match: x\n    strategy: moded\n    params: {{mode: {mode}}}\n")
    named = rf"strategy 'moded' \(plugin 'audit' \(distribution audit-strategies 0\.1\.0\)\).*{exc}.*'mode': '{mode}'"

    code = cli.main(["validate", str(path)])
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in out + err
    assert re.search(rf"line 5: rules\[0\]\.params: {named}", out + err), out + err
    with pytest.raises(PolicyError, match=named):
        omni_accum.load_policy(str(path), manager=mgr)
    for endpoint in (omni_accum.Sender, omni_accum.Receiver):
        with pytest.raises(PolicyError, match=named):
            endpoint(policy, manager=mgr)
    assert omni_accum.load_policy({"default": {"strategy": "moded", "params": {"mode": "fine"}}}, manager=mgr)


# 3 ------------------------------------------------------------------------------------------------------------ #


@pytest.mark.parametrize("bad", [True, "4", 4.0])
def test_the_documented_params_example_refuses_what_the_built_ins_refuse(example_plugin, bad):  # noqa: F811
    mgr = example_plugin
    with pytest.raises(PolicyError, match=r"block: Input should be a valid integer"):
        omni_accum.load_policy({"default": {"strategy": "blocked_cat", "params": {"block": bad}}}, manager=mgr)
    assert omni_accum.load_policy({"default": {"strategy": "blocked_cat", "params": {"block": 4}}}, manager=mgr)
    params = doc_text().split("### Params", 1)[1].split("\n### ", 1)[0]
    assert "strict=True" in params and "`block: true`" in params


# 4 ------------------------------------------------------------------------------------------------------------ #


def test_overriding_new_encoder_counts_as_rewriting_the_wire_and_is_documented():
    from omni_accum.engine.endpoint import rewrites_wire

    spec = _strategy("none_encoder", _Cat, new_encoder=lambda self, key: None)
    mgr = _manager(spec)
    assert rewrites_wire(mgr.build("none_encoder"))  # even though every encoder it makes is None
    with pytest.raises(PolicyError, match=r"meta\.override_keys gets strategy 'none_encoder'"):
        omni_accum.Receiver({"default": "none_encoder"}, manager=mgr)
    override = doc_text().split("### `meta.override_keys` must travel as itself", 1)[1].split("\n## ", 1)[0]
    assert "overrides `new_encoder`" in override and "returns `None`" in override
    assert "overrides `new_encoder`" in doc_text().split("## Testing with the conformance kit", 1)[0].split(
        "The same holds for a `read()` of the wrong type", 1)[1]  # fmt: skip


# 5 ------------------------------------------------------------------------------------------------------------ #


def test_an_entry_point_to_a_plain_value_says_what_it_is(monkeypatch):
    mod = types.ModuleType("oa_audit_thing")
    mod.THING = 42
    monkeypatch.setitem(sys.modules, "oa_audit_thing", mod)
    ep = metadata.EntryPoint(name="thing", value="oa_audit_thing:THING", group="omni_accum")
    mgr = omni_accum.StrategyManager(load_entrypoints=False)
    mgr.load_entrypoints([ep])
    assert mgr.problems == [("thing", "plugin 'thing': the entry point 'oa_audit_thing:THING' is an int (42), not a "
                                      "module, class instance or object with omni_accum hooks")]  # fmt: skip
    strict = omni_accum.StrategyManager(load_entrypoints=False, strict=True)
    with pytest.raises(PluginError, match=r"is an int \(42\), not a module"):
        strict.load_entrypoints([ep])
    with pytest.raises(PluginError, match=r"^plugin 'x': is a str \('abc'\), not a module, class instance"):
        strict.register("abc", name="x")


# 6 ------------------------------------------------------------------------------------------------------------ #


def test_the_kit_names_the_strategy_and_allowed_params_for_bad_params():
    with pytest.raises(PluginError, match=r"conformance kit: strategy 'cat' .* refuses params \{'blok': 3\}: blok: "
                                          r"unknown param \(allowed params: none\)"):  # fmt: skip
        check_conformance("cat", {"blok": 3})
    with pytest.raises(PluginError, match=r"strategy 'prealloc' .* initial_capacity: .*allowed params: "):
        check_conformance("prealloc", {"initial_capacity": 0})


# 7 ------------------------------------------------------------------------------------------------------------ #


def test_the_plugin_docs_name_what_an_author_trips_on():
    doc = doc_text()
    if "use_attribute_docstrings" in doc:  # pydantic 2.7 added it, and omni-accum itself needs 2.7
        assert "pydantic>=2.6" not in doc and "pydantic>=2.7" in doc
    table = doc.split("What an `AppendAccumulator` subclass writes:", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in table.splitlines() if line.startswith("| `read_tensor()`"))
    assert "0-d" in row and "as it is" in row
    kit = doc.split("## Testing with the conformance kit", 1)[1].split("\n## ", 1)[0]
    assert "max_examples=" in kit and "shrink" in kit
