"""``mooncake_read_threads``: the reads of a fast-path payload's parts in threads of their own, so that one large
read does not hold vllm-omni's receive loop.

vllm-omni 0.30.0's chunk adapter receives in one thread (``recv_loop``): it asks the connector for each waiting
request's next chunk in turn, and a get that returns None puts the request at the back of the queue until the next
pass. With the tensor fast path a get of chunk 0 reads its parts (66 MB at 8k input) from another host inside that
call: at concurrency 4 across simulated hosts one such read took 4.2 s, and three other requests' chunk 0s, already in
the store, waited behind it 7.2-7.8 s.

With ``mooncake_read_threads: N`` (1 to 64) a get that finds a payload with parts starts their read on one of N
threads and returns None, as a get of a key not there yet; a later get of the key returns the payload once the read
has finished (bit for bit what a read in the get gives). The key and its parts are removed from the store by that
get, when it takes the read, not by the reader thread: a finished read that no get takes within :data:`RESULT_TTL_S`
(its request was aborted, or vllm-omni's receive loop went round slower than that), or that would make the finished
reads held exceed :data:`MAX_HELD_BYTES`, is dropped (logged, counted in ``reads_dropped``). The connector then says
(``let_go``) whether its request is gone: where the receiving adapters it knows no longer have the request (aborted
or finished), the key and its parts are removed from the store; otherwise they stay, so a later get of a request
still waiting reads them again: nothing a live request waits for is lost. At :meth:`BackgroundReads.close` every
finished read no get took is let go the same way, removed (no get of this process will take it; the 0.30.0 objects'
soft pin would otherwise hold its bytes in the store for half an hour). A read that fails is counted
(``mooncake_get_error``, once per chunk) and the key stays in the store for the next get to read again; one whose
parts are gone is the connector's (:mod:`.mooncake_get`). 0, the default, reads in the get as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

#: What :meth:`BackgroundReads.take` says of a key.
NONE, RUNNING, DONE = "none", "running", "done"
#: A finished read that no get takes in this many seconds is dropped, its key left in the store (a later get reads it
#: again): vllm-omni asks every pass, usually within milliseconds.
RESULT_TTL_S = 60.0
_now = time.monotonic  # the readers' clock (tests move it)
#: The finished reads held at most (their ``nbytes``): beyond, the oldest is dropped as above.
MAX_HELD_BYTES = 4 << 30
MAX_THREADS = 64

logger = logging.getLogger("omni_accum.vllm_omni")


class BackgroundReads:
    """The reads running or finished, per store key (thread-safe), on a pool of ``threads`` threads, each with a
    staging buffer of its own (made by ``make_buffer`` on the thread's first read, closed by :meth:`close`).
    ``let_go(key, result, closing)``: a finished read no get took is dropped (``closing`` False) or left at
    :meth:`close` (True); True when it removed the key and its parts from the store (it must not raise)."""

    def __init__(self, threads: int, make_buffer: Callable[[], Any],
                 let_go: Callable[[str, Any, bool], bool] | None = None) -> None:  # fmt: skip
        self._make_buffer = make_buffer
        self._let_go = let_go
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="omni-accum-mooncake-read")
        self._reads: dict[str, tuple[Future, list[float]]] = {}  # key -> (its read, [when it finished])
        self._lock = threading.Lock()
        self._local = threading.local()
        self._buffers: list[Any] = []
        self.dropped = 0
        self._next_expire = 0.0  # a take looks for finished reads no get took at most once a second
        self._dropped: list[tuple[str, Future, str]] = []  # dropped by :meth:`_expire`, to let go outside the lock

    def start(self, key: str, read: Callable[[Any], Any]) -> None:
        """Run ``read(buffer)`` on a reader thread; its result (None: failed) is :meth:`take`'s for ``key``."""
        finished: list[float] = []

        def run() -> Any:
            try:
                return read(self.buffer())
            finally:
                finished.append(_now())

        with self._lock:  # the reads this drops are let go by the next take (the get runs this under its own lock)
            self._dropped += self._expire(_now())
            self._reads[key] = (self._pool.submit(run), finished)

    def take(self, key: str) -> tuple[str, Any]:
        """``(NONE, None)``: no read of ``key``; ``(RUNNING, None)``; ``(DONE, result)``, forgotten from then on."""
        with self._lock:
            now = _now()
            if now >= self._next_expire:  # an idle server starts no read: its takes let go of the old ones
                self._next_expire = now + 1.0
                self._dropped += self._expire(now)
            dropped, self._dropped = self._dropped, []
            got = self._reads.get(key)
            if got is not None and got[0].done():
                del self._reads[key]
        self._let_go_of(dropped)  # outside the lock: it may reach the store and wait for the adapter's lock
        if got is None or not got[0].done():
            return (NONE if got is None else RUNNING), None
        try:
            return DONE, got[0].result()
        except Exception:  # noqa: BLE001 - the read counts its own failures; this one found none to count
            return DONE, None

    def buffer(self) -> Any:
        """This thread's staging buffer (None when it cannot be made: the read registers its tensors or fails)."""
        buf = getattr(self._local, "buffer", None)
        if buf is None:
            buf = self._local.buffer = self._make_buffer()
            if buf is not None:
                with self._lock:
                    self._buffers.append(buf)
        return buf

    def _expire(self, now: float) -> list[tuple[str, Future, str]]:
        """Drop the finished reads no get took in :data:`RESULT_TTL_S`, then the oldest while those held exceed
        :data:`MAX_HELD_BYTES` (under the lock); ``(key, read, why)`` of each, for :meth:`_let_go_of` after it."""
        done = sorted(((d[0], k, f) for k, (f, d) in self._reads.items() if d and f.done()), key=lambda x: x[0])
        held = sum(_nbytes(f) for _, _, f in done)
        out = []
        for when, key, f in done:
            old = now - when > RESULT_TTL_S
            if not old and held <= MAX_HELD_BYTES:
                continue
            del self._reads[key]
            held -= _nbytes(f)
            self.dropped += 1
            out.append((key, f, f"not taken by a get for {now - when:.0f} s" if old else (
                f"the finished reads held passed {MAX_HELD_BYTES} bytes")))  # fmt: skip
        return out

    def _let_go_of(self, dropped: list[tuple[str, Future, str]]) -> None:
        """Each dropped read let go (:meth:`_release`, outside the lock: it may reach the store) and logged."""
        for key, f, why in dropped:
            then = ("its request is gone from the receiving adapter: the key and its parts are removed from the store"
                    if self._release(key, f, closing=False) else "the key and its parts stay in the store, and a "
                    "later get of it reads them again")  # fmt: skip
            logger.warning("omni-accum OmniAccumMooncakeConnector: dropped the finished read of %s (%s); %s", key,
                           why, then)

    def _release(self, key: str, f: Future, closing: bool) -> bool:
        """``let_go`` of a finished read no get took (False for a failed read: it handled its own key)."""
        if self._let_go is None or f.cancelled():
            return False
        try:
            return bool(self._let_go(key, f.result(timeout=0), closing))
        except Exception:  # noqa: BLE001 - a read that raised; ``let_go`` itself does not raise
            return False

    def __len__(self) -> int:
        return len(self._reads)

    def close(self) -> None:
        """Wait for the reads running, let go of the finished reads no get took (their keys and parts removed from
        the store: no get of this process will take them), then close the threads' buffers."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            left = [(k, f) for k, (f, _) in self._reads.items() if f.done()] + [(k, f) for k, f, _ in self._dropped]
            self._reads.clear()
            self._dropped = []
            buffers, self._buffers = self._buffers, []
        removed = [k for k, f in left if self._release(k, f, closing=True)]
        if removed:
            logger.info("omni-accum OmniAccumMooncakeConnector: closing: removed %d finished read(s) no get took, "
                        "with their parts, from the store (%s)", len(removed), ", ".join(removed[:3]))
        for buf in buffers:
            buf.close()


def _nbytes(f: Future) -> int:
    try:
        return int(getattr(f.result(timeout=0), "nbytes", 0) or 0)
    except Exception:  # noqa: BLE001 - a failed read holds nothing
        return 0
