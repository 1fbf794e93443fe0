"""The messages an ``OmniAccumArenaConnector`` puts through its inner ``SharedMemoryConnector`` that no get takes.

The connector puts a message the inner way when the arena cannot take it (no region yet, a full arena, a replica
of the receiving stage beside the region's owner: :mod:`.arena_pairs`), and the owner of a region forwards there the
messages a replica may be waiting for. vllm-omni 0.30.0 unlinks an aborted request's unread segments only when the
stage's connector *is* a ``SharedMemoryConnector`` (the sender's abort clean-up checks the class), and its stage
processes end without closing their connectors: without this, such a segment (up to the whole prefill, hundreds of
MB) stayed in ``/dev/shm`` for as long as the server ran (Python's resource tracker unlinks what is left when the
process that made it ends).

:class:`InnerOrphans` keeps, for each such put, its time and the identity of the segment it made (inode and change
time: vllm-omni's keys are ``<request>_<stage>_<chunk>``, and a request id may come again, from this process or
another, whose put of the same key makes a new segment that is not this one). A segment that is gone, or is another
one now, was taken (the reader unlinks it) or is not this process's to remove: forgotten. One still there after the
arena's orphan time (:func:`.arena_settings.orphan_after_s`, twice vllm-omni's input wait) counted from its put or
from the last time a later chunk of its request was seen taken, whichever is later (vllm-omni's wait starts again at
each chunk a request receives, so a request still taking chunks is alive however far behind it runs), is unlinked
through the inner connector's ``cleanup``, counted in ``health()["orphans_dropped"]`` and said once. One whose unlink
did not take (``cleanup`` says nothing when it fails) is kept and tried again at the next look.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from omni_accum.integrations.vllm_omni.arena_chains import request_of

logger = logging.getLogger("omni_accum.vllm_omni")

#: Where ``SharedMemoryConnector``'s segments are (``multiprocessing.shared_memory`` on Linux), by key.
SHM_DIR = "/dev/shm"
#: How often the puts are looked at (seconds).
CHECK_S = 1.0


def _identity(key: str) -> tuple[int, int] | None:
    """The segment named ``key`` now: (inode, change time in ns), or None when there is none."""
    try:
        st = os.stat(os.path.join(SHM_DIR, key))
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


def _request(key: str) -> str:
    """The request of a vllm-omni chunk key ``<request>_<stage>_<chunk>`` (the key itself for another shape)."""
    return request_of(key) or key


class InnerOrphans:
    """The segments this process put through ``inner`` and not yet seen taken (see the module docstring)."""

    def __init__(self, inner: Any, after_s: float, clock: Any = time.monotonic) -> None:
        self.inner = inner
        self.after_s = after_s
        self.clock = clock
        self.dropped = 0
        self._put: dict[str, tuple[float, tuple[int, int]]] = {}  # key -> (clock() at its put, its segment)
        self._taken: dict[str, float] = {}  # request -> when a look last saw one of its keys taken
        self._lock = threading.Lock()  # _put
        self._looking = threading.Lock()  # one look at a time; another thread skips it
        self._next = 0.0
        self._said = False

    def put(self, key: str) -> None:
        """``key`` was put through the inner connector (after the put succeeded)."""
        seg = _identity(key)
        if seg is not None:  # (None: taken already)
            with self._lock:
                self._put[key] = (self.clock(), seg)

    def abort(self, keys: list[str]) -> int:
        """vllm-omni's abort clean-up of ``keys`` (:mod:`.arena_abort`): each segment there now is unlinked by name with
        its lock file, as vllm-omni does it for a ``SharedMemoryConnector`` (a forward of the key by a region's owner
        too), and forgotten; how many were unlinked. Never raises (what is left, the next looks try)."""
        n = 0
        for key in keys:
            seg, lock = _identity(key), os.path.join(SHM_DIR, f"shm_{key}_lockfile.lock")
            if seg is None and not os.path.exists(lock):
                continue  # taken, or carried in the region (a lock file alone: a put that failed, removed below)
            try:
                self.inner.cleanup(key)
                if _identity(key) is None and os.path.exists(lock):  # (0.28.0's cleanup leaves it)
                    os.remove(lock)
            except Exception as e:  # noqa: BLE001 - the orphan time still covers it
                logger.debug("omni-accum arena: cannot unlink %s at its abort: %s", key, e)
            if seg is not None and _identity(key) != seg:
                n += 1
                with self._lock:
                    self._put.pop(key, None)
        return n

    def waiting(self) -> int:
        """How many of this process's inner puts were not seen taken at the last look (or since)."""
        return len(self._put)

    def look(self) -> list[str]:
        """At most every :data:`CHECK_S`: forget the keys taken, unlink those no get took in time; the keys unlinked.
        Any thread; never raises."""
        now = self.clock()
        if now < self._next or not self._put or not self._looking.acquire(blocking=False):
            return []
        try:
            self._next = now + CHECK_S
            with self._lock:
                puts = list(self._put.items())
            done, dropped = [], []
            for key, rec in puts:
                if _identity(key) != rec[1]:  # taken (or another put's segment now: not this one)
                    done.append((key, rec))
                    self._taken[_request(key)] = now
                elif now - max(rec[0], self._taken.get(_request(key), rec[0])) > self.after_s:
                    dropped.append((key, rec))
            unlinked = []
            for key, rec in dropped:
                if _identity(key) != rec[1]:  # taken meanwhile
                    done.append((key, rec))
                    continue
                try:
                    self.inner.cleanup(key)
                except Exception as e:  # noqa: BLE001 - tried again at the next look
                    logger.debug("omni-accum arena: cannot unlink %s: %s", key, e)
                if _identity(key) == rec[1]:  # still there (cleanup says nothing when it fails): the next look
                    continue
                done.append((key, rec))
                unlinked.append(key)
            with self._lock:
                for key, rec in done:
                    if self._put.get(key) is rec:  # (not a later put of the same key)
                        del self._put[key]
                live = {_request(k) for k in self._put}
            for req in [r for r, t in self._taken.items() if r not in live and now - t > self.after_s]:
                del self._taken[req]
            if unlinked:
                if not self._said:
                    self._said = True
                    logger.warning("omni-accum arena: unlinked %d message(s) put through %s that no get took within "
                                   "%g s (e.g. %r: requests aborted or failed on the receiving stage); counted in "
                                   "health()['orphans_dropped'] (said once)", len(unlinked), type(self.inner).__name__,
                                   self.after_s, unlinked[0])
                self.dropped += len(unlinked)  # (after the warning: a count seen was said)
            return unlinked
        except Exception as e:  # noqa: BLE001 - a look never fails its caller; the next one tries again
            logger.debug("omni-accum arena: the look at the inner puts failed: %s", e)
            return []
        finally:
            self._looking.release()
