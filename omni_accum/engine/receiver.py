"""The receiver side of the engine: :class:`Receiver` merges wire chunks per request, key by key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omni_accum.context import StreamContext
from omni_accum.engine.endpoint import (
    LEAF,
    OVERRIDE_KEYS_PATH,
    WIRE_MARKER,
    _Endpoint,
    _held_once,
    _iter_slots,
    _leaves,
    _override_keys_message,
    _path,
    _Request,
    _resets_on_override,
    _Slot,
    check_error,
    check_first_read,
    merge_error,
    rewrites_wire,
    slot_error,
)
from omni_accum.errors import AccumulationError, InvalidArgumentError, OmniAccumError
from omni_accum.manager import StrategyManager
from omni_accum.policy.model import Policy
from omni_accum.engine.sequencing import REORDER_WINDOW, SequencedMerge
from omni_accum.engine.views import RequestView, request_view


class Receiver(SequencedMerge, _Endpoint):
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
            raise InvalidArgumentError(f"reorder_window must be an int >= 0, got {reorder_window!r}")
        super().__init__(policy, context=context, manager=manager)
        self.reorder_window = reorder_window
        self._dups = 0
        #: Called with the ``(slot, value)`` pairs of every chunk merged (after the merge), or None.
        #: A slot has ``.path``, ``.spec`` (its strategy's) and ``.meter``, free for the callee's use:
        #: the vllm-omni metrics count each key there, in the merge's own pass over the chunk.
        self.on_merge: Any = None

    def merge(
        self,
        req_id: str,
        wire: Mapping[str, Any],
        *,
        context: StreamContext | None = None,
        seq: int | None = None,
    ) -> RequestView:
        """Merge one wire chunk of ``req_id`` and return its view: the request's one live :class:`RequestView`.

        A chunk is merged whole or not at all: if any key fails (dtype or trailing shape change,
        a 0-d tensor appended, the memory guard, an unknown strategy) an
        :class:`AccumulationError` is raised and the request's state is as before the chunk.
        If a strategy raises half-way, or a new key's first read is of the wrong type (a string for
        a tensor chunk: checked once per key and request), the request is marked failed until released.

        ``seq`` (opt-in; all chunks of a request carry one, or none does) numbers the request's
        chunks 0, 1, 2, ...: a chunk below the next expected number, or one already buffered, is a
        duplicate: dropped and counted. The expected chunk is merged, then any buffered successors.
        A chunk ahead of it is buffered (at most ``reorder_window`` ahead) and merged when the gap
        fills; the view returned meanwhile is the in-order prefix. Further ahead, the chunk is
        rejected with an :class:`AccumulationError` whose ``missing`` lists the seqs still awaited.
        """
        if not isinstance(wire, (dict, Mapping)):
            raise AccumulationError(f"a payload chunk must be a mapping, got {type(wire).__name__}", request_id=req_id)
        st, made = self._state(req_id, context)
        with st.lock:
            try:
                if st.failed is not None:
                    raise AccumulationError(f"request failed earlier ({st.failed}); release it", request_id=req_id)
                if seq is None:
                    if st.next_seq is not None:
                        raise AccumulationError(
                            "chunk without a seq, but this request's chunks carry sequence numbers (next "
                            f"{st.next_seq}); number every chunk of a request, or none",
                            request_id=req_id,
                        )
                    try:
                        if not self._merge_known(req_id, st, wire):
                            self._apply(req_id, st, self._plan(req_id, st, wire))
                    except AccumulationError:
                        self._fail_if_sender_diverged(st, wire)
                        raise
                else:
                    # A rejected sequenced chunk leaves its seq open: later chunks wait behind it (a gap), so
                    # the view never runs ahead of a chunk the sender believes delivered.
                    self._merge_sequenced(req_id, st, wire, seq)
            except AccumulationError:
                if made and st.failed is None and not st.entries and not st.pending:
                    self._forget_new(req_id, st)  # a refused first chunk leaves no request behind
                raise
        return request_view(st)

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

    def view(self, req_id: str, *, copy: bool = False) -> RequestView | dict[Any, Any]:
        """The live view of ``req_id``: borrowed tensors, not to be written into (see :class:`RequestView`).

        ``copy=True`` returns a snapshot: plain nested dicts with every tensor cloned, for the consumer to write.

        Raises:
            UnknownRequestError: (a KeyError) when it holds no state for ``req_id``.
            InvalidArgumentError: ``copy`` is not a bool.
        """
        if type(copy) is not bool:
            raise InvalidArgumentError(f"view: copy must be True or False, got {type(copy).__name__} {copy!r:.60}")
        view = request_view(self._lookup(req_id))
        return view.copy() if copy else view

    def nbytes(self, req_id: str | None = None) -> int:
        """Bytes held by accumulation state of one request, or of all (each read under its request's lock)."""
        if req_id is not None:
            sts = [self._lookup(req_id)]
        else:
            with self._lock:
                sts = list(self._requests.values())
        total = 0
        for st in sts:
            with st.lock:
                total += sum(s.acc.nbytes() for s in _iter_slots(st.entries))
        return total

    def parts(self, req_id: str) -> dict[Any, Any]:
        """The stored representation per key (lists of parts), in the payload's nesting."""
        entries = self._lookup(req_id).entries
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
                    request_id=req_id,
                    key=OVERRIDE_KEYS_PATH,
                    strategy=strategy.name,
                )
        if raw is None and _override_left_off(wire):
            # A send_once-like strategy left an unchanged override list off the wire: it still applies.
            group = st.entries.get("meta")
            slot = group.get("override_keys") if isinstance(group, dict) else None
            if slot is None or not slot.strategy.omits_unchanged:
                raise AccumulationError(
                    f"the sender left an unchanged {OVERRIDE_KEYS_PATH} off the wire for this request, but this "
                    "receiver holds none: it lost it (restarted, or the request was released mid-stream). Release "
                    "the request and re-send it from its first chunk",
                    request_id=req_id,
                    key=OVERRIDE_KEYS_PATH,
                )
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
        strategy, spec, acc = self._key_state(st, req_id, path, value, "new_accumulator", like)
        return _Slot(path, strategy, spec, acc)

    def _check(self, req_id: str, st: _Request, slot: _Slot, value: Any) -> None:
        try:
            slot.acc.check(value)
        except Exception as e:  # noqa: BLE001 - MergeError, or a strategy bug: fails this request only
            raise check_error(req_id, st, slot, e) from e

    def _merge_known(self, req_id: str, st: _Request, wire: Mapping[str, Any]) -> bool:
        """The steady-state path of :meth:`merge`: False (nothing done) unless every key of ``wire`` already has a slot.

        It also declines an empty group, a chunk that resets keys (``meta.override_keys`` on the
        wire, or left off it by a send_once-like strategy: a negative count), a wire marker this
        receiver cannot cover, or a policy with a memory guard: :meth:`_plan` and :meth:`_apply`
        handle those (and word their errors). Otherwise it does what they would do for known keys
        (check every value, then merge every value, with the same errors) without building a plan.
        """
        policy = self.policy
        if policy.max_bytes_per_request:
            return False
        entries = st.entries
        marked = WIRE_MARKER in wire
        if marked:
            need = wire[WIRE_MARKER]
            # negative: an override list left off still applies, and _plan resets its keys
            if type(need) is not int or need < 0 or need > st.held_once:
                return False
        if policy.honor_override_keys:
            meta = wire.get("meta")
            if isinstance(meta, dict) and "override_keys" in meta:
                return False
        pairs: list[tuple[_Slot, Any]] = []
        for top, value in wire.items():
            if marked and top == WIRE_MARKER:
                continue
            e = entries.get(top)
            if isinstance(value, dict):
                if type(e) is not dict or not value:
                    return False
                for qual, qv in value.items():
                    slot = e.get(qual)
                    if slot is None:
                        return False
                    pairs.append((slot, qv))
            elif type(e) is _Slot:
                pairs.append((e, value))
            else:  # a new key, or a leaf where a group was
                return False
        # One try around each loop (not a helper call per key): this runs for every chunk of every request.
        try:
            for slot, value in pairs:
                slot.acc.check(value)
        except Exception as e:  # noqa: BLE001 - MergeError, or a strategy bug: fails this request only
            raise check_error(req_id, st, slot, e) from e
        try:
            for slot, value in pairs:
                slot.acc.merge_checked(value)
        except Exception as e:  # noqa: BLE001
            raise merge_error(req_id, st, slot, e) from e
        if self.on_merge is not None:
            self.on_merge(pairs)
        return True

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
                    self._check(req_id, st, slot, qv)  # first values too: every key before any merge
                    ops.append((top, qual, qv, slot))
            else:
                slot = entries.get(top)
                if type(slot) is not _Slot:
                    slot = self._new_slot(req_id, st, _path(top), value)
                    new_once += slot.strategy.omits_unchanged
                elif top in override and _resets_on_override(slot):
                    slot = self._new_slot(req_id, st, slot.path, value, like=slot)
                self._check(req_id, st, slot, value)
                ops.append((top, LEAF, value, slot))
        marked = WIRE_MARKER in wire
        need = wire[WIRE_MARKER] if marked else None
        if marked and type(need) is not int:
            raise AccumulationError(
                f"malformed wire marker {WIRE_MARKER!r}: expected a count (an int), got {need!r}", request_id=req_id
            )
        if marked and st.held_once + new_once < abs(need):
            raise AccumulationError(
                f"the sender left unchanged send_once values off the wire for this request, counting on {abs(need)} "
                f"held here, but this receiver holds {st.held_once + new_once}: it lost them (restarted, or the "
                "request was released mid-stream). Release the request and re-send it from its first chunk",
                request_id=req_id,
            )
        limit = self.policy.max_bytes_per_request
        if limit:
            self._guard(req_id, st, ops, limit)
        return ops

    def _guard(self, req_id: str, st: _Request, ops: list[tuple[Any, Any, Any, _Slot]], limit: int) -> None:
        """Refuse the chunk when the state would hold more than ``limit`` bytes once merged.

        Starts from what every key holds now (live: a read may have cached a concatenation since the last chunk);
        each touched key then counts what it would hold after the merge (:meth:`Accumulator.projected_nbytes`: a
        ``prealloc`` buffer's grown capacity, a ``token_list``'s cached concatenation) instead of what it holds, and
        a leaf a group replaces (or the reverse) counts nothing. The check runs before anything is allocated."""
        entries = st.entries
        held: dict[int, int] = {}
        for s in _iter_slots(entries):
            try:
                held[id(s)] = s.acc.nbytes()
            except Exception as e:  # noqa: BLE001 - a strategy bug fails this request only, as a raising check does
                raise check_error(req_id, st, s, e, "nbytes") from e
        after = sum(held.values())
        gone: set[int] = set()

        def drop(entry: Any) -> int:  # bytes of a slot or group the chunk replaces, counted once
            freed = 0
            for s in [entry] if type(entry) is _Slot else entry.values():
                if id(s) not in gone:
                    gone.add(id(s))
                    freed += held[id(s)]
            return freed

        worst: tuple[int, str] = (0, "")
        big: _Slot | None = None  # the key that grows most: the error names it, its strategy and plugin
        for top, qual, value, slot in ops:
            old_top = entries.get(top)
            if slot is None:  # an empty group: it replaces a leaf, keeps a group
                if type(old_top) is _Slot:
                    after -= drop(old_top)
                continue
            if qual is LEAF:
                now = drop(old_top) if old_top is not None else 0  # the leaf itself, or the group it replaces
            elif type(old_top) is _Slot:  # a leaf turns into a group
                after -= drop(old_top)
                now = 0
            else:
                old = old_top.get(qual) if isinstance(old_top, dict) else None
                now = drop(old) if old is not None else 0
            try:
                proj = slot.acc.projected_nbytes(value)
            except Exception as e:  # noqa: BLE001 - a strategy bug fails this request only
                raise slot_error(f"projected_nbytes raised {type(e).__name__}: {e}", req_id, slot) from e
            after += proj - now
            if (proj - now, slot.path) > worst:
                worst, big = (proj - now, slot.path), slot
        if after > limit:
            msg = (
                f"would hold {after} bytes after this chunk (key {worst[1]!r} grows by {worst[0]}), over "
                f"max_bytes_per_request={limit}; chunk rejected before allocating (state unchanged)"
            )
            raise slot_error(msg, req_id, big) if big is not None else AccumulationError(msg, request_id=req_id)

    def _apply(self, req_id: str, st: _Request, ops: list[tuple[Any, Any, Any, _Slot]]) -> None:
        """Phase 2: merge every planned value; a new key's first read is checked (:func:`check_first_read`)."""
        entries = st.entries
        for top, qual, value, slot in ops:
            if slot is None:  # an empty group
                if not isinstance(entries.get(top), dict):
                    st.held_once -= _held_once(entries.get(top))
                    entries[top] = {}
                continue
            self._merge_one(req_id, st, slot, value)
            if qual is LEAF:
                old = entries.get(top)
                if old is not slot:
                    check_first_read(req_id, st, slot, value)
                    st.held_once += slot.strategy.omits_unchanged - _held_once(old)
                    entries[top] = slot
            else:
                group = entries.get(top)
                if not isinstance(group, dict):
                    st.held_once -= _held_once(group)
                    group = entries[top] = {}
                old = group.get(qual)
                if old is not slot:
                    check_first_read(req_id, st, slot, value)
                    st.held_once += slot.strategy.omits_unchanged - _held_once(old)
                    group[qual] = slot
        if self.on_merge is not None:
            self.on_merge([(slot, value) for _, _, value, slot in ops if slot is not None])

    @staticmethod
    def _merge_one(req_id: str, st: _Request, slot: _Slot, value: Any) -> None:
        """Merge one checked value; a failure marks the request failed (earlier keys may be merged)."""
        try:
            slot.acc.merge_checked(value)
        except Exception as e:  # noqa: BLE001 - MergeError, or a strategy bug: fails this request only
            raise merge_error(req_id, st, slot, e) from e


def _override_left_off(wire: Mapping[str, Any]) -> bool:
    """True when the wire marker says an unchanged ``meta.override_keys`` was left off (a negative count)."""
    need = wire.get(WIRE_MARKER)
    return type(need) is int and need < 0
