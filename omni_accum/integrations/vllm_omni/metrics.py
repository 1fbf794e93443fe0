"""Prometheus metrics of omni-accum inside vllm-omni (``prometheus_client``, the library vLLM uses).

Metrics live in ``prometheus_client``'s default registry. In a vllm-omni server the stage processes
are separate OS processes; with ``PROMETHEUS_MULTIPROC_DIR`` set (vLLM sets it for its own
multi-process metrics) every process writes its values there and the API server's ``/metrics``
collects them all, exactly as vLLM's own metrics travel. On by default when ``prometheus_client``
imports; ``OMNI_ACCUM_METRICS=0`` turns them off.

The hot path never touches ``prometheus_client``: each binding's :class:`Recorder` adds to plain
dict counters (a dict increment per key), and publishes them when a request is released, when a
status snapshot is taken, and every :data:`FLUSH_EVERY` events. Label values are bounded: key
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

logger = logging.getLogger("omni_accum.vllm_omni")

ENV_METRICS = "OMNI_ACCUM_METRICS"
#: Pending events after which a Recorder publishes without waiting for a release.
FLUSH_EVERY = 512
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
    """Per-binding event counts, published to Prometheus in batches (see the module docstring)."""

    __slots__ = ("chunks", "wire", "saved", "fallbacks", "requests", "merges", "pending", "on")

    def __init__(self) -> None:
        self.on = enabled()
        self.chunks: defaultdict[tuple[str, str, str], int] = defaultdict(int)
        self.wire: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.saved: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.fallbacks: defaultdict[str, int] = defaultdict(int)
        self.requests: defaultdict[tuple[str, str, str], int] = defaultdict(int)
        self.merges: list[tuple[str, float]] = []
        self.pending = 0

    def chunk(self, role: str, key: str, strategy: str, nbytes: int) -> None:
        self.chunks[(role, key, strategy)] += 1
        self.wire[(role, key)] += nbytes
        self.pending += 1
        if self.pending >= FLUSH_EVERY:
            self.flush()

    def kept_off(self, key: str, strategy: str, nbytes: int) -> None:
        self.saved[(key, strategy)] += nbytes

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] += 1

    def request(self, role: str, context_bucket: str = "none", concurrency_bucket: str = "none") -> None:
        self.requests[(role, context_bucket, concurrency_bucket)] += 1

    def merge(self, strategy: str, seconds: float) -> None:
        self.merges.append((strategy, seconds))

    def flush(self, gauges: tuple[int, dict[str, int]] | None = None) -> None:
        """Publish what accumulated since the last flush (and, given, the held-bytes / active gauges)."""
        self.pending = 0
        m = _registry_metrics() if self.on else None
        if m is None:
            self._clear()
            return
        for (role, key, strategy), n in self.chunks.items():
            m["chunks"].labels(role, key, strategy).inc(n)
        for (role, key), n in self.wire.items():
            if n:
                m["wire"].labels(role, key).inc(n)
        for (key, strategy), n in self.saved.items():
            m["saved"].labels(key, strategy).inc(n)
        for reason, n in self.fallbacks.items():
            m["fallbacks"].labels(reason).inc(n)
        for labels, n in self.requests.items():
            m["requests"].labels(*labels).inc(n)
        for strategy, seconds in self.merges:
            m["merge"].labels(strategy).observe(seconds)
        self._clear()
        if gauges is not None:
            held, active = gauges
            m["held"].set(held)
            for role, n in active.items():
                m["active"].labels(role).set(n)

    def _clear(self) -> None:
        self.chunks.clear()
        self.wire.clear()
        self.saved.clear()
        self.fallbacks.clear()
        self.requests.clear()
        self.merges.clear()


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
