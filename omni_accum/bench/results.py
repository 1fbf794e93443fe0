"""``omni-accum bench --json``: one document for every wire (``inproc``, ``serializer``, ``shm``, ``mooncake``),
following :data:`RESULT_SCHEMA`, written atomically.

Every row says whether its arm ran (``status``: ``ok``, ``failed`` with the ``error`` it raised, or ``wrong views``
with the first mismatch), and what was not measured is null, never 0 (an upstream arm that raised read
``wire_bytes_per_step: 0.0, peak_bytes: 0``, like a measurement). A run stopped before its last bucket (Ctrl-C)
writes the buckets it finished with ``complete: false``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from collections.abc import Callable
from typing import Any

import torch

from omni_accum.bench._paths import replace_file
from omni_accum.bench.report import BenchRun, bucket_base, p50_interval, ratio_vs
from omni_accum.bench.replay import ArmResult
from omni_accum.policy.fingerprint import dist_version

#: What a row's ``status`` says.
STATUSES = ("ok", "failed", "wrong views")

_COUNT = {"type": ["integer", "null"], "minimum": 0}
_STORE_FIELDS = ("store_bytes_per_request", "put_bytes_p50", "puts", "failed_puts")
_FIGURE = {"type": ["number", "null"], "minimum": 0}

#: JSON schema of ``omni-accum bench --json`` output (every wire but ``arena``, which writes its own: docs/arena.md).
RESULT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "omni-accum bench results",
    "type": "object",
    "required": ["workload", "wire", "machine", "complete", "results"],
    "additionalProperties": False,
    "properties": {
        "workload": {"type": "string"},
        "wire": {"enum": ["inproc", "serializer", "shm", "mooncake"]},
        "machine": {"type": "object"},
        "complete": {"type": "boolean"},
        "stopped": {"type": ["string", "null"]},
        "results": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": [
                    "arm",
                    "key",
                    "context_len",
                    "concurrency",
                    "status",
                    "error",
                    "step_us_p50",
                    "step_us_p99",
                    "total_us_per_request",
                    "wire_bytes_per_step",
                    "peak_bytes",
                    "requests",
                    "steps",
                    "store",
                    "step_us_p50_ci",
                    "repeat_p50_us",
                    "vs",
                ],
                "properties": {
                    "arm": {"type": "string"},
                    "key": {"type": "string"},
                    "context_len": {"type": "integer", "minimum": 1},
                    "concurrency": {"type": "integer", "minimum": 1},
                    "status": {"enum": list(STATUSES)},
                    "error": {"type": ["string", "null"]},
                    "step_us_p50": _FIGURE,
                    "step_us_p99": _FIGURE,
                    "total_us_per_request": _FIGURE,
                    "wire_bytes_per_step": _FIGURE,
                    "peak_bytes": _COUNT,
                    "requests": {"type": "integer", "minimum": 1},
                    "steps": {"type": "integer", "minimum": 1},
                    "step_us_p50_ci": {"type": ["array", "null"], "items": _FIGURE, "minItems": 2, "maxItems": 2},
                    "repeat_p50_us": {"type": ["array", "null"], "items": _FIGURE},
                    "vs": {
                        "type": ["object", "null"],
                        "additionalProperties": False,
                        "required": ["baseline", "ratio", "low", "high", "within_noise"],
                        "properties": {
                            "baseline": {"type": "string"},
                            "ratio": _FIGURE,
                            "low": _FIGURE,
                            "high": _FIGURE,
                            "within_noise": {"type": "boolean"},
                        },
                    },
                    "store": {
                        "type": ["object", "null"],
                        "additionalProperties": False,
                        "required": list(_STORE_FIELDS),
                        "properties": {
                            "store_bytes_per_request": _FIGURE,
                            "put_bytes_p50": _FIGURE,
                            "puts": _COUNT,
                            "failed_puts": _COUNT,
                        },
                    },
                },
            },
        },
    },
}


def machine_info(run: BenchRun | None = None) -> dict[str, Any]:
    """Where the run happened (and how it was run, under ``run``)."""
    ver = dist_version

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "omni_accum": ver("omni-accum"),
        "vllm_omni": ver("vllm-omni"),
    }
    if run is not None:
        info["run"] = {
            "view_hop": run.view_hop,
            "repeats": run.repeats,
            "delta_roundtrip_us": _num(run.delta_roundtrip_us),
        }
    return info


def _num(x: float | None) -> float | None:
    """A figure for JSON: None for what is not a finite number (JSON has no NaN)."""
    return None if x is None or not math.isfinite(x) else round(float(x), 3)


def status_of(r: ArmResult) -> tuple[str, str | None]:
    """``(status, error)`` of an arm: it raised, its views differ from the reference, or it ran as it should."""
    if r.error is not None:
        return "failed", r.error
    if not r.correct:
        return "wrong views", r.mismatch
    return "ok", None


def _vs(r: ArmResult, base: ArmResult | None, name: str) -> dict[str, Any] | None:
    """The table's ratio column of ``r``: its p50 over the bucket's ``base``'s with the 95 % interval over the repeats
    (:func:`~omni_accum.bench.report.ratio_vs`); None without a base or samples."""
    if base is None or not r.samples_us:
        return None
    if r is base:
        return {"baseline": name, "ratio": 1.0, "low": 1.0, "high": 1.0, "within_noise": True}
    q = ratio_vs(base, r)
    if q is None:
        return None
    ratio, low, high, noise = q
    return {"baseline": name, "ratio": _x(ratio), "low": _x(low), "high": _x(high), "within_noise": noise}


def _x(x: float) -> float | None:
    """A ratio for JSON: six significant digits (so a bound beside 1 keeps its side of it), None when not finite."""
    return None if not math.isfinite(x) else float(f"{x:.6g}")


def _row(
    run: BenchRun, r: ArmResult, key: str, wire_bytes: float, peak: int, timed: bool,
    base: tuple[ArmResult | None, str] = (None, ""),
) -> dict[str, Any]:  # fmt: skip
    status, error = status_of(r)
    measured = bool(r.samples_us)  # an arm that raised in its first repeat measured nothing
    store = run.store.get((r.arm, r.context_len, r.concurrency)) if timed and measured else None
    ci = p50_interval(r) if measured and timed else None
    return {
        "arm": r.arm,
        "key": key,
        "context_len": r.context_len,
        "concurrency": r.concurrency,
        "status": status,
        "error": error,
        "step_us_p50": _num(r.step_us_p50) if measured and timed else None,
        "step_us_p99": _num(r.step_us_p99) if measured and timed else None,
        "total_us_per_request": _num(statistics.fmean(r.total_us_per_request))
        if measured and timed and r.total_us_per_request
        else None,
        "wire_bytes_per_step": _num(wire_bytes) if measured else None,
        "peak_bytes": int(peak) if measured else None,
        "requests": r.requests,
        "steps": r.steps,
        "store": None if store is None else {k: store[k] for k in _STORE_FIELDS},
        "step_us_p50_ci": None if ci is None else [_num(ci[0]), _num(ci[1])],
        "repeat_p50_us": [_num(x) for x in r.repeat_medians()] if measured and timed else None,
        "vs": _vs(r, *base) if timed else None,
    }


def to_json(run: BenchRun) -> dict[str, Any]:
    """The JSON document of a run (validates against :data:`RESULT_SCHEMA`)."""
    rows = []
    buckets: dict[tuple[int, int], list[ArmResult]] = {}
    for r in run.results:
        buckets.setdefault((r.context_len, r.concurrency), []).append(r)
    bases = {k: bucket_base(rs) for k, rs in buckets.items()}  # what the table's ratio column compares with
    for r in run.results:
        base = bases[(r.context_len, r.concurrency)]
        rows.append(_row(run, r, r.key, r.wire_bytes_per_step, r.peak_bytes, True, base))
        for k, ks in sorted(r.per_key.items()):
            rows.append(_row(run, r, k, ks.wire_bytes_per_step, ks.peak_bytes, False))
    return {
        "workload": run.workload.name,
        "wire": run.wire,
        "machine": machine_info(run),
        "complete": run.stopped is None,
        "stopped": run.stopped,
        "results": rows,
    }


def write_json(run: BenchRun, path: str | os.PathLike[str]) -> None:
    """Through a random temporary file (``O_EXCL``, in the output's folder) and a rename onto ``path`` itself (a
    link there is replaced, never written through; ``<out>.tmp`` was a fixed name that followed a link planted
    there), keeping an existing file's mode, owner and group (:func:`~omni_accum.bench._paths.replace_file`, the
    writer of ``--plot`` and ``tune --out`` too); the folder is never created (its folder and kind are checked
    before the run: output_path_problem)."""
    data = (json.dumps(to_json(run), indent=2, allow_nan=False) + "\n").encode("utf-8")
    replace_file(path, lambda fh: fh.write(data))


def interrupted_json(run: BenchRun, path: str | os.PathLike[str] | None) -> None:
    """On Ctrl-C with ``--json``: write the buckets that finished, ``complete: false`` (as ``tune`` keeps its
    finished buckets), or say on stderr that nothing was written; a line on stderr either way."""

    def write() -> None:
        run.stopped = "interrupted"
        write_json(run, path)

    interrupted_write(path, len({(r.context_len, r.concurrency) for r in run.results}), write)


def interrupted_write(path: str | os.PathLike[str] | None, buckets: int, write: Callable[[], None]) -> None:
    """What every wire's ``--json`` does on Ctrl-C: ``write()`` the ``buckets`` that finished (marked incomplete
    by ``write``), or say that ``path`` was not written when none had; a line on stderr either way."""
    import sys

    if not path:
        return
    if not buckets:
        print(f"omni-accum bench: no bucket finished before the interrupt: --json {path} was not written",
              file=sys.stderr)  # fmt: skip
        return
    write()
    print(f"omni-accum bench: wrote {path} with the {buckets} bucket(s) finished before the interrupt "
          "(complete: false)", file=sys.stderr)  # fmt: skip
