"""The hand-off metric: how long a chunk takes from its put on the sending stage to its merge on the next.

The time runs from the sending adapter's ``put`` (omni-accum's send hook, before vllm-omni's connector
serializes anything) to the moment the payload is merged and readable on the receiving stage (the receive
hook, after the merge), per stage pair (``"0->1"``) and kind:

* ``prefill``: a request's first chunk, and every chunk sent before its prompt is complete (chunked
  prefill; the request's own counts at the save say so);
* ``decode``: later chunks, timed on a sample only (every :data:`DEFAULT_SAMPLE`-th chunk of a request,
  ``OMNI_ACCUM_HANDOFF_SAMPLE``; 0: none), so that steady-state wire bytes do not grow;
* ``full`` (``async_chunk: false``): the whole request, sent once by the runner transport when it finished
  (timed around its ``_send_single_request`` and ``_recv_full_payload_result``, :mod:`.full_payload`).

The sender's ``time.monotonic_ns()`` rides in omni-accum's wire marker (:mod:`.marker`), sent only to a
receiving stage that said hello (:mod:`.peer`), with its clock domain: :func:`clock_id`, a short hash of
the kernel's boot id (stages on one host share ``CLOCK_MONOTONIC``). A receiver turns it into a duration
only when the clock domain is its own and 0 <= duration <= :data:`MAX_SECONDS`; otherwise it counts
``omni_accum_handoff_skipped_total{reason}`` (``clock_domain``, ``out_of_range``) and records nothing.

=========================================  =========  ==================================================
metric                                     type       labels
=========================================  =========  ==================================================
``omni_accum_handoff_seconds``             histogram  ``pair``, ``kind``
``omni_accum_handoff_bytes_total``         counter    ``pair``, ``kind`` (tensor bytes of the timed chunks)
``omni_accum_handoff_skipped_total``       counter    ``reason``
=========================================  =========  ==================================================

On the hot path a timed chunk adds to plain numbers in a slot cached per (pair, kind) (no lock, no label
built); :func:`publish` hands them to Prometheus (the publisher thread, after each release), and
:func:`summary` is :func:`.reporting.status`'s ``handoff`` field. Metrics off (``OMNI_ACCUM_METRICS=0``):
nothing is timed and the wire stays as it was.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from omni_accum.integrations.vllm_omni import publishing
from omni_accum.integrations.vllm_omni.marker import MARKERS, stamp_of
from omni_accum.integrations.vllm_omni.prometheus import _registry_metrics
from omni_accum.switches import SettingError

ENV_SAMPLE = "OMNI_ACCUM_HANDOFF_SAMPLE"
#: Decode chunks: every n-th chunk of a request is timed.
DEFAULT_SAMPLE = 16
#: Longest duration taken as a hand-off (seconds); a longer or negative one is ``out_of_range``.
MAX_SECONDS = 600
KINDS = {"p": "prefill", "d": "decode", "f": "full"}
#: Timed chunks a meter holds before it publishes from the hot path (else: after a release).
FLUSH_EVERY = 256

_monotonic_ns = time.monotonic_ns
_Tensor = torch.Tensor
_clock: str | None = None
#: Decode chunks: every ``sample``-th chunk of a request is timed (0: none); read by :func:`read_settings`.
sample = DEFAULT_SAMPLE


def clock_id() -> str:
    """This host's clock domain: 8 hex digits of a hash of ``/proc/sys/kernel/random/boot_id`` (processes of
    one boot share ``CLOCK_MONOTONIC``). Without a boot id, one of this process only (nothing compares)."""
    global _clock
    if _clock is None:
        try:
            with open("/proc/sys/kernel/random/boot_id", "rb") as f:
                seed = f.read().strip()
        except OSError:
            seed = b""
        if not seed:
            seed = f"pid:{os.getpid()}:{time.time_ns()}".encode()
        _clock = hashlib.sha256(seed).hexdigest()[:8]
    return _clock


def read_settings() -> int:
    """Read ``OMNI_ACCUM_HANDOFF_SAMPLE`` (install calls it: a bad value refuses there, nothing patched)."""
    global sample
    raw = os.environ.get(ENV_SAMPLE, "").strip()
    if not raw:
        sample = DEFAULT_SAMPLE
        return sample
    n = int(raw) if raw.isascii() and raw.isdigit() else -1  # int() takes 1_000, +5 and other scripts' digits
    if n < 0:
        raise SettingError(
            f"{ENV_SAMPLE}={raw!r} is not a whole number >= 0: give n to time every n-th decode chunk of a "
            f"request (default {DEFAULT_SAMPLE}; 1: every one; 0: none, prefill chunks only)"
        )
    sample = n
    return n


# ------------------------------------------------------------------------------------- sending side
def heard(b: Any) -> bool:
    """Whether a request starting now on sending binding ``b`` is timed: metrics on, and its receiving stage
    said hello (a binding not on an adapter, as in ``replay``, never is)."""
    w = b.__dict__.get("_peer")
    return w is not None and b.metrics.on and w.ready()


def kind_of(n: int, task: Any) -> str:
    """The kind code of a request's ``n``-th chunk (``task``: the sending adapter's, when known): the first
    chunk and those sent before the prompt is complete (the request's counts at the save) are ``p``refill,
    later ones ``d``ecode."""
    if n == 0:
        return "p"
    req = task.get("request") if isinstance(task, Mapping) else None
    if req is None:
        return "d"
    try:
        done = int(getattr(req, "num_computed_tokens", 0) or 0) - int(getattr(req, "num_output_placeholders", 0) or 0)
        prompt = getattr(req, "num_prompt_tokens", None)
        if prompt is None:
            prompt = len(getattr(req, "prompt_token_ids", None) or ())
        return "p" if 0 < done <= int(prompt) else "d"
    except (TypeError, ValueError):
        return "d"


def stamp(table: Any, task: Any) -> tuple[int, str, str] | None:
    """The ``(t_ns, clock_id, kind)`` of the chunk of a request (its :class:`.marker.SendTable`) now going
    out, or None: untimed (a decode chunk off the sample, or a request whose hand-offs are not timed)."""
    n = table.stamps
    if n is None:
        return None
    table.stamps = n + 1
    kind = kind_of(n, task)
    if kind == "d" and (not sample or n % sample):
        return None
    return _monotonic_ns(), clock_id(), kind


# ----------------------------------------------------------------------------------- receiving side
# A slot: [count, seconds sum, seconds max, bytes, times not yet published, (pair, kind) labels, bytes published]
_COUNT, _SUM, _MAX, _BYTES, _TIMES, _LABELS, _PUB = range(7)

#: Every meter (status and publishing read them all).
_meters: weakref.WeakSet[Meter] = weakref.WeakSet()


class Meter:
    """The hand-offs one receiving binding timed: a slot per (sending stage, receiving stage, kind)."""

    __slots__ = ("slots", "skipped", "pending", "_flushing", "__weakref__")

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int, str], list[Any]] = {}
        self.skipped = {"clock_domain": [0, 0], "out_of_range": [0, 0]}  # reason -> [count, published]
        self.pending = 0
        self._flushing = threading.Lock()
        _meters.add(self)
        # a binding dropped (its adapter closed, garbage collected) keeps its hand-offs counted: status and
        # Prometheus are per process, and a total that shrank with a collection would read as wrong
        weakref.finalize(self, _retire, self.slots, self.skipped, self._flushing)

    def _slot(self, key: tuple[int, int, str]) -> list[Any]:
        slot = self.slots[key] = [0, 0.0, 0.0, 0, [], (f"{key[0]}->{key[1]}", KINDS[key[2]]), 0]
        return slot

    def record(self, src: int, dst: int, raw: Any, payload: Mapping[str, Any], now: int) -> None:
        """A timed chunk's marker ``raw`` reached stage ``dst`` from ``src``; ``payload`` merged at ``now``."""
        got = stamp_of(raw)
        if got is None:
            return
        t, clock, kind = got
        if kind is None:  # an announced first chunk
            kind = "p"
        elif kind not in KINDS:
            return
        if clock != (_clock or clock_id()):
            self.skipped["clock_domain"][0] += 1
            return
        seconds = (now - t) / 1e9
        if not 0 <= seconds <= MAX_SECONDS:
            self.skipped["out_of_range"][0] += 1
            return
        key = (src, dst, kind)
        slot = self.slots.get(key) or self._slot(key)
        slot[_COUNT] += 1
        slot[_SUM] += seconds
        if seconds > slot[_MAX]:
            slot[_MAX] = seconds
        slot[_BYTES] += payload_bytes(payload)
        slot[_TIMES].append(seconds)
        self.pending += 1
        if self.pending >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Publish what was timed since the last flush (one flush at a time; the hot path only adds)."""
        self.pending = 0
        _flush(self.slots, self.skipped, self._flushing)


def _flush(slots: dict[tuple[int, int, str], list[Any]], skipped: dict[str, list[int]], lock: threading.Lock) -> None:
    with lock:
        m = _registry_metrics()
        for slot in list(slots.values()):
            k = len(slot[_TIMES])
            batch = slot[_TIMES][:k]
            del slot[_TIMES][:k]
            n = slot[_BYTES] - slot[_PUB]
            slot[_PUB] += n
            if m is not None:
                hist = m["handoff"].labels(*slot[_LABELS])
                for x in batch:
                    hist.observe(x)
                if n:
                    m["handoff_bytes"].labels(*slot[_LABELS]).inc(n)
        for reason, c in skipped.items():
            n = c[0] - c[1]
            c[1] += n
            if n and m is not None:
                m["handoff_skipped"].labels(reason).inc(n)


#: The counts of meters whose binding is gone: (pair, kind) labels -> [count, [seconds sum per meter], seconds
#: max, bytes]. The sums stay apart so that :func:`summary` adds them exactly (``math.fsum``): a meter retired
#: between two calls, or meters visited in another order, give the same total to the last bit.
_retired: dict[tuple[str, str], list[Any]] = {}


#: Retired meters whose last hand-offs are not published yet: :func:`publish` (the publisher thread, exit) does it.
_unpublished: deque[tuple[Any, ...]] = deque()


def _retire(slots: dict[tuple[int, int, str], list[Any]], skipped: dict[str, list[int]], lock: threading.Lock) -> None:
    """A meter's binding is gone: keep its counts for :func:`summary`, leave what it had not published to
    :func:`publish`. A finalizer: the garbage collector runs it on whichever thread allocates, at any point of
    its code, maybe while that thread holds a lock of ``prometheus_client`` (not reentrant; a metric's lock while
    it makes a child, the multiprocess value lock): it takes no lock, or that thread would wait for itself."""
    _unpublished.append((slots, skipped, lock))
    for slot in list(slots.values()):
        row = _retired.setdefault(slot[_LABELS], [0, [], 0.0, 0])
        row[0] += slot[_COUNT]
        row[1].append(slot[_SUM])
        row[2] = max(row[2], slot[_MAX])
        row[3] += slot[_BYTES]


def payload_bytes(payload: Mapping[str, Any]) -> int:
    """Tensor bytes of a chunk's values (as ``omni_accum_wire_bytes_total`` counts them; markers skipped)."""
    n = 0
    for top, value in payload.items():
        if isinstance(value, dict):
            for v in value.values():
                if isinstance(v, _Tensor):
                    n += v.nbytes
        elif isinstance(value, _Tensor) and top not in MARKERS:
            n += value.nbytes
    return n


def meter(b: Any) -> Meter:
    """Binding ``b``'s meter (made at its first timed chunk)."""
    m = b.__dict__.get("_handoff")
    if m is None:
        m = b.__dict__.setdefault("_handoff", Meter())
    return m


def arrived(b: Any, dst: Any, raw: Any, payload: Mapping[str, Any]) -> None:
    """Receive hooks, after the merge: the chunk ``payload`` carrying marker ``raw`` (a list: maybe timed) is
    readable on stage ``dst`` (the sending stage is ``dst - 1``)."""
    now = _monotonic_ns()
    if not b.metrics.on:
        return
    m = b.__dict__.get("_handoff") or meter(b)
    try:
        m.record(int(dst) - 1, int(dst), raw, payload, now)
    except (TypeError, ValueError):  # a stage id that is not a number: nothing to pair
        return


def publish() -> None:
    """Publish every meter's hand-offs, those of retired meters too (the publisher thread, after releases; exit;
    tests)."""
    while _unpublished:
        try:
            slots, skipped, lock = _unpublished.popleft()
        except IndexError:  # another thread took the last one
            break
        try:
            _flush(slots, skipped, lock)
        except Exception:  # noqa: BLE001 - at interpreter exit Prometheus may be half torn down
            pass
    for m in list(_meters):
        m.flush()


def summary() -> dict[str, dict[str, dict[str, float]]]:
    """``{pair: {kind: {count, seconds_sum, seconds_max, bytes}}}`` of every meter in this process.

    The same hand-offs give the same figures whatever order the meters are visited in and whether their
    bindings are gone yet: the seconds are added with ``math.fsum`` (exactly rounded)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    sums: dict[tuple[str, str], list[float]] = {}
    rows = [(s[_LABELS], s[_COUNT], [s[_SUM]], s[_MAX], s[_BYTES]) for m in list(_meters) for s in list(m.slots.values())]
    rows += [(labels, r[0], list(r[1]), r[2], r[3]) for labels, r in list(_retired.items())]
    for (pair, kind), count, totals, top, nbytes in rows:
        if not count:
            continue
        row = out.setdefault(pair, {}).setdefault(kind, {"count": 0, "seconds_sum": 0.0, "seconds_max": 0.0, "bytes": 0})
        row["count"] += count
        sums.setdefault((pair, kind), []).extend(totals)
        row["seconds_max"] = max(row["seconds_max"], top)
        row["bytes"] += nbytes
    for (pair, kind), totals in sums.items():
        out[pair][kind]["seconds_sum"] = math.fsum(totals)
    return out


publishing.also_publish.append(publish)
