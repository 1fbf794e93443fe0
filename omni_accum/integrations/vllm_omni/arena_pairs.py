"""The stage pairs' regions of ``OmniAccumArenaConnector`` (:mod:`.arena_connector`): finding and making them,
and what happens when that fails.

The sending side of a pair attaches to the region the receiving side made (found through the pair's pointer
file, :mod:`omni_accum.arena.live`); a region not there yet is looked for again after :data:`ATTACH_RETRY_S`.
The receiving side makes the region on its first ``get``; when it cannot (a private directory it cannot use, a
file there that is not this user's, a full ``/dev/shm``, another live receiver of the pair) the cause is counted
in ``omni_accum_fallbacks_total``, said once with what to fix, and tried again every :data:`CREATE_RETRY_S`.
Meanwhile the pair's messages go through the connector's inner ``SharedMemoryConnector``. A pair with no region
for a cause that does not pass by itself is listed in ``health()["inner_only"]`` with what was said.

:class:`PairRegions` is a mixin of :class:`.arena_connector.ArenaConnector`: it reads the connector's settings
(``arena_name``, ``arena_name_from``, ``arena_bytes``, ``ring_bytes``, ``warm_bytes``), its ``inner`` connector
(named in messages) and ``_rx_lock``, and reads and fills its tables of senders and receivers (``_tx``, ``_rx``),
their retry times (``_tx_retry``, ``_rx_retry``), ``_inner_only``, ``fallbacks`` and ``_warned``, all made by the
connector's ``__init__``. A second receiving process of a pair (a replica of the stage) marks the pair
(:func:`omni_accum.arena.live.mark_replica`); the sender then sends through the inner connector and the owner forwards
what its region holds there (:meth:`PairRegions._shared`, :meth:`PairRegions._forward`, with the connector's
``_decode``, ``counts``, ``_seen``, ``_replica_seen``, ``_marked`` and ``_forwarder``).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import threading
import time
import weakref
from typing import Any

from omni_accum import samehost
from omni_accum.arena.live import create_receiver, live_region, mark_replica, replicas_marked, unmark_replica
from omni_accum.arena.region import ArenaError, PeerDied, owner_of, path_for, pid_alive
from omni_accum.integrations.vllm_omni.arena_settings import NAME
from omni_accum.integrations.vllm_omni.prometheus import fallback as _count_fallback
from omni_accum.samehost import SameHostRefused, log_refusal

logger = logging.getLogger("omni_accum.vllm_omni")

#: A sender that found no region tries again after this long (puts meanwhile use the inner connector).
ATTACH_RETRY_S = 0.05
#: A receiver that could not make its region (a full /dev/shm: ``no_space``; a private directory it cannot use:
#: ``unavailable``, ``samehost_refused``; another live receiver holds the pair's region: ``in_use``) tries again
#: after this long.
CREATE_RETRY_S = 5.0
NO_SPACE = (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT)
#: How often the sender and the owning receiver of a pair look at the pair's replica mark (seconds).
REPLICA_CHECK_S = 0.5
_STARTING = threading.Lock()  # _start_forwarder


def _say_refused(e: SameHostRefused) -> None:
    """A same-host file that is not this user's: logged once per path, counted (``samehost_refused``)."""
    log_refusal(e, NAME)
    _count_fallback("samehost_refused")


def _metric(reason: str) -> str:
    """The ``omni_accum_fallbacks_total`` reason of a fallback counted as ``reason`` in ``health()["fallbacks"]``."""
    return reason if reason.startswith(("arena_", "samehost_")) else f"arena_{reason}"


def _owner(region: str) -> str:
    """``pid N`` of the live region named ``region`` (what the receiver that holds it is), for a message."""
    try:
        return f"pid {owner_of(path_for(region))}"
    except Exception:  # noqa: BLE001 - only words for a message
        return "pid unknown"


def _reap_soon(ref: Any) -> None:
    """The last tensor over some arena pages was freed (any thread, any point of its code): give the pages
    back to the sender now if no get is in progress, without waiting (else the next get does)."""
    self = ref()
    if self is not None and self._rx_lock.acquire(blocking=False):
        try:
            for rx in list(self._rx.values()):
                if rx is not None:
                    rx.reap(wait=False)
        finally:
            self._rx_lock.release()


def _forward_loop(ref: Any) -> None:
    """Every :data:`REPLICA_CHECK_S`: each region this process owns whose pair a replica shares gives its waiting
    messages to the inner connector (the connector's ``_forward``), the messages of its regions no get took in time
    are dropped (``_look_for_orphans``), and the segments this process put the inner way that no get took in time are
    unlinked (:mod:`.arena_inner`); ends with the connector."""
    while True:
        time.sleep(REPLICA_CHECK_S)
        self = ref()
        if self is None or self._closed:
            return
        try:
            for pair, rx in list(self._rx.items()):
                if rx is not None:
                    self._still_pointed(pair, rx)
                if rx is not None and self._shared(pair):
                    with self._rx_lock:
                        if not self._closed and self._rx.get(pair) is rx:
                            self._forward(pair, rx)
        except Exception as e:  # noqa: BLE001 - the thread goes on; the next look tries again
            self._warn("forward-loop", logging.WARNING, "omni-accum arena: forwarding to a replica failed: %s", str(e))
        try:
            self._look_for_orphans()  # the regions' messages no get took (also at gets)
        except Exception as e:  # noqa: BLE001 - as above
            self._warn("orphan-loop", logging.WARNING, "omni-accum arena: the look for messages no get took failed: "
                       "%s", str(e))
        self._inner_orphans.look()  # (never raises)
        del self


class PairRegions:
    """Finding and making the regions of the stage pairs (see the module docstring); a mixin of the connector."""

    def region_name(self, from_stage: str, to_stage: str) -> str:
        return f"{self.arena_name}_{from_stage}_{to_stage}"

    def _warn(self, key: str, level: int, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.log(level, msg, *args)

    def _sender(self, pair: tuple[str, str]) -> Any:
        tx = self._tx.get(pair)
        if tx is not None or time.monotonic() < self._tx_retry.get(pair, 0.0):
            return tx
        from omni_accum.arena.sender import ArenaSender  # noqa: PLC0415 - torch-heavy, first put only

        try:
            tx = ArenaSender(live_region(self.region_name(*pair)), attach_timeout_s=0.0, timeout_s=30.0)
        except (ArenaError, SameHostRefused, OSError) as e:  # a put never fails for the arena: the inner connector
            self._tx_retry[pair] = time.monotonic() + ATTACH_RETRY_S
            reason, said = self._attach_failure(e)
            if reason is None:  # not there yet (the receiver makes it at its first get), or its owner died
                self._inner_only.pop((*pair, "send"), None)
            else:
                self._inner_only[(*pair, "send")] = (reason, said)
            counted = "" if reason is None else f" (each put counted: {_metric(reason)} in omni_accum_fallbacks_total)"
            self._warn(f"attach-{reason}-{pair}", logging.INFO if reason is None else logging.WARNING,
                       "omni-accum arena %s: %s; sending through %s meanwhile%s", self.region_name(*pair), said,
                       type(self.inner).__name__, counted)
            return None
        self._tx[pair] = tx
        self._inner_only.pop((*pair, "send"), None)
        logger.info("omni-accum arena %s: attached as sender (pid=%d)", self.region_name(*pair), os.getpid())
        if self.warm_bytes:
            tx.region.warm(self.warm_bytes)  # this process's page tables for the first slabs (arena_warm)
        return tx

    def _attach_failure(self, e: BaseException) -> tuple[str | None, str]:
        """``(reason, what to say)`` of a failed attach: reason None when it passes by itself (no region yet, or
        one whose owner died); else the fallback each put of the pair is counted as until an attach succeeds."""
        if isinstance(e, SameHostRefused):
            self._refused(e)  # counted at the attach (samehost_refused), as ever
            return None, f"{e} ({samehost.describe_base()})"
        if isinstance(e, OSError):  # the private directory cannot be used (a bad OMNI_ACCUM_ARENA_DIR)
            return "unavailable", f"cannot attach: {e} ({samehost.describe_base()})"
        held = re.search(r"still has sender pid (\d+)", str(e))
        if held is not None and pid_alive(int(held.group(1))):  # another live process sends on this pair's region
            return "sender_in_use", (f"{e}: another process sends on {self._name_said()} for this stage pair (one "
                                     "sending process per stage pair; give each server on a host its own arena_name)")
        return None, str(e)  # (a sender that died: the receiver resets the region for the next)

    def _name_said(self) -> str:
        return f"arena_name {self.arena_name!r} (from {self.arena_name_from})"

    def _receiver(self, pair: tuple[str, str]) -> Any:
        rx = self._rx.get(pair)
        if rx is not None or time.monotonic() < self._rx_retry.get(pair, 0.0):
            return rx  # None: no region a moment ago; the inner connector until the next try (CREATE_RETRY_S)
        base = self.region_name(*pair)
        try:
            samehost.private_dir()
        except SameHostRefused as e:
            self._refused(e)
            return self._no_region(pair, "samehost_refused", f"{e} ({samehost.describe_base()})", counted=True)
        except OSError as e:
            return self._no_region(pair, "unavailable", f"no private directory for its region: "
                                                        f"{samehost.describe_base()}: {e}")
        try:
            live = live_region(base)
        except SameHostRefused as e:  # never read: a region of this process replaces it
            self._refused(e)
            live = None
        except (ArenaError, OSError):
            live = None
        if live is not None:
            self._mark(pair)  # the sender sends the pair's messages the inner way; the owner forwards what it holds
            return self._no_region(pair, "in_use", f"region {live} is in use by a live receiver ({_owner(live)}): "
                                                   f"{self._name_said()} is taken on this host for this stage pair "
                                                   "(one receiving process per stage pair: a replica of this stage "
                                                   "(num_replicas) receives through the inner connector, and the "
                                                   "pair's sender sends every message that way; another server on "
                                                   "this host needs its own arena_name)")
        try:
            rx = create_receiver(base, self.arena_bytes, ring_bytes=self.ring_bytes)
        except OSError as e:
            if e.errno in NO_SPACE:  # a full file system
                return self._no_region(pair, "no_space", f"{e} ({samehost.describe_base()})")
            return self._no_region(pair, "unavailable", f"{e} ({samehost.describe_base()})")
        except SameHostRefused as e:
            self._refused(e)
            return self._no_region(pair, "samehost_refused", f"{e} ({samehost.describe_base()})", counted=True)
        except ArenaError as e:
            return self._no_region(pair, "unavailable", str(e))
        logger.info("omni-accum arena %s: created (%d data bytes, pid=%d)", rx.region.path.name,
                    self.arena_bytes, os.getpid())
        rx.on_dead.append(functools.partial(_reap_soon, weakref.ref(self)))
        rx.on_bad = functools.partial(self._fell_back, "bad_frame", pair)  # a malformed ring message
        if self.warm_bytes:
            rx.region.warm(self.warm_bytes)  # tmpfs gives the first slabs' pages now (arena_warm)
        self._rx[pair] = rx
        self._inner_only.pop((*pair, "receive"), None)
        if base in self._marked:  # it took the pair over: no longer a replica beside the owner
            self._marked.discard(base)
            unmark_replica(base)
        self._start_forwarder()
        return rx

    def _no_region(self, pair: tuple[str, str], reason: str, said: str, counted: bool = False) -> None:
        """The receiving side of ``pair`` could not make its region: counted (``health()["fallbacks"]`` and
        ``omni_accum_fallbacks_total``), said once per reason, and tried again in :data:`CREATE_RETRY_S`
        (the inner connector meanwhile)."""
        self._rx_retry[pair] = time.monotonic() + CREATE_RETRY_S
        self._inner_only[(*pair, "receive")] = (reason, said)
        if not counted:
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
            _count_fallback(_metric(reason))
        level = logging.WARNING if reason == "no_space" else logging.ERROR
        self._warn(f"region-{reason}-{pair}", level, "omni-accum arena %s: %s; this process receives through %s "
                   "meanwhile and tries again every %g s (each try counted: %s in omni_accum_fallbacks_total)",
                   self.region_name(*pair), said, type(self.inner).__name__, CREATE_RETRY_S, _metric(reason))
        return None

    def _shared(self, pair: tuple[str, str]) -> bool:
        """Whether another live process receives on ``pair`` beside its region's owner (a replica of the receiving
        stage, vllm-omni's ``num_replicas``, or a second server with this arena_name): its replica mark, looked at
        every :data:`REPLICA_CHECK_S`. The arena's ring has one reader, the owner, and the sender cannot tell which
        replica a message is for: the sender then sends the pair's messages through the inner connector, which
        every process reads by key (counted ``arena_replicas``), and the owner forwards there any it holds."""
        now = time.monotonic()
        seen = self._replica_seen.get(pair)
        if seen is not None and now < seen[0]:
            return seen[1]
        try:
            shared = replicas_marked(self.region_name(*pair))
        except SameHostRefused as e:
            self._refused(e)
            shared = False
        except (OSError, ArenaError):
            shared = False
        self._replica_seen[pair] = (now + REPLICA_CHECK_S, shared)
        side = (*pair, "send")
        if shared:
            said = ("another process receives on this stage pair beside the region's owner (a replica of the stage: "
                    "num_replicas > 1); one process reads a region, so every message goes the inner way")
            if pair in self._tx and self._inner_only.get(side, ("",))[0] != "replicas":
                self._inner_only[side] = ("replicas", said)
                self._warn(f"replicas-{pair}", logging.WARNING, "omni-accum arena %s: %s: sending through %s (each "
                           "put counted: arena_replicas in omni_accum_fallbacks_total)", self.region_name(*pair), said,
                           type(self.inner).__name__)
        elif self._inner_only.get(side, ("",))[0] == "replicas":
            self._inner_only.pop(side, None)
        return shared

    def _forward(self, pair: tuple[str, str], rx: Any) -> None:
        """Give every message waiting in ``pair``'s region to the inner connector under its key, where any process
        of the stage finds it (a replica shares the pair: the ring has one reader, and the message may be for another
        replica), with ``_rx_lock`` held. Its tensors are copied there as ``SharedMemoryConnector`` copies them; the
        pages go back once the views are dropped. Counted in ``health()["forwarded"]``."""
        for key in self._past_death(pair, rx.waiting_keys):
            msg = self._past_death(pair, rx.take, key)
            if msg is None:
                continue
            self._seen.get(pair, {}).pop(key, None)
            ok, obj = self._decode(pair, rx, msg, handed=False)
            try:
                put = ok and self.inner.put(pair[0], pair[1], key, obj)[0]
            except Exception:  # noqa: BLE001 - said below, like a put the inner connector refused
                put = False
            if put:
                self._inner_orphans.put(key)  # (recorded before counted: a count seen has its orphan record)
                self.counts["forwarded"] += 1
            elif ok:
                self._warn(f"forward-{pair}", logging.ERROR, "omni-accum arena %s: the inner connector refused a "
                           "forwarded message (%r); a replica waiting for it will not get it", self.region_name(*pair),
                           key)
            del obj

    def _still_pointed(self, pair: tuple[str, str], rx: Any) -> None:
        """Two receivers that made their regions at the same moment both own one, and the pair's pointer names only
        the later: the other is a replica beside it. It marks the pair then (the sender goes the inner way, the
        pointed owner forwards what it holds), and forwards what its own region holds (:meth:`_shared` is then
        true here too)."""
        base = self.region_name(*pair)
        if base in self._marked:
            return
        try:
            named = live_region(base)
        except (ArenaError, OSError, SameHostRefused):
            return  # no live pointer (or not this user's): nobody else claims the pair
        if path_for(named) != rx.region.path:
            self._mark(pair)

    def _look_for_orphans(self) -> None:
        """The connector's look for its regions' messages no get took (``_drop_orphans``, also at gets), from its
        thread: a receiving process that has no get to make (no request of its own waiting) drops them too."""
        with self._rx_lock:
            now = self._clock()
            if self._closed or now < self._orphan_check:
                return
            for pair, rx in list(self._rx.items()):
                if rx is not None:
                    self._past_death(pair, rx.waiting_keys)  # the ring's messages first: no take has read them
            self._drop_orphans(now)

    def _past_death(self, pair: tuple[str, str], call: Any, *args: Any) -> Any:
        """``call(*args)`` of ``pair``'s receiver, once more when it found the sender dead (``PeerDied`` comes once per
        death; it is said here; what the sender published before it died is kept)."""
        try:
            return call(*args)
        except PeerDied as e:
            # the text, not the exception: a kept log record must not keep the caller's payload alive
            logger.warning("omni-accum arena %s: %s", self.region_name(*pair), str(e))
            return call(*args)

    def _mark(self, pair: tuple[str, str]) -> None:
        """Write ``pair``'s replica mark: this process receives on the pair beside the region's owner (a replica
        without a region writes it again at each try to make one, every :data:`CREATE_RETRY_S`: with three or more
        replicas the mark holds the last writer's pid). One that cannot be written is said once (the replica's chunks
        then wait in the owner's region)."""
        base = self.region_name(*pair)
        try:
            mark_replica(base)
        except (OSError, SameHostRefused) as e:
            self._warn(f"mark-{pair}", logging.WARNING, "omni-accum arena %s: cannot write the replica mark: %s",
                       base, e)
            return
        self._marked.add(base)
        self._replica_seen.pop(pair, None)

    def _start_forwarder(self) -> None:
        """The connector's thread: an owner's forwards of the messages a replica is waiting for (:meth:`_forward`)
        while this process has no get of its own to do it (vllm-omni polls only for requests it holds), and the
        unlinking of this process's inner puts no get took (:mod:`.arena_inner`). Started with the first region this
        process makes or its first put through the inner connector."""
        if self._forwarder is None:
            with _STARTING:  # a put's thread and a get's may both be first
                if self._forwarder is None:
                    t = threading.Thread(target=_forward_loop, args=(weakref.ref(self),), daemon=True,
                                         name="omni-accum-arena-forward")
                    try:
                        t.start()
                    except RuntimeError as e:  # (no thread to be had: the next put or region tries again)
                        self._warn("forwarder", logging.WARNING, "omni-accum arena: cannot start its thread: %s", e)
                        return
                    self._forwarder = t

    def _refused(self, e: SameHostRefused) -> None:
        self.fallbacks["samehost_refused"] = self.fallbacks.get("samehost_refused", 0) + 1
        _say_refused(e)

    def _fell_back(self, reason: str, pair: tuple[str, str], e: BaseException) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        _count_fallback(_metric(reason))  # omni_accum_fallbacks_total
        self._warn(f"{reason}-{pair}", logging.WARNING, "omni-accum arena %s: %s (%s); that put goes through %s",
                   self.region_name(*pair), reason, str(e), type(self.inner).__name__)

    def _regions(self) -> list[str]:
        return sorted([self.region_name(*p) + " (send)" for p in list(self._tx)]
                      + [self.region_name(*p) + " (receive)" for p, rx in list(self._rx.items()) if rx is not None])

    def _inner_only_now(self) -> dict[str, str]:
        return {f"{self.region_name(f, t)} ({side})": f"{_metric(reason)}: {said}"
                for (f, t, side), (reason, said) in sorted(self._inner_only.items())}

    def _drop_sender(self, pair: tuple[str, str]) -> None:
        tx = self._tx.pop(pair, None)
        if tx is not None:
            try:
                tx.close()
            except Exception:  # noqa: BLE001, S110 - already dead
                pass
