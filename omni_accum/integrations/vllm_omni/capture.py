"""Capture inside vllm-omni: every bound stage process records the chunks that pass its hooks.

Switched on by ``OMNI_ACCUM_CAPTURE=DIR`` or the connector ``extra`` key ``omni_accum_capture: DIR`` (the
extra wins; ``false`` / ``off`` there turns it off for that connector), with
``omni_accum_capture_values: sample`` (or ``OMNI_ACCUM_CAPTURE_VALUES=sample``) to keep the first rows
of each tensor key once per request, and ``omni_accum_capture_max_bytes`` /
``OMNI_ACCUM_CAPTURE_MAX_BYTES`` for the bound per process (default 64 MiB, over 4 rotated files).

The send hook (:mod:`.send`) records each chunk as the adapter built it, before omni-accum encodes it
(role ``send``, pair ``<stage>-><stage + 1>``, the request's prompt length); the adapter's receive hook
(:mod:`.receive`) records it after the merge (role ``recv``, with the hand-off time when the sender's
clock came with it). Records and files: :mod:`omni_accum.capture`. A capture that cannot be written (a
bad setting, a symlink where a file should be, a full disk) is logged once and stops; it never fails a
chunk.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from omni_accum.capture.recorder import VALUES, ChunkRecorder
from omni_accum.capture.writer import DEFAULT_KEEP, DEFAULT_MAX_BYTES, CaptureWriter
from omni_accum.integrations.vllm_omni import handoff
from omni_accum.integrations.vllm_omni.arena_settings import parse_size
from omni_accum.integrations.vllm_omni.marker import MARKERS, stamp_of
from omni_accum.policy.loader import POLICY_OFF
from omni_accum.switches import ON, SettingError

logger = logging.getLogger("omni_accum.vllm_omni")

ENV_CAPTURE = "OMNI_ACCUM_CAPTURE"
ENV_VALUES = "OMNI_ACCUM_CAPTURE_VALUES"
ENV_MAX_BYTES = "OMNI_ACCUM_CAPTURE_MAX_BYTES"
EXTRA_CAPTURE = "omni_accum_capture"
EXTRA_VALUES = "omni_accum_capture_values"
EXTRA_MAX_BYTES = "omni_accum_capture_max_bytes"
_OFF = ("", *POLICY_OFF)  # OMNI_ACCUM_POLICY's off words (the switches' and none), and empty
_ON = ON  # a switch's on-word is not a folder: OMNI_ACCUM_CAPTURE=1 wrote into ./1

_monotonic_ns = time.monotonic_ns
_lock = threading.Lock()
#: One writer per capture folder in this process: (folder, pid) -> writer.
_writers: dict[tuple[str, int], CaptureWriter] = {}
_reported: set[str] = set()


class Capture:
    """The recorders of one binding: ``send`` (its adapter's puts) and ``recv`` (its commits)."""

    __slots__ = ("send", "recv", "writer")

    def __init__(self, writer: CaptureWriter, send: ChunkRecorder | None, recv: ChunkRecorder | None) -> None:
        self.writer, self.send, self.recv = writer, send, recv


def _setting(extra: Any, key: str, env: str) -> tuple[Any, str] | None:
    if isinstance(extra, Mapping) and key in extra:
        return extra[key], f"connector extra {key}"
    raw = os.environ.get(env)
    if raw is None or not raw.strip():
        return None
    return raw.strip(), f"environment variable {env}"


def settings(extra: Any = None) -> tuple[str, str, int] | None:
    """``(folder, values, max_bytes)`` of the capture asked for by ``extra`` or the environment, else None.

    Raises:
        SettingError: a value that is not a folder, ``none``/``sample`` or a byte count >= 4096 (each named).
    """
    got = _setting(extra, EXTRA_CAPTURE, ENV_CAPTURE)
    if got is None:
        return None
    folder, where = got
    if folder is None or folder is False or (isinstance(folder, str) and folder.strip().lower() in _OFF):
        return None
    problems = []  # every bad setting, in one message
    if not isinstance(folder, (str, os.PathLike)) or (isinstance(folder, str) and folder.strip().lower() in _ON):
        problems.append(f"{where}={folder!r}: give the capture folder as a path (an on/off word is not one; "
                        "false / off turns capture off)")  # fmt: skip
    values = "none"
    got = _setting(extra, EXTRA_VALUES, ENV_VALUES)
    if got is not None:
        values = str(got[0]).strip().lower()
        if values not in VALUES:
            problems.append(f"{got[1]}={got[0]!r}: choose {' or '.join(VALUES)}")
    max_bytes = DEFAULT_MAX_BYTES
    got = _setting(extra, EXTRA_MAX_BYTES, ENV_MAX_BYTES)
    if got is not None:
        try:  # bytes, or a size as every size key of omni-accum's connectors takes it (64MiB)
            max_bytes = parse_size(got[0], EXTRA_MAX_BYTES, minimum=4096)
        except ValueError:  # inf, a bool, 1k (under 4096), 64MiX
            problems.append(f"{got[1]}={got[0]!r}: give the bytes a process may write, at least 4096: a whole "
                            "number or a size such as 64MiB")
    if problems:
        raise SettingError("; ".join(problems))
    return os.fspath(folder), values, max_bytes


def _report(message: str, kind: str | None = None) -> None:
    """Log ``message`` once per ``kind`` (default: the message; a message naming a request or a value would be new
    every time: its kind is what is said once, and the set stays small)."""
    said = message if kind is None else kind
    if said not in _reported:
        _reported.add(said)
        logger.error("omni-accum capture: %s", message)


def _writer(folder: str, stage: str, max_bytes: int) -> CaptureWriter:
    key = (os.path.abspath(folder), os.getpid())
    with _lock:
        w = _writers.get(key)
        if w is None or w.closed:
            w = _writers[key] = CaptureWriter(
                folder, stage, max_bytes=max_bytes, keep=DEFAULT_KEEP, on_error=_report
            )
            logger.info("omni-accum capture: pid %d records to %s", os.getpid(), w.path)
        return w


def _prompt_len(task: Any) -> int | None:
    req = task.get("request") if isinstance(task, Mapping) else None
    n = getattr(req, "num_prompt_tokens", None)
    if n is None:
        ids = getattr(req, "prompt_token_ids", None)
        n = len(ids) if ids is not None else None
    return int(n) if n is not None else None


def _kind_of(b: Any):
    def kind_of(path: str, value: Any) -> tuple[str, str]:
        strategy = b.strategy_name(path, value)
        return ("append" if strategy in b._append_kind else "replace"), strategy

    return kind_of


def attach(b: Any, adapter: Any) -> Capture | None:
    """The capture of binding ``b`` on ``adapter`` (made once; None: no capture). Never raises."""
    state = b.__dict__
    if "_capture" in state:
        return state["_capture"]
    cap = None
    try:
        conn = getattr(adapter, "connector", None)
        asked = settings(getattr(conn, "config", None))
        if asked is not None:
            folder, values, max_bytes = asked
            stage = int(getattr(conn, "stage_id", 0) or 0)
            w = _writer(folder, str(stage), max_bytes)
            kind_of = _kind_of(b)
            send = ChunkRecorder(w, "send", f"{stage}->{stage + 1}", kind_of, values, ctx_of=_prompt_len)
            recv = ChunkRecorder(w, "recv", f"{stage - 1}->{stage}", kind_of, values)
            cap = Capture(w, send, recv)
    except Exception as e:  # noqa: BLE001 - a capture never fails a chunk (a bad setting, a folder refused, ...)
        _report(f"not recording in pid {os.getpid()}: {e}")
        cap = None
    state["_capture"] = cap
    return cap


def for_arm(cap: Capture | None, arm: Any) -> Capture | None:
    """The capture of A/B arm binding ``arm`` (:mod:`.ab`): the split's writer, recorders of its own, so that
    its records name the arm and the strategies of the arm's policy."""
    if cap is None:
        return None
    recorders = []
    for r in (cap.send, cap.recv):
        recorders.append(
            None if r is None else ChunkRecorder(
                cap.writer, r.role, r.pair, _kind_of(arm), "sample" if r.sample else "none", ctx_of=r.ctx_of,
                arm=arm.arm,
            )
        )
    return Capture(cap.writer, *recorders)


def sent(cap: Capture, req_id: Any, chunk: Mapping[str, Any], task: Any) -> None:
    """The send hook: ``chunk`` of ``req_id`` as the adapter built it (before omni-accum encodes it)."""
    try:
        cap.send.record(req_id, chunk, _monotonic_ns() // 1000, source=task, skip=MARKERS)
    except Exception as e:  # noqa: BLE001 - a capture never fails a chunk
        _report(f"a send record failed ({type(e).__name__}: {e}); said once", f"send {type(e).__name__}")


def received(cap: Capture, adapter: Any, req_id: Any, payload: Mapping[str, Any], raw: Any) -> None:
    """The adapter's receive hook, after the merge: ``payload`` of ``req_id`` (its wire marker ``raw``)."""
    now = _monotonic_ns()
    seconds = None
    if raw.__class__ is list:
        got = stamp_of(raw)
        if got is not None and got[1] == handoff.clock_id():
            s = (now - got[0]) / 1e9
            if 0 <= s <= handoff.MAX_SECONDS:
                seconds = s
    try:
        rec = cap.recv
        if req_id in rec._reqs:  # followed since its first chunk, whose record hashed the sender's id
            ext = None
        else:
            mapping = getattr(adapter, "request_ids_mapping", None)
            ext = mapping.get(req_id, req_id) if isinstance(mapping, dict) else req_id  # the sender's id: joins both
        rec.record(req_id, payload, now // 1000, handoff_s=seconds, skip=MARKERS, name=ext)
    except Exception as e:  # noqa: BLE001 - a capture never fails a chunk
        _report(f"a receive record failed ({type(e).__name__}: {e}); said once", f"receive {type(e).__name__}")


def released(b: Any, req_id: Any, role: str) -> None:
    """A request was released on ``role``'s side: forget it and write what is buffered."""
    caps = [c for c in (x.__dict__.get("_capture") for x in b.each()) if c is not None]
    for cap in caps:  # the binding's and, under an A/B split, its arms' (the request is in one of them)
        rec = cap.send if role == "send" else cap.recv
        if rec is not None:
            rec.forget(req_id)
    if caps:
        caps[0].writer.flush()


def flush_all() -> None:
    """Write every writer's buffered lines (at exit; tests)."""
    for w in list(_writers.values()):
        try:
            w.flush()
        except Exception:  # noqa: BLE001 - at exit, nothing to report to
            pass


def close_all() -> None:
    """Flush and close every writer of this process (uninstall; tests)."""
    with _lock:
        writers = list(_writers.values())
        _writers.clear()
    for w in writers:
        w.close()
    _reported.clear()


def _after_fork_in_child() -> None:
    """A forked child writes files of its own: the parent's writers (and what they buffered) are not its to
    use; bindings made in the child capture afresh."""
    for w in _writers.values():
        w._buf.clear()
        w.closed = True
    _writers.clear()


atexit.register(flush_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
