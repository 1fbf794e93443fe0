"""Receive side of the runner transports: ``_accumulate_payload`` of the payload transport mixin and of
the MRv2 data plane (0.30), of the runner mixin (0.28); the decode-span merge kept where the release has
it (``decode_spans``: which methods do is in each release family, :mod:`.families`). Upstream's
accumulator dict stays the store of record: the binding's Receiver is synced with it, and popping it
releases the Receiver (:class:`.store.ReleasingDict`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

from omni_accum.engine import WIRE_MARKER
from omni_accum.errors import AccumulationError
from omni_accum.integrations.vllm_omni import handoff
from omni_accum.integrations.vllm_omni.binding import Binding, binding_for
from omni_accum.integrations.vllm_omni.marker import OMITTED_KEY, count_bits, split_mask


def _layout(mapping: Mapping[str, Any]) -> set[tuple[Any, Any]]:
    return {(k, q) for k, v in mapping.items() for q in (v if isinstance(v, Mapping) else (None,))}


def _sync(b: Binding, req_id: str, mirror: Any) -> None:
    """Make the Receiver hold what upstream's accumulator dict holds.

    Upstream mutates its accumulator in place (MRv2 ``pop_local_stage_payload`` drops consumed decode
    rows); when the key layouts differ the Receiver is re-seeded from the dict (no tensor copies).
    """
    if not isinstance(mirror, dict):
        b.receiver.release(req_id)
        return
    try:
        held = _layout(b.receiver.view(req_id))
    except KeyError:
        held = set()
    if held != _layout(mirror):
        b.receiver.release(req_id)
        if mirror:
            b.receiver.merge(req_id, {k: (dict(v) if isinstance(v, dict) else v) for k, v in mirror.items()})


def align_decode_span(b: Binding, req_id: str, wire: dict[str, Any]) -> dict[str, Any]:
    """MRv2: rewrite ``embed.decode`` of a chunk so the strategy append gives upstream's span merge.

    Contiguous spans keep the existing start; overlapping rows are trimmed (a fully duplicate chunk
    drops the decode span); gaps and malformed spans fall through to the generic merge, as upstream.
    """
    from vllm_omni.worker.payload_span import get_tensor_span

    emb = wire.get("embed")
    if not isinstance(emb, dict) or "decode" not in emb:
        return wire
    meta = wire.get("meta")
    raw = meta.get("override_keys", []) if isinstance(meta, dict) else []
    if ("embed", "decode") in {tuple(k) if isinstance(k, list) else k for k in raw}:
        return wire
    try:
        cur = b.receiver.view(req_id)["embed"]
    except (KeyError, TypeError):
        return wire
    if not isinstance(cur, Mapping):  # a flat ``embed`` held: upstream's span rule needs a group
        return wire
    names = {"tensor_key": "decode", "start_key": "decode_token_start", "end_key": "decode_token_end"}
    existing, incoming = get_tensor_span(cur, **names), get_tensor_span(emb, **names)
    if existing is None or incoming is None:
        return wire
    et, es, ee = existing
    it, i_s, ie = incoming
    if it.device != et.device or it.dtype != et.dtype:
        it = it.to(device=et.device, dtype=et.dtype)
    new = dict(emb)
    if i_s == ee:
        new["decode"] = it
        if es != ee:
            new["decode_token_start"] = es
    elif i_s < ee:
        overlap = ee - i_s
        if overlap >= int(it.shape[0]):
            for k in ("decode", "decode_token_start", "decode_token_end"):
                new.pop(k, None)
        else:
            new.update(decode=it[overlap:], decode_token_start=es, decode_token_end=ie)
    else:
        return wire
    return {**wire, "embed": new}


def _upstream_chunk(store: Mapping[str, Any], req_id: str, payload_data: Mapping[str, Any]) -> dict[str, Any]:
    """The chunk as 0.30.0's ``_accumulate_payload`` can take it: the bit mask dropped (the send_once
    values it names are still in upstream's store, which upstream's merge keeps), and an override list
    the sender left off put back from the store."""
    up = {k: v for k, v in payload_data.items() if k != OMITTED_KEY}
    try:
        override = split_mask(payload_data.get(OMITTED_KEY) or 0)[1]
    except AccumulationError:
        override = False
    meta = up.get("meta")
    if override and not (isinstance(meta, Mapping) and "override_keys" in meta):
        held = store.get(req_id)
        held_meta = held.get("meta") if isinstance(held, Mapping) else None
        if isinstance(held_meta, Mapping) and "override_keys" in held_meta:
            up["meta"] = {**(meta if isinstance(meta, Mapping) else {}), "override_keys": held_meta["override_keys"]}
    return up


def wrap_accumulate(orig: Callable[..., Any], *, decode_spans: bool) -> Callable[..., Any]:
    @functools.wraps(orig)
    def _accumulate_payload(self: Any, req_id: str, payload_data: Any) -> Any:
        b = binding_for(self)
        if b is None:
            return orig(self, req_id, payload_data)
        store = self._send_side_request_payload
        b.stats["chunks_received"] += 1
        new = req_id not in store
        if not b.accept(req_id, payload_data, new):  # the stage handshake: another policy sent it
            return orig(self, req_id, _upstream_chunk(store, req_id, payload_data))
        t0 = time.perf_counter()
        try:
            wire = {k: v for k, v in payload_data.items() if k != OMITTED_KEY}
            if OMITTED_KEY in payload_data:
                mask, override = split_mask(payload_data[OMITTED_KEY])
                if mask:  # the engine's marker: held values still apply (negative: the override list too)
                    wire[WIRE_MARKER] = -count_bits(mask) if override else count_bits(mask)
            if req_id in store:
                _sync(b, req_id, store[req_id])
            else:
                b.receiver.release(req_id)  # upstream starts afresh here too
            arm = True
            if decode_spans:
                aligned = align_decode_span(b, req_id, wire)
                arm = aligned is wire  # the merge counts the wire's keys; a rewritten chunk is counted as it came
                wire = aligned
            rec = b.metrics
            if arm:
                rec.arm(t0)  # the merge counts the keys and records its time
            try:
                merged = b.receiver.merge(req_id, wire).to_dict()
            finally:
                counted = arm and rec.on and not rec.armed
                rec.armed = False
        except AccumulationError as e:
            # 0.30.0 takes this chunk (torch.cat promotes dtypes, takes a legacy empty tensor): let it,
            # on upstream's store (which still holds the send_once values left off); the next chunk re-seeds.
            b.fall_back(req_id, e, f"{type(self).__name__}._accumulate_payload")
            return orig(self, req_id, _upstream_chunk(store, req_id, payload_data))
        # the merge's time (when the merge did not record it): the hand-off bookkeeping below is not the merge
        seconds = None if counted else time.perf_counter() - t0
        store[req_id] = merged
        if (raw := payload_data.get(OMITTED_KEY)).__class__ is list:  # maybe timed: merged now (.handoff)
            handoff.arrived(b, getattr(self, "_stage_id", None), raw, payload_data)
        if not counted:
            b.received(payload_data, seconds, new, req_id)
        elif new:  # the merge counted the keys and its time: the request is left
            b.received(payload_data, None, new, req_id, counted=True)
        return dict(merged)

    return _accumulate_payload
