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
                   "chunks_sent": 101, "chunks_received": 0, "active_requests": 0, ...}], ...}

(:func:`status` as JSON; ``connectors``: each arena connector's puts, gets, fallbacks and the stage pairs it has no
region for, and why). :func:`status` gives the same record, typed, to code in the process.

so an operator (or a test) can check which processes of a server bound omni-accum and how many
chunks each handled. Written atomically (a temporary file, then a rename).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import multiprocessing
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from omni_accum.capture.writer import prepare_dir
from omni_accum.integrations.vllm_omni import binding as hooks
from omni_accum.integrations.vllm_omni import instances
from omni_accum.integrations.vllm_omni import full_payload, handoff, peer, publishing
from omni_accum.integrations.vllm_omni.binding_settings import Settings
from omni_accum.integrations.vllm_omni.runner_rows import STATS as RUNNER_ROWS_STATS
from omni_accum.switches import ensure_visible_logging  # noqa: F401 - activation calls reporting.ensure_visible_logging

ENV_STATUS_DIR = "OMNI_ACCUM_STATUS_DIR"

_lock = threading.Lock()
_exit_registered_pid: int | None = None


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


@dataclass(frozen=True)
class BindingStatus:
    """One adapter or transport omni-accum is bound to."""

    owner: str
    source: str
    fingerprint: str
    chunks_sent: int
    chunks_received: int
    omitted: int
    #: Distinct requests holding state here: a middle stage's adapter receives request R (under vllm-omni's
    #: internal id) and sends it on (under its external id), and that is one request, not two.
    #: A producing stage's full-payload accumulator (``async_chunk: false``) counts its requests until their
    #: payload is sent. ``omni_accum_active_requests`` counts per role (send, receive, accumulate).
    active_requests: int
    #: The peer hello: ``told stage N`` (receiving), ``heard stage N (pid, fingerprint)`` or ``waiting for
    #: stage N's hello`` (sending, a policy that can change the wire), ``-`` (neither).
    peer: str = "-"
    #: vllm-omni 0.16 with a pickling executor: the accumulated tensors shipped to the model runner as their rows
    #: (``runner_full``), as the rows the worker lacked (``runner_delta``), and the bytes that did not cross
    #: (``runner_bytes_saved``); empty elsewhere.
    runner_rows: dict[str, int] = field(default_factory=dict)
    #: ``async_chunk: false``, the producing stage: steps its full-payload accumulator took (nothing received; the
    #: whole payload it then puts is a chunk sent).
    accumulated: int = 0


@dataclass(frozen=True)
class Status:
    """What omni-accum is doing in this process (:func:`status`)."""

    installed: bool
    vllm_omni_version: str | None
    policy_source: str
    fingerprint: str | None
    bindings: tuple[BindingStatus, ...]
    live_requests: int
    metrics: bool
    pid: int
    process: str
    #: The hand-offs the receive hooks here timed (:mod:`.handoff`): ``{pair: {kind: {count, seconds_sum,
    #: seconds_max, bytes}}}``, pair ``"0->1"`` (sending and receiving stage), kind prefill / decode / full.
    handoff: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    #: Why the plugin's activation installed nothing here (the log line's reason; None: it did or was not asked).
    refused: str | None = None
    #: omni-accum's arena connectors in this process, a few numbers each (``ArenaConnector.status_row``): arena_name,
    #: stage, puts and gets through the arena and the inner connector, fallbacks by reason, regions, and
    #: ``inner_only``: the stage pairs with no region now for a cause that does not pass by itself, and why.
    connectors: tuple[dict[str, Any], ...] = ()


def status() -> Status:
    """This process's omni-accum status: installed, the vllm-omni version, the process-wide policy's
    source and fingerprint, every binding with its chunk counts, live requests (each request once per binding: see
    :attr:`BindingStatus.active_requests`), whether metrics are on, the hand-offs timed here."""
    from omni_accum.integrations.vllm_omni import metrics
    from omni_accum.policy.fingerprint import dist_version

    vo_version = dist_version("vllm-omni")
    rows = []
    for obj, b in instances.bindings():
        rows.append(
            BindingStatus(
                owner=type(obj).__name__,
                source=b.source,
                fingerprint=b.fingerprint,
                chunks_sent=b.stats["chunks_sent"],
                chunks_received=b.stats["chunks_received"],
                omitted=b.stats["omitted"],
                active_requests=_live(obj, b),
                peer=peer.describe(b),
                runner_rows={k: b.stats[k] for k in RUNNER_ROWS_STATS if k in b.stats},
                accumulated=b.stats.get("accumulated", 0),
            )
        )
    policy = Settings.policy
    return Status(
        installed=Settings.installed,
        vllm_omni_version=vo_version,
        policy_source=Settings.policy_source,
        fingerprint=hooks.policy_fingerprint(policy) if policy is not None else None,
        bindings=tuple(rows),
        live_requests=sum(r.active_requests for r in rows),
        metrics=metrics.enabled(),
        pid=os.getpid(),
        process=process_label(),
        handoff=handoff.summary(),
        refused=Settings.refused,
        connectors=_connector_rows(),
    )


def _live(obj: Any, b: Any) -> int:
    """The distinct requests binding ``b`` of ``obj`` holds state for, receiving or sending. The adapter receives
    under vllm-omni's internal request id and sends under the external one; ``request_ids_mapping`` (internal ->
    external, vllm-omni's own, kept while the request is loaded) makes one request of the two (as vllm-omni's
    ``cleanup`` looks the external id up)."""
    ext = getattr(obj, "request_ids_mapping", None)
    if not isinstance(ext, dict):
        ext = {}
    ids: set[Any] = set()
    for x in b.each():  # an A/B split's arms hold their requests' state
        ids.update(ext.get(r, r) for r in x.receiver.request_ids())
        ids.update(x.sender.request_ids())
    with contextlib.suppress(Exception):  # a status never fails a stage
        ids.update(full_payload.held(obj)[1])  # the producing stage's full-payload accumulators (async_chunk: false)
    return len(ids)


def _connector_rows() -> tuple[dict[str, Any], ...]:
    """``status_row()`` of every live connector of omni-accum in this process (:data:`.publishing.connectors`)."""
    rows = []
    for conn in list(publishing.connectors):
        try:
            row = conn.status_row()
        except Exception:  # noqa: BLE001 - a status never fails a stage
            continue
        if row is not None:
            rows.append(row)
    return tuple(sorted(rows, key=lambda r: (str(r.get("arena_name")), str(r.get("stage")))))


def snapshot() -> dict[str, Any]:
    """:func:`status` as a JSON-ready dict (the status file), with the time it was taken."""
    return {**asdict(status()), "time": time.time()}


def write() -> str | None:
    """Write :func:`snapshot` to ``$OMNI_ACCUM_STATUS_DIR/<pid>.json``; the path, or None when unset."""
    folder = os.environ.get(ENV_STATUS_DIR, "").strip()
    if not folder:
        return None
    path = os.path.join(folder, f"{os.getpid()}.json")
    with _lock:
        prepare_dir(folder, "status folder")  # 0700, this user's alone (CaptureError names the problem)
        text = json.dumps(snapshot())
        fd, tmp = tempfile.mkstemp(prefix=f".{os.getpid()}.", suffix=".tmp", dir=folder)  # O_EXCL, 0600, random
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return path


_write_errors: set[str] = set()


def _safe_write() -> None:
    try:
        write()
    except Exception as e:  # noqa: BLE001 - a status file never fails a stage; said once per problem
        key = f"{type(e).__name__} {getattr(e, 'errno', None)}"  # not the text: it can name a random temporary file
        if key not in _write_errors:
            _write_errors.add(key)
            logging.getLogger("omni_accum.vllm_omni").warning(
                "omni-accum: cannot write the status file (%s); fix %s or unset it", e, ENV_STATUS_DIR
            )


def register_exit_dump() -> None:
    """When ``OMNI_ACCUM_STATUS_DIR`` is set: write the status now, on every binding / release, and at exit."""
    global _exit_registered_pid
    if not os.environ.get(ENV_STATUS_DIR, "").strip():
        return
    Settings.on_change = _safe_write
    if _exit_registered_pid != os.getpid():
        _exit_registered_pid = os.getpid()
        atexit.register(_safe_write)
    _safe_write()
