"""What the sender and the receiver share: per-request state, per-key slots, strategy selection.

See :mod:`omni_accum.engine` for the engine as a whole.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from omni_accum.context import DEFAULT_CONTEXT, KeyMeta, StreamContext
from omni_accum.errors import (
    AccumulationError,
    InvalidArgumentError,
    MergeError,
    OmniAccumError,
    PolicyError,
    UnknownRequestError,
)
from omni_accum.policy.loader import load_policy
from omni_accum.manager import StrategyManager, get_manager
from omni_accum.policy.model import Policy
from omni_accum.strategy import Accumulator, KeyInfo, Strategy, StrategySpec, describe

#: Wire key carrying, when the sender left unchanged ``send_once`` values off, how many such
#: values the receiver must already hold for the request. The count is negative (minus that count)
#: when one of the values left off is ``meta.override_keys``: the list the receiver holds then
#: still applies to the chunk; a chunk with a positive count or none resets nothing. Never shown to
#: consumers.
WIRE_MARKER = "__omni_accum__"


class _Slot:
    """One key of one request: its strategy and receiver-side state."""

    __slots__ = ("path", "strategy", "spec", "acc", "meter")

    def __init__(self, path: str, strategy: Strategy, spec: StrategySpec, acc: Accumulator) -> None:
        self.path = path
        self.strategy = strategy
        self.spec = spec
        self.acc = acc
        self.meter: Any = None  # whatever the receiver's ``on_merge`` keeps per key (its metrics slot)


#: The one key whose value the receiver reads straight from the wire (to reset listed keys).
OVERRIDE_KEYS_PATH = "meta.override_keys"


class _Request:
    __slots__ = (
        "entries",
        "lock",
        "context",
        "failed",
        "held_once",
        "enc_specs",
        "next_seq",
        "pending",
        "dups",
        "view",
        "plain",
        "once",
    )

    def __init__(self, context: StreamContext) -> None:
        self.entries: dict[Any, Any] = {}  # top key -> _Slot | dict[qualifier, _Slot] (sender: Encoder|None)
        self.lock = threading.Lock()
        self.context = context
        self.failed: str | None = None
        self.held_once = 0
        self.enc_specs: dict[str, StrategySpec] = {}  # sender: key path -> spec of its encoder (for errors)
        self.next_seq: int | None = None  # receiver: next seq to merge; None while the request is unsequenced
        self.pending: dict[int, Mapping[str, Any]] = {}  # receiver: chunks that arrived early, by seq
        self.dups = 0  # receiver: duplicated chunks dropped
        self.view: Any = None  # receiver: the request's RequestView (made once; it reads entries live)
        self.plain: frozenset[Any] = frozenset()  # sender: top-level leaf keys that have no encoder
        # sender: (top, qualifier or LEAF) of each send_once-like key -> whether its value went on the wire
        # (the receiver holds it then); held_once counts the True ones, as the receiver counts its slots
        self.once: dict[tuple[Any, Any], bool] = {}


class _Leaf:
    """Marks a top-level leaf in the merge plan (``None`` is a valid qualifier of a group)."""

    def __repr__(self) -> str:
        return "LEAF"


LEAF: Any = _Leaf()

#: At most this many strategy selections an endpoint keeps (the oldest dropped first): with a stream
#: context per request (its own ``context_len`` or length hints) every request may select anew.
SELECTION_CACHE_SIZE = 4096


def _path(top: Any, qual: Any = LEAF) -> str:
    return str(top) if qual is LEAF else f"{top}.{qual}"


class _Endpoint:
    """What Sender and Receiver share: policy, manager, strategy selection, request table."""

    def __init__(
        self,
        policy: Policy | Mapping[str, Any] | str | None = None,
        *,
        context: StreamContext | None = None,
        manager: StrategyManager | None = None,
    ) -> None:
        if manager is not None and not isinstance(manager, StrategyManager):
            raise InvalidArgumentError(f"manager must be a StrategyManager or None, got {type(manager).__name__}")
        self.manager = manager or get_manager()
        self.policy: Policy = load_policy(policy, manager=self.manager)
        if self.policy.ab is not None:  # a split runs as its first arm here, as in bench, tune and explain
            self.policy = next(iter(self.policy.arm_policies().values()))
        self.context = _checked_context(context) or DEFAULT_CONTEXT
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._selected: dict[tuple[Any, ...], tuple[Strategy, StrategySpec]] = {}
        if self.policy.honor_override_keys:
            self._check_override_keys_rule()

    def _check_override_keys_rule(self) -> None:
        """Refuse a policy that gives ``meta.override_keys`` a strategy that rewrites its wire form: the rule that
        decides the key, or else the default and every tuned cell of the key (not those of a table measured in another
        environment, which is ignored at run time)."""
        hit = self.policy.match_rule(OVERRIDE_KEYS_PATH)
        refs = [(f"rules[{hit[0]}]", f"rules[{hit[0]}] ({hit[1].match!r})", hit[1])] if hit is not None else []
        if hit is None:
            refs.append(("default", "default", self.policy.default))
            # a stale table's cells are never used at run time: they do not refuse the policy (validate says stale)
            cells = self.policy.tuned.cells if self.policy.tuned_usable(warn=False) else []
            refs += [
                (f"tuned.cells[{i}]", f"tuned.cells[{i}], bucket context_len>={c.context_len}, concurrency>="
                 f"{c.concurrency}", c)
                for i, c in enumerate(cells)
                if c.key == OVERRIDE_KEYS_PATH and self.manager.get_spec(c.strategy) is not None
            ]  # fmt: skip
        details = []  # each that would rewrite it (a table may have several cells): validate lists each
        for loc, where, ref in refs:
            try:
                strategy = self.manager.build(ref.strategy, dict(ref.params), f"{where} for {OVERRIDE_KEYS_PATH}")
            except OmniAccumError:
                if loc.startswith("tuned."):  # params of another plugin version: a stale table, ignored at run time
                    continue
                raise
            if rewrites_wire(strategy):
                cell = loc.startswith("tuned.")  # a cell is placed (a table has many); a rule or the default as before
                msg = _override_keys_message(ref.strategy, where, cell=cell)
                details.append({"loc": f"{loc}.strategy" if cell else None, "line": None, "msg": msg})
        if details:
            raise PolicyError("\n".join(d["msg"] for d in details), details=details)

    # -- requests ---------------------------------------------------------------------------- #
    def _state(self, req_id: str, context: StreamContext | None) -> tuple[_Request, bool]:
        """The state of ``req_id`` and whether this call made it (a new request)."""
        if context is not None:
            _checked_context(context)
        try:
            st = self._requests.get(req_id)
        except TypeError:
            raise _bad_id(req_id) from None
        made = False
        if st is None:
            if req_id is None:  # never held: nbytes(None) and parts' callers could not name it
                raise AccumulationError(
                    "a request id must not be None (rx.nbytes(None) means every request): give a str", request_id=None
                )
            with self._lock:
                st = self._requests.get(req_id)
                if st is None:
                    st = self._requests[req_id] = _Request(context or self.context)
                    made = True
        return st, made

    def _forget_new(self, req_id: str, st: _Request) -> None:
        """Drop the state a refused first chunk made (the caller checks it holds nothing the request needs)."""
        with self._lock:
            if self._requests.get(req_id) is st:
                del self._requests[req_id]

    def _table_get(self, req_id: str) -> _Request | None:
        """The state of ``req_id``, or None; an unhashable id is an :class:`AccumulationError`, as in ``merge``."""
        try:
            return self._requests.get(req_id)
        except TypeError:
            raise _bad_id(req_id) from None

    def _lookup(self, req_id: str) -> _Request:
        """The state of ``req_id``; :class:`UnknownRequestError` (a KeyError) when none is held, and for an
        unhashable id an :class:`AccumulationError` (as in ``merge``) that is also an UnknownRequestError."""
        try:
            return self._requests[req_id]
        except KeyError:
            raise UnknownRequestError(req_id, len(self._requests)) from None
        except TypeError:  # an unhashable id, which no request can have
            raise _UnhashableLookup(req_id, len(self._requests)) from None

    def release(self, req_id: str) -> bool:
        """Drop all state of ``req_id``. Unknown ids are a no-op. Returns True when state was held."""
        try:
            hash(req_id)  # dict.pop skips hashing when the table is empty
        except TypeError:
            raise _bad_id(req_id) from None
        with self._lock:
            return self._requests.pop(req_id, None) is not None

    @property
    def active_requests(self) -> int:
        """Number of requests holding state."""
        return len(self._requests)

    def request_ids(self) -> list[str]:
        with self._lock:
            return list(self._requests)

    # -- selection --------------------------------------------------------------------------- #
    def select(self, path: str, value: Any, context: StreamContext) -> tuple[Strategy, StrategySpec]:
        """Strategy (and its spec) for key ``path`` whose first value is ``value``, in ``context``."""
        meta = KeyMeta.of(path, value)
        # Keyed by all a selection hook is given (the policy is the endpoint's own); bounded (SELECTION_CACHE_SIZE).
        ck = (meta.cache_key, context.cache_key)
        hit = self._selected.get(ck)
        if hit is None:
            choice = self.manager.select(path, meta, context, self.policy)
            spec = self.manager.spec(choice.strategy, where=f"key {path!r} ({choice.source})")
            chosen = f"chosen by {choice.source or 'a selection hook'}"  # the request's error names the key
            params = dict(choice.params) if isinstance(choice.params, Mapping) else choice.params  # build names others
            hit = (self.manager.build(choice.strategy, params, chosen), spec)
            with self._lock:
                cache = self._selected
                while len(cache) >= SELECTION_CACHE_SIZE:
                    del cache[next(iter(cache))]  # the oldest (dicts keep insertion order)
                cache[ck] = hit
        return hit

    def _key_state(
        self, st: _Request, req_id: str, path: str, value: Any, make: str, like: _Slot | None = None
    ) -> tuple[Strategy, StrategySpec, Any]:
        """Select ``path``'s strategy (or reuse ``like``'s) and create its per-key state with ``strategy.<make>``.

        Every failure (no such strategy, a plugin raising) is an :class:`AccumulationError` for this request;
        a plugin raising also fails the request until it is released (its state is no longer trusted).
        """
        if like is not None:
            strategy, spec = like.strategy, like.spec
        else:
            try:
                strategy, spec = self.select(path, value, st.context)
            except OmniAccumError as e:
                raise AccumulationError(str(e), request_id=req_id, key=path) from e
            except Exception as e:  # noqa: BLE001 - a value the key's metadata cannot be read from
                why = f"cannot select a strategy for {describe(value)}: {type(e).__name__}: {e}"
                raise AccumulationError(why, request_id=req_id, key=path) from e
        try:
            state = getattr(strategy, make)(KeyInfo(path, req_id, st.context.length_hints.get(path)))
        except Exception as e:  # noqa: BLE001 - a strategy bug fails this request only
            st.failed = f"strategy {spec.name!r} raised {type(e).__name__} in {make} for key {path!r}"
            raise AccumulationError(
                f"{make} raised {type(e).__name__}: {e}",
                request_id=req_id,
                key=path,
                strategy=spec.name,
                plugin=spec.plugin,
            ) from e
        return strategy, spec, state

    def strategy_for(self, path: str, value: Any = None, context: StreamContext | None = None) -> str:
        """Name of the strategy ``path`` gets (with a first value like ``value``)."""
        if not isinstance(path, str):
            raise InvalidArgumentError(
                f"strategy_for: path must be a key path (a str such as 'embed.decode'), got {type(path).__name__} "
                f"{path!r:.80}"
            )
        return self.select(path, value, _checked_context(context) or self.context)[1].name


def _trailing(t: torch.Tensor) -> Any:
    """A tensor's shape without dim 0 (a nested tensor has none: its ``.shape`` raises)."""
    return "nested" if t.is_nested else t.shape[1:]


def read_mismatch(value: Any, got: Any) -> str | None:
    """Why ``got`` (a first ``read()`` after merging ``value``) is no view of a key whose chunk was ``value``, or None.

    A tensor chunk reads as a tensor of its dtype, trailing shape and device (appended or replaced), a
    list chunk as a list, any other value as a value of its type (every kind replaces those).
    """
    if isinstance(value, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"expected a tensor like the chunk's {describe(value)}"
        if got.dtype != value.dtype or _trailing(got) != _trailing(value) or got.device != value.device:
            return f"expected the chunk's dtype, trailing shape and device ({describe(value)})"
        return None
    if isinstance(value, list):
        return None if isinstance(got, list) else "expected a list, as the chunk's value"
    if isinstance(got, type(value)):
        return None
    return f"expected a {type(value).__name__}, as the chunk's value"


def check_first_read(req_id: str, st: _Request, slot: _Slot, value: Any) -> None:
    """Check a new key state's first ``read()`` after merging its first ``value`` (:func:`read_mismatch`).

    Runs once per key and request, where a slot is made (never on the steady path of known keys): a
    plugin whose view has the wrong type (a string for an append key) fails the request here, with an
    :class:`AccumulationError`, as a strategy that raises does, instead of reaching the consumer. A
    strategy that rewrites the wire form is not checked: its wire value says nothing of its view.
    """
    if rewrites_wire(slot.strategy):
        return
    try:
        got = slot.acc.read()
    except Exception as e:  # noqa: BLE001 - a strategy bug fails this request only
        st.failed = f"strategy {slot.spec.name!r} raised {type(e).__name__} in read on key {slot.path!r}"
        raise slot_error(f"read raised {type(e).__name__}: {e}", req_id, slot) from e
    msg = read_mismatch(value, got)
    if msg is not None:
        st.failed = f"strategy {slot.spec.name!r} read {describe(got)} for key {slot.path!r}"
        raise slot_error(f"read() returned {describe(got)}: {msg}", req_id, slot)


def _checked_context(context: Any) -> StreamContext | None:
    if context is not None and not isinstance(context, StreamContext):
        raise InvalidArgumentError(
            f"context must be a StreamContext or None, got {type(context).__name__} {context!r:.80}"
        )
    return context


def _bad_id(req_id: Any) -> AccumulationError:
    return AccumulationError(f"a request id must be hashable (a str), got {type(req_id).__name__}")


class _UnhashableLookup(AccumulationError, UnknownRequestError):
    """An unhashable request id given to ``view``, ``nbytes`` or ``parts``: an :class:`AccumulationError`, as in
    ``merge`` and ``release``, and still an :class:`UnknownRequestError` (a KeyError), what these raised before."""

    def __init__(self, req_id: Any, live: int) -> None:
        vars(self).update(vars(_bad_id(req_id)))  # request_id None, reason: the AccumulationError's fields
        self.live = live
        KeyError.__init__(self, self.reason)  # str() is the reason (UnknownRequestError.__str__)


def slot_error(message: str, req_id: str, slot: _Slot) -> AccumulationError:
    """An :class:`AccumulationError` for one key of one request, naming its strategy and plugin."""
    return AccumulationError(
        message, request_id=req_id, key=slot.path, strategy=slot.spec.name, plugin=slot.spec.plugin
    )


def check_error(req_id: str, st: _Request, slot: _Slot, e: Exception, what: str = "check") -> AccumulationError:
    """The error for a value ``slot``'s check refused; a check (or nbytes) raising anything else fails the request."""
    if isinstance(e, MergeError) and what == "check":
        return slot_error(str(e), req_id, slot)
    st.failed = f"strategy {slot.spec.name!r} raised {type(e).__name__} in {what} on key {slot.path!r}"
    return slot_error(f"{what} raised {type(e).__name__}: {e}", req_id, slot)


def merge_error(req_id: str, st: _Request, slot: _Slot, e: Exception) -> AccumulationError:
    """The error for a merge that raised after the checks passed; marks the request failed."""
    if isinstance(e, MergeError):
        st.failed = f"key {slot.path!r}: {e}"
        return slot_error(str(e), req_id, slot)
    st.failed = f"strategy {slot.spec.name!r} raised {type(e).__name__} on key {slot.path!r}"
    return slot_error(f"strategy raised {type(e).__name__}: {e}", req_id, slot)


def _leaves(wire: Mapping[str, Any]) -> Iterator[tuple[str, Any, Any, Any]]:
    """``(path, top, qualifier or LEAF, value)`` of every leaf of a wire chunk (the markers excluded)."""
    for top, value in wire.items():
        if top == WIRE_MARKER:
            continue
        if isinstance(value, dict):
            for qual, qv in value.items():
                yield _path(top, qual), top, qual, qv
        else:
            yield _path(top), top, LEAF, value


def _iter_slots(entries: dict[Any, Any]) -> Iterator[_Slot]:
    for e in entries.values():
        if type(e) is _Slot:
            yield e
        else:
            yield from e.values()


def _resets_on_override(slot: _Slot) -> bool:
    """Whether a key listed in ``meta.override_keys`` gets fresh state for the chunk.

    Only append-kind strategies do: a replace-kind one already serves the latest value, and one
    that transforms the wire (``delta`` sends suffixes) needs its state to decode the next value.
    """
    return "append" in slot.spec.kinds


def _held_once(entry: Any) -> int:
    """How many send_once-like values an entry (slot, group or None) holds."""
    if entry is None:
        return 0
    if type(entry) is _Slot:
        return int(entry.strategy.omits_unchanged)
    return sum(int(s.strategy.omits_unchanged) for s in entry.values())


def rewrites_wire(strategy: Strategy) -> bool:
    """True when ``strategy``'s encoder may put something other than the value itself on the wire.

    A strategy without an encoder sends values as they are; one with ``omits_unchanged`` only
    leaves unchanged values off (``send_once``). Anything else (``delta`` sends suffixes) rewrites.
    """
    return not strategy.omits_unchanged and type(strategy).new_encoder is not Strategy.new_encoder


def _override_keys_message(name: str, where: str, cell: bool = False) -> str:
    also = " (a rule beats the tuned table), or remove the cell" if cell else ""
    return (
        f"{OVERRIDE_KEYS_PATH} gets strategy {name!r} (from {where}), which rewrites the key's wire form, but the "
        f"receiver reads {OVERRIDE_KEYS_PATH} from the wire to reset the keys it lists: give it a rule with "
        f"'replace' or 'send_once'{also}, or set honor_override_keys: false"
    )
