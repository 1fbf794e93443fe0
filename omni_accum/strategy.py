"""What a strategy is: the record a plugin registers and the per-key state objects it creates.

A strategy decides how one key of one request is carried from the sender to the consumer:

* on the sender, an optional :class:`Encoder` may change what goes on the wire (``send_once``
  omits an unchanged value; a delta strategy sends a suffix);
* on the receiver, an :class:`Accumulator` merges each wire value and serves the consumer's view.

Semantics every strategy must meet are listed in docs/plugins.md ("The contract") and are checked by
:mod:`omni_accum.testing`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from omni_accum.errors import MergeError, PluginError, describe_plugin

#: Kinds of keys. ``append``: every chunk adds rows / items (the view is the concatenation);
#: ``replace``: the latest value wins; ``static``: replace-kind whose value rarely or never changes.
KINDS: tuple[str, ...] = ("append", "replace", "static")


class _Omit:
    """Sentinel an :class:`Encoder` returns to leave a key off the wire."""

    _instance: ClassVar[_Omit | None] = None

    def __new__(cls) -> _Omit:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "OMIT"


OMIT: Any = _Omit()


class NoParams(BaseModel):
    """Params model of a strategy that takes none."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class KeyInfo:
    """What a strategy is told about the key it is created for.

    Attributes:
        path: the key path, ``"embed.decode"`` or a flat name.
        request_id: the request the state belongs to.
        length_hint: expected final number of rows of an append key, when known (``None`` otherwise).
    """

    path: str
    request_id: str = ""
    length_hint: int | None = None


class Accumulator(ABC):
    """Receiver-side state of one key of one request.

    ``merge`` is called once per chunk that carries the key; ``read`` returns the consumer's view. ``merge`` must
    either succeed completely or raise without changing the state."""

    __slots__ = ()

    def check(self, value: Any) -> None:  # noqa: B027 - optional hook
        """Raise :class:`MergeError` if ``value`` cannot be merged. Must not change state."""

    @abstractmethod
    def merge(self, value: Any) -> None:
        """Merge one wire value into the state."""

    def merge_checked(self, value: Any) -> None:
        """Merge a value that :meth:`check` has just accepted (the engine checks every key of a chunk
        before merging any). Override to skip checks :meth:`merge` would repeat; default: :meth:`merge`."""
        self.merge(value)

    @abstractmethod
    def read(self) -> Any:
        """Return the consumer's view of the key (same dtype, trailing shape and device as the chunks)."""

    def nbytes(self) -> int:
        """Bytes this state holds (tensor storage; lists counted at 8 bytes per item)."""
        return value_nbytes(self.read())

    def projected_nbytes(self, value: Any) -> int:
        """Bytes this state would hold after merging ``value`` (and a read), without changing anything.

        Called before :meth:`merge` when the policy sets ``max_bytes_per_request``, so the guard refuses a chunk
        *before* the strategy allocates. Override it when a merge allocates more than the value (a growable
        buffer, a cached concatenation); the default (held + value) over-estimates a replace.
        """
        return self.nbytes() + value_nbytes(value)

    def parts(self) -> list[Any]:
        """The stored representation, as a list of parts (one part unless the strategy keeps chunks)."""
        return [self.read()]


class Encoder(ABC):
    """Sender-side state of one key of one request."""

    __slots__ = ()

    @abstractmethod
    def encode(self, value: Any) -> Any:
        """Return what goes on the wire for ``value``, or :data:`OMIT` to leave the key off."""


class Strategy:
    """A strategy bound to validated params; a factory of per-key state.

    Subclasses set ``name`` and ``Params`` and override :meth:`new_accumulator` (and
    :meth:`new_encoder` when they change the wire).

    Attributes:
        omits_unchanged: True when the encoder may leave a key off the wire and the receiver must
            keep serving its cached value (the engine then checks that the receiver does hold one).
    """

    name: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]] = NoParams
    omits_unchanged: ClassVar[bool] = False

    def __init__(self, params: BaseModel | None = None) -> None:
        self.params = params if params is not None else self.Params()

    def new_encoder(self, key: KeyInfo) -> Encoder | None:
        """Create the sender-side state of ``key``; ``None`` means values go on the wire as they are."""
        return None

    def new_accumulator(self, key: KeyInfo) -> Accumulator:
        """Create the receiver-side state of ``key``."""
        raise NotImplementedError(f"strategy {self.name!r} does not implement new_accumulator")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params!r})"


@dataclass(frozen=True)
class StrategySpec:
    """The record a plugin returns from ``omni_accum_register_strategies``.

    Attributes:
        name: unique strategy name used in policies (``"prealloc"``).
        factory: called with a validated ``params`` instance, returns a :class:`Strategy`.
        params_model: pydantic model of the params (``extra="forbid"``).
        kinds: key kinds the strategy applies to (subset of ``append``, ``replace``, ``static``).
        description: one line shown by ``omni-accum strategies``.
        params_grid: small set of params the tuner tries (each a mapping); empty means defaults only.
        plugin: set by the manager: the plugin that registered the record.
        distribution: set by the manager: ``(name, version)`` of the distribution shipping the plugin.
    """

    name: str
    factory: Callable[[BaseModel], Strategy]
    params_model: type[BaseModel] = NoParams
    kinds: frozenset[str] = frozenset(KINDS)
    description: str = ""
    params_grid: tuple[dict[str, Any], ...] = ()
    plugin: str = field(default="", compare=False)
    distribution: tuple[str, str] | None = field(default=None, compare=False)

    def build(self, params: dict[str, Any] | BaseModel | None = None) -> Strategy:
        """Validate ``params`` with :attr:`params_model` and create the strategy (PluginError: not a Strategy)."""
        if not isinstance(params, BaseModel):
            params = self.params_model.model_validate(params or {})
        return checked_strategy(self, self.factory(params))

    def allowed_params(self) -> str:
        """``initial_capacity (default 64), growth_factor (default 2.0)``: the params this strategy takes."""
        fields = self.params_model.model_fields.items()
        shown = [f"{f} (required)" if fi.is_required() else f"{f} (default {fi.default!r})" for f, fi in fields]
        return ", ".join(shown) or "none"


def checked_strategy(spec: StrategySpec, built: Any, where: str | None = None) -> Strategy:
    """``built`` if a :class:`Strategy`, else PluginError (the engine would fail later naming no plugin)."""
    if isinstance(built, Strategy):
        return built
    raise PluginError(f"{describe_strategy(spec, where)}: its factory returned {type(built).__module__}."
                      f"{type(built).__qualname__} {built!r:.60}, not an omni_accum.Strategy; return an instance of a "
                      "Strategy subclass (class MyStrategy(omni_accum.Strategy))")  # fmt: skip


def describe_strategy(spec: StrategySpec, where: str | None = None) -> str:
    """``key 'x' (rules[0]): strategy 'prealloc' (plugin 'prealloc' (distribution ...))``: how errors name one."""
    return f"{where + ': ' if where else ''}strategy {spec.name!r} ({describe_plugin(spec.plugin, spec.distribution)})"


def validation_summary(err: Any) -> str:
    """A pydantic ``ValidationError`` on one line: ``field: problem; field: problem`` (an unknown field is
    ``unknown param``), without pydantic's header and documentation links."""
    try:
        errors = err.errors()
    except AttributeError:
        return str(err).splitlines()[0] if str(err).strip() else type(err).__name__
    parts = []
    for e in errors:
        loc = ".".join(str(p) for p in e.get("loc", ())) or "value"
        msg = str(e.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{loc}: {'unknown param' if e.get('type') == 'extra_forbidden' else msg}")
    return "; ".join(parts) or type(err).__name__


# ---------------------------------------------------------------------------------------------- #
# Helpers shared by the built-in strategies (and usable by plugins).
# ---------------------------------------------------------------------------------------------- #


#: Attribute of a tensor an arena receiver hands out as the new rows of an append chain (see
#: :mod:`omni_accum.arena`): ``(chain number, first row, the chain's rows so far as one view)``. An
#: append-kind accumulator whose rows are that chain's up to that first row may take the view as its
#: buffer, with no copy (``prealloc`` does).
ARENA_TAG = "_omni_accum_arena"


def value_nbytes(value: Any) -> int:
    """Approximate bytes held by a payload value: tensor storage, 8 bytes per list item, string and
    bytes length, a dict's values; 0 otherwise.

    A list is walked item by item only when its first item is a tensor (a list of chunks); a list
    of ids counts 8 bytes per item in O(1), so memory accounting never costs O(context) per step.
    """
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], torch.Tensor):
            return sum(value_nbytes(v) if isinstance(v, torch.Tensor) else 8 for v in value)
        return 8 * len(value)
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    if isinstance(value, Mapping):
        return sum(8 + value_nbytes(v) for v in value.values())
    return 0


def describe(value: Any) -> str:
    """Short description of a value for error messages."""
    if isinstance(value, torch.Tensor):
        shape = "nested" if value.is_nested else list(value.shape)  # a nested tensor's .shape raises
        layout = "" if value.layout is torch.strided else f", layout={value.layout}"
        return f"tensor(shape={shape}, dtype={value.dtype}, device={value.device}{layout})"
    if isinstance(value, list):
        return f"list(len={len(value)})"
    return type(value).__name__


def not_dense(value: torch.Tensor) -> str | None:
    """Why the append strategies cannot hold tensor ``value`` (sparse, mkldnn, nested), or None for a dense one."""
    if not value.is_nested and value.layout is torch.strided:
        return None
    return (f"cannot append {describe(value)}: the append strategies hold dense (torch.strided) tensors; send a dense "
            "tensor (value.to_dense()), or give this key a replace-kind strategy (replace, send_once)")  # fmt: skip


def check_appendable(current: torch.Tensor, value: torch.Tensor) -> None:
    """Raise :class:`MergeError` unless ``value`` can be appended to ``current`` along dim 0.

    Unlike ``torch.cat`` this never promotes dtypes silently: the view's dtype, trailing shape and device must stay
    what the first chunk had; both must be dense (:func:`not_dense`)."""
    if problem := not_dense(value) or not_dense(current):
        raise MergeError(problem)
    if current.dim() == 0 or value.dim() == 0:
        raise MergeError(
            f"cannot append a 0-d tensor (expected a tensor with a row dimension, have {describe(current)}, "
            f"received {describe(value)}); give this key a replace-kind strategy (replace, send_once)"
        )
    if value.dtype != current.dtype:
        raise MergeError(f"dtype changed mid-stream: expected {current.dtype}, received {value.dtype}")
    if value.shape[1:] != current.shape[1:]:
        legacy = _legacy_empty_note(current, value)
        raise MergeError(
            f"trailing shape changed mid-stream: expected [{', '.join(['*', *map(str, current.shape[1:])])}], "
            f"received {list(value.shape)}{legacy}"
        )
    if value.device != current.device:
        raise MergeError(f"device changed mid-stream: expected {current.device}, received {value.device}")


def _legacy_empty_note(current: torch.Tensor, value: torch.Tensor) -> str:
    """Why a legacy empty 1-D tensor (``torch.empty(0)``) beside rows is refused, or ''."""
    rows = f"[0, {', '.join(map(str, (value if current.shape == (0,) else current).shape[1:]))}]"
    if value.shape == (0,):
        return f": a legacy empty 1-D tensor after rows (torch.cat skips it; send shape {rows}, or leave the key off)"
    if current.shape == (0,):
        return f": rows after a legacy empty 1-D tensor (torch.cat skips it; start the key with shape {rows} or rows)"
    return ""


class AppendAccumulator(Accumulator):
    """Base of append-kind accumulators, with vllm-omni 0.30.0's value dispatch built in.

    * tensor after tensor: appended along dim 0 (:meth:`append_tensor`), after :func:`check_appendable`;
    * list after list: extended (:meth:`append_list`);
    * anything else (first value, a value of another type, scalars, ``None``): replaces the state, as upstream's;
    * a tensor that is not dense (sparse, mkldnn, nested): refused (:func:`not_dense`).

    Subclasses implement :meth:`start_tensor`, :meth:`append_tensor`, :meth:`read_tensor`, :meth:`current_tensor_meta`;
    they override :meth:`tensor_nbytes` (and :meth:`projected_tensor_nbytes`) when they hold more than the view."""

    __slots__ = ("key", "_mode", "_value", "_items", "_list_view", "_like")

    def __init__(self, key: KeyInfo) -> None:
        self.key = key
        self._mode = 0  # 0 empty / other value, 1 tensor, 2 list
        self._value: Any = None
        self._items: list[Any] | None = None
        self._list_view: list[Any] | None = None
        # (dtype, trailing shape, device) of the tensor state: a value matching it passes the append check
        # without check_appendable (None: always call it, e.g. after a 0-d first tensor).
        self._like: tuple[torch.dtype, torch.Size, torch.device] | None = None

    # -- tensor part, for subclasses -------------------------------------------------------- #
    @abstractmethod
    def start_tensor(self, value: torch.Tensor) -> None:
        """Start the state with a first tensor."""

    @abstractmethod
    def append_tensor(self, value: torch.Tensor) -> None:
        """Append a checked tensor along dim 0."""

    @abstractmethod
    def read_tensor(self) -> torch.Tensor:
        """Return the accumulated tensor."""

    @abstractmethod
    def current_tensor_meta(self) -> torch.Tensor:
        """Return any tensor with the accumulated dtype, trailing shape and device (for checks)."""

    def tensor_nbytes(self) -> int:
        """Bytes the tensor state holds. The default measures the view (:meth:`read_tensor`, which may build it):
        override it when the state keeps more (chunks and a cached view, spare capacity) or a view costs a cat."""
        return value_nbytes(self.read_tensor())

    def projected_tensor_nbytes(self, value: torch.Tensor) -> int:
        """Bytes the tensor state would hold after appending the checked tensor ``value``."""
        return self.tensor_nbytes() + value_nbytes(value)

    # -- list part: a growing list, snapshot on read, cached until the next append ------------ #
    def start_list(self, value: list[Any]) -> None:
        # Held as it is until the next list arrives (its view is the sender's list), as upstream's ``+`` does.
        self._items = self._list_view = value

    def append_list(self, value: list[Any]) -> None:
        items = self._items
        assert items is not None
        if items is self._list_view:  # the first list, still the sender's: its items as they are now
            items = self._items = list(items)
        items.extend(value)
        self._list_view = None

    def read_list(self) -> list[Any]:
        if self._list_view is None:
            self._list_view = list(self._items or ())
        return self._list_view

    def list_nbytes(self) -> int:
        """Bytes the list state holds: its items, and the view copy a read made (8 bytes per item)."""
        view, items = self._list_view, self._items or []
        return value_nbytes(items) + (8 * len(view) if view is not None and view is not items else 0)

    def projected_list_nbytes(self, value: list[Any]) -> int:
        """Bytes the list state would hold after merging the list ``value`` (start or extend) and a read."""
        if self._mode != 2:
            return value_nbytes(value)  # a first list is held as it is: it is its own view
        items = self._items or []
        return value_nbytes(items) + value_nbytes(value) + 8 * (len(items) + len(value))

    # -- dispatch --------------------------------------------------------------------------- #
    def check(self, value: Any) -> None:
        if not isinstance(value, torch.Tensor):
            return
        if value.layout is not torch.strided or (self._mode != 1 and value.is_nested):  # sparse, mkldnn, nested
            raise MergeError(not_dense(value) or f"cannot append {describe(value)}")
        if self._mode == 1:
            like = self._like
            try:
                if (
                    like is None
                    or value.dtype != like[0]
                    or value.dim() == 0
                    or value.shape[1:] != like[1]
                    or value.device != like[2]
                ):
                    check_appendable(self.current_tensor_meta(), value)
            except RuntimeError:  # a nested tensor's .shape (is_nested is not read on this path): named here
                check_appendable(self.current_tensor_meta(), value)
                raise

    def merge_checked(self, value: Any) -> None:
        if self._mode == 1 and isinstance(value, torch.Tensor):
            self.append_tensor(value)  # check() ran just before
        else:
            self.merge(value)

    def merge(self, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if self._mode == 1:
                self.check(value)
                self.append_tensor(value)
                return
            self.start_tensor(value)
            self._mode, self._value, self._items, self._list_view = 1, None, None, None
            m = self.current_tensor_meta()
            self._like = (m.dtype, m.shape[1:], m.device) if m.dim() else None
        elif isinstance(value, list):
            if self._mode == 2:
                self.append_list(value)
                return
            self.clear_tensor()
            self.start_list(value)
            self._mode, self._value = 2, None
        else:
            self.clear_tensor()
            self._mode, self._value, self._items, self._list_view = 0, value, None, None

    def projected_nbytes(self, value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return self.projected_tensor_nbytes(value) if self._mode == 1 else value_nbytes(value)
        if isinstance(value, list):
            return self.projected_list_nbytes(value)
        return value_nbytes(value)

    def clear_tensor(self) -> None:  # noqa: B027 - optional hook
        """Drop tensor state (called when a value of another type replaces it)."""

    def read(self) -> Any:
        if self._mode == 1:
            return self.read_tensor()
        if self._mode == 2:
            return self.read_list()
        return self._value

    def nbytes(self) -> int:
        if self._mode == 1:
            return self.tensor_nbytes()
        if self._mode == 2:
            return self.list_nbytes()
        return value_nbytes(self._value)
