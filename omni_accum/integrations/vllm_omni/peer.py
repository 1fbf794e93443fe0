"""The peer hello: a sending stage changes the wire only once its receiving stage said it runs omni-accum.

A sender whose policy can change what goes on the wire (``send_once`` leaves values off, a tuned table
marks each request's first chunk) would hand a receiving stage without omni-accum chunks that lack
those values and carry a marker key: vllm-omni 0.30.0 cannot read them. So, through the same connector:

* a **receiving** adapter bound to a policy (stage id > 0, ``receives_chunks``) ``put``\\ s one small
  hello when it is made (else at its first chunk) under :func:`hello_key`: its policy fingerprint, its
  policy source, its process id and host. It withdraws it (``cleanup``) when its binding is closed. A hello
  that could not be written (a private directory it cannot use, a store that refused the put) is said once as a
  warning, shown in the status as ``could not tell stage N (why)``, and tried again (after :data:`HELLO_RETRY_S`,
  doubling) until it is written or the binding is closed;
* a **sending** adapter's binding starts a watcher thread at its first send that ``get``\\ s that key
  (first at once, then backing off from 50 ms to 30 s). Over shared memory the first look is made on the
  sending thread itself, before that request's choice (a read of a small file: so the first request of a server
  whose receiver said hello is announced however loaded the host); over another connector (whose ``get`` of a
  missing key may retry for a second, as Mooncake's store does) the request's first chunk waits at most
  :data:`FIRST_WAIT_S` for the watcher's first look. Until the hello came, its requests go out as
  vllm-omni 0.30.0 builds them: nothing left off, no marker. A request that starts after it came is announced
  (fingerprint, bucket) and may leave values off. A request keeps its choice until it is released, or until the
  hello it was announced under is lost (:attr:`PeerWatch.lost`: withdrawn, its process gone, replaced): from its
  next chunk it then goes out as vllm-omni built it, every value again (:mod:`.send`). A sending binding with
  metrics on watches under any policy: the hand-off metric's timestamps ride in the marker (:mod:`.handoff`).

The key carries the deployment's token (:func:`deployment_token`, ``OMNI_ACCUM_DEPLOYMENT``: set by the
first omni-accum process of a server, inherited by the stage processes it starts), so two servers on one
host never read each other's hello, and a hello left by a stopped server is never found. A hello from
a process on this host that is no longer alive is ignored, and a sender whose receiver (on this host)
dies, or withdraws its hello while it lives (:meth:`PeerWatch._changed`), goes back to 0.30.0's payloads until a
receiver says hello again. "This host" is :func:`machine_id`: the
kernel's boot id and this process's PID namespace (where a process id means the same process), not the host
name, which cloned machines share (their live receivers' hellos were ignored) and which network namespaces on
one kernel share as rightly as they share process ids.

Over shared memory (``SharedMemoryConnector``, and the arena connector, whose ``peer_channel`` says so)
the hello is a small file of its own in this user's private directory (:mod:`omni_accum.samehost`,
``/dev/shm/omni-accum-<euid>/``, 0700; the key as its name), written whole through a temporary file of an
unguessable name and read without being consumed (``SharedMemoryConnector.get`` would unlink it), so every
sender of the stage reads the same one; it is JSON (never unpickled), at most 4 KiB, and read only when the
file is this user's, not a symlink and not writable by others (else refused: logged once, counted as the
fallback ``samehost_refused``, and the sender sends vllm-omni's own payloads). omni-accum's reaper process
removes it when its process ends without withdrawing it (a SIGTERM), as for the arena's regions. Over any
other connector (Mooncake's store) the hello is that connector's ``put`` / ``get`` / ``cleanup`` of the key.
The key, the hello's content, the shared-memory channel and the machine id are :mod:`.peer_channel`'s (re-exported
here).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

from omni_accum.integrations.vllm_omni.peer_channel import (  # noqa: F401 - re-exported: the hello's names
    ENV_DEPLOYMENT,
    HELLO,
    HELLO_MAX,
    SHM_CHANNEL,
    ShmChannel,
    _channel,
    _hello_of,
    _stage,
    _stale,
    deployment_token,
    hello_key,
    machine_id,
    same_machine,
)

logger = logging.getLogger("omni_accum.vllm_omni")

POLL_S = (0.05, 30.0)  # the watcher's first and longest wait between looks
ALIVE_S = 1.0  # how often a found receiver is checked: alive (this host), its hello still there (shared memory)
#: How often a hello heard through another connector (Mooncake's store) is read again to see it is still there.
RECHECK_S = 30.0
#: A sender that has not heard its receiver's hello after this long says so once (its deployment token named).
QUIET_WARN_S = 60.0
#: Over a connector other than shared memory, how long a request's first chunk waits for the watcher's first look.
FIRST_WAIT_S = 0.05

_lock = threading.Lock()


# ------------------------------------------------------------------------------ the receiving side
def receives(adapter: Any) -> bool:
    """Whether ``adapter`` is a chunk transfer adapter that receives chunks, or a runner transport that
    receives full payloads (``async_chunk: false``), on a stage id > 0."""
    stage = _stage(getattr(adapter, "connector", None))
    takes = getattr(adapter, "receives_chunks", False) or getattr(adapter, "_async_chunk", None) is False
    return bool(takes) and stage is not None and stage > 0


#: A hello that could not be written is tried again after this long, doubling up to the second value (seconds).
HELLO_RETRY_S = (5.0, 60.0)


def _hello_lock_of(b: Any) -> threading.Lock:
    """Binding ``b``'s lock around its hello's put and withdrawal (``setdefault``: one lock whoever asks first)."""
    lock = b.__dict__.get("_hello_lock")
    return lock if lock is not None else b.__dict__.setdefault("_hello_lock", threading.Lock())


def announce(adapter: Any, b: Any, again: bool = False) -> None:
    """Receiving adapter ``adapter`` bound to ``b``: put the hello (once per binding). One that could not be
    written (``could not tell stage N (why)`` in the status) is tried again by a later call and by a timer, no
    sooner than :data:`HELLO_RETRY_S` after the last try, until it is written or the binding is closed (``again``: the
    timer's call, which a closed binding ignores)."""
    if b.__dict__.get("_hello") is not None or not receives(adapter):
        return
    failed = b.__dict__.get("_hello_failed")
    if failed is not None and time.monotonic() < failed[2]:
        return  # tried a moment ago: the timer (or a later call) tries again
    conn = adapter.connector
    stage = _stage(conn)
    chan, key = _channel(conn), hello_key(stage - 1, stage)
    data = {HELLO: [1, b.fingerprint, b.short_source, os.getpid(), socket.gethostname(), machine_id()]}
    with _hello_lock_of(b):
        if b.__dict__.get("_hello") is not None or (again and b.__dict__.get("_hello_closed")):
            return  # said meanwhile, or a retry of a binding closed since (its hello withdrawn)
        b.__dict__.pop("_hello_closed", None)
        try:
            ok = bool(chan.put(str(stage - 1), str(stage), key, data)[0])
        except Exception as e:  # noqa: BLE001 - the sender then sends 0.30.0's payloads
            ok, why = False, str(e) or type(e).__name__
        else:
            why = "the connector's put failed"
        if ok:
            b._hello = (chan, key)
            b.__dict__.pop("_hello_failed", None)
        else:
            delay = HELLO_RETRY_S[0] if failed is None else min(failed[3] * 2, HELLO_RETRY_S[1])
            b._hello_failed = (stage - 1, why, time.monotonic() + delay, delay)
    if ok:
        logger.info("omni-accum: stage %d told stage %d it runs omni-accum (pid=%d, fingerprint %s, key %s%s)",
                    stage, stage - 1, os.getpid(), b.fingerprint, key, "" if failed is None else ", tried again")
        return
    if failed is None:
        logger.warning("omni-accum: stage %d could not tell stage %d it runs omni-accum (%s); that sender sends "
                       "vllm-omni's own payloads (nothing left off) until it can: tried again from %.0f s to every "
                       "%.0f s", stage, stage - 1, why, *HELLO_RETRY_S)
    _retry_later(adapter, b, delay)


def keep_hello(adapter: Any, b: Any) -> None:
    """A receiving binding that said hello over shared memory (receive hooks, at each chunk): every :data:`ALIVE_S`, a
    stat of its hello file; one that is gone (another replica of the stage withdrew the hello it wrote over this
    one, or its reaper removed it) is written again, so the senders of the stage hear a receiver running
    omni-accum again within a second or so."""
    hello = b.__dict__.get("_hello")
    if hello is None or hello[0] is not SHM_CHANNEL:
        return
    now = time.monotonic()
    if now < b.__dict__.get("_hello_check", 0.0):
        return
    b._hello_check = now + ALIVE_S
    if SHM_CHANNEL.stamp(hello[1]) is not None:
        return
    with _hello_lock_of(b):
        if b.__dict__.get("_hello") is not hello:
            return  # withdrawn (closed) or said again meanwhile
        del b.__dict__["_hello"]
    logger.info("omni-accum: the hello %s of this process was removed (another replica of the stage withdrew its "
                "own); saying it again", hello[1])
    announce(adapter, b)


def _retry_later(adapter: Any, b: Any, delay: float) -> None:
    """A timer that calls :func:`announce` again after ``delay`` (weakly: a dropped adapter or binding ends it)."""
    refs = weakref.ref(adapter), weakref.ref(b)

    def retry() -> None:
        a, bb = refs[0](), refs[1]()
        if a is not None and bb is not None and bb.__dict__.get("_hello") is None:
            try:
                announce(a, bb, again=True)
            except Exception:  # noqa: BLE001 - a hello never fails vllm-omni
                logger.debug("omni-accum: saying hello again failed", exc_info=True)

    t = threading.Timer(delay + 0.01, retry)
    t.daemon = True
    t.name = "omni-accum-hello"
    old = b.__dict__.get("_hello_timer")
    b._hello_timer = t
    if old is not None:
        old.cancel()
    t.start()


def withdraw(b: Any) -> None:
    """Binding ``b`` is closed: withdraw its hello (receiving), stop its retries and its watcher (sending)."""
    with _hello_lock_of(b):
        b._hello_closed = True
        hello = b.__dict__.pop("_hello", None)
        b.__dict__.pop("_hello_failed", None)
        timer = b.__dict__.pop("_hello_timer", None)
    if timer is not None:
        timer.cancel()
    if hello is not None:
        _cleanup(*hello)
    w = b.__dict__.pop("_peer", None)
    if w is not None:
        w.close()


def _cleanup(chan: Any, key: str) -> None:
    try:
        if chan is SHM_CHANNEL:
            chan.withdraw(key)  # only this process's: a replica of the stage may have written its own since
        else:
            chan.cleanup(key)
    except Exception:  # noqa: BLE001 - a connector's cleanup never fails omni-accum's
        logger.debug("omni-accum: withdrawing hello %s failed", key, exc_info=True)


# -------------------------------------------------------------------------------- the sending side
class PeerWatch:
    """The sending side's watch for its receiving stage's hello (see the module docstring)."""

    def __init__(self, conn: Any, src: int, owner: Any = None) -> None:
        #: The binding watched for (weakly): a binding dropped without being closed ends its watcher too.
        self._owner = weakref.ref(owner) if owner is not None else None
        self.chan = _channel(conn)
        self.src, self.dst = src, src + 1
        self.key = hello_key(src, self.dst)
        self.hello: list[Any] | None = None
        #: How many times a hello heard was lost (withdrawn, its process gone, replaced by another receiver's): a
        #: request announced before goes out as vllm-omni built it from its next chunk (:mod:`.send`). Counted after
        #: ``hello`` is cleared, so a request that starts in between is never announced under the lost hello unseen.
        self.lost = 0
        self._stamp: Any = None  # the hello file's stamp when it was read (shared memory)
        self._checked = 0.0  # when the hello was last read (time.monotonic)
        self.looks = 0
        self._first_lock = threading.Lock()
        self._first = threading.Event()  # the first look was made
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ready(self) -> bool:
        """True once the receiving stage said hello. The first call starts the watcher; over shared memory it makes
        the first look itself, on the caller's thread (the adapter's save thread, before its put: a watcher thread's
        first look could come after a loaded host's first request; a concurrent first call waits for it), over
        another connector it waits for the watcher's first look at most :data:`FIRST_WAIT_S`."""
        if self.hello is not None or self._stop.is_set():
            return self.hello is not None
        if self._thread is None:
            with self._first_lock:
                if self._thread is None:
                    if isinstance(self.chan, ShmChannel):
                        try:
                            self._look()
                        except Exception:  # noqa: BLE001 - never into the send: the watcher looks again
                            logger.debug("omni-accum: the first look for %s failed", self.key, exc_info=True)
                        self._first.set()
                    self._thread = threading.Thread(target=self._run, name="omni-accum-peer", daemon=True)
                    self._thread.start()
            self._first.wait(FIRST_WAIT_S)
        return self.hello is not None

    def _run(self) -> None:
        delay = POLL_S[0]
        started, warned = time.monotonic(), False
        if self._first.is_set():  # ready made the first look
            delay = ALIVE_S if self.hello is not None else delay
            self._stop.wait(delay)
        while not self._stop.is_set():
            if self._owner is not None and self._owner() is None:
                return
            if self.hello is None:
                found = self._look()
                self._first.set()
                delay = ALIVE_S if found else min(delay * 2, POLL_S[1])
                if not found and not warned and time.monotonic() - started >= QUIET_WARN_S:
                    warned = True
                    logger.warning(
                        "omni-accum: stage %d has not heard stage %d's hello (key %s) in %.0f s, so it sends "
                        "vllm-omni's own payloads (nothing left off). If stage %d runs omni-accum on another host, "
                        "give every stage process of this server the same %s (this one has %r; docs/mooncake.md, "
                        "'Across hosts, step by step')", self.src, self.dst, self.key, time.monotonic() - started,
                        self.dst, ENV_DEPLOYMENT, deployment_token())  # fmt: skip
            elif _stale(self.hello):
                logger.warning("omni-accum: stage %d's receiver (pid %d) is gone; stage %d sends vllm-omni's own "
                               "payloads until a receiver says hello again", self.dst, self.hello[3], self.src)
                self.hello, delay = None, POLL_S[0]
                self.lost += 1
                warned = True  # that warning said it: the 'never heard' advice (another host) would mislead
                continue
            elif (change := self._changed()) is not None:
                if change == "gone":
                    logger.warning("omni-accum: stage %d's receiver (pid %d) withdrew its hello (its omni-accum was "
                                   "uninstalled or its adapter closed); stage %d sends vllm-omni's own payloads until "
                                   "a receiver says hello again", self.dst, self.hello[3], self.src)  # fmt: skip
                    warned = True
                self.hello, delay = None, POLL_S[0]
                self.lost += 1
                continue  # replaced by another receiver's: the next look hears it (and says so)
            self._stop.wait(delay)

    def _changed(self) -> str | None:
        """Whether the hello heard is still there: None (unchanged), ``"gone"`` (withdrawn) or ``"replaced"`` (another
        receiver's). Cheap: over shared memory a stat of its file, read again only when the stat changed; over
        another connector a get of the key every :data:`RECHECK_S` (a get that raises is no answer)."""
        if isinstance(self.chan, ShmChannel):
            now = self.chan.stamp(self.key)
            if now is not None and now == self._stamp:
                return None
            if now is None:
                return "gone"
            self._stamp = now
        elif time.monotonic() - self._checked < RECHECK_S:
            return None
        self._checked = time.monotonic()
        try:
            got = self.chan.get(str(self.src), str(self.dst), self.key)
        except Exception:  # noqa: BLE001 - not known now: asked again later
            return None
        h = _hello_of(got)
        if h is None:
            return "gone"
        return None if h == self.hello else "replaced"

    def _look(self) -> bool:
        if isinstance(self.chan, ShmChannel):
            self._stamp = self.chan.stamp(self.key)  # before the read: a rewrite since is seen
        self._checked = time.monotonic()
        try:
            got = self.chan.get(str(self.src), str(self.dst), self.key)
        except Exception:  # noqa: BLE001 - not there (yet)
            got = None
        self.looks += 1
        h = _hello_of(got)
        if h is None or _stale(h):
            return False
        self.hello = h
        where = "this machine" if same_machine(h) else f"host {h[4]}"
        logger.info("omni-accum: stage %d's receiver runs omni-accum (pid=%s on %s, fingerprint %s, policy from %s): "
                    "stage %d marks its requests from now on (values left off, hand-offs timed, as configured)",
                    self.dst, h[3], where, h[1], h[2], self.src)
        return True

    def close(self) -> None:
        self._stop.set()


def watch(b: Any, conn: Any) -> None:
    """Sending binding ``b`` (on connector ``conn``): make its watcher when its policy can change the wire or
    its hand-offs may be timed (metrics on, :mod:`.handoff`)."""
    if (b.announces or b.metrics.on) and b.__dict__.get("_peer") is None:
        src = _stage(conn)
        if src is not None:
            with _lock:
                if b.__dict__.get("_peer") is None:
                    b._peer = PeerWatch(conn, src, b)


def may_announce(b: Any) -> bool:
    """Whether a request starting now on ``b`` is announced (its receiver said hello; a binding not on an
    adapter, as in ``replay``, always is)."""
    w = b.__dict__.get("_peer")
    return w is None or w.ready()


def describe(b: Any) -> str:
    """The peer hello of binding ``b`` in a few words (:class:`.reporting.BindingStatus` ``peer``)."""
    parts = []
    hello, failed = b.__dict__.get("_hello"), b.__dict__.get("_hello_failed")
    if hello is not None:
        parts.append(f"told stage {hello[1].rsplit('_', 2)[-2]}")
    elif failed is not None:
        parts.append(f"could not tell stage {failed[0]} ({failed[1]})")
    w = b.__dict__.get("_peer")
    if w is not None:
        h = w.hello
        if h is not None:
            parts.append(f"heard stage {w.dst} (pid {h[3]}, fingerprint {h[1]})")
        else:
            parts.append(f"waiting for stage {w.dst}'s hello")
    return "; ".join(parts) or "-"
