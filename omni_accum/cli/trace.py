"""``omni-accum trace DIR``: summarise a capture; and the ``--trace DIR`` input of ``bench`` and ``tune``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from omni_accum.capture.writer import CaptureError

TRACE_HELP = (
    "replay a capture (a folder written with OMNI_ACCUM_CAPTURE=DIR) instead of a workload: the captured "
    "requests' chunks with their keys, shapes, dtypes and order; buckets from their prompt lengths and "
    "concurrency unless --context-lens / --concurrency are given"
)
PAIR_HELP = (
    "with --trace: the stage pair replayed, as 0-1 or '0->1' (quoted: the shell reads > as a redirection) "
    "(default: the pair that moved the most bytes)"
)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "trace",
        help="summarise a capture: requests, per-key bytes and chunks, hand-offs, what each strategy would save",
        description=(
            "Read a capture folder (OMNI_ACCUM_CAPTURE=DIR, or the connector extra omni_accum_capture) and print, "
            "per stage pair: the requests, their prompt lengths and concurrency (the buckets bench/tune --trace "
            "use), the hand-off times the receiving stage recorded, and per key its kind, chunks, bytes, strategy "
            "and what a strategy would save on this stream (counted from the recorded shapes; bench --trace times "
            "it). A cut or corrupt line is reported (file and line) and skipped."
        ),
    )
    p.add_argument("dir", metavar="DIR", nargs="+", help="capture folder(s) or capture file(s)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def read(paths: list[str], prog: str, warn: bool = True) -> tuple[Any, Any] | None:
    """``(capture, trace)`` of ``paths``, skipped lines warned about on stderr (``warn``); None (after a one-line
    error) when there is nothing to read."""
    from omni_accum.capture.reader import read_capture
    from omni_accum.capture.trace import build_trace

    try:
        cap = read_capture(paths)
    except CaptureError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return None
    for line in cap.notes():  # a file named twice (trace cap cap): read once
        print(f"{prog}: note: {line}", file=sys.stderr)
    for line in cap.warnings() if warn else ():
        print(f"{prog}: warning: {line}", file=sys.stderr)
    trace = build_trace(cap)
    for line in trace.notes() if warn else ():  # trace prints them in its summary
        print(f"{prog}: note: {line}", file=sys.stderr)
    for line in trace.warnings():
        print(f"{prog}: warning: {line}", file=sys.stderr)
    return cap, trace


def empty_input_problem(args: argparse.Namespace) -> str | None:
    """``--workload ''`` or ``--trace ''`` (bench, tune): a usage error, never the default workload; or None."""
    from omni_accum.bench.workloads import workload_names

    if args.workload is not None and not args.workload.strip():
        what = "empty" if not args.workload else "blank"
        return (f"{what} --workload {args.workload!r}: give a workload preset ({', '.join(workload_names())}) or a "
                "YAML or JSON workload file (leave --workload out for the default)")
    if args.trace is not None and not args.trace.strip():
        what = "empty" if not args.trace else "blank"
        return (f"{what} --trace {args.trace!r}: give a capture folder or a capture file (capture-*.jsonl), written "
                "with OMNI_ACCUM_CAPTURE=DIR")
    return None


def trace_workload(args: argparse.Namespace, prog: str) -> Any:
    """The captured workload ``--trace`` / ``--pair`` name, or None after a one-line error (exit 2)."""
    from omni_accum.capture.trace import captured_workload

    got = read([args.trace], prog)
    if got is None:
        return None
    try:
        wl = captured_workload(got[1], args.pair)
    except CaptureError as e:
        print(f"{prog}: error: {args.trace}: {e}", file=sys.stderr)
        return None
    for line in wl._notes:
        print(f"{prog}: note: {args.trace}: {line}", file=sys.stderr)
    for line in wl.bucket_warnings(getattr(args, "context_lens", None), getattr(args, "concurrency", None)):
        print(f"{prog}: warning: {args.trace}: {line}", file=sys.stderr)
    if prog.endswith("bench"):  # tune says it per bucket, with the decode steps it replays
        steps = getattr(args, "steps", None)
        shown = wl.model_copy(update={"decode_steps": steps}) if steps is not None else wl
        for cl in sorted(set(getattr(args, "context_lens", None) or wl.default_context_lens())):
            c = max(getattr(args, "concurrency", None) or wl.concurrency)
            print(f"{prog}: note: {args.trace}: bucket context_len={cl}: {shown.replay_note(cl, c)}", file=sys.stderr)
    return wl


def run(args: argparse.Namespace) -> int:
    from omni_accum.capture.summary import format_summary, skipped_text, summarize

    got = read(args.dir, "omni-accum trace", warn=False)  # the summary lists the skipped lines
    if got is None:
        return 2
    data = summarize(*got)
    if args.json:
        try:  # allow_nan=False: never Infinity or NaN, which are not JSON (the reader refuses such records)
            text = json.dumps(data, indent=2, default=str, allow_nan=False)
        except ValueError as e:
            print(f"omni-accum trace: error: {' '.join(args.dir)}: the summary cannot be printed as JSON ({e})",
                  file=sys.stderr)
            return 2
        print(text)
    else:
        print(format_summary(data))
    if not data["records"]:  # as bench / tune --trace: nothing in it to replay or summarise
        said = f"{skipped_text(data)} skipped, listed above" if data["skipped"] else "no line in it"
        where = " ".join(args.dir)
        print(f"omni-accum trace: error: {where}: the capture holds no complete record ({said})", file=sys.stderr)
        return 2
    return 0
