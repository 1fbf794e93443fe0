"""Which instances omni-accum bound: the weak table ``uninstall`` detaches, and undoing a binding.

:mod:`.binding` makes a :class:`~.binding.Binding` and keeps it in the instance's ``__dict__`` under
:data:`ATTR` (``None``: looked at, no policy applies); this module keeps every such instance, weakly, by
id, so that :func:`detach_all` can reach them, and lists the live bindings for the process-wide gauges
(:func:`bindings`). It knows a binding only by what it calls on it (``forget``, ``close``), so the
wrappers' paths (``.full_payload``, ``.processor``) register what they own here without an import circle.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from omni_accum.integrations.vllm_omni.deployment import reset_warning
from omni_accum.integrations.vllm_omni.store import ReleasingDict

#: The instance attribute holding its binding (None: no policy applies to it).
ATTR = "_omni_accum_binding"

_lock = threading.Lock()
#: Every instance given the binding attribute (a Binding or None), by id, weakly: uninstall detaches them.
_instances: dict[int, weakref.ref[Any]] = {}
_gone: list[int] = []  # ids of tracked objects gone since (see _track)

#: Called by :func:`detach` with each instance (the full-payload path registers one that gives
#: pending entries back in upstream's representation).
DETACH_HOOKS: list[Callable[[Any], None]] = []
#: ``(bytes, request ids)`` an instance holds outside its bindings' Receivers (``.full_payload.held``, added there):
#: counted in ``omni_accum_held_bytes`` and as role ``accumulate`` of ``omni_accum_active_requests``.
HELD_HOOKS: list[Callable[[Any], tuple[int, list[str]]]] = []


def bindings() -> list[tuple[Any, Any]]:
    """``(instance, binding)`` for every live instance that has a binding."""
    with _lock:
        refs = list(_instances.values())
    out = []
    for r in refs:
        obj = r()
        b = obj.__dict__.get(ATTR) if obj is not None else None
        if b is not None:
            out.append((obj, b))
    return out


def _track(obj: Any) -> None:
    """Enter ``obj`` (under ``_lock``), first dropping entries whose object is gone (noted in ``_gone`` by a
    weakref callback, which may run under ``_lock``): only a dead one goes, as a new object may reuse an id."""
    while _gone:
        r = _instances.get(k := _gone.pop())
        if r is not None and r() is None:
            del _instances[k]
    try:
        _instances[id(obj)] = weakref.ref(obj, lambda _, k=id(obj): _gone.append(k))
    except TypeError:  # not weak-referenceable: uninstall cannot reach it (vllm-omni's classes all are)
        pass


def _attach(obj: Any, b: Any) -> None:
    """Per-instance plumbing: a release-aware accumulator dict (runner transports). Nothing else of the
    instance, and nothing of its connector, is replaced (the send path wraps the connector's class)."""
    store = obj.__dict__.get("_send_side_request_payload")
    if isinstance(store, ReleasingDict):
        store.release = b.forget
    elif isinstance(store, dict):
        obj._send_side_request_payload = ReleasingDict(b.forget, store)


def detach(obj: Any) -> None:
    """Undo everything omni-accum did to ``obj``: release its state, drop its binding attribute, put a
    plain dict back as its accumulator store (same contents), and let :data:`DETACH_HOOKS` turn what
    they own back (pending full-payload entries into upstream's representation). Upstream's code then
    handles it alone, and a later install binds it afresh (re-seeding from upstream's store)."""
    b = obj.__dict__.pop(ATTR, None)
    store = obj.__dict__.get("_send_side_request_payload")
    if isinstance(store, ReleasingDict):
        obj._send_side_request_payload = dict(store.items())
    for hook in DETACH_HOOKS:
        hook(obj)
    if b is not None:
        b.close()


def detach_all() -> int:
    """:func:`detach` every instance a binding was made for; returns how many were still alive."""
    with _lock:
        objs = [r() for r in _instances.values()]
        _instances.clear()
    reset_warning()
    alive = [o for o in objs if o is not None]
    for obj in alive:
        detach(obj)
    return len(alive)
