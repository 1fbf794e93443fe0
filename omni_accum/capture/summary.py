"""What ``omni-accum trace DIR`` prints: a capture's requests, keys, bytes, hand-offs, and what each
strategy would save on that stream.

The savings are counted from the recorded shapes (bytes copied or sent), not timed: ``bench --trace``
and ``tune --trace`` time them. Per key of a stage pair:

* an append key carried in more than one chunk of a request, whose consumer reads the accumulated view:
  ``cat`` (vllm-omni's ``torch.cat`` per chunk) copies the rows accumulated so far at every chunk;
  ``prealloc`` and ``token_list`` copy each row once; the difference is the saving;
* an append key the consumer takes chunk by chunk (read ``delta``: nothing accumulates), or carried in one
  chunk per request: nothing to save;
* a replace key re-sent with the same shape in later chunks of a request: ``send_once`` keeps an unchanged
  value off the wire (at most those bytes: a capture without values cannot tell unchanged from changed);
  sent once per request, or a few bytes: nothing measurable.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from omni_accum.capture.keys import _read_of, known_key
from omni_accum.capture.reader import Capture, Problem
from omni_accum.capture.trace import Trace, _with_keys

#: Bytes per chunk under which a key's saving is "nothing measurable".
TINY = 64


def _mb(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    if n >= 1e6:
        return f"{n / 1e6:.1f} MB"
    if n >= 1e3:
        return f"{n / 1e3:.1f} KB"
    return f"{int(n)} B"


def _saving(kind: str, read: str, chunks: int, requests: int, nbytes: int, cat_copy: int, resent: int) -> dict:
    per_chunk = nbytes / chunks if chunks else 0
    if kind == "append":
        if chunks <= requests:
            return {"strategy": None, "bytes": 0, "note": "nothing: one chunk per request, nothing to concatenate"}
        if read == "delta":
            return {"strategy": None, "bytes": 0,
                    "note": "nothing: the consumer takes each chunk's rows (the receiver keeps none to concatenate)"}
        saved = max(0, cat_copy - nbytes)
        return {"strategy": "prealloc or token_list", "bytes": saved,
                "note": f"cat copies {_mb(cat_copy)} (the accumulated rows at every chunk); prealloc / token_list "
                f"copy each row once ({_mb(nbytes)}): {_mb(saved)} fewer bytes copied"}
    if per_chunk <= TINY:
        return {"strategy": None, "bytes": 0, "note": "nothing measurable (a few bytes per chunk)"}
    if not resent:
        return {"strategy": None, "bytes": 0, "note": "nothing: sent once per request already"}
    return {"strategy": "send_once", "bytes": resent,
            "note": f"send_once keeps up to {_mb(resent)} off the wire (re-sends with an unchanged shape; "
            "a capture without values cannot tell whether the value changed)"}


def summarize(capture: Capture, trace: Trace) -> dict[str, Any]:
    """The summary as data (``trace --json``)."""
    out: dict[str, Any] = {
        "files": [str(f) for f in capture.files],
        "records": len(capture.records),
        "skipped": [str(p) for p in capture.problems],
        **skipped_counts(capture.problems),
        "warnings": trace.warnings(),  # also on stderr (omni-accum trace)
        "notes": trace.notes(),
        "pairs": {},
    }
    for pair in trace.pairs():
        side, empty = _with_keys(trace.side(pair))  # as bench / tune --trace replay it: chunks with no key left out
        if empty:
            out["notes"].append(
                f"stage pair {pair}: left out {empty} captured chunk(s) that carry no payload key (records with "
                '"keys": []): nothing in them to accumulate; not counted in the figures'
            )
        role = "send" if trace.requests.get((pair, "send")) else "recv"
        conc = trace.concurrency(pair, of=side)
        lens = [r.prompt_len() for r in side]
        kinds = trace.key_kinds(pair)  # one kind per key, as bench / tune --trace replay it
        keys: dict[str, dict[str, Any]] = {}
        for r in side:
            acc: dict[str, int] = {}
            last_shape: dict[str, tuple[int, ...]] = {}
            for c in r.chunks:
                for k in c.keys:
                    e = keys.setdefault(k.path, {"kind": "replace", "dtype": k.dtype, "strategies": [], "chunks": 0,
                                                 "requests": 0, "bytes": 0, "_cat": 0, "_resent": 0, "_reqs": set()})
                    kind = kinds[k.path]
                    if kind == "append":
                        e["kind"] = "append"
                    if k.strategy not in e["strategies"]:
                        e["strategies"].append(k.strategy)
                    e["chunks"] += 1
                    e["bytes"] += k.nbytes
                    e["_reqs"].add(r.req)
                    acc[k.path] = acc.get(k.path, 0) + k.nbytes
                    e["_cat"] += acc[k.path] if last_shape.get(k.path) is not None else 0
                    if kind != "append" and last_shape.get(k.path) == k.shape:
                        e["_resent"] += k.nbytes
                    last_shape[k.path] = k.shape
        for path, e in keys.items():
            e["requests"] = len(e.pop("_reqs"))
            cat, resent = e.pop("_cat"), e.pop("_resent")
            known = known_key(path)
            e["read"] = _read_of(path, e["kind"])  # kind: as Trace.key_kinds decided it
            e["read_from"] = known[0] if known else None
            e["would_save"] = _saving(e["kind"], e["read"], e["chunks"], e["requests"], e["bytes"], cat, resent)
            if known is None and e["kind"] == "append" and e["chunks"] > e["requests"]:
                e["would_save"]["note"] += (
                    f"; read taken as '{e['read']}', as 0.30.0's talker reads an appended key (no built-in preset has "
                    "this key; bench and tune --trace replay it so)"
                )
        handoffs = _handoffs(trace, pair)
        out["pairs"][pair] = {
            "side": role,
            "requests": len(side),
            "chunks": sum(len(r.chunks) for r in side),
            "context_len": {"min": min(lens), "p50": statistics.median(lens), "max": max(lens)} if lens else None,
            "concurrency": {"p50": statistics.median(conc), "max": max(conc)} if conc else None,
            "buckets": {"context_lens": trace.context_lens(pair, of=side),
                        "concurrency": trace.concurrency_levels(pair, of=side)},
            "keys": keys,
            "handoff": handoffs,
        }
    return out


def skipped_counts(problems: list[Problem]) -> dict[str, int]:
    """``{"skipped_lines": N, "skipped_files": M}``: lines skipped (a run of lines of another record version counts
    each of its lines) and files not read at all (a symlink, a folder, one that cannot be read)."""
    lines = sum((p.last or p.line) - p.line + 1 for p in problems if p.line)
    return {"skipped_lines": lines, "skipped_files": sum(1 for p in problems if not p.line)}


def skipped_text(data: Mapping[str, Any]) -> str:
    """``"3 line(s)"``, ``"2 file(s)"`` or ``"3 line(s) and 1 file(s)"`` of a summary's skipped problems."""
    parts = [f"{data[k]} {w}(s)" for k, w in (("skipped_lines", "line"), ("skipped_files", "file")) if data.get(k)]
    return " and ".join(parts) or "nothing"


def _handoffs(trace: Trace, pair: str) -> dict[str, Any]:
    """Hand-off seconds the receiving side recorded: the first chunk of a request and the later ones."""
    first, later = [], []
    for r in trace.requests.get((pair, "recv"), []):
        for i, c in enumerate(r.chunks):
            if c.handoff_s is not None:
                (first if i == 0 else later).append(c.handoff_s)
    out = {}
    for name, xs in (("first_chunk", first), ("later_chunks", later)):
        if xs:
            out[name] = {"count": len(xs), "p50_s": statistics.median(xs), "max_s": max(xs)}
    return out


def format_summary(data: Mapping[str, Any]) -> str:
    """The summary as text (``omni-accum trace DIR``)."""
    n = data["records"]
    lines = [f"capture: {len(data['files'])} file(s), {n} record{'' if n == 1 else 's'}"]
    if data["skipped"]:
        lines.append(f"skipped {skipped_text(data)} (a cut or corrupt record, a file not read; the rest is used):")
        lines += [f"  {s}" for s in data["skipped"][:10]]
        if len(data["skipped"]) > 10:
            lines.append(f"  ... and {len(data['skipped']) - 10} more (trace --json lists them all)")
    lines += [f"note: {s}" for s in data.get("notes", ())]
    for pair, p in data["pairs"].items():
        lines.append("")
        cl, cc = p["context_len"], p["concurrency"]
        if not p["requests"]:
            lines.append(f"stage pair {pair}: no chunk with a payload key (nothing to replay or count)")
            continue
        lines.append(
            f"stage pair {pair} ({'sending' if p['side'] == 'send' else 'receiving'} side): {p['requests']} requests, "
            f"{p['chunks']} chunks; prompt length {cl['min']}..{cl['max']} (p50 {cl['p50']:g}); "
            f"requests at once p50 {cc['p50']:g}, max {cc['max']}"
        )
        b = p["buckets"]
        lines.append(
            f"  buckets for bench/tune --trace: --context-lens {','.join(map(str, b['context_lens']))} "
            f"--concurrency {','.join(map(str, b['concurrency']))}"
        )
        for name, h in p["handoff"].items():
            lines.append(
                f"  hand-off ({name.replace('_', ' ')}): {h['count']} timed, p50 {h['p50_s'] * 1e3:.2f} ms, "
                f"max {h['max_s'] * 1e3:.2f} ms"
            )
        rows = [("key", "kind", "chunks", "requests", "bytes", "strategy", "what a strategy would save")]
        for path, e in p["keys"].items():
            rows.append((path, e["kind"], str(e["chunks"]), str(e["requests"]), _mb(e["bytes"]),
                         ",".join(e["strategies"]), e["would_save"]["note"]))
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        for i, r in enumerate(rows):
            lines.append("  " + "  ".join(x.ljust(w) for x, w in zip(r[:6], widths)) + "  " + r[6])
            if i == 0:
                lines.append("  " + "  ".join("-" * w for w in widths) + "  " + "-" * 26)
    return "\n".join(lines)
