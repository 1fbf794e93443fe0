"""``omni-accum bench --plot``: p50 step latency vs context length, log-log (needs matplotlib)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omni_accum.bench.report import BenchRun
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
