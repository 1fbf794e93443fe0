"""``omni-accum bench --plot``: p50 step latency vs context length, log-log (needs matplotlib)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omni_accum.bench._paths import replace_file
from omni_accum.bench.replay import UPSTREAM
from omni_accum.bench.report import BenchRun, p50_interval
from omni_accum.errors import OmniAccumError


class PlotUnavailable(OmniAccumError):
    """``--plot`` needs matplotlib (the ``plot`` extra)."""


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


def context_label(n: float) -> str:
    """``1000`` -> ``1k``, ``32000`` -> ``32k``, ``1500`` -> ``1.5k``, ``16`` -> ``16`` (x tick labels)."""
    if n >= 1000:
        return f"{n / 1000:g}k"
    return f"{n:g}"


def plot_series(run: BenchRun) -> dict[tuple[str, int], list[tuple[int, float, float, float]]]:
    """``{(arm, concurrency): [(context_len, p50, low, high), ...]}`` sorted by context length; the
    interval is the p50's 95 % interval (:func:`~omni_accum.bench.report.p50_interval`; none under 6 samples: the
    point alone)."""
    series: dict[tuple[str, int], list[tuple[int, float, float, float]]] = {}
    for r in run.results:
        if not r.pooled():
            continue
        ci = p50_interval(r) or (r.step_us_p50, r.step_us_p50)
        series.setdefault((r.arm, r.concurrency), []).append((r.context_len, r.step_us_p50, *ci))
    for pts in series.values():
        pts.sort()
    return series


def plot(run: BenchRun, path: str | os.PathLike[str]) -> None:
    """Write :func:`figure` to ``path`` (the extension gives the format) as ``--json`` is written: through a
    temporary file and a rename (:func:`~omni_accum.bench._paths.replace_file`), so a full disk leaves the previous
    plot whole and a symlink planted at ``path`` is replaced, never written through; an ``OSError`` names ``path``."""
    plt = require_matplotlib()
    fig = figure(run)
    fmt = Path(path).suffix.lower().removeprefix(".")
    try:
        replace_file(path, lambda fh: fig.savefig(fh, format=fmt, dpi=120))
    finally:
        plt.close(fig)


def figure(run: BenchRun) -> Any:
    """Log-log plot of p50 step latency vs context length with 95 % intervals (a matplotlib Figure).

    One colour per arm (``upstream``: black, thicker, drawn on top), one line style and marker per
    concurrency; the legend names the arms, and the concurrency levels as ``c=N: N requests at once``;
    x ticks at the measured context lengths, as ``1k``, ``8k``, ``32k``.
    """
    plt = require_matplotlib()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    fig, ax = plt.subplots(figsize=(8, 5))
    series = plot_series(run)
    arms = list(dict.fromkeys(arm for arm, _ in series))
    concs = sorted({c for _, c in series})
    palette = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7]  # 7: grey, for the c= legend
    colours: dict[str, Any] = {}
    for arm in arms:
        others = len([a for a in colours if a != UPSTREAM])
        colours[arm] = "black" if arm == UPSTREAM else palette[others % len(palette)]
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "v"), ((0, (5, 1)), "D")]
    for (arm, c), pts in series.items():
        ls, marker = styles[concs.index(c) % len(styles)]
        up = arm == UPSTREAM
        xs = [p[0] for p in pts]
        ax.plot(
            xs,
            [p[1] for p in pts],
            linestyle=ls,
            marker=marker,
            color=colours[arm],
            linewidth=2.6 if up else 1.4,
            markersize=6 if up else 4.5,
            zorder=3 if up else 2,
        )
        ax.fill_between(xs, [p[2] for p in pts], [p[3] for p in pts], color=colours[arm], alpha=0.15, linewidth=0)
    xs_all = sorted({p[0] for pts in series.values() for p in pts})
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(FixedLocator(xs_all))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: context_label(x)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("context length (prefill rows)")
    ax.set_ylabel("p50 step latency (us), shaded: 95% interval")
    hop = f", view hop {run.view_hop}" if run.view_hop else ""
    ax.set_title(f"{run.workload.name}: wire {run.wire}{hop}")
    ax.grid(True, which="both", alpha=0.3)
    handles = [
        Line2D([], [], color=colours[a], linewidth=2.6 if a == UPSTREAM else 1.4, label=f"{a} (baseline)")
        if a == UPSTREAM
        else Line2D([], [], color=colours[a], linewidth=1.4, label=a)
        for a in arms
    ]
    if len(concs) > 1:
        handles += [
            Line2D(
                [],
                [],
                color="grey",
                linestyle=styles[i % len(styles)][0],
                marker=styles[i % len(styles)][1],
                label=f"c={c}: {c} request{'s' if c > 1 else ''} at once",
            )
            for i, c in enumerate(concs)
        ]
    elif concs:
        ax.set_title(f"{run.workload.name}: wire {run.wire}{hop}, concurrency {concs[0]}")
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig
