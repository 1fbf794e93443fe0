"""The e2e harness's report: omni-accum's samples on the server's ``/metrics`` (the hand-off and the stage
processor's accumulation among them), the benchmark table per input length and concurrency, and the
probes' comparison with ``off``. Pure functions (no server needed) plus one fetch; used by ``run.py``."""

from __future__ import annotations

import re
import statistics
import time
import urllib.request
from typing import Any

_SAMPLE_RE = re.compile(r"^(omni_accum_[a-z_]+?)(?:\{(.*)\})?\s+([-+0-9.eEinfNa]+)$")
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

# metric -> (report field, the label it is summed by)
_BY_LABEL = {
    "omni_accum_chunks_total": ("chunks", "role"),
    "omni_accum_wire_bytes_total": ("wire_bytes", "role"),
    "omni_accum_fallbacks_total": ("fallbacks", "reason"),
    "omni_accum_requests_total": ("requests", "role"),
    "omni_accum_handoff_skipped_total": ("handoff_skipped", "reason"),
    "omni_accum_processor_bytes_copied_total": ("processor_bytes_copied", "strategy"),
}
# histograms (their _sum / _count) and counters kept per label set -> (report field, labels, entry field)
_PER_KEY = {
    "omni_accum_handoff_seconds_sum": ("handoff", ("pair", "kind"), "seconds"),
    "omni_accum_handoff_seconds_count": ("handoff", ("pair", "kind"), "count"),
    "omni_accum_handoff_bytes_total": ("handoff", ("pair", "kind"), "bytes"),
    "omni_accum_processor_merge_seconds_sum": ("processor_merge", ("stage", "strategy"), "seconds"),
    "omni_accum_processor_merge_seconds_count": ("processor_merge", ("stage", "strategy"), "count"),
}
_TIMED = ("handoff", "processor_merge")


def parse_metrics(text: str) -> dict[str, Any]:
    """omni-accum's samples in a Prometheus text exposition, summed by what an operator reads: chunks and
    wire bytes per role, bytes kept off the wire, fallbacks per reason, requests per role, the policy-info
    label sets, the hand-off per ``"PAIR KIND"`` and the processor's accumulation per ``"STAGE STRATEGY"``
    (``{count, seconds, bytes}``), and the raw ``omni_accum_*`` lines."""
    out: dict[str, Any] = {
        "chunks": {}, "wire_bytes": {}, "bytes_saved": 0.0, "fallbacks": {}, "requests": {},
        "merge_count": 0.0, "policy_info": [], "handoff": {}, "handoff_skipped": {}, "processor_merge": {},
        "processor_bytes_copied": {}, "lines": [],
    }  # fmt: skip
    for line in text.splitlines():
        m = _SAMPLE_RE.match(line.strip())
        if not m:
            continue
        out["lines"].append(line.strip())
        name, labels, value = m.group(1), dict(_LABEL_RE.findall(m.group(2) or "")), float(m.group(3))
        if name in _BY_LABEL:  # summed per one label
            field_, label = _BY_LABEL[name]
            by = out[field_]
            by[labels.get(label, "?")] = by.get(labels.get(label, "?"), 0.0) + value
        elif name == "omni_accum_handoff_seconds_bucket":  # cumulative counts per upper bound: the p50 row
            e = out["handoff"].setdefault(" ".join(labels.get(k, "?") for k in ("pair", "kind")), {})
            le = labels.get("le", "+Inf")
            bk = e.setdefault("buckets", {})
            bk[le] = bk.get(le, 0.0) + value
        elif name in _PER_KEY:
            field_, keys, entry = _PER_KEY[name]
            e = out[field_].setdefault(" ".join(labels.get(k, "?") for k in keys), {})
            e[entry] = e.get(entry, 0.0) + value
        elif name == "omni_accum_wire_bytes_saved_total":
            out["bytes_saved"] += value
        elif name == "omni_accum_merge_seconds_count":
            out["merge_count"] += value
        elif name == "omni_accum_policy_info" and value:
            out["policy_info"].append(labels)
    return out


def scrape_metrics(base: str, timeout: float = 30) -> dict[str, Any]:
    """The server's ``/metrics``, parsed by :func:`parse_metrics`."""
    req = urllib.request.Request(base + "/metrics", method="GET")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return parse_metrics(r.read().decode(errors="replace"))


def metrics_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """The hand-off and processor entries counted between two scrapes (one benchmark's requests); {} when
    a scrape is missing or failed."""
    if not before or not after or "error" in before or "error" in after:
        return {}
    out: dict[str, Any] = {}
    for field_ in _TIMED:
        d = {}
        for key, e in (after.get(field_) or {}).items():
            b = (before.get(field_) or {}).get(key, {})
            diff = {k: v - b.get(k, 0.0) for k, v in e.items() if k != "buckets"}
            if "buckets" in e:
                was = b.get("buckets") or {}
                diff["buckets"] = {le: c - was.get(le, 0.0) for le, c in e["buckets"].items()}
            if diff.get("count", 0) > 0:
                d[key] = diff
        out[field_] = d
    return out


def mean_ms(entry: dict[str, float] | None) -> float | None:
    if not entry or not entry.get("count"):
        return None
    return 1000.0 * entry.get("seconds", 0.0) / entry["count"]


def p50_ms(entry: dict[str, Any] | None) -> float | None:
    """The median from the histogram's buckets (``entry["buckets"]``: cumulative count per upper bound), linear
    inside its bucket as Prometheus' ``histogram_quantile``; None without buckets. The mean of a few requests
    carries any one that waited (a request the receiving stage had not scheduled yet, fresh pages): the
    median does not."""
    bk = (entry or {}).get("buckets") or {}
    pts = sorted((float(le), c) for le, c in bk.items())
    n = pts[-1][1] if pts else 0.0
    if n <= 0:
        return None
    rank, lo, seen = 0.5 * n, 0.0, 0.0
    for le, cum in pts:
        c = cum - seen
        if c > 0 and cum >= rank:
            if le == float("inf"):
                return 1000.0 * lo
            return 1000.0 * (lo + (le - lo) * (rank - seen) / c)
        seen, lo = cum, le
    return None


def print_metrics(arm: str, m: dict[str, Any] | None) -> None:
    if not m:
        return
    if "error" in m:
        print(f"[{arm}] /metrics: {m['error']}")
        return
    fmt = lambda d: ", ".join(f"{k} {v:.0f}" for k, v in sorted(d.items())) or "none"  # noqa: E731

    def timed(d: dict[str, dict[str, float]]) -> str:
        return (
            ", ".join(
                f"{k}: {e.get('count', 0):.0f} x {mean_ms(e) or 0:.1f} ms"
                + (f", {e['bytes'] / 1e6:.1f} MB" if "bytes" in e else "")
                for k, e in sorted(d.items())
            )
            or "none"
        )

    print(
        f"[{arm}] /metrics (omni-accum, every server process): chunks {fmt(m['chunks'])}; "
        f"wire bytes {fmt(m['wire_bytes'])}; bytes kept off the wire {m['bytes_saved']:.0f}; "
        f"requests {fmt(m['requests'])}; fallbacks {fmt(m['fallbacks'])}; merges timed {m['merge_count']:.0f}; "
        f"hand-off {timed(m.get('handoff') or {})} (skipped {fmt(m.get('handoff_skipped') or {})}); "
        f"processor accumulation {timed(m.get('processor_merge') or {})}; "
        f"policies {sorted({(p.get('source'), p.get('fingerprint')) for p in m['policy_info']})}"
    )


def payload_memcpy_ms(input_len: int, width: int = 2048, repeat: int = 5) -> float | None:
    """One memcpy of the thinker's prefill payload (``embed.prefill`` and ``hidden_states.output``, two
    ``[P+1, width]`` bf16 tensors) in this process, best of ``repeat``: the floor a hand-off is held to."""
    try:
        import torch
    except ImportError:
        return None
    srcs = [torch.ones(input_len + 1, width, dtype=torch.bfloat16) for _ in range(2)]
    dsts = [torch.empty_like(s) for s in srcs]
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for s, d in zip(srcs, dsts):
            d.copy_(s)
        best = min(best, time.perf_counter() - t0)
    return round(1000.0 * best, 2)


# --------------------------------------------------------------------------------------------------
# the orchestrator's per-request stage tables (vllm-omni's --log-stats), for what the client cannot see

_TITLE_RE = re.compile(r"^\[(Overall Summary|StageRequestStats \[request_id=(.+)\])\]\s*$")
# what vLLM's logger puts before each line of a message: "(APIServer pid=5439) INFO 12-03 06:24:06 [stats.py:502] "
_STAGE_WALL_RE = re.compile(r"e2e_stage_(\d+)_wall_time_ms")
_LOG_PREFIX_RE = re.compile(r"^(?:\([^)]*pid=\d+\)\s+)?(?:[A-Z]+ \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\]\s?)?")


def _table_rows(lines: list[str], i: int) -> tuple[list[list[str]], int]:
    """The cells of the PrettyTable that starts at ``lines[i]`` (its ``+---`` rules skipped), and the index
    after it."""
    rows: list[list[str]] = []
    while i < len(lines) and lines[i][:1] in "+|" and lines[i].strip():
        if lines[i].startswith("|"):
            rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
        i += 1
    return rows, i


def _number(cell: str) -> float | None:
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return None


def stage_requests(text: str) -> list[dict[str, Any]]:
    """Per request, from the tables vllm-omni's orchestrator logs with ``--log-stats`` (its
    ``OrchestratorAggregator.build_and_log_summary``: an "Overall Summary" and then the request's
    "StageRequestStats" table, logged one after the other by one synchronous call): ``request_id``,
    ``wall_ms`` (stage -> ms from the stage's submission to its last output, ``e2e_stage_N_wall_time_ms``)
    and ``tokens_out`` (stage -> the tokens of its last output, ``num_tokens_out``). Requests whose stage
    table did not come with a summary have no ``wall_ms``."""
    lines = [_LOG_PREFIX_RE.sub("", line, count=1) for line in text.splitlines()]
    out: list[dict[str, Any]] = []
    summary: dict[str, float] | None = None
    i = 0
    while i < len(lines):
        m = _TITLE_RE.match(lines[i].strip())
        if not m:
            i += 1
            continue
        rows, i = _table_rows(lines, i + 1)
        if m.group(2) is None:  # Overall Summary: Field | Value
            summary = {r[0]: v for r in rows[1:] if len(r) == 2 and (v := _number(r[1])) is not None}
            continue
        if not rows or rows[0][:1] != ["Field"]:
            continue
        stages = [int(c) if c.isdigit() else c for c in rows[0][1:]]
        cells = {r[0]: r[1:] for r in rows[1:]}
        tokens = {s: int(v) for s, c in zip(stages, cells.get("num_tokens_out", [])) if (v := _number(c)) is not None}
        wall = {int(k.group(1)): v for key, v in (summary or {}).items() if (k := _STAGE_WALL_RE.fullmatch(key))}
        out.append({"request_id": m.group(2), "wall_ms": wall, "tokens_out": tokens})
        summary = None
    return out


def stage_rows(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over ``requests`` (:func:`stage_requests`): each stage's wall time and its time per output
    token (wall time / tokens out). The talker's (stage 1) is the talker TPOT the client does not report: the
    client's TPOT is the thinker's text; it includes the talker's own prefill and, with async chunks, the
    waits for the thinker's rows, so it is the pace a user's audio is made at."""
    per: dict[int, dict[str, list[float]]] = {}
    for r in requests:
        for s, ms in r.get("wall_ms", {}).items():
            n = r.get("tokens_out", {}).get(s)
            e = per.setdefault(s, {"wall_ms": [], "ms_per_token": []})
            e["wall_ms"].append(ms)
            if n:
                e["ms_per_token"].append(ms / n)
    return {
        "requests": len(requests),
        "stages": {
            s: {k: (round(statistics.median(v), 3) if v else None) for k, v in e.items()} | {"n": len(e["wall_ms"])}
            for s, e in sorted(per.items())
        },
    }


# --------------------------------------------------------------------------------------------------
# the table

METRICS = [  # (label, key in vllm bench's result json, unit)
    ("E2EL p50", "p50_e2el_ms", "ms"),
    ("E2EL p99", "p99_e2el_ms", "ms"),
    ("TTFT p50", "p50_ttft_ms", "ms"),
    ("TTFT p99", "p99_ttft_ms", "ms"),
    ("TPOT p50", "p50_tpot_ms", "ms"),
    ("TPOT p99", "p99_tpot_ms", "ms"),
    ("ITL p50", "p50_itl_ms", "ms"),
    ("ITL p99", "p99_itl_ms", "ms"),
    ("audio TTFP p50", "p50_audio_ttfp_ms", "ms"),
    ("audio TTFP p99", "p99_audio_ttfp_ms", "ms"),
    ("audio RTF p50", "p50_audio_rtf", ""),
    ("audio RTF p99", "p99_audio_rtf", ""),
]
# (label, stage, field of stage_rows) from vllm-omni's --log-stats tables (run.py --release 0.16 turns them on)
STAGE_METRICS = [
    ("talker ms/token p50", 1, "ms_per_token"),
    ("talker wall p50", 1, "wall_ms"),
    ("thinker wall p50", 0, "wall_ms"),
]
# the hand-off kinds on the way to the first audio packet (a request's first chunk of each pair, or its
# whole payload with async_chunk off)
TTFP_KINDS = ("prefill", "full")
CELL = 26


def metric(raw: dict[str, Any], key: str) -> float | None:
    v = raw.get(key)
    if v is None and key.startswith("p50_"):
        v = raw.get("median_" + key[4:])
    return float(v) if isinstance(v, (int, float)) else None


def server_rows(bench: dict[str, Any]) -> list[tuple[str, float | None, str]]:
    """(label, value, unit) rows a benchmark's server-side counts add to the table: mean hand-off per
    pair and kind (and its median from the histogram's buckets), mean processor accumulation per request, the hand-off on the way to the first audio
    packet as a share of audio TTFP p50, and one memcpy of the prefill payload measured in the run."""
    srv = bench.get("server") or {}
    rows: list[tuple[str, float | None, str]] = []
    for key, e in sorted((srv.get("handoff") or {}).items()):
        rows.append((f"hand-off {key}", mean_ms(e), "ms"))
        if e.get("buckets"):
            rows.append((f"hand-off {key} p50", p50_ms(e), "ms"))
    for key, e in sorted((srv.get("processor_merge") or {}).items()):
        rows.append((f"proc. merge {key}", mean_ms(e), "ms"))
    path = [mean_ms(e) for k, e in (srv.get("handoff") or {}).items() if k.split(" ")[-1] in TTFP_KINDS]
    ttfp = metric(bench.get("raw") or {}, "p50_audio_ttfp_ms")
    rows.append(("hand-off/TTFP", 100.0 * sum(path) / ttfp if path and ttfp else None, "%"))
    rows.append(("payload memcpy", bench.get("memcpy_ms"), "ms"))
    return rows


def _cell(v: float | None, unit: str, base: float | None, ratio: bool, width: int = CELL) -> str:
    if v is None:
        return f"{'-':>{width}}"
    s = f"{v:.1f} {unit}".strip() if unit else f"{v:.3f}"
    if ratio and base:
        s += f" ({v / base:.2f}x)"
    return f"{s:>{width}}"


def off_arm(names: list[str]) -> str | None:
    """The reference of the ratios and of the probes' comparison: the first arm whose policy is ``off`` (``off``,
    ``off@NAME``, ``off#2``, in the run's order); None when no arm ran with omni-accum off."""
    return next((a for a in names if a.split("@")[0].split("#")[0] == "off"), None)


def _stage(stages: dict[Any, Any], stage: int) -> dict[str, Any]:
    """One stage's row of the orchestrator's table: keyed by the stage number in a live run, by its text in a run
    read back from ``--json`` (JSON keys are strings: ``--report`` lost the 0.16 stage rows)."""
    row = stages.get(stage, stages.get(str(stage)))
    return row if isinstance(row, dict) else {}


def answered(b: dict[str, Any] | None) -> str:
    """``completed/sent`` of one benchmark cell (the percentiles are over the answered requests only), or why there
    is no figure: ``-`` (not run), ``rc N`` (the client failed without a result)."""
    if not b:
        return "-"
    raw = b.get("raw") or {}
    if "completed" not in raw:
        return f"rc {b.get('rc')}" if b.get("rc") else "-"
    done, failed = (b["completed"], b["failed"]) if "rounds" in b else (raw["completed"], raw.get("failed"))
    sent = b.get("num_prompts") or (int(done) + int(failed or 0))  # --duration-s: every round's totals
    return f"{int(done)}/{sent}" + (" !" if int(done) < sent else "")


def table_lines(results: list[dict[str, Any]]) -> list[str]:
    """One table per (input length, concurrency): the client's metrics per arm with their ratio to
    the first off arm (``off``, ``off@NAME``: :func:`off_arm`), then the server-side rows (``-`` where an arm has
    no such count, e.g. ``off``, which measures nothing), the hand-off and processor rows with their ratio to
    ``default``. Each arm's column is as wide as its whole name."""
    by: dict[tuple[int, int], dict[str, dict]] = {}
    for arm in results:
        for b in arm.get("bench") or []:
            by.setdefault((int(b.get("input_len") or 0), b["concurrency"]), {})[arm["arm"]] = b
    arms = [a["arm"] for a in results]
    ref = off_arm(arms)
    # each column as wide as its arm's whole name (two arms cut to the same prefix read alike)
    width = {a: max(CELL, len(a) + 2) for a in arms}
    out: list[str] = []
    for (n, c), per_arm in sorted(by.items()):
        said = ("no off arm, so no ratios" if ref is None else f"{ref} has no cell here, so no ratios"
                if ref not in per_arm else f"ratio: arm / {ref}")  # fmt: skip
        out.append(f"\ninput {n} tokens, concurrency {c} ({said})")
        out.append(f"  {'metric':<26}" + "".join(f"{a:>{width[a]}}" for a in arms))
        out.append(f"  {'requests answered':<26}" + "".join(f"{answered(per_arm.get(a)):>{width[a]}}" for a in arms))
        for label, key, unit in METRICS:
            base = metric((per_arm.get(ref) or {}).get("raw") or {}, key)
            cells = [_cell(metric((per_arm.get(a) or {}).get("raw") or {}, key), unit, base, a != ref, width[a])
                     for a in arms]  # fmt: skip
            out.append(f"  {label:<26}" + "".join(cells))
        for label, stage, field in STAGE_METRICS:  # the orchestrator's tables (--log-stats), where the run has them
            vals = {a: _stage((((per_arm.get(a) or {}).get("stages") or {}).get("stages") or {}), stage).get(field)
                    for a in arms}  # fmt: skip
            if any(v is not None for v in vals.values()):
                cells = [_cell(vals[a], "ms", vals.get(ref), a != ref, width[a]) for a in arms]
                out.append(f"  {label:<26}" + "".join(cells))
        srv = {a: {label: (v, unit) for label, v, unit in server_rows(per_arm.get(a) or {})} for a in arms}
        labels: list[str] = []
        for a in arms:
            labels += [k for k in srv[a] if k not in labels]
        if labels:  # off measures nothing; default (vllm-omni's own payload path, timed) is their reference
            out.append("  server side" + (" (hand-off and processor rows: ratio arm / default)" if "default" in arms else ""))
        for label in labels:
            dref = srv.get("default", {}).get(label, (None, ""))[0] if label != "payload memcpy" else None
            cells = [_cell(*srv[a].get(label, (None, "")), dref, a != "default", width[a]) for a in arms]
            out.append(f"  {label[:26]:<26}" + "".join(cells))
    return out


def print_table(results: list[dict[str, Any]]) -> None:
    for line in table_lines(results):
        print(line)


def compare(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each arm's probes against the off arm's (:func:`off_arm`, the first arm with omni-accum off): text, text
    token ids and audio bytes (SHA-256)."""
    by = {r["arm"]: (r.get("correctness") or {}).get("probes") or [] for r in results}
    out: dict[str, Any] = {}
    off = off_arm(list(by))
    if off is None or not by[off]:
        return out
    ref = by[off]
    for arm, probes in by.items():
        if arm == off:
            continue
        text_eq = len(probes) == len(ref) and all(
            (a.get("text"), a.get("text_token_ids")) == (b.get("text"), b.get("text_token_ids"))
            for a, b in zip(probes, ref)
        )
        audio_eq = len(probes) == len(ref) and all(
            a.get("audio_sha256") == b.get("audio_sha256") and b.get("audio_sha256") for a, b in zip(probes, ref)
        )
        out[arm] = {"equals_off": bool(text_eq and audio_eq), "text_equal": text_eq, "audio_equal": bool(audio_eq)}
    return out
