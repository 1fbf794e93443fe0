"""The engine: :class:`Sender` and :class:`Receiver`, per-request, per-key strategy state.

``Sender.encode`` turns a payload chunk into what goes on the wire (strategies with an encoder,
such as ``send_once``, may leave keys off). ``Receiver.merge`` merges a wire chunk into the
request's state and returns the consumer's view: a read-only :class:`RequestView` mapping with
the payload's own nesting, whose leaves are read from the strategies lazily (a ``token_list`` key
is only concatenated when the consumer reads it).

Payloads are vllm-omni's: a mapping whose values are leaves (tensors, lists, scalars) or groups
(a dict of leaves: ``{"embed": {"decode": t}}``, key path ``embed.decode``). Deeper dicts are leaf
values, as in vllm-omni 0.30.0. Merging follows 0.30.0's ``_accumulate_payload``: keys a chunk
lists in ``meta.override_keys`` are replaced for that chunk; keys absent from a chunk keep their
value.

Thread safety: one lock per request and one for the request table, so one thread may merge or
release some requests while others merge other requests. One request must not be merged by two
threads at once (vllm-omni never does).

Ordering: without a sequence number chunks are merged in the order ``merge`` is called (as
upstream does: a duplicated chunk is merged twice, a lost one is never noticed). With the opt-in
``seq`` argument (0, 1, 2, ... per request) the receiver drops duplicates, buffers chunks that
arrive early in a bounded reorder window and reports gaps (:meth:`Receiver.merge`,
:meth:`Receiver.finish`). The wire itself is unchanged. See ``docs/reliability.md``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from omni_accum.context import DEFAULT_CONTEXT, KeyMeta, StreamContext
from omni_accum.errors import AccumulationError, MergeError, OmniAccumError, PolicyError
from omni_accum.loader import load_policy
from omni_accum.manager import StrategyManager, get_manager
from omni_accum.policy import Policy
from omni_accum.strategy import OMIT, Accumulator, Encoder, KeyInfo, Strategy, StrategySpec

#: Wire key carrying, when the sender left unchanged ``send_once`` values off, how many such
#: values the receiver must already hold for the request. Never shown to consumers.
WIRE_MARKER = "__omni_accum__"


class _Slot:
    """One key of one request: its strategy and receiver-side state."""

    __slots__ = ("path", "strategy", "spec", "acc")

    def __init__(self, path: str, strategy: Strategy, spec: StrategySpec, acc: Accumulator) -> None:
        self.path = path
        self.strategy = strategy
        self.spec = spec
        self.acc = acc


#: Default number of chunks a receiver buffers per request while it waits for a missing ``seq``.
REORDER_WINDOW = 16

#: The one key whose value the receiver reads straight from the wire (to reset listed keys).
OVERRIDE_KEYS_PATH = "meta.override_keys"


class _Request:
    __slots__ = (
        "entries", "lock", "context", "failed", "held_once", "nbytes", "enc_specs", "next_seq", "pending", "dups"
    )

    def __init__(self, context: StreamContext) -> None:
        self.entries: dict[Any, Any] = {}  # top key -> _Slot | dict[qualifier, _Slot] (sender: Encoder|None)
        self.lock = threading.Lock()
        self.context = context
        self.failed: str | None = None
        self.held_once = 0
        self.nbytes = 0
        self.enc_specs: dict[str, StrategySpec] = {}  # sender: key path -> spec of its encoder (for errors)
        self.next_seq: int | None = None  # receiver: next seq to merge; None while the request is unsequenced
        self.pending: dict[int, Mapping[str, Any]] = {}  # receiver: chunks that arrived early, by seq
        self.dups = 0  # receiver: duplicated chunks dropped


class _Leaf:
    """Marks a top-level leaf in the merge plan (``None`` is a valid qualifier of a group)."""

    def __repr__(self) -> str:
        return "LEAF"


LEAF: Any = _Leaf()


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
        self.manager = manager or get_manager()
        self.policy: Policy = load_policy(policy, manager=self.manager)
        self.context = context or DEFAULT_CONTEXT
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._selected: dict[tuple[Any, ...], tuple[Strategy, StrategySpec]] = {}
        if self.policy.honor_override_keys:
            self._check_override_keys_rule()

    def _check_override_keys_rule(self) -> None:
        """Refuse a policy whose rules give ``meta.override_keys`` a strategy that rewrites its wire form."""
        hit = self.policy.match_rule(OVERRIDE_KEYS_PATH)
        ref = hit[1] if hit is not None else self.policy.default
        strategy = self.manager.build(ref.strategy, dict(ref.params))
        if rewrites_wire(strategy):
            where = f"rules[{hit[0]}] ({hit[1].match!r})" if hit is not None else "default"
            raise PolicyError(_override_keys_message(ref.strategy, where))

    # -- requests ---------------------------------------------------------------------------- #
    def _state(self, req_id: str, context: StreamContext | None) -> _Request:
        st = self._requests.get(req_id)
        if st is None:
            with self._lock:
                st = self._requests.get(req_id)
                if st is None:
                    st = self._requests[req_id] = _Request(context or self.context)
        return st

    def release(self, req_id: str) -> bool:
        """Drop all state of ``req_id``. Unknown ids are a no-op. Returns True when state was held."""
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
        ck = (meta.cache_key, context.cache_key)
        hit = self._selected.get(ck)
        if hit is None:
            choice = self.manager.select(path, meta, context, self.policy)
            spec = self.manager.spec(choice.strategy, where=f"key {path!r} ({choice.source})")
            hit = self._selected[ck] = (self.manager.build(choice.strategy, dict(choice.params)), spec)
        return hit

    def strategy_for(self, path: str, value: Any = None, context: StreamContext | None = None) -> str:
        """Name of the strategy ``path`` gets (with a first value like ``value``)."""
        return self.select(path, value, context or self.context)[1].name


class Sender(_Endpoint):
    """Sender side: turns each payload chunk into its wire form.

    Args:
        policy: a Policy, mapping, preset name or path; None reads ``OMNI_ACCUM_POLICY`` / ``default``.
        context: default stream context of requests (a per-request one can be given to ``encode``).
        manager: strategy manager (default: the process-wide one).
    """

    def encode(self, req_id: str, chunk: Mapping[str, Any], *, context: StreamContext | None = None) -> Any:
        """Return the wire form of ``chunk`` for ``req_id``.

        Keys whose strategy has no encoder go on the wire as they are (the chunk itself is
        returned when no key of it has an encoder). Keys an encoder omits are left off; a group
        left empty is dropped; the wire then carries :data:`WIRE_MARKER`.
        """
        if not isinstance(chunk, Mapping):
            raise AccumulationError(f"a payload chunk must be a mapping, got {type(chunk).__name__}", request_id=req_id)
        if WIRE_MARKER in chunk:
            raise AccumulationError(
                f"a payload chunk may not use the key {WIRE_MARKER!r}: omni-accum reserves it for its wire marker",
                request_id=req_id, key=WIRE_MARKER,
            )
        st = self._state(req_id, context)
        with st.lock:
            if st.failed is not None:
                raise AccumulationError(f"request failed earlier ({st.failed}); release it", request_id=req_id)
            encs = st.entries
            any_enc = False
            for top, value in chunk.items():
                if isinstance(value, dict):
                    group = encs.get(top)
                    if not isinstance(group, dict):
                        group = encs[top] = {}
                    for qual, qv in value.items():
                        enc = group.get(qual, OMIT)
                        if enc is OMIT:
                            enc = group[qual] = self._new_encoder(st, req_id, _path(top, qual), qv)
                        any_enc = any_enc or enc is not None
                else:
                    enc = encs.get(top, OMIT)
                    if enc is OMIT or isinstance(enc, dict):
                        enc = encs[top] = self._new_encoder(st, req_id, _path(top), value)
                    any_enc = any_enc or enc is not None
            if not any_enc:
                return chunk
            try:
                return self._encode_with(st, req_id, chunk)
            except AccumulationError as e:
                # Encoders before the failing one already recorded this chunk as sent: a later chunk
                # encoded against that state would give the receiver a wrong view. Fail the request.
                st.failed = f"key {e.key!r}: {e.reason}"
                raise

    def _new_encoder(self, st: _Request, req_id: str, path: str, value: Any) -> Encoder | None:
        try:
            strategy, spec = self.select(path, value, st.context)
        except OmniAccumError as e:
            raise AccumulationError(str(e), request_id=req_id, key=path) from e
        try:
            enc = strategy.new_encoder(KeyInfo(path, req_id, st.context.length_hints.get(path)))
        except Exception as e:  # noqa: BLE001 - a strategy bug fails this request only
            raise AccumulationError(
                f"new_encoder raised {type(e).__name__}: {e}",
                request_id=req_id, key=path, strategy=spec.name, plugin=spec.plugin,
            ) from e
        if enc is not None:
            st.enc_specs[path] = spec
            if strategy.omits_unchanged:
                st.held_once += 1
        return enc

    def _encode_one(self, enc: Encoder | None, value: Any, req_id: str, path: str, st: _Request) -> Any:
        if enc is None:
            return value
        try:
            return enc.encode(value)
        except Exception as e:  # noqa: BLE001 - a strategy bug fails this request only
            spec = st.enc_specs.get(path)
            reason = e.reason if isinstance(e, AccumulationError) else f"encoder raised {type(e).__name__}: {e}"
            raise AccumulationError(
                reason,
                request_id=req_id,
                key=path,
                strategy=spec.name if spec else None,
                plugin=spec.plugin if spec else None,
            ) from e

    def _encode_with(self, st: _Request, req_id: str, chunk: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        omitted = 0
        for top, value in chunk.items():
            if isinstance(value, dict):
                group = st.entries[top]
                sub = {}
                for qual, qv in value.items():
                    w = self._encode_one(group[qual], qv, req_id, _path(top, qual), st)
                    if w is OMIT:
                        omitted += 1
                    else:
                        sub[qual] = w
                if sub or not value:
                    out[top] = sub
            else:
                w = self._encode_one(st.entries[top], value, req_id, _path(top), st)
                if w is OMIT:
                    omitted += 1
                else:
                    out[top] = w
        if omitted:
            out[WIRE_MARKER] = st.held_once
        return out


class GroupView(Mapping):
    """Read-only view of one payload group (``view["embed"]``)."""

    __slots__ = ("_slots",)

    def __init__(self, slots: dict[Any, _Slot]) -> None:
        self._slots = slots

    def __getitem__(self, qual: Any) -> Any:
        return self._slots[qual].acc.read()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def to_dict(self) -> dict[Any, Any]:
        return {q: s.acc.read() for q, s in self._slots.items()}

    def __repr__(self) -> str:
        return f"GroupView({list(self._slots)})"


class RequestView(Mapping):
    """The consumer's view of one request: a read-only mapping with the payload's nesting.

    Values are read from the strategies when accessed. Tensors are borrowed: do not write into them.
    """

    __slots__ = ("_entries",)

    def __init__(self, entries: dict[Any, Any]) -> None:
        self._entries = entries

    def __getitem__(self, top: Any) -> Any:
        e = self._entries[top]
        return e.acc.read() if type(e) is _Slot else GroupView(e)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def to_dict(self) -> dict[Any, Any]:
        """Materialise the whole view as plain nested dicts."""
        return {
            k: (e.acc.read() if type(e) is _Slot else {q: s.acc.read() for q, s in e.items()})
            for k, e in self._entries.items()
        }

    def __repr__(self) -> str:
        return f"RequestView({list(self._entries)})"


@dataclass(frozen=True)
class SequenceState:
    """Where a sequenced request stands on the receiver (see :meth:`Receiver.sequence`).

    Attributes:
        next_seq: the sequence number the receiver merges next.
        buffered: sequence numbers that arrived early and wait in the reorder window, ascending.
        missing: sequence numbers below the highest buffered one that have not arrived (a gap).
        duplicates: duplicated chunks dropped for this request.
    """

    next_seq: int
    buffered: tuple[int, ...]
    missing: tuple[int, ...]
    duplicates: int


class Receiver(_Endpoint):
    """Receiver side: merges wire chunks per request and serves the consumer's view.

    Args:
        policy: a Policy, mapping, preset name or path; None reads ``OMNI_ACCUM_POLICY`` / ``default``.
        context: default stream context of requests (a per-request one can be given to ``merge``).
        manager: strategy manager (default: the process-wide one).
        reorder_window: for chunks merged with ``seq``: how many chunks that arrive early a request may
            buffer while it waits for a missing one (0: any gap is an error at once).
    """

    def __init__(
        self,
        policy: Policy | Mapping[str, Any] | str | None = None,
        *,
        context: StreamContext | None = None,
        manager: StrategyManager | None = None,
        reorder_window: int = REORDER_WINDOW,
    ) -> None:
        if type(reorder_window) is not int or reorder_window < 0:
            raise ValueError(f"reorder_window must be an int >= 0, got {reorder_window!r}")
        super().__init__(policy, context=context, manager=manager)
        self.reorder_window = reorder_window
        self._dups = 0

    def merge(
        self,
        req_id: str,
        wire: Mapping[str, Any],
        *,
        context: StreamContext | None = None,
        seq: int | None = None,
    ) -> RequestView:
        """Merge one wire chunk of ``req_id`` and return the consumer's view after it.

        A chunk is merged whole or not at all: if any key fails (dtype or trailing shape change,
        a 0-d tensor appended, the memory guard, an unknown strategy) an
        :class:`AccumulationError` is raised and the request's state is as before the chunk.
        If a strategy raises half-way, the request is marked failed until released.

        ``seq`` (opt-in; all chunks of a request carry one, or none does) numbers the request's
        chunks 0, 1, 2, ...: a chunk below the next expected number, or one already buffered, is a
        duplicate: dropped and counted. The expected chunk is merged, then any buffered successors.
        A chunk ahead of it is buffered (at most ``reorder_window`` ahead) and merged when the gap
        fills; the view returned meanwhile is the in-order prefix. Further ahead, the chunk is
        rejected with an :class:`AccumulationError` whose ``missing`` lists the seqs still awaited.
        """
        if not isinstance(wire, Mapping):
            raise AccumulationError(f"a payload chunk must be a mapping, got {type(wire).__name__}", request_id=req_id)
        st = self._state(req_id, context)
        with st.lock:
            if st.failed is not None:
                raise AccumulationError(f"request failed earlier ({st.failed}); release it", request_id=req_id)
            if seq is None:
                if st.next_seq is not None:
                    raise AccumulationError(
                        f"chunk without a seq, but this request's chunks carry sequence numbers (next {st.next_seq}); "
                        "number every chunk of a request, or none",
                        request_id=req_id,
                    )
                try:
                    self._apply(req_id, st, self._plan(req_id, st, wire))
                except AccumulationError:
                    self._fail_if_sender_diverged(st, wire)
                    raise
            else:
                # A rejected sequenced chunk leaves its seq open: later chunks wait behind it (a gap), so
                # the view never runs ahead of a chunk the sender believes delivered.
                self._merge_sequenced(req_id, st, wire, seq)
        return RequestView(st.entries)

    def _fail_if_sender_diverged(self, st: _Request, wire: Mapping[str, Any]) -> None:
        """After a rejected chunk: fail the request when the chunk carried a send_once-like value.

        The sender recorded that value as delivered and will leave it off later chunks while it is
        unchanged, so this receiver would go on serving the value it held before: a stale view.
        Runs on the error path only.
        """
        if st.failed is not None:
            return
        for path, top, qual, value in _leaves(wire):
            slot = st.entries.get(top)
            if qual is not LEAF:
                slot = slot.get(qual) if isinstance(slot, dict) else None
            try:
                strategy = slot.strategy if type(slot) is _Slot else self.select(path, value, st.context)[0]
            except OmniAccumError:
                continue
            if strategy.omits_unchanged:
                st.failed = (
                    f"a rejected chunk carried the send_once value of {path!r}, which the sender now leaves off "
                    "the wire; re-send the request from its first chunk"
                )
                return

    def _merge_sequenced(self, req_id: str, st: _Request, wire: Mapping[str, Any], seq: int) -> None:
        if type(seq) is not int or seq < 0:
            raise AccumulationError(f"seq must be an int >= 0, got {seq!r}", request_id=req_id)
        nxt = st.next_seq
        if nxt is None:
            if st.entries:
                raise AccumulationError(
                    f"chunk with seq {seq}, but earlier chunks of this request carried none; "
                    "number every chunk of a request, or none",
                    request_id=req_id, seq=seq,
                )
            nxt = st.next_seq = 0
        if seq < nxt or seq in st.pending:
            st.dups += 1
            with self._lock:
                self._dups += 1
            return
        if seq > nxt:
            if seq - nxt > self.reorder_window:
                missing = _missing(nxt, seq, st.pending)
                raise AccumulationError(
                    f"chunk arrived {seq - nxt} ahead of the next expected seq {nxt}, beyond reorder_window="
                    f"{self.reorder_window}: still missing {_fmt_seqs(missing, seq - nxt - len(st.pending))}; "
                    "chunk rejected (state unchanged). Re-send the missing chunks, or release the request",
                    request_id=req_id, seq=seq, missing=missing,
                )
            st.pending[seq] = wire
            return
        self._apply(req_id, st, self._plan(req_id, st, wire))
        st.next_seq = nxt = seq + 1
        while st.pending and nxt in st.pending:
            w = st.pending.pop(nxt)
            try:
                self._apply(req_id, st, self._plan(req_id, st, w))
            except AccumulationError as e:
                raise AccumulationError(
                    f"buffered chunk rejected after seq {seq} filled the gap: {e.reason}; it was dropped: re-send it",
                    request_id=req_id, key=e.key, strategy=e.strategy, plugin=e.plugin, seq=nxt,
                ) from e
            st.next_seq = nxt = nxt + 1

    def finish(self, req_id: str, *, chunks: int | None = None) -> RequestView:
        """The final view of ``req_id``, after checking that no chunk is missing.

        Raises :class:`AccumulationError` (with ``missing``) when sequenced chunks wait in the reorder
        window behind a gap, or when ``chunks`` (the number the sender sent; needs ``seq``) is not the
        number merged; also when the request holds no state (never merged, or released) or failed.
        Does not release the request.
        """
        st = self._requests.get(req_id)
        if st is None:
            missing = tuple(range(min(chunks or 0, 100)))
            raise AccumulationError(
                "finish: no chunk of this request was merged (never sent, or released)",
                request_id=req_id, missing=missing,
            )
        with st.lock:
            if st.failed is not None:
                raise AccumulationError(f"request failed earlier ({st.failed}); release it", request_id=req_id)
            nxt = st.next_seq
            if chunks is not None and nxt is None:
                raise AccumulationError(
                    "finish(chunks=...) needs chunks merged with seq; this request's carried none", request_id=req_id
                )
            if st.pending:
                last = max(st.pending)
                missing = _missing(nxt or 0, last, st.pending)
                raise AccumulationError(
                    f"finish with a gap: seqs {_fmt_seqs(tuple(sorted(st.pending)), len(st.pending))} wait for "
                    f"missing {_fmt_seqs(missing, last - (nxt or 0) - len(st.pending) + 1)}",
                    request_id=req_id, missing=missing,
                )
            if chunks is not None and nxt != chunks:
                if nxt is not None and nxt < chunks:
                    missing = tuple(range(nxt, min(chunks, nxt + 100)))
                    raise AccumulationError(
                        f"finish: the sender sent {chunks} chunks but only seqs 0..{nxt - 1} arrived; missing "
                        f"{_fmt_seqs(missing, chunks - nxt)}",
                        request_id=req_id, missing=missing,
                    )
                raise AccumulationError(f"finish: expected {chunks} chunks, merged {nxt}", request_id=req_id)
        return RequestView(st.entries)

    def sequence(self, req_id: str) -> SequenceState | None:
        """Where sequenced request ``req_id`` stands, or None (unknown, or merged without ``seq``)."""
        st = self._requests.get(req_id)
        if st is None or st.next_seq is None:
            return None
        with st.lock:
            nxt, pending = st.next_seq, dict(st.pending)
            last = max(pending) if pending else nxt
            return SequenceState(nxt, tuple(sorted(pending)), _missing(nxt, last, pending), st.dups)

    @property
    def duplicates_dropped(self) -> int:
        """Duplicated sequenced chunks dropped, all requests together (released ones included)."""
        return self._dups

    def view(self, req_id: str) -> RequestView:
        """The current view of ``req_id`` (KeyError when it holds no state)."""
        return RequestView(self._requests[req_id].entries)

    def nbytes(self, req_id: str | None = None) -> int:
        """Bytes held by accumulation state of one request, or of all."""
        sts = [self._requests[req_id]] if req_id is not None else list(self._requests.values())
        return sum(s.acc.nbytes() for st in sts for s in _iter_slots(st.entries))

    def parts(self, req_id: str) -> dict[Any, Any]:
        """The stored representation per key (lists of parts), in the payload's nesting."""
        entries = self._requests[req_id].entries
        return {
            k: (e.acc.parts() if type(e) is _Slot else {q: s.acc.parts() for q, s in e.items()})
            for k, e in entries.items()
        }

    # -- merging ----------------------------------------------------------------------------- #
    def _override_keys(self, req_id: str, st: _Request, wire: Mapping[str, Any]) -> frozenset[Any]:
        meta = wire.get("meta")
        raw = meta.get("override_keys") if isinstance(meta, dict) else None
        if raw is not None:
            group = st.entries.get("meta")
            slot = group.get("override_keys") if isinstance(group, dict) else None
            try:
                strategy = slot.strategy if slot is not None else self.select(OVERRIDE_KEYS_PATH, raw, st.context)[0]
            except OmniAccumError as e:
                raise AccumulationError(str(e), request_id=req_id, key=OVERRIDE_KEYS_PATH) from e
            if rewrites_wire(strategy):
                raise AccumulationError(
                    _override_keys_message(strategy.name, "strategy selection"),
                    request_id=req_id, key=OVERRIDE_KEYS_PATH, strategy=strategy.name,
                )
        if raw is None and WIRE_MARKER in wire:
            # A send_once-like strategy left an unchanged override list off the wire: it still applies.
            group = st.entries.get("meta")
            slot = group.get("override_keys") if isinstance(group, dict) else None
            if slot is not None and slot.strategy.omits_unchanged:
                raw = slot.acc.read()
        if raw is None:
            return frozenset()
        if not isinstance(raw, (list, tuple)):
            raise AccumulationError(
                f"meta.override_keys must be a list of key names or [group, qualifier] pairs, got {type(raw).__name__}",
                request_id=req_id,
                key="meta.override_keys",
            )
        if not raw:
            return frozenset()
        try:
            return frozenset(tuple(k) if isinstance(k, list) else k for k in raw)
        except TypeError as e:
            raise AccumulationError(
                f"meta.override_keys must list key names or [group, qualifier] pairs, got {raw!r}",
                request_id=req_id,
                key="meta.override_keys",
            ) from e

    def _new_slot(self, req_id: str, st: _Request, path: str, value: Any, like: _Slot | None = None) -> _Slot:
        if like is not None:
            strategy, spec = like.strategy, like.spec
        else:
            try:
                strategy, spec = self.select(path, value, st.context)
            except OmniAccumError as e:
                raise AccumulationError(str(e), request_id=req_id, key=path) from e
        try:
            acc = strategy.new_accumulator(KeyInfo(path, req_id, st.context.length_hints.get(path)))
        except Exception as e:  # noqa: BLE001 - a strategy bug fails this request only
            raise AccumulationError(
                f"new_accumulator raised {type(e).__name__}: {e}",
                request_id=req_id, key=path, strategy=spec.name, plugin=spec.plugin,
            ) from e
        return _Slot(path, strategy, spec, acc)

    def _check(self, req_id: str, slot: _Slot, value: Any) -> None:
        try:
            slot.acc.check(value)
        except Exception as e:  # noqa: BLE001 - MergeError, or a strategy bug: fails this request only
            msg = str(e) if isinstance(e, MergeError) else f"check raised {type(e).__name__}: {e}"
            raise AccumulationError(
                msg, request_id=req_id, key=slot.path, strategy=slot.spec.name, plugin=slot.spec.plugin
            ) from e

    def _plan(self, req_id: str, st: _Request, wire: Mapping[str, Any]) -> list[tuple[Any, Any, Any, _Slot]]:
        """Phase 1: find or create the slot of every key, check every value; change nothing."""
        override = self._override_keys(req_id, st, wire) if self.policy.honor_override_keys else frozenset()
        entries = st.entries
        ops: list[tuple[Any, Any, Any, _Slot]] = []
        new_once = 0
        for top, value in wire.items():
            if top == WIRE_MARKER:
                continue
            if isinstance(value, dict):
                group = entries.get(top)
                if not isinstance(group, dict):
                    group = None
                if not value:
                    ops.append((top, None, None, None))  # type: ignore[arg-type]
                for qual, qv in value.items():
                    slot = group.get(qual) if group is not None else None
                    if slot is None:
                        slot = self._new_slot(req_id, st, _path(top, qual), qv)
                        new_once += slot.strategy.omits_unchanged
                    elif (top, qual) in override and _resets_on_override(slot):
                        slot = self._new_slot(req_id, st, slot.path, qv, like=slot)
                    else:
                        self._check(req_id, slot, qv)
                    ops.append((top, qual, qv, slot))
            else:
                slot = entries.get(top)
                if type(slot) is not _Slot:
                    slot = self._new_slot(req_id, st, _path(top), value)
                    new_once += slot.strategy.omits_unchanged
                elif top in override and _resets_on_override(slot):
                    slot = self._new_slot(req_id, st, slot.path, value, like=slot)
                else:
                    self._check(req_id, slot, value)
                ops.append((top, LEAF, value, slot))
        need = wire.get(WIRE_MARKER) if WIRE_MARKER in wire else None
        if need is not None and (type(need) is not int or need < 0):
            raise AccumulationError(
                f"malformed wire marker {WIRE_MARKER!r}: expected a count >= 0, got {need!r}", request_id=req_id
            )
        if need is not None and st.held_once + new_once < need:
            raise AccumulationError(
                f"the sender left {need!r} unchanged send_once value(s) off the wire for this request, but this "
                f"receiver holds {st.held_once + new_once}: it lost them (restarted, or the request was released "
                "mid-stream). Release the request and re-send it from its first chunk",
                request_id=req_id,
            )
        limit = self.policy.max_bytes_per_request
        if limit:
            self._guard(req_id, st, ops, limit)
        return ops

    def _guard(self, req_id: str, st: _Request, ops: list[tuple[Any, Any, Any, _Slot]], limit: int) -> None:
        """Refuse the chunk when the state would hold more than ``limit`` bytes once merged.

        Each touched key reports what it would hold after the merge (:meth:`Accumulator.projected_nbytes`:
        a ``prealloc`` buffer's grown capacity, a ``token_list``'s cached concatenation), so the check
        runs before anything is allocated.
        """
        after = st.nbytes
        worst: tuple[int, str] = (0, "")
        entries = st.entries
        for top, qual, value, slot in ops:
            if slot is None:
                continue
            old = entries.get(top)
            if qual is not LEAF:
                old = old.get(qual) if isinstance(old, dict) else None
            now = old.acc.nbytes() if type(old) is _Slot else 0
            try:
                proj = slot.acc.projected_nbytes(value)
            except Exception as e:  # noqa: BLE001 - a strategy bug fails this request only
                raise AccumulationError(
                    f"projected_nbytes raised {type(e).__name__}: {e}",
                    request_id=req_id, key=slot.path, strategy=slot.spec.name, plugin=slot.spec.plugin,
                ) from e
            after += proj - now
            worst = max(worst, (proj - now, slot.path))
        if after > limit:
            raise AccumulationError(
                f"would hold {after} bytes after this chunk (key {worst[1]!r} grows by {worst[0]}), over "
                f"max_bytes_per_request={limit}; chunk rejected before allocating (state unchanged)",
                request_id=req_id,
            )

    def _apply(self, req_id: str, st: _Request, ops: list[tuple[Any, Any, Any, _Slot]]) -> None:
        """Phase 2: merge every planned value."""
        entries = st.entries
        for top, qual, value, slot in ops:
            if slot is None:  # an empty group
                if not isinstance(entries.get(top), dict):
                    st.held_once -= _held_once(entries.get(top))
                    entries[top] = {}
                continue
            try:
                slot.acc.merge(value)
            except MergeError as e:
                st.failed = f"key {slot.path!r}: {e}"
                raise AccumulationError(
                    str(e), request_id=req_id, key=slot.path, strategy=slot.spec.name, plugin=slot.spec.plugin
                ) from e
            except Exception as e:  # noqa: BLE001 - a strategy bug fails this request only
                st.failed = f"strategy {slot.spec.name!r} raised {type(e).__name__} on key {slot.path!r}"
                raise AccumulationError(
                    f"strategy raised {type(e).__name__}: {e}",
                    request_id=req_id,
                    key=slot.path,
                    strategy=slot.spec.name,
                    plugin=slot.spec.plugin,
                ) from e
            if qual is LEAF:
                old = entries.get(top)
                if old is not slot:
                    st.held_once += slot.strategy.omits_unchanged - _held_once(old)
                    entries[top] = slot
            else:
                group = entries.get(top)
                if not isinstance(group, dict):
                    st.held_once -= _held_once(group)
                    group = entries[top] = {}
                old = group.get(qual)
                if old is not slot:
                    st.held_once += slot.strategy.omits_unchanged - _held_once(old)
                    group[qual] = slot
        if self.policy.max_bytes_per_request:
            st.nbytes = sum(s.acc.nbytes() for s in _iter_slots(entries))


def _leaves(wire: Mapping[str, Any]) -> Iterator[tuple[str, Any, Any, Any]]:
    """``(path, top, qualifier or LEAF, value)`` of every leaf of a wire chunk (the marker excluded)."""
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


def _override_keys_message(name: str, where: str) -> str:
    return (
        f"{OVERRIDE_KEYS_PATH} gets strategy {name!r} (from {where}), which rewrites the key's wire form, but the "
        f"receiver reads {OVERRIDE_KEYS_PATH} from the wire to reset the keys it lists: give it a rule with "
        "'replace' or 'send_once', or set honor_override_keys: false"
    )


def _missing(nxt: int, upto: int, pending: Mapping[int, Any]) -> tuple[int, ...]:
    """Seqs in ``[nxt, upto)`` not buffered in ``pending``: the first 100 at most."""
    out: list[int] = []
    s = nxt
    while s < upto and len(out) < 100:
        if s not in pending:
            out.append(s)
        s += 1
    return tuple(out)


def _fmt_seqs(seqs: tuple[int, ...], total: int) -> str:
    """``3, 4, 7`` (and how many more when the list was cut)."""
    text = ", ".join(map(str, seqs[:20]))
    more = total - min(len(seqs), 20)
    return f"{text} (and {more} more)" if more > 0 else text
