"""Receive side of the scheduler's adapter: ``_commit_received_chunk`` and receiver release.

The adapter hands each chunk's raw values over (0.30.0 keeps no accumulated store there). The hook
puts back the ``send_once`` values the sender left off (from what the binding's Receiver holds) and,
for an AR receiver, replaces the adapter keys (``embed.prefill``, ``hidden_states.output``: chunked
prefill) by their accumulated view. A chunk omni-accum refuses is handed over as 0.30.0 would
(:func:`adapter_fallback`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from omni_accum.engine import WIRE_MARKER
from omni_accum.errors import AccumulationError
from omni_accum.integrations.vllm_omni import ab, capture, handoff
from omni_accum.integrations.vllm_omni.binding import Binding, _leaves, _path, binding_for
from omni_accum.integrations.vllm_omni.marker import MARKERS, OMITTED_KEY, count_bits, number_once, split_mask
from omni_accum.integrations.vllm_omni.peer import announce, keep_hello

logger = logging.getLogger("omni_accum.vllm_omni")


def adapter_receive(b: Binding, req_id: str, payload: dict[str, Any], ar: bool) -> dict[str, Any]:
    """The delta an adapter hands over: raw wire values, with send_once values the sender left off
    restored, and (AR) the adapter keys replaced by their accumulated view. A request sent under
    another policy (the handshake) gets :func:`foreign_receive`."""
    if not b.accept(req_id, payload, req_id not in b.held_once) or req_id in b.mirror:
        return foreign_receive(b, req_id, payload)  # another policy's, or one omni-accum gave up (adapter_fallback)
    ctx = b.context_of(req_id)
    raw = payload.get(OMITTED_KEY) or 0
    mask, override = split_mask(raw)
    table = b.held_once.setdefault(req_id, {})
    omitted = [p for p, bit in table.items() if mask >> bit & 1]
    if mask >> len(table):
        raise AccumulationError(
            f"the sender left send_once values off the wire (mask {raw!r}) that this receiver never received "
            f"(it holds {len(table)}); release the request and re-send it from its first chunk",
            request_id=req_id,
        )
    sub: dict[str, Any] = {}
    views: list[tuple[Any, Any]] = []
    rec = b.metrics
    # The hook armed the recorder: this pass counts the keys (then the merge does not count them again).
    meters = rec.meters("receive") if rec.armed else None
    first = None
    for top, qual, value in _leaves(payload):
        tq = (top, qual)
        if tq not in table:  # number_once, in this pass
            table[tq] = len(table)
        if meters is not None:
            m = meters.get(tq)
            if m is None or m[2] is not type(value):
                m = rec.meter(meters, "receive", tq, value, b.strategy_name)
            m[0] += 1
            if m[3]:
                m[1] += value.nbytes
            if first is None:
                first = m[6]
        merge, view = b.tracks(_path(top, qual), value, ar, ctx)
        if merge:
            if qual is None:
                sub[top] = value
            else:
                sub.setdefault(top, {})[qual] = value
            if view:
                views.append(tq)
    if meters is not None:
        rec.armed, rec.first = False, first or "replace"
    meta = payload.get("meta")
    if isinstance(meta, dict) and "override_keys" in meta:
        sub.setdefault("meta", {})["override_keys"] = meta["override_keys"]
    if mask:  # negative: the override list the sender left off still applies
        sub[WIRE_MARKER] = -count_bits(mask) if override else count_bits(mask)
    if not sub and not mask:
        return payload if OMITTED_KEY not in payload else _stripped(payload)
    view = b.receiver.merge(req_id, sub) if sub else b.receiver.view(req_id)
    out = _stripped(payload)
    for path in [*views, *omitted]:
        top, qual = path
        if qual is None:
            out[top] = view[top]
        else:
            out.setdefault(top, {})[qual] = view[top][qual]
    return out


def _stripped(payload: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``payload`` without omni-accum's wire markers (groups copied, values shared)."""
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in payload.items() if k not in MARKERS}


def foreign_receive(b: Binding, req_id: str, payload: dict[str, Any]) -> dict[str, Any]:
    """What 0.30.0's adapter hands over for a request sent under another policy: the raw values, with the
    ones the sender left off put back from the latest value seen for that key (what a 0.30.0 sender would
    have sent again). Nothing is accumulated."""
    try:
        mask, _ = split_mask(payload.get(OMITTED_KEY) or 0)
    except AccumulationError:
        mask = 0
    table = b.held_once.setdefault(req_id, {})
    mirror = b.mirror.setdefault(req_id, {})
    omitted = [p for p, bit in table.items() if mask >> bit & 1]
    number_once(table, payload)
    out = _stripped(payload)
    ours = req_id not in b.foreign  # given up (adapter_fallback): only what this policy may leave off is kept
    for top, qual, value in _leaves(payload):
        if not ours or _may_leave_off(b, req_id, top, qual, value):
            mirror[(top, qual)] = value
    lost = []
    for top, qual in omitted:
        if (top, qual) in mirror:
            _set(out, top, qual, mirror[(top, qual)])
        else:
            lost.append(_path(top, qual))
    _say_lost(b, req_id, lost)
    return out


def _may_leave_off(b: Binding, req_id: str, top: Any, qual: Any, value: Any) -> bool:
    """Whether the sender may leave key ``top.qual`` off a later chunk under this binding's policy (``send_once``);
    True when its selection raises (a value that may be left off is never dropped)."""
    try:
        return b.receiver.select(_path(top, qual), value, b.context_of(req_id))[0].omits_unchanged
    except Exception:  # noqa: BLE001 - a plugin's selection raising
        return True


def _say_lost(b: Binding, req_id: str, lost: list[str]) -> None:
    """Warn (once per request, until it is released) that a chunk is handed over without values the sender left off."""
    if lost and req_id not in b.said_lost:
        b.said_lost.add(req_id)
        logger.warning(
            "omni-accum: request %r: the sender left %s off the wire and this receiver no longer holds them; the "
            "chunk is handed over without them (not logged again for this request)",
            req_id,
            ", ".join(lost),
        )


def _get(d: Mapping[Any, Any], top: Any, qual: Any) -> tuple[bool, Any]:
    if qual is None:
        return (top in d, d.get(top))
    sub = d.get(top)
    return (True, sub[qual]) if isinstance(sub, Mapping) and qual in sub else (False, None)


def _set(d: dict[Any, Any], top: Any, qual: Any, value: Any) -> None:
    if qual is None:
        d[top] = value
    else:
        sub = d.get(top)
        d[top] = sub = dict(sub) if isinstance(sub, Mapping) else {}
        sub[qual] = value


def upstream_merge(old: Any, new: Any) -> Any:
    """vllm-omni 0.30.0's ``_accumulate_payload`` rule for one key: ``torch.cat`` (which promotes dtypes
    and takes a legacy empty tensor), lists extended, anything else replaced."""
    if isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor):
        return torch.cat([old, new], dim=0)
    if isinstance(new, list) and isinstance(old, list):
        return old + new
    return new


def _override_set(payload: Mapping[str, Any]) -> set[Any]:
    meta = payload.get("meta")
    raw = meta.get("override_keys") if isinstance(meta, Mapping) else None
    try:
        return {tuple(k) if isinstance(k, list) else k for k in raw} if isinstance(raw, (list, tuple)) else set()
    except TypeError:
        return set()


def adapter_fallback(b: Binding, req_id: str, payload: dict[str, Any], ar: bool, error: AccumulationError) -> dict:
    """What a receiving adapter hands over when omni-accum refused a chunk (:func:`adapter_receive` raised).

    0.30.0's adapter keeps no accumulated store: it hands the chunk's raw values over. So does this,
    with the send_once values the sender left off put back from what the Receiver held (what a 0.30.0
    sender would have sent again), and for an accumulated adapter key (AR) the view it handed over
    last merged with the chunk by 0.30.0's own rule (:func:`upstream_merge`: ``torch.cat``; the raw
    value when even that fails, or when the chunk overrides the key). The request's Receiver state is
    then released and re-seeded from what was handed over, so later chunks (and the values they
    leave off) go on through omni-accum. When that re-seed fails too (the byte guard refuses the whole
    view, a plugin's selection raises), omni-accum gives the request up: nothing of it stays in the
    Receiver, and it is handed over as 0.30.0 does until it is released (:func:`foreign_receive`), the
    values the sender may leave off kept beside (``Binding.mirror``). Never raises.
    """
    try:
        prev = b.receiver.view(req_id).to_dict()
    except Exception:  # noqa: BLE001 - none held (a refused first chunk), or a request failed earlier
        prev = {}
    b.fall_back(req_id, error, "the adapter receive hook (_commit_received_chunk)")  # releases the Receiver state
    try:
        mask, _ = split_mask(payload.get(OMITTED_KEY) or 0)
    except AccumulationError:
        mask = 0
    table = b.held_once.setdefault(req_id, {})
    out = _stripped(payload)
    lost = []
    for (top, qual), bit in table.items():
        if mask >> bit & 1:
            held, value = _get(prev, top, qual)
            if held:
                _set(out, top, qual, value)
            else:
                lost.append(_path(top, qual))
    _say_lost(b, req_id, lost)
    overridden = _override_set(out)
    seed = {k: (dict(v) if isinstance(v, dict) else v) for k, v in prev.items()}
    complete = True  # every key of the chunk classified: the seed holds all a later chunk may leave off
    for top, qual, value in list(_leaves(out)):
        try:
            merge, view = b.tracks(_path(top, qual), value, ar)
        except Exception:  # noqa: BLE001 - a plugin's selection raising: that key cannot be re-seeded
            complete = False
            continue
        if not merge:
            continue
        if view and (top if qual is None else (top, qual)) not in overridden:
            held, old = _get(prev, top, qual)
            if held:
                try:
                    value = upstream_merge(old, value)
                except (RuntimeError, TypeError):
                    pass  # the raw value, as 0.30.0 hands it over; the key starts again from it
                else:
                    _set(out, top, qual, value)
        _set(seed, top, qual, value)
    meta = out.get("meta")
    if isinstance(meta, dict) and "override_keys" in meta:
        _set(seed, "meta", "override_keys", meta["override_keys"])
    number_once(table, payload)
    why = None if complete else "a key's strategy selection raised"
    if why is None and seed:
        try:
            b.receiver.merge(req_id, seed)
        except Exception as e:  # noqa: BLE001 - the byte guard, a plugin raising: give the request up
            why = str(e)
    if why is not None:
        _give_up(b, req_id, prev, out, why)
    return out


def _give_up(b: Binding, req_id: str, prev: Mapping[str, Any], out: Mapping[str, Any], why: str) -> None:
    """Request ``req_id`` could not be re-seeded: release it, and keep what the sender may leave off later (the
    ``send_once`` values held before the chunk, then those of the chunk just handed over) for :func:`foreign_receive`.
    Only those: the accumulated views (what the byte guard refused to hold) are not kept."""
    try:
        b.receiver.release(req_id)
    except Exception:  # noqa: BLE001 - nothing held
        pass
    mirror = b.mirror.setdefault(req_id, {})
    for source in (prev, out):
        for top, qual, value in _leaves(source):
            if _may_leave_off(b, req_id, top, qual, value):
                mirror[(top, qual)] = value
    logger.warning(
        "omni-accum: request %r: its state could not be re-seeded after the refused chunk (%s); vllm-omni 0.30.0's "
        "own code hands its chunks over until it is released, the values the sender leaves off put back from the "
        "last ones seen",
        req_id,
        why,
    )


def _as_refusal(e: Exception, req_id: str) -> AccumulationError:
    """``e`` as the refusal :meth:`.Binding.fall_back` reports (an error of omni-accum's or a plugin's bug)."""
    if isinstance(e, AccumulationError):
        return e
    err = AccumulationError(f"{type(e).__name__}: {e}", request_id=req_id)
    err.__cause__ = e
    return err


def wrap_commit(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def _commit_received_chunk(
        self: Any, request: Any, result: Any, *, stage_id: int, req_id: str, chunk_id: int, connector_get_key: str
    ) -> bool:
        b = binding_for(self)
        payload = result[0] if isinstance(result, tuple) else None
        if b is not None and isinstance(payload, dict) and payload:
            if not b.stats["chunks_received"]:
                announce(self, b)  # an adapter made before omni-accum was installed says hello now (.peer)
            else:
                keep_hello(self, b)  # said again if another replica of the stage withdrew it (.peer)
            if b.arms is not None:  # an A/B split: the arm the sender announced, else the id's (.ab)
                if "_capture" not in b.__dict__:
                    capture.attach(b, self)
                b = ab.receive_arm(b, self, req_id, payload, connector_get_key)
            b.stats["chunks_received"] += 1
            ar = self.model_mode == "ar"
            new = req_id not in b.held_once
            t0 = time.perf_counter()
            rec = b.metrics
            rec.arm()  # adapter_receive's own pass over the keys counts them
            try:
                handed = adapter_receive(b, req_id, payload, ar)
                counted = rec.on and not rec.armed
            except Exception as e:  # noqa: BLE001 - a refusal, or a plugin raising: never into vllm-omni
                counted = rec.on and not rec.armed  # refused after its pass counted the keys, or before
                rec.armed = False  # the fallback's re-seeding merge is not this chunk
                handed = adapter_fallback(b, req_id, payload, ar, _as_refusal(e, req_id))
            # the merge's time ends here, as on the runner path: the hand-off bookkeeping and the capture's writing
            # below are not the merge (omni_accum_merge_seconds, the A/B merge histogram)
            seconds = time.perf_counter() - t0
            rec.armed = False
            raw = payload.get(OMITTED_KEY)
            if raw.__class__ is list:  # maybe timed: merged and readable now (.handoff)
                handoff.arrived(b, stage_id, raw, payload)
                if b.arm is not None:
                    ab.arrived(b, stage_id, raw)
            cap = b.__dict__.get("_capture", False)
            if cap is False:
                cap = capture.attach(b, self)  # OMNI_ACCUM_CAPTURE / the extra's omni_accum_capture (.capture)
            if cap is not None:
                capture.received(cap, self, req_id, payload, raw)
            if counted and not new:  # the steady path: only the time is left to record
                rec.timed(seconds)
            else:
                b.received(payload, seconds, new, req_id, counted=counted)
            result = (handed, result[1])
        return orig(
            self,
            request,
            result,
            stage_id=stage_id,
            req_id=req_id,
            chunk_id=chunk_id,
            connector_get_key=connector_get_key,
        )

    return _commit_received_chunk


def wrap_clear_receiver(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def _clear_receiver_state_locked(self: Any, request_id: str) -> None:
        orig(self, request_id)
        b = binding_for(self)
        if b is not None:
            b.forget(request_id)
            capture.released(b, request_id, "recv")

    return _clear_receiver_state_locked
