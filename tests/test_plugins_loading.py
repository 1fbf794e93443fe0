"""Loading strategy plugins from entry points: every failure reported (plugin and distribution named,
cause chained) and skipped; strict mode raises; allowlist, blocklist and tracing.

Entry points are faked the way pluggy's own tests do it: ``importlib.metadata.entry_points`` is
monkeypatched to return real ``EntryPoint`` objects (bound to a fake distribution) whose modules are
put into ``sys.modules``. The installed example plugin (``omni-accum-delta``) is tested for real at
the end.
"""

from __future__ import annotations

import json
import logging
import sys
import types
from importlib import metadata

import pytest
from pydantic import BaseModel, ConfigDict, Field

import omni_accum
from omni_accum import manager as manager_mod
from omni_accum.errors import DuplicateStrategyError, PluginError
from omni_accum.strategies.replace import ReplaceAccumulator
from omni_accum.strategy import Strategy, StrategySpec

FAKE_DIST = "acme-accum"
FAKE_VERSION = "1.2.3"
MODULE = "acme_accum_plugins"


class FakeDist:
    """What the manager reads of a distribution: ``metadata["Name"]`` and ``version``."""

    def __init__(self, name: str = FAKE_DIST, version: str = FAKE_VERSION) -> None:
        self.metadata = {"Name": name}
        self.version = version
        self.name = name


def fake_ep(name: str, value: str, dist: str | None = FAKE_DIST, version: str = FAKE_VERSION) -> metadata.EntryPoint:
    ep = metadata.EntryPoint(name=name, value=value, group="omni_accum")
    return ep._for(FakeDist(dist, version)) if dist else ep


# ---------------------------------------------------------------------------------------------- #
# plugins, good and broken
# ---------------------------------------------------------------------------------------------- #


class GoodParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    depth: int = Field(default=1, ge=1)


class Latest(Strategy):
    name = "latest"
    Params = GoodParams

    def new_accumulator(self, key):
        return ReplaceAccumulator()


def spec(name: str = "latest", **kw) -> StrategySpec:
    base = dict(name=name, factory=Latest, params_model=GoodParams, kinds=frozenset({"replace"}), description="test")
    base.update(kw)
    return StrategySpec(**base)


def plugin_returning(*records):
    class P:
        @omni_accum.hookimpl
        def omni_accum_register_strategies(self):
            return list(records)

    return P()


class NoForbid(BaseModel):
    depth: int = 1


class RequiredParam(BaseModel):
    model_config = ConfigDict(extra="forbid")
    depth: int


class Raising:
    @omni_accum.hookimpl
    def omni_accum_register_strategies(self):
        raise RuntimeError("database unreachable")


class UnknownHook:
    @omni_accum.hookimpl
    def omni_accum_register_strategies(self):
        return [spec("typo_plugin_strategy")]

    @omni_accum.hookimpl
    def omni_accum_regsiter_strategy(self):  # misspelled: check_pending must catch it
        return []


class ClassPlugin:  # an entry point naming the class, not an instance: its hooks would be unbound methods
    @omni_accum.hookimpl
    def omni_accum_select_strategy(self, key, meta, context, policy):
        return None


class ExitingHook:
    @omni_accum.hookimpl
    def omni_accum_register_strategies(self):
        raise SystemExit(2)  # argparse, run by a plugin's registration


class WrongHookArgs:
    @omni_accum.hookimpl
    def omni_accum_select_strategy(self, key, meta, context, policy, extra):
        return None


PLUGINS = {
    "good": plugin_returning(spec("latest")),
    "good2": plugin_returning(spec("latest2")),
    "dup": plugin_returning(spec("latest")),
    "dup_builtin": plugin_returning(spec("cat")),
    "raising": Raising(),
    "no_forbid": plugin_returning(spec("nf", params_model=NoForbid)),
    "required": plugin_returning(spec("req", params_model=RequiredParam)),
    "not_pydantic": plugin_returning(spec("np", params_model=dict)),
    "bad_kinds": plugin_returning(spec("bk", kinds=frozenset({"appendd"}))),
    "empty_kinds": plugin_returning(spec("ek", kinds=frozenset())),
    "bad_grid": plugin_returning(spec("bg", params_grid=({"depth": 0},))),
    "bad_name": plugin_returning(spec("no spaces")),
    "not_a_spec": plugin_returning({"name": "dictspec"}),
    "not_callable": plugin_returning(spec("nc", factory=42)),
    "unknown_hook": UnknownHook(),
    "wrong_args": WrongHookArgs(),
    "none_grid": plugin_returning(spec("ng", params_grid=None)),
    "none_kinds": plugin_returning(spec("nk", kinds=None)),
    "int_kinds": plugin_returning(spec("ik", kinds=3)),
    "list_in_grid": plugin_returning(spec("lg", params_grid=[[("depth", 2)]])),
    "class_plugin": ClassPlugin,
    "exiting_hook": ExitingHook(),
}


@pytest.fixture
def fake_plugins(monkeypatch):
    """Install ``acme_accum_plugins`` and return ``use(*entry_points)``, which makes them the installed set."""
    mod = types.ModuleType(MODULE)
    for attr, obj in PLUGINS.items():
        setattr(mod, attr, obj)
    monkeypatch.setitem(sys.modules, MODULE, mod)
    real = metadata.entry_points
    first_party = [
        ep for ep in real(group="omni_accum") if ep.dist is not None and ep.dist.metadata["Name"] == "omni-accum"
    ]
    for var in (manager_mod.ENV_STRICT, manager_mod.ENV_ALLOW, manager_mod.ENV_DENY, manager_mod.ENV_TRACE):
        monkeypatch.delenv(var, raising=False)

    def use(*eps: metadata.EntryPoint) -> None:
        def entry_points(**kw):
            if kw.get("group") == "omni_accum":
                return metadata.EntryPoints([*first_party, *eps])
            return real(**kw)

        monkeypatch.setattr(metadata, "entry_points", entry_points)

    return use


def ep_of(attr: str, name: str | None = None, **kw) -> metadata.EntryPoint:
    return fake_ep(name or attr, f"{MODULE}:{attr}", **kw)


BUILTINS = ["cat", "prealloc", "replace", "send_once", "token_list"]


# ---------------------------------------------------------------------------------------------- #
# the good path
# ---------------------------------------------------------------------------------------------- #


def test_good_plugin_is_loaded_with_plugin_and_distribution(fake_plugins):
    fake_plugins(ep_of("good", "acme"))
    m = omni_accum.StrategyManager()
    assert m.problems == [] and m.errors == []
    s = m.spec("latest")
    assert s.plugin == "acme" and s.distribution == (FAKE_DIST, FAKE_VERSION)
    assert m.names() == sorted([*BUILTINS, "latest"])
    # built-ins came through the same entry-point path, with the first-party distribution
    assert m.spec("cat").distribution == ("omni-accum", omni_accum.__version__)


def test_policies_can_name_a_plugin_strategy_and_its_params_are_validated(fake_plugins):
    fake_plugins(ep_of("good", "acme"))
    m = omni_accum.StrategyManager()
    policy = omni_accum.load_policy(
        {"rules": [{"match": "ids.*", "strategy": "latest", "params": {"depth": 2}}]}, manager=m
    )
    assert policy.resolve("ids.output").strategy == "latest"
    with pytest.raises(omni_accum.PolicyError, match=r"rules\[0\]\.params\.dpeth: unknown param \(strategy 'latest'"):
        omni_accum.load_policy({"rules": [{"match": "x", "strategy": "latest", "params": {"dpeth": 2}}]}, manager=m)


def test_loading_twice_is_idempotent(fake_plugins):
    fake_plugins(ep_of("good", "acme"))
    m = omni_accum.StrategyManager()
    m.load_entrypoints()
    assert m.problems == [] and m.names().count("latest") == 1


def test_entry_points_can_be_passed_directly():
    m = omni_accum.StrategyManager(load_entrypoints=False)
    sys.modules.setdefault(MODULE, types.ModuleType(MODULE))
    mod = sys.modules[MODULE]
    mod.good2 = PLUGINS["good2"]
    try:
        m.load_entrypoints([ep_of("good2")])
    finally:
        del sys.modules[MODULE]
    assert "latest2" in m.names() and set(BUILTINS) <= set(m.names())


# ---------------------------------------------------------------------------------------------- #
# each failure: reported with plugin and distribution, cause chained, skipped; strict raises
# ---------------------------------------------------------------------------------------------- #

FAILURES = [
    # (entry point, expected words in the report, expected cause type or None)
    (fake_ep("ghost", "acme_accum_no_such_module"), ["failed to import", "ModuleNotFoundError"], ModuleNotFoundError),
    (fake_ep("ghost_attr", f"{MODULE}:no_such_attr"), ["failed to import", "AttributeError"], AttributeError),
    (ep_of("raising"), ["omni_accum_register_strategies raised RuntimeError", "database unreachable"], RuntimeError),
    (ep_of("no_forbid"), ["extra='forbid'", "NoForbid", "'nf'"], None),
    (ep_of("required"), ["must validate with no arguments", "'req'"], None),
    (ep_of("not_pydantic"), ["pydantic BaseModel"], None),
    (ep_of("bad_kinds"), ["kinds ['appendd']", "append", "replace", "static"], None),
    (ep_of("empty_kinds"), ["non-empty subset"], None),
    (ep_of("bad_grid"), ["params_grid[0] invalid"], None),
    (ep_of("bad_name"), ["invalid strategy name 'no spaces'"], None),
    (ep_of("not_a_spec"), ["returned dict, expected omni_accum.StrategySpec"], None),
    (ep_of("not_callable"), ["factory is not callable"], None),
    (ep_of("unknown_hook"), ["omni_accum_regsiter_strategy", "unknown hook"], None),
    (ep_of("wrong_args"), ["invalid hook implementation", "extra"], None),
    # None fields were a bare TypeError out of StrategyManager(): every omni-accum process died
    (ep_of("none_grid"), ["strategy 'ng': params_grid None must be a tuple of params mappings"], None),
    (ep_of("none_kinds"), ["strategy 'nk': kinds None must be a set of ['append', 'replace', 'static']"], None),
    (ep_of("int_kinds"), ["strategy 'ik': kinds 3 must be a set of"], None),
    (ep_of("list_in_grid"), ["params_grid[0] [('depth', 2)] must be a mapping of param names to values"], None),
    (ep_of("class_plugin"), ["is the class ClassPlugin", "point the entry point at an instance"], None),
    (ep_of("exiting_hook"), ["omni_accum_register_strategies raised SystemExit: 2"], SystemExit),
    (
        ep_of("dup_builtin"),
        ["'cat' is registered twice", "plugin 'cat'", "plugin 'dup_builtin'", "omni-accum 0.1.0"],
        None,
    ),
]


@pytest.mark.parametrize("ep, words, cause", FAILURES, ids=[f[0].name for f in FAILURES])
def test_broken_plugin_is_reported_and_skipped(fake_plugins, caplog, ep, words, cause):
    fake_plugins(ep, ep_of("good", "acme"))
    with caplog.at_level(logging.WARNING, logger="omni_accum"):
        m = omni_accum.StrategyManager()
    # skipped, and nothing else is harmed: the built-ins and the good plugin loaded
    assert [p for p, _ in m.problems] == [ep.name]
    assert set(BUILTINS) | {"latest"} <= set(m.names())
    assert m.pm.get_plugin(ep.name) is None
    text = m.problems[0][1]
    assert f"plugin {ep.name!r}" in text and f"distribution {FAKE_DIST} {FAKE_VERSION}" in text, text
    for w in words:
        assert w in text, (w, text)
    err = m.errors[0]
    assert isinstance(err, PluginError) and str(err) == text
    if cause is not None:
        chained = err.__cause__
        while chained is not None and not isinstance(chained, cause):
            chained = chained.__cause__
        assert isinstance(chained, cause), f"cause {cause.__name__} not chained: {err.__cause__!r}"
    # reported in the log, with the way out
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(text in msg and "OMNI_ACCUM_STRICT_PLUGINS" in msg for msg in logged), logged


@pytest.mark.parametrize("ep, words, cause", FAILURES, ids=[f[0].name for f in FAILURES])
def test_strict_mode_raises(fake_plugins, monkeypatch, ep, words, cause):
    fake_plugins(ep)
    monkeypatch.setenv("OMNI_ACCUM_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError) as ei:
        omni_accum.StrategyManager()
    text = str(ei.value)
    assert f"plugin {ep.name!r}" in text and FAKE_DIST in text, text
    for w in words:
        assert w in text
    if cause is not None:
        assert ei.value.__cause__ is not None


def test_strict_argument_beats_environment(fake_plugins, monkeypatch):
    fake_plugins(ep_of("raising"))
    monkeypatch.setenv("OMNI_ACCUM_STRICT_PLUGINS", "1")
    assert omni_accum.StrategyManager(strict=False).problems
    monkeypatch.delenv("OMNI_ACCUM_STRICT_PLUGINS")
    with pytest.raises(PluginError):
        omni_accum.StrategyManager(strict=True)


def test_duplicate_between_two_plugins_names_both_and_keeps_the_first(fake_plugins):
    fake_plugins(ep_of("good", "acme", dist="acme-one"), ep_of("dup", "acme_dup", dist="acme-two", version="9.9"))
    m = omni_accum.StrategyManager()
    assert m.spec("latest").plugin == "acme"
    ((plugin, text),) = m.problems
    assert plugin == "acme_dup"
    for w in (
        "'latest' is registered twice",
        "plugin 'acme'",
        "plugin 'acme_dup'",
        "acme-one",
        "acme-two 9.9",
        "OMNI_ACCUM_DISABLED_PLUGINS=acme_dup",
    ):
        assert w in text, (w, text)


def test_duplicate_in_strict_mode_is_a_duplicate_error(fake_plugins):
    fake_plugins(ep_of("good", "acme"), ep_of("dup", "acme_dup"))
    with pytest.raises(DuplicateStrategyError) as ei:
        omni_accum.StrategyManager(strict=True)
    assert ei.value.plugins == ("acme", "acme_dup") and FAKE_DIST in str(ei.value)


def test_entry_point_name_taken_by_another_distribution_is_reported(fake_plugins):
    fake_plugins(ep_of("good", "acme", dist="acme-one"), ep_of("good2", "acme", dist="acme-two"))
    m = omni_accum.StrategyManager()
    assert "latest" in m.names() and "latest2" not in m.names()
    ((plugin, text),) = m.problems
    assert text == (  # one line: whose the name is, and what to do
        "plugin 'acme' (distribution acme-two 1.2.3): cannot register: the name 'acme' is taken by plugin 'acme' "
        "(distribution acme-one 1.2.3); give the entry point another name"
    )


def test_third_party_plugin_cannot_take_a_builtin_entry_point_name(fake_plugins):
    fake_plugins(ep_of("good2", "cat"))
    m = omni_accum.StrategyManager()
    assert m.spec("cat").plugin == "cat" and m.spec("cat").distribution[0] == "omni-accum"
    assert [p for p, _ in m.problems] == ["cat"] and FAKE_DIST in m.problems[0][1]


def test_a_broken_builtin_is_always_an_error(monkeypatch):
    bad = types.ModuleType("omni_accum_broken_builtin")
    bad.omni_accum_register_strategies = omni_accum.hookimpl(lambda: [spec("cat")])
    monkeypatch.setitem(sys.modules, "omni_accum_broken_builtin", bad)
    m = omni_accum.StrategyManager()
    with pytest.raises(DuplicateStrategyError):
        m.register(bad, name="broken", first_party=True)
    with pytest.raises(PluginError, match="plugin 'builtin_ghost'"):
        m._problem("builtin_ghost", ("omni-accum", "0.1.0"), "failed", ImportError("x"), first_party=True)


# ---------------------------------------------------------------------------------------------- #
# allowlist and blocklist
# ---------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "allow, deny, loaded",
    [
        (None, None, {"latest", "latest2"}),
        ("acme", None, {"latest"}),
        ("acme-one", None, {"latest"}),  # by distribution name
        ("ACME_ONE", None, {"latest"}),  # distribution names are compared normalised (PEP 503)
        ("acme,acme2", None, {"latest", "latest2"}),
        ("nobody", None, set()),
        (None, "acme2", {"latest"}),
        (None, "acme-two", {"latest"}),
        (None, "acme_one, acme-two", set()),
        ("acme,acme2", "acme2", {"latest"}),  # the blocklist wins
    ],
)
def test_allowlist_and_blocklist(fake_plugins, monkeypatch, allow, deny, loaded):
    fake_plugins(ep_of("good", "acme", dist="acme-one"), ep_of("good2", "acme2", dist="acme-two"))
    if allow is not None:
        monkeypatch.setenv("OMNI_ACCUM_PLUGINS", allow)
    if deny is not None:
        monkeypatch.setenv("OMNI_ACCUM_DISABLED_PLUGINS", deny)
    m = omni_accum.StrategyManager()
    assert set(m.names()) - set(BUILTINS) == loaded
    assert m.problems == []


def test_lists_never_disable_builtins(fake_plugins, monkeypatch):
    fake_plugins()
    monkeypatch.setenv("OMNI_ACCUM_PLUGINS", "nobody")
    monkeypatch.setenv("OMNI_ACCUM_DISABLED_PLUGINS", "cat,omni-accum")
    assert omni_accum.StrategyManager().names() == BUILTINS


def test_blocklist_skips_a_broken_plugin_without_importing_it(fake_plugins, monkeypatch):
    fake_plugins(fake_ep("ghost", "acme_accum_no_such_module"))
    monkeypatch.setenv("OMNI_ACCUM_DISABLED_PLUGINS", "ghost")
    monkeypatch.setenv("OMNI_ACCUM_STRICT_PLUGINS", "1")
    assert omni_accum.StrategyManager().problems == []


# ---------------------------------------------------------------------------------------------- #
# tracing
# ---------------------------------------------------------------------------------------------- #


def test_trace_logs_hook_calls(fake_plugins, monkeypatch, caplog):
    fake_plugins(ep_of("good", "acme"))
    monkeypatch.setenv("OMNI_ACCUM_TRACE_PLUGINS", "1")
    with caplog.at_level(logging.INFO, logger="omni_accum"):
        m = omni_accum.StrategyManager()
        omni_accum.Receiver({"default": "latest"}, manager=m).merge("r", {"x": 1})
    msgs = [r.getMessage() for r in caplog.records]
    assert any("omni_accum_register_strategies [acme]" in s and "latest" in s for s in msgs), msgs
    assert any("omni_accum_select_strategy" in s and "'x'" in s for s in msgs), msgs
    assert any("finish" in s and "latest" in s for s in msgs), msgs


def test_no_trace_by_default(fake_plugins, caplog):
    fake_plugins(ep_of("good", "acme"))
    with caplog.at_level(logging.INFO, logger="omni_accum"):
        m = omni_accum.StrategyManager()
        omni_accum.Receiver({"default": "latest"}, manager=m).merge("r", {"x": 1})
    assert not [r for r in caplog.records if "omni_accum hook" in r.getMessage()]


# ---------------------------------------------------------------------------------------------- #
# the example plugin, installed for real (scripts/env.sh: pip install examples/plugins/omni-accum-delta)
# ---------------------------------------------------------------------------------------------- #


def _installed_delta() -> metadata.Distribution:
    try:
        return metadata.distribution("omni-accum-delta")
    except metadata.PackageNotFoundError:
        pytest.fail(
            "omni-accum-delta is not installed: run bash scripts/env.sh "
            "or pip install examples/plugins/omni-accum-delta"
        )


def test_installed_delta_plugin_is_found_through_its_entry_point():
    dist = _installed_delta()
    eps = [ep for ep in dist.entry_points if ep.group == "omni_accum"]
    assert [(ep.name, ep.value) for ep in eps] == [("delta", "omni_accum_delta")]
    m = omni_accum.StrategyManager()
    s = m.spec("delta")
    assert s.plugin == "delta" and s.distribution == ("omni-accum-delta", dist.version)
    assert s.kinds == frozenset({"replace"})
    assert m.problems == []


def test_cli_strategies_lists_delta_with_distribution_and_version(capsys):
    from omni_accum.cli import main

    version = _installed_delta().version
    omni_accum.reset_manager(None)
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("delta "))
    assert "omni-accum-delta" in line and version in line and "replace" in line
    assert main(["strategies", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rec = next(r for r in data["strategies"] if r["name"] == "delta")
    assert rec["distribution"] == {"name": "omni-accum-delta", "version": version}
    assert rec["plugin"] == "delta" and rec["kinds"] == ["replace"] and rec["params"] == []


def test_policies_can_name_delta():
    _installed_delta()
    policy = omni_accum.load_policy(
        {
            "default": "cat",
            "rules": [{"match": "ids.output", "strategy": "delta"}, {"match": "meta.*", "strategy": "replace"}],
        }
    )
    assert policy.resolve("ids.output").strategy == "delta"
    with pytest.raises(omni_accum.PolicyError, match=r"unknown param \(strategy 'delta'; allowed params: none\)"):
        omni_accum.load_policy({"rules": [{"match": "ids.output", "strategy": "delta", "params": {"verify": True}}]})
    with pytest.raises(omni_accum.PolicyError, match="Available: .*delta"):
        omni_accum.load_policy({"default": "delat"})


def test_delta_can_be_disabled_like_any_third_party_plugin(monkeypatch):
    _installed_delta()
    monkeypatch.setenv("OMNI_ACCUM_DISABLED_PLUGINS", "omni-accum-delta")
    assert "delta" not in omni_accum.StrategyManager().names()
    monkeypatch.setenv("OMNI_ACCUM_DISABLED_PLUGINS", "")
    monkeypatch.setenv("OMNI_ACCUM_PLUGINS", "delta")
    assert "delta" in omni_accum.StrategyManager().names()


def test_strategies_prints_a_plugin_problem_once(fake_plugins, monkeypatch, caplog, capsys):
    from omni_accum.cli import main

    fake_plugins(ep_of("raising"), ep_of("good", "acme"))
    monkeypatch.setattr(manager_mod, "_manager", None)
    with caplog.at_level(logging.WARNING, logger="omni_accum"):
        assert main(["strategies"]) == 0
    said = capsys.readouterr().err + "\n".join(r.getMessage() for r in caplog.records)
    assert said.count("database unreachable") == 1, said


# ---------------------------------------------------------------------------------------------- #
# what a plugin raises is the plugin's failure, never the process's
# ---------------------------------------------------------------------------------------------- #


class _ExitOnImport(types.ModuleType):
    def __getattr__(self, name):
        raise SystemExit(2)  # what argparse does at import time when sys.argv is the CLI's


def test_a_plugin_exiting_at_import_is_skipped_not_the_cli_s_exit(fake_plugins, monkeypatch, capsys):
    """SystemExit from ep.load() ended `omni-accum strategies` with exit status 2 and nothing printed."""
    monkeypatch.setitem(sys.modules, "acme_accum_exits", _ExitOnImport("acme_accum_exits"))
    fake_plugins(fake_ep("exits", "acme_accum_exits:plugin"), ep_of("good", "acme"))
    m = omni_accum.StrategyManager()
    ((plugin, text),) = m.problems
    assert plugin == "exits" and "failed to import 'acme_accum_exits:plugin': SystemExit: 2" in text, text
    assert "if __name__ == '__main__'" in text and "latest" in m.names()
    from omni_accum.cli.main import main

    monkeypatch.setattr(manager_mod, "_manager", None)
    assert main(["strategies", "--json"]) == 0
    assert "latest" in capsys.readouterr().out


def test_ctrl_c_during_plugin_loading_still_stops_the_process(fake_plugins, monkeypatch):
    class Interrupted(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "acme_accum_ctrlc", Interrupted("acme_accum_ctrlc"))
    fake_plugins(fake_ep("ctrlc", "acme_accum_ctrlc:plugin"))
    with pytest.raises(KeyboardInterrupt):
        omni_accum.StrategyManager()


def test_any_exception_from_a_registration_is_that_plugin_s_failure(fake_plugins, monkeypatch):
    """Not only PluginError: an unforeseen exception while registering a plugin skips the plugin."""
    real = manager_mod.validate_spec

    def flaky(rec, who, reserved):
        if rec.name == "latest2":
            raise LookupError("unforeseen")
        return real(rec, who, reserved)

    monkeypatch.setattr(manager_mod, "validate_spec", flaky)
    fake_plugins(ep_of("good2", "flaky"), ep_of("good", "acme"))
    m = omni_accum.StrategyManager()
    ((plugin, text),) = m.problems
    assert plugin == "flaky" and text == (
        f"plugin 'flaky' (distribution {FAKE_DIST} {FAKE_VERSION}): registration raised LookupError: unforeseen"
    )
    assert isinstance(m.errors[0].__cause__, LookupError) and "latest" in m.names() and "latest2" not in m.names()


def test_a_duplicate_says_which_plugin_serves_and_which_to_disable(fake_plugins):
    """The advice was to disable the plugin that had already been skipped, whatever one wanted."""
    fake_plugins(ep_of("good", "acme", dist="acme-one"), ep_of("dup", "acme_dup", dist="acme-two", version="9.9"))
    ((_, text),) = omni_accum.StrategyManager().problems
    assert text == (
        "plugin 'acme_dup' (distribution acme-two 9.9): strategy 'latest' is registered twice: plugin 'acme' "
        "(distribution acme-one 1.2.3) serves it, so this plugin is skipped; to use this plugin's 'latest' instead, "
        "disable plugin 'acme' (distribution acme-one 1.2.3) (OMNI_ACCUM_DISABLED_PLUGINS=acme); to keep the one "
        "plugin 'acme' (distribution acme-one 1.2.3) serves, disable this one (OMNI_ACCUM_DISABLED_PLUGINS=acme_dup) "
        "or uninstall it"
    )
