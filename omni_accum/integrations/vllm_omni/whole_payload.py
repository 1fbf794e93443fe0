"""Receive side of vllm-omni 0.16's chunk transfer adapter: ``_update_request_payload`` and ``cleanup``.

0.16.0's receiving adapter keeps the whole accumulated payload of a request (``request_payload``,
keyed by the external request id) and, on every chunk, ``torch.cat``-s each tensor key with what it
held (lists are joined with ``+``); ``finished`` and every other value are taken as they come, and
a key the chunk does not carry is dropped. The chunk dict itself becomes the accumulated payload
(updated in place: the caller hands that same dict to the scheduler as the request's
``additional_information``). On Qwen3-Omni that is the whole ``thinker_embeddings`` ``[P+t, H]``
copied on every decode step.

The wrapper keeps that contract and moves the tensor and list keys through the binding's
:class:`~omni_accum.engine.Receiver`: under ``cat`` (the ``default`` policy) the same values as
0.16.0, under ``prealloc`` a row copy into a preallocated buffer whose prefix is handed over (a
tensor, as the talker reads it). Upstream's dict stays the store of record: a request whose held
keys differ from the chunk's (0.16 drops the keys a chunk does not carry) is re-seeded from it, and
a chunk omni-accum refuses is handed to 0.16.0's own code.

0.16.0's AR scheduler calls the adapter's ``cleanup`` only after a failed KV load, so a talker never releases a
request: 0.16.0 keeps each finished request's accumulated rows for the process's life (its own leak), and the
binding kept its Receiver state beside them; under ``prealloc`` that pinned a buffer of twice the prompt's rows
per request instead of 0.16.0's tight ``[P+t, H]``. :func:`track_ends` notes when the scheduler has let a request
go (its ``Request`` object collected) and :func:`compact_ended`, at the next scheduler step, gives upstream's entry
tight copies of the tensors omni-accum handed over (the same values: what 0.16.0 would hold) and releases the
Receiver's state: memory and ``live_requests`` then follow 0.16.0's own, one request late at most (0.16.0's receive
loop keeps the last request it polled in a local variable until it polls another, and an idle engine core makes no
scheduler step). The copy is one pass over the request's rows on the scheduler thread (~33 MB at 8k, ~131 MB at 32k),
once per request.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from omni_accum.errors import AccumulationError
from omni_accum.integrations.vllm_omni.binding import Binding, binding_for
from omni_accum.integrations.vllm_omni.publishing import published_later

#: The key 0.16.0's adapter never accumulates (a 0-d bool tensor: the request's last chunk).
FINISHED = "finished"
#: Seconds between publications of a binding's metrics and status from this hook. 0.16.0's AR scheduler
#: calls the adapter's ``cleanup`` only for a request whose KV load failed, so a talker's requests are
#: never released (upstream keeps their ``request_payload`` too) and the release that publishes on the
#: later families never comes; a talker that stops at its token cap reads fewer than the metrics' 256
#: chunks of a flush per request. Published from here instead: a request's first and last chunk and
#: at most this often in between (a time read the hook makes anyway).
PUBLISH_EVERY_S = 1.0
#: Binding attribute: the external ids of the requests 0.16.0's scheduler has let go, for :func:`compact_ended`.
ENDED_ATTR = "_omni_accum_ended"
#: Request attribute (scheduler side): the ended list of the binding that watches it (:func:`track_ends`; a binding
#: made afresh, after a reinstall, watches it again).
TRACKED_ATTR = "_omni_accum_end_tracked"


def _kind(value: Any) -> type | None:
    if isinstance(value, torch.Tensor):
        return torch.Tensor
    if isinstance(value, list):
        return list
    return None


def _held_keys(b: Binding, req_id: str) -> set[Any]:
    try:
        return set(b.receiver.view(req_id).keys())
    except KeyError:
        return set()


def _plan(b: Binding, req_id: str, origin: dict[str, Any] | None, chunk: dict[str, Any]) -> list[str] | None:
    """The keys of ``chunk`` the Receiver accumulates, after aligning what it holds with upstream's
    ``origin`` (None: the request's first chunk). None: a key whose kind changes, which 0.16.0 alone
    handles (its ``torch.cat`` of a list, say)."""
    keys = [k for k, v in chunk.items() if k != FINISHED and _kind(v) is not None]
    if origin is None:
        b.receiver.release(req_id)  # upstream starts afresh here too
        return keys
    carried = [k for k in keys if k in origin]
    if any(_kind(origin[k]) is not _kind(chunk[k]) for k in carried):
        return None
    if _held_keys(b, req_id) != set(carried):  # 0.16 dropped keys the last chunk lacked, or a fallback ran
        b.receiver.release(req_id)
        if carried:
            b.receiver.merge(req_id, {k: origin[k] for k in carried})
    return keys


def _finished(chunk: dict[str, Any]) -> bool:
    """The chunk says it is the request's last (``finished``: a bool or a one-element tensor)."""
    v = chunk.get(FINISHED)
    try:
        return bool(v) if v is not None else False
    except (RuntimeError, ValueError):  # a tensor of several elements: not a flag
        return False


def wrap_update_payload(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def _update_request_payload(self: Any, req_id: str, payload_data: dict[str, Any]) -> dict[str, Any]:
        b = binding_for(self)
        store = getattr(self, "request_payload", None)
        if b is None or not isinstance(payload_data, dict) or not isinstance(store, dict):
            return orig(self, req_id, payload_data)
        b.stats["chunks_received"] += 1
        origin = store.get(req_id) if req_id in store else None
        new = origin is None
        if not new and not isinstance(origin, dict):
            return orig(self, req_id, payload_data)
        incoming = dict(payload_data)
        t0 = time.perf_counter()
        try:
            keys = _plan(b, req_id, origin, payload_data)
            if keys is None:
                b.receiver.release(req_id)
                return orig(self, req_id, payload_data)
            view = b.receiver.merge(req_id, {k: payload_data[k] for k in keys}) if keys else None
            for k in keys:
                payload_data[k] = view[k]  # type: ignore[index]
        except AccumulationError as e:
            # 0.16.0 takes this chunk (torch.cat promotes dtypes) or raises where it raises: its own code, on its
            # own store (untouched so far); the next chunk re-seeds from it.
            for k, v in incoming.items():
                payload_data[k] = v
            b.fall_back(req_id, e, f"{type(self).__name__}._update_request_payload")
            return orig(self, req_id, payload_data)
        if not keys:
            b.receiver.release(req_id)
        store[req_id] = payload_data
        t1 = time.perf_counter()
        b.received(incoming, t1 - t0, new, req_id)
        state = b.__dict__
        if new or t1 - state.get("_published_at", 0.0) >= PUBLISH_EVERY_S or _finished(incoming):
            state["_published_at"] = t1
            published_later(b)
        return payload_data

    return _update_request_payload


def wrap_cleanup(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def cleanup(self: Any, request_id: str, external_req_id: str | None = None) -> None:
        ext = external_req_id
        if ext is None:  # as 0.16.0 looks it up (its mapping entry is gone afterwards)
            ext = getattr(self, "request_ids_mapping", {}).get(request_id, request_id)
        orig(self, request_id, external_req_id)
        b = binding_for(self)
        if b is not None:
            b.forget(ext)  # the receive side is keyed by the external id, like request_payload

    return cleanup


def track_ends(b: Binding, adapter: Any, requests: Any) -> None:
    """Each of the scheduler's ``requests`` (request id -> ``Request``), once: when its ``Request`` is collected
    (0.16.0's scheduler is done with it), its external id goes on the binding's list for :func:`compact_ended`. The
    finalizer only appends to a deque: it runs wherever the collector does, so it takes no lock."""
    ended = b.__dict__.get(ENDED_ATTR)
    if ended is None:
        ended = b.__dict__.setdefault(ENDED_ATTR, deque())
    mapping = getattr(adapter, "request_ids_mapping", None) or {}
    for rid, req in list(requests.items()):
        state = getattr(req, "__dict__", None)
        if state is None or state.get(TRACKED_ATTR) is ended:
            continue
        state[TRACKED_ATTR] = ended
        ext = mapping.get(rid) or getattr(req, "external_req_id", None) or rid
        try:
            weakref.finalize(req, ended.append, ext)
        except TypeError:  # not weakly referable: its entry stays as it is
            pass


def compact_ended(b: Binding, adapter: Any) -> None:
    """The requests the scheduler has let go since the last step (:func:`track_ends`): upstream's entry gets tight
    copies of the tensors that are views of a larger buffer (omni-accum's, handed over), and the Receiver's state
    of the request is released (its buffer back to the pool or freed)."""
    ended = b.__dict__.get(ENDED_ATTR)
    if not ended:
        return
    store = getattr(adapter, "request_payload", None)
    while ended:
        try:
            ext = ended.popleft()
        except IndexError:
            break
        entry = store.get(ext) if isinstance(store, dict) else None
        if isinstance(entry, dict):
            for k, v in list(entry.items()):
                if isinstance(v, torch.Tensor) and v.untyped_storage().nbytes() > v.nbytes:
                    entry[k] = v.clone()
        b.forget(ext)
