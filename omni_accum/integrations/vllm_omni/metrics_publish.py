"""The publishing half of :class:`.metrics.Recorder`: what accumulated on the hot path, into ``prometheus_client``.

:class:`Publishing` holds :meth:`~Publishing.flush` (the differences since the last flush, the merge times bucketed,
the gauges) and :meth:`~Publishing._clear` (metrics off: the counts dropped). It has no state of its own: the
tables it reads are the Recorder's (its docstring and the metrics module's say what each holds).
"""

from __future__ import annotations

from typing import Any

from omni_accum.integrations.vllm_omni.prometheus import _buckets, _observe_many, _registry_metrics

# The indices of a metrics slot (see the metrics module): [chunks, tensor bytes, type, is tensor, (role, path,
# strategy) labels, (role, path) labels, the strategy when append-kind else None (, an engine slot's merge times)].
_N, _B, _TYPE, _TENSOR, _CLABELS, _WLABELS, _APPEND = range(7)


class Publishing:
    """:class:`.metrics.Recorder`'s flush to Prometheus (a base class with no slots of its own)."""

    __slots__ = ()

    def _child(self, m: dict[str, Any], name: str, labels: tuple[str, ...]) -> Any:
        k = (name, labels)
        child = self._children.get(k)
        if child is None:
            child = self._children[k] = m[name].labels(*labels) if labels else m[name]
        return child

    def flush(self, gauges: tuple[int, dict[str, int]] | None = None) -> None:
        """Publish what accumulated since the last flush (and, given, the held-bytes / active gauges).

        Safe beside the hot path on another thread (vllm-omni 0.30.0's chunk transfer adapter receives on
        one thread and saves on another, and releases on the scheduler's): one flush at a time (a lock
        taken here only), each value taken by subtracting what was read rather than by zeroing (an
        increment made meanwhile stays for the next flush), merge times taken off the front of their list
        (one the other thread appends to), and the tables read from snapshots (a key may be added)."""
        with self._flushing:
            self.chunks_seen = 0
            m = _registry_metrics() if self.on else None
            if m is None:
                self._clear()
                return
            child = self._child
            for x in list(self._saved_slots.values()):
                n = x[0]
                if n:
                    x[0] -= n
                    child(m, "saved", x[1]).inc(n)
            for counter in list(self._runs.values()):
                n = counter[0]
                if n:
                    counter[0] -= n
                    for x, size in counter[1]:
                        if size:
                            child(m, "saved", x[1]).inc(n * size)
            for slot in self._all[:]:
                n = slot[_N]
                if n:
                    slot[_N] -= n
                    child(m, "chunks", slot[_CLABELS]).inc(n)
                n = slot[_B]
                if n:
                    slot[_B] -= n
                    child(m, "wire", slot[_WLABELS]).inc(n)
            arm = self.ab_arm
            for table, name in ((self.fallbacks, "fallbacks"), (self.requests, "requests")):
                for labels, n in list(table.items()):
                    if n:
                        table[labels] -= n
                        child(m, name, labels if name == "requests" else (labels,)).inc(n)
                        if arm is not None and name == "requests":
                            child(m, "ab_requests", (arm, labels[0])).inc(n)
            for strategy, times in list(self._hist.items()):
                k = len(times)
                if k:
                    batch = times[:k]
                    del times[:k]
                    counts, sums = _buckets(batch)
                    _observe_many(child(m, "merge", (strategy,)), counts, sums)
                    if arm is not None:
                        _observe_many(child(m, "ab_merge", (arm,)), counts, sums)
            for labels, times in list(self._ab_handoff.items()):
                k = len(times)
                if k:
                    batch = times[:k]
                    del times[:k]
                    hist = child(m, "ab_handoff", (arm or "", *labels))
                    for x in batch:
                        hist.observe(x)
            if gauges is not None:
                held, active = gauges
                m["held"].set(held)
                for role, n in active.items():
                    child(m, "active", (role,)).set(n)

    def _clear(self) -> None:
        for slot in self._all:
            slot[_N] = slot[_B] = 0
        for x in self._saved_slots.values():
            x[0] = 0
        for counter in self._runs.values():
            counter[0] = 0
        self.fallbacks.clear()
        self.requests.clear()
        for times in self._hist.values():
            times.clear()
        for times in self._ab_handoff.values():
            times.clear()
