"""The ``extra`` settings of ``OmniAccumArenaConnector`` (:mod:`.arena_connector`): the keys it reads, sizes
(``512MiB``, ``2GiB``), ``arena_warm``, ``arena_view_bytes`` and on/off switches, each bad value refused with
the key, the value and what it takes."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from omni_accum import samehost
from omni_accum.errors import close_matches, key_form, setting_given

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


#: The back ring a region reserves beside ``ring_bytes`` (:meth:`omni_accum.arena.region.Region.create`'s default).
RESERVED_BACK_BYTES = 256 << 10
#: The ``arena_*`` / ``ring_*`` keys the connector reads from its ``extra``.
KNOWN_KEYS = ("arena_name", "arena_bytes", "ring_bytes", "arena_view_bytes", "arena_warm", "arena_stage_rows")
#: The key prefixes of each of omni-accum's connectors (:func:`check_keys`): a key of one given to another is refused.
KEY_PREFIXES = {NAME: ("arena_", "ring_"), "OmniAccumMooncakeConnector": ("mooncake_",)}
#: Un-prefixed forms of a known key too plain to be taken as meant for it (``bytes``: vllm-omni's keys may end so).
_PLAIN = frozenset({"name", "bytes"})
#: How close (``difflib`` ratio) a key must be to a known key (or its un-prefixed form) to be refused as its typo.
CLOSE = 0.85


def check_keys(extra: Mapping[Any, Any], name: str, known: Iterable[str]) -> None:
    """Refuse the keys of ``extra`` that connector ``name`` (one of :data:`KEY_PREFIXES`) does not read but that look
    meant for it or for another omni-accum connector: written otherwise (lowercased, ``-`` as ``_``), one has a
    connector's prefix or is one of ``known``, or it is close to one of ``known`` (:data:`CLOSE`), or to one without
    its prefix (``view_bytes``, ``warm``). Every other key is left alone (vllm-omni's own keys share the ``extra``).
    One ``ValueError`` names each such key, what it looks like, and the keys ``name`` reads. The settings of both
    connectors (arena and Mooncake) call it, so a typo is never silently ignored."""
    known = tuple(known)
    own = KEY_PREFIXES[name]
    targets = {k: k for k in known}  # what a key may be meant as -> the key it is meant as
    for k in known:
        bare = next((k[len(p):] for p in own if k.startswith(p)), "")
        if bare and bare not in _PLAIN:
            targets.setdefault(bare, k)
    bad: list[tuple[str, str]] = []
    for key in sorted((k for k in extra if k not in known), key=str):
        norm = key_form(key)
        other = next((n for n, ps in KEY_PREFIXES.items() if n != name and norm.startswith(ps)), None)
        near = close_matches(norm, targets, cutoff=CLOSE)
        if other is not None:
            bad.append((str(key), f"a key of {other}, not of this connector"))
        elif norm in targets or near:
            bad.append((str(key), f"did you mean {targets[norm if norm in targets else near[0]]!r}?"))
        elif norm.startswith(own):
            bad.append((str(key), "none of them"))
    if bad:
        keys = ", ".join(repr(k) for k, _ in bad)
        notes = "; ".join(f"{k!r}: {why}" for k, why in bad)
        raise ValueError(f"{name}: unknown extra key(s) {keys}; it reads {', '.join(known)} ({notes})")


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


def parse_warm(value: Any, arena_bytes: int, arena_given: Any = None) -> int:
    """``arena_warm``: a size (:func:`parse_size`) of at most ``arena_bytes``, ``all`` (``arena_bytes``), or ``0`` /
    ``off`` (nothing). ``arena_given``: the ``extra.arena_bytes`` given (None: the default), for the message."""
    if value is None or value == 0 or str(value).strip().lower() in ("0", "off", "false", "none"):
        return 0
    if str(value).strip().lower() == "all":
        return arena_bytes
    try:
        n = parse_size(value, "arena_warm")
    except ValueError as e:
        raise ValueError(f"{e} (or all, off)") from None
    if n > arena_bytes:
        region = f"extra.arena_bytes = {arena_given!r}" if arena_given is not None else "the default arena_bytes"
        raise ValueError(f"{NAME}: extra.arena_warm = {value!r} is {n} bytes, more than the region's data pages "
                         f"({region}: {arena_bytes} bytes); give at most arena_bytes, or all, or off")
    return n


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
    else ``omni``, also when it is empty or blank; a given one must be such a name). ``ValueError`` names the key,
    the value and what it takes; a key that looks meant for this connector or is another omni-accum connector's is
    refused (:func:`check_keys`), as is a size larger than the file system its regions go in (:func:`check_fits`).
    ``omni-accum doctor --deploy`` calls it too, so that a deploy the connector would refuse is not called ready."""
    config = extra if isinstance(extra, dict) else {}
    check_keys(config, NAME, KNOWN_KEYS)
    given = setting_given(config, "arena_name")  # empty or blank: the key left out (docs/arena.md)
    if given is not None:
        name, source = (str(given) if type(given) is int else given), "extra.arena_name"
    elif os.environ.get(ENV_NAME):
        name, source = os.environ[ENV_NAME], ENV_NAME
    else:
        name, source = "omni", "the default"
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,120}", name, re.ASCII):
        said = f"extra.arena_name = {name!r}" if source != ENV_NAME else f"{ENV_NAME}={name!r} (no extra.arena_name)"
        text = "" if isinstance(name, str) else " (a text: quote it in the YAML)"
        out = f"; leave the key out for ${ENV_NAME}, else 'omni'" if source != ENV_NAME else ""
        raise ValueError(f"{NAME}: {said}: use letters, digits, '_', '.', '-' (1 to 120){text}{out}")
    arena_bytes = parse_size(config.get("arena_bytes", DEFAULT_ARENA_BYTES), "arena_bytes")
    ring_bytes = parse_size(config.get("ring_bytes", DEFAULT_RING_BYTES), "ring_bytes")
    check_fits(config, arena_bytes, ring_bytes)
    return ArenaSettings(
        arena_name=name,
        arena_bytes=arena_bytes,
        ring_bytes=ring_bytes,
        view_bytes=parse_view_bytes(config.get("arena_view_bytes", DEFAULT_VIEW_BYTES)),
        warm_bytes=parse_warm(config.get("arena_warm", 0), arena_bytes, config.get("arena_bytes")),
        stage_rows=parse_switch(config.get("arena_stage_rows", True), "arena_stage_rows"),
        arena_name_from=source,
    )


def check_fits(config: Mapping[str, Any], arena_bytes: int, ring_bytes: int) -> None:
    """Refuse sizes given in ``config`` whose part a region reserves when it is made (the rings, ``ring_bytes`` and
    a quarter MiB back, and a byte of page map per 4 KiB of ``arena_bytes``) is larger than the whole file system the
    regions go in (``statvfs`` of :func:`omni_accum.samehost.base_dir`: ``/dev/shm`` or ``$OMNI_ACCUM_ARENA_DIR``):
    no region could ever be made, and every get would fall back and try again, never naming the key. The data pages
    are not reserved (the file is sparse: an ``arena_bytes`` larger than the file system works until the pages in
    use fill it, then puts go the inner way), so ``arena_bytes`` itself is not compared. Nothing is checked where
    that directory cannot be read (the first get says why) nor for default sizes."""
    given = [k for k in ("arena_bytes", "ring_bytes") if k in config]
    if not given:
        return
    try:
        st = os.statvfs(samehost.base_dir())
    except OSError:
        return
    total = st.f_blocks * st.f_frsize
    reserved = ring_bytes + RESERVED_BACK_BYTES + arena_bytes // 4096
    if 0 < total < reserved:  # (a file system that says no size: 0)
        size = f"{total / (1 << 30):.3g} GiB" if total >= 1 << 30 else f"{total / (1 << 20):.3g} MiB"
        said = " and ".join(f"extra.{k} = {config[k]!r}" for k in given)
        raise ValueError(
            f"{NAME}: {said}: a region reserves {reserved} bytes when it is made (ring_bytes, the back ring and a byte "
            f"per 4 KiB page of arena_bytes), more than the whole file system of {samehost.base_dir()} "
            f"({samehost.describe_base()}: {total} bytes, {size}); give sizes that fit there"
        )


def room_note(settings: ArenaSettings, pairs: int = 1) -> str | None:
    """What the file system the regions go in cannot give ``pairs`` stage pairs of these settings, or None (``doctor``
    says it as a note: the connector starts, but less goes through the arena than the sizes say): ``arena_warm``
    beyond its free space (the warm stops when it is full, leaving nothing there to any other process), or
    ``arena_bytes`` beyond its whole size (a chunk that does not fit goes the inner way: an 8k-token prompt's chunk 0
    is 66 MB, more than Docker's default 64 MiB ``/dev/shm``)."""
    try:
        st = os.statvfs(samehost.base_dir())
    except OSError:
        return None
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    where = f"{samehost.base_dir()} ({samehost.describe_base()})"
    each = f" x {pairs} stage pairs" if pairs > 1 else ""
    if total and settings.warm_bytes * pairs > free:
        return (f"arena_warm {settings.warm_bytes} bytes{each} is more than the {free} bytes free in {where}: the warm "
                "stops when the file system is full (logged), and leaves nothing there for any other process")
    if total and settings.arena_bytes > total:
        return (f"arena_bytes {settings.arena_bytes} bytes per stage pair, and {where} holds {total} bytes in all: a "
                "chunk that does not fit there goes through the inner connector (an 8k-token prompt's chunk 0: 66 MB)")
    return None


#: vllm-omni's limit on how long a request waits for its next chunk, and its default (seconds).
ENV_INPUT_WAIT = "VLLM_OMNI_INPUT_WAIT_TIMEOUT_S"
INPUT_WAIT_DEFAULT_S = 600.0
#: The orphan time where ``VLLM_OMNI_INPUT_WAIT_TIMEOUT_S=0`` turns vllm-omni's deadline off (seconds).
NO_DEADLINE_ORPHAN_S = 3600.0


def orphan_after_s() -> float:
    """How long a message may wait for its get before it is dropped: twice ``VLLM_OMNI_INPUT_WAIT_TIMEOUT_S`` (a
    request that waited that long for a chunk was failed by vllm-omni), at least a minute. An hour
    (:data:`NO_DEADLINE_ORPHAN_S`) for 0, which turns vllm-omni 0.30.0's deadline off: no request is failed for
    waiting then, but a receiving stage looks for its requests' chunks all the time, so a message no get took in an
    hour belongs to a request that is gone (aborted, failed), and the messages of such requests must be given back
    or they fill the arena (every later put would go the inner way). 20 min (vllm-omni's default, doubled) for a
    value it does not take: one that is no number (it uses its default then), negative or not finite (it refuses to
    start)."""
    try:
        wait = float(os.environ.get(ENV_INPUT_WAIT, INPUT_WAIT_DEFAULT_S))
    except ValueError:
        wait = INPUT_WAIT_DEFAULT_S
    if wait == 0:  # (0.30.0: "set exactly 0 to disable"; -0.0 too)
        return NO_DEADLINE_ORPHAN_S
    if not math.isfinite(wait) or wait < 0:
        wait = INPUT_WAIT_DEFAULT_S
    return max(60.0, 2 * wait)
