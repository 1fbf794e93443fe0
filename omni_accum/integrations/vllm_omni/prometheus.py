"""The Prometheus side of omni-accum's metrics: the metric objects in ``prometheus_client``'s default
registry (created once per process), whether metrics are on, and publishing a local merge-time list
as a histogram. :mod:`.metrics` counts on the hot path and publishes through this module.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import re
import threading
from bisect import bisect_right
from typing import Any

from omni_accum.switches import SettingError, env_flag

ENV_METRICS = "OMNI_ACCUM_METRICS"
MERGE_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1, 1.0)
#: The stage input processor's accumulation time per request (seconds; a 32k prompt in 2048-row chunks
#: takes ~1 s per tensor under ``torch.cat`` on a small CPU).
PROCESSOR_BUCKETS = (1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: ``omni_accum_handoff_seconds`` (.handoff): from a decode row's hand-off to a 32k prompt's over a slow wire, and
#: decode rows waiting 10-40 s for a talker still in its own 32k prefill on a small CPU (20 and 30 s told apart).
HANDOFF_BUCKETS = (
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
)  # fmt: skip

_lock = threading.Lock()
_metrics: dict[str, Any] | None = None
_unavailable = False


_warned: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        logging.getLogger("omni_accum.vllm_omni").error("omni-accum: %s; metrics are off", text)


def enabled() -> bool:
    """True when metrics are on (``OMNI_ACCUM_METRICS`` not 0/off/false) and ``prometheus_client`` imports."""
    try:
        if not env_flag(ENV_METRICS):
            return False
    except SettingError as e:  # install() refuses it first; a Recorder made meanwhile counts nothing
        _warn_once(str(e))
        return False
    return _registry_metrics() is not None


def _make(Counter: Any, Gauge: Any, Histogram: Any) -> dict[str, Any]:
    """The metric objects (registered in the default registry)."""
    return {
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
        "handoff": Histogram(
            "omni_accum_handoff_seconds",
            "Time from a chunk's put on the sending stage to its merge on the receiving stage",
            ["pair", "kind"],
            buckets=HANDOFF_BUCKETS,
        ),
        "handoff_bytes": Counter(
            "omni_accum_handoff_bytes_total", "Tensor bytes of the hand-offs timed", ["pair", "kind"]
        ),
        "handoff_skipped": Counter(
            "omni_accum_handoff_skipped_total", "Hand-off timestamps not turned into a duration", ["reason"]
        ),
        "processor_merge": Histogram(
            "omni_accum_processor_merge_seconds",
            "Time the stage input processor spends on one request's prefill chunks",
            ["stage", "strategy"],
            buckets=PROCESSOR_BUCKETS,
        ),
        "processor_copied": Counter(
            "omni_accum_processor_bytes_copied_total",
            "Bytes the stage input processor's prefill accumulation copied",
            ["strategy"],
        ),
        # A/B splits (:mod:`.ab`): new families, so a split leaves every series above as it was
        "ab_requests": Counter(
            "omni_accum_ab_requests_total", "Requests per arm of an A/B split", ["arm", "role"]
        ),
        "ab_merge": Histogram(
            "omni_accum_ab_merge_seconds",
            "Time a receive hook spends per chunk, per arm of an A/B split",
            ["arm"],
            buckets=MERGE_BUCKETS,
        ),
        "ab_handoff": Histogram(
            "omni_accum_ab_handoff_seconds",
            "omni_accum_handoff_seconds per arm of an A/B split",
            ["arm", "pair", "kind"],
            buckets=HANDOFF_BUCKETS,
        ),
        "info": Gauge(
            "omni_accum_policy_info",
            "The policy a binding runs (value 1)",
            ["source", "fingerprint", "version"],
            multiprocess_mode="liveall",
        ),
    }


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
        from prometheus_client import REGISTRY

        before = set(REGISTRY._collector_to_names)  # noqa: SLF001 - the collectors a failed _make leaves behind
        try:
            _metrics = _make(Counter, Gauge, Histogram)
        except Exception as e:  # noqa: BLE001 - e.g. PROMETHEUS_MULTIPROC_DIR missing or not writable by this user
            for c in set(REGISTRY._collector_to_names) - before:  # noqa: SLF001
                REGISTRY.unregister(c)
            _unavailable = True
            where = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")
            hint = f" (PROMETHEUS_MULTIPROC_DIR={where}: a folder this user can write; vLLM's own metrics need it too)"
            what = f"cannot create the metrics in pid {os.getpid()} ({type(e).__name__}: {e})"
            _warn_once(what + (hint if where else ""))
            return None
        _forget_dead_processes()
        return _metrics


#: A file of a multiprocess folder: ``<kind>_<pid>.db`` (prometheus_client's naming; live gauges: ``gauge_live*``).
_DB_FILE = re.compile(r"([a-z_]+)_(\d+)\.db")


def db_files(where: str, live_only: bool = False) -> dict[int, list[str]]:
    """The ``<kind>_<pid>.db`` files of multiprocess folder ``where`` by pid (only the live gauges' with
    ``live_only``); {} when it cannot be read. ``doctor`` names the pids no longer running."""
    try:
        names = os.listdir(where)
    except OSError:
        return {}
    out: dict[int, list[str]] = {}
    for f in names:
        m = _DB_FILE.fullmatch(f)
        if m is not None and (not live_only or m[1].startswith("gauge_live")):
            out.setdefault(int(m[2]), []).append(f)
    return out


def _remove(where: str, names: list[str]) -> None:
    for f in names:
        try:
            os.remove(os.path.join(where, f))
        except OSError as e:  # removed by another stage starting beside this one, or another user's
            logging.getLogger("omni_accum.vllm_omni").debug("omni-accum: %s not removed: %s", f, e)


def _forget_dead_processes() -> None:
    """In multiprocess mode, the live gauges (``omni_accum_held_bytes``, ``omni_accum_active_requests``,
    ``omni_accum_policy_info``, and vLLM's own) of every process of the folder that is no longer running are removed,
    as ``prometheus_client.multiprocess.mark_process_dead`` does (nothing in vLLM calls it for a stage process: a
    crashed or restarted stage's held bytes and policy stayed in ``/metrics`` for good); a process's own go when it
    exits normally (a process forked from this one too: its files are its own pid's). Counters and histograms stay:
    they are totals. Pids are judged in this PID namespace: the folder must not be shared across containers. Two
    stages starting together may remove the same files: one gone already (or not this user's) is skipped, file by
    file."""
    where = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")
    if not where:
        return
    from omni_accum.samehost import pid_alive

    atexit.register(lambda: _remove(where, db_files(where, live_only=True).get(os.getpid(), [])))  # at normal exit
    for pid, names in db_files(where, live_only=True).items():
        if pid != os.getpid() and not pid_alive(pid):
            _remove(where, names)


def _buckets(times: list[float]) -> tuple[list[int], list[float]]:
    """Counts and sums per bucket (``MERGE_BUCKETS``, then +Inf) of ``times``; Prometheus buckets are
    "less or equal". Sorts ``times``."""
    times.sort()
    counts, sums, lo = [], [], 0
    for bound in MERGE_BUCKETS:
        hi = bisect_right(times, bound, lo)
        counts.append(hi - lo)
        sums.append(math.fsum(times[lo:hi]))
        lo = hi
    counts.append(len(times) - lo)
    sums.append(math.fsum(times[lo:]))
    return counts, sums


def _observe_many(child: Any, counts: list[int], sums: list[float]) -> None:
    """Add a local histogram (counts and sums per bucket, ``MERGE_BUCKETS`` then +Inf) to a Prometheus
    histogram child: through its per-bucket values when it has the layout ``prometheus_client`` has
    had since 0.4 (one ``inc`` per bucket), else one ``observe`` per event at its bucket's mean
    (counts and sum stay exact either way)."""
    buckets, total = getattr(child, "_buckets", None), getattr(child, "_sum", None)
    bounds = getattr(child, "_upper_bounds", None)
    if buckets is not None and total is not None and bounds is not None and list(bounds[:-1]) == list(MERGE_BUCKETS):
        for i, n in enumerate(counts):
            if n:
                buckets[i].inc(n)
        total.inc(sum(sums))
        return
    for n, s in zip(counts, sums):
        for _ in range(n):
            child.observe(s / n)


#: The bindings running each ``omni_accum_policy_info`` label set (made, not yet closed), under ``_info_lock``
#: (the series set and removed under it too: a binding made while the last one of its policy closes keeps it).
_info_users: dict[tuple[str, str, str], int] = {}
_info_lock = threading.Lock()


def policy_info(source: str, fingerprint: str, version: str) -> None:
    """Set ``omni_accum_policy_info{source, fingerprint, version} = 1`` (when metrics are on), for one more binding
    running that policy (:func:`policy_info_done` when it closes)."""
    k = (source, fingerprint, version)
    with _info_lock:
        _info_users[k] = _info_users.get(k, 0) + 1
        m = _registry_metrics() if enabled() else None
        if m is not None:
            m["info"].labels(*k).set(1)


def policy_info_done(source: str, fingerprint: str, version: str) -> None:
    """A binding that ran this policy closed: when it was the last one, the series goes (in multiprocess mode it is
    set to 0: the value stays in this process's file, and prometheus_client does not remove labels there), so an
    uninstall then an install of another policy does not show two policies running."""
    k = (source, fingerprint, version)
    with _info_lock:
        n = _info_users.pop(k, 0) - 1
        if n > 0:
            _info_users[k] = n
            return
        m = _registry_metrics()
        if m is not None:
            try:
                m["info"].labels(*k).set(0)
                if not {"PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir"} & os.environ.keys():
                    m["info"].remove(*k)
            except Exception:  # noqa: BLE001 - metrics never fail vllm-omni
                pass


def processor_observe(stage: str, strategy: str, seconds: float, copied: int) -> None:
    """One request's prefill accumulation in the stage input processor (once per request, when it hands over)."""
    m = _registry_metrics() if enabled() else None
    if m is not None:
        m["processor_merge"].labels(stage, strategy).observe(seconds)
        if copied:
            m["processor_copied"].labels(strategy).inc(copied)


def fallback(reason: str) -> None:
    """Count one fallback outside any binding (a binding that could not be made)."""
    m = _registry_metrics() if enabled() else None
    if m is not None:
        m["fallbacks"].labels(reason).inc()
