"""Prometheus metrics of omni-accum inside vllm-omni (``prometheus_client``, the library vLLM uses).

Metrics live in ``prometheus_client``'s default registry. In a vllm-omni server the stage processes
are separate OS processes; with ``PROMETHEUS_MULTIPROC_DIR`` set (vLLM sets it for its own
multi-process metrics) every process writes its values there and the API server's ``/metrics``
collects them all, exactly as vLLM's own metrics travel. On by default when ``prometheus_client``
imports; ``OMNI_ACCUM_METRICS=0`` turns them off.

The hot path never touches ``prometheus_client``: each binding's :class:`Recorder` adds to plain
integers in a slot cached per key (at most a dict lookup and two additions per key, counted in a pass
the hook makes anyway; merge times go into a local list, bucketed at flush), and publishes them, on a thread of its
own, every :data:`FLUSH_EVERY` chunks (with the held-bytes and active-request gauges) and soon after a request is
released (:func:`.binding.published_later`); at exit every Recorder's (:func:`flush_all`). Wire bytes count the
tensors' bytes (lists, strings and scalars count 0); saved bytes what a left-off value would have taken (a string's
length, 8 bytes a list item).
Label values are bounded: key paths, strategy names, roles, buckets, reasons; never request ids.

Every family, its labels and what it counts: docs/monitoring.md (the metrics table).

An A/B split's arm bindings (:mod:`.ab`) count into these families as any binding does, and also into the
``omni_accum_ab_*`` families under their arm (published at the same flush): a series that existed without a
split keeps its labels.
"""

from __future__ import annotations

import os
import stat
import threading
import time
import weakref
from collections import defaultdict
from typing import Any

import torch

from omni_accum.integrations.vllm_omni.metrics_publish import Publishing
from omni_accum.integrations.vllm_omni.prometheus import (  # noqa: F401 - re-exported
    ENV_METRICS,
    MERGE_BUCKETS,
    _buckets,
    _observe_many,
    _registry_metrics,
    enabled,
    fallback,
    policy_info,
    policy_info_done,
)
from omni_accum.strategy import value_nbytes

_Tensor = torch.Tensor
_perf_counter = time.perf_counter

#: Chunks after which a Recorder publishes without waiting for a release (:meth:`Recorder._due`).
FLUSH_EVERY = 256
#: Distinct run counters of keys left off (key sets and sizes) a Recorder keeps (see Recorder._new_run).
MAX_RUNS = 1024

# A slot counts one (role, key path, value type): [chunks, tensor bytes, type, is tensor,
# (role, path, strategy) labels, (role, path) labels, the strategy when append-kind else None]; an
# engine slot's (see Recorder._engine_slot) also holds that strategy's list of merge times
# (the indices: .metrics_publish).
_SKIP: list[Any] = [0, 0, None, False, None, None, None]  # a marker key: not counted
_EMPTY: dict[Any, Any] = {}


#: Every Recorder, for a forked child: a lock another thread held at the fork would stay held there.
_recorders: weakref.WeakSet[Recorder] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for r in list(_recorders):
        r._flushing = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def flush_all() -> None:
    """Flush every Recorder of the process (at exit: a request still live then counted chunks that no release
    published, and a Recorder made without a binding never publishes on its own)."""
    for r in list(_recorders):
        try:
            r.flush()
        except Exception:  # noqa: BLE001 - metrics never fail vllm-omni, at exit neither
            pass


class Recorder(Publishing):
    """Per-binding event counts, published to Prometheus in batches (see the module docstring).

    The hot path (:meth:`sent`, :meth:`merged`, :meth:`received`) touches no ``prometheus_client``
    object and builds no label: each key of a chunk finds its cached slot and adds to two integers; a
    merge time is appended to a local list (bucketed at :meth:`flush`). No hook walks a chunk for its metrics
    alone: the send side counts in the walk that numbers the keys for the wire marker, a runner
    transport's receive hook in the merge's own pass (:meth:`arm`, then the Receiver's ``on_merge``
    is :meth:`merged`: the engine slot holds its metrics slot), the adapter's in the pass that picks
    the keys it merges (:meth:`meters`); :meth:`received` walks only a chunk none of those counted.
    :meth:`flush` publishes the differences (:class:`.metrics_publish.Publishing`).
    """

    __slots__ = (
        "fallbacks",
        "requests",
        "chunks_seen",
        "on",
        "_slots",
        "_by_type",
        "_all",
        "_saved_slots",
        "_runs",
        "_hist",
        "_children",
        "armed",
        "first",
        "_flat",
        "t0",
        "_flushing",
        "ab_arm",
        "_ab_handoff",
        "publish_later",
        "__weakref__",
    )

    def __init__(self, arm: str | None = None) -> None:
        self.on = enabled()
        self.ab_arm = arm  # an A/B arm's name: its counts also go to the omni_accum_ab_* families
        self._ab_handoff: dict[tuple[str, str], list[float]] = {}  # (pair, kind) -> hand-off seconds (arms)
        self.fallbacks: defaultdict[str, int] = defaultdict(int)
        self.requests: defaultdict[tuple[str, str, str], int] = defaultdict(int)
        self.chunks_seen = 0
        self._slots: dict[str, dict[Any, Any]] = {}  # role -> top -> slot | {qual -> slot}
        self._by_type: dict[tuple[Any, ...], list[Any]] = {}  # (role, top, qual, type) -> slot
        self._all: list[list[Any]] = []  # every slot, for flush
        self._saved_slots: dict[tuple[Any, Any], list[Any]] = {}  # ((top, qual), type) -> [bytes, labels]
        self._runs: dict[tuple[Any, ...], list[Any]] = {}  # run counters: sizes -> [chunks, [(slot, bytes)]]
        self._hist: dict[str, list[float]] = {}  # strategy -> merge times since the last flush
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._flat: dict[str, dict[tuple[Any, Any], list[Any]]] = {}  # role -> (top, qual) -> slot
        self.armed = False  # the next merged() counts (see arm)
        self.first = "replace"  # the histogram label merged() found for the chunk it counted last
        self.t0: float | None = None  # the armed hook's start: merged() records the merge time
        self._flushing = threading.Lock()  # one flush at a time (see flush)
        #: Called instead of :meth:`flush` every :data:`FLUSH_EVERY` chunks (a binding's: it marks itself for the
        #: publisher thread, which publishes the counts with the held-bytes / active gauges, off the hot path).
        self.publish_later: Any = None
        _recorders.add(self)

    def _slot(self, holder: dict[Any, Any], role: str, top: Any, qual: Any, value: Any, name_of: Any) -> list[Any]:
        """The slot of (role, key, type(value)), made once; it becomes ``holder``'s entry for the key."""
        k = (role, top, qual, type(value))
        slot = self._by_type.get(k)
        if slot is None:
            path = str(top) if qual is None else f"{top}.{qual}"
            strategy = name_of(path, value)
            slot = [0, 0, type(value), isinstance(value, torch.Tensor), (role, path, strategy), (role, path)]
            slot.append(None if strategy in _REPLACE_LIKE else strategy)
            self._by_type[k] = slot
            self._all.append(slot)
        holder[top if qual is None else qual] = slot
        return slot

    def arm(self, t0: float | None = None) -> None:
        """The next :meth:`merged` call counts (a hook's own merge; re-seeding merges do not). ``t0``: the
        hook's start (``time.perf_counter()``); :meth:`merged` then also records the merge time, from
        ``t0`` to the end of the merge (else the hook does, with :meth:`timed`)."""
        self.armed = self.on
        self.t0 = t0

    def merged(self, pairs: list[tuple[Any, Any]], role: str = "receive") -> None:
        """A Receiver's ``on_merge``: count the ``(slot, value)`` pairs of the chunk it just merged, when
        :meth:`arm` asked for it (else nothing). Each engine slot keeps its metrics slot in ``.meter`` (one
        per engine slot: its labels are the slot's path and strategy, whatever the value's type), so a key
        costs no lookup: an increment and, for a tensor, its bytes. The merge time goes under the strategy
        of the chunk's first append-kind key (``replace`` when it has none), which is left in :attr:`first`."""
        if not self.armed:
            return
        self.armed = False
        fm = None  # the meter of the first append-kind key
        for slot, v in pairs:
            m = slot.meter
            if m is None:
                m = slot.meter = self._engine_slot(role, slot)
            m[0] += 1
            if isinstance(v, _Tensor):
                m[1] += v.nbytes
            if fm is None and m[6] is not None:
                fm = m
        if fm is None:
            self.first = "replace"
            h = self._times("replace")
        else:
            self.first, h = fm[6], fm[7]
        t0 = self.t0
        if t0 is not None:  # timed(), inlined: this runs for every chunk
            self.t0 = None
            h.append(_perf_counter() - t0)  # bucketed at flush
            self.chunks_seen += 1
            if self.chunks_seen >= FLUSH_EVERY:
                self._due()

    def meters(self, role: str) -> dict[tuple[Any, Any], list[Any]]:
        """The flat ``(top, qual) -> slot`` table of ``role``, for a hook that counts in its own pass
        over a chunk (with :meth:`meter`), as the receive hook of the scheduler's adapter does."""
        flat = self._flat.get(role)
        if flat is None:
            flat = self._flat[role] = {}
        return flat

    def meter(self, flat: dict[tuple[Any, Any], list[Any]], role: str, tq: tuple[Any, Any], value: Any, name_of: Any):
        """The slot of key ``tq`` (qual None: a top-level key) for values of this type, entered in ``flat``."""
        flat[tq] = slot = self._slot({}, role, tq[0], tq[1], value, name_of)
        return slot

    def _engine_slot(self, role: str, slot: Any) -> list[Any]:
        """The metrics slot of an engine slot's key, under the strategy the engine slot runs (a request's
        own tuned bucket may give a key another strategy than the next's)."""
        path, name = slot.path, slot.spec.name
        k = (role, path, None, name)
        m = self._by_type.get(k)
        if m is None:
            m = [0, 0, None, None, (role, path, name), (role, path)]
            m.append(None if name in _REPLACE_LIKE else name)
            m.append(None if name in _REPLACE_LIKE else self._times(name))  # its merge times
            self._by_type[k] = m
            self._all.append(m)
        return m

    def received(
        self, payload: Any, seconds: float | None, name_of: Any, skip: Any, role: str = "receive", counted: bool = False
    ) -> None:
        """One received chunk: every key (tensor bytes as wire bytes; top-level keys in ``skip`` are not
        counted) and its merge time, under the strategy of its first append-kind key (``replace`` when it
        has none). ``name_of(path, value)`` names a key's strategy (called once per key and value type).
        ``counted``: :meth:`merged` already counted the keys (the merge's own pass); only the time is left
        (``seconds`` None: that too, as after an :meth:`arm` given the hook's start)."""
        if not counted:
            self.timed(seconds, self._walk(payload, name_of, skip, role) or "replace")
        elif seconds is not None:  # None: merged() recorded it
            self.timed(seconds, self.first)

    def timed(self, seconds: float, first: str | None = None) -> None:
        """The merge time of a chunk whose keys are counted, under ``first`` (default: :attr:`first`, what
        the counting pass found): the hooks' call for a chunk of a request already known."""
        self._times(self.first if first is None else first).append(seconds)  # bucketed at flush
        self.chunks_seen += 1
        if self.chunks_seen >= FLUSH_EVERY:
            self._due()

    def _due(self) -> None:
        """:data:`FLUSH_EVERY` chunks counted: publish them. A binding's Recorder hands that to the publisher thread
        (:attr:`publish_later`), which also sets the held-bytes and active-request gauges: those are process-wide
        (every binding's Receivers, request by request), too slow to read here, and a flush without them left the
        gauges at 0 while requests were live and not yet released. Anything else flushes here."""
        self.chunks_seen = 0  # marked once per FLUSH_EVERY chunks, not on every chunk until the publisher gets there
        later = self.publish_later
        if later is not None:
            try:
                later()
                return
            except Exception:  # noqa: BLE001 - no publisher thread (interpreter shutdown): flush here
                pass
        self.flush()

    def whole(self, payload: Any, name_of: Any, skip: Any, role: str) -> None:
        """A whole payload put or got (``async_chunk: false``): its keys counted under ``role`` as a chunk's are
        (the same slots), no merge time (nothing is merged: the producing stage's accumulator steps were timed)."""
        self._walk(payload, name_of, skip, role)
        self.chunks_seen += 1
        if self.chunks_seen >= FLUSH_EVERY:
            self._due()

    def _times(self, strategy: str) -> list[float]:
        """The merge times of ``strategy`` since the last flush (one list for good: flush empties it)."""
        h = self._hist.get(strategy)
        if h is None:  # setdefault: a thread that made it meanwhile keeps its list (else its times were lost)
            h = self._hist.setdefault(strategy, [])
        return h

    def _walk(self, payload: Any, name_of: Any, skip: Any, role: str) -> str | None:
        """Count every key of ``payload`` under ``role``; the strategy of its first append-kind key."""
        slots = self._slots.get(role)
        if slots is None:
            slots = self._slots[role] = {}
        first = None
        for top, value in payload.items():
            s = slots.get(top)
            if s is _SKIP:
                continue
            if type(value) is dict:
                if type(s) is not dict:
                    if s is None and top in skip:
                        slots[top] = _SKIP
                        continue
                    s = slots[top] = {}
                for qual, qv in value.items():
                    x = s.get(qual)
                    if x is None or x[2] is not type(qv):
                        x = self._slot(s, role, top, qual, qv, name_of)
                    x[0] += 1
                    if x[3]:
                        x[1] += qv.nbytes
                    if first is None:
                        first = x[6]
            else:
                if s is None or type(s) is dict or s[2] is not type(value):
                    if s is None and top in skip:
                        slots[top] = _SKIP
                        continue
                    s = self._slot(slots, role, top, None, value, name_of)
                s[0] += 1
                if s[3]:
                    s[1] += value.nbytes
                if first is None:
                    first = s[6]
        return first

    def sent(
        self,
        table: dict[tuple[Any, Any], int],
        chunk: Any,
        wire: Any,
        name_of: Any,
        skip: Any,
        kept: dict[tuple[Any, Any], list[Any]] | None = None,
    ) -> list[tuple[Any, Any]]:
        """One sent chunk, in one walk over ``chunk``: number each key of ``wire`` new to the request in
        ``table`` (wire order, as :func:`.marker.number_once`), count the keys on the wire and, metrics on,
        the bytes of those left off; returns the keys left off as ``(top, qual)`` (qual None: top-level).
        ``wire``: ``chunk`` or its encoded form (same key order, some keys left off). ``table``: the
        request's :class:`.marker.SendTable` (or a dict); its ``meters`` hold each numbered key's slot (a
        key costs one lookup). ``kept``: the request's run of chunks leaving the same keys off (:meth:`_new_run`)."""
        on = self.on
        kept = {} if kept is None else kept
        omitted: list[tuple[Any, Any]] = []
        meters = getattr(table, "meters", None)
        if meters is None:  # a plain dict: slots by number for this chunk only
            meters = [None] * len(table)
        for top, value in chunk.items():
            if top in skip:
                continue
            if isinstance(value, dict):  # a group: its keys, looked up in the wire's group
                sub = value if wire is chunk else wire.get(top)
                if not isinstance(sub, dict):
                    sub = _EMPTY
                items: Any = value.items()
            else:  # a top-level key: itself, looked up in the wire
                sub, items = wire, ((None, value),)
            for qual, qv in items:
                tq = (top, qual)
                k = top if qual is None else qual
                if k in sub:
                    i = table.get(tq)
                    if i is None:
                        i = table[tq] = len(table)
                        meters.append(None)
                    if on:
                        w = qv if sub is value else sub[k]
                        x = meters[i]
                        if x is None or x[2] is not type(w):
                            x = meters[i] = self._slot({}, "send", top, qual, w, name_of)
                        x[0] += 1
                        if x[3]:
                            x[1] += w.nbytes
                else:
                    omitted.append(tq)
        if on:
            if omitted:  # the same keys left off as in the request's last chunk that left any off: one count
                run = kept.get(None)
                if run is not None and run[0] == omitted:
                    run[1][0] += 1
                else:
                    self._new_run(kept, omitted, chunk, name_of)
            elif kept:  # nothing left off: the run ends (a key sent may have changed)
                kept.clear()
            self.chunks_seen += 1
            if self.chunks_seen >= FLUSH_EVERY:
                self._due()
        return omitted

    def _new_run(self, kept: dict[Any, Any], omitted: list[tuple[Any, Any]], chunk: Any, name_of: Any) -> None:
        """Start the request's run of chunks leaving ``omitted`` off; count this one. A key is left off only
        while unchanged (``omits_unchanged``: the value last sent), so its bytes hold through the run: the
        run counts chunks, :meth:`flush` multiplies. Runs of equal slots and sizes share a counter."""
        entries = []
        for tq in omitted:
            top, qual = tq
            v = chunk[top] if qual is None else chunk[top][qual]
            k = (tq, type(v))
            slot = self._saved_slots.get(k)
            if slot is None:  # setdefault: as in _times
                path = str(top) if qual is None else f"{top}.{qual}"
                slot = self._saved_slots.setdefault(k, [0, (path, name_of(path, v))])
            entries.append((slot, v.nbytes if isinstance(v, torch.Tensor) else value_nbytes(v)))
        sig = tuple((id(slot), n) for slot, n in entries)  # slots live as long as this Recorder
        counter = self._runs.get(sig)
        if counter is None:
            if len(self._runs) >= MAX_RUNS:  # bounded: past it, the bytes are added at once
                kept.pop(None, None)
                for slot, n in entries:
                    slot[0] += n
                return
            counter = self._runs.setdefault(sig, [0, entries])
        kept[None] = [omitted, counter]
        counter[0] += 1

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] += 1

    def ab_handoff(self, pair: str, kind: str, seconds: float) -> None:
        """An arm's timed hand-off (``omni_accum_ab_handoff_seconds``), published at the next flush."""
        h = self._ab_handoff.get((pair, kind))
        if h is None:
            h = self._ab_handoff.setdefault((pair, kind), [])
        h.append(seconds)

    def request(self, role: str, context_bucket: str = "none", concurrency_bucket: str = "none") -> None:
        self.requests[(role, context_bucket, concurrency_bucket)] += 1


#: Strategies that replace a key's value (not append): the merge histogram's label skips them.
_REPLACE_LIKE = frozenset({"replace", "send_once"})


def multiproc_dir_problem(where: str) -> str | None:
    """Why the multiprocess metrics folder is not the serving user's own (prometheus_client's /metrics sums every
    ``.db`` file in it, whoever wrote it), or None."""
    try:
        st = os.stat(where)
    except OSError as e:
        return f"{e.strerror or e}: prometheus_client fails to write there"
    if not stat.S_ISDIR(st.st_mode):
        return "not a folder: prometheus_client fails to write there"
    if not os.access(where, os.W_OK | os.X_OK):  # a read-only mount refuses root too (EROFS)
        ro = hasattr(os, "statvfs") and os.statvfs(where).f_flag & os.ST_RDONLY
        why = "on a read-only file system" if ro else f"not writable by this user (uid {os.geteuid()})"
        return f"{why}: prometheus_client fails to write there"
    if st.st_uid not in (0, os.geteuid()):
        return f"owned by another user (uid {st.st_uid}), whose files it may add to these metrics"
    if st.st_mode & 0o022:
        return (f"group- or world-writable (mode {stat.S_IMODE(st.st_mode):o}): other users' files in it are added to "
                "these metrics")  # fmt: skip
    return None
