"""Publishing a binding's metrics (and the status file) after a release, on a thread of its own.

vllm-omni 0.30.0 runs its release callbacks under the adapter's state locks, which its receiving and
saving threads take for every chunk; a release only marks its binding here (:func:`published_later`), and so does a
binding's Recorder every 256 chunks (without the status file: :func:`published_later` ``status=False``). At exit
(:func:`publish_all`) everything is published, the counts of requests still live included.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("omni_accum.vllm_omni")

#: Called after each batch is published (the binding module sets it: the status file, when asked for).
after_publish: Callable[[], None] | None = None
#: Called with each batch before ``after_publish`` (the hand-off meters, :mod:`.handoff`), and by
#: :func:`publish_pending` even when no binding was marked (at exit: what the meters timed since their last flush).
also_publish: list[Callable[[], None]] = []
#: Flushes every Recorder of the process (the binding module sets it: :func:`.metrics.flush_all`), for
#: :func:`publish_all`.
flush_all: Callable[[], None] | None = None
#: omni-accum's connectors in this process (the arena's): each one's ``status_row()`` goes into
#: :func:`.reporting.status` and the status file (weakly held: a connector dropped is left out).
connectors: weakref.WeakSet[Any] = weakref.WeakSet()
Binding = Any  # a binding (omni_accum.integrations.vllm_omni.binding.Binding); that module imports this one


class _Publisher:
    """Publishes bindings' metrics (and the status file) after a release, on a thread of its own.

    vllm-omni 0.30.0 runs its release callbacks (``_clear_receiver_state_locked``,
    ``_clear_sender_state_locked``) under the adapter's state locks, which its receiving and saving threads
    take for every chunk. Publishing there (every binding's held bytes, request by request, then
    Prometheus, then the status file) held those locks for 0.35 ms with 256 live requests and 3-4 ms with
    a status file. A release only marks its binding here; a daemon thread publishes, outside every lock
    of the adapter. :func:`publish_pending` does it at once (tests; :func:`publish_all` at exit)."""

    def __init__(self) -> None:
        self._reset()
        if hasattr(os, "register_at_fork"):  # a forked child starts without the thread, and maybe with the lock held
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._busy = threading.Lock()  # held while taking and publishing: drain() returns after any publish under way
        self._pending: dict[int, tuple[Binding, bool]] = {}  # id -> (binding, the status file wanted too)
        self._thread: threading.Thread | None = None

    def mark(self, b: Binding, status: bool = True) -> None:
        with self._cv:
            was = self._pending.get(id(b))
            self._pending[id(b)] = (b, status or (was is not None and was[1]))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="omni-accum-publish", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending:
                    self._cv.wait()
            self.drain()

    def drain(self, meters: bool = False, everything: bool = False) -> None:
        """Publish what was marked; ``meters``: the hand-off meters (``also_publish``) even when nothing was;
        ``everything``: then every Recorder's counts, marked or not (:data:`flush_all`)."""
        with self._busy:
            with self._cv:
                taken = list(self._pending.values())
                self._pending.clear()
            self._publish(taken, meters)
            if everything and flush_all is not None:
                try:
                    flush_all()
                except Exception:  # noqa: BLE001 - metrics never fail vllm-omni
                    logger.debug("omni-accum: publishing metrics failed", exc_info=True)

    @staticmethod
    def _publish(taken: list[tuple[Binding, bool]], meters: bool = False) -> None:
        if not taken and not meters:
            return
        for b, _ in taken:
            try:
                b.publish()
            except Exception:  # noqa: BLE001 - metrics never fail vllm-omni
                logger.debug("omni-accum: publishing metrics failed", exc_info=True)
        for f in also_publish:
            try:
                f()
            except Exception:  # noqa: BLE001 - metrics never fail vllm-omni
                logger.debug("omni-accum: publishing metrics failed", exc_info=True)
        if after_publish is not None and any(status for _, status in taken):
            after_publish()


_publisher = _Publisher()


def published_later(b: Binding, status: bool = True) -> None:
    """After a release: publish ``b``'s metrics and the status file soon, off the caller's locks. ``status=False``
    (a Recorder's every 256 chunks): the metrics and gauges only; the status file is written at a release, as
    documented, not at every 256th chunk."""
    _publisher.mark(b, status)


def publish_pending() -> None:
    """Publish now what releases marked (:func:`published_later`) and, marked or not, what the hand-off meters
    timed since their last flush, on the calling thread."""
    _publisher.drain(meters=True)


def publish_all() -> None:
    """:func:`publish_pending`, then every binding's counts not yet published, marked or not (at exit: a request
    still live then, or never released, counted chunks that no release published; :meth:`.Binding.close` publishes
    its own at uninstall)."""
    _publisher.drain(meters=True, everything=True)


atexit.register(publish_all)
