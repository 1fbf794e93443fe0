"""The wrappers omni-accum puts around vllm-omni 0.30.0 methods, and the per-instance binding.

Every wrapper starts with :func:`binding_for`: an adapter or transport with no policy (neither
installed globally nor named by its connector ``extra``) runs the upstream method untouched.
:mod:`omni_accum.integrations.vllm_omni` checks signatures and patches; this module only says
what each wrapper does. It imports vllm-omni (through its callers only).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from omni_accum.channel import WIRE_MARKER, Receiver, Sender
from omni_accum.context import DEFAULT_CONTEXT, StreamContext
from omni_accum.errors import AccumulationError, OmniAccumError
from omni_accum.loader import load_policy
from omni_accum.policy import Policy

logger = logging.getLogger("omni_accum.vllm_omni")

#: Wire key replacing the engine's ``WIRE_MARKER`` on adapter puts: a bit mask of the send_once
#: values left off this chunk, bit i + 1 being the i-th send_once key first sent for the request
#: (both ends number them in wire order), bit 0 set when one of them is ``meta.override_keys``,
#: whose list still applies (the engine's negative count). A receiver that hands
#: deltas over (the AR adapter) restores exactly those keys; one small int costs less than the
#: names, so short statics still save bytes.
OMITTED_KEY = "__omni_accum_once__"
#: Wire keys that are not payload keys.
_MARKERS = (WIRE_MARKER, OMITTED_KEY)
#: Connector ``extra`` keys read by the integration.
EXTRA_POLICY = "omni_accum_policy"
EXTRA_ADAPTER_KEYS = "omni_accum_adapter_keys"
EXTRA_CONTEXT_LEN = "omni_accum_context_len"
EXTRA_CONCURRENCY = "omni_accum_concurrency"
#: The deployment context (see :func:`deployment_context`): a connector extra key beats its variable.
ENV_CONTEXT_LEN = "OMNI_ACCUM_CONTEXT_LEN"
ENV_CONCURRENCY = "OMNI_ACCUM_CONCURRENCY"
#: Keys an AR receiving adapter accumulates (when their strategy is append-kind, other than ``cat``)
#: before handing the view over: the prefill rows that chunked prefill (vllm-omni PR #2997) splits
#: over several chunks.
#: Other keys are handed over as raw deltas, as in 0.30.0 (the talker keeps its own decode cache).
DEFAULT_ADAPTER_KEYS = ("embed.prefill", "hidden_states.output")
_ATTR = "_omni_accum_binding"
_DISABLED = ("off", "none", "false", "0", "")

_lock = threading.Lock()
_tls = threading.local()
#: Every instance given the binding attribute (a Binding or None), by id, weakly: uninstall detaches them.
_instances: dict[int, weakref.ref[Any]] = {}
_warned_no_context = False


class Settings:
    """Process-wide settings written by ``install``: the global policy and the AR adapter keys."""

    policy: Policy | None = None
    adapter_keys: tuple[str, ...] = DEFAULT_ADAPTER_KEYS
    #: True while the method wrappers are in place (``install`` .. ``uninstall``).
    installed: bool = False
    #: Where the process-wide policy came from (``OMNI_ACCUM_POLICY``, a preset name, a path ...).
    policy_source: str = "no policy"
    #: Called after a binding is made or a request released (the status file, when one is asked for).
    on_change: Callable[[], None] | None = None


def _path(top: Any, qual: Any = None) -> str:
    return str(top) if qual is None else f"{top}.{qual}"


class ContextSettingError(OmniAccumError, ValueError):
    """``OMNI_ACCUM_CONTEXT_LEN`` / ``OMNI_ACCUM_CONCURRENCY`` (or their connector extra keys) hold an invalid value."""


_INT = re.compile(r"\s*(\d+)\s*([kK]?)\s*")


def _context_setting(extra: Any, key: str, env: str, what: str) -> int | None:
    if isinstance(extra, Mapping) and extra.get(key) is not None:
        value, where = extra[key], f"connector extra {key}"
    else:
        value, where = os.environ.get(env, ""), f"environment variable {env}"
        if not value.strip():
            return None
    n: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str) and (m := _INT.fullmatch(value)):
        n = int(m.group(1)) * (1000 if m.group(2) else 1)
    if n is None or n < 1:
        raise ContextSettingError(
            f"{where}={value!r}: expected the deployment's {what} as a whole number >= 1 (such as 8000 or 8k)"
        )
    return n


def deployment_context(extra: Any = None) -> StreamContext | None:
    """The stream context every binding of this process uses for strategy selection (tuned tables).

    ``omni_accum_context_len`` / ``omni_accum_concurrency`` in the connector ``extra``, else
    ``OMNI_ACCUM_CONTEXT_LEN`` / ``OMNI_ACCUM_CONCURRENCY``: the typical prompt length (tokens) and
    the number of requests streaming at once. Read once per binding, never per request: a sender and
    its receiver must select the same strategy for keys whose strategy has an encoder, so give every
    stage the same values. None when neither is set.

    Raises:
        ContextSettingError: a value that is not a whole number >= 1 (names the variable and value).
    """
    context_len = _context_setting(extra, EXTRA_CONTEXT_LEN, ENV_CONTEXT_LEN, "context length (prompt tokens)")
    concurrency = _context_setting(extra, EXTRA_CONCURRENCY, ENV_CONCURRENCY, "concurrency (requests at once)")
    if context_len is None and concurrency is None:
        return None
    return StreamContext(context_len=context_len, concurrency=concurrency or 1)


def _warn_untuned_context(policy: Policy, context: StreamContext | None, source: str) -> None:
    global _warned_no_context
    if context is not None or policy.tuned is None or _warned_no_context:
        return
    _warned_no_context = True
    c_edge, k_edge, _ = policy.tuned.bucket(DEFAULT_CONTEXT)
    logger.warning(
        "omni-accum: the policy from %s has a tuned table, but no deployment context is set: inside vllm-omni "
        "every stream resolves in the table's first bucket (context_len>=%s, concurrency>=%s). Set %s and %s "
        "(or %s / %s in the connector extra) to the deployment's typical prompt length and concurrency, the "
        "same on every stage",
        source,
        c_edge,
        k_edge,
        ENV_CONTEXT_LEN,
        ENV_CONCURRENCY,
        EXTRA_CONTEXT_LEN,
        EXTRA_CONCURRENCY,
    )


class Binding:
    """The omni-accum state of one adapter or transport: its policy, Sender and Receiver.

    Attributes:
        context: the deployment context (:func:`deployment_context`) its Sender and Receiver use, or None.
        stats: ``puts``, ``wire_bytes`` (as the connector reports them) and ``omitted`` (send_once
            values left off the wire), counted by the send-side hook; ``chunks_sent`` (payloads that
            went through the Sender) and ``chunks_received`` (payloads a receive hook handled).
        fell_back: requests one of whose chunks omni-accum refused and left to upstream's code
            (:meth:`fall_back`), until released.
    """

    def __init__(
        self,
        policy: Policy,
        adapter_keys: tuple[str, ...] | list[str],
        source: str,
        context: StreamContext | None = None,
    ) -> None:
        self.policy = policy
        self.source = source
        self.context = context
        self.sender = Sender(policy, context=context)
        self.receiver = Receiver(policy, context=context)
        self.adapter_keys = frozenset(adapter_keys)
        self.stats = {"puts": 0, "wire_bytes": 0, "omitted": 0, "chunks_sent": 0, "chunks_received": 0}
        self.sent_once: dict[str, dict[tuple[Any, Any], int]] = {}  # ext id -> send_once key -> bit
        self.held_once: dict[str, dict[tuple[Any, Any], int]] = {}  # req id -> send_once key -> bit
        self.fell_back: set[str] = set()
        self._full: Receiver | None = None

    @property
    def full_payload_endpoint(self) -> Receiver:
        """Strategy selection for the full-payload accumulator.

        Its ``default`` is ``token_list`` when the policy's is ``cat``: upstream's accumulator keeps a
        list and concatenates once at flush, and ``cat`` means "as upstream"; rules apply as written.
        """
        if self._full is None:
            pol = self.policy
            if pol.default.strategy == "cat":
                data = pol.model_dump(mode="json", exclude_none=True)
                data["default"] = "token_list"
                pol = load_policy(data, manager=self.receiver.manager)
            self._full = Receiver(pol, manager=self.receiver.manager, context=self.context)
        return self._full

    def once(self, top: Any, qual: Any, value: Any) -> bool:
        """True when the key's strategy leaves unchanged values off the wire (``send_once``)."""
        return self.receiver.select(_path(top, qual), value, self.receiver.context)[0].omits_unchanged

    def number_once(self, table: dict[tuple[Any, Any], int], payload: Mapping[str, Any]) -> None:
        """Give each send_once key of ``payload`` seen for the first time the next bit, in wire order."""
        for top, qual, value in _leaves(payload):
            if (top, qual) not in table and self.once(top, qual, value):
                table[(top, qual)] = len(table)

    def tracks(self, path: str, value: Any, ar: bool) -> tuple[bool, bool]:
        """``(merge it, hand over the accumulated view)`` for a key reaching a receiving adapter.

        ``cat`` means "as upstream", and 0.30.0's adapter hands raw deltas over: a key under ``cat``
        (the ``default`` policy) is not accumulated here, even under chunked prefill.
        """
        strategy, spec = self.receiver.select(path, value, self.receiver.context)
        accumulate = ar and path in self.adapter_keys and "append" in spec.kinds and spec.name != "cat"
        return accumulate or strategy.omits_unchanged, accumulate

    def forget(self, req_id: Any) -> None:
        """Release the receive-side state of ``req_id`` (upstream released the request)."""
        self.receiver.release(req_id)
        self.held_once.pop(req_id, None)
        self.fell_back.discard(req_id)
        _changed()

    def fall_back(self, req_id: str, error: AccumulationError, where: str, *, release: bool = True) -> None:
        """omni-accum refused a chunk of ``req_id``: log it (once per request until it is released) and
        release its Receiver state; the caller lets upstream's code handle the chunk, and the next one
        re-seeds. ``release=False`` (full-payload accumulator, whose entry stays upstream's until it is
        flushed): log only."""
        if req_id not in self.fell_back:
            if release:
                self.fell_back.add(req_id)
                then = "this chunk, and omni-accum goes on from upstream's state with the next one"
            else:
                then = "this step and the rest of the request until it is flushed"
            logger.warning(
                "omni-accum refused a chunk in %s: request %r, key %r: %s. vllm-omni 0.30.0's own code handles %s "
                "(not logged again for this request)",
                where,
                req_id,
                error.key,
                error.reason,
                then,
            )
        if release:
            self.receiver.release(req_id)

    def close(self) -> None:
        """Release every request's state (uninstall)."""
        for rid in self.receiver.request_ids():
            self.receiver.release(rid)
        for rid in self.sender.request_ids():
            self.sender.release(rid)
        self.sent_once.clear()
        self.held_once.clear()
        self.fell_back.clear()


def _leaves(payload: Mapping[str, Any]):
    for top, value in payload.items():
        if top in _MARKERS:
            continue
        if isinstance(value, dict):
            for qual, qv in value.items():
                yield top, qual, qv
        else:
            yield top, None, value


def _policy_source(extra: Any) -> tuple[Any, str]:
    if isinstance(extra, Mapping) and EXTRA_POLICY in extra:
        value = extra[EXTRA_POLICY]
        if value is None or value is False or (isinstance(value, str) and value.strip().lower() in _DISABLED):
            return None, f"connector extra {EXTRA_POLICY}={value!r} (off)"
        return value, f"connector extra {EXTRA_POLICY}"
    if Settings.policy is not None:
        return Settings.policy, "install()"
    return None, "no policy"


def connector_extra(obj: Any) -> Any:
    """The deploy YAML connector ``extra`` of an adapter or transport (``connector.config``)."""
    conn = getattr(obj, "connector", None)
    return getattr(conn, "config", None)


def binding_for(obj: Any) -> Binding | None:
    """The binding of ``obj`` (created on first use), or None when no policy applies to it."""
    b = obj.__dict__.get(_ATTR, False)
    if b is not False:
        return b
    with _lock:
        b = obj.__dict__.get(_ATTR, False)
        if b is not False:
            return b
        extra = connector_extra(obj)
        spec, source = _policy_source(extra)
        b = None
        if spec is not None:
            keys = extra.get(EXTRA_ADAPTER_KEYS) if isinstance(extra, Mapping) else None
            context = deployment_context(extra)
            policy = load_policy(spec)
            b = Binding(policy, tuple(keys) if keys else Settings.adapter_keys, source, context)
            _attach(obj, b)
            _warn_untuned_context(policy, context, source)
            logger.info(
                "omni-accum bound to %s (pid=%d, policy from %s, context %s)", type(obj).__name__, os.getpid(), source,
                context,
            )
        obj.__dict__[_ATTR] = b
        _track(obj)
    if b is not None:
        _changed()
    return b


def _changed() -> None:
    hook = Settings.on_change
    if hook is not None:
        try:
            hook()
        except Exception:  # noqa: BLE001 - reporting must never fail vllm-omni
            logger.debug("omni-accum: status update failed", exc_info=True)


def bindings() -> list[tuple[Any, Binding]]:
    """``(instance, binding)`` for every live instance that has a binding."""
    with _lock:
        refs = list(_instances.values())
    out = []
    for r in refs:
        obj = r()
        b = obj.__dict__.get(_ATTR) if obj is not None else None
        if isinstance(b, Binding):
            out.append((obj, b))
    return out


def bind(obj: Any, policy: Policy | None, context: StreamContext | None = None) -> Binding | None:
    """Give ``obj`` (an adapter or transport) its own policy, or none (upstream code), explicitly.

    ``context``: for strategy selection; None: the deployment context (:func:`deployment_context`), as
    for a binding made on first use.
    """
    with _lock:
        b = None
        if policy is not None:
            ctx = context if context is not None else deployment_context(connector_extra(obj))
            b = Binding(load_policy(policy), Settings.adapter_keys, "bind()", ctx)
            _attach(obj, b)
        old = obj.__dict__.get(_ATTR)
        if isinstance(old, Binding) and old is not b:
            old.close()
        obj.__dict__[_ATTR] = b
        _track(obj)
        return b


def _track(obj: Any) -> None:
    key = id(obj)

    def gone(ref: weakref.ref[Any], key: int = key) -> None:
        if _instances.get(key) is ref:
            _instances.pop(key, None)

    try:
        _instances[key] = weakref.ref(obj, gone)
    except TypeError:  # not weak-referenceable: uninstall cannot reach it (vllm-omni's classes all are)
        pass


def _attach(obj: Any, b: Binding) -> None:
    """Per-instance plumbing: release-aware accumulator dict (transports), encoding put (adapters)."""
    store = obj.__dict__.get("_send_side_request_payload")
    if isinstance(store, ReleasingDict):
        store.release = b.forget
    elif isinstance(store, dict):
        obj._send_side_request_payload = ReleasingDict(b.forget, store)
    conn = getattr(obj, "connector", None)
    if conn is not None and hasattr(obj, "put_req_chunk"):
        put = conn.__dict__.get("put")
        if isinstance(put, EncodingPut):
            put.binding = b
        else:
            conn.put = EncodingPut(conn.put, b)


def detach(obj: Any) -> None:
    """Undo everything omni-accum did to ``obj``: release its state, drop its binding attribute, put a
    plain dict back as its accumulator store (same contents), unwrap its connector's ``put``, and turn
    pending full-payload entries into upstream's representation. Upstream's code then handles it alone,
    and a later install binds it afresh (re-seeding from upstream's store)."""
    from omni_accum.integrations.vllm_omni_full_payload import restore_upstream_entries

    b = obj.__dict__.pop(_ATTR, None)
    store = obj.__dict__.get("_send_side_request_payload")
    if isinstance(store, ReleasingDict):
        obj._send_side_request_payload = dict(store.items())
    conn = getattr(obj, "connector", None)
    put = getattr(conn, "__dict__", {}).get("put")
    if isinstance(put, EncodingPut):
        inner = put.put
        if getattr(inner, "__self__", None) is conn and getattr(inner, "__func__", None) is getattr(
            type(conn), "put", None
        ):
            del conn.__dict__["put"]  # the class's own method again
        else:
            conn.put = inner
    pending = obj.__dict__.get("_pending_full_payload_send")
    if isinstance(pending, dict):
        restore_upstream_entries(pending)
    if isinstance(b, Binding):
        b.close()


def detach_all() -> int:
    """:func:`detach` every instance a binding was made for; returns how many were still alive."""
    global _warned_no_context
    with _lock:
        objs = [r() for r in _instances.values()]
        _instances.clear()
        _warned_no_context = False
    alive = [o for o in objs if o is not None]
    for obj in alive:
        detach(obj)
    return len(alive)


class ReleasingDict(dict):
    """The transport's ``_send_side_request_payload``: removing an entry releases the Receiver state.

    Upstream releases its accumulator by popping this dict (chunk finished, cleanup, abort), so the
    Receiver is released exactly there, whatever the path.
    """

    def __init__(self, release: Callable[[Any], Any], *args: Any) -> None:
        super().__init__(*args)
        self.release = release

    def pop(self, key: Any, *default: Any) -> Any:
        self.release(key)
        return super().pop(key, *default)

    def __delitem__(self, key: Any) -> None:
        self.release(key)
        super().__delitem__(key)

    def popitem(self) -> tuple[Any, Any]:
        key, value = super().popitem()
        self.release(key)
        return key, value

    def clear(self) -> None:
        for key in list(self):
            self.release(key)
        super().clear()


# ---------------------------------------------------------------------------------------------- #
# Send side: OmniChunkTransferAdapter._send_single_request_for_generation
# ---------------------------------------------------------------------------------------------- #


class EncodingPut:
    """The adapter connector's ``put``: while the send hook runs, payloads go through the Sender."""

    def __init__(self, put: Callable[..., Any], binding: Binding) -> None:
        self.put = put
        self.binding = binding

    def __call__(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> Any:
        ctx = getattr(_tls, "send", None)
        b = self.binding
        if ctx is None or ctx[0] is not b:
            return self.put(from_stage=from_stage, to_stage=to_stage, put_key=put_key, data=data)
        from vllm_omni.data_entry_keys import OmniPayloadStruct, to_dict

        chunk = to_dict(data) if isinstance(data, OmniPayloadStruct) else data
        wire = b.sender.encode(ctx[1], chunk) if isinstance(chunk, Mapping) else chunk
        b.stats["chunks_sent"] += 1
        if wire is not chunk:
            table = b.sent_once.setdefault(ctx[1], {})
            b.number_once(table, wire)
            if WIRE_MARKER in wire:
                omitted = _omitted_paths(chunk, wire)
                override = wire.pop(WIRE_MARKER) < 0  # the engine's negative count: an override list left off
                wire[OMITTED_KEY] = omitted_mask(table, omitted, override)
                b.stats["omitted"] += len(omitted)
            data = wire
        result = self.put(from_stage=from_stage, to_stage=to_stage, put_key=put_key, data=data)
        if isinstance(result, tuple) and len(result) >= 2 and result[0]:
            b.stats["puts"] += 1
            b.stats["wire_bytes"] += int(result[1] or 0)
        return result


def _omitted_paths(chunk: Mapping[str, Any], wire: Mapping[str, Any]) -> list[tuple[Any, Any]]:
    out: list[tuple[Any, Any]] = []
    for top, value in chunk.items():
        if isinstance(value, dict):
            sub = wire.get(top)
            out += [(top, q) for q in value if not isinstance(sub, dict) or q not in sub]
        elif top not in wire:
            out.append((top, None))
    return out


def wrap_send(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def _send_single_request_for_generation(self: Any, task: dict, sender_token: Any = None) -> Any:
        b = binding_for(self)
        if b is None:
            return orig(self, task, sender_token)
        _tls.send = (b, task["request"].external_req_id)
        try:
            return orig(self, task, sender_token)
        finally:
            _tls.send = None

    return _send_single_request_for_generation


def wrap_clear_sender(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def _clear_sender_state_locked(self: Any, external_req_id: str) -> None:
        orig(self, external_req_id)
        b = binding_for(self)
        if b is not None:
            b.sender.release(external_req_id)
            b.sent_once.pop(external_req_id, None)
            _changed()

    return _clear_sender_state_locked


# ---------------------------------------------------------------------------------------------- #
# Receive side of the adapter (scheduler): _commit_received_chunk, _clear_receiver_state_locked
# ---------------------------------------------------------------------------------------------- #


def adapter_receive(b: Binding, req_id: str, payload: dict[str, Any], ar: bool) -> dict[str, Any]:
    """The delta an adapter hands over: raw wire values, with send_once values the sender left off
    restored, and (AR) the adapter keys replaced by their accumulated view."""
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
    b.number_once(table, payload)
    sub: dict[str, Any] = {}
    views: list[tuple[Any, Any]] = []
    for top, value in payload.items():
        if top in _MARKERS:
            continue
        if isinstance(value, dict):
            for qual, qv in value.items():
                merge, view = b.tracks(_path(top, qual), qv, ar)
                if merge:
                    sub.setdefault(top, {})[qual] = qv
                    if view:
                        views.append((top, qual))
        else:
            merge, view = b.tracks(_path(top), value, ar)
            if merge:
                sub[top] = value
                if view:
                    views.append((top, None))
    meta = payload.get("meta")
    if isinstance(meta, dict) and "override_keys" in meta:
        sub.setdefault("meta", {})["override_keys"] = meta["override_keys"]
    if mask:  # negative: the override list the sender left off still applies
        sub[WIRE_MARKER] = -_count(mask) if override else _count(mask)
    if not sub and OMITTED_KEY not in payload:
        return payload
    view = b.receiver.merge(req_id, sub) if sub else b.receiver.view(req_id)
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in payload.items() if k not in _MARKERS}
    for path in [*views, *omitted]:
        top, qual = path
        if qual is None:
            out[top] = view[top]
        else:
            out.setdefault(top, {})[qual] = view[top][qual]
    return out


def _count(mask: int) -> int:
    return bin(mask).count("1")


def omitted_mask(table: Mapping[tuple[Any, Any], int], omitted: list[tuple[Any, Any]], override: bool) -> int:
    """The ``OMITTED_KEY`` value: bit ``table[path] + 1`` per key left off, bit 0 for the override marker."""
    return sum(1 << (table[p] + 1) for p in omitted) | bool(override)


def split_mask(raw: Any) -> tuple[int, bool]:
    """``(bits of the keys left off, override marker)`` of an ``OMITTED_KEY`` value; a malformed one is refused."""
    if type(raw) is not int or raw < 0:
        raise AccumulationError(
            f"malformed wire marker {OMITTED_KEY!r}: expected a bit mask (an int >= 0), got {raw!r}"
        )
    return raw >> 1, bool(raw & 1)


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
    leave off) go on through omni-accum.
    """
    try:
        prev = b.receiver.view(req_id).to_dict()
    except (KeyError, OmniAccumError):
        prev = {}
    b.fall_back(req_id, error, "the adapter receive hook (_commit_received_chunk)")  # releases the Receiver state
    try:
        mask, _ = split_mask(payload.get(OMITTED_KEY) or 0)
    except AccumulationError:
        mask = 0
    table = b.held_once.setdefault(req_id, {})
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in payload.items() if k not in _MARKERS}
    lost = []
    for (top, qual), bit in table.items():
        if mask >> bit & 1:
            held, value = _get(prev, top, qual)
            if held:
                _set(out, top, qual, value)
            else:
                lost.append(_path(top, qual))
    if lost:
        logger.warning(
            "omni-accum: request %r: the sender left %s off the wire and this receiver no longer holds them; the "
            "chunk is handed over without them",
            req_id,
            ", ".join(lost),
        )
    overridden = _override_set(out)
    seed = {k: (dict(v) if isinstance(v, dict) else v) for k, v in prev.items()}
    for top, qual, value in list(_leaves(out)):
        try:
            merge, view = b.tracks(_path(top, qual), value, ar)
        except OmniAccumError:
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
    try:
        b.number_once(table, payload)
        if seed:
            b.receiver.merge(req_id, seed)
    except OmniAccumError:
        b.receiver.release(req_id)
    return out


def wrap_commit(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def _commit_received_chunk(
        self: Any, request: Any, result: Any, *, stage_id: int, req_id: str, chunk_id: int, connector_get_key: str
    ) -> bool:
        b = binding_for(self)
        payload = result[0] if isinstance(result, tuple) else None
        if b is not None and isinstance(payload, dict) and payload:
            b.stats["chunks_received"] += 1
            ar = self.model_mode == "ar"
            try:
                handed = adapter_receive(b, req_id, payload, ar)
            except AccumulationError as e:
                handed = adapter_fallback(b, req_id, payload, ar, e)
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

    return _clear_receiver_state_locked


# ---------------------------------------------------------------------------------------------- #
# Receive side of the runner transports: _accumulate_payload (mixin, MRv2 data plane)
# ---------------------------------------------------------------------------------------------- #


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
        try:
            wire = {k: v for k, v in payload_data.items() if k != OMITTED_KEY}
            if OMITTED_KEY in payload_data:
                mask, override = split_mask(payload_data[OMITTED_KEY])
                if mask:  # the engine's marker: held values still apply (negative: the override list too)
                    wire[WIRE_MARKER] = -_count(mask) if override else _count(mask)
            if req_id in store:
                _sync(b, req_id, store[req_id])
            else:
                b.receiver.release(req_id)  # upstream starts afresh here too
            if decode_spans:
                wire = align_decode_span(b, req_id, wire)
            merged = b.receiver.merge(req_id, wire).to_dict()
        except AccumulationError as e:
            # 0.30.0 takes this chunk (torch.cat promotes dtypes, takes a legacy empty tensor): let it,
            # on upstream's store (which still holds the send_once values left off); the next chunk re-seeds.
            b.fall_back(req_id, e, f"{type(self).__name__}._accumulate_payload")
            return orig(self, req_id, _upstream_chunk(store, req_id, payload_data))
        store[req_id] = merged
        return dict(merged)

    return _accumulate_payload


# ---------------------------------------------------------------------------------------------- #
# Lazy activation: constructors look at the connector extra
# ---------------------------------------------------------------------------------------------- #


def wrap_probe(orig: Callable[..., Any], on_policy: Callable[[Any], None]) -> Callable[..., Any]:
    """Constructor probe: after construction, a connector extra naming a policy triggers ``on_policy``."""

    @functools.wraps(orig)
    def probe(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, *args, **kwargs)
        extra = connector_extra(self)
        if isinstance(extra, Mapping) and _policy_source(extra)[0] is not None:
            on_policy(self)
        return result

    return probe
