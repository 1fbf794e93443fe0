"""The bit mask that says which ``send_once`` values a sender left off an adapter put.

Both ends number a request's send_once keys in wire order; bit ``i + 1`` is the i-th key, bit 0
says the ``meta.override_keys`` list left off still applies (the engine's negative marker count).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omni_accum.engine import WIRE_MARKER
from omni_accum.errors import AccumulationError

#: Wire key replacing the engine's ``WIRE_MARKER`` on adapter puts: a bit mask of the send_once
#: values left off this chunk, bit i + 1 being the i-th send_once key first sent for the request
#: (both ends number them in wire order), bit 0 set when one of them is ``meta.override_keys``,
#: whose list still applies (the engine's negative count). A receiver that hands
#: deltas over (the AR adapter) restores exactly those keys; one small int costs less than the
#: names, so short statics still save bytes.
OMITTED_KEY = "__omni_accum_once__"
#: Wire keys that are not payload keys.
MARKERS = (WIRE_MARKER, OMITTED_KEY)


def count_bits(mask: int) -> int:
    return bin(mask).count("1")


def omitted_mask(table: Mapping[tuple[Any, Any], int], omitted: list[tuple[Any, Any]], override: bool) -> int:
    """The ``OMITTED_KEY`` value: bit ``table[path] + 1`` per key left off, bit 0 for the override marker."""
    return sum(1 << (table[p] + 1) for p in omitted) | bool(override)


def split_mask(raw: Any) -> tuple[int, bool]:
    """``(bits of the keys left off, override marker)`` of an ``OMITTED_KEY`` value; a malformed one is refused."""
    if type(raw) is not int or raw < 0:
        raise AccumulationError(
            f"malformed wire marker {OMITTED_KEY!r}: expected a bit mask (an int >= 0), got {raw!r}"
        )
    return raw >> 1, bool(raw & 1)
