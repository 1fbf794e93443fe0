"""The per-instance binding: which policy an adapter or transport runs, its Sender and Receiver.

Every wrapper (:mod:`.send`, :mod:`.receive`, :mod:`.runner`, :mod:`.full_payload`) starts with
:func:`binding_for`: an adapter or transport with no policy (neither installed globally nor named
by its connector ``extra``) runs the upstream method untouched. The wrappers depend on this module,
never on each other.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from omni_accum.context import StreamContext
from omni_accum.engine import Receiver, Sender
from omni_accum.errors import AccumulationError
from omni_accum.integrations.vllm_omni import deployment, handshake, metrics, peer, publishing
from omni_accum.integrations.vllm_omni.binding_settings import Settings, check_extra, connector_extra
from omni_accum.integrations.vllm_omni.deployment import _warn_untuned_context, deployment_context
from omni_accum.integrations.vllm_omni.handshake import (  # noqa: F401 - policy_fingerprint re-exported
    _changes_wire,
    _readable_source,
    _RequestContextReceiver,
    _short_source,
    policy_fingerprint,
)
from omni_accum.integrations.vllm_omni.instances import ATTR as _ATTR
from omni_accum.integrations.vllm_omni.instances import HELD_HOOKS, _attach, _lock, _track, bindings
from omni_accum.integrations.vllm_omni.marker import MARKERS, _leaves, _path  # noqa: F401 - _leaves, _path re-exported
from omni_accum.integrations.vllm_omni.publishing import publish_pending, published_later  # noqa: F401 - re-exported
from omni_accum.policy import Policy, load_policy

logger = logging.getLogger("omni_accum.vllm_omni")


class Binding:
    """The omni-accum state of one adapter or transport: its policy, Sender and Receiver.

    Attributes:
        context: the deployment context (:func:`deployment_context`) its Sender and Receiver use, or None.
        stats: ``puts``, ``wire_bytes`` (as the connector reports them) and ``omitted`` (send_once
            values left off the wire), counted by the send-side hook; ``chunks_sent`` (payloads that
            went through the Sender) and ``chunks_received`` (payloads a receive hook handled); ``accumulated``: steps
            the full-payload accumulator took (``async_chunk: false``, the producing stage: nothing received).
        fell_back: requests one of whose chunks omni-accum refused and left to upstream's code
            (:meth:`fall_back`), until released.
        split: the policy's A/B split (:class:`~omni_accum.policy.model.ABSplit`), or None.
        arms: with a split, one binding per arm (its policy, Sender and Receiver; fingerprint
            ``<this binding's>/<arm>``), sharing this one's stats; the chunk transfer adapter's hooks route
            each request to its arm (:mod:`.ab`). This binding itself runs the first arm (every other path).
        arm: an arm binding's name (None: not an arm).
    """

    def __init__(
        self,
        policy: Policy,
        adapter_keys: tuple[str, ...] | list[str],
        source: str,
        context: StreamContext | None = None,
        *,
        arm: tuple[Binding, str] | None = None,
    ) -> None:
        split = policy.ab
        arm_policies = policy.arm_policies()
        whole, policy = policy, next(iter(arm_policies.values())) if arm_policies else policy
        self.policy = policy
        self.source = source
        self.context = context
        self.sender = Sender(policy, context=context)
        self.receiver = _RequestContextReceiver(self, policy, context=context)
        self.adapter_keys = frozenset(adapter_keys)
        self.stats = {  # accumulated: the full-payload accumulator's steps (the producing stage)
            "puts": 0, "wire_bytes": 0, "omitted": 0, "chunks_sent": 0, "chunks_received": 0, "accumulated": 0
        }  # fmt: skip
        self.arm = arm[1] if arm is not None else None
        #: the split's binding of an arm (its adapter's), else this one
        self.top: Binding = arm[0] if arm is not None else self
        if arm is not None:
            self.stats = arm[0].stats  # one adapter's counts, whichever arm a chunk ran
        self.metrics = metrics.Recorder(arm=self.arm)
        # every 256 chunks: published by the publisher thread with the gauges (an arm's with its split's binding)
        self.metrics.publish_later = functools.partial(published_later, arm[0] if arm is not None else self, False)
        if self.metrics.on:  # the hooks' merges count each key in the merge's own pass (Recorder.merged)
            self.receiver.on_merge = self.metrics.merged
        self._names: dict[tuple[str, type], str] = {}
        self._append_kind = frozenset(s.name for s in self.receiver.manager.specs() if "append" in s.kinds)
        if arm is None:
            from omni_accum import __version__

            self.fingerprint = policy_fingerprint(whole, self.receiver.manager)
            #: its omni_accum_policy_info labels, until :meth:`close` lets them go (None: let go)
            self.info: tuple[str, str, str] | None = (
                _readable_source(source, Settings.policy_source), self.fingerprint, __version__
            )
            metrics.policy_info(*self.info)
        else:  # the split's fingerprint and the arm: a receiver follows a request's arm only on the same split
            self.fingerprint = f"{arm[0].fingerprint}/{arm[1]}"
            self.info = None
        self.sent_once: dict[str, dict[tuple[Any, Any], int]] = {}  # ext id -> key -> bit (wire order)
        self.held_once: dict[str, dict[tuple[Any, Any], int]] = {}  # req id -> key -> bit (wire order)
        #: Per request: the stream context of the tuned bucket the sender decided (the handshake), as the
        #: receiving side follows it (request id) and as the sending side decided it (external id).
        self.req_ctx: dict[str, StreamContext] = {}
        self.send_ctx: dict[str, StreamContext] = {}
        #: Requests a sender with another policy sent: (its fingerprint, its source); 0.30.0's code runs them.
        self.foreign: dict[str, tuple[str, str]] = {}
        #: Requests an adapter hands over as 0.30.0 does: foreign ones, and those whose Receiver state could not be
        #: re-seeded after a refused chunk (:func:`.receive.adapter_fallback`). The latest value of every key, to put
        #: back what the sender left off.
        self.mirror: dict[str, dict[tuple[Any, Any], Any]] = {}
        #: Requests whose chunks lacked values the sender left off (said once per request, until released).
        self.said_lost: set[str] = set()
        self.short_source = _short_source(source, Settings.policy_source)
        self.announces = (
            split is not None  # an A/B split announces each request's arm
            or arm is not None
            or policy.tuned is not None
            or any(
                _changes_wire(self.receiver.manager.build(c.strategy, c.params)) for c in [policy.default, *policy.rules]
            )
        )
        self.fell_back: set[str] = set()
        #: Bytes this binding's stage input processor holds for prompts still in chunked prefill (their rows, before
        #: chunk 0 is put; set by :mod:`.processor` at a request's first prefill chunk), or None: counted in
        #: ``omni_accum_held_bytes`` beside the Receivers' state.
        self.prefill_nbytes: Callable[[], int] | None = None
        self.live_send: set[str] = set()  # requests this binding has sent a chunk of, until released
        self.send_refused: set[str] = set()  # requests whose chunk the send hook refused (said once: .send)
        self.peer_lost = 0  # the receiver's watcher's count of lost hellos this binding last acted on (.send)
        self._full: Receiver | None = None
        self.split = split
        #: A split's receiving side: the arm each live request runs (its first chunk's, else its id's hash).
        self.recv_arm: dict[str, str] = {}
        self.arms: dict[str, Binding] | None = None
        if split is not None:
            self.arms = {
                name: Binding(p, adapter_keys, source, context, arm=(self, name)) for name, p in arm_policies.items()
            }

    def each(self) -> tuple[Binding, ...]:
        """This binding and its A/B arms' (just itself without a split)."""
        return (self,) if self.arms is None else (self, *self.arms.values())

    @property
    def full_payload_endpoint(self) -> Receiver:
        """Strategy selection for the full-payload accumulator.

        Its ``default`` is ``token_list`` when the policy's is ``cat``: upstream's accumulator keeps a
        list and concatenates once at flush, and ``cat`` means "as upstream"; so is a tuned cell that kept
        ``cat`` (the tuner's baseline: "runs as the default does"); rules apply as written.
        """
        if self._full is None:
            pol = self.policy
            cat_cells = pol.tuned is not None and any(c.strategy == "cat" for c in pol.tuned.cells)
            if pol.default.strategy == "cat" or cat_cells:
                data = pol.model_dump(mode="json", exclude_none=True)
                if pol.default.strategy == "cat":
                    data["default"] = "token_list"
                for cell in (data.get("tuned") or {}).get("cells", []):
                    if cell.get("strategy") == "cat":
                        cell["strategy"], cell["params"] = "token_list", {}
                pol = load_policy(data, manager=self.receiver.manager)
            self._full = Receiver(pol, manager=self.receiver.manager, context=self.context)
        return self._full

    def strategy_name(self, path: str, value: Any) -> str:
        """The strategy ``path`` gets for a value of this type (cached: one resolution per key and type)."""
        k = (path, type(value))
        name = self._names.get(k)
        if name is None:
            try:
                name = self.receiver.select(path, value, self.receiver.context)[1].name
            except Exception:  # noqa: BLE001 - a metrics label never fails a chunk
                name = "unknown"
            self._names[k] = name
        return name

    def appends(self, path: str, value: Any) -> bool:
        """Whether this binding's policy appends key ``path`` for a value of this type (its strategy, from
        :meth:`strategy_name`'s cache, is of the append kind)."""
        return self.strategy_name(path, value) in self._append_kind

    def bucket_labels(self, ctx: StreamContext | None) -> tuple[str, str]:
        """``(context_bucket, concurrency_bucket)`` metric labels of a request's context (``none``: no table, or
        one measured in another environment, which no request uses)."""
        if ctx is None or self.policy.tuned is None or not self.policy.tuned_usable():
            return "none", "none"
        return str(ctx.context_len), str(ctx.concurrency)

    def received(
        self,
        payload: Mapping[str, Any],
        seconds: float | None,
        new_request: bool,
        req_id: Any = None,
        role: str = "receive",
        counted: bool = False,
    ) -> None:
        """Metrics of one received chunk (``accumulate``: one step of the full-payload accumulator): per
        key, and the hook's time under the strategy of its first append-kind key (``replace`` when it has
        none). ``counted``: the hook's merge already counted the keys (see :meth:`.metrics.Recorder.arm`),
        and recorded the time too when ``seconds`` is None."""
        rec = self.metrics
        if not rec.on:
            return
        if new_request:
            rec.request(role, *self.bucket_labels(self.req_ctx.get(req_id)))
        rec.received(payload, seconds, self.strategy_name, MARKERS, role, counted)

    def publish(self) -> None:
        """Publish this binding's metrics with the process's held-bytes and active-request gauges."""
        held, active = 0, {"send": 0, "receive": 0, "accumulate": 0}
        for obj, top in bindings():
            for state in HELD_HOOKS:  # the producing stage's full-payload accumulators (async_chunk: false)
                try:
                    nbytes, ids = state(obj)
                    held, active["accumulate"] = held + nbytes, active["accumulate"] + len(ids)
                except Exception:  # noqa: BLE001 - a gauge never fails vllm-omni
                    pass
            for other in top.each():
                try:
                    held += other.receiver.nbytes()
                    if other.prefill_nbytes is not None:
                        held += other.prefill_nbytes()
                except Exception:  # noqa: BLE001 - a gauge never fails vllm-omni
                    pass
                active["send"] += other.sender.active_requests
                active["receive"] += other.receiver.active_requests
        self.metrics.flush((held, active))
        if self.arms is not None:
            for a in self.arms.values():
                a.metrics.flush()

    def context_of(self, req_id: Any) -> StreamContext:
        """The stream context strategy selection uses for ``req_id`` (its handshake bucket, else the binding's)."""
        return self.req_ctx.get(req_id) or self.receiver.context

    # -- the stage handshake: the sender decides the bucket, the receiver follows ------------------ #
    def decide(self, req_id: str, chunk: Mapping[str, Any]) -> int:
        """Sender side, first chunk: the tuned bucket for ``req_id`` (:func:`.handshake.decide`)."""
        return handshake.decide(self, req_id, chunk)

    def bucket_context(self, bucket: int) -> StreamContext | None:
        """The stream context of a tuned bucket index (:func:`.handshake.bucket_context`)."""
        return handshake.bucket_context(self.policy, bucket)

    def accept(self, req_id: str, payload: Mapping[str, Any], new: bool) -> bool:
        """Receiver side: read the handshake (:func:`.handshake.accept`); False: another policy sent it."""
        return handshake.accept(self, req_id, payload, new)

    def tracks(self, path: str, value: Any, ar: bool, context: StreamContext | None = None) -> tuple[bool, bool]:
        """``(merge it, hand over the accumulated view)`` for a key reaching a receiving adapter.

        ``cat`` means "as upstream", and 0.30.0's adapter hands raw deltas over: a key under ``cat``
        (the ``default`` policy) is not accumulated here, even under chunked prefill. A key whose
        strategy encodes its wire form (other than leaving it off: the ``delta`` plugin) is merged and
        handed over decoded, on any adapter.
        """
        strategy, spec = self.receiver.select(path, value, context or self.receiver.context)
        accumulate = ar and path in self.adapter_keys and "append" in spec.kinds and spec.name != "cat"
        decoded = not strategy.omits_unchanged and _changes_wire(strategy)
        return accumulate or decoded or strategy.omits_unchanged, accumulate or decoded

    def forget(self, req_id: Any) -> None:
        """Release the receive-side state of ``req_id`` (upstream released the request)."""
        self.receiver.release(req_id)
        self.held_once.pop(req_id, None)
        self.fell_back.discard(req_id)
        self.req_ctx.pop(req_id, None)
        self.foreign.pop(req_id, None)
        self.mirror.pop(req_id, None)
        self.said_lost.discard(req_id)
        if self.arms is not None:
            self.recv_arm.pop(req_id, None)
            for a in self.arms.values():
                a.forget(req_id)
        if self.arm is None:  # an arm's are published with its split's binding
            published_later(self)

    def fall_back(self, req_id: str, error: AccumulationError, where: str, *, release: bool = True) -> None:
        """omni-accum refused a chunk of ``req_id``: log it (once per request until it is released) and
        release its Receiver state; the caller lets upstream's code handle the chunk, and the next one
        re-seeds. ``release=False`` (full-payload accumulator, whose entry stays upstream's until it is
        flushed): log only."""
        self.metrics.fallback("refused_chunk")
        if req_id not in self.fell_back:
            if release:
                self.fell_back.add(req_id)
                then = "this chunk, and omni-accum goes on from upstream's state with the next one"
            else:
                then = "this step and the rest of the request until it is flushed"
            from omni_accum.policy.fingerprint import dist_version

            logger.warning(
                "omni-accum refused a chunk in %s: request %r, key %r: %s. vllm-omni %s's own code handles %s "
                "(not logged again for this request)",
                where,
                req_id,
                error.key,
                error.reason,
                dist_version("vllm-omni") or "(its release)",
                then,
            )
        if release:
            self.receiver.release(req_id)

    def close(self) -> None:
        """Release every request's state (uninstall), publish what this binding counted (a request still live
        counted chunks that no release will publish now) and let its ``omni_accum_policy_info`` series go once
        no other binding runs that policy (an uninstall, then an install of another, showed two policies running)."""
        for rid in self.receiver.request_ids():
            self.receiver.release(rid)
        for rid in self.sender.request_ids():
            self.sender.release(rid)
        self.sent_once.clear()
        self.live_send.clear()
        self.send_refused.clear()
        self.held_once.clear()
        self.req_ctx.clear()
        self.send_ctx.clear()
        self.foreign.clear()
        self.mirror.clear()
        self.said_lost.clear()
        self.fell_back.clear()
        self.recv_arm.clear()
        for a in self.each()[1:]:
            a.close()
        peer.withdraw(self)  # its hello (receiving), its watcher (sending)
        if self.arm is None:
            for x in self.each():
                try:
                    x.metrics.flush()  # at once: uninstall() returns with them published
                except Exception:  # noqa: BLE001 - metrics never fail vllm-omni
                    logger.debug("omni-accum: publishing metrics failed", exc_info=True)
            if self.info is not None:
                metrics.policy_info_done(*self.info)
                self.info = None
            # the gauges (every binding's: bindings() takes _lock, which bind() holds here) and the status file soon
            published_later(self)


def binding_for(obj: Any) -> Binding | None:
    """The binding of ``obj`` (created on first use), or None when no policy applies to it.

    Never raises: an object without a ``__dict__`` gets none, and a binding that cannot be made (a bad
    policy or context setting in the connector ``extra``) is logged once, naming the setting, and that
    instance runs vllm-omni's own code.
    """
    state = getattr(obj, "__dict__", None)
    if not isinstance(state, dict):
        return None
    b = state.get(_ATTR, False)
    if b is not False:
        return b
    with _lock:
        b = state.get(_ATTR, False)
        if b is not False:
            return b
        b = None
        try:
            made = check_extra(extra := connector_extra(obj))
            if made is not None:
                policy, source, keys, context = made
                b = Binding(policy, keys, source, context)
                _attach(obj, b)
                _warn_untuned_context(policy, context, source)
                what = (type(obj).__name__, os.getpid(), source, deployment.context_label(policy, context, extra))
                logger.info("omni-accum bound to %s (pid=%d, policy from %s, %s)", *what)
        except Exception as e:  # noqa: BLE001 - a hooked path never raises where vllm-omni would not
            b = None
            metrics.fallback("bind_error")
            what = (type(obj).__name__, os.getpid(), e)
            logger.error("omni-accum cannot bind %s (pid=%d): %s. This instance runs vllm-omni's own code", *what)
        state[_ATTR] = b
        _track(obj)
    if b is not None and Settings.on_change is not None:
        # the status file names the new binding soon, written by the publisher thread: binding_for runs on
        # vllm-omni's receiving / saving threads, under the adapter's state locks, where no file is written
        publishing.published_later(b)
    return b


def _changed() -> None:
    hook = Settings.on_change
    if hook is not None:
        try:
            hook()
        except Exception:  # noqa: BLE001 - reporting must never fail vllm-omni
            logger.debug("omni-accum: status update failed", exc_info=True)


publishing.after_publish = _changed  # the status file follows each publish
publishing.flush_all = metrics.flush_all  # at exit: every Recorder's counts, released or not


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


