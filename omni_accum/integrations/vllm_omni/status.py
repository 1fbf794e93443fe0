"""What omni-accum does in this process, made visible: log output and a per-process status file.

vLLM configures logging for its own ``vllm`` logger only, so inside vllm-omni processes the
``omni_accum`` logger would have no handler and its INFO lines (installed, bound) would be lost.
:func:`ensure_visible_logging` gives it one (level from ``OMNI_ACCUM_LOG_LEVEL``, default INFO)
when nothing above it has one.

``OMNI_ACCUM_STATUS_DIR=DIR``: every process where omni-accum activated writes ``DIR/<pid>.json``
when a binding is made, when a request is released and at exit::

    {"pid": 4242, "process": "StageEngineCoreProc_stage0_replica0_DP0", "installed": true,
     "policy_source": "OMNI_ACCUM_POLICY",
     "bindings": [{"owner": "OmniChunkTransferAdapter", "source": "install()",
                   "chunks_sent": 101, "chunks_received": 0, "active_requests": 0, ...}]}

so an operator (or a test) can check which processes of a server bound omni-accum and how many
chunks each handled. Written atomically (a temporary file, then a rename).
"""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing
import os
import threading
import time
from typing import Any

from omni_accum.integrations.vllm_omni import binding as hooks

ENV_STATUS_DIR = "OMNI_ACCUM_STATUS_DIR"
ENV_LOG_LEVEL = "OMNI_ACCUM_LOG_LEVEL"
LOG_FORMAT = "%(levelname)s %(asctime)s [omni-accum pid=%(process)d] %(message)s"

_lock = threading.Lock()
_exit_registered_pid: int | None = None


def ensure_visible_logging() -> None:
    """Give the ``omni_accum`` logger a stderr handler unless it (or an ancestor) already has one."""
    lg = logging.getLogger("omni_accum")
    if lg.level == logging.NOTSET:
        level = logging.getLevelName(os.environ.get(ENV_LOG_LEVEL, "INFO").strip().upper())
        lg.setLevel(level if isinstance(level, int) else logging.INFO)
    if not lg.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        lg.addHandler(handler)


def process_label() -> str:
    """The process title vllm-omni set (``StageEngineCoreProc_stage0_replica0_DP0``), else its name."""
    try:
        import setproctitle  # vLLM's own dependency; vllm-omni titles its stage processes with it

        title = setproctitle.getproctitle().strip()
        if title and not title.startswith(("python", "/")):
            return title.split()[0]
    except Exception:  # noqa: BLE001 - not installed, or no title
        pass
    return multiprocessing.current_process().name


def snapshot() -> dict[str, Any]:
    """This process's record: pid, process label, installed, policy source, one entry per binding."""
    rows = []
    for obj, b in hooks.bindings():
        rows.append(
            {
                "owner": type(obj).__name__,
                "source": b.source,
                "chunks_sent": b.stats["chunks_sent"],
                "chunks_received": b.stats["chunks_received"],
                "puts": b.stats["puts"],
                "wire_bytes": b.stats["wire_bytes"],
                "omitted": b.stats["omitted"],
                "active_requests": b.receiver.active_requests + b.sender.active_requests,
            }
        )
    return {
        "pid": os.getpid(),
        "process": process_label(),
        "installed": hooks.Settings.installed,
        "policy_source": hooks.Settings.policy_source,
        "bindings": rows,
        "time": time.time(),
    }


def write() -> str | None:
    """Write :func:`snapshot` to ``$OMNI_ACCUM_STATUS_DIR/<pid>.json``; the path, or None when unset."""
    folder = os.environ.get(ENV_STATUS_DIR, "").strip()
    if not folder:
        return None
    path = os.path.join(folder, f"{os.getpid()}.json")
    with _lock:
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(snapshot(), f)
        os.replace(tmp, path)
    return path


def _safe_write() -> None:
    try:
        write()
    except OSError as e:
        logging.getLogger("omni_accum.vllm_omni").warning("omni-accum: cannot write the status file: %s", e)


def register_exit_dump() -> None:
    """When ``OMNI_ACCUM_STATUS_DIR`` is set: write the status now, on every binding / release, and at exit."""
    global _exit_registered_pid
    if not os.environ.get(ENV_STATUS_DIR, "").strip():
        return
    hooks.Settings.on_change = _safe_write
    if _exit_registered_pid != os.getpid():
        _exit_registered_pid = os.getpid()
        atexit.register(_safe_write)
    _safe_write()
