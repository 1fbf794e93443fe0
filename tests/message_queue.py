"""The tests' handle on ``benchmarks/_message_queue.py``: vLLM's ``MessageQueue`` in one process (what a worker gets
from the scheduler's output), shared with ``benchmarks/talker_step_016.py``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "_message_queue.py"
_spec = importlib.util.spec_from_file_location("omni_accum_benchmarks_message_queue", _PATH)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

through_message_queue = _module.through_message_queue
