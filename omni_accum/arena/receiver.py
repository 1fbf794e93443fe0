"""The receiving stage's side of an arena: owns the region; its views are tensors over the shared pages.

:meth:`ArenaReceiver.poll` takes the next descriptor off ring F and returns the request's view: for
an append key, ``slab[:rows]`` (a zero-copy view of the rows published so far; rows are written
before the descriptor that publishes them, and never rewritten), for a replace/static tensor the
slab of its latest value, and the non-tensor values as sent. A view is borrowed: it stays valid
until the request's next chunk is polled (a move or a new replace value lets the sender reuse the
old slab after that) or the request is released. ``release`` hands the request's pages back to the
sender through ring B.

Keyed messages (:meth:`ArenaSender.publish`, the connector's put) wait in a mailbox until their key
is asked for (:meth:`take`); the taker copies their small tensors out (:meth:`read_tensor`) and gives
their pages back to the sender (:meth:`free`), and hands the large ones out over their pages
(:meth:`tensor_view`: no copy; the pages go back once no tensor over them is left).
"""

from __future__ import annotations

import logging
import struct
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from omni_accum.arena import wire
from omni_accum.arena._common import (
    CHAINS_DONE,
    CHUNK,
    DONE,
    DTYPES,
    LIVENESS_EVERY_S,
    MSG,
    ROWS_HEAD,
    ROWS_ITEM,
    ROWS_TAG,
    R_BOOL,
    R_NONE,
    R_ROWS,
    place,
    region_bytes,
    wait_until,
)
from omni_accum.arena.region import W_SENDER_CLOSED, W_SENDER_PID, ArenaError, PeerDied, Region
from omni_accum.arena.views import ChainViews
from omni_accum.errors import UnknownRequestError

logger = logging.getLogger("omni_accum.arena")

#: how many released requests' numbers a receiver remembers (to drop their chunks still in flight)
_GONE_KEPT = 65536
#: page-map value of pages a dead sender's successor must leave alone (live slabs of done requests)
_HELD = 255


@dataclass(slots=True)
class Event:
    """One chunk taken off the ring: its request, the request's view after it, the sender's stamp."""

    req_id: str
    view: dict[str, Any]
    t0_ns: int = 0


class _Req:
    __slots__ = ("slabs", "view", "done", "failed", "rix")

    def __init__(self) -> None:
        self.slabs: dict[str, tuple[int, int, torch.Tensor]] = {}  # path -> (page, npages, base tensor)
        self.view: dict[str, Any] = {}
        self.done = False
        self.failed = False
        self.rix = 0  # the sender's number for it (its binary descriptors name it so)


class ArenaReceiver(ChainViews):
    """Create the arena ``name`` (``omni_accum_arena_<name>`` in the private directory: :mod:`omni_accum.samehost`)
    and receive from its one sender.

    Args:
        data_bytes: the slab space (the memory bound: tmpfs pages are touched as slabs are first used).
        ring_bytes: the descriptor ring (sender -> receiver).
        page: slab granularity in bytes.
    """

    def __init__(self, name: str, data_bytes: int, *, ring_bytes: int = 1 << 20, page: int = 4096) -> None:
        self.region = Region.create(name, data_bytes, page=page, ring_bytes=ring_bytes)
        self._u8 = region_bytes(self.region.mm)
        self._page = page
        self._data_off = self.region.data_off
        self._reqs: dict[str, _Req] = {}
        self._mailbox: dict[str, tuple[bytes, list[tuple[int, int]], dict[int, torch.Tensor]]] = {}  # not taken yet
        self._by_rix: dict[int, tuple[str, _Req]] = {}  # the live sender's request numbers
        self._keys: dict[int, tuple[str, str, str]] = {}  # its key numbers: (path, top, qualifier)
        #: numbers of requests released here, whose descriptors may still be in flight (dropped when they
        #: arrive, their pages given back); the oldest are forgotten past _GONE_KEPT
        self._gone: dict[int, None] = {}
        self.binary_descriptors = 0  # chunks that came as a binary decode-step descriptor
        # Append chains of keyed messages: chain number -> its slab's rows as a tensor (the sender writes
        # rows behind those published; a move to a larger slab replaces it), and request -> path -> number.
        self._chains: dict[int, tuple[int, torch.Tensor]] = {}  # chain number -> (lineage token, slab rows)
        self._chains_of: dict[str, dict[str, int]] = {}
        self._sender_pid = 0  # the sender whose chains these are (a new one numbers its own)
        # first page -> pages of every chain slab and message tensor (tensor_view) a tensor still shows
        self._live_slabs: dict[int, int] = {}
        self._dead_slabs: deque[tuple[int, int]] = deque()  # of those, the ones no tensor shows any more (any thread)
        #: called once a span is queued for :meth:`reap` (from whichever thread freed the last tensor over it, at
        #: any point of its code: a hook must not block; it may reap with ``wait=False`` if nothing else is using
        #: this receiver at that moment)
        self.on_dead: list[Any] = []
        self.chain_views = 0  # tensors handed out as new rows of a chain (no copy)
        self.tensor_views = 0  # tensors of keyed messages handed out over their pages (no copy; tensor_view)
        self._last_check = time.monotonic()
        self.bad_frames = 0  # ring messages dropped as malformed or out of bounds (:meth:`_take`)
        #: called with the error of each message dropped (the connector counts it as a fallback)
        self.on_bad: Any = None

    # ------------------------------------------------------------------ receiving
    def poll(self, timeout_s: float = 0.0) -> Event | None:
        """The next chunk's event, waiting up to ``timeout_s``; None when none came.

        Raises PeerDied (its ``requests``: the failed in-flight ones) once when the sender is found
        dead; the arena is then reset for a new sender, and done requests stay readable.
        """
        ring = self.region.ring_f
        while True:
            msg = ring.pop()
            if msg is None:
                now = time.monotonic()
                if now - self._last_check >= LIVENESS_EVERY_S:
                    self._last_check = now
                    self.check_sender()
                if timeout_s <= 0:
                    return None
                msg = wait_until(ring.pop, timeout_s, self.check_sender)
                if msg is None:
                    return None
            ev = self._take(msg)
            if ev is not None:
                return ev

    # ------------------------------------------------------------------ keyed messages (the connector)
    def take(self, key: str) -> tuple[bytes, list[tuple[int, int]], dict[int, torch.Tensor]] | None:
        """``(body, pages, chains)`` of the keyed message ``key`` (taking every message published so far off
        the ring first), or None when it has not arrived. Read its tensors with :meth:`read_tensor` (a copy)
        or :meth:`tensor_view` (none), then give the pages of those not viewed back with :meth:`free`; its
        rows of append chains with :meth:`chain_rows`. Raises
        PeerDied once when the sender is found dead (the messages it published before are kept)."""
        got = self._mailbox.pop(key, None)
        if got is not None:
            return got
        self._pump()
        now = time.monotonic()
        if now - self._last_check >= LIVENESS_EVERY_S:
            self._last_check = now
            self.check_sender()
        return self._mailbox.pop(key, None)

    def read_tensor(self, page: int, dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
        """A copy of the tensor a keyed message holds at ``page``."""
        numel = 1
        for d in shape:
            numel *= d
        nb = numel * dtype.itemsize
        self._in_data(page, nb)
        off = self._data_off + page * self._page
        return self._u8[off : off + nb].view(dtype).view(tuple(shape)).clone()

    def _in_data(self, page: Any, nbytes: int) -> None:
        """BadFrame unless ``nbytes`` from data page ``page`` lie in the data area (a message names them)."""
        lay = self.region.layout
        wire.need(wire.is_int(page) and page * lay.page + nbytes <= lay.npages * lay.page, "a tensor outside the data")

    def free(self, spans: list[tuple[int, int]]) -> None:
        """Give a taken message's pages back to the sender."""
        if spans:
            self._post_free(None, spans)

    def discard(self, key: str) -> bool:
        """Drop the message ``key`` if it was published, giving its pages back (True when it was)."""
        self._pump()
        got = self._mailbox.pop(key, None)
        if got is not None:
            self.free(got[1])
        return got is not None

    def pending_keys(self) -> list[str]:
        return sorted(self._mailbox)

    def waiting_keys(self) -> list[str]:
        """The keys of every message published so far that no take has taken (taking the ring's messages first)."""
        self._pump()
        return sorted(self._mailbox)

    def _pump(self) -> None:
        if self._dead_slabs:
            self.reap()
        ring = self.region.ring_f
        while (msg := ring.pop()) is not None:
            self._take(msg)

    def _take(self, msg: bytes) -> Event | None:
        """Apply one ring message. One that is malformed, or names pages, keys or requests it may not
        (:mod:`.wire`: nothing in it can construct an object or run code) is dropped and counted; the
        request it was meant for gets no more of it (its get falls back or times out), the others go on."""
        try:
            tag = msg[0] if msg else 0
            if tag == ROWS_TAG:
                return self._apply_rows(msg)
            m = wire.load_msg(msg) if tag == wire.MSG_TAG else wire.loads(msg)
            wire.need(tag == wire.MSG_TAG or type(m) is not tuple or m[:1] != (MSG,), "an unframed keyed message")
            return self._apply(wire.checked(m, self.region.layout))
        except PeerDied:
            raise
        except (ArenaError, KeyError, IndexError, ValueError, TypeError, AttributeError, RuntimeError, OverflowError,
                struct.error) as e:  # AttributeError: keys that collide ("a" and "a.b") in one message
            self.bad_frames += 1
            if self.bad_frames == 1:
                logger.warning("omni-accum arena %s: dropped a malformed message from the sender: %s (counted in "
                               "bad_frames)", self.region.path.name, str(e))
            if self.on_bad is not None:
                self.on_bad(e)
            return None

    def _apply_rows(self, msg: bytes) -> Event | None:
        """A binary decode-step descriptor (see ``ROWS_HEAD``): new row counts and small values."""
        rix, t0, n = ROWS_HEAD.unpack_from(msg, 1)
        wire.need(len(msg) == 1 + ROWS_HEAD.size + n * ROWS_ITEM.size, f"{len(msg)} bytes for {n} items")
        hit = self._by_rix.get(rix)
        if hit is None:
            if rix in self._gone:
                return None  # a request released here while this step was in flight: dropped
            raise ArenaError(f"arena {self.region.path.name}: a descriptor names request number {rix}, never announced")
        rid, req = hit
        self.binary_descriptors += 1
        view, slabs, keys = req.view, req.slabs, self._keys
        unpack, size = ROWS_ITEM.unpack_from, ROWS_ITEM.size
        for off in range(1 + ROWS_HEAD.size, 1 + ROWS_HEAD.size + n * size, size):
            ix, kind, val = unpack(msg, off)
            path, top, qual = keys[ix]
            if kind == R_ROWS:
                v: Any = slabs[path][2][:val]
            elif kind == R_NONE:
                v = None
            elif kind == R_BOOL:
                v = bool(val)
            else:
                v = val
            if qual:
                view.setdefault(top, {})[qual] = v
            else:
                view[top] = v
        return Event(rid, view, t0)

    def _apply(self, m: tuple) -> Event | None:
        if m[0] == MSG:
            chains: dict[int, torch.Tensor] = {}
            if len(m) > 4:
                if m[4]:
                    self._open_chains(m[4])
                # the message keeps the slabs it shows (the chain may move or end before it is taken)
                chains = {no: self._chains[no] for no in m[5] if no in self._chains}
            self._mailbox[m[1]] = (m[2], m[3], chains)
            return None
        if m[0] == CHAINS_DONE:
            self._end_chains(m[1])
            return None
        if m[0] == DONE:
            req = self._reqs.get(m[1])
            if req is not None:
                req.done = True
            return None
        if m[0] != CHUNK:
            raise ArenaError(f"arena {self.region.path.name}: unknown message {m[0]!r}")
        _, rid, t0, opens, rows, values, rix, keys = m
        for ix, path in keys:
            top, _, qual = path.partition(".")
            self._keys[ix] = (path, top, qual)
        if rix in self._gone:  # released here while this chunk was in flight: its new slabs go back
            spans = [(page, npg) for _, page, npg, *_ in opens]
            if spans:
                self._post_free(None, spans)
            return None
        req = self._reqs.get(rid)
        if req is None:
            req = self._reqs[rid] = _Req()
        if rix and req.rix != rix:
            req.rix = rix
            self._by_rix[rix] = (rid, req)
        view = req.view
        stale: list[tuple[int, int]] = []
        for path, page, npg, cap, dt, row_shape, append in opens:
            dtype = DTYPES[dt]
            off = self._data_off + page * self._page
            numel = cap
            for d in row_shape:
                numel *= d
            nbytes = numel * dtype.itemsize
            base = self._u8[off : off + nbytes].view(dtype)
            base = base.view(cap, *row_shape) if append else base.view(row_shape)
            old = req.slabs.get(path)
            if old is not None:
                stale.append((old[0], old[1]))
            req.slabs[path] = (page, npg, base)
            if not append:
                place(view, path, base)
        for path, n in rows:
            place(view, path, req.slabs[path][2][:n])
        for path, (append, v) in values.items():
            if append and isinstance(v, list):
                top, _, qual = path.partition(".")
                cur = (view.get(top) or {}).get(qual) if qual else view.get(top)
                v = (cur + v) if isinstance(cur, list) else list(v)
            place(view, path, v)
        if stale:
            self._post_free(None, stale)
        return Event(rid, view, t0)

    def view(self, req_id: str) -> dict[str, Any]:
        req = self._reqs.get(req_id)
        if req is None:
            raise UnknownRequestError(req_id, len(self._reqs))
        if req.failed:
            raise PeerDied(f"request {req_id!r} was in flight when its sender died", [req_id])
        return req.view

    def requests(self) -> list[str]:
        return sorted(self._reqs)

    def held_bytes(self) -> int:
        return sum(n * self._page for r in self._reqs.values() for _, n, _ in r.slabs.values())

    # ------------------------------------------------------------------ release
    def release(self, req_id: str) -> None:
        """Drop ``req_id``; its pages go back to the sender (views of it must not be used after this)."""
        req = self._reqs.pop(req_id, None)
        if req is not None and self._by_rix.get(req.rix, (None, None))[1] is req:
            del self._by_rix[req.rix]  # (a later sender may have given its number to another request)
            if not req.done:  # the sender may still have chunks of it in flight
                self._gone[req.rix] = None
                if len(self._gone) > _GONE_KEPT:
                    del self._gone[next(iter(self._gone))]
        if req is None or not req.slabs:
            return
        spans = [(p, n) for p, n, _ in req.slabs.values()]
        req.slabs.clear()
        req.view.clear()
        self._post_free(req_id, spans)

    def _post_free(self, rid: str | None, spans: list[tuple[int, int]], *, wait: bool = True) -> bool:
        """Give ``spans`` back to the sender (False: ``wait=False`` and ring B is full; nothing sent)."""
        q = self.region.q
        if q[W_SENDER_PID] == 0:  # no sender: this side is the page map's only writer
            for p, n in spans:
                self.region.pages[p : p + n] = b"\0" * n
            return True
        msg = wire.dump_free(rid, spans)
        ring = self.region.ring_b
        if ring.push(msg):
            return True
        if not wait:
            return False
        if not wait_until(lambda: ring.push(msg), 30.0, self.check_sender):
            raise ArenaError(f"arena {self.region.path.name}: the sender takes no released pages back")
        return True

    # ------------------------------------------------------------------ the sender's liveness
    def check_sender(self) -> None:
        """Raise PeerDied (after resetting the arena for a new sender) if the attached sender is dead."""
        q = self.region.q
        pid = q[W_SENDER_PID]
        # (no sender attached while chains are open: theirs closed, also when this side never saw its pid,
        # as happens when it attached and closed between two liveness checks)
        if pid != self._sender_pid or (pid == 0 and self._chains):
            self._new_sender(pid)
        if pid == 0:
            return
        self.region.beat()
        if q[W_SENDER_CLOSED] and pid == 0:
            return
        if self.region.peer_alive():
            return
        failed = self._reset_sender()
        raise PeerDied(f"arena {self.region.path.name}: sender pid {pid} died; failed requests {failed}", failed)

    def _reset_sender(self) -> list[str]:
        ring = self.region.ring_f
        while (msg := ring.pop()) is not None:  # every published message is complete: apply it
            self._take(msg)
        self._by_rix.clear()  # a new sender numbers its requests and keys afresh
        self._keys.clear()
        self._gone.clear()
        failed = []
        for rid, req in self._reqs.items():
            if not req.done and not req.failed:
                req.failed = True
                req.slabs.clear()
                req.view.clear()
                failed.append(rid)
        pages = self.region.pages
        pages[:] = b"\0" * len(pages)  # the dead sender's pages, announced or not, are free again ...
        for req in self._reqs.values():
            for p, n, _ in req.slabs.values():
                pages[p : p + n] = bytes([_HELD]) * n  # ... except those of done requests
        for _, spans, _ in self._mailbox.values():
            for p, n in spans:
                pages[p : p + n] = bytes([_HELD]) * n  # ... and those of keyed messages not taken yet
        self._chains.clear()  # the dead sender's chains end: their slabs go back once no tensor shows them
        self._chains_of.clear()
        while self._dead_slabs:  # (slabs no tensor shows any more are free with the rest)
            self._live_slabs.pop(self._dead_slabs.popleft()[0], None)
        for p, n in self._live_slabs.items():
            pages[p : p + n] = bytes([_HELD]) * n
        ring.reset()
        self.region.ring_b.reset()
        q = self.region.q
        q[W_SENDER_CLOSED] = 0
        q[W_SENDER_PID] = 0  # written last: a new sender may attach
        return sorted(failed)

    def close(self) -> None:
        """Unlink the arena; the mapping stays until the views over it are freed."""
        self._reqs.clear()
        self._chains.clear()
        self._chains_of.clear()
        self._u8 = None
        self.region.close()

    def __enter__(self) -> ArenaReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


