"""Benchmarks: replay a workload's chunk trace through arms (strategies, policies, upstream vllm-omni).

The parts, bottom up:

* :mod:`~omni_accum.bench.workloads` (the workload schema and loading),
  :mod:`~omni_accum.bench.workload_presets` (the built-in workloads) and
  :mod:`~omni_accum.bench.streams` (the chunk dicts of one request, deterministically);
* :mod:`~omni_accum.bench.wires` (``inproc``, ``serializer``, ``shm``) and
  :mod:`~omni_accum.bench.engines` (what a replayed chunk goes through: a Sender/Receiver pair,
  upstream's ``_accumulate_payload``, nothing at all);
* :mod:`~omni_accum.bench.reference` (the ``torch.cat`` reference a view is checked against);
* :mod:`~omni_accum.bench.replay` (:func:`~omni_accum.bench.replay.measure`: one bucket, arms
  interleaved round by round, with the heap guard of :mod:`~omni_accum.bench._malloc`);
* :mod:`~omni_accum.bench.arms`, :mod:`~omni_accum.bench.runner`, :mod:`~omni_accum.bench.report`
  :mod:`~omni_accum.bench.results` and :mod:`~omni_accum.bench.plotting`: ``omni-accum bench`` (arms from names,
  every bucket, tables, JSON with :data:`RESULT_SCHEMA`, a plot).

This package re-exports the names of the last five, which were ``omni_accum.bench`` before the
package existed (``from omni_accum.bench import build_arms``).
"""

from __future__ import annotations

from omni_accum.bench.arms import (
    UnknownArmError,
    arm_policy_files,
    build_arms,
    default_arm_names,
    strategy_arm,
    upstream_available,
    workload_policy_problem,
)
from omni_accum.bench.plotting import (
    PLOT_FORMATS,
    PlotUnavailable,
    plot,
    plot_formats,
    plot_path_problem,
    require_matplotlib,
)
from omni_accum.bench.report import BenchRun, format_table, p50_interval, ratio_vs, roundtrip_lines, upstream_notes
from omni_accum.bench.results import RESULT_SCHEMA, machine_info, to_json, write_json
from omni_accum.bench.runner import (
    BenchError,
    Progress,
    allocation_detail,
    context_lens_problem,
    is_allocation_failure,
    run_bench,
)

__all__ = [
    "PLOT_FORMATS",
    "RESULT_SCHEMA",
    "UnknownArmError",
    "BenchError",
    "BenchRun",
    "PlotUnavailable",
    "Progress",
    "allocation_detail",
    "arm_policy_files",
    "build_arms",
    "context_lens_problem",
    "default_arm_names",
    "format_table",
    "is_allocation_failure",
    "machine_info",
    "p50_interval",
    "ratio_vs",
    "plot",
    "plot_formats",
    "plot_path_problem",
    "require_matplotlib",
    "roundtrip_lines",
    "run_bench",
    "strategy_arm",
    "to_json",
    "upstream_available",
    "upstream_notes",
    "workload_policy_problem",
    "write_json",
]
