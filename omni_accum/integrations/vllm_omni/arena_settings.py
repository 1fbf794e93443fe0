"""The ``extra`` settings of ``OmniAccumArenaConnector`` (:mod:`.arena_connector`): the keys it reads, sizes
(``512MiB``, ``2GiB``), ``arena_warm``, ``arena_view_bytes`` and on/off switches, each bad value refused with
the key, the value and what it takes."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

#: The name :mod:`.arena_plugin` registers the connector under (``name:`` of a deploy YAML's connector).
NAME = "OmniAccumArenaConnector"
ENV_NAME = "OMNI_ACCUM_ARENA_NAME"
DEFAULT_ARENA_BYTES = 1 << 30
DEFAULT_RING_BYTES = 4 << 20
#: Tensors of at least this many bytes are handed to the consumer over the arena's pages (``arena_view_bytes``).
DEFAULT_VIEW_BYTES = 64 << 10

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20}
_UNITS.update({"g": 1 << 30, "gb": 10**9, "gib": 1 << 30})


#: The smallest ``arena_bytes`` / ``ring_bytes`` taken (one page; a smaller region could hold no message).
MIN_BYTES = 4096


#: A size: ASCII digits (``re.ASCII``: a Unicode digit such as Arabic-Indic is no digit here), maybe a fraction, and
#: a unit of :data:`_UNITS`.
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", re.ASCII)


def parse_size(
    value: Any, what: str, *, name: str = NAME, minimum: int = MIN_BYTES, maximum: int | None = None,
    say_range: bool = False,
) -> int:
    """Bytes of ``value`` (an int, or a string like ``512MiB``, ``2GiB``, ``1GB``), from ``minimum`` to ``maximum``
    (None: no upper bound). ``ValueError`` names ``name``, ``extra.<what>`` and the value; a value out of range is
    said as ``under the minimum of M`` / ``over the maximum of M``, or with ``say_range`` as ``it takes from M to
    N bytes`` / ``it takes at least M bytes``. Every connector of omni-accum reads its sizes here."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _SIZE.fullmatch(str(value)) if not isinstance(value, (bool, float)) else None
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{name}: extra.{what} = {value!r} is not a size; use bytes or a number with B, KiB, MiB, GiB, KB, "
                "MB, GB"
            )
        exact = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]
        if exact.denominator != 1:
            raise ValueError(f"{name}: extra.{what} = {value!r} is not a whole number of bytes")
        n = int(exact)
    if minimum <= n and (maximum is None or n <= maximum):
        return n
    if say_range:
        bound = f"from {minimum} to {maximum}" if maximum is not None else f"at least {minimum}"
        raise ValueError(f"{name}: extra.{what} = {value!r} is {n} bytes; it takes {bound} bytes")
    side = f"under the minimum of {minimum}" if n < minimum else f"over the maximum of {maximum}"
    raise ValueError(f"{name}: extra.{what} = {value!r} is {n} bytes, {side}")


#: The ``arena_*`` / ``ring_*`` keys the connector reads from its ``extra``.
KNOWN_KEYS = ("arena_name", "arena_bytes", "ring_bytes", "arena_view_bytes", "arena_warm", "arena_stage_rows")


def parse_switch(value: Any, what: str) -> bool:
    """An on/off extra (``true`` / ``false``, ``on`` / ``off``, ``yes`` / ``no``, 1 / 0)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "on", "yes"):
        return True
    if text in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{NAME}: extra.{what} = {value!r}: use true or false (on / off)")


def parse_warm(value: Any, arena_bytes: int) -> int:
    """``arena_warm``: a size (:func:`parse_size`), ``all`` (``arena_bytes``), or ``0`` / ``off`` (nothing)."""
    if value is None or value == 0 or str(value).strip().lower() in ("0", "off", "false", "none"):
        return 0
    if str(value).strip().lower() == "all":
        return arena_bytes
    try:
        return min(parse_size(value, "arena_warm"), arena_bytes)
    except ValueError as e:
        raise ValueError(f"{e} (or all, off)") from None


def parse_view_bytes(value: Any) -> int | None:
    """``arena_view_bytes``: a size (:func:`parse_size`), or ``off`` (None: every tensor is copied out)."""
    if value is False or (isinstance(value, str) and value.strip().lower() == "off"):
        return None
    return parse_size(value, "arena_view_bytes")


@dataclass(frozen=True)
class ArenaSettings:
    """What ``OmniAccumArenaConnector`` reads from its ``extra`` (:func:`parse_settings`)."""

    arena_name: str
    arena_bytes: int
    ring_bytes: int
    #: None: every received tensor is copied out (``arena_view_bytes: off``).
    view_bytes: int | None
    warm_bytes: int
    stage_rows: bool
    #: Where ``arena_name`` came from: ``extra.arena_name``, ``OMNI_ACCUM_ARENA_NAME`` or ``the default``.
    arena_name_from: str = "extra.arena_name"


def parse_settings(extra: Any) -> ArenaSettings:
    """The connector's settings from a deploy's ``extra`` (``arena_name`` defaults to ``$OMNI_ACCUM_ARENA_NAME``,
    else ``omni``). ``ValueError`` names the key, the value and what it takes; an unknown ``arena_*`` / ``ring_*``
    key is refused with the keys it reads (a typo would otherwise be ignored). ``omni-accum doctor --deploy``
    calls it too, so that a deploy the connector would refuse is not called ready."""
    config = extra if isinstance(extra, dict) else {}
    unknown = sorted(str(k) for k in config if str(k).startswith(("arena_", "ring_")) and k not in KNOWN_KEYS)
    if unknown:
        names = ", ".join(map(repr, unknown))
        raise ValueError(f"{NAME}: unknown extra key(s) {names}; it reads {', '.join(KNOWN_KEYS)}")
    given = config.get("arena_name")
    if given is not None:
        name, source = str(given), "extra.arena_name"
    elif os.environ.get(ENV_NAME):
        name, source = os.environ[ENV_NAME], ENV_NAME
    else:
        name, source = "omni", "the default"
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,120}", name, re.ASCII):
        said = f"extra.arena_name = {name!r}" if source != ENV_NAME else f"{ENV_NAME}={name!r} (no extra.arena_name)"
        raise ValueError(f"{NAME}: {said}: use letters, digits, '_', '.', '-' (at most 120)")
    arena_bytes = parse_size(config.get("arena_bytes", DEFAULT_ARENA_BYTES), "arena_bytes")
    return ArenaSettings(
        arena_name=name,
        arena_bytes=arena_bytes,
        ring_bytes=parse_size(config.get("ring_bytes", DEFAULT_RING_BYTES), "ring_bytes"),
        view_bytes=parse_view_bytes(config.get("arena_view_bytes", DEFAULT_VIEW_BYTES)),
        warm_bytes=parse_warm(config.get("arena_warm", 0), arena_bytes),
        stage_rows=parse_switch(config.get("arena_stage_rows", True), "arena_stage_rows"),
        arena_name_from=source,
    )
