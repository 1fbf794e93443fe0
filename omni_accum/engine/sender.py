"""The sender side of the engine: :class:`Sender` turns payload chunks into their wire form."""

from __future__ import annotations

from collections.abc import Mapping
from itertools import repeat
from typing import Any

from omni_accum.context import StreamContext
from omni_accum.engine.endpoint import LEAF, WIRE_MARKER, _Endpoint, _path, _Request
from omni_accum.errors import AccumulationError
from omni_accum.strategy import OMIT, Encoder


_DICT = repeat(dict)  # second argument of isinstance for map(); repeat() never runs out


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
        left empty is dropped; the wire then carries :data:`WIRE_MARKER` (a negative count when one
        of the keys left off is ``meta.override_keys``, whose list still applies to the chunk).
        """
        if not isinstance(chunk, (dict, Mapping)):
            raise AccumulationError(f"a payload chunk must be a mapping, got {type(chunk).__name__}", request_id=req_id)
        if WIRE_MARKER in chunk:
            raise AccumulationError(
                f"a payload chunk may not use the key {WIRE_MARKER!r}: omni-accum reserves it for its wire marker",
                request_id=req_id,
                key=WIRE_MARKER,
            )
        st, made = self._state(req_id, context)
        plain = st.plain
        # Steady state of a chunk whose keys are all known leaves without an encoder: the chunk itself.
        if plain and st.failed is None and plain.issuperset(chunk) and not any(map(isinstance, chunk.values(), _DICT)):
            return chunk
        with st.lock:
            if st.failed is not None:
                raise AccumulationError(f"request failed earlier ({st.failed}); release it", request_id=req_id)
            encs = st.entries
            any_enc = False
            try:
                for top, value in chunk.items():
                    if isinstance(value, dict):
                        if plain and top in plain:
                            st.plain = plain = plain - {top}
                        group = encs.get(top)
                        if not isinstance(group, dict):
                            if top in encs:  # a leaf becomes a group: the receiver drops the leaf too
                                _forget(st, top, LEAF)
                            group = encs[top] = {}
                        for qual, qv in value.items():
                            enc = group.get(qual, OMIT)
                            if enc is OMIT:
                                enc = group[qual] = self._new_encoder(st, req_id, top, qual, qv)
                            any_enc = any_enc or enc is not None
                    else:
                        enc = encs.get(top, OMIT)
                        if enc is OMIT or isinstance(enc, dict):
                            if enc is not OMIT:  # a group becomes a leaf: the receiver drops the group too
                                for qual in enc:
                                    _forget(st, top, qual)
                            enc = encs[top] = self._new_encoder(st, req_id, top, LEAF, value)
                        any_enc = any_enc or enc is not None
            except AccumulationError:
                if made and st.failed is None:  # a first chunk refused before anything went on the wire
                    self._forget_new(req_id, st)  # leaves no request behind
                raise
            if not any_enc:
                leaves = [top for top, value in chunk.items() if not isinstance(value, dict)]
                if leaves:
                    st.plain = (plain or frozenset()).union(leaves)
                return chunk
            try:
                return self._encode_with(st, req_id, chunk)
            except AccumulationError as e:
                # Encoders before the failing one already recorded this chunk as sent: a later chunk
                # encoded against that state would give the receiver a wrong view. Fail the request.
                st.failed = f"key {e.key!r}: {e.reason}"
                raise

    def _new_encoder(self, st: _Request, req_id: str, top: Any, qual: Any, value: Any) -> Encoder | None:
        path = _path(top, qual)
        strategy, spec, enc = self._key_state(st, req_id, path, value, "new_encoder")
        if enc is not None:
            st.enc_specs[path] = spec
            if strategy.omits_unchanged:
                st.once[(top, qual)] = False  # counted once its first value is on the wire
        return enc

    def _encode_one(self, enc: Encoder | None, value: Any, req_id: str, top: Any, qual: Any, st: _Request) -> Any:
        if enc is None:
            return value
        try:
            return enc.encode(value)
        except Exception as e:  # noqa: BLE001 - a strategy bug fails this request only
            path = _path(top, qual)
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
        override_omitted = False
        for top, value in chunk.items():
            if isinstance(value, dict):
                group = st.entries[top]
                sub = {}
                for qual, qv in value.items():
                    enc = group[qual]
                    w = qv if enc is None else self._encode_one(enc, qv, req_id, top, qual, st)
                    if w is OMIT:
                        if (top, qual) not in st.once:
                            raise _omit_refused(st, req_id, top, qual)
                        omitted += 1
                        override_omitted = override_omitted or (top == "meta" and qual == "override_keys")
                    else:
                        sub[qual] = w
                        if st.once.get((top, qual)) is False:
                            st.once[(top, qual)] = True
                            st.held_once += 1
                if sub or not value:
                    out[top] = sub
            else:
                enc = st.entries[top]
                w = value if enc is None else self._encode_one(enc, value, req_id, top, LEAF, st)
                if w is OMIT:
                    if (top, LEAF) not in st.once:
                        raise _omit_refused(st, req_id, top, LEAF)
                    omitted += 1
                else:
                    out[top] = w
                    if st.once.get((top, LEAF)) is False:
                        st.once[(top, LEAF)] = True
                        st.held_once += 1
        if omitted:  # negative: the override list left off still applies (see WIRE_MARKER)
            out[WIRE_MARKER] = -st.held_once if override_omitted else st.held_once
        return out


def _omit_refused(st: _Request, req_id: str, top: Any, qual: Any) -> AccumulationError:
    """OMIT from the encoder of a strategy that does not declare ``omits_unchanged``: refused, because only for such a
    strategy does the wire marker count the values held, so a receiver that lost its state (restarted, released)
    can tell and fail the request, instead of serving a view without the key."""
    path = _path(top, qual)
    spec = st.enc_specs.get(path)
    name, plugin = (spec.name, spec.plugin) if spec else (None, None)
    return AccumulationError(
        "the encoder returned OMIT but the strategy does not declare omits_unchanged, so a receiver that lost this "
        "key's value could not tell and would serve a view without it; set omits_unchanged = True on the Strategy "
        "class (not on the Encoder), or make the encoder return the value",
        request_id=req_id,
        key=path,
        strategy=name,
        plugin=plugin,
    )


def _forget(st: _Request, top: Any, qual: Any) -> None:
    """Drop a send_once-like key the chunk replaces (a leaf by a group, or the reverse), as the receiver does."""
    if st.once.pop((top, qual), False):
        st.held_once -= 1
