"""The StrategyManager facade: registration, validation, lookups, selection. A fresh manager per test."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field

import omni_accum
from omni_accum.context import KeyMeta, StreamContext
from omni_accum.errors import DuplicateStrategyError, PluginError, UnknownStrategyError, describe_plugin
from omni_accum.hookspecs import ALL_HOOKS
from omni_accum.policy import StrategyChoice
from omni_accum.strategies.replace import ReplaceAccumulator
from omni_accum.strategy import Strategy, StrategySpec

BUILTINS = ["cat", "prealloc", "replace", "send_once", "token_list"]


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    depth: int = Field(default=1, ge=1)


class Latest(Strategy):
    name = "latest"
    Params = Params

    def new_accumulator(self, key):
        return ReplaceAccumulator()


def registering(*names: str):
    class P:
        @omni_accum.hookimpl
        def omni_accum_register_strategies(self):
            return [
                StrategySpec(name=n, factory=Latest, params_model=Params, kinds=frozenset({"replace"})) for n in names
            ]

    return P()


@pytest.fixture
def m():
    mgr = omni_accum.StrategyManager(load_entrypoints=False)
    mgr.load_entrypoints([])  # built-ins only, through the same path as entry points
    return mgr


def test_builtins_register_through_the_plugin_path(m):
    assert m.names() == BUILTINS
    for name in BUILTINS:
        assert m.pm.get_plugin(name) is not None and m.spec(name).plugin == name
    assert [s.name for s in m.specs()] == BUILTINS
    assert set(ALL_HOOKS) == {h for h in dir(m.pm.hook) if h.startswith("omni_accum_")}


def test_register_records_plugin_and_distribution(m):
    m.register(registering("a", "b"), name="acme", distribution=("acme-dist", "1.0"))
    assert m.spec("a").plugin == "acme" and m.spec("b").distribution == ("acme-dist", "1.0")


def test_a_distribution_that_is_not_a_name_version_pair_is_refused_and_registers_nothing(m):
    """A plain string was taken, and every message then named "distribution m y" (its first two letters)."""
    for bad in ("my-strategies", ("my-strategies",), ("my-strategies", 1)):
        with pytest.raises(PluginError, match=r"distribution must be a \(name, version\) pair of strings, got"):
            m.register(registering("a"), name="acme", distribution=bad)
        assert "a" not in m.names() and m.pm.get_plugin("acme") is None
    m.register(registering("a"), name="acme", distribution=["acme-dist", "1.0"])  # a list of the two: as a pair
    assert "acme-dist 1.0" in describe_plugin("acme", m.spec("a").distribution)


def test_bad_register_arguments_are_plugin_errors_naming_the_value_and_register_nothing(m):
    """A bad distribution was describe_plugin's bare TypeError, None pluggy's AssertionError, name=5 was taken."""
    before = m.pm.list_name_plugin()
    cases = [
        (dict(plugin=None), r"cannot register plugin None: give a module or an object with @omni_accum.hookimpl"),
        (dict(name=5), r"under the name 5 \(int\): give a non-empty str, or None"),
        (dict(name=""), r"under the name '' \(str\): give a non-empty str"),
        (dict(name="acme", distribution="my-dist"), r"plugin 'acme': cannot register: .*got 'my-dist'; give None or"),
        (dict(name="acme", distribution=("a", 1)), r"plugin 'acme': cannot register: .*got \('a', 1\)"),
    ]
    for kwargs, needle in cases:
        kwargs = {"plugin": registering("a"), **kwargs}
        with pytest.raises(PluginError, match=needle):
            m.register(kwargs.pop("plugin"), **kwargs)
        assert m.pm.list_name_plugin() == before and "a" not in m.names()


def test_unknown_strategy_lists_available_names(m):
    with pytest.raises(UnknownStrategyError, match=r"key 'k': unknown strategy 'nope'. Available: cat, prealloc"):
        m.spec("nope", where="key 'k'")
    assert m.get_spec("nope") is None


def test_duplicate_within_one_plugin(m):
    with pytest.raises(DuplicateStrategyError, match="'x' is registered twice"):
        m.register(registering("x", "x"), name="twice")
    assert m.pm.get_plugin("twice") is None and "x" not in m.names()


def test_failed_registration_leaves_nothing_behind(m):
    with pytest.raises(DuplicateStrategyError) as ei:
        m.register(registering("fresh", "cat"), name="greedy", distribution=("greedy-dist", "0.1"))
    assert ei.value.plugins == ("cat", "greedy")
    assert "plugin 'greedy' (distribution greedy-dist 0.1)" in str(ei.value)
    assert "plugin 'cat' serves it, so this plugin is skipped" in str(ei.value)
    assert "rename the strategy in it (a built-in cannot be disabled)" in str(ei.value)
    assert "fresh" not in m.names() and m.pm.get_plugin("greedy") is None
    m.register(registering("fresh"), name="greedy")  # the name is free again
    assert "fresh" in m.names()


def test_plugin_name_registered_twice(m):
    m.register(registering("one"), name="acme")
    with pytest.raises(PluginError, match="plugin 'acme': cannot register"):
        m.register(registering("two"), name="acme")


def test_check_pending_catches_misspelled_hooks(m):
    class Typo:
        @omni_accum.hookimpl
        def omni_accum_select_strategies(self, key):
            return None

    with pytest.raises(PluginError, match="plugin 'typo'.*omni_accum_select_strategies"):
        m.register(Typo(), name="typo")
    assert m.pm.get_plugin("typo") is None
    m.pm.check_pending()  # nothing pending is left behind


def test_build_validates_params_and_caches(m):
    m.register(registering("latest"), name="acme")
    a = m.build("latest", {"depth": 2})
    assert a is m.build("latest", {"depth": 2}) and a.params.depth == 2
    assert m.build("latest") is not a
    with pytest.raises(PluginError) as e:  # one line: the strategy, its plugin, the param, what it takes
        m.build("latest", {"depht": 2}, "key 'x' (a plugin's choice)")
    assert str(e.value) == (
        "key 'x' (a plugin's choice): strategy 'latest' (plugin 'acme') refuses params {'depht': 2}: depht: "
        "unknown param (allowed params: depth (default 1))"
    )
    with pytest.raises(UnknownStrategyError):
        m.build("nope")


@pytest.mark.parametrize("params", [[1, 2], "ab", ["depth"], 5, [], {1: 2, "depth": 2}])
def test_params_that_are_not_a_mapping_of_names_are_plugin_errors_naming_them(m, params):
    """A list or a str was a bare TypeError/ValueError from dict(), mixed keys one from sorting the cache key."""
    m.register(registering("latest"), name="acme")
    for call in (m.build, m.params):
        with pytest.raises(PluginError, match=r"strategy 'latest' \(plugin 'acme'\) refuses params ") as e:
            call("latest", params, "key 'x'")
        assert repr(params) in str(e.value) and "(allowed params: depth (default 1))" in str(e.value)
    assert m.build("latest", {"depth": 2}).params.depth == 2 and m.build("latest", None).params.depth == 1


class TestSelection:
    meta = KeyMeta.of("embed.decode", None)
    ctx = StreamContext(context_len=20000)

    def test_builtin_selection_applies_the_policy(self, m):
        policy = omni_accum.load_policy(
            {"default": "cat", "rules": [{"match": "embed.*", "strategy": "prealloc"}]}, manager=m
        )
        choice = m.select("embed.decode", self.meta, self.ctx, policy)
        assert choice.strategy == "prealloc" and "embed.*" in choice.source

    def test_a_plugin_overrides_the_builtin_selection(self, m):
        class LongContext:
            @omni_accum.hookimpl
            def omni_accum_select_strategy(self, key, meta, context, policy):
                if (context.context_len or 0) > 16000:
                    return StrategyChoice("token_list", {}, "plugin long-context")
                return None

        m.register(LongContext(), name="longctx")
        policy = omni_accum.load_policy({"default": "cat"}, manager=m)
        assert m.select("k", self.meta, self.ctx, policy).strategy == "token_list"
        assert m.select("k", self.meta, StreamContext(context_len=10), policy).strategy == "cat"  # None: policy decides

    def test_a_wrong_return_type_is_a_plugin_error(self, m):
        class Wrong:
            @omni_accum.hookimpl
            def omni_accum_select_strategy(self, key, meta, context, policy):
                return "cat"

        m.register(Wrong(), name="wrong")
        with pytest.raises(PluginError, match=r"^plugin 'wrong': omni_accum_select_strategy returned str 'cat' for key "
                                              r"'k'; return an omni_accum StrategyChoice, or None$"):  # fmt: skip
            m.select("k", self.meta, self.ctx, omni_accum.load_policy({}, manager=m))

    def test_a_raising_selection_hook_names_its_plugin(self, m):
        class Raising:
            @omni_accum.hookimpl
            def omni_accum_select_strategy(self, key, meta, context, policy):
                raise KeyError("no table")

        m.register(Raising(), name="raiser", distribution=("raiser-dist", "3.1"))
        with pytest.raises(PluginError) as ei:
            m.select("k", self.meta, self.ctx, omni_accum.load_policy({}, manager=m))
        assert "plugin 'raiser' (distribution raiser-dist 3.1)" in str(ei.value) and "KeyError" in str(ei.value)
        assert isinstance(ei.value.__cause__, KeyError)


def test_process_wide_manager_is_created_once_and_can_be_replaced():
    omni_accum.reset_manager(None)
    first = omni_accum.get_manager()
    assert omni_accum.get_manager() is first
    mine = omni_accum.StrategyManager(load_entrypoints=False)
    omni_accum.reset_manager(mine)
    assert omni_accum.get_manager() is mine


def test_strategies_built_with_params_that_differ_per_request_are_kept_at_most_max_built(m, monkeypatch):
    """The stage input processor builds ``prealloc`` with each prompt's length as its capacity: the manager kept every
    one for good (870 B per distinct length, up to ~110 MB at 128k-token contexts)."""
    from omni_accum import manager

    monkeypatch.setattr(manager, "MAX_BUILT", 50)
    first = m.build("prealloc", {"initial_capacity": 1})
    assert m.build("prealloc", {"initial_capacity": 1}) is first  # reused while kept
    for n in range(2, 200):
        s = m.build("prealloc", {"initial_capacity": n})
        assert s.params.initial_capacity == n
    assert len(m._built) == 50
    again = m.build("prealloc", {"initial_capacity": 1})  # the oldest went: built again, the same strategy
    assert again is not first and again.params == first.params
    assert m.build("prealloc", {"initial_capacity": 199}) is s  # the newest are kept
