"""docs/plugins.md documents every hook, and its complete example really works (datasette's habit)."""

from __future__ import annotations

import inspect
import re
import sys
import types
from pathlib import Path

import pytest
import torch

import omni_accum
from omni_accum import hookspecs
from omni_accum.testing import check_conformance, check_stream

DOC = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", doc_text(), flags=re.S | re.M)


def declared_hookspecs() -> list[str]:
    """Every function of omni_accum/hookspecs.py marked as a hookspec (not only those in ALL_HOOKS)."""
    return sorted(
        name
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(fn, f"{hookspecs.PROJECT}_spec")
    )


def test_all_hooks_lists_every_hookspec():
    assert declared_hookspecs() == sorted(hookspecs.ALL_HOOKS)


@pytest.mark.parametrize("hook", declared_hookspecs())
def test_every_hookspec_is_documented(hook):
    text = doc_text()
    assert f"### `{hook}`" in text, f"hook {hook} has no '### `{hook}`' section in {DOC}"
    section = text.split(f"### `{hook}`", 1)[1].split("\n#", 1)[0]
    assert len(section.split()) >= 25, f"the section of {hook} in {DOC} is too short to document it"
    params = list(inspect.signature(getattr(hookspecs, hook)).parameters)
    for p in params:
        assert p in section, f"parameter {p!r} of {hook} is not mentioned in its section of {DOC}"


def test_every_hookspec_has_a_docstring_with_an_example():
    for hook in declared_hookspecs():
        doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
        assert "Example::" in doc and "@omni_accum.hookimpl" in doc, hook


@pytest.fixture
def example_plugin(tmp_path, monkeypatch):
    """The complete example of docs/plugins.md, as a module, registered with a fresh manager.

    Imported from a file, as a user's would be (pydantic reads attribute docstrings from the source).
    """
    import importlib.util

    block = next(b for b in python_blocks() if "omni_accum_register_strategies" in b)
    path = tmp_path / "my_strategies.py"
    path.write_text(block, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("my_strategies", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "my_strategies", mod)
    spec.loader.exec_module(mod)
    m = omni_accum.StrategyManager(load_entrypoints=False)
    m.load_entrypoints([])
    m.register(mod, name="blocked_cat", distribution=("my-strategies", "0.1.0"))
    assert m.problems == []
    return m


def test_the_complete_example_registers_and_conforms(example_plugin):
    spec = example_plugin.spec("blocked_cat")
    assert spec.plugin == "blocked_cat" and spec.distribution == ("my-strategies", "0.1.0")
    assert spec.kinds == frozenset({"append"}) and spec.params_grid
    for params in ({}, {"block": 1}, {"block": 3}):
        check_conformance("blocked_cat", params, manager=example_plugin, max_examples=25, max_chunks=60)


def test_the_complete_example_works_from_a_policy(example_plugin):
    policy = omni_accum.load_policy(
        {"default": "cat", "rules": [{"match": "embed.prefill", "strategy": "blocked_cat", "params": {"block": 16}}]},
        manager=example_plugin,
    )
    rx = omni_accum.Receiver(policy, manager=example_plugin)
    chunks = [torch.randn(3, 4) for _ in range(40)]
    for c in chunks:
        view = rx.merge("r", {"embed": {"prefill": c}})
    assert torch.equal(view["embed"]["prefill"], torch.cat(chunks))
    with pytest.raises(omni_accum.PolicyError, match="blok"):
        omni_accum.load_policy(
            {"rules": [{"match": "x", "strategy": "blocked_cat", "params": {"blok": 4}}]}, manager=example_plugin
        )


def test_the_documented_test_and_selection_hook_run(example_plugin):
    ns: dict = {}
    for block in python_blocks():
        if "omni_accum_register_strategies" not in block:
            exec(compile(block, str(DOC), "exec"), ns)
    omni_accum.reset_manager(example_plugin)
    ns["test_blocked_cat_conforms"](
        lambda name, params: check_conformance(name, params, max_examples=10, max_chunks=30)
    )
    selector = types.SimpleNamespace(omni_accum_select_strategy=ns["omni_accum_select_strategy"])
    example_plugin.register(selector, name="long_context")
    tx = omni_accum.Sender(
        {"default": "cat"}, manager=example_plugin, context=omni_accum.StreamContext(context_len=20000)
    )
    assert tx.strategy_for("embed.decode", torch.zeros(1, 4)) == "prealloc"
    assert tx.strategy_for("ids.output", [1]) == "cat"
    check_stream("cat", [{"a": [1]}, {"a": [2]}], manager=example_plugin)


def _storage_bytes(*tensors):
    """Bytes of the distinct storages behind ``tensors`` (what a state really holds)."""
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_the_complete_example_reports_what_it_holds(example_plugin):
    from omni_accum.strategy import KeyInfo

    spec = example_plugin.spec("blocked_cat")
    strategy = spec.factory(spec.params_model(block=4))
    acc = strategy.new_accumulator(KeyInfo(path="embed.prefill", request_id="r"))
    chunks = [torch.randn(3, 8) for _ in range(10)]
    for i, c in enumerate(chunks):
        if i:
            projected = acc.projected_nbytes(c)
        acc.merge(c)
        acc.read()
        held = _storage_bytes(*acc._blocks, *acc._tail, acc._view)
        assert acc.nbytes() >= held, (i, acc.nbytes(), held)
        if i:
            assert projected >= held, (i, projected, held)


def test_the_complete_example_documents_its_params(example_plugin):
    from omni_accum.cli.policy import param_rows

    rows = param_rows(example_plugin.spec("blocked_cat").params_model)
    assert rows[0]["name"] == "block" and "joined into one tensor" in (rows[0]["description"] or "")


def test_append_accumulator_docs_name_every_abstract_method():
    from omni_accum.strategy import AppendAccumulator

    for name in AppendAccumulator.__abstractmethods__:
        assert name in (AppendAccumulator.__doc__ or ""), name
        assert f"`{name}(" in doc_text(), name
    assert "`tensor_nbytes()`" in doc_text()
