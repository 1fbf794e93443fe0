"""A/B benchmarks: arms from names, runs over buckets, tables, JSON (with its schema) and a plot.

An arm name is one of:

* ``upstream`` — vllm-omni 0.30.0's own ``_accumulate_payload`` (the baseline);
* a strategy name (``cat``, ``token_list``, ``prealloc``, ``send_once``, ``replace`` or a plugin's):
  the strategy on the workload's keys it applies to (append-kind keys for append strategies,
  replace/static keys otherwise), upstream-equivalent behaviour (the ``default`` preset) elsewhere;
* a policy preset name (``qwen3-omni``) or a policy file: the policy as is;
* ``wire-floor`` — no accumulation: the cost of shipping each delta over the wire (and view hop),
  measured in the same run; the floor every arm is compared with.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

import torch

from omni_accum.errors import OmniAccumError
from omni_accum.loader import load_policy, preset_names
from omni_accum.manager import get_manager
from omni_accum.policy import Policy
from omni_accum.replay import UPSTREAM, WIRE_FLOOR, Arm, ArmResult, VllmOmniUnavailable, delta_roundtrip_us, measure
from omni_accum.workloads import MAX_ROWS, Workload, load_workload

#: JSON schema of ``omni-accum bench --json`` output.
RESULT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "omni-accum bench results",
    "type": "object",
    "required": ["workload", "wire", "machine", "results"],
    "additionalProperties": False,
    "properties": {
        "workload": {"type": "string"},
        "wire": {"enum": ["inproc", "serializer", "shm"]},
        "machine": {"type": "object"},
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
                    "step_us_p50",
                    "step_us_p99",
                    "wire_bytes_per_step",
                    "peak_bytes",
                    "requests",
                    "steps",
                ],
                "properties": {
                    "arm": {"type": "string"},
                    "key": {"type": "string"},
                    "context_len": {"type": "integer", "minimum": 1},
                    "concurrency": {"type": "integer", "minimum": 1},
                    "step_us_p50": {"type": ["number", "null"], "minimum": 0},
                    "step_us_p99": {"type": ["number", "null"], "minimum": 0},
                    "wire_bytes_per_step": {"type": "number", "minimum": 0},
                    "peak_bytes": {"type": "integer", "minimum": 0},
                    "requests": {"type": "integer", "minimum": 1},
                    "steps": {"type": "integer", "minimum": 1},
                },
            },
        },
    },
}


class PlotUnavailable(OmniAccumError):
    """``--plot`` needs matplotlib (the ``plot`` extra)."""


class BenchError(OmniAccumError):
    """A bench run cannot go on: a bucket too large for this machine's memory, a bad context length."""


# ---------------------------------------------------------------------------------------------- #
# Arms
# ---------------------------------------------------------------------------------------------- #


def strategy_arm(workload: Workload, strategy: str, params: dict[str, Any] | None = None) -> Policy | None:
    """Policy applying ``strategy`` to the workload's keys it fits, the ``default`` preset elsewhere.

    None when no key of the workload fits the strategy's kinds.
    """
    spec = get_manager().spec(strategy)
    kinds = ("append",) if "append" in spec.kinds else tuple(k for k in ("replace", "static") if k in spec.kinds)
    paths = workload.keys_of_kind(*kinds)
    if not paths:
        return None
    base = load_policy("default")
    rules = [{"match": p, "strategy": strategy, "params": dict(params or {})} for p in paths]
    rules += [r.model_dump() for r in base.rules if r.match not in paths]
    return load_policy(
        {
            "description": f"{strategy} on {', '.join(paths)}; default elsewhere",
            "default": base.default.model_dump(),
            "honor_override_keys": base.honor_override_keys,
            "rules": rules,
        }
    )


def workload_policy_problem(workload: Workload, source: str | None = None) -> str | None:
    """Why the workload's ``policy`` field names no policy preset nor policy file, or None.

    ``source`` (the ``--workload`` value) is named in the message; default: the workload's name.
    """
    if not workload.policy or workload.policy in preset_names() or Path(workload.policy).is_file():
        return None
    where = source if source is not None else f"workload {workload.name!r}"
    return (
        f"{where}: field 'policy': {workload.policy!r} is neither a policy preset "
        f"({', '.join(sorted(preset_names()))}) nor a policy file"
    )


def default_arm_names(workload: Workload) -> list[str]:
    """``upstream``; ``cat``, ``token_list`` and ``prealloc`` when a key is append-kind; ``send_once`` when
    one is replace or static (``replace`` is upstream's behaviour there already); the workload's ``policy``."""
    names = [UPSTREAM, "cat", "token_list", "prealloc"] if workload.keys_of_kind("append") else [UPSTREAM]
    if workload.keys_of_kind("replace", "static"):
        names.append("send_once")
    if workload.policy:
        names.append(workload.policy)
    return names


def arm_policy_files(workload: Workload, names: Sequence[str] | None = None) -> list[str]:
    """The policy files among the arms ``names`` (``None``: :func:`default_arm_names`), as :func:`build_arms`
    reads them: names that are not ``upstream``, ``wire-floor``, a strategy nor a preset, and are files."""
    manager = get_manager()
    presets = set(preset_names())
    names = list(names) if names is not None else default_arm_names(workload)
    return [
        n
        for n in names
        if n not in (UPSTREAM, WIRE_FLOOR) and manager.get_spec(n) is None and n not in presets and Path(n).is_file()
    ]


def upstream_available() -> bool:
    try:
        from omni_accum.replay import UpstreamEngine

        UpstreamEngine()
    except VllmOmniUnavailable:
        return False
    return True


def build_arms(workload: Workload, names: Sequence[str] | None = None, *, warn: TextIO | None = None) -> dict[str, Arm]:
    """Arms by name (see the module docstring); ``None`` gives :func:`default_arm_names`.

    With the default names, ``upstream`` is left out (with a note) when vllm-omni cannot be imported;
    named explicitly, it raises :class:`VllmOmniUnavailable`.
    """
    explicit = names is not None
    if not explicit:
        problem = workload_policy_problem(workload)
        if problem:
            raise OmniAccumError(problem)
    names = list(names) if names is not None else default_arm_names(workload)
    manager = get_manager()
    presets = set(preset_names())
    arms: dict[str, Arm] = {}
    for name in names:
        if name == WIRE_FLOOR:
            arms[name] = WIRE_FLOOR
        elif name == UPSTREAM:
            if not explicit and not upstream_available():
                if warn is not None:
                    print("note: vllm-omni is not importable; the upstream arm is left out", file=warn)
                continue
            arms[name] = UPSTREAM
        elif manager.get_spec(name) is not None:
            policy = strategy_arm(workload, name)
            if policy is None:
                if warn is not None:
                    print(f"note: arm {name!r} skipped: no key of workload {workload.name!r} fits it", file=warn)
                continue
            arms[name] = policy
        elif name in presets or Path(name).is_file():
            arms[name] = load_policy(name)
        else:
            raise OmniAccumError(
                f"unknown arm {name!r}: not 'upstream', 'wire-floor', a strategy ({', '.join(manager.names())}), "
                f"a policy preset ({', '.join(sorted(presets))}) nor a policy file"
            )
    if not arms:
        raise OmniAccumError("no arm to run")
    return arms


# ---------------------------------------------------------------------------------------------- #
# Running
# ---------------------------------------------------------------------------------------------- #


def context_lens_problem(context_lens: Iterable[int], option: str = "--context-lens") -> str | None:
    """Why a context length cannot be benchmarked (under 1 or over :data:`MAX_ROWS`), or None."""
    for n in context_lens:
        if n < 1 or n > MAX_ROWS:
            return f"{option} {n}: context lengths go from 1 to {MAX_ROWS} ({MAX_ROWS // 1000}k) prefill rows"
    return None


def is_allocation_failure(e: BaseException) -> bool:
    """``e`` is torch's (or Python's) failure to allocate memory, not a bug."""
    if isinstance(e, MemoryError) or isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text.lower() or "size calculation overflowed" in text
    )


def allocation_detail(e: BaseException) -> str:
    """``" (could not allocate 81.9 TB)"`` from torch's allocator message, else ``""``."""
    m = re.search(r"tried to allocate (\d+) bytes", str(e))
    return f" (could not allocate {_fmt_bytes(int(m.group(1)))})" if m else ""


@dataclass
class BenchRun:
    """Everything one ``omni-accum bench`` run measured."""

    workload: Workload
    wire: str
    view_hop: str | None
    repeats: int
    results: list[ArmResult] = field(default_factory=list)
    delta_roundtrip_us: float | None = None


class Progress:
    """A progress bar with ETA on a stream (stderr), drawn only once a run takes over a second."""

    def __init__(self, total: int, stream: TextIO | None = None, *, min_interval: float = 0.2) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.monotonic()
        self._last = 0.0
        self._drawn = False
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._min = min_interval if self._tty else 5.0

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.t0 < 1.0 or now - self._last < self._min:
            return
        self._last = now
        self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(1.0, self.done / self.total)
        el = now - self.t0
        eta = el / frac - el if frac > 0 else float("nan")
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        line = f"[{bar}] {100 * frac:5.1f}% {el:6.1f}s elapsed, ETA {eta:6.1f}s"
        self.stream.write(("\r" + line) if self._tty else (line + "\n"))
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn and self._tty:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()


def run_bench(
    workload: Workload | str,
    arms: dict[str, Arm],
    *,
    context_lens: Iterable[int] | None = None,
    concurrency: Iterable[int] | None = None,
    wire: str = "inproc",
    view_hop: str | None = None,
    repeats: int = 3,
    per_key: bool = False,
    through: str = "direct",
    progress: TextIO | None = None,
    on_bucket: Callable[[list[ArmResult]], None] | None = None,
) -> BenchRun:
    """Measure ``arms`` in every bucket (context length x concurrency) of the workload.

    Raises :class:`BenchError` for a context length over :data:`~omni_accum.workloads.MAX_ROWS` (before
    measuring) and when a bucket's stream or state cannot be allocated.
    """
    wl = load_workload(workload)
    cls = list(context_lens or wl.default_context_lens())
    concs = list(concurrency or wl.concurrency)
    problem = context_lens_problem(cls)
    if problem:
        raise BenchError(problem)
    total = sum(repeats * len(arms) * c * wl.n_chunks(cl) for cl in cls for c in concs)
    bar = Progress(total, progress) if progress is not None else None
    run = BenchRun(wl, wire, view_hop, repeats)
    try:
        for cl in cls:
            for c in concs:
                try:
                    res = measure(
                        wl,
                        arms,
                        context_len=cl,
                        concurrency=c,
                        wire=wire,
                        repeats=repeats,
                        view_hop=view_hop,
                        per_key=per_key,
                        through=through,
                        progress=bar.advance if bar else None,
                        warmup=True,
                    )
                except (MemoryError, RuntimeError) as e:
                    if not is_allocation_failure(e):
                        raise
                    raise BenchError(
                        f"context_len={cl} concurrency={c}: out of memory{allocation_detail(e)}; "
                        "give shorter --context-lens or a lower --concurrency"
                    ) from e
                run.results += res
                if on_bucket is not None:
                    on_bucket(res)
    finally:
        if bar is not None:
            bar.close()
    if wire == "serializer" or view_hop == "serializer":
        run.delta_roundtrip_us = delta_roundtrip_us(wl, context_len=cls[0])
    return run


# ---------------------------------------------------------------------------------------------- #
# Output
# ---------------------------------------------------------------------------------------------- #


def roundtrip_lines(run: BenchRun) -> list[str]:
    """Per bucket, every arm's p50 step as a multiple of one decode delta's serializer round trip.

    The round trip is :func:`~omni_accum.replay.delta_roundtrip_us` (the delta alone, serialized
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


def _fmt_bytes(n: float) -> str:
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def _fmt_us(us: float) -> str:
    if math.isnan(us):
        return "-"
    return f"{us / 1000:.2f} ms" if us >= 10_000 else f"{us:.1f} us"


def format_table(results: list[ArmResult], baseline: str = UPSTREAM, *, decode_steps: int | None = None) -> str:
    """One bucket's results as a text table, with each arm's p50 as a ratio to ``baseline``.

    A step is one chunk of one request, prefill chunks included; with ``decode_steps`` the head splits
    ``steps/request`` into prefill chunks and decode steps.
    """
    if not results:
        return ""
    r0 = results[0]
    base = next((r for r in results if r.arm == baseline and r.samples_us), None)
    split = ""
    if decode_steps is not None and 0 <= decode_steps <= r0.steps:
        split = f" ({r0.steps - decode_steps} prefill + {decode_steps} decode)"
    head = (
        f"context_len={r0.context_len}  concurrency={r0.concurrency}  wire={r0.wire}  steps/request={r0.steps}{split}"
    )
    cols = ["arm", "p50 step", "p99 step", "total/request", "wire/step", "peak held", f"p50 vs {baseline}", "views"]
    rows = []
    notes = []
    for r in results:
        ratio = "-"
        if base is not None and r.samples_us:
            q = r.step_us_p50 / base.step_us_p50 if base.step_us_p50 > 0 else float("nan")
            ratio = f"{q:.3g}x" + (f" ({1 / q:.0f}x faster)" if q > 0 and q < 0.5 else "")
        tot = sum(r.total_us_per_request) / len(r.total_us_per_request) if r.total_us_per_request else float("nan")
        ok = "ok" if r.correct else "WRONG"
        rows.append(
            [
                r.arm,
                _fmt_us(r.step_us_p50),
                _fmt_us(r.step_us_p99),
                _fmt_us(tot),
                _fmt_bytes(r.wire_bytes_per_step),
                _fmt_bytes(r.peak_bytes),
                ratio,
                ok,
            ]
        )
        if not r.correct:
            notes.append(f"  {r.arm}: {r.mismatch}")
        for k, ks in sorted(r.per_key.items()):
            rows.append([f"  {k}", "", "", "", _fmt_bytes(ks.wire_bytes_per_step), _fmt_bytes(ks.peak_bytes), "", ""])
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]

    def line(cells: list[Any]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [head, line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows]
    if notes:
        out += ["views differing from the cat reference (or errors):", *notes]
    return "\n".join(out)


def machine_info(run: BenchRun | None = None) -> dict[str, Any]:
    """Where the run happened (and how it was run, under ``run``)."""

    def ver(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

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
            "delta_roundtrip_us": run.delta_roundtrip_us,
        }
    return info


def _num(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 3)


def to_json(run: BenchRun) -> dict[str, Any]:
    """The JSON document of a run (validates against :data:`RESULT_SCHEMA`)."""
    rows = []
    for r in run.results:
        rows.append(
            {
                "arm": r.arm,
                "key": r.key,
                "context_len": r.context_len,
                "concurrency": r.concurrency,
                "step_us_p50": _num(r.step_us_p50),
                "step_us_p99": _num(r.step_us_p99),
                "wire_bytes_per_step": round(r.wire_bytes_per_step, 3),
                "peak_bytes": int(r.peak_bytes),
                "requests": r.requests,
                "steps": r.steps,
            }
        )
        for k, ks in sorted(r.per_key.items()):
            rows.append(
                {
                    "arm": r.arm,
                    "key": k,
                    "context_len": r.context_len,
                    "concurrency": r.concurrency,
                    "step_us_p50": None,
                    "step_us_p99": None,
                    "wire_bytes_per_step": round(ks.wire_bytes_per_step, 3),
                    "peak_bytes": int(ks.peak_bytes),
                    "requests": r.requests,
                    "steps": r.steps,
                }
            )
    return {"workload": run.workload.name, "wire": run.wire, "machine": machine_info(run), "results": rows}


def write_json(run: BenchRun, path: str | os.PathLike[str]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(to_json(run), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, p)


def require_matplotlib() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailable(
            "--plot needs matplotlib, which is not installed: "
            "pip install 'omni-accum[plot]' (or pip install matplotlib)"
        ) from e
    return plt


#: Plot formats named when matplotlib cannot be asked for its own.
PLOT_FORMATS = ("png", "svg", "pdf")


def plot_formats() -> list[str]:
    """File extensions (no dot) ``--plot`` can write: matplotlib's Agg formats, else :data:`PLOT_FORMATS`."""
    try:
        require_matplotlib()
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except (PlotUnavailable, ImportError):
        return list(PLOT_FORMATS)
    return sorted(FigureCanvasAgg.get_supported_filetypes())


def plot_path_problem(path: str | os.PathLike[str], option: str = "--plot") -> str | None:
    """Why ``path``'s extension names no format the plot can be written in, or None (checked before measuring)."""
    ext = Path(path).suffix.lower().removeprefix(".")
    formats = plot_formats()
    if ext in formats:
        return None
    what = "has no extension" if not ext else f"extension .{ext} is not a format matplotlib can write"
    return f"{option} {path}: {what}; the extension gives the format: {', '.join(formats)}"


def plot(run: BenchRun, path: str | os.PathLike[str]) -> None:
    """Log-log plot of p50 step latency vs context length, one line per arm (and concurrency)."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in run.results:
        if r.samples_us:
            series.setdefault((r.arm, r.concurrency), []).append((r.context_len, r.step_us_p50))
    concs = sorted({c for _, c in series})
    styles = ["-o", "--s", ":^", "-.v"]
    for (arm, c), pts in sorted(series.items()):
        pts.sort()
        style = styles[concs.index(c) % len(styles)]
        label = arm if len(concs) == 1 else f"{arm} (c={c})"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("context length (prefill rows)")
    ax.set_ylabel("p50 step latency (us)")
    hop = f", view hop {run.view_hop}" if run.view_hop else ""
    ax.set_title(f"{run.workload.name}: wire {run.wire}{hop}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
