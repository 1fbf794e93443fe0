"""Exceptions raised by omni-accum.

Every error names the thing, the place and, where there is a choice, the valid choices.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from typing import Any


class OmniAccumError(Exception):
    """Base class of every error omni-accum raises on purpose."""


class AccumulationError(OmniAccumError):
    """A chunk could not be accumulated for one request.

    The request's earlier state is left as it was before the failing chunk (or, when a strategy
    raised half-way through a chunk, the request is marked failed and every later merge says so
    until it is released). Other requests are never affected.

    Attributes:
        request_id: the request whose chunk failed, or None when not known.
        key: the key path (``"embed.decode"``) that failed, or None for the whole chunk.
        strategy: the strategy name in charge of the key, or None.
        plugin: the plugin that provides that strategy, or None.
        seq: the sequence number of the failing chunk, when the chunk carried one.
        missing: sequence numbers the receiver still waits for (a gap), at most the first 100; empty otherwise.
    """

    def __init__(
        self,
        message: str,
        *,
        request_id: str | None = None,
        key: str | None = None,
        strategy: str | None = None,
        plugin: str | None = None,
        seq: int | None = None,
        missing: tuple[int, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.key = key
        self.strategy = strategy
        self.plugin = plugin
        self.seq = seq
        self.missing = tuple(missing)
        self.reason = message
        where = []
        if request_id is not None:
            where.append(f"request {request_id!r}")
        if seq is not None:
            where.append(f"chunk seq {seq}")
        if key is not None:
            where.append(f"key {key!r}")
        if strategy is not None:
            where.append(f"strategy {strategy!r}" + (f" (plugin {plugin!r})" if plugin else ""))
        super().__init__(f"{', '.join(where)}: {message}" if where else message)


class UnknownRequestError(OmniAccumError, KeyError):
    """A Sender or Receiver was asked about a request it holds no state for (never merged, or released).

    A ``KeyError`` too, so ``except KeyError`` keeps working. Attributes: ``request_id``, ``live``
    (how many requests held state then).
    """

    def __init__(self, request_id: object, live: int) -> None:
        self.request_id = request_id
        self.live = live
        self.reason = (
            f"unknown request {request_id!r}: no state held for it (never merged, or released); "
            f"{live} request{'' if live == 1 else 's'} live"
        )
        super().__init__(self.reason)

    def __str__(self) -> str:  # KeyError would quote the message
        return self.reason


class InvalidArgumentError(OmniAccumError, TypeError, ValueError):
    """A call got an argument of the wrong type or value (``StreamContext(concurrency=0)``,
    ``Receiver(reorder_window=-1)``, ``merge(..., context="8k")``), raised by the call that received it.

    The message names the argument, the value and what is valid. Also a ``TypeError`` and a ``ValueError``
    (what such mistakes raised before), so ``except TypeError`` and ``except ValueError`` keep working.
    """


class SettingError(OmniAccumError, ValueError):
    """An environment setting (an ``OMNI_ACCUM_*`` switch) has a value it does not accept."""


class MergeError(ValueError):
    """Raised by an accumulator when a value cannot be merged; the engine wraps it in AccumulationError."""


class PolicyError(OmniAccumError):
    """A policy could not be loaded or is invalid. ``errors`` lists every problem found.

    ``details``: the same problems as ``{"loc", "line", "msg"}`` records (field path such as
    ``rules[0].params.growth`` or None, 1-based line in the source text or None, and the message
    without source and place), when the loader could tell them apart.
    """

    def __init__(
        self,
        message: str,
        errors: list[str] | None = None,
        source: str | None = None,
        details: list[dict] | None = None,
    ) -> None:
        self.errors = list(errors or [message])
        self.source = source
        self.details = list(details) if details is not None else None
        super().__init__(message)


class PolicyArgumentError(PolicyError, InvalidArgumentError):
    """``load_policy`` (or a ``Sender``/``Receiver``) got a policy argument of a type no policy can be
    (a number, a list, bytes). A :class:`PolicyError`, and an :class:`InvalidArgumentError`."""


class UnknownStrategyError(PolicyError):
    """A policy or a call names a strategy that no loaded plugin provides."""

    def __init__(self, name: str, available: list[str], where: str | None = None) -> None:
        self.name = name
        self.available = sorted(available)
        loc = f"{where}: " if where else ""
        msg = f"{loc}unknown strategy {name!r}. Available: {', '.join(self.available) or '(none loaded)'}"
        super().__init__(msg, [msg])


class PluginError(OmniAccumError):
    """A strategy plugin is broken: failed to import, raised in a hook, or returned invalid records."""


class DuplicateStrategyError(PluginError):
    """Two plugins register the same strategy name."""

    def __init__(self, name: str, first: str, second: str) -> None:
        self.name = name
        self.plugins = (first, second)
        super().__init__(
            f"strategy {name!r} is registered twice: by plugin {first!r} and by plugin {second!r}; "
            f"disable one of them (OMNI_ACCUM_DISABLED_PLUGINS={second})"
        )


def describe_plugin(plugin: str, distribution: tuple[str, str] | None) -> str:
    """``plugin 'delta' (distribution omni-accum-delta 0.1.0)``: how errors name a plugin. Raises ``TypeError`` for a
    ``distribution`` that is not a ``(name, version)`` pair of strings (``StrategyManager.register`` checks it first,
    with :func:`plugin_name`)."""
    pair = isinstance(distribution, tuple | list) and len(distribution) == 2
    if distribution is not None and not (pair and all(isinstance(p, str) for p in distribution)):
        raise TypeError(f"distribution must be a (name, version) pair of strings, got {distribution!r}")
    return f"plugin {plugin!r}" + (f" (distribution {distribution[0]} {distribution[1]})" if distribution else "")


def plugin_name(plugin: object, name: object, distribution: object) -> str:
    """The name ``StrategyManager.register`` gives ``plugin``: ``name``, else its ``__name__``, else its repr.

    Raises :class:`PluginError`, naming the value and what is valid, before anything is registered: ``plugin`` is
    None, ``name`` is not None or a non-empty str, or ``distribution`` is not None or a ``(name, version)`` pair of
    strings (a tuple or a list of two).
    """
    if plugin is None:
        raise PluginError("cannot register plugin None: give a module or an object with @omni_accum.hookimpl functions")
    if name is not None and not (isinstance(name, str) and name.strip()):
        raise PluginError(
            f"cannot register a plugin under the name {name!r} ({type(name).__name__}): give a non-empty str, "
            "or None for the plugin's __name__"
        )
    name = name or getattr(plugin, "__name__", None) or repr(plugin)
    try:
        describe_plugin(str(name), distribution)  # type: ignore[arg-type]  # a TypeError for a bad distribution
    except TypeError as e:
        raise PluginError(
            f"plugin {name!r}: cannot register: {e}; give None or a pair such as ('my-strategies', '0.1.0')"
        ) from None
    return str(name)


def key_form(word: object) -> str:
    """``word`` written as a setting's key is compared: stripped, lowercased, ``-`` as ``_``."""
    return str(word).strip().lower().replace("-", "_")


def setting_given(extra: object, key: str) -> Any:
    """``extra[key]`` as a deploy setting is read: None when ``extra`` is no mapping or the key is absent, and also
    when its value is None (an empty YAML value), ``''`` or blanks, so that every connector setting, and ``doctor``
    reading them, takes an empty value as the key left out."""
    value = extra.get(key) if isinstance(extra, Mapping) else None
    return None if isinstance(value, str) and not value.strip() else value


def close_matches(word: object, choices: Iterable[str], *, n: int = 1, cutoff: float = 0.6) -> list[str]:
    """The (at most ``n``) ``choices`` closest to ``word``, best first, for a "did you mean" hint: difflib's ratio of
    at least ``cutoff``, both compared in :func:`key_form` (``Master-Server`` is close to ``master_server``). Every
    "did you mean" of omni-accum comes from here, so one typo gets the same hint from the connector, the plugin and
    ``doctor``."""
    forms: dict[str, str] = {}
    for choice in choices:
        forms.setdefault(key_form(choice), choice)
    return [forms[f] for f in difflib.get_close_matches(key_form(word), list(forms), n=n, cutoff=cutoff)]


def hook_problem(err: Exception, hooks: tuple[str, ...]) -> str:
    """pluggy's text for a bad hook implementation (a ``PluginValidationError``), on one line; an unknown hook name
    with the valid ones (``hooks``) and the closest."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    m = re.match(r"unknown hook '([^']+)'", text)
    if m:
        close = close_matches(m.group(1), hooks)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown hook {m.group(1)!r} (omni_accum's hooks: {', '.join(hooks)}){hint}"
    return text
