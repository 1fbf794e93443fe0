"""The messages an ``OmniAccumArenaConnector`` puts through its inner ``SharedMemoryConnector`` that no get takes.

The connector puts a message the inner way when the arena cannot take it (no region yet, a full arena, a replica
of the receiving stage beside the region's owner: :mod:`.arena_pairs`), and the owner of a region forwards there the
messages a replica may be waiting for. vllm-omni 0.30.0 unlinks an aborted request's unread segments only when the
stage's connector *is* a ``SharedMemoryConnector`` (the sender's abort clean-up checks the class), and its stage
processes end without closing their connectors: without this, such a segment (up to the whole prefill, hundreds of
MB) stayed in ``/dev/shm`` for as long as the server ran (Python's resource tracker unlinks what is left when the
process that made it ends). :class:`InnerOrphans` keeps the key and time of each such put;
a key whose segment is gone was taken (the reader unlinks it) and is forgotten; one still there after the arena's
orphan time (:func:`.arena_connector.orphan_after_s`, twice vllm-omni's input wait: its request has been failed) is
unlinked through the inner connector's ``cleanup``, counted in ``health()["orphans_dropped"]`` and said once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

logger = logging.getLogger("omni_accum.vllm_omni")

#: Where ``SharedMemoryConnector``'s segments are (``multiprocessing.shared_memory`` on Linux), by key.
SHM_DIR = "/dev/shm"
#: How often the puts are looked at (seconds).
CHECK_S = 1.0


class InnerOrphans:
    """The keys this process put through ``inner`` and not yet seen taken, with when (see the module docstring)."""

    def __init__(self, inner: Any, after_s: float, clock: Any = time.monotonic) -> None:
        self.inner = inner
        self.after_s = after_s
        self.clock = clock
        self.dropped = 0
        self._put: dict[str, float] = {}  # key -> clock() at its put
        self._lock = threading.Lock()  # _put
        self._looking = threading.Lock()  # one look at a time; another thread skips it
        self._next = 0.0
        self._said = False

    def put(self, key: str) -> None:
        """``key`` was put through the inner connector (after the put succeeded)."""
        with self._lock:
            self._put[key] = self.clock()

    def waiting(self) -> int:
        """How many of this process's inner puts were not seen taken at the last look (or since)."""
        return len(self._put)

    def look(self) -> list[str]:
        """At most every :data:`CHECK_S`: forget the keys taken, unlink those no get took within ``after_s``; the keys
        unlinked. Any thread; never raises (a segment that cannot be unlinked is tried again at the next look)."""
        now = self.clock()
        if now < self._next or not self._put or not self._looking.acquire(blocking=False):
            return []
        try:
            self._next = now + CHECK_S
            with self._lock:
                puts = list(self._put.items())
            gone, dropped = [], []
            for key, when in puts:
                if not os.path.exists(os.path.join(SHM_DIR, key)):
                    gone.append(key)
                elif now - when > self.after_s:
                    try:
                        self.inner.cleanup(key)
                    except Exception as e:  # noqa: BLE001 - tried again at the next look
                        logger.debug("omni-accum arena: cannot unlink %s: %s", key, e)
                        continue
                    dropped.append(key)
            with self._lock:
                for key in gone + dropped:
                    self._put.pop(key, None)
            if dropped:
                self.dropped += len(dropped)
                if not self._said:
                    self._said = True
                    logger.warning("omni-accum arena: unlinked %d message(s) put through %s that no get took within "
                                   "%g s (e.g. %r: requests aborted or failed on the receiving stage); counted in "
                                   "health()['orphans_dropped'] (said once)", len(dropped), type(self.inner).__name__,
                                   self.after_s, dropped[0])
            return dropped
        finally:
            self._looking.release()
