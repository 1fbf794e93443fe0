"""The plugin manager: loads strategy plugins and answers "which strategy is X".

Built-in strategies and third-party plugins go through the same path: entry points of group
``omni_accum`` are loaded, registered with a pluggy ``PluginManager``, checked with
``check_pending()``, and their ``omni_accum_register_strategies`` results validated.

A broken third-party plugin (fails to import, implements no hook or an unknown one, raises in a hook, returns invalid
records, takes a reserved or repeated strategy name) is reported and skipped, in one line; ``OMNI_ACCUM_STRICT_PLUGINS``
makes that an error. A broken built-in is always an error. ``OMNI_ACCUM_PLUGINS`` (comma-separated allowlist) and
``OMNI_ACCUM_DISABLED_PLUGINS`` (blocklist) filter third-party plugins by entry-point or distribution name;
``OMNI_ACCUM_TRACE_PLUGINS=1`` logs every hook call.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import replace
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy
from pydantic import BaseModel

from omni_accum import hookspecs
from omni_accum.context import KeyMeta, StreamContext
from omni_accum.errors import (
    PluginError,
    UnknownStrategyError,
    describe_plugin,
    hook_problem,
    plugin_name,
)
from omni_accum.hookspecs import ALL_HOOKS, PROJECT, hookimpl
from omni_accum.plugin_checks import (
    choosing_plugin,
    class_plugin,
    duplicate,
    is_fatal,
    raising_plugin,
    validate_spec,
)
from omni_accum.policy.model import Policy, StrategyChoice
from omni_accum.strategy import Strategy, StrategySpec, checked_strategy, describe_strategy, validation_summary
from omni_accum.switches import _env_flag, ensure_visible_logging

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
#: What ``omni-accum bench --arms`` names besides strategies: a strategy may not take one (it could never be
#: reached there, or would hide the other). The policy presets (``preset_names()``) are reserved too.
RESERVED_NAMES = ("upstream", "wire-floor")


def _canonical(name: str) -> str:
    """PEP 503 normalisation, so ``omni_accum_delta`` and ``Omni-Accum-Delta`` name the same distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _env_list(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    return {_canonical(p.strip()) for p in raw.split(",") if p.strip()}


class _PolicySelector:
    """Built-in selection: apply the policy. ``trylast`` so any plugin can override it."""

    @hookimpl(trylast=True)
    def omni_accum_select_strategy(self, key: str, meta: KeyMeta, context: StreamContext, policy: Policy) -> Any:
        return policy.resolve(key, context)


MAX_BUILT = 1024  # strategies kept built (the stage input processor builds prealloc with each prompt's length)


def _not_a_plugin(plugin: Any) -> str | None:
    """``an int (42), not a module, ...`` for a value of a built-in type (an int, a str, a function) with no hooks."""
    kind = type(plugin).__name__
    if plugin is None or isinstance(plugin, (ModuleType, type)) or type(plugin).__module__ != "builtins":
        return None
    if any(hasattr(plugin, h) for h in ALL_HOOKS):
        return None
    return (f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} ({plugin!r:.60}), not a module, class instance or object "
            "with omni_accum hooks")  # fmt: skip


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
        #: Third-party plugins left out by OMNI_ACCUM_PLUGINS / OMNI_ACCUM_DISABLED_PLUGINS (entry-point names).
        self.disabled: list[str] = []
        #: What OMNI_ACCUM_PLUGINS / OMNI_ACCUM_DISABLED_PLUGINS list that names no installed plugin (``doctor``).
        self.list_problems: list[str] = []
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
            return (str(d.metadata["Name"] or "?"), str(d.version or "?")) if d is not None else None

        first = [ep for ep in eps if (dist_of(ep) or ("",))[0] == FIRST_PARTY_DIST]
        third = [ep for ep in eps if ep not in first]
        # Running from a source tree without an install: register built-ins by module, same path.
        missing = [n for n in BUILTIN_MODULES if n not in {ep.name for ep in first}]
        for name in missing:
            if name not in self.pm.list_name_plugin():
                self.register(importlib.import_module(BUILTIN_MODULES[name]), name=name, first_party=True)
        for ep in sorted(first, key=lambda e: e.name) + third:
            dist, is_first = dist_of(ep), ep in first
            if not is_first:
                names = {_canonical(ep.name)} | ({_canonical(dist[0])} if dist else set())
                if names & deny or (allow is not None and not names & allow):
                    logger.debug("omni_accum: plugin %r disabled by %s/%s", ep.name, ENV_ALLOW, ENV_DENY)
                    if ep.name not in self.disabled:
                        self.disabled.append(ep.name)
                    continue
            if self._loaded_eps.get(ep.name) == ep.value:
                continue  # loaded by an earlier call
            try:
                plugin = ep.load()
            except BaseException as e:  # noqa: BLE001 - SystemExit too (argparse at import): the plugin's failure
                if is_fatal(e):
                    raise
                hint = " (it exits when imported: parse arguments under if __name__ == '__main__')" * isinstance(
                    e, SystemExit)  # fmt: skip
                self._problem(ep.name, dist, f"failed to import {ep.value!r}: {type(e).__name__}: {e}{hint}", e,
                              is_first)  # fmt: skip
                continue
            if _not_a_plugin(plugin):  # THING = 42: not "implements no hook", as if hooks were only unmarked
                self._problem(ep.name, dist, f"the entry point {ep.value!r} is {_not_a_plugin(plugin)}", None, is_first)
                continue
            try:
                self.register(plugin, name=ep.name, distribution=dist, first_party=is_first)
            except BaseException as e:  # noqa: BLE001 - whatever a plugin's registration raises is its own failure
                if is_fatal(e):
                    raise
                own = isinstance(e, PluginError)
                text = str(e) if own else f"registration raised {type(e).__name__}: {e}"
                self._problem(ep.name, dist, text, e, is_first, already=own)
            else:
                self._loaded_eps[ep.name] = ep.value
        known = {_canonical(n) for ep in third for n in (ep.name, (dist_of(ep) or ("",))[0]) if n}
        builtin = {_canonical(n) for n in [*(ep.name for ep in first), FIRST_PARTY_DIST, *BUILTIN_MODULES]}
        valid = ", ".join(sorted(known)) or "none installed"
        for env, names in ((ENV_ALLOW, allow or set()), (ENV_DENY, deny)):  # a typo would only show later
            for name in sorted(names - known - (builtin if env == ENV_ALLOW else set())):  # built-ins always load
                no_such = f"but no installed strategy plugin has that name (plugins: {valid})"
                why = "a built-in: built-ins cannot be disabled" if name in builtin else no_such
                logger.warning("omni_accum: %s lists %r, %s", env, name, why)
                self.list_problems.append(f"{env} lists {name!r}, {why}")

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
            PluginError: the plugin implements unknown hooks, raises, or returns invalid records; or (registering
                nothing) ``plugin`` is None, ``name`` not a non-empty str, ``distribution`` not a (str, str) pair.
        """
        name = plugin_name(plugin, name, distribution)
        who = describe_plugin(name, distribution)
        class_plugin(plugin, who, ALL_HOOKS)
        try:
            self.pm.register(plugin, name=name)
        except ValueError as e:
            raise PluginError(f"{who}: cannot register: {self._clash(plugin, name)}") from e
        except pluggy.PluginValidationError as e:
            raise PluginError(f"{who}: invalid hook implementation: {hook_problem(e, ALL_HOOKS)}") from e
        try:
            if not self.pm.get_hookcallers(plugin):
                if _not_a_plugin(plugin):
                    raise PluginError(f"{who}: is {_not_a_plugin(plugin)}")
                unmarked = [n for n in ALL_HOOKS if callable(getattr(plugin, n, None))]
                raise PluginError(f"{who}: implements no omni_accum hook (mark {' or '.join(unmarked or ALL_HOOKS)} "
                                  "with @omni_accum.hookimpl)")  # fmt: skip
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
        elif not first_party and {c.name for c in self.pm.get_hookcallers(plugin) or []} == {ALL_HOOKS[0]}:
            logger.warning("omni_accum: %s: omni_accum_register_strategies returned no strategy", who)

    def _clash(self, plugin: Any, name: str) -> str:
        """Why pluggy refused ``plugin`` as ``name``, in a line (pluggy's own text prints the whole registry)."""
        taken = self.pm.get_plugin(name)
        if taken is not None and taken is not plugin:
            builtin = name in BUILTIN_MODULES or (self._dists.get(name) or ("",))[0] == FIRST_PARTY_DIST
            owner = "omni-accum's built-in strategy plugin" if builtin else describe_plugin(name, self._dists.get(name))
            return f"the name {name!r} is taken by {owner}; give the entry point another name"
        other = self.pm.get_name(plugin)
        if other is not None:
            return f"the same object is already registered as plugin {other!r} (two entry points name one module)"
        return f"the name {name!r} is already registered"

    def _collect(
        self, plugin: Any, name: str, distribution: tuple[str, str] | None, who: str
    ) -> dict[str, StrategySpec]:
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            raise PluginError(f"{who}: {hook_problem(e, ALL_HOOKS)}") from e
        out: dict[str, StrategySpec] = {}
        for impl in self.pm.hook.omni_accum_register_strategies.get_hookimpls():
            if impl.plugin is not plugin:
                continue
            try:
                records = impl.function()
            except BaseException as e:  # noqa: BLE001 - a raising hook (SystemExit too) is a broken plugin
                if is_fatal(e):
                    raise
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
                spec = replace(validate_spec(rec, who, _reserved_names()), plugin=name, distribution=distribution)
                prior = self._specs.get(spec.name) or out.get(spec.name)
                if prior is not None:
                    builtin = (prior.distribution or ("",))[0] == FIRST_PARTY_DIST or prior.plugin in BUILTIN_MODULES
                    raise duplicate(spec, prior, name, who, builtin)
                out[spec.name] = spec
        return out

    def selectors(self) -> list[str]:
        """The plugins with an ``omni_accum_select_strategy`` of their own (the policy's is left out), named."""
        impls = self.pm.hook.omni_accum_select_strategy.get_hookimpls()
        return [describe_plugin(i.plugin_name, self._dists.get(i.plugin_name)) for i in impls if i.plugin_name
                != "omni_accum.policy"]  # fmt: skip

    def not_loaded_note(self) -> str:
        """`` (not loaded here: ...)``, naming the plugins that were disabled or failed to load, for a message
        about a strategy no loaded plugin provides; empty when every plugin loaded."""
        parts = [f"{n!r} disabled by {ENV_ALLOW}/{ENV_DENY}" for n in self.disabled]
        parts += [f"{n!r} failed to load" for n, _ in self.problems]
        return f" (plugins not loaded here: {', '.join(parts)}; see omni-accum doctor)" if parts else ""

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

    def params(self, name: str, params: Any = None, where: str | None = None) -> BaseModel:
        """``params`` validated by strategy ``name``'s Params model. PluginError in one line naming the strategy,
        its plugin, what is wrong and the params it takes (a selection hook's choice is not checked by any
        policy loader); ``where``: the key and who chose it."""
        spec = self.spec(name, where)
        if isinstance(params, BaseModel):
            return params
        given = dict(params) if isinstance(params, Mapping) else {} if params is None else params
        try:
            if not isinstance(given, dict):  # a list or a str: dict() would raise a bare TypeError or ValueError
                raise TypeError(f"params must be a mapping of param names to values, not {type(given).__name__}")
            return spec.params_model.model_validate(given)
        except Exception as e:  # noqa: BLE001 - a ValidationError, or a validator of the plugin's raising
            raise PluginError(
                f"{describe_strategy(spec, where)} refuses params {given!r}: {validation_summary(e)} "
                f"(allowed params: {spec.allowed_params()})"
            ) from e

    def build(self, name: str, params: Any = None, where: str | None = None) -> Strategy:
        """Create (or reuse) the strategy ``name`` with ``params`` validated by its Params model. PluginError in
        one line when the params are refused or the plugin's factory raises."""
        key = (name, repr(sorted(params.items(), key=repr)) if isinstance(params, dict) else repr(params))
        built = self._built.get(key)
        if built is None:
            spec = self.spec(name, where)
            valid = self.params(name, params, where)
            try:
                built = spec.factory(valid)
            except Exception as e:  # noqa: BLE001 - a plugin's factory raising is that plugin's problem
                raise PluginError(
                    f"{describe_strategy(spec, where)}: its factory raised {type(e).__name__} with params "
                    f"{valid.model_dump()!r}: {e}"
                ) from e
            built = checked_strategy(spec, built, where)  # not a Strategy: named here, not as an AttributeError later
            with self._lock:
                self._built[key] = built
                if len(self._built) > MAX_BUILT:  # params that differ per request: the oldest go
                    del self._built[next(iter(self._built))]
        return built

    def select(self, key: str, meta: KeyMeta, context: StreamContext, policy: Policy) -> StrategyChoice:
        """Run ``omni_accum_select_strategy`` (first non-None result wins)."""
        kwargs = {"key": key, "meta": meta, "context": context, "policy": policy}
        try:
            choice = self.pm.hook.omni_accum_select_strategy(**kwargs)
        except Exception as e:  # noqa: BLE001 - a raising selection hook fails the request, not the process
            raise PluginError(
                f"{self._culprit('omni_accum_select_strategy', e)}: omni_accum_select_strategy raised "
                f"{type(e).__name__} for key {key!r}: {e}"
            ) from e
        if choice is None:  # only if a plugin unregistered the built-in selector
            choice = policy.resolve(key, context)
        bad = not isinstance(choice, StrategyChoice)
        if bad or (not choice.source and choice.strategy not in self._specs):  # name the plugin that chose it
            impls = self.pm.hook.omni_accum_select_strategy.get_hookimpls()
            who = self._who(choosing_plugin(impls, kwargs, choice))
            if bad:
                raise PluginError(f"{who}: omni_accum_select_strategy returned {type(choice).__name__} {choice!r:.80} "
                                  f"for key {key!r}; return an omni_accum StrategyChoice, or None")  # fmt: skip
            choice = replace(choice, source=who)
        return choice

    def _culprit(self, hook: str, exc: BaseException) -> str:
        """Name the plugin whose implementation of ``hook`` raised ``exc`` (from the traceback)."""
        return self._who(raising_plugin(getattr(self.pm.hook, hook).get_hookimpls(), exc))

    def _who(self, plugin: str | None) -> str:
        return describe_plugin(plugin, self._dists.get(plugin)) if plugin else "a plugin"


@functools.cache
def _reserved_names() -> tuple[str, ...]:
    """The bench arms' names and the policy presets' (read from the presets' folder once, no plugin loading)."""
    from omni_accum.policy.sources import preset_names

    return (*RESERVED_NAMES, *preset_names())


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
