"""``send_once``: replace, with deduplication on the wire.

The sender leaves the key off the wire while its value equals the value last sent for that
request (compared by content, against a private copy, so in-place changes are seen); the
receiver keeps serving its cached value. A changed value is sent again, so the view is never
stale; so is every value that cannot be copied (``copy.deepcopy`` refuses it), and, in one
process (where the receiver holds the very object sent), a value whose last sent object was
changed in place since. For static keys: ``embed.tts_bos``, ``speaker``, ``language``,
``meta.override_keys``.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from omni_accum.hookspecs import hookimpl
from omni_accum.strategy import OMIT, Encoder, KeyInfo, Strategy, StrategySpec
from omni_accum.strategies.replace import ReplaceAccumulator


class Params(BaseModel):
    """``send_once`` takes no params."""

    model_config = ConfigDict(extra="forbid", frozen=True)


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Immutable types whose == is exact (no -0.0 == 0.0, no NaN): lists of them compare and copy in C.
_EXACT = frozenset({int, str, bytes, bool, type(None)})


def same_value(a: Any, b: Any) -> bool:
    """True only when ``a`` and ``b`` certainly hold the same data (any doubt: False, so it is re-sent)."""
    if a is b:
        return True
    ta = type(a)
    if ta is not type(b):
        return False
    if ta is list or ta is tuple:  # the common case first (ids, names, override lists)
        return _same_items(a, b)
    if isinstance(a, torch.Tensor):
        if a.is_nested or b.is_nested or a.layout is not torch.strided or b.layout is not torch.strided:
            return False  # sparse, mkldnn, nested: torch.equal cannot compare them (re-sent)
        if not (a.dtype == b.dtype and a.shape == b.shape and a.device == b.device):
            return False
        if not torch.equal(a, b):  # NaN is never equal: re-sent rather than guessed unchanged
            return False
        if a.is_floating_point() or a.is_complex():  # and the same bits: -0.0 == 0.0 but is another value
            view = _INT_OF_SIZE.get(a.element_size())
            if view is None:
                return False
            a, b = _resolved(a), _resolved(b)  # a lazy conj/neg bit: view() refuses it, the bits lack it
            return bool(torch.equal(a.view(view), b.view(view)))
        return True
    if isinstance(a, float):  # -0.0 == 0.0, but the consumer must see the value it was sent
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, (list, tuple)):
        return _same_items(a, b)
    if isinstance(a, dict):  # keys in the same order and of the same types (1, 1.0 and True are one key)
        return _same_items(list(a), list(b)) and all(map(same_value, a.values(), b.values()))
    try:
        eq = a == b
    except Exception:  # noqa: BLE001 - incomparable values are treated as changed
        return False
    return eq is True


def _same_items(a: list[Any] | tuple[Any, ...], b: list[Any] | tuple[Any, ...]) -> bool:
    if len(a) != len(b):
        return False
    if _EXACT.issuperset(map(type, a)):
        # ids, names: == is exact for these types; the item types must match too (True == 1).
        return a == b and list(map(type, a)) == list(map(type, b))
    return all(map(same_value, a, b))


def _resolved(t: torch.Tensor) -> torch.Tensor:
    return t.resolve_conj().resolve_neg() if t.is_conj() or t.is_neg() else t


#: What :func:`snapshot` returns for a value it cannot copy: it equals nothing, so the value is always sent.
UNCOPYABLE: Any = object()


def snapshot(value: Any) -> Any:
    """A private copy of ``value`` to compare later chunks against (:data:`UNCOPYABLE` when it has none)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (int, float, str, bytes, bool, type(None))):
        return value
    if type(value) in (list, tuple) and _EXACT.issuperset(map(type, value)):
        return list(value) if type(value) is list else value  # immutable items: a shallow copy is a copy
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - without a copy, an in-place change could not be seen: never omit it
        return UNCOPYABLE


def _nothing() -> None:
    return None


def _handle(value: Any) -> Callable[[], Any]:
    """What :meth:`SendOnceEncoder.encode` keeps of the value it sends: a way back to the object itself
    (a weak reference where it can), or nothing for an immutable value, which no one can change."""
    if isinstance(value, (int, float, str, bytes, bool, type(None))) or (
        type(value) is tuple and _EXACT.issuperset(map(type, value))
    ):
        return _nothing
    try:
        return weakref.ref(value)
    except TypeError:  # a list, a dict: kept (a receiver in the same process keeps it too)
        return lambda: value


class SendOnceEncoder(Encoder):
    """Remembers the last value sent for one key of one request: a private copy, and the object sent."""

    __slots__ = ("_last", "_sent", "_obj")

    def __init__(self) -> None:
        self._last: Any = None
        self._sent = False
        self._obj: Callable[[], Any] = _nothing

    def encode(self, value: Any) -> Any:
        if self._sent and self._last is not UNCOPYABLE and same_value(self._last, value) and self._held(value):
            return OMIT
        self._last = snapshot(value)
        self._obj = _handle(value)
        self._sent = True
        return value

    def _held(self, value: Any) -> bool:
        """Whether the value a receiver holds is still the one sent. In process it is the very object sent
        (no wire copies it), which the sender, or a consumer writing into its view, may have changed since:
        then the key goes on the wire again. Over a real wire the receiver holds a copy; re-sending is harmless."""
        obj = self._obj()
        return obj is None or obj is value or same_value(self._last, obj)


class SendOnce(Strategy):
    name = "send_once"
    Params = Params
    omits_unchanged = True

    def new_encoder(self, key: KeyInfo) -> SendOnceEncoder:
        return SendOnceEncoder()

    def new_accumulator(self, key: KeyInfo) -> ReplaceAccumulator:
        return ReplaceAccumulator()


@hookimpl
def omni_accum_register_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="send_once",
            factory=SendOnce,
            params_model=Params,
            kinds=frozenset({"static", "replace"}),
            description="replace, but an unchanged value is left off the wire and served from the receiver's cache",
        )
    ]
