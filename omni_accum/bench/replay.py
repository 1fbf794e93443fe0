"""The replay engine: a workload's chunk trace through an arm, over a wire, timed per step.

N concurrent requests are interleaved round-robin (a captured workload's bucket replays all its captured
requests, N at a time, each next one starting as one ends: :func:`~omni_accum.bench.streams.schedule`); each chunk goes ``encode -> wire -> merge ->
consumer read`` (and, with a view hop, the consumer's read is serialized once more, as pre-0.30
releases did when they attached the accumulated payload to the scheduler output). Arms are
interleaved round by round (the arm order rotates every repeat) in one process, so arms are
compared under the same machine state; compare them as ratios. With ``warmup=True`` every arm
first replays the trace once, untimed; between rounds (untimed) a :class:`~omni_accum.bench._malloc.HeapGuard`
keeps a fragmenting heap from growing without bound.

Seams (for ``--through vllm-omni`` and other transports), each in its own module and re-exported
here:

* an arm runs as an :class:`~omni_accum.bench.engines.Engine` (:mod:`omni_accum.bench.engines`: ``PolicyEngine``,
  ``UpstreamEngine``, ``WireFloorEngine``, :data:`THROUGH`, :func:`make_engine`). An arm given to
  :func:`measure` may also be any callable ``(StreamContext) -> Engine``;
* a :class:`~omni_accum.bench.wires.Wire` carries wire payloads (:mod:`omni_accum.bench.wires`: ``inproc``,
  ``serializer``, ``shm``; :data:`WIRES` maps names to factories; payload helpers);
* :func:`~omni_accum.bench.reference.check_view` compares a final view with the ``torch.cat`` reference
  (:mod:`omni_accum.bench.reference`).

The tuner calls :func:`measure` and bootstraps medians from :attr:`ArmResult.samples_us`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from omni_accum.bench._malloc import HeapGuard
from omni_accum.bench.engines import THROUGH, UPSTREAM, WIRE_FLOOR, Arm, Engine, make_engine  # noqa: F401 - re-exported
from omni_accum.bench.engines import PolicyEngine, UpstreamEngine, WireFloorEngine  # noqa: F401 - re-exported
from omni_accum.bench.reference import check_taken, check_view  # noqa: F401 - re-exported
from omni_accum.bench.wires import WIRES, InprocWire, SerializerWire, ShmWire, Wire, WireName, _get, _has  # noqa: F401
from omni_accum.bench.wires import iter_leaves, make_wire, payload_nbytes
from omni_accum.bench.streams import append_length_hints, bucket_streams, build_stream, schedule
from omni_accum.bench.workloads import Workload, load_workload
from omni_accum.context import StreamContext
from omni_accum.errors import InvalidArgumentError, OmniAccumError
from omni_accum.integrations.vllm_omni.classes import (  # noqa: F401 - re-exported
    VllmOmniUnavailable,
    serializer,
    shm_connector,
    transport_mixin,
)

ViewHop = Literal["serializer"]


@dataclass
class KeyStats:
    """Per-key figures of an arm (no timing: keys are merged together)."""

    wire_bytes_per_step: float = 0.0
    peak_bytes: int = 0


@dataclass
class ArmResult:
    """What :func:`measure` found for one arm in one bucket.

    Attributes:
        samples_us: per repeat, the latency of every step (one chunk of one request), in
            microseconds, in replay order. The tuner bootstraps medians from these.
        total_us_per_request: per repeat, the mean over requests of the summed step latencies.
        correct: final views of every request equal the cat reference (checked on the first repeat).
        mismatch: the first mismatch (request, key, what) when not correct.
        error: the exception an arm raised, if any (the arm is then not correct either).
    """

    arm: str
    context_len: int
    concurrency: int
    wire: str
    requests: int
    steps: int
    key: str = "*"
    samples_us: list[list[float]] = field(default_factory=list)
    total_us_per_request: list[float] = field(default_factory=list)
    wire_bytes_per_step: float = 0.0
    peak_bytes: int = 0
    correct: bool = True
    mismatch: str | None = None
    error: str | None = None
    per_key: dict[str, KeyStats] = field(default_factory=dict)

    def pooled(self) -> list[float]:
        return [x for rep in self.samples_us for x in rep]

    @property
    def step_us_p50(self) -> float:
        s = self.pooled()
        return statistics.median(s) if s else float("nan")

    @property
    def step_us_p99(self) -> float:
        return percentile(self.pooled(), 99.0)

    def repeat_medians(self) -> list[float]:
        """Median step latency of each repeat."""
        return [statistics.median(r) for r in self.samples_us if r]


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank on sorted data); NaN when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))
    return s[k]


@dataclass(frozen=True)
class _Read:
    """One key the consumer reads: its path split once (``top``, ``qual``; ``qual`` None for a flat key)."""

    path: str
    pattern: str
    top: str
    qual: str | None

    @classmethod
    def of(cls, path: str, pattern: str) -> _Read:
        top, _, qual = path.partition(".")
        return cls(path, pattern, top, qual or None)

    def lookup(self, view: Mapping[str, Any]) -> Any:
        """The consumer's read of this key (``view[top][qual]`` or ``view[path]``); :data:`_ABSENT` when absent.

        What :func:`_has` then :func:`_get` would give, with fewer lookups (no exception either: a
        raised KeyError costs about a microsecond, which would be charged to the arm).
        """
        if self.qual is None:
            return view[self.path] if self.path in view else _ABSENT
        if self.top not in view:
            return _ABSENT
        group = view[self.top]
        if not isinstance(group, Mapping) or self.qual not in group:
            return _ABSENT
        return group[self.qual]


_ABSENT: Any = object()


def replay(
    workload: Workload,
    engine: Engine,
    wire: Wire,
    streams: list[list[dict[str, Any]]],
    *,
    view_hop: Any = None,
    device: str = "cpu",
    check: bool = False,
    per_key: bool = False,
    on_round: Callable[[int], None] | None = None,
    tag: str = "r",
    concurrency: int | None = None,
) -> tuple[list[float], list[float], int, int, dict[str, KeyStats], str | None]:
    """Replay ``streams`` (one chunk list per request, round-robin, ``concurrency`` in flight: default all)
    through ``engine`` over ``wire``; ``on_round`` gets the steps of each round.

    Returns ``(step_us, total_us per request, wire bytes, peak bytes, per-key stats, first mismatch)``.
    Only encode, wire, merge, the consumer's read and the view hop are timed.
    """
    reads = [_Read.of(k.path, k.read) for k in workload.keys if k.read != "never"]
    n_req = len(streams)
    rounds = schedule([len(s) for s in streams], concurrency or n_req)  # captured requests end at their own length
    step_us: list[float] = []
    totals = [0.0] * n_req
    wire_bytes = 0
    peak = 0
    keys: dict[str, KeyStats] = {}
    mismatch: str | None = None
    req_ids = [f"{tag}{r}" for r in range(n_req)]
    clock = time.perf_counter_ns
    timer = _CudaTimer() if device.startswith("cuda") else None
    guard = HeapGuard()
    for steps_of_round in rounds:
        ended = []
        for r, i in steps_of_round:
            last = i == len(streams[r]) - 1
            rid = req_ids[r]
            chunk = streams[r][i]
            t0 = clock() if timer is None else timer.start()
            sent = engine.encode(rid, chunk)
            got, nb = wire.carry(f"{rid}_{i}", sent)
            view = engine.merge(rid, got)
            hop: dict[str, Any] | None = {} if view_hop is not None else None
            taken: list[tuple[str, Any]] | None = None
            for rd in reads:
                if rd.pattern == "end" and not last:
                    continue
                val = rd.lookup(view)
                if val is _ABSENT:
                    continue
                if rd.pattern == "newest_row" and isinstance(val, (torch.Tensor, list)) and len(val):
                    val = val[-1:]
                if hop is not None:  # before a delta read drops the key's state, which the hop may ship
                    hop[rd.path] = engine.hop_value(rid, rd.path, val)
                if rd.pattern == "delta":  # the consumer takes what accumulated; the receiver drops it
                    engine.consume(rid, rd.path)
                    if check:
                        taken = (taken or []) + [(rd.path, val)]
            if hop:
                view_hop.deserialize(view_hop.serialize(hop))
            dt = (clock() - t0) / 1000.0 if timer is None else timer.stop_us()
            if taken and mismatch is None and getattr(engine, "checks_views", True):
                m = check_taken(chunk, taken)
                if m:
                    mismatch = f"request {r}, chunk {i}: {m}"
            step_us.append(dt)
            totals[r] += dt
            wire_bytes += payload_nbytes(sent) if nb is None else nb  # inproc: counted here, off the clock
            if per_key:
                for path, v in iter_leaves(sent):
                    if not str(path).startswith("__"):
                        keys.setdefault(path, KeyStats()).wire_bytes_per_step += payload_nbytes(v)
            if last:
                ended.append(r)
                if check and mismatch is None and getattr(engine, "checks_views", True):
                    m = check_view(workload, streams[r], view)
                    if m:
                        mismatch = f"request {r}: {m}"
        held = engine.nbytes()
        peak = max(peak, held)
        if per_key:
            for path, nbk in engine.key_nbytes().items():
                ks = keys.setdefault(path, KeyStats())
                ks.peak_bytes = max(ks.peak_bytes, nbk)
        if (concurrency or n_req) < n_req:  # not all at once: one that ended makes room for the next (untimed)
            for r in ended:
                engine.release(req_ids[r])
                req_ids[r] = ""
        guard()  # untimed: bounds a fragmenting heap (see omni_accum.bench._malloc)
        if on_round is not None:
            on_round(len(steps_of_round))
    for rid in filter(None, req_ids):
        engine.release(rid)
    steps = max(1, sum(map(len, streams)))
    for ks in keys.values():
        ks.wire_bytes_per_step /= steps
    return step_us, totals, wire_bytes, peak, keys, mismatch


class _CudaTimer:
    """Times one step with CUDA events (the step's host work and the device work it queued)."""

    def __init__(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> int:
        self._start.record()
        return 0

    def stop_us(self) -> float:
        self._end.record()
        self._end.synchronize()
        return self._start.elapsed_time(self._end) * 1000.0


def _to_device(value: Any, device: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def measure(
    workload: Workload | str,
    arms: Mapping[str, Arm],
    *,
    context_len: int | None = None,
    concurrency: int = 1,
    wire: str = "inproc",
    repeats: int = 3,
    view_hop: ViewHop | None = None,
    check: bool = True,
    per_key: bool = False,
    length_hints: bool = True,
    through: str = "direct",
    device: str = "cpu",
    progress: Callable[[int], None] | None = None,
    warmup: bool = False,
) -> list[ArmResult]:
    """Measure every arm on the workload's trace for one bucket (context length x concurrency).

    Args:
        workload: a :class:`Workload`, a preset name or a file path.
        arms: label -> a :class:`Policy`, ``"upstream"`` (vllm-omni 0.30.0's own code) or an
            engine factory ``(StreamContext) -> Engine``.
        context_len: prefill rows P (default: the workload's).
        concurrency: requests replayed at once, round-robin (a captured workload's bucket replays all its
            requests, up to its bound, ``concurrency`` at a time).
        wire: ``inproc``, ``serializer`` or ``shm`` (the latter two need vllm-omni).
        repeats: rounds; in every round each arm replays the whole trace once, in rotated order.
        view_hop: ``"serializer"`` to serialize the consumer's read every step.
        check: compare every request's final view with the cat reference (first round only).
        per_key: also collect per-key wire and held bytes (:attr:`ArmResult.per_key`).
        length_hints: tell strategies the final rows of each append key (``StreamContext.length_hints``).
        through: engine mode (``direct``; integrations may register more in :data:`THROUGH`).
        device: where the chunks' tensors live (``cuda``: steps are timed with CUDA events and
            ``prealloc`` buffers stay on the device).
        progress: called with the number of steps done after every round of chunks.
        warmup: before the first repeat, every arm replays the whole trace once, untimed, so that it is
            measured as a warm process runs it. glibc serves a block from its heap only when one at
            least as large was freed before; cold, upstream's growing ``[8000, 2048]`` concatenations
            each map and fault fresh pages: 16 ms per step instead of 2.7 ms.

    Returns:
        One :class:`ArmResult` per arm (``key="*"``), in the order of ``arms``.

    Raises:
        InvalidArgumentError: an argument of the wrong type or value (checked before anything runs).
        VllmOmniUnavailable: a requested mode needs vllm-omni and it cannot be imported.
    """
    _check_arguments(arms, context_len, concurrency, repeats, wire, through, device)
    wl = load_workload(workload)
    cl = context_len or wl.context_len
    streams = bucket_streams(wl, cl, concurrency)
    if device != "cpu":
        streams = [[_to_device(c, device) for c in s] for s in streams]
    hints = append_length_hints(wl, streams[0]) if length_hints else {}
    ctx = StreamContext(context_len=cl, concurrency=concurrency, length_hints=hints)
    hop = serializer() if view_hop == "serializer" else None
    if view_hop not in (None, "serializer"):
        raise OmniAccumError(f"unknown view hop {view_hop!r}. Available: serializer")
    labels = list(arms)
    n_chunks = max(map(len, streams), default=0)
    results = {lab: ArmResult(lab, cl, concurrency, wire, requests=len(streams), steps=n_chunks) for lab in labels}
    wire_totals = {lab: 0 for lab in labels}
    if warmup:
        _warm_up(wl, arms, ctx, through, wire, streams)
    for rep in range(repeats):
        k = rep % len(labels) if labels else 0
        for lab in labels[k:] + labels[:k]:
            res = results[lab]
            if res.error is not None:
                continue
            w = make_wire(wire)
            engine: Engine | None = None
            try:
                engine = make_engine(arms[lab], ctx, through)
                on_round = progress
                steps, totals, nb, peak, keys, mismatch = replay(
                    wl,
                    engine,
                    w,
                    streams,
                    view_hop=hop,
                    device=device,
                    check=check and rep == 0,
                    per_key=per_key,
                    on_round=on_round,
                    tag=f"{lab}-{rep}-",
                    concurrency=concurrency,
                )
            except VllmOmniUnavailable:
                raise
            except Exception as e:  # noqa: BLE001 - a failing arm is reported, the others go on
                res.error = f"{type(e).__name__}: {e}"
                res.correct = False
                res.mismatch = res.mismatch or res.error
                continue
            finally:
                if engine is not None:
                    engine.close()
                w.close()
            res.samples_us.append(steps)
            res.total_us_per_request.append(statistics.fmean(totals) if totals else 0.0)
            res.peak_bytes = max(res.peak_bytes, peak)
            wire_totals[lab] += nb
            if mismatch and res.mismatch is None:
                res.correct, res.mismatch = False, mismatch
            if per_key and rep == 0:
                res.per_key = keys
    for lab, res in results.items():
        n = sum(len(s) for s in res.samples_us)
        res.wire_bytes_per_step = wire_totals[lab] / n if n else 0.0
    return [results[lab] for lab in labels]


def _check_arguments(arms: Any, cl: Any, concurrency: Any, repeats: Any, wire: Any, through: Any, device: Any) -> None:
    """Refuse what :func:`measure` cannot run, naming the argument, the value and what is valid (bool is no int)."""

    def bad(name: str, value: Any, valid: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"measure: {name} must be {valid}, got {value!r:.80}")

    if not isinstance(arms, Mapping):
        raise bad("arms", arms, "a mapping of labels to arms (build_arms(workload, names) makes one from arm names)")
    for name, value in (("context_len", cl), ("concurrency", concurrency), ("repeats", repeats)):
        if (value is not None or name != "context_len") and (type(value) is not int or value < 1):
            raise bad(name, value, "an int >= 1" + (" or None (the workload's)" if name == "context_len" else ""))
    for name, what, value, valid in (("wire", "wire", wire, WIRES), ("through", "--through mode", through, THROUGH)):
        if not isinstance(value, str) or value not in valid:
            hint = " (vllm-omni: import omni_accum.integrations.vllm_omni.replay first)" if name == "through" else ""
            raise InvalidArgumentError(f"measure: unknown {what} {value!r:.80}; {name} must be one of "
                                       f"{', '.join(map(repr, valid))}{hint}")  # fmt: skip
    try:
        dev = torch.device(device) if isinstance(device, str) else None
    except RuntimeError:
        dev = None
    if dev is None or (dev.type == "cuda" and not torch.cuda.is_available()):
        raise bad("device", device, "a torch device name such as 'cpu' or 'cuda' (with a CUDA device present)")


def _warm_up(
    wl: Workload, arms: Mapping[str, Arm], ctx: StreamContext, through: str, wire: str, streams: list[list[Any]]
) -> None:
    """Replay ``streams`` once through every arm, untimed; an arm that fails is left to the measured repeats."""
    for lab, arm in arms.items():
        w = make_wire(wire)
        engine: Engine | None = None
        try:
            engine = make_engine(arm, ctx, through)
            replay(wl, engine, w, streams, tag=f"{lab}-warm-", concurrency=ctx.concurrency)
        except VllmOmniUnavailable:
            raise
        except Exception:  # noqa: BLE001, S110 - the measured repeats report it
            pass
        finally:
            if engine is not None:
                engine.close()
            w.close()


def delta_roundtrip_us(workload: Workload | str, *, context_len: int | None = None, repeats: int = 200) -> float:
    """Median serializer round trip (``OmniSerializer`` serialize + deserialize) of one decode chunk, in us.

    The floor a step over the ``serializer`` wire cannot beat: what one delta costs to ship.
    """
    wl = load_workload(workload)
    stream = build_stream(wl, context_len or wl.context_len, 0)
    chunk = stream[-1]
    ser = serializer()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        ser.deserialize(ser.serialize(chunk))
        ts.append((time.perf_counter_ns() - t0) / 1000.0)
    return statistics.median(ts)
