"""``OmniAccumArenaConnector``: a vllm-omni connector for stages on one host, over omni-accum's arena.

Select it in a deploy YAML like any connector::

    connectors:
      arena:
        name: OmniAccumArenaConnector
        extra:
          arena_name: my-server        # default: $OMNI_ACCUM_ARENA_NAME, else "omni"
          arena_bytes: 2GiB            # per stage pair (default 1GiB); tmpfs pages are touched as used
          ring_bytes: 4MiB             # descriptor ring per stage pair (default 4MiB)
          arena_view_bytes: 64KiB      # received tensors this large are not copied (default 64KiB; off)
          arena_warm: 1GiB             # reserve and map this much of a region when it is created / attached
                                       # (default 0: pages are given as slabs first need them; all: arena_bytes)
          arena_stage_rows: true       # the stage input processor builds the prompt's rows in the arena
                                       # (stage_rows: chunk 0's put copies none of them); false: it does not

One shared-memory region per stage pair (``omni_accum_arena_<arena_name>_<from>_<to>.<random>`` in this user's
private directory, ``/dev/shm/omni-accum-<euid>/``: :mod:`omni_accum.samehost`), created once by the receiving
process on its first ``get`` and found by the sending process through the pair's pointer file
(:mod:`omni_accum.arena.live`); a file there that is not this user's is refused (``samehost_refused``):
no segment is created per message and no tensor byte is pickled. A ``put`` writes each tensor of the
payload into arena pages with one copy and pushes a small message (the rest of the payload, in
vllm-omni's own msgpack encoding, which ``SharedMemoryConnector`` uses for all of it) through the
region's ring; the receiver's ``get`` decodes the payload as ``SharedMemoryConnector`` would: the same
values come out, the tensors of at least ``arena_view_bytes`` as tensors over their arena pages (no copy:
the pages go back to the sender once no tensor over them is left), smaller ones copied out (their pages
go back at once; :mod:`.arena_codec`). The rows of keys the sending policy appends go into the
request's append chains instead (:mod:`.arena_chains`), one slab per request and key written once, and
come out as views over the shared pages that ``prealloc`` takes as its buffer (docs/arena.md, "Append
chains" and "Zero-copy receive").

Everything the arena cannot take goes through an inner ``SharedMemoryConnector`` built from the same
config, so nothing is lost: a put before the receiver has created the region, an arena that is full,
a message larger than the ring, a payload that does not encode, a peer that died. ``get`` looks
in the arena first, then in the inner connector. ``health()`` counts both paths, and :meth:`status_row` puts a
few of its numbers into omni-accum's status (and the status file).

A pair whose region cannot be made is counted in ``omni_accum_fallbacks_total`` and said once per cause, naming what
to fix, and tried again every :data:`.arena_pairs.CREATE_RETRY_S` by the receiving side: a private directory that
cannot be used (``arena_unavailable``; ``samehost_refused`` when it is not this user's), a full ``/dev/shm``
(``arena_no_space``), and another live receiver of the pair (``arena_in_use``: one receiving process per stage pair,
so give each server on a host its own ``arena_name``). A sending side that cannot attach for a cause that does not
pass by itself counts each put it sends the inner way (``arena_unavailable``, ``arena_sender_in_use``: another live
process sends on the pair's region; ``arena_replicas``: another process receives on the pair beside the region's
owner, a replica of the stage, and the owner forwards to the inner connector what its region holds).
``health()["inner_only"]`` names the pairs without a region and why
(:mod:`.arena_pairs` finds and makes the regions). The region is removed when the connector closes, and otherwise by
omni-accum's reaper process once the server's processes have ended (vllm-omni's stage processes end on SIGTERM without
closing their connectors); a region whose owner died is removed by the next process that looks for the pair.

A message no get takes (its request aborted or failed on the receiving stage) is dropped after :func:`orphan_after_s`
(twice vllm-omni's ``VLLM_OMNI_INPUT_WAIT_TIMEOUT_S``; an hour where its 0 turns vllm-omni's deadline off), its pages
given back, counted (``health()["orphans_dropped"]``) and said once per pair (looked for at gets and from the
connector's thread): vllm-omni 0.30.0 removes an aborted request's unread chunks only for a ``SharedMemoryConnector``.
One that went through the inner connector is unlinked from ``/dev/shm`` by the process that put it
(:mod:`.arena_inner`), counted the same way; at the abort itself where vllm-omni's adapter has that clean-up, by the
sender, a forward of the key too (:mod:`.arena_abort`, 0.30.0: ``health()["aborted_unlinked"]``).

Registered with ``OmniConnectorFactory`` by :mod:`.arena_plugin` (entry point ``omni_accum_arena``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
from vllm_omni.distributed.omni_connectors.connectors.base import OmniConnectorBase
from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

from omni_accum.arena.live import unmark_replica
from omni_accum.arena.region import ArenaError, ArenaFull, PeerDied
from omni_accum.integrations.vllm_omni import publishing
from omni_accum.integrations.vllm_omni.arena_chains import append_test, chain_payload, request_of, struct_map
from omni_accum.integrations.vllm_omni.arena_codec import Decoder, Encoder
from omni_accum.integrations.vllm_omni.arena_inner import InnerOrphans
from omni_accum.integrations.vllm_omni.arena_pairs import PairRegions, _metric
from omni_accum.integrations.vllm_omni.arena_settings import NAME, orphan_after_s, parse_settings
from omni_accum.integrations.vllm_omni.prometheus import fallback as _count_fallback

logger = logging.getLogger("omni_accum.vllm_omni")

#: How often a receiving connector looks for messages no get took (seconds, at a get).
ORPHAN_CHECK_S = 1.0
_now = time.monotonic  # the clock of those looks (tests move it)
class ArenaConnector(PairRegions, OmniConnectorBase):
    """See the module docstring. ``config`` is the connector's ``extra`` (vllm-omni adds ``stage_id``)."""

    def __init__(self, config: dict[str, Any] | None) -> None:
        self.config = dict(config or {})
        self.stage_id = self.config.get("stage_id", -1)
        settings = parse_settings(self.config)
        self.arena_name = settings.arena_name
        self.arena_name_from = settings.arena_name_from  # extra.arena_name, OMNI_ACCUM_ARENA_NAME or the default
        self.arena_bytes = settings.arena_bytes
        self.ring_bytes = settings.ring_bytes
        self.view_bytes = settings.view_bytes
        self.warm_bytes = settings.warm_bytes
        self.stage_rows_on = settings.stage_rows
        self.inner = self.peer_channel = SharedMemoryConnector(self.config)  # peer_channel: the stage hellos (.peer)
        # one lock per direction: a put waiting for ring space never holds up this process's gets
        self._tx_lock = threading.Lock()
        self._rx_lock = threading.Lock()
        self._tx: dict[tuple[str, str], Any] = {}  # pair -> ArenaSender
        self._tx_retry: dict[tuple[str, str], float] = {}  # pair -> monotonic time of the next attach
        self._rx: dict[tuple[str, str], Any] = {}  # pair -> ArenaReceiver, or None: inner connector only
        self._rx_retry: dict[tuple[str, str], float] = {}  # pair -> monotonic time of the next create
        #: Pairs that have no region now for a cause that does not pass by itself (health()["inner_only"]): the
        #: pair's side, "send" or "receive" -> (reason, what was said). A put of such a pair is counted.
        self._inner_only: dict[tuple[str, str, str], tuple[str, str]] = {}
        self._warned: set[str] = set()
        self._chain_logged = False
        self._to_release: deque[str] = deque()  # requests whose chains end at the next chance (release_request)
        #: ``(key path, value) -> bool``: which keys go as append chains in a put that omni-accum's send
        #: hook is not making (a benchmark, a test); within the hook, the sending policy decides.
        self.append_test: Any = None
        self._closed = False
        self._encoder = Encoder()
        self._decoder = Decoder(self.view_bytes)
        self.counts = {"arena_puts": 0, "inner_puts": 0, "arena_gets": 0, "inner_gets": 0, "arena_bytes": 0,
                       "chain_appends": 0, "orphans_dropped": 0, "forwarded": 0, "aborted_unlinked": 0}
        self.orphan_s = orphan_after_s()
        self._inner_orphans = InnerOrphans(self.inner, self.orphan_s)  # inner puts no get takes (.arena_inner)
        self._orphan_check = 0.0  # monotonic time of the next look for messages no get took
        self._seen: dict[tuple[str, str], dict[str, float]] = {}  # pair -> key -> when a look first saw it waiting
        self._alive: dict[str, float] = {}  # request -> when a get last took one of its messages
        self._alive_check = 0.0  # monotonic time of the next look at it from an inner get
        self.fallbacks: dict[str, int] = {}
        self._replica_seen: dict[tuple[str, str], tuple[float, bool]] = {}  # pair -> (next look, a replica shares it)
        self._marked: set[str] = set()  # the pairs whose replica mark this process wrote (it is not their owner)
        self._forwarder: threading.Thread | None = None  # forwards what a replica waits for (arena_pairs)
        publishing.connectors.add(self)  # its status_row() goes into status() and the status file

    # ------------------------------------------------------------------ the connector interface
    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        pair = (str(from_stage), str(to_stage))
        try:
            return self._put_or_inner(pair, from_stage, to_stage, put_key, data)
        finally:
            # a release that came while this put held the lock (release_request never waits for it)
            if self._to_release and self._tx_lock.acquire(blocking=False):
                try:
                    self._release_pending()
                finally:
                    self._tx_lock.release()

    def _put_or_inner(self, pair: tuple[str, str], from_stage: str, to_stage: str, put_key: str, data: Any) -> Any:
        with self._tx_lock:
            if self._to_release:
                self._release_pending()
            tx = None if self._closed else self._sender(pair)
            if tx is not None and self._shared(pair):  # another process receives on the pair: the inner way
                tx = None
            if tx is not None:
                try:
                    n = self._put(tx, put_key, data)
                except ArenaFull as e:
                    self._fell_back("arena_full", pair, e)
                except PeerDied as e:
                    self._fell_back("receiver_died", pair, e)
                    self._drop_sender(pair)
                except ArenaError as e:
                    self._fell_back("arena_error", pair, e)
                except Exception as e:  # noqa: BLE001 - a payload that does not encode: the ordinary path says why
                    self._fell_back("encode_error", pair, e)
                else:
                    if not self.counts["arena_puts"]:
                        logger.info("omni-accum arena %s: first put through the arena (%d bytes)",
                                    tx.region.path.name, n)
                    self.counts["arena_puts"] += 1
                    self.counts["arena_bytes"] += n
                    return True, n, {"arena": self.region_name(*pair), "size": n}
            stuck = self._inner_only.get((*pair, "send"))
            if stuck is not None and not self._closed:  # no region for a cause that does not pass by itself
                self.fallbacks[stuck[0]] = self.fallbacks.get(stuck[0], 0) + 1
                _count_fallback(_metric(stuck[0]))
        result = self.inner.put(from_stage, to_stage, put_key, data)
        if result[0]:
            self.counts["inner_puts"] += 1
            if not self._closed:
                self._inner_orphans.put(put_key)
                self._start_forwarder()  # its thread unlinks the segments no get takes
        return result

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        pair = (str(from_stage), str(to_stage))
        with self._rx_lock:
            rx = None if self._closed else self._receiver(pair)
            if rx is not None:
                msg = self._past_death(pair, rx.take, get_key)
                now = _now()
                if msg is not None:
                    self._seen.get(pair, {}).pop(get_key, None)
                    self._alive[request_of(get_key) or get_key] = now
                if self._shared(pair):  # a replica shares the pair: the rest (maybe its messages), the inner way
                    self._forward(pair, rx)
                if now >= self._orphan_check:
                    self._drop_orphans(now)
                if msg is not None:
                    ok, obj = self._decode(pair, rx, msg)
                    if ok:
                        self.counts["arena_gets"] += 1
                        return obj, len(msg[0]) + sum(n for _, n in msg[1]) * rx.region.layout.page
        got = self.inner.get(from_stage, to_stage, get_key, metadata)
        if got is not None:
            self.counts["inner_gets"] += 1
            now = _now()
            self._alive[request_of(get_key) or get_key] = now
            if now >= self._alive_check:  # (a connector with no region makes no look above: it grew by a request per
                self._alive_check = now + ORPHAN_CHECK_S  # get, for good; only the record here: a payload taken
                self._forget_idle(now)  # the inner way is never lost to a region's trouble)
        return got

    def _decode(self, pair: tuple[str, str], rx: Any, msg: Any, handed: bool = True) -> tuple[bool, Any]:
        """``(True, payload)`` of a taken message, as ``SharedMemoryConnector`` would give it; ``(False, None)`` for a
        malformed one (counted ``bad_frame``). With ``_rx_lock`` held. ``handed=False``: not handed out by this
        process (a forward to a replica): its tensors are not counted as views or copies received here."""
        body, spans, chains = msg
        dec = self._decoder
        counts = (dec.views, dec.copies, rx.chain_views, rx.tensor_views)
        dec.rx, dec.chains, dec.spans = rx, chains, dict(spans)
        try:
            obj = dec.decode(body)
        except Exception as e:  # noqa: BLE001 - malformed: the get looks in the inner connector
            self._fell_back("bad_frame", pair, e)
            return False, None
        finally:
            # the pages of tensors copied out go back now; those of tensors handed out over
            # them, once no tensor over them is left (ChainViews.reap, on a later get)
            rx.free(list(dec.spans.items()))
            dec.chains, dec.spans = {}, {}
            if not handed:
                dec.views, dec.copies, rx.chain_views, rx.tensor_views = counts
        if (chains or dec.views) and handed and not self._chain_logged:
            self._chain_logged = True
            logger.info("omni-accum arena %s: first tensors handed out over the shared pages (no copy; "
                        "%d chain view(s), %d tensor view(s))", rx.region.path.name, rx.chain_views, rx.tensor_views)
        return True, obj

    def _clock(self) -> float:
        return _now()  # the orphan looks' clock (tests move it)

    def _forget_idle(self, now: float) -> dict[str, float]:
        """Forget the requests no get took a message of within :attr:`orphan_s`; the record as it was."""
        alive = dict(self._alive)  # (an inner get may add to it meanwhile)
        for req in [r for r, t in alive.items() if now - t > self.orphan_s]:
            self._alive.pop(req, None)
        return alive

    def _drop_orphans(self, now: float) -> None:
        """Drop the messages that have waited for a get longer than :attr:`orphan_s` (with ``_rx_lock`` held)."""
        self._orphan_check = now + ORPHAN_CHECK_S
        alive = self._forget_idle(now)
        for pair, rx in list(self._rx.items()):
            if rx is None:
                continue
            old = self._seen.get(pair, {})
            seen = self._seen[pair] = {k: old.get(k, now) for k in rx.pending_keys()}  # the keys waiting now only
            # (vllm-omni's wait starts again at each chunk: a request still taking its chunks is alive)
            dropped = [k for k, first in seen.items()
                       if now - max(first, alive.get(request_of(k) or k, first)) > self.orphan_s]
            for k in dropped:
                rx.discard(k)  # its pages go back to the sender
                del seen[k]
            if dropped:
                self.counts["orphans_dropped"] += len(dropped)
                self._warn(f"orphans-{pair}", logging.WARNING, "omni-accum arena %s: dropped %d message(s) no get took "
                           "within %g s (e.g. %r: requests aborted or failed on this stage), their pages given back; "
                           "counted in health()['orphans_dropped'] (said once)", self.region_name(*pair), len(dropped),
                           self.orphan_s, dropped[0])

    def _put(self, tx: Any, key: str, data: Any) -> int:
        """Encode ``data`` as vllm-omni does, its tensors into the arena, and publish it; the bytes moved.

        The tensors of keys the sending policy appends go behind the request's earlier rows of the key
        (its append chain): the receiver hands them out as views of one slab that holds all of the
        key's rows, which an append-kind accumulator (``prealloc``) takes as its buffer with no copy."""
        tx.reclaim()
        enc = self._encoder
        enc.tx, enc.spans, enc.tensor_bytes = tx, [], 0
        opens: list[tuple[Any, ...]] = []
        taken: list[tuple[int, int]] = []
        req = request_of(key)
        # (a put of a request released here already, an abort racing a send, goes the copy way: no
        # chain would ever end)
        appends = (append_test() or self.append_test) if req is not None and not tx.ended(req) else None
        refs: list[int] = []  # the chains whose rows the message names
        try:
            if appends is not None:
                as_map = data if isinstance(data, Mapping) else struct_map(data)
                if as_map is not None:
                    chained = chain_payload(tx, req, as_map, appends, opens, taken, refs)
                    if refs:
                        data = chained
            body = enc.encode(data)
            tx.publish(key, body, enc.spans, opens, refs)
        except BaseException:
            tx.free(enc.spans)
            tx.free(taken)
            if refs or taken:
                tx.drop_chains(req)  # the receiver holds other rows than these chains now say
            raise
        finally:
            enc.tx = None
        if refs and not self.counts["chain_appends"]:
            logger.info("omni-accum arena %s: first append chain rows written (request %s, %d key(s)): the "
                        "receiver's append-kind buffers are these shared pages", tx.region.path.name, req, len(refs))
        self.counts["chain_appends"] += len(refs)
        return enc.tensor_bytes + len(body)

    def stage_rows(
        self, from_stage: str, to_stage: str, req: str, path: str, dtype: torch.dtype, row_shape: tuple, rows: int
    ) -> torch.Tensor | None:
        """A tensor of ``rows`` rows in the arena where the request's append chain of ``path`` will live, for a
        caller in this process that builds the key's rows before they are put (the stage input processor):
        a later put of rows written there copies none of them (``health()["chain_rows_in_place"]``). None
        when ``arena_stage_rows`` is off, there is no region to send into, the request's chains already ended
        or hold rows of the key, or the arena has no room: the caller builds its rows in its own memory and the
        put copies them."""
        if not self.stage_rows_on:
            return None
        pair = (str(from_stage), str(to_stage))
        with self._tx_lock:
            tx = None if self._closed else self._sender(pair)
            if tx is None or tx.ended(req) or self._shared(pair):
                return None
            try:
                return tx.stage(req, path, dtype, tuple(row_shape), rows)
            except (ArenaError, OSError, ValueError, TypeError, RuntimeError):
                return None

    def release_request(self, external_req_id: str) -> None:
        """The sending side is done with ``external_req_id``: the receivers drop its append chains' slabs
        once no tensor over them is left (omni-accum's sender-release hook calls this, possibly on the
        scheduler's thread: it never waits for a put in progress or for ring space; what it cannot do
        now, the next put does)."""
        self._to_release.append(external_req_id)
        if self._tx_lock.acquire(blocking=False):
            try:
                self._release_pending()
            finally:
                self._tx_lock.release()

    def _release_pending(self) -> None:
        """End the chains of the requests released since (with ``_tx_lock`` held)."""
        todo = self._to_release
        for _ in range(len(todo)):
            req = todo.popleft()
            for pair, tx in list(self._tx.items()):
                try:
                    if not tx.release_chains(req, wait=False):
                        todo.append(req)  # the ring is full: the next put tries again
                        break
                except (ArenaError, OSError, ValueError) as e:
                    self._warn(f"release-{pair}", logging.WARNING, "omni-accum arena %s: %s", self.region_name(*pair),
                               str(e))

    def get_with_deadline(self, from_stage, to_stage, get_key, metadata=None, *, deadline):  # noqa: ANN001
        if time.monotonic() >= deadline:
            return None
        return self.get(from_stage, to_stage, get_key, metadata)

    def cleanup(self, request_id: str) -> None:
        """Drop the unconsumed message ``request_id`` (the exact key of a put), in the arena and the inner connector."""
        with self._rx_lock:
            for rx in self._rx.values():
                if rx is not None:
                    rx.discard(request_id)
        self.inner.cleanup(request_id)

    def abort_keys(self, keys: list[str]) -> None:
        """The abort clean-up of this sender's chunks ``keys`` (:mod:`.arena_abort`, on the adapter's save thread): what
        went the inner way is unlinked now, as for a ``SharedMemoryConnector``; counted in ``aborted_unlinked``."""
        self.counts["aborted_unlinked"] += self._inner_orphans.abort(keys)

    def reap_consumed(self) -> None:
        self.inner.reap_consumed()

    def health(self) -> dict[str, Any]:
        inner = self.inner.health()
        return {
            "status": "healthy" if not self._closed else "closed",
            **self.counts,
            "orphans_dropped": self.counts["orphans_dropped"] + self._inner_orphans.dropped,
            # (copies of the tables: the receiving and sending threads may add a pair meanwhile)
            "chain_views": sum(rx.chain_views for rx in list(self._rx.values()) if rx is not None),
            # chain rows a put found written in place (stage_rows): not copied at the put
            "chain_rows_in_place": sum(tx.rows_in_place for tx in list(self._tx.values())),
            "tensor_views": self._decoder.views,  # received tensors handed out over arena pages (no copy)
            "tensor_copies": self._decoder.copies,  # received tensors copied out (under arena_view_bytes)
            # pages of chains and tensor views some tensor still shows (given back once none does)
            "view_bytes_held": sum(rx.view_bytes() for rx in list(self._rx.values()) if rx is not None),
            "fallbacks": dict(self.fallbacks),
            "regions": self._regions(),
            # the pairs with no region now, for a cause that does not pass by itself: what was said
            "inner_only": self._inner_only_now(),
            "inner": inner,
        }

    def status_row(self) -> dict[str, Any]:
        """A few of :meth:`health`'s numbers for :func:`.reporting.status` and the status file: the name, the stage,
        puts and gets by path, the fallbacks, the regions, the pairs without one and why."""
        c = self.counts
        return {"connector": NAME, "status": "closed" if self._closed else "healthy", "arena_name": self.arena_name,
                "stage": self.stage_id,
                "arena_puts": c["arena_puts"], "inner_puts": c["inner_puts"], "arena_gets": c["arena_gets"],
                "inner_gets": c["inner_gets"], "orphans_dropped": c["orphans_dropped"] + self._inner_orphans.dropped,
                "aborted_unlinked": c["aborted_unlinked"], "fallbacks": dict(self.fallbacks),
                "regions": self._regions(),
                "inner_only": self._inner_only_now()}

    def close(self) -> None:
        """Detach as sender, unlink the regions this process created, close the inner connector (idempotent)."""
        if getattr(self, "_closed", True):
            return
        with self._tx_lock, self._rx_lock:
            self._closed = True
            for pair in list(self._tx):
                self._drop_sender(pair)
            for rx in self._rx.values():
                if rx is not None:
                    try:
                        rx.close()
                    except Exception:  # noqa: BLE001, S110
                        pass
            self._rx.clear()
            for base in self._marked:  # it no longer receives beside those regions' owners
                unmark_replica(base)
            self._marked.clear()
        self.inner.close()
