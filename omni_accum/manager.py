"""The plugin manager: loads strategy plugins and answers "which strategy is X".

Built-in strategies and third-party plugins go through the same path: entry points of group
``omni_accum`` are loaded, registered with a pluggy ``PluginManager``, checked with
``check_pending()``, and their ``omni_accum_register_strategies`` results validated.

A broken third-party plugin (fails to import, raises in a hook, returns invalid records, repeats
a strategy name) is reported and skipped; ``OMNI_ACCUM_STRICT_PLUGINS=1`` makes that an error. A
broken built-in is always an error. ``OMNI_ACCUM_PLUGINS`` (comma-separated allowlist) and
``OMNI_ACCUM_DISABLED_PLUGINS`` (blocklist) filter third-party plugins by entry-point or
distribution name; ``OMNI_ACCUM_TRACE_PLUGINS=1`` logs every hook call.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import threading
import traceback
from collections.abc import Iterable
from dataclasses import replace
from importlib import metadata
from typing import Any

import pluggy
from pydantic import BaseModel

from omni_accum import hookspecs
from omni_accum.context import KeyMeta, StreamContext
from omni_accum.errors import DuplicateStrategyError, OmniAccumError, PluginError, UnknownStrategyError
from omni_accum.hookspecs import PROJECT, hookimpl
from omni_accum.policy.model import Policy, StrategyChoice
from omni_accum.strategy import KINDS, Strategy, StrategySpec

logger = logging.getLogger("omni_accum")

ENTRY_POINT_GROUP = "omni_accum"
FIRST_PARTY_DIST = "omni-accum"
BUILTIN_MODULES = {
    "cat": "omni_accum.strategies.cat",
    "token_list": "omni_accum.strategies.token_list",
    "prealloc": "omni_accum.strategies.prealloc",
    "replace": "omni_accum.strategies.replace",
    "send_once": "omni_accum.strategies.send_once",
}
ENV_STRICT = "OMNI_ACCUM_STRICT_PLUGINS"
ENV_ALLOW = "OMNI_ACCUM_PLUGINS"
ENV_DENY = "OMNI_ACCUM_DISABLED_PLUGINS"
ENV_TRACE = "OMNI_ACCUM_TRACE_PLUGINS"
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


ENV_LOG_LEVEL = "OMNI_ACCUM_LOG_LEVEL"
LOG_FORMAT = "%(levelname)s %(asctime)s [omni-accum pid=%(process)d] %(message)s"


def ensure_visible_logging(level: int | None = None, fmt: str = LOG_FORMAT) -> logging.Logger:
    """Give the ``omni_accum`` logger a stderr handler unless it (or an ancestor) already has one.

    Called when ``OMNI_ACCUM_TRACE_PLUGINS=1`` asks for hook traces (so a library process shows them)
    and by the CLI for ``-v``; an application's own handler is kept. ``level``: at most this level when
    given; otherwise the level is set only when unset, from ``OMNI_ACCUM_LOG_LEVEL`` (default INFO).
    """
    lg = logging.getLogger("omni_accum")
    if level is not None:
        if lg.level == logging.NOTSET or lg.level > level:
            lg.setLevel(level)
    bad = None
    if level is None and lg.level == logging.NOTSET:
        raw = os.environ.get(ENV_LOG_LEVEL, "INFO").strip() or "INFO"
        named = logging.getLevelName(raw.upper())
        lg.setLevel(named if isinstance(named, int) else logging.INFO)
        bad = None if isinstance(named, int) else raw
    if not lg.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(fmt))
        lg.addHandler(handler)
    if bad is not None:
        levels = "DEBUG, INFO, WARNING, ERROR, CRITICAL"
        lg.warning("omni_accum: %s=%r is not a log level (%s): INFO", ENV_LOG_LEVEL, bad, levels)
    return lg


# ---- On/off environment switches (OMNI_ACCUM_*): one reader, strict about values. A switch set to a value
# that is neither on (1, true, yes, on) nor off (0, false, no, off), case-insensitive, is an error naming the
# variable, its value and the accepted values: OMNI_ACCUM_VLLM_OMNI=disable must not leave omni-accum on, nor
# OMNI_ACCUM_REQUIRED=y off. Unset or empty: the switch's default.
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")

#: Every on/off switch omni-accum reads, with its default.
SWITCHES: dict[str, bool] = {
    "OMNI_ACCUM_VLLM_OMNI": True,
    "OMNI_ACCUM_REQUIRED": False,
    "OMNI_ACCUM_METRICS": True,
    "OMNI_ACCUM_ARENA_CONNECTOR": True,
    "OMNI_ACCUM_MOONCAKE_COMPAT": True,
    "OMNI_ACCUM_STRICT_PLUGINS": False,
    "OMNI_ACCUM_TRACE_PLUGINS": False,
}


class SettingError(OmniAccumError, ValueError):
    """An environment switch has a value that is neither on nor off."""


def env_flag(name: str, default: bool | None = None) -> bool:
    """The on/off value of environment variable ``name`` (unset or empty: ``default``, else the value in
    :data:`SWITCHES`). Raises SettingError for any other value."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return SWITCHES.get(name, False) if default is None else default
    value = raw.strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    raise SettingError(
        f"environment variable {name}={raw!r} is neither on ({', '.join(ON)}) nor off ({', '.join(OFF)})"
    )


def switch_problems() -> list[str]:
    """The message of every switch in :data:`SWITCHES` set to a value that is neither on nor off."""
    out = []
    for name in SWITCHES:
        try:
            env_flag(name)
        except SettingError as e:
            out.append(str(e))
    return out


def check_switches() -> None:
    """Raise SettingError naming every switch set to a value that is neither on nor off."""
    problems = switch_problems()
    if problems:
        raise SettingError("; ".join(problems))


def _env_flag(name: str) -> bool:
    return env_flag(name, False)  # SettingError (an OmniAccumError) for a value neither on nor off


def _canonical(name: str) -> str:
    """PEP 503 normalisation, so ``omni_accum_delta`` and ``Omni-Accum-Delta`` name the same distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _env_list(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    return {_canonical(p.strip()) for p in raw.split(",") if p.strip()}


def describe_plugin(plugin: str, distribution: tuple[str, str] | None) -> str:
    """``plugin 'delta' (distribution omni-accum-delta 0.1.0)``: how errors name a plugin."""
    return f"plugin {plugin!r}" + (f" (distribution {distribution[0]} {distribution[1]})" if distribution else "")


class _PolicySelector:
    """Built-in selection: apply the policy. ``trylast`` so any plugin can override it."""

    @hookimpl(trylast=True)
    def omni_accum_select_strategy(
        self, key: str, meta: KeyMeta, context: StreamContext, policy: Policy
    ) -> StrategyChoice | None:
        return policy.resolve(key, context)


class StrategyManager:
    """Typed facade over the pluggy ``PluginManager`` of project ``omni_accum``.

    Args:
        load_entrypoints: load plugins from the ``omni_accum`` entry-point group (built-ins included).
        strict: turn reported plugin problems into errors (default: ``OMNI_ACCUM_STRICT_PLUGINS``).
    """

    def __init__(self, *, load_entrypoints: bool = True, strict: bool | None = None) -> None:
        self.strict = _env_flag(ENV_STRICT) if strict is None else strict
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._specs: dict[str, StrategySpec] = {}
        self._built: dict[tuple[str, str], Strategy] = {}
        self._lock = threading.Lock()
        #: Problems found while loading plugins (plugin name, message) — reported and skipped.
        self.problems: list[tuple[str, str]] = []
        #: The same problems as exceptions, each naming plugin and distribution, cause chained.
        self.errors: list[PluginError] = []
        self._trace = _env_flag(ENV_TRACE)
        self._dists: dict[str, tuple[str, str] | None] = {}  # plugin name -> its distribution
        self._loaded_eps: dict[str, str] = {}  # entry-point name -> value, for idempotent reloads
        if self._trace:
            ensure_visible_logging()  # a trace asked for is shown, even where nobody configured logging
            self.pm.trace.root.setwriter(lambda msg: logger.info("omni_accum hook: %s", msg.rstrip()))
            self.pm.enable_tracing()
        self.register(_PolicySelector(), name="omni_accum.policy", first_party=True)
        if load_entrypoints:
            self.load_entrypoints()

    # -- loading ----------------------------------------------------------------------------- #
    def load_entrypoints(self, entry_points: Iterable[metadata.EntryPoint] | None = None) -> None:
        """Load every plugin of the ``omni_accum`` entry-point group (built-ins first)."""
        eps = list(entry_points if entry_points is not None else metadata.entry_points(group=ENTRY_POINT_GROUP))
        allow, deny = _env_list(ENV_ALLOW), _env_list(ENV_DENY) or set()

        def dist_of(ep: metadata.EntryPoint) -> tuple[str, str] | None:
            d = getattr(ep, "dist", None)
            return (d.metadata["Name"], d.version) if d is not None else None

        first = [ep for ep in eps if (dist_of(ep) or ("",))[0] == FIRST_PARTY_DIST]
        third = [ep for ep in eps if ep not in first]
        # Running from a source tree without an install: register built-ins by module, same path.
        missing = [n for n in BUILTIN_MODULES if n not in {ep.name for ep in first}]
        for name in missing:
            if name not in self.pm.list_name_plugin():
                self.register(importlib.import_module(BUILTIN_MODULES[name]), name=name, first_party=True)
        for ep in sorted(first, key=lambda e: e.name) + third:
            dist = dist_of(ep)
            is_first = ep in first
            if not is_first:
                names = {_canonical(ep.name)} | ({_canonical(dist[0])} if dist else set())
                if names & deny or (allow is not None and not names & allow):
                    logger.debug("omni_accum: plugin %r disabled by %s/%s", ep.name, ENV_ALLOW, ENV_DENY)
                    continue
            if self._loaded_eps.get(ep.name) == ep.value:
                continue  # loaded by an earlier call
            try:
                plugin = ep.load()
            except Exception as e:  # noqa: BLE001 - any import failure of a plugin is reported
                self._problem(ep.name, dist, f"failed to import {ep.value!r}: {type(e).__name__}: {e}", e, is_first)
                continue
            try:
                self.register(plugin, name=ep.name, distribution=dist, first_party=is_first)
            except PluginError as e:
                self._problem(ep.name, dist, str(e), e, is_first, already=True)
            else:
                self._loaded_eps[ep.name] = ep.value
        known = {_canonical(n) for ep in third for n in (ep.name, (dist_of(ep) or ("",))[0]) if n}
        for name in sorted((allow or set()) - known):  # a typo would only show as an unknown strategy later
            logger.warning("omni_accum: %s lists %r, but no installed strategy plugin has that name", ENV_ALLOW, name)

    def _problem(
        self,
        plugin: str,
        dist: tuple[str, str] | None,
        message: str,
        cause: BaseException | None,
        first_party: bool,
        already: bool = False,
    ) -> None:
        who = describe_plugin(plugin, dist)
        text = message if already and message.startswith(who) else f"{who}: {message}"
        if isinstance(cause, PluginError) and already and str(cause) == text:
            err = cause  # already names plugin and distribution, its own cause chained
        else:
            err = PluginError(text)
            err.__cause__ = cause
        if first_party or self.strict:
            raise err
        self.problems.append((plugin, text))
        self.errors.append(err)
        logger.warning("omni_accum: %s; plugin skipped (set %s=1 to make this an error)", text, ENV_STRICT)

    def register(
        self,
        plugin: Any,
        name: str | None = None,
        distribution: tuple[str, str] | None = None,
        *,
        first_party: bool = False,
    ) -> None:
        """Register one plugin object or module and its strategies.

        Raises:
            DuplicateStrategyError: a strategy name is already registered (names both plugins).
            PluginError: the plugin implements unknown hooks, raises, or returns invalid records.
        """
        name = name or getattr(plugin, "__name__", None) or repr(plugin)
        who = describe_plugin(name, distribution)
        try:
            self.pm.register(plugin, name=name)
        except ValueError as e:
            raise PluginError(f"{who}: cannot register: {e}") from e
        except pluggy.PluginValidationError as e:
            raise PluginError(f"{who}: invalid hook implementation: {e}") from e
        try:
            new_specs = self._collect(plugin, name, distribution, who)
        except BaseException:
            self.pm.unregister(plugin)
            raise
        with self._lock:
            self._specs.update(new_specs)
            self._dists[name] = distribution
        if new_specs:
            where = f"{distribution[0]} {distribution[1]}" if distribution else "no distribution"
            logger.debug("omni_accum: plugin %r (%s) registered %s", name, where, ", ".join(sorted(new_specs)))

    def _collect(
        self, plugin: Any, name: str, distribution: tuple[str, str] | None, who: str
    ) -> dict[str, StrategySpec]:
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            raise PluginError(f"{who}: {e}") from e
        out: dict[str, StrategySpec] = {}
        for impl in self.pm.hook.omni_accum_register_strategies.get_hookimpls():
            if impl.plugin is not plugin:
                continue
            try:
                records = impl.function()
            except Exception as e:  # noqa: BLE001 - a raising hook is a broken plugin
                raise PluginError(f"{who}: omni_accum_register_strategies raised {type(e).__name__}: {e}") from e
            if self._trace:
                logger.info("omni_accum hook: omni_accum_register_strategies [%s] -> %r", name, records)
            if records is None:
                continue
            if not isinstance(records, (list, tuple)):
                raise PluginError(
                    f"{who}: omni_accum_register_strategies must return a list of StrategySpec, "
                    f"got {type(records).__name__}"
                )
            for rec in records:
                spec = self._validate_spec(rec, who)
                spec = replace(spec, plugin=name, distribution=distribution)
                prior = self._specs.get(spec.name) or out.get(spec.name)
                if prior is not None:
                    err = DuplicateStrategyError(spec.name, prior.plugin or "?", name)
                    err.args = (
                        f"{who}: {err}; the first is {describe_plugin(prior.plugin or '?', prior.distribution)}",
                    )
                    raise err
                out[spec.name] = spec
        return out

    @staticmethod
    def _validate_spec(rec: Any, who: str) -> StrategySpec:
        if not isinstance(rec, StrategySpec):
            raise PluginError(f"{who}: returned {type(rec).__name__}, expected omni_accum.StrategySpec")
        if not isinstance(rec.name, str) or not _NAME_RE.match(rec.name):
            raise PluginError(f"{who}: invalid strategy name {rec.name!r} (letters, digits, _ . -)")
        if not callable(rec.factory):
            raise PluginError(f"{who}: strategy {rec.name!r}: factory is not callable")
        pm = rec.params_model
        if not (isinstance(pm, type) and issubclass(pm, BaseModel)):
            raise PluginError(f"{who}: strategy {rec.name!r}: params_model must be a pydantic BaseModel subclass")
        if pm.model_config.get("extra") != "forbid":
            raise PluginError(
                f"{who}: strategy {rec.name!r}: params_model {pm.__name__} must set "
                "model_config = ConfigDict(extra='forbid') so misspelled params are errors"
            )
        try:
            pm()
        except Exception as e:  # noqa: BLE001
            raise PluginError(
                f"{who}: strategy {rec.name!r}: params_model {pm.__name__} must validate with no arguments "
                f"(every param needs a default): {e}"
            ) from e
        kinds = frozenset(rec.kinds)
        if not kinds or not kinds <= set(KINDS):
            raise PluginError(
                f"{who}: strategy {rec.name!r}: kinds {sorted(kinds)} must be a non-empty subset of {list(KINDS)}"
            )
        for i, grid in enumerate(rec.params_grid):
            try:
                pm.model_validate(grid)
            except Exception as e:  # noqa: BLE001
                raise PluginError(f"{who}: strategy {rec.name!r}: params_grid[{i}] invalid: {e}") from e
        return replace(rec, kinds=kinds)

    # -- lookups ----------------------------------------------------------------------------- #
    def specs(self) -> list[StrategySpec]:
        """Every registered strategy, sorted by name."""
        return [self._specs[n] for n in sorted(self._specs)]

    def names(self) -> list[str]:
        return sorted(self._specs)

    def get_spec(self, name: str) -> StrategySpec | None:
        return self._specs.get(name)

    def spec(self, name: str, where: str | None = None) -> StrategySpec:
        """Return the spec of ``name``; :class:`UnknownStrategyError` lists the available names."""
        spec = self._specs.get(name)
        if spec is None:
            raise UnknownStrategyError(name, self.names(), where)
        return spec

    def build(self, name: str, params: Any = None) -> Strategy:
        """Create (or reuse) the strategy ``name`` with ``params`` validated by its Params model."""
        key = (name, repr(sorted((params or {}).items())) if isinstance(params, dict) else repr(params))
        built = self._built.get(key)
        if built is None:
            built = self.spec(name).build(
                dict(params) if params is not None and not isinstance(params, BaseModel) else params
            )
            with self._lock:
                self._built[key] = built
        return built

    def select(self, key: str, meta: KeyMeta, context: StreamContext, policy: Policy) -> StrategyChoice:
        """Run ``omni_accum_select_strategy`` (first non-None result wins)."""
        try:
            choice = self.pm.hook.omni_accum_select_strategy(key=key, meta=meta, context=context, policy=policy)
        except Exception as e:  # noqa: BLE001 - a raising selection hook fails the request, not the process
            raise PluginError(
                f"{self._culprit('omni_accum_select_strategy', e)}: omni_accum_select_strategy raised "
                f"{type(e).__name__} for key {key!r}: {e}"
            ) from e
        if choice is None:  # only if a plugin unregistered the built-in selector
            choice = policy.resolve(key, context)
        if not isinstance(choice, StrategyChoice):
            raise PluginError(f"omni_accum_select_strategy returned {type(choice).__name__}, expected StrategyChoice")
        return choice

    def _culprit(self, hook: str, exc: BaseException) -> str:
        """Name the plugin whose implementation of ``hook`` raised ``exc`` (from the traceback)."""
        codes = {f.f_code for f, _ in traceback.walk_tb(exc.__traceback__)}
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            func = getattr(impl.function, "__func__", impl.function)
            if getattr(func, "__code__", None) in codes:
                return describe_plugin(impl.plugin_name, self._dists.get(impl.plugin_name))
        return "a plugin"


_manager: StrategyManager | None = None
_manager_lock = threading.Lock()


def get_manager() -> StrategyManager:
    """The process-wide manager (created on first use; plugins are loaded once)."""
    global _manager
    if _manager is None:
        with _manager_lock:
            if _manager is None:
                _manager = StrategyManager()
    return _manager


def reset_manager(manager: StrategyManager | None = None) -> None:
    """Replace (or drop, with None) the process-wide manager; for tests and reloads."""
    global _manager
    with _manager_lock:
        _manager = manager
