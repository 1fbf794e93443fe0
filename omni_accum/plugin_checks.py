"""What the plugin manager checks in what a plugin hands it: its strategy records, a class registered where an
instance was meant, a name two plugins register, which plugin's hook raised or chose; split out of
:mod:`omni_accum.manager` so each check can name the plugin, the value and the fix.

Every check here raises :class:`PluginError`: a plugin's mistake is that plugin's failure (reported and skipped
while loading, the request's failure at run time), never the process's.
"""

from __future__ import annotations

import inspect
import re
import traceback
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from pydantic import BaseModel

from omni_accum.errors import DuplicateStrategyError, PluginError, describe_plugin
from omni_accum.strategy import KINDS, StrategySpec, validation_summary

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
#: What a plugin may not swallow as its own failure: the user stopping the process, a generator being closed.
FATAL = (KeyboardInterrupt, GeneratorExit)


def is_fatal(exc: BaseException) -> bool:
    """True for what stops the process on purpose (Ctrl-C); everything else a plugin raises (SystemExit from an
    argparse at import included) is that plugin's failure."""
    return isinstance(exc, FATAL)


def validate_spec(rec: Any, who: str, reserved: tuple[str, ...]) -> StrategySpec:
    """``rec`` checked and normalised (kinds a frozenset, params_grid a tuple); PluginError naming the field."""
    if not isinstance(rec, StrategySpec):
        raise PluginError(f"{who}: returned {type(rec).__name__}, expected omni_accum.StrategySpec")
    if not isinstance(rec.name, str) or not NAME_RE.match(rec.name):
        raise PluginError(f"{who}: invalid strategy name {rec.name!r} (letters, digits, _ . -)")
    if rec.name in reserved:
        raise PluginError(
            f"{who}: strategy name {rec.name!r} is reserved (bench arms and policy presets: {', '.join(reserved)})"
        )
    if not callable(rec.factory):
        raise PluginError(f"{who}: strategy {rec.name!r}: factory is not callable")
    if not isinstance(rec.description, str):  # printed by `omni-accum strategies`, in text and JSON
        raise PluginError(f"{who}: strategy {rec.name!r}: description {rec.description!r} must be a str")
    pm = rec.params_model
    if not (isinstance(pm, type) and issubclass(pm, BaseModel)):
        raise PluginError(f"{who}: strategy {rec.name!r}: params_model must be a pydantic BaseModel subclass")
    if pm.model_config.get("extra") != "forbid":
        raise PluginError(
            f"{who}: strategy {rec.name!r}: params_model {pm.__name__} must set "
            "model_config = ConfigDict(extra='forbid') so misspelled params are errors"
        )
    try:
        pm.model_validate(pm().model_dump(by_alias=True))  # pydantic does not check defaults: each must be valid
    except Exception as e:  # noqa: BLE001
        raise PluginError(
            f"{who}: strategy {rec.name!r}: params_model {pm.__name__} must validate with no arguments "
            f"(every param needs a default of its own type): {validation_summary(e)}"
        ) from e
    kinds = _kinds(rec, who)
    return replace(rec, kinds=kinds, params_grid=_grid(rec, pm, who))


def _kinds(rec: StrategySpec, who: str) -> frozenset[str]:
    # None, a str or a number iterate wrongly or not at all: each was a bare TypeError that took the process down.
    fix = f"must be a set of {list(KINDS)} (leave kinds out for all three)"
    if isinstance(rec.kinds, (str, bytes)) or not hasattr(rec.kinds, "__iter__"):
        raise PluginError(f"{who}: strategy {rec.name!r}: kinds {rec.kinds!r} {fix}")
    try:
        kinds = frozenset(rec.kinds)
    except TypeError as e:  # an unhashable item
        raise PluginError(f"{who}: strategy {rec.name!r}: kinds {rec.kinds!r} {fix}: {e}") from e
    if not kinds or not kinds <= set(KINDS):
        shown = sorted(kinds, key=repr) if all(isinstance(k, str) for k in kinds) else sorted(map(repr, kinds))
        raise PluginError(
            f"{who}: strategy {rec.name!r}: kinds {shown} must be a non-empty subset of {list(KINDS)}"
        )
    return kinds


def _grid(rec: StrategySpec, pm: type[BaseModel], who: str) -> tuple[dict[str, Any], ...]:
    grid = rec.params_grid
    if isinstance(grid, (str, bytes, Mapping)) or not isinstance(grid, (list, tuple)):
        raise PluginError(
            f"{who}: strategy {rec.name!r}: params_grid {grid!r} must be a tuple of params mappings, such as "
            "({'depth': 2},) (leave params_grid out to tune the defaults only)"
        )
    for i, params in enumerate(grid):
        if not isinstance(params, Mapping):
            raise PluginError(
                f"{who}: strategy {rec.name!r}: params_grid[{i}] {params!r} must be a mapping of param names to "
                f"values, not {type(params).__name__}"
            )
        try:
            pm.model_validate(dict(params))
        except Exception as e:  # noqa: BLE001
            raise PluginError(
                f"{who}: strategy {rec.name!r}: params_grid[{i}] invalid: {validation_summary(e)}"
            ) from e
    return tuple(dict(p) for p in grid)


def duplicate(spec: StrategySpec, prior: StrategySpec, name: str, who: str, builtin: bool) -> DuplicateStrategyError:
    """The error for ``spec`` (of plugin ``name``, being registered) taking a name ``prior`` already has: which plugin
    serves the strategy, that this one is skipped, and which plugin to disable for which outcome."""
    err = DuplicateStrategyError(spec.name, prior.plugin or "?", name)
    if prior.plugin == name:  # one plugin's own records: the only fix is in that plugin
        err.args = (
            f"{who}: strategy {spec.name!r} is registered twice by this plugin's omni_accum_register_strategies; "
            "give each StrategySpec its own name (plugin skipped)",
        )
        return err
    first = describe_plugin(prior.plugin or "?", prior.distribution)
    keep = (
        f"to use this plugin's {spec.name!r} instead, rename the strategy in it (a built-in cannot be disabled)"
        if builtin
        else f"to use this plugin's {spec.name!r} instead, disable {first} (OMNI_ACCUM_DISABLED_PLUGINS={prior.plugin})"
    )
    err.args = (
        f"{who}: strategy {spec.name!r} is registered twice: {first} serves it, so this plugin is skipped; {keep}; "
        f"to keep the one {first} serves, disable this one (OMNI_ACCUM_DISABLED_PLUGINS={name}) or uninstall it",
    )
    return err


def class_plugin(plugin: Any, who: str, hooks: tuple[str, ...]) -> None:
    """Refuse a class registered where an instance was meant (an entry point naming ``pkg:MyPlugin``): its hooks
    are then unbound methods, and every call would fail with a TypeError about ``self``."""
    if not isinstance(plugin, type):
        return
    unbound = [h for h in hooks if _takes_self(inspect.getattr_static(plugin, h, None))]
    if unbound:
        raise PluginError(
            f"{who}: is the class {plugin.__qualname__}, whose hook {unbound[0]} is a method that needs an instance: "
            f"point the entry point at an instance (plugin = {plugin.__qualname__}() in the module, "
            f"then 'module:plugin'), or make the hooks @staticmethod"
        )


def _takes_self(fn: Any) -> bool:
    """Whether class attribute ``fn`` is a method whose first parameter is the instance (``self``, which pluggy
    leaves out of the hook's arguments); a function without it works from the class (called with the hook's
    arguments only) and is taken."""
    if not inspect.isfunction(fn):
        return False
    first = next(iter(inspect.signature(fn).parameters.values()), None)
    return first is not None and first.name == "self"


def raising_plugin(hookimpls: list[Any], exc: BaseException) -> str | None:
    """The name of the plugin whose hook implementation raised ``exc``: the one whose code is in the traceback, else
    the one pluggy was calling (its caller's ``hook_impl``: a call that failed before entering the hook, such as
    a TypeError for missing arguments)."""
    frames = [f for f, _ in traceback.walk_tb(exc.__traceback__)]
    codes = {f.f_code for f in frames}
    for impl in hookimpls:
        func = getattr(impl.function, "__func__", impl.function)
        if getattr(func, "__code__", None) in codes:
            return str(impl.plugin_name)
    calling = [f.f_locals.get("hook_impl") for f in frames]
    names = [getattr(c, "plugin_name", None) for c in calling if c is not None]
    return str(names[-1]) if names and names[-1] else None


def choosing_plugin(hookimpls: list[Any], kwargs: dict[str, Any], choice: Any) -> str | None:
    """The plugin whose selection hook returned ``choice``: called again in pluggy's order (last registered first)
    until one returns something; only on the error path, to name the plugin of a bad choice."""
    for impl in reversed(hookimpls):
        if getattr(impl, "hookwrapper", False) or getattr(impl, "wrapper", False):
            continue
        try:
            got = impl.function(*[kwargs[a] for a in impl.argnames])
        except Exception:  # noqa: BLE001 - best effort: the message then names no plugin
            return None
        if got is not None:
            return str(impl.plugin_name) if got is choice or got == choice else None
    return None
