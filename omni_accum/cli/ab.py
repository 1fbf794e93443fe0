"""``omni-accum ab --metrics URL|FILE``: compare the arms of a live A/B split from a ``/metrics`` scrape.

Reads ``omni_accum_ab_merge_seconds{arm}`` and ``omni_accum_ab_handoff_seconds{arm,pair,kind}`` (the
Prometheus text format, parsed by ``prometheus_client.parser``) and prints, per arm, the count, the mean with
a 95% interval of the mean, and approximate p50 / p90; then each other arm against the baseline arm
(``--baseline``; default ``control`` when there is one, else the first by name): the
difference of the means with its 95% interval and a verdict, ``above the noise`` when that interval leaves
out 0, else ``within the noise``.

The split assigns requests, not chunks, to the arms, and a request's chunks are alike (a ``torch.cat`` merge grows
with the rows the request holds): the interval counts **requests** as the independent units, the spread of the
chunks divided by the arm's requests as the receiving stages counted them (``omni_accum_ab_requests_total{role=
"receive"}``: a request counts once per receiving stage, where its merges are timed, so on Qwen3-Omni's talker and
code2wav a request is two units, and the interval up to sqrt(2) narrower than one per request; a hand-off group of
one pair counts that arm's requests over its pairs), never by more units than observations. That holds for requests
of like sizes (the spread of per-request means is at most the spread of the chunks); counting chunks instead called
an A/A split "above the noise" in 86 % of trials of a cat-like stream. It does not hold when request lengths vary
and a chunk's cost grows with the rows its request holds (a ``torch.cat`` merge): the long requests' means spread more
than the chunks over the requests say, the interval is too narrow, and an A/A split is called "above the noise" far
more often than 5 % of the time (:data:`LIMIT`; 12 % to 44 % of simulated A/A splits). The histograms are per arm, not
per request, so that spread is not in the scrape: the limit is said, not corrected. An arm with fewer than
:data:`MIN_COUNT` such units gets no verdict (``too few``). Counters that cannot both be right (chunks timed but no
request received; more requests received than chunks timed: a counter reset or a stale series) are warned about
(:func:`counter_warnings`), the exit status unchanged.

Everything comes from histogram buckets, so it is approximate: the mean is exact (``_sum / _count``); the
spread is estimated with each observation at its bucket's midpoint plus the bucket's own width (as if uniform
inside it: ``width**2 / 12``; the +Inf bucket counts at its lower bound). That is an estimate, not a bound:
values bunched at a bucket's edges (12 ms and 90 ms share ``(0.01, 0.1]``) spread more than it says. Quantiles are
interpolated inside their bucket as Prometheus' ``histogram_quantile`` does. The series read are checked first (finite
counts >= 0 and sums, buckets that never decrease, ``_count`` equal to the +Inf bucket, one arm's series with the same
bounds): a corrupt one is refused, named with its line, rather than read as nonsense; the other series of the page are
not looked at (:mod:`.ab_scrape`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import Any

from omni_accum.cli.ab_scrape import HANDOFF, MERGE, REQUESTS, Hist, InputError, parse, read_text  # noqa: F401

#: Units (requests, see the module doc) an arm needs for a verdict.
MIN_COUNT = 30
#: What the interval cannot see (said under every verdict, in ``--help`` and in the docs).
LIMIT = (
    "the interval assumes requests of like sizes: when request lengths vary and a chunk's cost grows with the rows "
    "its request holds (a cat merge), it is too narrow, and two arms of one policy read 'above the noise' far more "
    "often than 5% of the time (the metrics are per arm, not per request, so that spread cannot be seen here); "
    "take a verdict near its edge as unsure and confirm it on a second window"
)
Z95 = 1.959963984540054


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "ab",
        help="compare the arms of a live A/B split: per-arm merge and hand-off time, and whether they differ",
        description=(
            "Read omni-accum's A/B metrics from a /metrics URL or a saved scrape and print, per arm, the merge "
            "time per chunk (omni_accum_ab_merge_seconds) and the hand-off time per stage pair and kind "
            "(omni_accum_ab_handoff_seconds): count, requests, mean with a 95% interval, p50 and p90 (approximate: "
            "from the histogram buckets; the interval counts requests, the split's unit, not chunks); then each "
            "arm against the baseline arm: the difference and whether it is above the noise (its 95% interval "
            "leaves out 0; no verdict under 30 requests received an arm, each receiving stage counting its own). "
            f"Limit: {LIMIT}. An arm whose counters cannot both be right (chunks timed but no request received, or "
            "more requests received than chunks timed: a counter reset or a stale series) is warned about on stderr. "
            "Exit 0: printed (warnings too); 1: no A/B series in the input; "
            "2: the input cannot be read, or an A/B series in it is not a valid histogram or counter."
        ),
    )
    p.add_argument(
        "--metrics",
        required=True,
        metavar="URL|FILE",
        help="an http(s) URL of a /metrics page (e.g. http://127.0.0.1:8000/metrics) or a file holding one scrape",
    )
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="seconds to wait for the URL (default 10)")
    p.add_argument(
        "--baseline",
        metavar="ARM",
        help="the arm the others are compared with (default: 'control' when there is one, else the first by name)",
    )
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(func=run)


def _bins(h: Hist) -> list[tuple[float, float, float]]:
    """``(lower, upper, count)`` per bucket (upper +Inf for the last)."""
    out, lo, seen = [], 0.0, 0.0
    for le in sorted(h.buckets):
        c = h.buckets[le] - seen
        seen = h.buckets[le]
        if c > 0:
            out.append((lo, le, c))
        lo = le if math.isfinite(le) else lo
    return out


def quantile(h: Hist, q: float) -> float | None:
    """Approximate ``q`` quantile (Prometheus' ``histogram_quantile``: linear inside the bucket; the +Inf
    bucket answers its lower bound)."""
    n = h.count or (max(h.buckets.values()) if h.buckets else 0.0)
    if n <= 0:
        return None
    rank, seen = q * n, 0.0
    for lo, hi, c in _bins(h):
        if seen + c >= rank:
            if not math.isfinite(hi):
                return lo
            return lo + (hi - lo) * (rank - seen) / c
        seen += c
    return None


@dataclass
class ArmStats:
    count: int
    units: int  # the independent units the interval counts: the arm's requests (at most ``count``)
    mean: float | None
    ci_low: float | None
    ci_high: float | None
    se: float | None
    p50: float | None
    p90: float | None


def stats(h: Hist, requests: float) -> ArmStats:
    """Count, mean, 95% interval of the mean (normal approximation, the chunks' spread from the buckets over
    ``requests`` units, at most the count: see the module doc), p50, p90. No units: no interval."""
    n = h.count
    if n <= 0:
        return ArmStats(0, 0, None, None, None, None, None, None)
    mean = h.total / n
    ss = 0.0
    for lo, hi, c in _bins(h):
        mid, width = ((lo + hi) / 2, hi - lo) if math.isfinite(hi) else (lo, 0.0)
        ss += c * ((mid - mean) * (mid - mean) + width * width / 12)  # inf on overflow, not OverflowError
    units = int(min(n, max(requests, 0.0)))
    if units <= 0:
        return ArmStats(int(n), 0, mean, None, None, None, quantile(h, 0.5), quantile(h, 0.9))
    se = math.sqrt(ss / max(n - 1, 1) / units)
    low = max(mean - Z95 * se, 0.0)  # a time is never negative: one slow chunk's wide bucket put the bound below 0
    return ArmStats(int(n), units, mean, low, mean + Z95 * se, se, quantile(h, 0.5), quantile(h, 0.9))


def compare(a: ArmStats, b: ArmStats) -> dict[str, Any]:
    """Arm ``b`` against arm ``a``: the difference of the means, its 95% interval and the verdict."""
    if a.units < MIN_COUNT or b.units < MIN_COUNT or a.mean is None or b.mean is None:
        return {"difference": None, "ci_low": None, "ci_high": None,
                "verdict": f"too few (< {MIN_COUNT} requests received per arm)"}  # fmt: skip
    d = b.mean - a.mean
    half = Z95 * math.hypot(a.se or 0.0, b.se or 0.0)
    above = abs(d) > half
    return {
        "difference": d,
        "relative": d / a.mean if a.mean else None,
        "ci_low": d - half,
        "ci_high": d + half,
        "verdict": "within the noise" if not above else (
            "difference above the noise" + (" (slower)" if d > 0 else " (faster)")),
    }


def analyse(merge: dict, hand: dict, reqs: dict, baseline: str | None = None) -> dict[str, Any]:
    """The comparison as plain data (what ``--json`` prints); ``baseline``: the arm the others are compared
    with (default: ``control`` when there is one, else the first by name)."""
    out: dict[str, Any] = {"requests": reqs, "groups": []}
    groups: list[tuple[str, dict[str, Hist]]] = [("merge", {k[0]: h for k, h in merge.items()})]
    for pk in sorted({k[1:] for k in hand}):
        groups.append((f"handoff {pk[0]} {pk[1]}", {k[0]: h for k, h in hand.items() if k[1:] == pk}))
    got = {arm: roles.get("receive", 0.0) for arm, roles in reqs.items()}
    pairs = {arm: len({k[1] for k in hand if k[0] == arm}) or 1 for arm in got}
    for what, by_arm in groups:
        share = 1 if what == "merge" else None  # a hand-off group: the arm's requests over its pairs
        arms = {arm: stats(h, got.get(arm, 0.0) / (share or pairs.get(arm, 1))) for arm, h in by_arm.items()}
        first = baseline if baseline in arms else "control" if "control" in arms else None
        order = sorted(arms, key=lambda a: (a != first, a))
        base = order[0] if order else None
        vs = {arm: compare(arms[base], arms[arm]) for arm in order[1:]} if base else {}
        if not reqs:  # the interval is over requests: without their counter no arm has any
            for v in vs.values():
                if v["difference"] is None:
                    v["verdict"] = (f"no {REQUESTS} series in the scrape: the interval is over requests, so none "
                                    "is given")
        note = None
        if len(order) == 1:
            idle = sorted(a for a in reqs if a not in arms)
            note = f"only arm {base!r} recorded here: nothing to compare" + (
                f" (arm(s) {', '.join(map(repr, idle))} counted requests but no {what} series: their chunks were not "
                "timed here)" if idle else ""
            )
        elif (wanted := baseline or ("control" if any(k[0] == "control" for k in (*merge, *hand)) else None)) and (
            wanted not in arms
        ):
            note = f"the baseline {wanted!r} has no series here: compared with {base!r} instead"
        if what == "merge" and any(v["difference"] is not None for v in vs.values()):
            note = f"{note}; {LIMIT}" if note else LIMIT
        out["groups"].append(
            {"what": what, "arms": {a: asdict(arms[a]) for a in order}, "baseline": base, "versus": vs, "note": note}
        )
    out["warnings"] = counter_warnings(merge, reqs)
    return out


def counter_warnings(merge: dict, reqs: dict) -> list[str]:
    """One line per arm whose merge count and received requests cannot both be right: chunks timed but no request
    received, or more requests received than chunks timed (every received request's chunks are timed). None
    without the requests counter in the scrape (said in the verdicts)."""
    if not reqs:
        return []
    out = []
    for (arm,), h in sorted(merge.items()):
        n, got = int(h.count), int(reqs.get(arm, {}).get("receive", 0.0))
        if n > 0 and got == 0:
            out.append(f"arm {arm!r}: {n} chunk(s) timed ({MERGE}) but 0 requests received ({REQUESTS}"
                       '{role="receive"}): its requests counter is missing or was reset; no interval without requests')
        elif got > n > 0:
            out.append(f"arm {arm!r}: {got} requests received ({REQUESTS}{{role=\"receive\"}}) but {n} chunk(s) "
                       f"timed ({MERGE}): a counter was reset (a restarted stage) or a series is stale (an old file "
                       f"in PROMETHEUS_MULTIPROC_DIR); the interval counts {n} units, one per chunk")
    return out


def _us(x: float | None, ms: bool | None = None) -> str:
    """Seconds as us or ms (``ms``: the unit of the whole table; None: by the value)."""
    if x is None:
        return "-"
    if ms is None:
        ms = abs(x) >= 1e-2
    return f"{x * 1e3:.2f} ms" if ms else f"{x * 1e6:.1f} us"


def format_report(data: dict[str, Any]) -> str:
    lines = []
    reqs = data["requests"]
    if reqs:
        lines.append("requests per arm: " + ", ".join(
            f"{arm} " + "/".join(f"{role} {int(n)}" for role, n in sorted(roles.items())) for arm, roles in reqs.items()
        ))
    for g in data["groups"]:
        title = "merge time per chunk (receive hook)" if g["what"] == "merge" else f"hand-off {g['what'][8:]}"
        lines.append("")
        lines.append(title)
        lines.append(f"  {'arm':<16} {'count':>8} {'requests':>8}  {'mean':>10}  {'95% interval of the mean':>26}  "
                     f"{'p50':>10}  {'p90':>10}")
        seen = [abs(v) for s in g["arms"].values() for k in ("ci_high", "p90") if (v := s[k]) is not None]
        ms = bool(seen) and max(seen) >= 1e-2  # one unit for the whole group
        for arm, s in g["arms"].items():
            ci = f"[{_us(s['ci_low'], ms)}, {_us(s['ci_high'], ms)}]" if s["ci_low"] is not None else "-"
            lines.append(
                f"  {arm:<16} {s['count']:>8} {s['units']:>8}  {_us(s['mean'], ms):>10}  {ci:>26}  "
                f"{_us(s['p50'], ms):>10}  {_us(s['p90'], ms):>10}"
            )
        for arm, v in g["versus"].items():
            if v["difference"] is None:
                lines.append(f"  {arm} vs {g['baseline']}: {v['verdict']}")
                continue
            rel = f" ({v['relative']:+.1%})" if v.get("relative") is not None else ""
            sign = "+" if v["difference"] >= 0 else "-"
            lines.append(
                f"  {arm} vs {g['baseline']}: {sign}{_us(abs(v['difference']), ms)}{rel}, 95% interval "
                f"[{_us(v['ci_low'], ms)}, {_us(v['ci_high'], ms)}]: {v['verdict']}"
            )
        if g.get("note"):
            lines.append(f"  note: {g['note']}")
    lines.append("")
    lines.append("(approximate: spread and quantiles from the histogram buckets, intervals over requests (the split's "
                 "unit), not chunks; means exact)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    prog = "omni-accum ab"
    where = args.metrics
    if not (0 < args.timeout < 1e9):  # inf overflowed the socket's timeout (a traceback)
        print(f"{prog}: error: --timeout {args.timeout}: give seconds > 0 (finite)", file=sys.stderr)
        return 2
    try:
        merge, hand, reqs = parse(read_text(where, args.timeout), where)
    except InputError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if not merge and not hand:
        print(
            f"{prog}: {where}: no {MERGE} or {HANDOFF} series: no A/B split has recorded there (a policy with an ab "
            "section, metrics on, PROMETHEUS_MULTIPROC_DIR set for the server so that the stages' series reach "
            "its /metrics, and chunks received since the server started)",
            file=sys.stderr,
        )
        return 1
    arms = {k[0] for k in merge} | {k[0] for k in hand}
    if args.baseline is not None and args.baseline not in arms:
        idle = " (it counted requests but recorded no merge or hand-off time: nothing to compare with)" if (
            args.baseline in reqs) else ""
        print(f"{prog}: error: --baseline {args.baseline!r}: no such arm in {where} (arms: {', '.join(sorted(arms))})"
              f"{idle}", file=sys.stderr)  # fmt: skip
        return 2
    data = analyse(merge, hand, reqs, args.baseline)
    for g in data["groups"]:  # finite inputs whose figures overflow (bounds or sums near 1e308): no inf, no NaN
        for arm, v in (*g["arms"].items(), *g["versus"].items()):
            if any(isinstance(x, float) and not math.isfinite(x) for x in v.values()):
                print(f"{prog}: error: {where}: the {g['what']} figures of arm {arm!r} overflow: its histogram's "
                      "values are out of range for seconds", file=sys.stderr)
                return 2
    if args.json:
        print(json.dumps(data, indent=2, allow_nan=False))
    else:
        print(format_report(data))
    for line in data["warnings"]:  # the exit status stays 0: printed
        print(f"{prog}: warning: {where}: {line}", file=sys.stderr)
    return 0
