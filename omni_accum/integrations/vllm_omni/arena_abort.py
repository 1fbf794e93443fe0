"""An aborted request's chunks that an ``OmniAccumArenaConnector`` put the inner way: unlinked at the abort.

vllm-omni 0.30.0's chunk transfer adapter, when the scheduler aborts a request before its last chunk was sent
(``cleanup_sender``), queues on its save thread (the thread of the puts, so the clean-up comes before a reuse of
the request id) a task that unlinks the request's chunk keys ``<request>_<stage>_0 .. <num_puts - 1>`` through its
connector's ``cleanup``, but only when that connector *is* a ``SharedMemoryConnector``
(``_queue_shm_cleanup_locked`` checks the class, ``_send_single_request`` asserts it for such a task). Over the
arena connector, the chunks it put through its inner ``SharedMemoryConnector`` (before the receiver's region, a full
arena, replicas of the receiving stage: :mod:`.arena_pairs`) therefore stayed in ``/dev/shm`` until the arena's
orphan time (:mod:`.arena_inner`, 20 min by default).

:func:`install`, called when the connector is registered (:mod:`.arena_plugin`, whether or not an omni-accum policy
is installed), wraps those two methods so that the same task is queued, on the same thread, for an
``OmniAccumArenaConnector`` too, and run through its :meth:`~.arena_connector.ArenaConnector.abort_keys`; for any
other connector both methods do what they did. It is installed only where both methods are the adapter's own with
0.30.0's signatures (vllm-omni 0.28.0 and 0.16.0 have no such clean-up, for any connector: there the orphan time
is the rule); otherwise it says why at debug level and patches nothing. The chunks the arena carried in its region
are not the sender's to drop: the receiving process gives their pages back after the orphan time.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from omni_accum.integrations.vllm_omni.families.base import Target, _resolve

logger = logging.getLogger("omni_accum.vllm_omni")

ADAPTER = "vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter:OmniChunkTransferAdapter"
#: The task key vllm-omni 0.30.0 gives an abort's clean-up: ``(key prefix, number of puts)``.
TASK = "cleanup_shm"
_WRAPPED = "__omni_accum_arena_abort__"
_LOCK = threading.Lock()


def _arena(conn: Any) -> bool:
    from omni_accum.integrations.vllm_omni.arena_connector import ArenaConnector  # noqa: PLC0415 - imports vllm-omni

    return isinstance(conn, ArenaConnector)


def wrap_queue(orig: Any) -> Any:
    """``_queue_shm_cleanup_locked``: the task that 0.30.0 queues for a ``SharedMemoryConnector``, for the arena too."""

    @functools.wraps(orig)
    def _queue_shm_cleanup_locked(self: Any, external_req_id: str, sender_token: Any) -> None:
        orig(self, external_req_id, sender_token)
        conn = getattr(self, "connector", None)
        if _arena(conn) and sender_token.num_puts and not sender_token.terminal_sent:
            self._pending_save_reqs.append({TASK: (f"{external_req_id}_{conn.stage_id}", sender_token.num_puts)})
            with self._save_cond:
                self._save_cond.notify()

    setattr(_queue_shm_cleanup_locked, _WRAPPED, True)
    return _queue_shm_cleanup_locked


def wrap_send(orig: Any) -> Any:
    """``_send_single_request``: an abort's clean-up task on the arena connector runs through ``abort_keys``."""

    @functools.wraps(orig)
    def _send_single_request(self: Any, task: dict) -> Any:
        conn = getattr(self, "connector", None)
        if TASK in task and _arena(conn):
            prefix, num_puts = task[TASK]
            conn.abort_keys([f"{prefix}_{chunk_id}" for chunk_id in range(num_puts)])
            return None
        return orig(self, task)

    setattr(_send_single_request, _WRAPPED, True)
    return _send_single_request


TARGETS = (
    Target(ADAPTER, "_queue_shm_cleanup_locked", "(self, external_req_id, sender_token)", wrap_queue),
    Target(ADAPTER, "_send_single_request", "(self, task)", wrap_send),
)


def installed() -> bool:
    """Whether this process's adapter runs the arena's abort clean-up."""
    try:
        cls = _resolve(ADAPTER)
    except Exception:  # noqa: BLE001 - no vllm-omni
        return False
    return all(getattr(vars(cls).get(t.name), _WRAPPED, False) for t in TARGETS)


def _problems() -> list[str]:
    """What keeps the wrap from the installed adapter: a method that is missing, not its own or has another
    signature than vllm-omni 0.30.0's (the release families' own probe, on these two methods)."""
    from omni_accum.integrations.vllm_omni.families import by_name, probe  # noqa: PLC0415 - the families import them

    return probe(by_name("0.30"), targets=TARGETS)


def when_unlinked() -> str:
    """When an aborted request's chunks sent the arena connector's inner way leave ``/dev/shm`` with the installed
    vllm-omni (``omni-accum doctor``)."""
    if not _problems():
        return "an aborted request's chunks sent the inner way are unlinked at the abort (vllm-omni's own clean-up)"
    return ("an aborted request's chunks sent the inner way are unlinked after the orphan time, twice "
            "VLLM_OMNI_INPUT_WAIT_TIMEOUT_S (this vllm-omni has no abort clean-up to extend)")


def install() -> bool:
    """Wrap the adapter's two abort clean-up methods (once per process); True when they are wrapped. Never raises:
    a release without them (or with other signatures) keeps the orphan time as the only rule, said at debug level."""
    with _LOCK:
        try:
            if installed():
                return True
            problems = _problems()
            if problems:
                logger.debug("omni-accum arena: an aborted request's inner chunks wait for the orphan time (this "
                             "vllm-omni has no abort clean-up to extend: %s)", "; ".join(problems))
                return False
            cls = _resolve(ADAPTER)
            for t in TARGETS:
                if not getattr(vars(cls)[t.name], _WRAPPED, False):  # (one of them wrapped already: not twice)
                    setattr(cls, t.name, t.wrap(vars(cls)[t.name]))
            return True
        except Exception as e:  # noqa: BLE001 - never fails the plugin's registration
            logger.debug("omni-accum arena: the abort clean-up is not installed: %s", e)
            return False
