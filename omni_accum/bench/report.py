"""What a bench run measured (:class:`BenchRun`) and its text tables (its JSON: :mod:`omni_accum.bench.results`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from omni_accum.bench.replay import UPSTREAM, WIRE_FLOOR, ArmResult
from omni_accum.bench.workloads import Workload
from omni_accum.bench.intervals import median_interval, ratio_interval_rounds
from omni_accum.tuner.stats import MIN_GAIN

@dataclass
class BenchRun:
    """Everything one ``omni-accum bench`` run measured."""

    workload: Workload
    wire: str
    view_hop: str | None
    repeats: int
    results: list[ArmResult] = field(default_factory=list)
    delta_roundtrip_us: float | None = None
    store: dict[tuple[str, int, int], dict[str, Any]] = field(default_factory=dict)
    """``--wire mooncake``: per (arm, context length, concurrency), the bytes through the store."""
    stopped: str | None = None
    """Why the run ended before its last bucket (``interrupted``), or None when every bucket was measured."""


def roundtrip_lines(run: BenchRun) -> list[str]:
    """Per bucket, every arm's p50 step as a multiple of one decode delta's serializer round trip.

    The round trip is :func:`~omni_accum.bench.replay.delta_roundtrip_us` (the delta alone, serialized
    again and again: warm). When the ``wire-floor`` arm ran, each p50 is also given as a multiple of
    its p50: the same delta's trip over the wire, plus the consumer's read, measured interleaved
    with the other arms (cold data, ``concurrency`` requests). The floor's own multiple of the round
    trip shows what no accumulation at all costs beyond it in the run. Empty when no round trip was measured.
    """
    rt = run.delta_roundtrip_us
    if not rt:
        return []
    lines = []
    buckets: dict[tuple[int, int], list[ArmResult]] = {}
    for r in run.results:
        buckets.setdefault((r.context_len, r.concurrency), []).append(r)
    for (cl, c), rs in buckets.items():
        floor = next((r.step_us_p50 for r in rs if r.arm == WIRE_FLOOR and r.samples_us), None)
        parts = []
        for r in rs:
            if not r.samples_us:
                continue
            p50 = r.step_us_p50
            vs_floor = f", {p50 / floor:.2f}x {WIRE_FLOOR}" if floor and r.arm != WIRE_FLOOR else ""
            parts.append(f"{r.arm} {p50 / rt:.2f}x{vs_floor}")
        if parts:
            lines.append(f"  context_len={cl} concurrency={c}: p50 step = " + "; ".join(parts))
    return lines


def p50_interval(r: ArmResult) -> tuple[float, float] | None:
    """95 % interval of an arm's p50 step (us) from every one of its step samples, or None without samples: two
    order statistics around the middle (:func:`~omni_accum.bench.intervals.median_interval`), so it always holds the
    p50 the table prints; under 6 samples there is none (``-``)."""
    return median_interval(r.pooled())


def ratio_vs(base: ArmResult, r: ArmResult) -> tuple[float, float, float, bool] | None:
    """``(ratio, low, high, within_noise)``: ``r``'s p50 over ``base``'s with a 95 % interval over the repeats both
    ran (:func:`~omni_accum.bench.intervals.ratio_interval_rounds`: Student's t over the repeats' ratios, so the
    drift between repeats counts; one repeat: a bootstrap over its steps alone; it holds the ratio).

    Within noise: the interval contains 1x. A difference under :data:`~omni_accum.tuner.stats.MIN_GAIN` (the rule
    ``omni-accum tune`` applies before it leaves the baseline) is not noise when the interval excludes 1x: the table
    says it is small (:func:`_fmt_ratio`). None without samples."""
    q = ratio_interval_rounds(base.samples_us, r.samples_us)
    if q is None:
        return None
    ratio, low, high = q
    return ratio, low, high, low <= 1.0 <= high


def bucket_base(results: list[ArmResult], baseline: str = UPSTREAM) -> tuple[ArmResult | None, str]:
    """``(base, name)``: the arm of one bucket's ``results`` the others' ratios compare with: ``baseline``, or, when
    upstream's code raised on the stream (no samples), ``wire-floor`` (what 0.30.0 does instead); None without one."""
    base = next((r for r in results if r.arm == baseline and r.samples_us), None)
    if base is None and baseline == UPSTREAM:
        base = next((r for r in results if r.arm == WIRE_FLOOR and r.samples_us), None)
        baseline = WIRE_FLOOR if base is not None else baseline
    return base, baseline


def _fmt_x(x: float) -> str:
    """A ratio at a precision that suits its size, never in exponent form: 0.071, 0.96, 4.07, 13.0, 520."""
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 0.1:
        return f"{x:.2f}"
    if not x > 0:
        return "0"
    # two significant digits in fixed point, as .2g shows them above 1e-4 (it read 5e-05 below)
    return f"{x:.{1 - math.floor(math.log10(x))}f}".rstrip("0")


def _fmt_ratio(q: tuple[float, float, float, bool] | None) -> str:
    if q is None:
        return "-"
    ratio, low, high, noise = q
    span = f"{_fmt_x(low)}-{_fmt_x(high)}"
    if noise:
        return f"~1x (within noise: {span}x)"
    # beyond the noise, but not wholly beyond 5 % (tune's rule: it leaves the baseline only for a gain whose whole
    # interval lies above 5 %): a difference, a small one, or one that may be
    if abs(1.0 - ratio) < MIN_GAIN:
        return f"{_fmt_x(ratio)}x [{span}] (under {MIN_GAIN:.0%})"
    if (high > 1.0 - MIN_GAIN) if ratio < 1.0 else (low < 1.0 + MIN_GAIN):
        return f"{_fmt_x(ratio)}x [{span}] (may be under {MIN_GAIN:.0%})"
    faster = f" ({1 / ratio:.0f}x faster)" if 0 < ratio < 0.5 else ""
    return f"{_fmt_x(ratio)}x [{span}]{faster}"


def _fmt_bytes(n: float) -> str:
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def _fmt_us(us: float) -> str:
    if math.isnan(us):
        return "-"
    return f"{us / 1000:.2f} ms" if us >= 10_000 else f"{us:.1f} us"


def _fmt_us_range(low: float, high: float) -> str:
    """An interval in one unit, the one its high end is printed in: ``2.68-11.65 ms``, not ``2680.0 us-11.65 ms``."""
    return f"{low / 1000:.2f}-{high / 1000:.2f} ms" if high >= 10_000 else f"{low:.1f}-{high:.1f} us"


def format_table(results: list[ArmResult], baseline: str = UPSTREAM, *, decode_steps: int | None = None) -> str:
    """One bucket's results as a text table, with each arm's p50 as a ratio to ``baseline``.

    Every p50 comes with a 95 % interval from all its step samples (:func:`p50_interval`), every ratio with a
    95 % interval of its own over the repeats (:func:`ratio_vs`); a ratio whose interval holds 1x reads
    ``~1x (within noise)``,
    one whose interval leaves out 1x but that is under 5 % from it ``0.97x [0.96-0.98] (under 5%)``, one beyond 5 %
    whose interval reaches within 5 % of 1x ``0.93x [0.90-0.96] (may be under 5%)`` (neither is what tune acts on:
    it leaves the baseline only for a gain whose whole interval lies beyond 5 %).

    A step is one chunk of one request, prefill chunks included; with ``decode_steps`` the head splits
    ``steps/request`` into prefill chunks and decode steps.
    """
    if not results:
        return ""
    r0 = results[0]
    base, baseline = bucket_base(results, baseline)
    split = ""
    if decode_steps is not None and 0 <= decode_steps <= r0.steps:
        split = f" ({r0.steps - decode_steps} prefill + {decode_steps} decode)"
    head = (
        f"context_len={r0.context_len}  concurrency={r0.concurrency}  wire={r0.wire}  steps/request={r0.steps}{split}"
    )
    cols = [
        "arm",
        "p50 step",
        "p50 95% CI",
        "p99 step",
        "total/request",
        "wire/step",
        "peak held",
        f"p50 vs {baseline} [95% CI]",
        "views",
    ]
    rows = []
    notes = []
    for r in results:
        ratio = "-"
        if base is not None and r.samples_us:
            ratio = "1x" if r is base else _fmt_ratio(ratio_vs(base, r))
        ci = p50_interval(r)
        tot = sum(r.total_us_per_request) / len(r.total_us_per_request) if r.total_us_per_request else float("nan")
        # wire-floor accumulates nothing: its views are not compared with the cat reference
        # upstream raising is vllm-omni's own code refusing the stream, not a wrong view of it
        ok = "n/a" if r.arm == WIRE_FLOOR and r.error is None else ("ok" if r.correct else "WRONG")
        ok = "fails" if r.arm == UPSTREAM and r.error is not None else ok
        rows.append(
            [
                r.arm,
                _fmt_us(r.step_us_p50),
                _fmt_us_range(*ci) if ci else "-",
                _fmt_us(r.step_us_p99),
                _fmt_us(tot),
                _fmt_bytes(r.wire_bytes_per_step) if r.samples_us else "-",  # not measured: not 0 B
                _fmt_bytes(r.peak_bytes) if r.samples_us else "-",
                ratio,
                ok,
            ]
        )
        if not r.correct:
            notes.append(f"  {r.arm}: {r.mismatch}")
        for k, ks in sorted(r.per_key.items()):
            rows.append(
                [f"  {k}", "", "", "", "", _fmt_bytes(ks.wire_bytes_per_step), _fmt_bytes(ks.peak_bytes), "", ""]
            )
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]

    def line(cells: list[Any]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [head, line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows]
    if base is not None and len(results) > 1:
        out.append(
            f"(95% CI over every step of {len(base.samples_us)} repeat(s): of the p50, two order statistics around "
            "the middle; of a ratio, Student's t over the repeats' ratios of the arms' medians (the drift between "
            "repeats counts; one repeat: a bootstrap over its steps alone). 'within noise': the interval holds 1x; "
            f"'under {MIN_GAIN:.0%}' / 'may be under {MIN_GAIN:.0%}': the ratio / its interval within "
            f"{MIN_GAIN:.0%} of 1x, a difference tune would not act on)"
        )
    if notes:
        out += ["views differing from the cat reference (or errors):", *notes]
    return "\n".join(out)


def upstream_notes(results: list[ArmResult], through: str = "direct") -> list[str]:
    """What a run's tables leave unsaid about ``upstream``: it raised (and what the ratios compare with then), or its
    views differ from the workload's declared semantics."""
    upstream = [r for r in results if r.arm == UPSTREAM and not r.correct]
    if not any(r.error is not None for r in upstream):
        differ = "note: upstream's own views differ from the workload's declared key semantics (see above)"
        return [differ] if upstream else []
    note = (
        "note: vllm-omni's own accumulation (upstream) raised on this stream (see above). On vllm-omni 0.30.0 the "
        "receiving adapter does not accumulate it: it hands each chunk over as it came, which the wire-floor arm "
        "measures"
    )
    if through != "direct":
        return [note + f"; --through {through} cannot run wire-floor, so the tables have no ratio: give a workload "
                "upstream's code accumulates (--workload qwen3-omni-seed), or leave --through out"]
    if not any(r.arm == WIRE_FLOOR for r in results):
        return [note + "; the tables have no ratio: add wire-floor to --arms (or give --workload qwen3-omni-seed)"]
    return [note + " (the ratio column compares with it)"]
