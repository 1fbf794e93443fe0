"""Prometheus metrics of omni-accum inside vllm-omni (``prometheus_client``, the library vLLM uses).

Metrics live in ``prometheus_client``'s default registry. In a vllm-omni server the stage processes
are separate OS processes; with ``PROMETHEUS_MULTIPROC_DIR`` set (vLLM sets it for its own
multi-process metrics) every process writes its values there and the API server's ``/metrics``
collects them all, exactly as vLLM's own metrics travel. On by default when ``prometheus_client``
imports; ``OMNI_ACCUM_METRICS=0`` turns them off.

The hot path never touches ``prometheus_client``: each binding's :class:`Recorder` adds to plain
dict counters (a dict increment per key), and publishes them when a request is released and every
:data:`FLUSH_EVERY` chunks. Wire bytes count the tensors' bytes (lists, strings and scalars count 0).
Label values are bounded: key
paths, strategy names, roles, buckets, reasons; never request ids.

=============================================  =========  ============================================
metric                                         type       labels
=============================================  =========  ============================================
``omni_accum_chunks_total``                    counter    ``role`` (send/receive), ``key``, ``strategy``
``omni_accum_requests_total``                  counter    ``role``, ``context_bucket``, ``concurrency_bucket``
``omni_accum_wire_bytes_total``                counter    ``role``, ``key`` (payload bytes of the values)
``omni_accum_wire_bytes_saved_total``          counter    ``key``, ``strategy`` (bytes kept off the wire)
``omni_accum_fallbacks_total``                 counter    ``reason``
``omni_accum_held_bytes``                      gauge      (bytes held by live requests, this process)
``omni_accum_active_requests``                 gauge      ``role``
``omni_accum_merge_seconds``                   histogram  ``strategy`` (of the chunk's first append key)
``omni_accum_policy_info``                     gauge = 1  ``source``, ``fingerprint``, ``version``
=============================================  =========  ============================================
"""

from __future__ import annotations

import logging
import os
import threading
from collections import defaultdict
from typing import Any

import torch

logger = logging.getLogger("omni_accum.vllm_omni")

ENV_METRICS = "OMNI_ACCUM_METRICS"
#: Chunks after which a Recorder publishes without waiting for a release.
FLUSH_EVERY = 256
MERGE_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1, 1.0)

_lock = threading.Lock()
_metrics: dict[str, Any] | None = None
_unavailable = False


def enabled() -> bool:
    """True when metrics are on (``OMNI_ACCUM_METRICS`` not 0/off/false) and ``prometheus_client`` imports."""
    if os.environ.get(ENV_METRICS, "1").strip().lower() in ("0", "off", "false", "no"):
        return False
    return _registry_metrics() is not None


def _registry_metrics() -> dict[str, Any] | None:
    """The metric objects, created once per process in the default registry (None: unavailable)."""
    global _metrics, _unavailable
    if _metrics is not None or _unavailable:
        return _metrics
    with _lock:
        if _metrics is not None or _unavailable:
            return _metrics
        try:
            from prometheus_client import Counter, Gauge, Histogram
        except ImportError:
            _unavailable = True
            return None
        _metrics = {
            "chunks": Counter("omni_accum_chunks_total", "Payload chunks per key", ["role", "key", "strategy"]),
            "requests": Counter(
                "omni_accum_requests_total", "Requests seen", ["role", "context_bucket", "concurrency_bucket"]
            ),
            "wire": Counter("omni_accum_wire_bytes_total", "Payload bytes of the values on the wire", ["role", "key"]),
            "saved": Counter(
                "omni_accum_wire_bytes_saved_total", "Bytes a strategy kept off the wire", ["key", "strategy"]
            ),
            "fallbacks": Counter("omni_accum_fallbacks_total", "Chunks left to vllm-omni's own code", ["reason"]),
            "held": Gauge("omni_accum_held_bytes", "Bytes held by live requests", multiprocess_mode="livesum"),
            "active": Gauge(
                "omni_accum_active_requests", "Requests holding state", ["role"], multiprocess_mode="livesum"
            ),
            "merge": Histogram(
                "omni_accum_merge_seconds", "Time a receive hook spends per chunk", ["strategy"], buckets=MERGE_BUCKETS
            ),
            "info": Gauge(
                "omni_accum_policy_info",
                "The policy a binding runs (value 1)",
                ["source", "fingerprint", "version"],
                multiprocess_mode="liveall",
            ),
        }
        return _metrics


class Recorder:
    """Per-binding event counts, published to Prometheus in batches (see the module docstring).

    The hot path (:meth:`chunk_leaves`) is a loop of dict increments over the chunk's keys; the key's
    label tuples are built once per (role, key, value type) and cached.
    """

    __slots__ = (
        "counts",
        "nbytes",
        "saved",
        "fallbacks",
        "requests",
        "merges",
        "chunks_seen",
        "on",
        "_labels",
        "_children",
    )

    def __init__(self) -> None:
        self.on = enabled()
        self.counts: defaultdict[tuple[str, str, str], int] = defaultdict(int)
        self.nbytes: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.saved: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.fallbacks: defaultdict[str, int] = defaultdict(int)
        self.requests: defaultdict[tuple[str, str, str], int] = defaultdict(int)
        self.merges: list[tuple[str, float]] = []
        self.chunks_seen = 0
        self._labels: dict[Any, tuple[tuple[str, str, str], tuple[str, str]]] = {}
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}

    def labels(
        self, role: str, top: Any, qual: Any, value: Any, name_of: Any
    ) -> tuple[tuple[str, str, str], tuple[str, str]]:
        """``((role, key, strategy), (role, key))`` for a leaf, cached per (role, key, value type)."""
        k = (role, top, qual, type(value))
        got = self._labels.get(k)
        if got is None:
            path = str(top) if qual is None else f"{top}.{qual}"
            got = self._labels[k] = ((role, path, name_of(path, value)), (role, path))
        return got

    def chunk(self, role: str, key: str, strategy: str, nbytes: int) -> None:
        """Count one key of one chunk (the uncached spelling of what :meth:`chunk_leaves` does)."""
        self.counts[(role, key, strategy)] += 1
        self.nbytes[(role, key)] += nbytes

    def chunk_leaves(self, role: str, payload: Any, name_of: Any, skip: Any = ()) -> str | None:
        """Count every key of one chunk; returns the strategy of its first append-kind key (or None)."""
        counts, nbytes, labels, first = self.counts, self.nbytes, self.labels, None
        for top, value in payload.items():
            if top in skip:
                continue
            if type(value) is dict:
                for qual, qv in value.items():
                    c, w = labels(role, top, qual, qv, name_of)
                    counts[c] += 1
                    nbytes[w] += qv.nbytes if isinstance(qv, torch.Tensor) else 0
                    if first is None and c[2] not in _REPLACE_LIKE:
                        first = c[2]
            else:
                c, w = labels(role, top, None, value, name_of)
                counts[c] += 1
                nbytes[w] += value.nbytes if isinstance(value, torch.Tensor) else 0
                if first is None and c[2] not in _REPLACE_LIKE:
                    first = c[2]
        self.chunks_seen += 1
        if self.chunks_seen >= FLUSH_EVERY:
            self.flush()
        return first

    def kept_off(self, key: str, strategy: str, nbytes: int) -> None:
        self.saved[(key, strategy)] += nbytes

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] += 1

    def request(self, role: str, context_bucket: str = "none", concurrency_bucket: str = "none") -> None:
        self.requests[(role, context_bucket, concurrency_bucket)] += 1

    def merge(self, strategy: str, seconds: float) -> None:
        self.merges.append((strategy, seconds))

    def _child(self, m: dict[str, Any], name: str, labels: tuple[str, ...]) -> Any:
        k = (name, labels)
        child = self._children.get(k)
        if child is None:
            child = self._children[k] = m[name].labels(*labels) if labels else m[name]
        return child

    def flush(self, gauges: tuple[int, dict[str, int]] | None = None) -> None:
        """Publish what accumulated since the last flush (and, given, the held-bytes / active gauges)."""
        self.chunks_seen = 0
        m = _registry_metrics() if self.on else None
        if m is None:
            self._clear()
            return
        child = self._child
        for labels, n in self.counts.items():
            if n:
                child(m, "chunks", labels).inc(n)
        for labels, n in self.nbytes.items():
            if n:
                child(m, "wire", labels).inc(n)
        for labels, n in self.saved.items():
            if n:
                child(m, "saved", labels).inc(n)
        for reason, n in self.fallbacks.items():
            child(m, "fallbacks", (reason,)).inc(n)
        for labels, n in self.requests.items():
            child(m, "requests", labels).inc(n)
        for strategy, seconds in self.merges:
            child(m, "merge", (strategy,)).observe(seconds)
        self._clear()
        if gauges is not None:
            held, active = gauges
            m["held"].set(held)
            for role, n in active.items():
                child(m, "active", (role,)).set(n)

    def _clear(self) -> None:
        for d in (self.counts, self.nbytes, self.saved):
            for k in d:
                d[k] = 0
        self.fallbacks.clear()
        self.requests.clear()
        self.merges.clear()


#: Strategies that replace a key's value (not append): the merge histogram's label skips them.
_REPLACE_LIKE = frozenset({"replace", "send_once"})


def policy_info(source: str, fingerprint: str, version: str) -> None:
    """Set ``omni_accum_policy_info{source, fingerprint, version} = 1`` (when metrics are on)."""
    m = _registry_metrics() if enabled() else None
    if m is not None:
        m["info"].labels(source, fingerprint, version).set(1)


def fallback(reason: str) -> None:
    """Count one fallback outside any binding (a binding that could not be made)."""
    m = _registry_metrics() if enabled() else None
    if m is not None:
        m["fallbacks"].labels(reason).inc()
