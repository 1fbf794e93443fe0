"""``delta``: send only the new suffix of a cumulative key; the consumer still sees the whole value.

Some upstream keys are *cumulative*: every chunk re-sends the whole value so far, which grows by a
little each step. ``ids.output`` of the 2026-03..05 vllm-omni releases is the example: the list of
output token ids, one longer every decode step, re-sent whole, so the wire grows O(n) per step.

With ``delta`` the sender remembers (a private copy of) what it last sent for the key and puts only
the new suffix on the wire; the receiver appends it; the consumer sees the full cumulative value,
bit for bit the latest value the upstream passed to ``Sender.encode``. It is *replace-kind* from the
consumer's point of view (the view is the latest value), so it declares ``kinds={"replace"}``.

A value that does not extend the previous one (shorter, a rewritten prefix, another dtype or
trailing shape, another type) is sent whole: a reset, never a wrong view. "Extends" is checked
exactly: tensors bit for bit (``-0.0`` is not ``0.0``), lists element for element with one exact
element type (all ``int``, all ``str`` or all ``bytes``; anything else is always sent whole).
In one process (no wire copies anything) the receiver holds a tensor sent whole as it is until rows
follow it: when the sender changed that tensor in place meanwhile, the next value is sent whole too.

Wire form (plain lists, ints, strings and tensors, so vllm-omni's ``OmniSerializer`` carries it):

* a list ``["omni_accum.delta/1", start, payload]``:

  * ``start > 0``: ``payload`` (a list or a tensor) continues the ``start`` items/rows the receiver holds;
  * ``start == 0``: ``payload`` is a whole list (first chunk, or a reset);
  * ``start == -1``: ``payload`` is a tuple, replaced as is (a serializer turns tuples into lists);

* anything else is the whole value, as is: a tensor with rows (first chunk, or a reset), or any
  other value (``None``, a 0-d tensor such as ``meta.finished``, a string), replaced. So a key
  that never grows costs nothing extra on the wire.

The receiver checks that it holds exactly ``start`` items of the same type, dtype and trailing shape,
and raises (the engine then fails that request only) when it does not, e.g. after losing state.

Costs: wire bytes per step O(suffix) (flat as the output grows); sender CPU O(n) per step to
verify the prefix (a C-speed compare); receiver O(suffix) per step (amortised growable buffer) and
a list copy when a list view is read after an append.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

import omni_accum
from omni_accum.errors import MergeError
from omni_accum.strategy import Accumulator, Encoder, KeyInfo, Strategy, StrategySpec, describe

__all__ = ["WIRE_TAG", "Delta", "DeltaAccumulator", "DeltaEncoder", "Params", "omni_accum_register_strategies"]

WIRE_TAG = "omni_accum.delta/1"
"""First element of every wire value of a ``delta`` key (versioned, so a format change is detected)."""
OPAQUE = -1
"""``start`` of a wire value that is not a sequence and is replaced as is."""

_EXACT_ELEMENT_TYPES = (int, str, bytes)
_EMPTY = object()
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Params(BaseModel):
    """``delta`` takes no params: the prefix check is always exact, so there is nothing to trade."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------------------------------------- #
# helpers
# ---------------------------------------------------------------------------------------------- #


def _element_type(items: list[Any]) -> Any:
    """The one exact element type of ``items`` (``int``, ``str``, ``bytes``), ``_EMPTY``, or None."""
    if not items:
        return _EMPTY
    types = set(map(type, items))
    if len(types) != 1:
        return None
    t = types.pop()
    return t if t in _EXACT_ELEMENT_TYPES else None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` (same dtype and shape) hold the same bits (``-0.0 != 0.0``, NaN == same NaN)."""
    try:
        if a.is_floating_point() or a.is_complex():
            int_dtype = _INT_OF_SIZE.get(a.element_size())
            if int_dtype is None:
                return False
            a, b = a.view(int_dtype), b.view(int_dtype)
        return bool(torch.equal(a, b))
    except (RuntimeError, TypeError):  # exotic layouts: treat as changed, the value is then sent whole
        return False


def _is_sequence_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


class _RowBuffer:
    """A growable contiguous buffer of rows (amortised O(1) append, zero-copy prefix view)."""

    __slots__ = ("first", "buf", "rows")

    def __init__(self, first: torch.Tensor) -> None:
        self.first: torch.Tensor | None = first  # held by reference until the first append
        self.buf: torch.Tensor | None = None
        self.rows = int(first.shape[0])

    def like(self) -> torch.Tensor:
        return self.first if self.buf is None else self.buf  # type: ignore[return-value]

    def view(self) -> torch.Tensor:
        return self.first if self.buf is None else self.buf[: self.rows]  # type: ignore[return-value,index]

    def append(self, rows: torch.Tensor) -> None:
        k = int(rows.shape[0])
        if k == 0:
            return
        need = self.rows + k
        if self.buf is None or need > self.buf.shape[0]:
            src = self.view()
            cap = max(16, math.ceil(need * 1.5))
            new = torch.empty((cap, *src.shape[1:]), dtype=src.dtype, device=src.device)
            new[: self.rows].copy_(src)
            self.buf, self.first = new, None
        self.buf[self.rows : need].copy_(rows)  # type: ignore[index]
        self.rows = need

    def nbytes(self) -> int:
        t = self.like()
        return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------- #
# sender
# ---------------------------------------------------------------------------------------------- #


class DeltaEncoder(Encoder):
    """Sender side of one key of one request: a private copy of what was last sent."""

    __slots__ = ("_mode", "_items", "_etype", "_rows", "_whole")

    def __init__(self) -> None:
        self._mode = 0  # 0 nothing deltable held, 1 tensor rows, 2 list items
        self._items: list[Any] = []
        self._etype: Any = None
        self._rows: _RowBuffer | None = None
        self._whole: weakref.ref[torch.Tensor] | None = None  # the tensor last sent whole, until rows follow it

    def encode(self, value: Any) -> list[Any]:
        if _is_sequence_tensor(value):
            return self._encode_tensor(value.detach() if value.requires_grad else value)
        if type(value) is list:
            return self._encode_list(value)
        self._mode, self._items, self._rows = 0, [], None
        return [WIRE_TAG, OPAQUE, value] if isinstance(value, (list, tuple)) else value

    def _encode_list(self, value: list[Any]) -> list[Any]:
        etype = _element_type(value)
        n = len(self._items)
        if (
            self._mode == 2
            and etype is not None
            and len(value) >= n
            and (etype is self._etype or self._etype is _EMPTY)
            and value[:n] == self._items
        ):
            suffix = value[n:]
            self._items.extend(suffix)
            if suffix:
                self._etype = etype
            return [WIRE_TAG, n, suffix]
        if etype is None:  # no exact element type: always sent whole
            self._mode, self._items = 0, []
        else:
            self._mode, self._items, self._etype = 2, list(value), etype
        self._rows = None
        return [WIRE_TAG, 0, value]

    def _encode_tensor(self, value: torch.Tensor) -> list[Any]:
        held = self._rows
        if self._mode == 1 and held is not None:
            like, n = held.like(), held.rows
            if (
                value.dtype == like.dtype
                and value.shape[1:] == like.shape[1:]
                and value.device == like.device
                and value.shape[0] >= n
                and _same_bits(value[:n], held.view())
                and self._whole_intact(held)
            ):
                suffix = value[n:]
                held.append(suffix)
                if n == 0:  # rows from row 0: the receiver holds them as a whole value, as they are
                    self._whole = weakref.ref(suffix)
                elif suffix.shape[0]:
                    self._whole = None  # the receiver copies the rows it held when it appends these
                return [WIRE_TAG, n, suffix]
        self._mode, self._items = 1, []
        self._rows = _RowBuffer(value.clone())  # private copy: the upstream may write into its tensor
        self._whole = weakref.ref(value)
        return value

    def _whole_intact(self, held: _RowBuffer) -> bool:
        """Whether the tensor last sent whole still holds what was sent. A receiver in the same process holds
        that very tensor until the next rows arrive (no wire copies it), so a sender that changed it since
        must send the value whole again, or the receiver would append to the changed rows."""
        sent = self._whole() if self._whole is not None else None
        return sent is None or (sent.shape == held.view().shape and _same_bits(sent, held.view()))


# ---------------------------------------------------------------------------------------------- #
# receiver
# ---------------------------------------------------------------------------------------------- #


def parse_wire(wire: Any) -> tuple[int, Any]:
    """Return ``(start, payload)`` of a ``delta`` wire value; :class:`MergeError` when it is not one."""
    if not isinstance(wire, (list, tuple)):
        return (0, wire) if _is_sequence_tensor(wire) else (OPAQUE, wire)
    if len(wire) != 3 or wire[0] != WIRE_TAG:
        raise MergeError(
            f"not a 'delta' wire value (expected [{WIRE_TAG!r}, start, payload], got {describe(wire)}); "
            "sender and receiver must use the same policy"
        )
    start = wire[1]
    if type(start) is not int or start < OPAQUE:
        raise MergeError(f"malformed 'delta' wire value: start must be an int >= -1, got {start!r}")
    return start, wire[2]


class DeltaAccumulator(Accumulator):
    """Receiver side of one key of one request: the cumulative value, rebuilt from suffixes."""

    __slots__ = ("_mode", "_value", "_rows", "_items", "_list_view")

    def __init__(self) -> None:
        self._mode = 0  # 0 opaque value, 1 tensor rows, 2 list items
        self._value: Any = None
        self._rows: _RowBuffer | None = None
        self._items: list[Any] = []
        self._list_view: list[Any] | None = None

    def _held(self) -> str:
        if self._mode == 1 and self._rows is not None:
            return f"{self._rows.rows} rows of {describe(self._rows.like())}"
        if self._mode == 2:
            return f"a list of {len(self._items)} items"
        return "no sequence"

    def check(self, value: Any) -> None:
        start, payload = parse_wire(value)
        if start == OPAQUE:
            return
        if start == 0:
            if not (_is_sequence_tensor(payload) or isinstance(payload, list)):
                raise MergeError(
                    f"malformed 'delta' wire value: a whole value must be a list or tensor, got {describe(payload)}"
                )
            return
        lost = "; the receiver lost state (restarted, or released mid-stream): release the request and re-send it"
        if isinstance(payload, list):
            if self._mode != 2 or len(self._items) != start:
                raise MergeError(
                    f"the sender sent list items from index {start}, but this receiver holds {self._held()}{lost}"
                )
            return
        if not _is_sequence_tensor(payload):
            raise MergeError(
                f"malformed 'delta' wire value: a suffix must be a list or tensor, got {describe(payload)}"
            )
        held = self._rows
        if self._mode != 1 or held is None or held.rows != start:
            raise MergeError(
                f"the sender sent tensor rows from row {start}, but this receiver holds {self._held()}{lost}"
            )
        like = held.like()
        if payload.dtype != like.dtype or payload.shape[1:] != like.shape[1:] or payload.device != like.device:
            raise MergeError(f"suffix {describe(payload)} does not continue {describe(like)}")

    def merge(self, value: Any) -> None:
        self.check(value)
        start, payload = parse_wire(value)
        if start == OPAQUE:
            self._mode, self._value, self._rows, self._items, self._list_view = 0, payload, None, [], None
        elif start == 0 and isinstance(payload, list):
            self._mode, self._value, self._rows = 2, None, None
            self._items, self._list_view = list(payload), None
        elif start == 0:
            self._mode, self._value, self._items, self._list_view = 1, None, [], None
            self._rows = _RowBuffer(payload)
        elif isinstance(payload, list):
            if payload:
                self._items.extend(payload)
                self._list_view = None
        else:
            self._rows.append(payload)  # type: ignore[union-attr]

    def read(self) -> Any:
        if self._mode == 1:
            return self._rows.view()  # type: ignore[union-attr]
        if self._mode == 2:
            if self._list_view is None:
                self._list_view = list(self._items)  # the consumer's copy, cached until the next append
            return self._list_view
        return self._value

    def nbytes(self) -> int:
        if self._mode == 1:
            return self._rows.nbytes()  # type: ignore[union-attr]
        if self._mode == 2:
            return 8 * (len(self._items) + (len(self._list_view) if self._list_view is not None else 0))
        return 0


# ---------------------------------------------------------------------------------------------- #
# strategy and registration
# ---------------------------------------------------------------------------------------------- #


class Delta(Strategy):
    """Cumulative keys: the sender sends the new suffix, the receiver appends, the view is the whole value."""

    name = "delta"
    Params = Params

    def new_encoder(self, key: KeyInfo) -> DeltaEncoder:
        return DeltaEncoder()

    def new_accumulator(self, key: KeyInfo) -> DeltaAccumulator:
        return DeltaAccumulator()


@omni_accum.hookimpl
def omni_accum_register_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="delta",
            factory=Delta,
            params_model=Params,
            kinds=frozenset({"replace"}),
            description="cumulative keys re-sent whole upstream (ids.output): only the new suffix goes on the wire",
        )
    ]
