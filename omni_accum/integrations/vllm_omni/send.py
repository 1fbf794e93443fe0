"""Send side: ``OmniChunkTransferAdapter._send_single_request_for_generation`` and sender release.

While the wrapped send runs, the payload the adapter hands to its connector's ``put`` goes through
the binding's :class:`~omni_accum.engine.Sender`: ``send_once`` values unchanged since their last
send are left off, and a small bit mask (:mod:`.marker`) says which. The encoding sits in a wrapper
of the connector's *class* ``put`` (each connector class wrapped once, restored by ``uninstall``),
so no connector instance is changed: code that inspects, mocks or replaces an instance's ``put``
sees exactly what vllm-omni made (a replaced ``put`` that never reaches the class's own method sends
the payload as vllm-omni built it, and the receiver then has nothing to restore).

Nothing raises into vllm-omni's save loop: a chunk omni-accum cannot encode (a strategy, a selection hook or an
encoder raising) is put as vllm-omni built it, and so is the rest of its request (:func:`_send_refused`). A request
in flight whose receiver's hello is lost (withdrawn, its process gone: :mod:`.peer`) sends every value again from its
next chunk, as vllm-omni built it (:func:`_receiver_lost`).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from omni_accum.engine import WIRE_MARKER
from omni_accum.errors import AccumulationError
from omni_accum.integrations.vllm_omni import ab, capture, handoff
from omni_accum.integrations.vllm_omni.binding import Binding, binding_for, published_later
from omni_accum.integrations.vllm_omni.marker import (
    MARKERS,
    OMITTED_KEY,
    SendTable,
    omitted_mask,
    with_hello,
    with_stamp,
)
from omni_accum.integrations.vllm_omni.peer import may_announce, watch

logger = logging.getLogger("omni_accum.vllm_omni")

_tls = threading.local()
_lock = threading.Lock()
_ABSENT = object()
#: Connector classes whose ``put`` is wrapped -> what their own ``__dict__`` held before (or _ABSENT).
_wrapped: dict[type, Any] = {}
_CONNECTOR_BASE = ("vllm_omni.distributed.omni_connectors.connectors.base", "OmniConnectorBase")


def _connector_base() -> type | None:
    import importlib

    try:
        return getattr(importlib.import_module(_CONNECTOR_BASE[0]), _CONNECTOR_BASE[1])
    except Exception:  # noqa: BLE001 - vllm-omni without the base class: nothing is wrapped
        return None


def encode_payload(b: Binding, req_id: str, data: Any, task: Any = None) -> Any:
    """What goes on the wire for ``data`` (a payload struct or mapping) of ``req_id``; ``task``: the sending
    adapter's task (the hand-off's kind, :mod:`.handoff`)."""
    from vllm_omni.data_entry_keys import OmniPayloadStruct, to_dict

    chunk = to_dict(data) if isinstance(data, OmniPayloadStruct) else data
    if not isinstance(chunk, Mapping):
        return data
    cap = b.__dict__.get("_capture")
    if cap is not None:  # recorded as the adapter built it (.capture)
        capture.sent(cap, req_id, chunk, task)
    hello = None
    w = b.__dict__.get("_peer")
    if w is not None and w.lost != b.peer_lost:  # its receiver's hello lost since (.peer)
        _receiver_lost(b, w)
    table = b.sent_once.get(req_id)
    if req_id not in b.live_send:
        b.live_send.add(req_id)
        bucket = b.decide(req_id, chunk)
        b.metrics.request("send", *b.bucket_labels(b.send_ctx.get(req_id)))
        table = b.sent_once[req_id] = SendTable()
        if b.announces:  # a policy that can change the wire tells the receiver who sent it ...
            if may_announce(b):
                hello = (b.fingerprint, bucket, b.short_source)
            else:  # ... once it said it runs omni-accum (the peer hello): until then, 0.30.0's payloads
                table.plain = True
        if not table.plain and handoff.heard(b):  # its hand-offs are timed (the sender's clock in the marker)
            table.stamps = 0
    elif table is None:
        table = b.sent_once[req_id] = SendTable()
    stamp = None if table.stamps is None else handoff.stamp(table, task)
    if table.plain:
        wire = chunk
    else:
        try:
            wire = b.sender.encode(req_id, chunk, context=b.send_ctx.get(req_id))
        except Exception as e:  # noqa: BLE001 - a refusal, or a plugin raising: never into vllm-omni's save loop
            _send_refused(b, req_id, e)
            wire, hello, stamp = chunk, None, None
    b.stats["chunks_sent"] += 1
    # One walk numbers the keys new on the wire, finds those left off and counts the metrics.
    omitted = b.metrics.sent(table, chunk, wire, b.strategy_name, MARKERS, table.kept)
    if wire is chunk and hello is None and stamp is None:
        return data
    if wire is chunk:
        wire = dict(chunk)
    mask = 0
    marked = WIRE_MARKER in wire
    if marked:
        override = wire.pop(WIRE_MARKER) < 0  # the engine's negative count: an override list left off
        mask = omitted_mask(table, omitted, override)
        b.stats["omitted"] += len(omitted)
    if hello is not None:
        wire[OMITTED_KEY] = with_hello(mask, *hello, stamp[:2] if stamp is not None else ())
    elif stamp is not None:
        wire[OMITTED_KEY] = with_stamp(mask, stamp)
    elif marked:
        wire[OMITTED_KEY] = mask
    return wire


def _send_refused(b: Binding, req_id: str, error: Exception) -> None:
    """omni-accum could not encode a chunk of ``req_id`` (``error``: a strategy, a selection hook or an encoder
    raised, or omni-accum's own bookkeeping did): count it (``refused_chunk``), say it once for the request, release
    the request's Sender state and send the chunk and the rest of the request as vllm-omni built them (every value,
    no marker). The receiver takes such chunks as it takes a sender's without omni-accum: nothing is left off them,
    so what it hands over is 0.30.0's. Never raises."""
    b.metrics.fallback("refused_chunk")
    table = b.sent_once.get(req_id)
    if table is None:
        table = b.sent_once[req_id] = SendTable()
    b.live_send.add(req_id)  # released with the request (_release_sender)
    table.plain, table.stamps = True, None
    try:
        b.sender.release(req_id)
    except Exception:  # noqa: BLE001 - nothing held
        pass
    if req_id in b.send_refused:
        return
    b.send_refused.add(req_id)
    from omni_accum.policy.fingerprint import dist_version

    if isinstance(error, AccumulationError):  # it names the request, the key, the strategy and its plugin
        what = str(error)
    else:
        what = f"request {req_id!r}: {type(error).__name__}: {error}"
    logger.warning(
        "omni-accum refused a chunk in the send hook (the connector's put): %s. The chunk and the rest of the request "
        "go out as vllm-omni %s built them, every value (not logged again for this request)",
        what,
        dist_version("vllm-omni") or "(its release)",
    )


def _receiver_lost(b: Binding, w: Any) -> None:
    """Sending binding ``b``'s watcher ``w`` lost the receiver's hello since ``b`` last looked (withdrawn, its
    process gone, replaced: :class:`.peer.PeerWatch` ``lost``): every request in flight that was announced or timed
    goes out as vllm-omni built it from its next chunk (every value again, no marker), its Sender state released;
    the receiver may run vllm-omni's own code now, which restores nothing."""
    b.peer_lost = w.lost
    moved = 0
    for rid in list(b.live_send):
        table = b.sent_once.get(rid)
        if table is None or table.plain:
            continue
        table.plain, table.stamps = True, None
        try:
            b.sender.release(rid)
        except Exception:  # noqa: BLE001 - nothing held
            pass
        moved += 1
    if moved:
        logger.info(
            "omni-accum: stage %d's hello is gone; %d request(s) in flight on stage %d send vllm-omni's own payloads "
            "(every value) from their next chunk",
            w.dst,
            moved,
            w.src,
        )


def _encoding_put(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def put(self: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = getattr(_tls, "send", None)
        if ctx is None or ctx[2] is not self or "data" not in kwargs:
            return orig(self, *args, **kwargs)
        _tls.send = None  # one encoding per send, even through a subclass's put calling its parent's
        b, req_id, _, task = ctx
        try:
            kwargs["data"] = encode_payload(b, req_id, kwargs["data"], task)
        except Exception as e:  # noqa: BLE001 - never into vllm-omni's save loop: its own payload goes out
            _send_refused(b, req_id, e)
        _tls.putting = b  # the connector may ask which keys the policy appends (putting_binding)
        try:
            result = orig(self, *args, **kwargs)
        finally:
            _tls.putting = None
        if isinstance(result, tuple) and len(result) >= 2 and result[0]:
            b.stats["puts"] += 1
            b.stats["wire_bytes"] += int(result[1] or 0)
        return result

    put.__omni_accum_put__ = True  # type: ignore[attr-defined]
    return put


def putting_binding() -> Binding | None:
    """The binding whose encoded payload the connector's ``put`` in progress on this thread sends, else None."""
    return getattr(_tls, "putting", None)


def ensure_encoding_put(conn: Any) -> bool:
    """Wrap the ``put`` of ``conn``'s class (once per class). False for an object that is not a real
    vllm-omni connector (a mock, say): its sends go out as vllm-omni built them."""
    cls = type(conn)
    if cls in _wrapped:
        return True
    base = _connector_base()
    if base is None or not isinstance(cls, type) or not issubclass(cls, base):
        return False
    return _wrap_class(cls)


def _wrap_class(cls: type) -> bool:
    with _lock:
        if cls in _wrapped:
            return True
        current = getattr(cls, "put", None)
        if not callable(current):
            return False
        _wrapped[cls] = cls.__dict__.get("put", _ABSENT)
        if not getattr(current, "__omni_accum_put__", False):  # not already covered through a parent class
            setattr(cls, "put", _encoding_put(current))
    return True


def wrap_connector_classes() -> int:
    """Wrap the ``put`` of every vllm-omni connector class imported so far (install): a bound ``put``
    taken from a connector before its first send then encodes too. Classes imported later are wrapped
    at their first send. Returns how many classes are wrapped."""
    base = _connector_base()
    if base is None:
        return 0
    todo, seen = [base], set()
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
    for cls in sorted(seen, key=lambda c: len(c.__mro__)):  # parents first: a child inheriting the wrapper keeps it
        _wrap_class(cls)
    return len(_wrapped)


def restore_connector_classes() -> None:
    """Give every wrapped connector class its own ``put`` back (uninstall)."""
    with _lock:
        for cls, raw in reversed(list(_wrapped.items())):
            if raw is _ABSENT:
                if "put" in cls.__dict__:
                    delattr(cls, "put")
            else:
                setattr(cls, "put", raw)
        _wrapped.clear()


def wrap_send(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def _send_single_request_for_generation(self: Any, task: dict, sender_token: Any = None) -> Any:
        b = binding_for(self)
        conn = getattr(self, "connector", None)
        if b is None or not ensure_encoding_put(conn):
            return orig(self, task, sender_token)
        watch(b, conn)  # its receiving stage's hello decides whether requests are announced (.peer)
        if "_capture" not in b.__dict__:
            capture.attach(b, self)  # OMNI_ACCUM_CAPTURE / the extra's omni_accum_capture (.capture)
        ext_id = task["request"].external_req_id
        top = b
        if b.arms is not None:  # an A/B split: the request's arm, from its id (.ab)
            b = ab.send_arm(b, ext_id)
        _tls.send = (b, ext_id, conn, task)
        try:
            return orig(self, task, sender_token)
        finally:
            _tls.send = None
            # A terminal chunk whose request the adapter already forgot (its clear ran before this put
            # finished, as 0.28 allows): release what the encode just (re)created, or it would leak.
            if task.get("is_finished") and ext_id not in getattr(self, "put_req_chunk", {}):
                _release_sender(top, ext_id, conn)

    return _send_single_request_for_generation


def _release_sender(b: Binding, ext_id: str, conn: Any = None) -> None:
    release = getattr(conn, "release_request", None)  # a connector with per-request state (the arena's)
    if callable(release):
        try:
            release(ext_id)
        except Exception as e:  # noqa: BLE001 - a connector's cleanup never fails vllm-omni's
            logger.warning("omni-accum: %s.release_request(%r) failed: %s", type(conn).__name__, ext_id, e)
    for x in b.each():  # itself and its A/B arms'
        x.sender.release(ext_id)
        x.sent_once.pop(ext_id, None)
        x.live_send.discard(ext_id)
        x.send_ctx.pop(ext_id, None)
        x.send_refused.discard(ext_id)
    capture.released(b, ext_id, "send")
    published_later(b)  # off vllm-omni's sender lock, which this runs under


def wrap_clear_sender(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def _clear_sender_state_locked(self: Any, external_req_id: str) -> None:
        orig(self, external_req_id)
        b = binding_for(self)
        if b is not None:
            _release_sender(b, external_req_id, getattr(self, "connector", None))

    return _clear_sender_state_locked
