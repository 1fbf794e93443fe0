"""Live A/B: a policy's ``ab`` section splits requests between named policies (its arms).

A binding made from a policy with an ``ab`` section (:class:`.binding.Binding`) holds one arm binding per arm:
its policy, Sender, Receiver and metrics, with the fingerprint ``<the split's fingerprint>/<arm>``. The chunk
transfer adapter's hooks (:mod:`.send`, :mod:`.receive`) hand each request to its arm's binding, where
everything goes on as without a split (the tuned bucket, the values left off, the hand-off stamps):

* **sending**: a request's arm is :meth:`~omni_accum.policy.model.ABSplit.arm_for` its external request id (a
  stable BLAKE2b hash laid over the weights), decided at its first chunk; every chunk of the request goes
  through that arm (a function of the id: nothing to remember, nothing to leak). The first chunk's hello
  (:func:`.marker.with_hello`) carries the arm binding's fingerprint, so the arm travels with the tuned bucket;
* **receiving**: a request follows the arm its first chunk's hello names when the hello comes from the same
  split (the part before ``/`` is this binding's fingerprint), and keeps it until released. A request whose
  first chunk this receiver never saw (no hello) takes the arm of the hash of its external request id (the
  adapter's ``request_ids_mapping``, else the connector key's prefix): the sender's own rule on the same id, so
  the same arm. A hello from another policy routes by the hash too, and that arm binding hands the request
  to vllm-omni's own code (a fingerprint mismatch, as without a split);
* a receiving stage **without omni-accum** never said hello: the sender sends vllm-omni's own payloads (no
  marker, nothing left off) whatever the arm.

Other paths (the full-payload transport, ``async_chunk: false``; the stage input processor) run the split's
first arm for every request, on both stages.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from omni_accum.integrations.vllm_omni import capture, handoff
from omni_accum.integrations.vllm_omni.marker import OMITTED_KEY, hello_of, stamp_of

_monotonic_ns = time.monotonic_ns


def _share(b: Any, arm: Any) -> Any:
    """What the split's binding holds for its adapter (the peer watcher, the capture) serves its arms too."""
    d, ad = b.__dict__, arm.__dict__
    if "_peer" in d and "_peer" not in ad:
        ad["_peer"] = d["_peer"]
    if "_capture" in d and "_capture" not in ad:  # the same files; records that name the arm (.capture)
        ad["_capture"] = capture.for_arm(d["_capture"], arm)
    return arm


def send_arm(b: Any, ext_id: Any) -> Any:
    """Sending: the arm binding of request ``ext_id`` on split binding ``b``."""
    return _share(b, b.arms[b.split.arm_for(ext_id)])


def external_id(adapter: Any, req_id: Any, connector_key: Any = None) -> Any:
    """The sender's id of a request a receiving adapter knows as ``req_id``: its ``request_ids_mapping``, else
    the prefix of the connector key (``<external id>_<stage>_<chunk>``), else ``req_id``."""
    mapping = getattr(adapter, "request_ids_mapping", None)
    if isinstance(mapping, Mapping) and req_id in mapping:
        return mapping[req_id]
    if isinstance(connector_key, str) and connector_key.count("_") >= 2:
        return connector_key.rsplit("_", 2)[0]
    return req_id


def receive_arm(b: Any, adapter: Any, req_id: Any, payload: Mapping[str, Any], connector_key: Any = None) -> Any:
    """Receiving: the arm binding of the request ``req_id`` whose chunk ``payload`` arrived (see the module)."""
    raw = payload.get(OMITTED_KEY)
    hello = hello_of(raw) if raw.__class__ is list else None
    name = None
    if hello is not None:
        split_fp, _, announced = hello[0].partition("/")
        if split_fp == b.fingerprint and announced in b.arms:
            name = announced
    if name is None:
        name = b.recv_arm.get(req_id)
        if name is None or hello is not None:
            name = b.split.arm_for(external_id(adapter, req_id, connector_key))
    b.recv_arm[req_id] = name
    return _share(b, b.arms[name])


def arrived(b: Any, dst: Any, raw: Any) -> None:
    """Receive hook of an arm binding ``b``, after :func:`.handoff.arrived`: its timed hand-off under its arm
    (``omni_accum_ab_handoff_seconds``), by the same rules (its clock domain, 0 .. ``MAX_SECONDS``)."""
    now = _monotonic_ns()
    if not b.metrics.on:
        return
    got = stamp_of(raw)
    if got is None:
        return
    t, clock, kind = got
    kind = "p" if kind is None else kind
    if kind not in handoff.KINDS or clock != handoff.clock_id():
        return
    seconds = (now - t) / 1e9
    if not 0 <= seconds <= handoff.MAX_SECONDS:
        return
    try:
        pair = f"{int(dst) - 1}->{int(dst)}"
    except (TypeError, ValueError):
        return
    b.metrics.ab_handoff(pair, handoff.KINDS[kind], seconds)
