"""What a plugin author's mistakes look like: each one a single line that names the plugin, what is wrong and what
is expected, never a raw pydantic or pluggy dump and never a traceback from the CLI; a broken plugin costs only
itself."""

from __future__ import annotations

import logging

import pytest
import torch
from pydantic import BaseModel, ConfigDict

import omni_accum
from omni_accum.cli.main import main
from omni_accum.errors import AccumulationError, PluginError, PolicyError
from omni_accum.policy import StrategyChoice
from omni_accum.strategies.replace import ReplaceAccumulator
from omni_accum.strategy import Strategy, StrategySpec
from tests.test_manager import Latest, Params, m, registering  # noqa: F401 - m: the fixture


class Picky(Strategy):
    """A strategy whose factory refuses some params (a plugin's own check)."""

    name = "picky"
    Params = Params

    def __init__(self, params=None):
        super().__init__(params)
        if self.params.depth > 1:
            raise RuntimeError("depth > 1 unsupported")

    def new_accumulator(self, key):
        return ReplaceAccumulator()


def _plugin(*specs: StrategySpec, choose: StrategyChoice | None = None):
    class P:
        @omni_accum.hookimpl
        def omni_accum_register_strategies(self):
            return list(specs)

        if choose is not None:

            @omni_accum.hookimpl
            def omni_accum_select_strategy(self, key, meta, context, policy):
                return choose if key.startswith("embed.bad") else None

    return P()


def test_a_selection_hook_s_bad_params_fail_the_request_in_one_line(m):  # noqa: F811
    m.register(_plugin(choose=StrategyChoice("prealloc", {"growth": 1.5}, "plugin 'chooser'")), name="chooser")
    tx = omni_accum.Sender("default", manager=m)
    with pytest.raises(AccumulationError) as e:
        tx.encode("r", {"embed": {"bad": torch.ones(2, 3)}})
    msg = str(e.value)
    assert "\n" not in msg and "errors.pydantic.dev" not in msg, msg
    assert "key 'embed.bad': chosen by plugin 'chooser': strategy 'prealloc' (plugin 'prealloc') refuses params " in msg
    assert msg.count("embed.bad") == 1, msg
    assert "growth: unknown param (allowed params: initial_capacity (default 64), growth_factor" in msg
    tx.encode("r2", {"embed": {"good": torch.ones(2, 3)}})  # other keys and requests go on


def test_a_raising_factory_is_the_plugin_s_error_not_the_sender_s(m):  # noqa: F811
    spec = StrategySpec(name="picky", factory=Picky, params_model=Params, kinds=frozenset({"replace"}))
    m.register(_plugin(spec), name="pickyplugin", distribution=("picky-dist", "0.3"))
    with pytest.raises(PluginError) as e:  # the policy's default: the Sender refuses it, naming the plugin
        omni_accum.Sender({"default": {"strategy": "picky", "params": {"depth": 2}}}, manager=m)
    assert str(e.value) == (
        "default for meta.override_keys: strategy 'picky' (plugin 'pickyplugin' (distribution picky-dist 0.3)): its "
        "factory raised RuntimeError with params {'depth': 2}: depth > 1 unsupported"
    )


@pytest.mark.parametrize(
    ("spec_kwargs", "needle"),
    [
        ({"name": "upstream"}, "strategy name 'upstream' is reserved (bench arms and policy presets: upstream, "
                               "wire-floor, default, qwen3-omni"),  # fmt: skip
        ({"name": "qwen3-omni"}, "strategy name 'qwen3-omni' is reserved"),
        ({"name": "wrongdefault", "params_model": "Wrong"}, "params_model Wrong must validate with no arguments "
                                                            "(every param needs a default of its own type): n: "),  # fmt: skip
        ({"name": "strkinds", "kinds": "append"}, "kinds 'append' must be a set of ['append', 'replace', 'static']"),
        ({"name": "badgrid", "params_grid": ({"depth": 0},)}, "params_grid[0] invalid: depth: Input should be "
                                                              "greater than or equal to 1"),  # fmt: skip
    ],
)
def test_a_bad_strategy_record_is_one_line_naming_the_plugin(m, spec_kwargs, needle):  # noqa: F811
    class Wrong(BaseModel):
        model_config = ConfigDict(extra="forbid")
        n: int = "three"  # pydantic does not check a default

    kw = {"factory": Latest, "params_model": Params, "kinds": frozenset({"replace"}), **spec_kwargs}
    if kw["params_model"] == "Wrong":
        kw["params_model"] = Wrong
    with pytest.raises(PluginError) as e:
        m.register(_plugin(StrategySpec(**kw)), name="author")
    assert str(e.value).startswith("plugin 'author': ") and needle in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    assert m.pm.get_plugin("author") is None and kw["name"] not in m.names()


def test_hook_mistakes_name_the_hooks(m):  # noqa: F811
    class Misspelt:
        @omni_accum.hookimpl
        def omni_accum_register_strategy(self):
            return []

    with pytest.raises(PluginError) as e:
        m.register(Misspelt(), name="misspelt")
    assert str(e.value) == (
        "plugin 'misspelt': unknown hook 'omni_accum_register_strategy' (omni_accum's hooks: "
        "omni_accum_register_strategies, omni_accum_select_strategy); did you mean 'omni_accum_register_strategies'?"
    )

    class Unmarked:  # the hook written, the marker forgotten: nothing would ever call it
        def omni_accum_register_strategies(self):
            return [StrategySpec(name="nodeco", factory=Latest, params_model=Params)]

    with pytest.raises(PluginError, match=r"^plugin 'unmarked': implements no omni_accum hook \(mark "
                                          r"omni_accum_register_strategies with @omni_accum.hookimpl\)$"):  # fmt: skip
        m.register(Unmarked(), name="unmarked")
    assert m.pm.get_plugin("unmarked") is None

    class WrongArgs:
        @omni_accum.hookimpl
        def omni_accum_select_strategy(self, key, ctx):
            return None

    with pytest.raises(PluginError) as e:
        m.register(WrongArgs(), name="wrongargs")
    assert "\n" not in str(e.value) and "ctx" in str(e.value), str(e.value)


def test_a_taken_plugin_name_says_whose_it_is(m):  # noqa: F811
    with pytest.raises(PluginError) as e:
        m.register(registering("mine"), name="prealloc", distribution=("acme", "1.0"))
    assert str(e.value) == (
        "plugin 'prealloc' (distribution acme 1.0): cannot register: the name 'prealloc' is taken by omni-accum's "
        "built-in strategy plugin; give the entry point another name"
    )
    one = registering("a")
    m.register(one, name="first")
    with pytest.raises(PluginError, match="the same object is already registered as plugin 'first'"):
        m.register(one, name="second")


def test_an_empty_registration_is_warned_about(m, caplog):  # noqa: F811
    with caplog.at_level(logging.WARNING, logger="omni_accum"):
        m.register(_plugin(), name="empty")
    assert "plugin 'empty': omni_accum_register_strategies returned no strategy" in caplog.text


def test_a_tuned_table_whose_winner_is_gone_is_stale_not_invalid(m, capsys, tmp_path):  # noqa: F811
    """A table measured with a plugin's strategy, loaded where that plugin is not: the policy loads, the table
    is stale (ignored at run time, with a warning), and validate says so (an error, or a warning with
    --allow-stale), naming the plugin as not loaded."""
    from omni_accum.policy.fingerprint import current_fingerprint, plugin_versions

    m.register(registering("chunklist"), name="acme", distribution=("acme-dist", "0.2"))
    fp = current_fingerprint("cpu", "x", plugins=plugin_versions(m.specs()))
    gone = omni_accum.StrategyManager(load_entrypoints=False)
    gone.load_entrypoints([])
    table = {
        "default": "cat",
        "tuned": {"fingerprint": fp, "context_len_edges": [1000], "concurrency_edges": [1],
                  "cells": [{"key": "embed.decode", "context_len": 1000, "concurrency": 1,
                             "strategy": "chunklist", "params": {"depth": 2}}]},
    }  # fmt: skip
    policy = omni_accum.load_policy(table, manager=gone)
    assert policy.tuned is not None
    with pytest.raises(PolicyError, match=r"tuned.cells\[0\].strategy: unknown strategy 'chunklist'"):
        omni_accum.load_policy({**table, "tuned": {**table["tuned"], "fingerprint": current_fingerprint(
            "cpu", "x", plugins=plugin_versions(gone.specs()))}}, manager=gone)  # fmt: skip
    assert omni_accum.load_policy(table, manager=m).tuned is not None  # where the plugin is, as before


def test_a_policy_naming_a_strategy_of_a_plugin_not_loaded_says_which_were_not(m):  # noqa: F811
    m.disabled.append("blocked")
    m.problems.append(("broken", "plugin 'broken': failed to import"))
    with pytest.raises(PolicyError) as e:
        omni_accum.load_policy({"default": "blocked_cat"}, manager=m)
    assert "unknown strategy 'blocked_cat'. Available: cat, prealloc, replace, send_once, token_list (plugins not " \
           "loaded here: 'blocked' disabled by OMNI_ACCUM_PLUGINS/OMNI_ACCUM_DISABLED_PLUGINS, 'broken' failed to " \
           "load; see omni-accum doctor)" in str(e.value)  # fmt: skip


def test_explain_of_a_hook_s_bad_choice_is_an_error_line(monkeypatch, capsys):
    mgr = omni_accum.StrategyManager(load_entrypoints=False)
    mgr.load_entrypoints([])
    mgr.register(_plugin(choose=StrategyChoice("prealloc", {"growth": 1.5}, "plugin 'chooser'")), name="chooser")
    monkeypatch.setattr(omni_accum.manager, "_manager", mgr)
    assert main(["explain", "default", "--key", "embed.badparam"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("omni-accum explain: error: key 'embed.badparam' (plugin 'chooser'): strategy 'prealloc'")


def test_a_stale_table_s_other_cells_are_still_checked(m):  # noqa: F811
    """Only a cell measured with a plugin that is not here (or not at its version) is left to the stale check: a
    typo in any other cell is an error whatever the rest of the fingerprint says (another torch, another device)."""
    from omni_accum.policy.fingerprint import current_fingerprint, plugin_versions

    fp = {**current_fingerprint("cpu", "x", plugins=plugin_versions(m.specs())), "torch": "9.9.9"}
    cell = {"key": "embed.decode", "context_len": 1000, "concurrency": 1}
    for bad, said in (({"strategy": "prealoc"}, "unknown strategy 'prealoc'"),
                      ({"strategy": "prealloc", "params": {"growht": 2}}, "growht")):  # fmt: skip
        table = {"fingerprint": fp, "context_len_edges": [1000], "concurrency_edges": [1], "cells": [{**cell, **bad}]}
        with pytest.raises(PolicyError, match=said):
            omni_accum.load_policy({"default": "cat", "tuned": table}, manager=m)


def test_shape_messages_read_as_shapes():
    """``[*]`` for rows of scalars (it read ``[*, ]``), and the reference's expected shape as one list (it read
    ``[209, *[2048]]``)."""
    from omni_accum.bench.reference import _check_concat
    from omni_accum.errors import MergeError
    from omni_accum.strategy import check_appendable

    with pytest.raises(MergeError, match=r"expected \[\*\], received \[2, 3\]$"):
        check_appendable(torch.ones(4), torch.ones(2, 3))
    with pytest.raises(MergeError, match=r"expected \[\*, 3\], received \[2, 4\]$"):
        check_appendable(torch.ones(4, 3), torch.ones(2, 4))
    said = _check_concat(torch.ones(5, 2048), [torch.ones(200, 2048), torch.ones(9, 2048)])
    assert said == "shape/dtype [5, 2048] torch.float32, expected [209, 2048] torch.float32"


# ---------------------------------------------------------------------------------------------- #
# run-time mistakes of a plugin: each named (plugin, strategy, value, fix), each the request's failure
# ---------------------------------------------------------------------------------------------- #


def test_a_factory_returning_no_strategy_names_the_plugin_and_the_type(m):  # noqa: F811
    """It was an AttributeError ('dict' object has no attribute 'omits_unchanged') when a Sender was built."""
    spec = StrategySpec(name="notastrategy", factory=lambda params: {"oops": 1}, kinds=frozenset({"replace"}))
    m.register(_plugin(spec), name="factoryplugin", distribution=("fp-dist", "0.1"))
    with pytest.raises(PluginError) as e:
        omni_accum.Sender({"default": "notastrategy"}, manager=m)
    assert str(e.value).startswith(
        "default for meta.override_keys: strategy 'notastrategy' (plugin 'factoryplugin' (distribution fp-dist 0.1)): "
        "its factory returned builtins.dict {'oops': 1}, not an omni_accum.Strategy; return an instance of a Strategy "
        "subclass"
    ), str(e.value)
    with pytest.raises(PluginError, match=r"^strategy 'notastrategy' \(plugin 'factoryplugin'.*returned builtins.dict"):
        m.spec("notastrategy").build()


def test_a_duplicate_within_one_plugin_is_told_to_rename_not_to_disable_itself(m):  # noqa: F811
    with pytest.raises(PluginError) as e:
        m.register(_plugin(*[StrategySpec(name="x", factory=Latest, params_model=Params)] * 2), name="twice")
    assert str(e.value) == (
        "plugin 'twice': strategy 'x' is registered twice by this plugin's omni_accum_register_strategies; give each "
        "StrategySpec its own name (plugin skipped)"
    )


class _RaisingNbytes(ReplaceAccumulator):
    def nbytes(self):
        raise RuntimeError("size unknown")


class _NbytesStrategy(Strategy):
    def new_accumulator(self, key):
        return _RaisingNbytes()


def test_a_raising_nbytes_under_the_memory_guard_fails_the_request_naming_the_plugin(m):  # noqa: F811
    """Receiver.merge raised the bare RuntimeError (projected_nbytes was guarded, nbytes was not)."""
    spec = StrategySpec(name="nb", factory=_NbytesStrategy, kinds=frozenset({"replace"}))
    m.register(_plugin(spec), name="nbplugin")
    rx = omni_accum.Receiver({"default": "nb", "max_bytes_per_request": 1 << 30}, manager=m)
    rx.merge("r", {"x": torch.ones(2)})  # nbytes is asked of the keys held before a chunk: none yet
    with pytest.raises(AccumulationError) as e:
        rx.merge("r", {"x": torch.ones(2)})
    assert (e.value.request_id, e.value.key, e.value.strategy, e.value.plugin) == ("r", "x", "nb", "nbplugin")
    assert "nbytes raised RuntimeError: size unknown" in str(e.value)
    with pytest.raises(AccumulationError, match="request failed earlier"):
        rx.merge("r", {"x": torch.ones(2)})
    rx.release("r")
    rx.merge("other", {"x": torch.ones(2)})  # other requests go on


class _OmitEncoder(omni_accum.strategy.Encoder):
    def __init__(self):
        self.last = None

    def encode(self, value):
        same, self.last = value == self.last, value
        return omni_accum.strategy.OMIT if same else value


class _Undeclared(Strategy):  # omits_unchanged = True forgotten (or set on the Encoder)
    def new_encoder(self, key):
        return _OmitEncoder()

    def new_accumulator(self, key):
        return ReplaceAccumulator()


def test_omit_from_a_strategy_without_omits_unchanged_is_refused(m):  # noqa: F811
    """It was accepted: a receiver that lost its state then served a view without the key, and no error."""
    m.register(_plugin(StrategySpec(name="myonce", factory=_Undeclared, kinds=frozenset({"replace"}))), name="onceplug")
    tx = omni_accum.Sender({"default": "myonce", "honor_override_keys": False}, manager=m)
    tx.encode("r", {"spk": 3})
    with pytest.raises(AccumulationError) as e:
        tx.encode("r", {"spk": 3})
    assert (e.value.key, e.value.strategy, e.value.plugin) == ("spk", "myonce", "onceplug")
    assert "set omits_unchanged = True on the Strategy class (not on the Encoder)" in str(e.value)


def test_a_selection_hook_s_mistakes_name_its_plugin(m):  # noqa: F811
    """A str, an unknown strategy and an unbound hook (a class registered) each named no plugin."""

    class Str:
        @omni_accum.hookimpl
        def omni_accum_select_strategy(self, key, meta, context, policy):
            return "prealloc" if key == "embed.s" else None

    class Unknown:
        @omni_accum.hookimpl
        def omni_accum_select_strategy(self, key, meta, context, policy):
            return StrategyChoice("nope") if key == "embed.u" else None

    class Unbound:
        @omni_accum.hookimpl
        def omni_accum_select_strategy(self, key, meta, context, policy):
            return None

    m.register(Str(), name="strsel")
    m.register(Unknown(), name="unksel")
    tx = omni_accum.Sender("default", manager=m)
    with pytest.raises(AccumulationError, match=r"plugin 'strsel': omni_accum_select_strategy returned str 'prealloc'"):
        tx.encode("r1", {"embed": {"s": torch.ones(1, 2)}})
    with pytest.raises(AccumulationError, match=r"key 'embed.u' \(plugin 'unksel'\): unknown strategy 'nope'"):
        tx.encode("r2", {"embed": {"u": torch.ones(1, 2)}})
    with pytest.raises(PluginError, match=r"^plugin 'unbound': is the class .*Unbound, whose hook "
                                          r"omni_accum_select_strategy is a method that needs"):  # fmt: skip
        m.register(Unbound, name="unbound")
    m.pm.register(Unbound, name="unbound")  # past the check (pluggy itself takes it): the failure still names it
    with pytest.raises(PluginError, match=r"^plugin 'unbound': omni_accum_select_strategy raised TypeError"):
        m.select("embed.x", None, None, omni_accum.load_policy("default", manager=m))


def test_strategies_json_prints_defaults_in_their_json_form(m, monkeypatch, capsys):  # noqa: F811
    """An Enum (or Path, timedelta, frozenset, bytes) default crashed --json and printed <Mode.FAST: 'fast'>."""
    import datetime
    import enum
    import json
    import pathlib

    class Mode(enum.Enum):
        FAST = "fast"

    class Odd(BaseModel):
        model_config = ConfigDict(extra="forbid")
        mode: Mode = Mode.FAST
        where: pathlib.Path = pathlib.Path("/tmp/x")
        every: datetime.timedelta = datetime.timedelta(seconds=2)
        tags: frozenset[str] = frozenset({"a"})
        raw: bytes = b"ab"

    m.register(_plugin(StrategySpec(name="odd", factory=Latest, params_model=Odd)), name="oddplug")
    monkeypatch.setattr(omni_accum.manager, "_manager", m)
    assert main(["strategies", "--json"]) == 0
    (odd,) = [r for r in json.loads(capsys.readouterr().out)["strategies"] if r["name"] == "odd"]
    assert {p["name"]: p["default"] for p in odd["params"]} == {
        "mode": "fast", "where": "/tmp/x", "every": "PT2S", "tags": ["a"], "raw": "ab"}  # fmt: skip
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    assert "param mode: Mode (default 'fast')" in out and "<Mode" not in out
