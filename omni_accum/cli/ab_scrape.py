"""``omni-accum ab``'s input: a saved ``/metrics`` scrape or a URL, read and checked into per-arm histograms.

The series read (:data:`MERGE`, :data:`HANDOFF`, :data:`REQUESTS`) are checked before they are added up: finite
counts >= 0 and sums, buckets that never decrease as ``le`` grows, ``_count`` equal to the +Inf bucket, the same
bucket bounds in every series of an arm (else they cannot be added), and totals that stay finite once summed. A
corrupt one is refused (:class:`InputError`, exit 2), named with its line, rather than read as nonsense; the other
series of the page are not looked at. The Prometheus text format is read, and OpenMetrics (a page that ends with
``# EOF``) with its own parser.
"""

from __future__ import annotations

import math
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MERGE = "omni_accum_ab_merge_seconds"
HANDOFF = "omni_accum_ab_handoff_seconds"
REQUESTS = "omni_accum_ab_requests_total"
MAX_BYTES = 64 * 1024 * 1024  # a /metrics page is some KiB to a few MiB


class InputError(Exception):
    """The input named cannot be read or parsed (exit 2)."""


def read_text(where: str, timeout: float = 10.0) -> str:
    """The text of a ``/metrics`` URL or of a saved scrape file."""
    if not where.strip():
        raise InputError(f"{where!r}: an empty --metrics; give a saved /metrics scrape or an http(s) URL")
    if re.match(r"[\w.-]+:\d+(/|$)", where) and not Path(where).exists():  # host:port/metrics, no scheme
        raise InputError(f"{where}: a host and port without a scheme: give http://{where}")
    try:
        scheme = urllib.parse.urlsplit(where).scheme.lower()
    except ValueError as e:  # "http://[::1": an unclosed IPv6 host
        if not Path(where).exists():
            raise InputError(f"{where}: cannot read the URL: {e}") from e
        scheme = ""
    if scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(where, timeout=timeout) as resp:  # noqa: S310 - http(s) only, checked above
                body = resp.read(MAX_BYTES + 1)
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", None) or e
            if isinstance(e, urllib.error.HTTPError):
                reason = f"HTTP {e.code} {e.reason}"
            raise InputError(f"{where}: cannot read the URL: {reason}") from e
        if len(body) > MAX_BYTES:
            raise InputError(f"{where}: more than {MAX_BYTES >> 20} MiB: not a /metrics page")
        return body.decode("utf-8", "replace")
    if scheme and len(scheme) > 1:  # a URL of another kind (c:\\ is a drive, not a scheme)
        raise InputError(f"{where}: unsupported URL scheme {scheme!r}: give an http(s) URL or a file")
    path = Path(where)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "no such file" if not path.exists() else "not a regular file"
        raise InputError(f"{where}: {what} (give a saved /metrics scrape or an http(s) URL)")
    try:
        with path.open("rb") as f:
            body = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise InputError(f"{where}: cannot read: {e.strerror or e}") from e
    if len(body) > MAX_BYTES:
        raise InputError(f"{where}: more than {MAX_BYTES >> 20} MiB: not a /metrics scrape")
    return body.decode("utf-8", "replace")


@dataclass
class Hist:
    """One arm's histogram (summed over the series that share its labels): cumulative counts per ``le``."""

    buckets: dict[float, float]
    total: float = 0.0
    count: float = 0.0


def parse(text: str, where: str) -> tuple[dict[tuple[str, ...], Hist], dict[tuple[str, ...], Hist], dict[str, dict]]:
    """``(merge by (arm,), hand-off by (arm, pair, kind), requests by arm by role)`` of a scrape."""
    openmetrics = text.rstrip().endswith("# EOF")  # the text parser would end a family at its first _created
    try:
        if openmetrics:
            from prometheus_client.openmetrics.parser import text_string_to_metric_families
        else:
            from prometheus_client.parser import text_string_to_metric_families
    except ImportError as e:  # vLLM depends on it; a bare install may not have it
        raise InputError(f"reading {where} needs prometheus_client: pip install prometheus_client") from e
    merge: dict[tuple[str, ...], Hist] = {}
    hand: dict[tuple[str, ...], Hist] = {}
    reqs: dict[str, dict[str, float]] = {}
    first: dict[tuple[str, tuple[str, ...]], tuple] = {}  # the first series summed into each arm's key, to name it
    try:
        for fam in text_string_to_metric_families(text):
            if fam.name in (MERGE, HANDOFF):
                into, names = (merge, ("arm",)) if fam.name == MERGE else (hand, ("arm", "pair", "kind"))
                series: dict[tuple, list] = {}  # one histogram per label set (le aside): each checked on its own
                for s in fam.samples:
                    if s.name in (f"{fam.name}_bucket", f"{fam.name}_sum", f"{fam.name}_count"):
                        series.setdefault(tuple(sorted((k, v) for k, v in s.labels.items() if k != "le")), []).append(s)
                for labels, samples in series.items():
                    one = _histogram(samples, text, where)
                    key = tuple(samples[0].labels.get(n, "") for n in names)
                    h = into.setdefault(key, Hist({}))
                    if h.buckets and set(h.buckets) != set(one.buckets):
                        _different_bounds(where, fam.name, first[fam.name, key], h, labels, one)
                    first.setdefault((fam.name, key), labels)
                    for le, c in one.buckets.items():
                        h.buckets[le] = h.buckets.get(le, 0.0) + c
                    h.total += one.total
                    h.count += one.count
            elif fam.name in (REQUESTS, REQUESTS.removesuffix("_total")):
                for s in fam.samples:
                    if s.name.endswith("_total"):
                        if not (math.isfinite(s.value) and s.value >= 0):
                            _invalid(text, where, s, "counter (a count of requests: a finite number >= 0)")
                        row = reqs.setdefault(s.labels.get("arm", ""), {})
                        role = s.labels.get("role", "")
                        row[role] = row.get(role, 0.0) + s.value
    except (ValueError, TypeError, KeyError, IndexError) as e:
        fmt = "OpenMetrics" if openmetrics else "the Prometheus text format"
        why = str(e) if len(str(e)) <= 160 else str(e)[:160] + "..."  # the parser quotes the whole line
        why = why or _first_line_text(text)  # some of the parser's errors say nothing
        hint = " (this is a capture of omni-accum: read it with omni-accum trace)" if text.startswith('{"v":') else ""
        raise InputError(f"{where}{_bad_line(text) if not openmetrics else ''}: not {fmt}: {why}{hint}") from e
    for what, table in (("merge", merge), ("hand-off", hand)):  # each series finite, their sums too
        for key, h in table.items():
            if not all(math.isfinite(x) for x in (h.count, h.total, *h.buckets.values())):
                raise InputError(f"{where}: the {what} series of arm {key[0]!r} add up past a float's range")
    if not all(math.isfinite(v) for row in reqs.values() for v in row.values()):
        raise InputError(f"{where}: the {REQUESTS} series add up past a float's range")
    return merge, hand, reqs


def _different_bounds(where: str, family: str, a: tuple, ha: Hist, b: tuple, hb: Hist) -> None:
    """Raise the InputError of two series of one arm whose buckets have different bounds: their counts per
    ``le`` cannot be added (the sum would not be one histogram)."""

    def name(labels: tuple) -> str:
        return family + "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"

    def bounds(h: Hist) -> str:
        les = sorted(h.buckets)
        shown = ", ".join("+Inf" if le == math.inf else _num(le) for le in les[:6])
        return shown + (f", ... ({len(les)} in all)" if len(les) > 6 else "")

    raise InputError(
        f"{where}: {name(b)} has buckets up to le {bounds(hb)}, but {name(a)} of the same arm has {bounds(ha)}: "
        "series with different bucket bounds cannot be added (scrape processes that run one omni-accum version)"
    )


def _num(v: float) -> str:
    return "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf") if math.isinf(v) else f"{v:.15g}"


def _invalid(text: str, where: str, s: Any, what: str, fault: str | None = None) -> None:
    """Raise the InputError of sample ``s``: its file (or URL), line, series, ``fault`` (default: its value) and
    ``what`` it should be."""
    esc = {"\\": "\\\\", '"': '\\"', "\n": "\\n"}  # as the text format writes a label's value
    labels = ",".join(f'{k}="{"".join(esc.get(c, c) for c in v)}"' for k, v in s.labels.items())
    series = f"{s.name}{{{labels}}}" if labels else s.name
    raise InputError(f"{where}{_line_of(text, s)}: {series} {fault or 'is ' + _num(s.value)}: not a valid {what}")


def _histogram(samples: list, text: str, where: str) -> Hist:
    """The Hist of one series' ``_bucket``, ``_sum`` and ``_count`` samples, refused (InputError naming the line)
    unless they make a histogram: counts finite and >= 0, a finite sum, buckets that never decrease as ``le``
    grows, and a ``_count`` equal to the +Inf bucket."""
    h, les, count = Hist({}), {}, None
    for s in samples:
        v, kind = s.value, s.name.rsplit("_", 1)[1]
        if kind == "sum":
            if not math.isfinite(v):
                _invalid(text, where, s, "histogram (_sum is the sum of the observations: a finite number)")
            h.total += v
            continue
        if not (math.isfinite(v) and v >= 0):
            _invalid(text, where, s, f"histogram (a {'bucket' if kind == 'bucket' else '_count'} counts "
                     "observations: a finite number >= 0)")  # fmt: skip
        if kind == "count":
            h.count, count = h.count + v, s
            continue
        try:
            le = float(s.labels["le"])
        except (KeyError, ValueError):
            le = math.nan
        if math.isnan(le):
            fault = f"has le={s.labels['le']!r}, not a number" if "le" in s.labels else "has no le label"
            _invalid(text, where, s, 'histogram (a bucket has a label le="<upper bound>": a number or +Inf)', fault)
        h.buckets[le] = h.buckets.get(le, 0.0) + v
        les[le] = s
    prev = None
    for le in sorted(h.buckets):
        if prev is not None and h.buckets[le] < h.buckets[prev]:
            _invalid(text, where, les[le], "histogram (the buckets are cumulative: each counts the observations "
                     "up to its le, so they never decrease as le grows)",
                     f'is {_num(h.buckets[le])}, less than {_num(h.buckets[prev])} at le="{les[prev].labels["le"]}"')
        prev = le
    top = h.buckets.get(math.inf)
    if count is not None and top is not None and abs(h.count - top) > 1e-9 * max(1.0, top):
        _invalid(text, where, count, "histogram (_count and the +Inf bucket both count every observation)",
                 f'is {_num(h.count)} but its le="+Inf" bucket is {_num(top)}')
    return h


def _line_of(text: str, s: Any) -> str:
    """``", line N"`` of the first line holding sample ``s`` (its name and labels), else ``""``."""
    from prometheus_client.parser import text_string_to_metric_families

    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(s.name):
            try:
                got = [x for fam in text_string_to_metric_families(line + "\n") for x in fam.samples]
            except (ValueError, TypeError, KeyError, IndexError):
                continue
            if got and got[0].name == s.name and got[0].labels == s.labels:
                return f", line {n}"
    return ""


def _first_line_text(text: str) -> str:
    """What the first line that does not parse alone reads (cut to 80 characters), for a parser error with no
    message of its own."""
    place = _bad_line(text)
    if not place:
        return "text the parser cannot read"
    line = text.splitlines()[int(place.rsplit(" ", 1)[1]) - 1]
    return f"{line[:80] + ('...' if len(line) > 80 else '')!r} is no sample, comment or blank line"


def _bad_line(text: str) -> str:
    """``", line N"`` of the first line that does not parse alone (a sample or a comment), else ``""``."""
    from prometheus_client.parser import text_string_to_metric_families

    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        try:
            for fam in text_string_to_metric_families(line + "\n"):
                list(fam.samples)
        except (ValueError, TypeError, KeyError, IndexError):
            return f", line {n}"
    return ""
