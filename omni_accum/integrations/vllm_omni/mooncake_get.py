"""The receiving side of ``OmniAccumMooncakeConnector`` (:mod:`.mooncake_connector`): ``get``.

A get asks the store for the chunk's key (0.30.0's way: 20 tries 50 ms apart in the call, or with
``mooncake_get_poll`` one ask per call, :mod:`.mooncake_wait`), decodes the payload with vllm-omni's own decoder
and, when the payload references parts (the fast path's tensors), allocates each tensor and reads its parts into it
with ``batch_get_into`` (through a registered staging buffer, or into the tensor's own memory registered for the call
when it is larger than the buffer), then removes the key and its parts from the store. With ``mooncake_read_threads``
that read runs on a thread of its own and the get returns None until it has finished (:mod:`.mooncake_reads`); the
get that takes the finished read removes the key and its parts.

When a part cannot be read through registered memory (this process could not register a receive buffer, or
``batch_get_into`` fails for it) it is read with the store's plain ``get`` and copied into its tensor: the chunk is
delivered, bit for bit, one copy later (``health()["plain_parts"]``). When a part is not in the store at all (Mooncake
evicted it: a segment past the master's eviction watermark evicts soft-pinned objects, read or not) the chunk cannot be
delivered: one warning names the key and the missing part (at most :data:`LOG_PER_MINUTE` such lines a minute, then
how many were left out), ``mooncake_get_error`` counts it once, the key and its remaining parts are removed (nothing
is left behind), and the request is failed at once where omni-accum's hooks are on the receiving adapter (vllm-omni
0.30.0's ``record_receive_failure``: the scheduler finishes it with ``FINISHED_ERROR``); elsewhere vllm-omni waits for
the chunk until its own time-out (600 s) and later gets of that key return None without asking the store. A part that
is in the store but cannot be read either way counts ``mooncake_get_error`` once per chunk, is logged the same way, and
its key stays for the next get. A finished background read that no get took is let go here too (``_let_go``, called
by :mod:`.mooncake_reads`): its key and parts are removed at close, or once the receiving adapters no longer have
its request.

:class:`FastGets` holds these methods for :class:`.mooncake_connector.MooncakeFastConnector`, which provides what
they use: ``store``, ``inner``, ``waits``, ``get_poll``, ``reads``, ``counts``, ``seconds``, ``buffer_bytes``, the
receive and count locks, the loss and failure records and the registration and fallback helpers.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from omni_accum.integrations.vllm_omni.arena_chains import request_of
from omni_accum.integrations.vllm_omni.mooncake_reads import DONE, RUNNING
from omni_accum.integrations.vllm_omni.mooncake_settings import NAME
from omni_accum.integrations.vllm_omni.mooncake_wait import TRIES, TRY_INTERVAL_S, monotonic
from omni_accum.integrations.vllm_omni.mooncake_wire import PART_SEP, Buffer, Decoder, PartsLost, read_parts

logger = logging.getLogger("omni_accum.vllm_omni")

#: What a get returns inside the connector when it has started a read of the parts in the background.
READING = object()
#: What it returns when the parts could not be read (logged and counted): None to the caller, no time-out line.
FAILED = object()
#: Warnings of one kind per minute, at most (then one line says how many were left out).
LOG_PER_MINUTE = 10
#: Lost and failed chunks remembered (the oldest forgotten first).
MAX_REMEMBERED = 4096


class RateLog:
    """Warnings of each kind at most ``per_minute`` a minute; the first line after a full minute says how many of
    that kind were left out (thread-safe)."""

    def __init__(self, per_minute: int = LOG_PER_MINUTE) -> None:
        self.per_minute = per_minute
        self._kinds: dict[str, list[float]] = {}  # kind -> [window start, lines, left out]
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: Any) -> bool:
        now = time.monotonic()
        with self._lock:
            st = self._kinds.setdefault(kind, [now, 0, 0])
            if now - st[0] >= 60.0:
                left, st[:] = int(st[2]), [now, 0, 0]
            else:
                left = 0
            if st[1] >= self.per_minute:
                st[2] += 1
                return False
            st[1] += 1
        if left:
            msg += f" ({left} more such line(s) left out in the minute before)"
        logger.warning(msg, *args)
        return True


@dataclass
class _Read:
    """The parts of ``key``'s payload, read (a reader thread's result, or the get's own): what :meth:`_finish` needs."""

    key: str
    raw: bytes
    dec: Decoder
    obj: Any
    t0: float
    t1: float
    t2: float
    n: int  # tensor bytes read
    plain: int  # parts read with the store's plain get

    @property
    def nbytes(self) -> int:
        return self.n


class FastGets:
    """``get`` and its steps (a mixin of :class:`.mooncake_connector.MooncakeFastConnector`; see the module)."""

    #: The reads of parts on threads of their own (:class:`.mooncake_reads.BackgroundReads`); None: in the get.
    reads: Any = None

    def _init_gets(self) -> None:
        self.rate_log = RateLog()
        #: key -> [reason, whether a receiving adapter was told]: chunks whose parts were gone (removed since).
        self._lost: OrderedDict[str, list[Any]] = OrderedDict()
        #: keys whose parts could not be read (counted once each), until a get reads them.
        self._failed: OrderedDict[str, None] = OrderedDict()
        #: vllm-omni's receiving adapters on this connector (weakly), told of a lost chunk's request.
        self._receivers: list[weakref.ref[Any]] = []

    def attach_receiver(self, adapter: Any) -> None:
        """``adapter`` (vllm-omni's chunk transfer adapter) receives through this connector: a chunk whose parts are
        gone fails its request there (``record_receive_failure``). omni-accum's adapter hook calls it."""
        if callable(getattr(adapter, "record_receive_failure", None)) and not any(
                r() is adapter for r in self._receivers):  # fmt: skip
            self._receivers.append(weakref.ref(adapter))

    # ------------------------------------------------------------------ get
    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        if self.store is None or self._closed:
            return None
        key = self._make_key(get_key, from_stage, to_stage)
        if self._was_lost(key, get_key):
            return None  # its parts were gone: removed, logged, counted; its request failed where the adapter allows
        if self.reads is not None:
            state, got = self.reads.take(key)
            if state == RUNNING:
                return None  # its parts are being read: the adapter asks again on its next pass
            if state == DONE:
                if isinstance(got, _Read):
                    return self._finish(got)
                if got is FAILED:
                    self._was_lost(key, get_key)
                    return None  # logged and counted; a key whose parts are there is read again on the next pass
            # no read of it, or a read that raised: ask the store
        if self.get_poll is not None:
            got = self._poll(key)
        else:
            got = self._blocking(key)
        if got is FAILED:
            self._was_lost(key, get_key)
            return None
        return got

    def _blocking(self, key: str) -> Any:
        """0.30.0's connector: 20 tries, 50 ms apart."""
        self.waits.due(key, monotonic())  # its first ask, for the time waited
        for attempt in range(TRIES):
            got = self._try(key, attempt)
            if got is READING:
                return None
            if got is not None:
                return got  # a payload, or FAILED: the key was there (no time-out to report)
            if attempt < TRIES - 1:
                time.sleep(TRY_INTERVAL_S)
        self.inner._metrics["timeouts"] += 1
        logger.warning("%s: timeout waiting for %s", NAME, key)  # as 0.30.0's connector says it: the key waited for
        return None

    def _poll(self, key: str) -> Any:
        """``mooncake_get_poll``: ask the store at most once per interval for ``key``; sleep only while no key asked
        for lately is due (:mod:`.mooncake_wait`)."""
        if not self.waits.turn(key, monotonic, time.sleep):
            return None
        got = self._try(key, 0)
        if got is READING:
            return None
        if got is None and self.waits.missed(key, monotonic()):
            self.inner._metrics["timeouts"] += 1
            logger.warning("%s: timeout waiting for %s", NAME, key)
        return got

    def _try(self, key: str, attempt: int) -> Any:
        with self._rx_lock:
            t0 = monotonic()
            try:
                raw = self.store.get(key)
            except Exception as e:  # noqa: BLE001 - as 0.30.0: try again
                logger.debug("%s get attempt %s failed: %s", NAME, attempt, e)
                raw = None
            if not raw:
                return None
            return self._decode(key, raw, t0)

    def _decode(self, key: str, raw: bytes, t0: float) -> Any:
        t1 = monotonic()
        dec = Decoder()
        dec.prefix = key + PART_SEP
        obj = dec.decode(raw)
        if not dec.todo:
            self.inner._metrics["gets"] += 1
            self.counts["inner_gets"] += 1
            self.waits.found(key, t1)
            return obj, len(raw)
        if self.reads is not None:
            with self._count_lock:
                self.counts["background_reads"] += 1
            self.reads.start(key, lambda buf: self._read(key, raw, dec, obj, t0, t1, buf))
            return READING
        got = self._read(key, raw, dec, obj, t0, t1, self._buffer("rx"))
        return got if got is FAILED else self._finish(got)

    def _read(self, key: str, raw: bytes, dec: Decoder, obj: Any, t0: float, t1: float, buf: Buffer | None) -> Any:
        """Read the parts ``dec`` found into its tensors through ``buf`` (None: no registered buffer; the plain way):
        a :class:`_Read`, or :data:`FAILED` (logged and counted: the key removed when its parts are gone, else kept for
        another get). Runs in the get, or on a reader thread."""
        try:
            n, plain = read_parts(self.store, buf, dec.todo, self._register, self._unregister)
        except PartsLost as e:
            self._lose(key, dec, e)
            return FAILED
        except Exception as e:  # noqa: BLE001 - counted once per chunk; the key stays for another try
            with self._count_lock:
                first = key not in self._failed
                if first:
                    self._failed[key] = None
                    while len(self._failed) > MAX_REMEMBERED:
                        self._failed.popitem(last=False)
                    self._count_fallback("mooncake_get_error")
            if first:
                self.rate_log.warning("get_error", "omni-accum %s: could not read the parts of %s: %s; the key stays "
                                      "in the store and the next get of it tries again", NAME, key, e)  # fmt: skip
            else:
                logger.debug("omni-accum %s: parts of %s still unreadable: %s", NAME, key, e)
            return FAILED
        return _Read(key, raw, dec, obj, t0, t1, monotonic(), n, plain)

    def _finish(self, r: _Read) -> tuple[Any, int]:
        """The parts are read (in this get, or by a reader thread): remove the key and its parts, count, log; the
        payload."""
        key = r.key
        # taken: the key and its parts go now (force: the lease this get holds would refuse it; they are
        # this payload's alone, under keys of their own, and this get was their one reader)
        keys = _with_parts(key, r.dec)
        try:
            rcs = self.store.batch_remove(keys, True)
            bad = [k for k, rc in zip(keys, rcs) if rc != 0]
        except Exception as e:  # noqa: BLE001 - left to the store's eviction
            bad = [f"{key} ({e})"]
        t3 = monotonic()
        with self._count_lock:
            if bad:
                self.counts["remove_errors"] += len(bad)
            self._failed.pop(key, None)
            waited = self.waits.found(key, r.t0)
            sec = self.seconds
            sec["get_waited"] += waited
            sec["get_key"] += r.t1 - r.t0
            sec["get_parts"] += r.t2 - r.t1
            sec["get_remove"] += t3 - r.t2
            self.counts["fast_gets"] += 1
            self.counts["plain_parts"] += r.plain
            self.inner._metrics["gets"] += 1
        if bad:
            logger.warning("omni-accum %s: could not remove %s", NAME, ", ".join(bad[:3]))
        how = "" if not r.plain else f", {r.plain} read with the store's plain get (no registered memory)"
        logger.info("omni-accum %s: got %s: waited %.1f ms, payload %d bytes %.1f ms, %d tensor bytes in %d part(s)%s "
                    "%.1f ms%s, removed in %.1f ms", NAME, key, waited * 1e3, len(r.raw), (r.t1 - r.t0) * 1e3, r.n,
                    len(keys) - 1, how, (r.t2 - r.t1) * 1e3, "" if self.reads is None else " (a reader thread)",
                    (t3 - r.t2) * 1e3)  # fmt: skip
        return r.obj, len(r.raw) + r.n

    # ------------------------------------------------------------------ lost chunks
    def _lose(self, key: str, dec: Decoder, e: PartsLost) -> None:
        """``key``'s part ``e.part`` is gone: remove the key and its other parts, remember it, count and log once."""
        keys = _with_parts(key, dec)
        try:
            self.store.batch_remove(keys, True)  # the missing part's rc says not found: nothing to count
        except Exception as err:  # noqa: BLE001 - left to the store's eviction
            logger.warning("omni-accum %s: could not remove %s and its parts: %s", NAME, key, err)
        reason = f"chunk {key} lost: {e}"
        with self._count_lock:
            self._lost[key] = [reason, False]
            while len(self._lost) > MAX_REMEMBERED:
                self._lost.popitem(last=False)
            self._failed.pop(key, None)
            self.counts["lost_chunks"] += 1
            self._count_fallback("mooncake_get_error")
        then = ("its request is failed now (vllm-omni's receiving adapter is told)" if self._live_receivers() else
                "vllm-omni waits for it until its chunk time-out (600 s): omni-accum's adapter hooks are not on this "
                "stage, which would fail the request at once")  # fmt: skip
        self.rate_log.warning("lost", "omni-accum %s: %s; the key and its remaining %d part(s) are removed from the "
                              "store; %s. Mooncake evicts soft-pinned objects once a segment passes its eviction "
                              "watermark (docs/mooncake.md, 'Objects pile up')", NAME, reason, len(keys) - 2, then)

    def _was_lost(self, key: str, get_key: str) -> bool:
        """Whether ``key`` was lost (:meth:`_lose`); the first get after it that finds its request on a receiving
        adapter fails the request there."""
        with self._count_lock:
            st = self._lost.get(key)
            if st is None or st[1]:
                return st is not None
            reason = st[0]
        told = self._tell_receivers(get_key, reason)
        if told:
            with self._count_lock:
                st[1] = True
        return True

    def _live_receivers(self) -> list[Any]:
        out = [r() for r in self._receivers]
        self._receivers = [r for r, a in zip(self._receivers, out) if a is not None]
        return [a for a in out if a is not None]

    def _tell_receivers(self, get_key: str, reason: str) -> bool:
        """Fail the request of chunk ``get_key`` (``<external request id>_<stage>_<chunk>``, vllm-omni 0.30.0's chunk
        key) on every receiving adapter that has it: True when one had it."""
        ext = get_key.rsplit("_", 2)[0]
        told = False
        for adapter in self._live_receivers():
            mapping = getattr(adapter, "request_ids_mapping", None)
            if not isinstance(mapping, dict):
                continue
            lock = getattr(adapter, "_receiver_state_lock", None)
            got = lock.acquire(timeout=1.0) if lock is not None else False
            try:
                rids = [rid for rid, e in list(mapping.items()) if e == ext]
            except RuntimeError:  # changed while read without the lock: the next get tries again
                rids = []
            finally:
                if got:
                    lock.release()
            for rid in rids:
                try:
                    adapter.record_receive_failure(rid, f"omni-accum {NAME}: {reason}")
                    told = True
                except Exception as e:  # noqa: BLE001 - vllm-omni's time-out fails it then
                    logger.warning("omni-accum %s: could not fail request %s: %s", NAME, rid, e)
        if told:
            logger.info("omni-accum %s: told vllm-omni's receiving adapter to fail request %s (%s)", NAME, ext, reason)
        return told

    def _let_go(self, key: str, got: Any, closing: bool) -> bool:
        """A finished background read of ``key`` that no get took (:mod:`.mooncake_reads`): remove the key and its
        parts from the store when no get will take them, that is when this connector closes, or when the receiving
        adapters it knows (:meth:`attach_receiver`) no longer have the request (aborted or finished: vllm-omni 0.30.0
        never removes an object, and the soft pin holds its bytes for half an hour); otherwise (a request still
        waiting, or no adapter known) they stay for a later get. True when removed. Never raises: best effort."""
        if not isinstance(got, _Read):
            return False  # a failed read: the read kept or removed its key itself
        try:
            if not closing:
                adapters = self._live_receivers()
                ext = request_of(key.rsplit("@", 1)[0])  # vllm-omni's key: <request>_<stage>_<chunk>@<from>_<to>
                if ext is None or not adapters or any(_has_request(a, ext) is not False for a in adapters):
                    return False
            rcs = self.store.batch_remove(_with_parts(key, got.dec), True)
            with self._count_lock:
                self.counts["remove_errors"] += sum(1 for rc in rcs if rc != 0)
            return True
        except Exception as e:  # noqa: BLE001 - left to the store's eviction
            logger.warning("omni-accum %s: could not remove %s and its parts: %s", NAME, key, e)
            return False


def _has_request(adapter: Any, ext: str) -> bool | None:
    """Whether vllm-omni's receiving ``adapter`` still has external request ``ext`` (None: cannot tell)."""
    mapping = getattr(adapter, "request_ids_mapping", None)
    if not isinstance(mapping, dict):
        return None
    lock = getattr(adapter, "_receiver_state_lock", None)
    got = lock.acquire(timeout=1.0) if lock is not None else False
    try:
        return ext in list(mapping.values())
    except RuntimeError:  # changed while read without the lock
        return None
    finally:
        if got:
            lock.release()


def _with_parts(key: str, dec: Any) -> list[str]:
    """``key``'s part keys (each once, in order) and then ``key``: what is removed once its chunk is done."""
    return list(dict.fromkeys([pk for _, parts in dec.todo for pk, _ in parts] + [key]))
