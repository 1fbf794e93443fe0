"""pytest-benchmark suite, collected only when asked for: ``pytest benchmarks --benchmark-group-by=group``.

The default test run (``pytest``, ``testpaths = ["tests"]``) never collects this folder.
"""

from __future__ import annotations

import pytest

try:
    import pytest_benchmark  # noqa: F401
except ImportError:  # pragma: no cover
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header(config: pytest.Config) -> str:
    return "omni-accum benchmarks: compare arms with --benchmark-group-by=group; save with --benchmark-autosave"
