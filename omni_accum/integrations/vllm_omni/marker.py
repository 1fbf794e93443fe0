"""The bit mask that says which values a sender left off an adapter put, and the stage handshake.

Both ends number a request's keys in the order they first appear on the wire, whatever their strategy
(so a receiver running another policy can still tell which keys were left off); bit ``i + 1`` is the
i-th key, bit 0 says the ``meta.override_keys`` list left off still applies (the engine's negative
marker count). A request's first chunk carries the mask as a list with the sender's policy fingerprint,
the tuned bucket it decided for the request and its policy source (:func:`with_hello`); later chunks
carry the bare mask, and only when something was left off. A chunk whose hand-off is timed (:mod:`.handoff`)
carries the sender's clock too: the first chunk's hello list gains ``t_ns, clock_id``; another chunk's marker
is ``[mask, t_ns, clock_id, kind]`` (:func:`with_stamp`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omni_accum.engine import WIRE_MARKER
from omni_accum.errors import AccumulationError

#: Wire key replacing the engine's ``WIRE_MARKER`` on adapter puts: a bit mask of the
#: values left off this chunk, bit i + 1 being the i-th key first sent for the request
#: (both ends number them in wire order), bit 0 set when one of them is ``meta.override_keys``,
#: whose list still applies (the engine's negative count). A receiver that hands
#: deltas over (the AR adapter) restores exactly those keys; one small int costs less than the
#: names, so short statics still save bytes.
OMITTED_KEY = "__omni_accum_once__"
#: Wire keys that are not payload keys.
MARKERS = (WIRE_MARKER, OMITTED_KEY)


class SendTable(dict):
    """A request's numbering on the sending side (``(top, qual) -> bit``, wire order), with the metrics'
    per-request caches (see :meth:`.metrics.Recorder.sent`), released with it: ``kept``, its run of chunks
    leaving the same keys off; ``meters``, each numbered key's metrics slot (by its number; None until counted);
    ``plain``: the request goes out as vllm-omni built it (its receiver had not said hello, :mod:`.peer`);
    ``stamps``: how many of its chunks went out, when their hand-offs are timed (:mod:`.handoff`), else None."""

    __slots__ = ("kept", "meters", "plain", "stamps")

    def __init__(self) -> None:
        super().__init__()
        self.plain = False
        self.stamps: int | None = None  # chunks sent so far when its hand-offs are timed (.handoff), else None
        self.kept: dict[tuple[Any, Any], list[Any]] = {}
        self.meters: list[Any] = []


def count_bits(mask: int) -> int:
    return bin(mask).count("1")


def omitted_mask(table: Mapping[tuple[Any, Any], int], omitted: list[tuple[Any, Any]], override: bool) -> int:
    """The ``OMITTED_KEY`` value: bit ``table[path] + 1`` per key left off, bit 0 for the override marker."""
    return sum(1 << (table[p] + 1) for p in omitted) | bool(override)


def with_hello(mask: int, fingerprint: str, bucket: int, source: str, stamp: tuple[Any, ...] = ()) -> list[Any]:
    """The ``OMITTED_KEY`` value of a request's first chunk: the mask, then the stage handshake — the
    sender's policy fingerprint, the tuned bucket it decided for the request (-1: none) and its policy
    source (shortened) — and, when its hand-off is timed, the sender's ``t_ns, clock_id`` (``stamp``)."""
    return [mask, fingerprint, bucket, source[:24], *stamp[:2]]


def with_stamp(mask: int, stamp: tuple[int, str, str]) -> list[Any]:
    """The ``OMITTED_KEY`` value of a timed chunk that is not an announced first chunk:
    ``[mask, t_ns, clock_id, kind]`` (kind: ``p`` prefill, ``d`` decode, ``f`` full)."""
    return [mask, *stamp]


def hello_of(raw: Any) -> tuple[str, int, str] | None:
    """``(fingerprint, bucket, source)`` of a first chunk's ``OMITTED_KEY`` value (with or without the
    sender's clock); None on later chunks."""
    if (
        isinstance(raw, (list, tuple))
        and len(raw) in (4, 6)
        and isinstance(raw[1], str)
        and type(raw[2]) is int
    ):
        return raw[1], raw[2], str(raw[3])
    return None


def stamp_of(raw: Any) -> tuple[int, str, str | None] | None:
    """``(t_ns, clock_id, kind)`` of a timed chunk's ``OMITTED_KEY`` value (kind None: an announced first
    chunk, whose hello carries no kind); None for a chunk that carries no timestamp."""
    if not isinstance(raw, (list, tuple)):
        return None
    if len(raw) == 6 and isinstance(raw[1], str):
        t, clock, kind = raw[4], raw[5], None
    elif len(raw) == 4 and type(raw[1]) is int:
        t, clock, kind = raw[1], raw[2], raw[3]
    else:
        return None
    if type(t) is int and isinstance(clock, str) and (kind is None or isinstance(kind, str)):
        return t, clock, kind
    return None


def split_mask(raw: Any) -> tuple[int, bool]:
    """``(bits of the keys left off, override marker)`` of an ``OMITTED_KEY`` value (a bare mask, or a
    first chunk's :func:`with_hello` list, a timed chunk's :func:`with_stamp` list); a malformed one is refused."""
    if isinstance(raw, (list, tuple)) and (hello_of(raw) is not None or stamp_of(raw) is not None):
        raw = raw[0]
    if type(raw) is not int or raw < 0:
        raise AccumulationError(
            f"malformed wire marker {OMITTED_KEY!r}: expected a bit mask (an int >= 0), got {raw!r}"
        )
    return raw >> 1, bool(raw & 1)


def _path(top: Any, qual: Any = None) -> str:
    return str(top) if qual is None else f"{top}.{qual}"


def _leaves(payload: Mapping[str, Any]):
    for top, value in payload.items():
        if top in MARKERS:
            continue
        if isinstance(value, dict):
            for qual, qv in value.items():
                yield top, qual, qv
        else:
            yield top, None, value


def number_once(table: dict[tuple[Any, Any], int], payload: Mapping[str, Any]) -> None:
    """Give each key of ``payload`` seen for the first time the next bit, in wire order (every key,
    whatever its strategy: a receiver running another policy numbers them the same way)."""
    for top, qual, _ in _leaves(payload):
        if (top, qual) not in table:
            table[(top, qual)] = len(table)
