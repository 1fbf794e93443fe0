"""The stage handshake: the sender decides each request's tuned bucket at its first chunk and says
which policy it runs (fingerprint, short source) in that chunk's marker; the receiver follows the
bucket, and leaves a request sent under another policy to vllm-omni's own code.

Functions here take a :class:`.binding.Binding` as ``self`` (its methods delegate here).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from omni_accum.context import StreamContext
from omni_accum.engine import Receiver
from omni_accum.integrations.vllm_omni.marker import OMITTED_KEY, _leaves, _path, hello_of
from omni_accum.manager import get_manager
from omni_accum.policy import Policy

logger = logging.getLogger("omni_accum.vllm_omni")


def decide(self: Any, req_id: str, chunk: Mapping[str, Any]) -> int:
    """Sender side, first chunk of ``req_id``: the tuned bucket for it (-1: no tuned table), from the
    deployment context when one is set, else from what the chunk shows (the length of ``ids.prompt``, or
    the rows of its first append-kind tensor key) and the requests live on this sender (this one
    included; under an A/B split, on every arm of it: the adapter's load, as tune measured it). A deployment
    context that sets only the concurrency leaves the context length to the chunk. The request's strategies
    then follow that bucket on both ends."""
    table = self.policy.tuned
    ctx = self.context
    if table is not None and (ctx is None or ctx.context_len is None):
        concurrency = ctx.concurrency if ctx is not None else live_requests(self, req_id)
        ctx = StreamContext(context_len=_context_len(self, chunk), concurrency=concurrency)
    if table is None or ctx is None:
        return -1
    c_edge, k_edge, clamped = table.bucket(ctx)
    if clamped and not self.__dict__.get("_said_clamped"):  # once per binding: the table does not cover the traffic
        self._said_clamped = True
        logger.info(
            "omni-accum: request %r (context length %s, concurrency %s) is outside the tuned table's buckets "
            "(context_len edges %s, concurrency edges %s): it runs the nearest end bucket's strategies "
            "(context_len>=%s, concurrency>=%s), which were measured at that edge; tune with edges that cover the "
            "deployment's traffic (said once for this stage)",
            req_id, ctx.context_len, ctx.concurrency, table.context_len_edges, table.concurrency_edges, c_edge, k_edge,
        )  # fmt: skip
    self.send_ctx[req_id] = StreamContext(context_len=c_edge, concurrency=k_edge)
    return table.context_len_edges.index(c_edge) * len(table.concurrency_edges) + table.concurrency_edges.index(k_edge)


def live_requests(b: Any, rid: str) -> int:
    """The concurrency a request ``rid`` is decided at on binding ``b``: the requests live on its sending adapter (on
    every arm of an A/B split), ``rid`` included (the stage input processor asks before the request's first put)."""
    live = [x.live_send for x in b.top.each()]
    return max(1, sum(len(s) for s in live) + all(rid not in s for s in live))


def bucket_context(policy: Policy, bucket: int) -> StreamContext | None:
    """The stream context of bucket index ``bucket`` of the tuned table (None: no bucket or no table)."""
    table = policy.tuned
    if table is None or bucket < 0:
        return None
    n = len(table.concurrency_edges)
    if bucket >= n * len(table.context_len_edges):
        return None
    return StreamContext(
        context_len=table.context_len_edges[bucket // n], concurrency=table.concurrency_edges[bucket % n]
    )


def accept(self: Any, req_id: str, payload: Mapping[str, Any], new: bool) -> bool:
    """Receiver side: read the handshake of a request's first chunk. True: omni-accum handles the
    request (its bucket applied); False: the sender runs another policy (logged once per request,
    counted), and the request is 0.30.0's own until it is released."""
    raw = payload.get(OMITTED_KEY)
    hello = hello_of(raw)
    if hello is None:
        if new:
            self.foreign.pop(req_id, None)
            self.req_ctx.pop(req_id, None)
        return req_id not in self.foreign
    fp, bucket, their_source = hello
    if fp != self.fingerprint:
        if req_id not in self.foreign:
            self.foreign[req_id] = (fp, their_source)
            self.metrics.fallback("policy_mismatch")
            logger.error(
                "omni-accum: request %r was sent under another policy (sender fingerprint %s, policy from %s; "
                "this stage %s, policy from %s). Every stage must run the same policy; vllm-omni's own code "
                "handles this request",
                req_id,
                fp,
                their_source,
                self.fingerprint,
                self.source,
            )
        return False
    self.foreign.pop(req_id, None)
    ctx = bucket_context(self.policy, bucket)
    if ctx is not None:
        self.req_ctx[req_id] = ctx
    return True


class _RequestContextReceiver(Receiver):
    """The binding's Receiver: a request's first merge takes the context of its handshake bucket."""

    def __init__(self, binding: Any, policy: Policy, *, context: StreamContext | None) -> None:
        super().__init__(policy, context=context)
        self._binding = binding

    def merge(self, req_id: str, wire: Mapping[str, Any], *, context: StreamContext | None = None, **kw: Any) -> Any:
        return super().merge(req_id, wire, context=context or self._binding.req_ctx.get(req_id), **kw)


def _readable_source(source: str, installed_source: str) -> str:
    """Where a binding's policy came from, as an operator reads it (the ``omni_accum_policy_info``
    label): the installed policy's own source for ``install()``, with the value of
    ``OMNI_ACCUM_POLICY`` when that is where it came from (``OMNI_ACCUM_POLICY=qwen3-omni``), shortened as
    ``install(text)`` describes its policy (a label value is one bounded line: inline YAML there was the whole
    policy, newlines and all): ``OMNI_ACCUM_POLICY (inline policy text)``."""
    if source == "install()":
        source = installed_source
    if source == "OMNI_ACCUM_POLICY":
        value = text_source(os.environ.get(source, "").strip())
        source = f"OMNI_ACCUM_POLICY={value}" if value != INLINE else f"OMNI_ACCUM_POLICY ({INLINE})"
    return source


#: How a policy given as its text (not a name or a path) is described: a description is one bounded line.
INLINE = "inline policy text"


def text_source(text: str) -> str:
    """A policy reference as given (a preset name, a path) when it is one line of at most 120 characters, else
    :data:`INLINE` (``install(text)`` and ``OMNI_ACCUM_POLICY`` alike)."""
    return text if "\n" not in text and len(text) <= 120 else INLINE


def _short_source(source: str, installed_source: str) -> str:
    """A few bytes naming where a binding's policy came from, for the handshake: the preset or file name
    when short, else the kind of source."""
    if source == "install()":
        source = installed_source
    if source == "OMNI_ACCUM_POLICY":
        source = os.environ.get(source, "").strip() or source
    if source.startswith("connector extra"):
        return "extra"
    name = os.path.basename(source.rstrip("/")) if "/" in source else source
    return name if len(name) <= 24 and "\n" not in name else "install"


def _changes_wire(strategy: Any) -> bool:
    """True when a strategy's encoder may change what goes on the wire (send_once, delta ...)."""
    from omni_accum.strategy import Strategy

    return strategy.omits_unchanged or type(strategy).new_encoder is not Strategy.new_encoder


def _context_len(b: Any, chunk: Mapping[str, Any]) -> int | None:
    """The prompt length the chunk carries (``ids.prompt``: the whole prompt, also when the prefill comes
    in several chunks), else the rows of its first append-kind tensor key (2-D or more), else None."""
    ids = chunk.get("ids")
    prompt = ids.get("prompt") if isinstance(ids, Mapping) else None
    if isinstance(prompt, (list, tuple)) and prompt:
        return len(prompt)
    if getattr(prompt, "dim", None) is not None and prompt.dim() == 1 and prompt.numel():
        return int(prompt.numel())
    for top, qual, value in _leaves(chunk):
        if getattr(value, "dim", None) is not None and value.dim() >= 2:
            try:
                spec = b.receiver.select(_path(top, qual), value, b.receiver.context)[1]
            except Exception:  # noqa: BLE001 - no strategy: not an append key
                continue
            if "append" in spec.kinds:
                return int(value.shape[0])
    return None


def policy_fingerprint(policy: Policy, manager: Any = None) -> str:
    """A short fingerprint of a resolved policy: its rules, strategies, params and tuned table, and the
    distribution versions of the strategy plugins it names. Equal on two stages that run the same policy. An A/B
    split's takes in each arm's resolved policy, in the arms' order (which lays out their shares)."""
    data = policy.model_dump(mode="json", exclude_none=True)
    if policy.ab is not None:
        data["ab_resolved"] = [
            [name, policy.ab.arms[name].weight, arm.model_dump(mode="json", exclude_none=True)]
            for name, arm in policy.arm_policies().items()
        ]
    text = json.dumps(data, sort_keys=True, default=str)
    versions = {}
    if manager is None:
        manager = get_manager()
    for spec in manager.specs():
        if f'"{spec.name}"' in text:
            versions[spec.name] = list(spec.distribution) if spec.distribution else None
    blob = json.dumps([data, versions], sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]
