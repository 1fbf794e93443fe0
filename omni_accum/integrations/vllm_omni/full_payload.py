"""Full-payload accumulator hooks (``async_chunk: false``): per-key strategies instead of upstream's
list-then-``torch.cat`` in ``accumulate_full_payload_output`` / ``_materialize_full_payload_entry``.

Upstream's rules are kept (``None`` skipped; 2-D+ tensors appended while the trailing shape holds,
restarted otherwise; ``_FULL_PAYLOAD_REPLACE_KEYS`` restart; anything else replaced); only how an
appended key is stored follows the policy.

The hand-off of the whole payload (kind ``full``, :mod:`.handoff`) is timed around the runner transport's
``_send_single_request`` (the sender's clock added to the task's payload, once the receiving transport said
hello) and its ``_recv_full_payload_result`` (the marker taken off before vllm-omni stores the payload). Each
whole payload put counts as a chunk sent of the sending binding, each one got as a chunk received of the receiving
one (``stats`` and the Prometheus counters: its keys and bytes under role ``send`` / ``receive``, a request of that
role; no merge time, nothing is merged), and both publish their binding's metrics and the status file soon after
(as a release does). The accumulator's steps on the producing stage are counted as ``accumulated`` (and under role
``accumulate``), not as chunks received: nothing was received there.

A step whose value a strategy refuses (a dtype change, which upstream's final ``torch.cat``
promotes), or that would make the entry's accumulators hold more than the policy's
``max_bytes_per_request`` (checked before anything is allocated, as the Receiver's guard is), is not an
error inside vllm-omni: the entry is turned into upstream's representation (each key's rows so far as
one tensor) and upstream's own method takes the step; that request's entry stays upstream's until it is
flushed (counted as ``refused_chunk``, logged once). ``uninstall`` turns every pending entry back the same way.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from omni_accum.engine import Receiver
from omni_accum.errors import AccumulationError
from omni_accum.integrations.vllm_omni import handoff, peer
from omni_accum.integrations.vllm_omni.binding import binding_for
from omni_accum.integrations.vllm_omni.instances import DETACH_HOOKS, HELD_HOOKS
from omni_accum.integrations.vllm_omni.marker import MARKERS, OMITTED_KEY, with_stamp
from omni_accum.integrations.vllm_omni.publishing import published_later
from omni_accum.strategy import Accumulator, KeyInfo


# ---------------------------------------------------------------------------------------------- #
# Full-payload accumulator (async_chunk=false): accumulate_full_payload_output, _materialize_...
# ---------------------------------------------------------------------------------------------- #


class PolicyChunks:
    """First element of a full-payload entry: one strategy accumulator per 2-D+ tensor key.

    Lives inside upstream's ``_pending_full_payload_send`` entry, so it is freed exactly when
    upstream drops the entry (flush, cleanup, abort).
    """

    __slots__ = ("endpoint", "req_id", "accs", "rows", "trailing", "publish")

    def __init__(self, endpoint: Receiver, req_id: str, publish: Callable[[], None] | None = None) -> None:
        self.endpoint = endpoint
        self.req_id = req_id
        self.publish = publish  # publishes the binding's metrics once the request's payload is handed over
        self.accs: dict[str, Accumulator] = {}
        self.rows: dict[str, int] = {}
        self.trailing: dict[str, tuple[int, ...]] = {}

    def start(self, key: str, value: torch.Tensor, acc: Accumulator | None = None) -> None:
        """Start ``key`` with an accumulator of its append-kind strategy (``acc``: one :meth:`fresh` made)."""
        acc = acc if acc is not None else self.fresh(key, value)
        self.accs[key], self.rows[key], self.trailing[key] = acc, int(value.shape[0]), tuple(value.shape[1:])

    def fresh(self, key: str, value: torch.Tensor) -> Accumulator:
        """A new accumulator of ``key``'s append-kind strategy holding ``value`` (:meth:`make`, then :meth:`fill`);
        nothing of the entry changes."""
        return self.fill(key, self.make(key, value), value)

    def make(self, key: str, value: torch.Tensor) -> Accumulator:
        """A new, empty accumulator of ``key``'s append-kind strategy for ``value`` (nothing allocated for it yet).
        Upstream appends every 2-D+ tensor here, whatever the key means in async-chunk mode; so a key whose policy
        strategy is not append-kind (``codes.audio: replace`` in the ``qwen3-omni`` preset, ``send_once``) keeps
        upstream's append semantics, with ``token_list`` (upstream's list-then-concatenate-once) storing it.
        :class:`AccumulationError` for anything raising (a selection hook, a strategy's factory)."""
        try:
            strategy, spec = self.endpoint.select(key, value, self.endpoint.context)
            if "append" not in spec.kinds:
                strategy = self.endpoint.manager.build("token_list")
            return strategy.new_accumulator(KeyInfo(key, self.req_id))
        except Exception as e:  # noqa: BLE001 - a plugin raising fails this request's entry, not vllm-omni
            raise _refusal(e, self.req_id, key) from e

    def fill(self, key: str, acc: Accumulator, value: torch.Tensor) -> Accumulator:
        """``acc`` (one :meth:`make` made) with ``value`` merged; :class:`AccumulationError` if its merge raises."""
        try:
            acc.merge(value)
        except Exception as e:  # noqa: BLE001 - a plugin raising fails this request's entry, not vllm-omni
            raise _refusal(e, self.req_id, key) from e
        return acc

    def guard(self, step: dict[str, Any], new: dict[str, Accumulator]) -> None:
        """The policy's ``max_bytes_per_request`` (the Receiver's guard) on the step ``step``, before anything is
        allocated: the keys in ``new`` restart with those accumulators (:meth:`make`, nothing merged yet), the other
        2-D+ tensors of keys held append (checked already), any other value that is not None drops its key. Raises
        :class:`AccumulationError` when the entry's accumulators would hold more than the limit afterwards (each
        touched key counted at :meth:`Accumulator.projected_nbytes`); changes nothing. Off (0): nothing done."""
        limit = self.endpoint.policy.max_bytes_per_request
        if not limit:
            return
        key: str | None = None
        try:
            held = {k: acc.nbytes() for k, acc in self.accs.items()}
            after, worst = sum(held.values()), (0, "")
            for key, value in step.items():
                if value is None:
                    continue
                if key in new:
                    grow = new[key].projected_nbytes(value) - held.get(key, 0)
                elif key in self.accs:
                    grow = (self.accs[key].projected_nbytes(value) if _appendable(value) else 0) - held[key]
                else:
                    continue
                after += grow
                worst = max(worst, (grow, key))
        except Exception as e:  # noqa: BLE001 - a strategy's nbytes / projected_nbytes raising (a plugin's bug)
            raise _refusal(e, self.req_id, key) from e
        if after > limit:
            raise AccumulationError(
                f"would hold {after} bytes after this step (key {worst[1]!r} grows by {worst[0]}), over "
                f"max_bytes_per_request={limit}; step refused before allocating",
                request_id=self.req_id,
                key=worst[1] or None,
            )

    def appends(self, key: str, value: torch.Tensor) -> bool:
        """True when :meth:`add` appends ``value`` (trailing shape unchanged: upstream's rule), False: restarts."""
        return key in self.accs and tuple(value.shape[1:]) == self.trailing[key]

    def check(self, key: str, value: torch.Tensor) -> None:
        """Raise :class:`AccumulationError` when :meth:`add` would refuse ``value``; changes nothing."""
        if self.appends(key, value):
            try:
                self.accs[key].check(value)
            except Exception as e:  # noqa: BLE001 - ValueError, or a plugin's check raising
                raise _refusal(e, self.req_id, key) from e

    def add(self, key: str, value: torch.Tensor) -> None:
        """Append when the trailing shape matches (upstream's rule), else restart the key (the accumulator hook
        restarts through :meth:`fresh` and :meth:`start` instead, having made the new accumulator before any
        change)."""
        if not self.appends(key, value):
            self.start(key, value)
            return
        acc = self.accs[key]
        try:
            acc.check(value)
            acc.merge(value)
        except Exception as e:  # noqa: BLE001 - ValueError, or a plugin's merge raising
            raise _refusal(e, self.req_id, key) from e
        self.rows[key] += int(value.shape[0])

    def drop(self, key: str) -> None:
        self.accs.pop(key, None)
        self.rows.pop(key, None)
        self.trailing.pop(key, None)

    def materialize(self) -> dict[str, Any]:
        return {k: acc.read() for k, acc in self.accs.items()}

    def to_upstream(self) -> dict[str, list[torch.Tensor]]:
        """The ``chunks`` of upstream's entry: each key's rows so far as a one-tensor list."""
        return {k: [v] for k, v in self.materialize().items()}


def held(obj: Any) -> tuple[int, list[str]]:
    """The bytes and the request ids of the full-payload entries omni-accum's accumulators hold on ``obj`` (its
    ``_pending_full_payload_send``, until the payload is sent or dropped): counted in ``omni_accum_held_bytes``
    and as role ``accumulate`` of ``omni_accum_active_requests``. Read from another thread: an entry changed
    meanwhile may be counted before or after the change, nothing else."""
    pending = getattr(obj, "__dict__", {}).get("_pending_full_payload_send")
    if not isinstance(pending, dict):
        return 0, []
    n, ids = 0, []
    for rid, entry in list(pending.items()):
        if isinstance(entry, tuple) and len(entry) == 4 and isinstance(entry[0], PolicyChunks):
            ids.append(rid)
            n += sum(acc.nbytes() for acc in list(entry[0].accs.values()))
    return n, ids


def _refusal(e: Exception, req_id: str, key: str | None) -> AccumulationError:
    """``e`` as the refusal :meth:`.Binding.fall_back` reports (a strategy's ValueError, or a plugin's bug)."""
    if isinstance(e, AccumulationError):
        return e
    reason = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    return AccumulationError(reason, request_id=req_id, key=key)


def to_upstream_entry(entry: tuple[Any, ...]) -> tuple[Any, ...]:
    """An entry of ``_pending_full_payload_send`` in 0.30.0's own representation (unchanged if it is already)."""
    if len(entry) != 4 or not isinstance(entry[0], PolicyChunks):
        return entry
    chunks, latest, _, request = entry
    return chunks.to_upstream(), latest, dict(chunks.rows), request


def restore_upstream_entries(pending: dict[Any, Any]) -> None:
    """Turn every omni-accum entry of a ``_pending_full_payload_send`` into upstream's representation."""
    for req_id, entry in list(pending.items()):
        if isinstance(entry, tuple) and len(entry) == 4 and isinstance(entry[0], PolicyChunks):
            pending[req_id] = to_upstream_entry(entry)


def _appendable(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() >= 2


def _refused(b: Any, req_id: str, error: AccumulationError, where: str) -> None:
    """A step omni-accum refused: counted (``refused_chunk``) and logged once for the request (:meth:`.Binding.
    fall_back`; the entry stays upstream's until it is flushed) and published soon (the count reaches Prometheus
    now: upstream's entry publishes nothing when it is handed over)."""
    b.fall_back(req_id, error, where, release=False)
    published_later(b)


def wrap_accumulate_full(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def accumulate_full_payload_output(self: Any, req_id: str, pooler_output: Any, request: Any) -> None:
        b = binding_for(self)
        pending = self._pending_full_payload_send
        existing = pending.get(req_id)
        if b is None or (existing is not None and not isinstance(existing[0], PolicyChunks)):
            return orig(self, req_id, pooler_output, request)
        b.stats["accumulated"] += 1  # a step of the producing stage's accumulator: nothing was received
        t0 = time.perf_counter()
        where = f"{type(self).__name__}.accumulate_full_payload_output"
        if existing is None:
            chunks, latest = PolicyChunks(b.full_payload_endpoint, req_id, b.publish), {}
            try:
                new = {k: chunks.make(k, v) for k, v in pooler_output.items() if _appendable(v)}
                chunks.guard(pooler_output, new)  # max_bytes_per_request, before anything is merged
                for k, v in pooler_output.items():
                    if k in new:
                        chunks.start(k, v, chunks.fill(k, new[k], v))
                    else:
                        latest[k] = v
            except AccumulationError as e:  # nothing pending yet: upstream's method starts the entry
                _refused(b, req_id, e, where)
                return orig(self, req_id, pooler_output, request)
            pending[req_id] = (chunks, latest, chunks.rows, request)
            b.received(pooler_output, time.perf_counter() - t0, True, req_id, "accumulate")
            return None
        chunks, latest, _, _ = existing
        replace_keys = self._resolve_full_payload_replace_keys()
        fresh: dict[str, Accumulator] = {}  # the keys this step (re)starts, their accumulators made before any change
        try:  # all or nothing: every appended value is checked, and the step guarded, before anything changes
            for k, v in pooler_output.items():
                if _appendable(v):
                    if k in replace_keys or not chunks.appends(k, v):
                        fresh[k] = chunks.make(k, v)
                    else:
                        chunks.check(k, v)
            chunks.guard(pooler_output, fresh)  # max_bytes_per_request, before anything is merged
            for k, acc in fresh.items():
                chunks.fill(k, acc, pooler_output[k])
        except AccumulationError as e:
            _refused(b, req_id, e, where)
            pending[req_id] = to_upstream_entry(existing)
            return orig(self, req_id, pooler_output, request)
        done = 0
        try:
            for k, v in pooler_output.items():
                if v is not None:
                    if _appendable(v):
                        latest.pop(k, None)
                        if k in fresh:
                            chunks.start(k, v, fresh[k])
                        else:
                            chunks.add(k, v)
                    else:
                        chunks.drop(k)
                        latest[k] = v
                done += 1
        except AccumulationError as e:  # a strategy's merge raising after its check passed (a plugin's bug):
            # the keys taken so far stay (the failing one's rows as its strategy left them); upstream takes the rest
            _refused(b, req_id, e, where)
            pending[req_id] = to_upstream_entry((chunks, latest, chunks.rows, request))
            return orig(self, req_id, dict(list(pooler_output.items())[done:]), request)  # the keys not taken
        pending[req_id] = (chunks, latest, chunks.rows, request)
        b.received(pooler_output, time.perf_counter() - t0, False, req_id, "accumulate")
        return None

    return accumulate_full_payload_output


def wrap_materialize(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def _materialize_full_payload_entry(entry: Any) -> Any:
        if len(entry) == 4 and isinstance(entry[0], PolicyChunks):
            chunks, latest, _, request = entry
            output = dict(latest)
            output.update(chunks.materialize())
            if chunks.publish is not None:
                chunks.publish()
            return output, request
        return orig(entry)

    return _materialize_full_payload_entry


def wrap_full_send(orig: Callable[..., Any]) -> Callable[..., Any]:
    """The runner transport's put of a queued task: a full payload (``async_chunk: false``) whose receiving
    stage said hello goes with the sender's clock (kind ``full``); any other task is vllm-omni's own."""

    @functools.wraps(orig)
    def _send_single_request(self: Any, task: dict) -> bool:
        data = task.get("data") if isinstance(task, dict) else None
        if getattr(self, "_async_chunk", True) is not False or not isinstance(data, dict) or OMITTED_KEY in data:
            return orig(self, task)
        b = binding_for(self)
        conn = getattr(self, "_omni_connector", None)
        if b is None or conn is None:
            return orig(self, task)
        if b.metrics.on:
            peer.watch(b, conn)
            if handoff.heard(b):  # a copy: a retried task is stamped afresh
                stamp = (time.monotonic_ns(), handoff.clock_id(), "f")
                task = {**task, "data": {**data, OMITTED_KEY: with_stamp(0, stamp)}}
        sent = orig(self, task)
        if sent is True:  # put (False: vllm-omni retries the task)
            b.stats["chunks_sent"] += 1  # a whole payload, counted as a chunk is (status, the status file)
            _count_whole(b, data, "send")
            published_later(b)
        return sent

    return _send_single_request


def _count_whole(b: Any, payload: dict, role: str) -> None:
    """A whole payload put (``send``) or got (``receive``): one chunk of a request of its own in the Prometheus
    counters, as a chunk of that role is counted (its keys, their bytes, the request), the markers left out."""
    rec = b.metrics
    if rec.on:
        rec.request(role, *b.bucket_labels(None))
        rec.whole(payload, b.strategy_name, MARKERS, role)


def wrap_transport_init(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``init_omni_connectors`` while installed: a transport that receives full payloads says hello at once (its
    binding made now). The family wraps the probe inside this (:func:`.families.v030.wrap_transport_init`): a bad
    connector extra is checked there, fatal under ``OMNI_ACCUM_REQUIRED=1``, as before install."""

    @functools.wraps(orig)
    def init_omni_connectors(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, *args, **kwargs)
        if peer.receives(self):
            b = binding_for(self)
            if b is not None:
                peer.announce(self, b)
        return result

    return init_omni_connectors


def wrap_full_recv(orig: Callable[..., Any]) -> Callable[..., Any]:
    """The runner transport's get of a full payload: a receiving transport bound to a policy says hello (at its
    first look, :mod:`.peer`); a timed payload's marker is taken off and its hand-off recorded."""

    @functools.wraps(orig)
    def _recv_full_payload_result(self: Any, *args: Any, **kwargs: Any) -> Any:
        b = binding_for(self)
        if b is not None:
            if b.__dict__.get("_hello") is None:
                peer.announce(self, b)
            else:
                peer.keep_hello(self, b)  # said again if another replica of the stage withdrew it
        result = orig(self, *args, **kwargs)
        payload = result[0] if isinstance(result, tuple) and result else None
        if isinstance(payload, dict) and OMITTED_KEY in payload:
            raw = payload[OMITTED_KEY]
            payload = {k: v for k, v in payload.items() if k != OMITTED_KEY}
            if b is not None and raw.__class__ is list:
                handoff.arrived(b, getattr(self, "_stage_id", None), raw, payload)
            result = (payload, *result[1:])
        if b is not None and isinstance(payload, dict):
            b.stats["chunks_received"] += 1  # a whole payload, counted as a chunk is
            _count_whole(b, payload, "receive")
            published_later(b)  # its hand-off reaches Prometheus and the status file now, not at the 256th
        return result

    return _recv_full_payload_result


def _detach(obj: Any) -> None:
    pending = obj.__dict__.get("_pending_full_payload_send")
    if isinstance(pending, dict):
        restore_upstream_entries(pending)


DETACH_HOOKS.append(_detach)
HELD_HOOKS.append(held)
