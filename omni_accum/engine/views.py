"""The consumer's view of a request: read-only mappings whose leaves are read from the strategies lazily."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from omni_accum.engine.endpoint import _Slot


class GroupView(Mapping):
    """Read-only view of one payload group (``view["embed"]``)."""

    __slots__ = ("_slots",)

    def __init__(self, slots: dict[Any, _Slot]) -> None:
        self._slots = slots

    def __getitem__(self, qual: Any) -> Any:
        return self._slots[qual].acc.read()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._slots)

    def __contains__(self, qual: object) -> bool:  # no read (Mapping's default would materialise the value)
        return qual in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def to_dict(self) -> dict[Any, Any]:
        return {q: s.acc.read() for q, s in self._slots.items()}

    def __repr__(self) -> str:
        return f"GroupView({list(self._slots)})"


class RequestView(Mapping):
    """The consumer's view of one request: a read-only mapping with the payload's nesting.

    Live: one object per request (``merge`` returns it for every chunk), whose values are read from the
    strategies when accessed, so it shows later chunks too; a tensor read from it keeps the rows it had.
    Tensors are borrowed: do not write into them. A write lands in the strategy's state (and, in process,
    in the sender's tensor): under ``cat``, ``prealloc`` and the ``default`` preset every later view holds
    the written rows; under ``token_list`` too after the first chunk, but after a later one only until the
    next chunk (it lands in a cached concatenation); under ``replace`` until the key comes again; under
    ``send_once`` over a copying wire until the sender's value changes (unchanged values stay off the wire),
    in process until the next chunk (the sender sees its object changed). :meth:`copy`
    (``Receiver.view(req_id, copy=True)``) gives a snapshot, with tensors of the consumer's own.
    """

    __slots__ = ("_entries",)

    def __init__(self, entries: dict[Any, Any]) -> None:
        self._entries = entries

    def __getitem__(self, top: Any) -> Any:
        e = self._entries[top]
        return e.acc.read() if type(e) is _Slot else GroupView(e)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._entries)

    def __contains__(self, top: object) -> bool:  # no read (Mapping's default would materialise the value)
        return top in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def to_dict(self) -> dict[Any, Any]:
        """Materialise the whole view as plain nested dicts."""
        return {
            k: (e.acc.read() if type(e) is _Slot else {q: s.acc.read() for q, s in e.items()})
            for k, e in self._entries.items()
        }

    def copy(self) -> dict[Any, Any]:
        """The whole view as plain nested dicts with every tensor cloned: the consumer may write into it."""
        return _cloned(self.to_dict())

    def __repr__(self) -> str:
        return f"RequestView({list(self._entries)})"


_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), range)


def _cloned(value: Any) -> Any:
    """A copy of ``value`` the consumer may write into: tensors cloned, containers rebuilt, other values deep-copied
    (kept as they are only where they cannot be copied)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cloned(v) for v in value]
    if type(value) is tuple:
        return tuple(_cloned(v) for v in value)
    if isinstance(value, _IMMUTABLE) or isinstance(value, type):
        return value
    try:  # a numpy array, a named tuple, a set, an object: read() may return other values as they are
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an object that cannot be copied is handed back as it is
        return value


def request_view(st: Any) -> RequestView:
    """The one :class:`RequestView` of a receiver-side request state (made on first use; it reads entries live)."""
    view = st.view
    if view is None:
        view = st.view = RequestView(st.entries)
    return view
