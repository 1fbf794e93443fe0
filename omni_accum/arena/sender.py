"""The sending stage's side of an arena: writes tensor values straight into the receiver's buffers.

Per request and tensor key, an *append* key gets one slab (sized from the length hint, grown by a
move when it runs out); each chunk copies its new rows into the slab behind the rows already
published (one ``memmove``), then pushes one descriptor: the request, the new row count per key,
the small non-tensor values (:mod:`.wire`: plain values only, never pickled) and any slab the receiver has
not seen yet. A *replace* or *static* tensor gets a fresh slab per value. The sender is the only writer of
the page map: it allocates pages, and frees them when the receiver reports them released (ring B).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from omni_accum.arena import wire
from omni_accum.arena._common import (
    CHUNK,
    DONE,
    LIVENESS_EVERY_S,
    ROWS_HEAD,
    ROWS_ITEM,
    ROWS_TAG,
    R_BOOL,
    R_INT,
    R_NONE,
    R_ROWS,
    dtype_name,
    leaves,
    region_bytes,
    wait_until,
)
from omni_accum.arena.keyed import KeyedMessages, _Chain
from omni_accum.arena.region import (
    W_OWNER_CLOSED,
    W_SENDER_GEN,
    W_SENDER_PID,
    ArenaError,
    ArenaFull,
    PeerDied,
    Region,
)
from omni_accum.errors import InvalidArgumentError, close_matches
from omni_accum.strategy import KINDS

_memmove = ctypes.memmove
logger = logging.getLogger("omni_accum.arena")
_ROWS = bytes((ROWS_TAG,))  # the first byte of a binary descriptor


class _Slab:
    __slots__ = ("page", "npages", "addr", "cap_rows", "rows", "row_bytes", "dtype", "row_shape", "one_row")

    def __init__(self, page: int, npages: int, addr: int, cap_rows: int, row_bytes: int, dtype: Any, row_shape: tuple):
        self.page, self.npages, self.addr = page, npages, addr
        self.cap_rows, self.rows, self.row_bytes = cap_rows, 0, row_bytes
        self.dtype, self.row_shape = dtype, row_shape
        self.one_row = (1, *row_shape)  # the shape of a one-row append


class ArenaSender(KeyedMessages):
    """Attach to the arena ``name`` (created by the receiver) as its one sender.

    Args:
        kinds: ``{key path: "append" | "replace" | "static"}``; unlisted keys are replace-kind.
        length_hints: ``{key path: final rows}`` of append keys (an int >= 0), to size slabs once.

    Raises :class:`~omni_accum.errors.InvalidArgumentError` (a ValueError) for another kind or hint, before attaching.
        attach_timeout_s: how long to wait for the arena, or for a previous sender's slot to be freed.
        timeout_s: how long a send waits for ring space (back-pressure) before it raises.
    """

    def __init__(
        self,
        name: str,
        kinds: Mapping[str, str] | None = None,
        *,
        length_hints: Mapping[str, int] | None = None,
        attach_timeout_s: float = 30.0,
        timeout_s: float = 30.0,
    ) -> None:
        self.kinds = _checked_kinds(kinds)
        self.length_hints = _checked_hints(length_hints)
        self.timeout_s = timeout_s
        region = wait_until(lambda: _try_attach(name), attach_timeout_s, lambda: None)
        if region is None:
            raise ArenaError(f"arena {name!r} did not appear within {attach_timeout_s}s")
        self.region: Region = region
        q = region.q
        if not wait_until(lambda: q[W_SENDER_PID] == 0, attach_timeout_s, self._check_owner):
            held = q[W_SENDER_PID]  # (read before the mapping goes)
            region.close()
            raise ArenaError(f"arena {name!r} still has sender pid {held} (the receiver resets it)")
        self.gen = q[W_SENDER_GEN] % 255 + 1
        q[W_SENDER_GEN] = self.gen
        q[W_SENDER_PID] = os.getpid()
        self._u8 = region_bytes(region.mm)
        self._base = self._u8.data_ptr() + region.data_off
        self._page = region.layout.page
        self._npages = region.layout.npages
        self._map_off = region.layout.map_off
        self._fill = bytes([self.gen]) * 256
        self._reqs: dict[str, dict[str, _Slab]] = {}
        self._released: set[str] = set()
        self._dead = False
        self._last_check = time.monotonic()
        # The binary fast path (a flat chunk whose keys and slabs are those of the request's last chunk):
        self._rix: dict[str, int] = {}  # request -> its number
        self._next_rix = (self.gen << 48) + 1  # each generation of sender numbers its requests apart
        self._keys: dict[str, int] = {}  # key path -> its number
        self._fast: dict[str, tuple[tuple[str, ...], list[tuple[int, _Slab | None]]]] = {}  # request -> template
        # Append chains of keyed messages (the connector): request -> key path -> chain
        self._chains: dict[str, dict[str, _Chain]] = {}
        self._ended: dict[str, None] = {}  # requests whose chains ended (oldest forgotten past ENDED_KEPT)
        self._next_chain = (self.gen << 40) + 1
        self.bad_frames = 0  # messages on ring B that were not well-formed page releases (dropped)
        self.rows_in_place = 0  # chain rows a put found already written in their slab (stage()): not copied

    # ------------------------------------------------------------------ pages
    def _alloc(self, nbytes: int) -> tuple[int, int]:
        n = max(1, -(-nbytes // self._page))
        mm, lo, hi = self.region.mm, self._map_off, self._map_off + self._npages
        pat = b"\0" * n
        i = mm.find(pat, lo, hi)  # first fit: reused pages are already mapped on both sides (no faults)
        if i < 0:
            self._drain()  # frees the receiver reported since the last send
            i = mm.find(pat, lo, hi)
        if i < 0:
            raise ArenaFull(
                f"arena {self.region.path.name}: no {n} free pages of {self._page} bytes "
                f"({nbytes} bytes) for a slab; send this request the ordinary way or release requests"
            )
        page = i - lo
        fill = self._fill * (n // 256) + self._fill[: n % 256]
        self.region.pages[page : page + n] = fill
        try:
            self.region.prefault(page, n)  # once per page: no page fault per row later
        except ArenaFull:  # the file system has no room for them (a full /dev/shm): nothing written
            self._free(page, n)
            raise
        return page, n

    def _free(self, page: int, n: int) -> None:
        self.region.pages[page : page + n] = b"\0" * n

    def _drain(self) -> None:
        ring = self.region.ring_b
        while (msg := ring.pop()) is not None:
            try:
                rid, spans = wire.load_free(msg, self._npages)
            except wire.BadFrame as e:
                self.bad_frames += 1
                if self.bad_frames == 1:
                    logger.warning("omni-accum arena %s: dropped a message from the receiver: %s (counted in "
                                   "bad_frames)", self.region.path.name, str(e))
                continue
            for page, n in spans:
                self._free(page, n)
            if rid is not None and rid in self._reqs:
                del self._reqs[rid]  # the receiver dropped it: later sends of it are refused
                self._released.add(rid)
                self._fast.pop(rid, None)

    # ------------------------------------------------------------------ liveness
    def _check_owner(self) -> None:
        q = self.region.q
        if q[W_OWNER_CLOSED] or not self.region.peer_alive():
            self._fail()

    def _fail(self) -> None:
        inflight = sorted(self._reqs) if hasattr(self, "_reqs") else []
        if not getattr(self, "_dead", False):
            self._dead = True
            self.region.unlink()  # the owner is gone: nobody else will remove the file
            if hasattr(self, "_reqs"):
                self._reqs.clear()
        raise PeerDied(f"arena {self.region.path.name}: the receiver is gone; failed requests {inflight}", inflight)

    def _ready(self) -> None:
        """Before a send: fail if the receiver is gone (checked every LIVENESS_EVERY_S), take back the
        pages it released."""
        if self._dead:
            self._fail()
        now = time.monotonic()
        if now - self._last_check >= LIVENESS_EVERY_S:
            self._last_check = now
            self._check_owner()
            self.region.beat()
        if not self.region.ring_b.empty():
            self._drain()

    # ------------------------------------------------------------------ sending
    def send(self, req_id: str, chunk: Mapping[str, Any], *, t0_ns: int = 0) -> None:
        """Publish one chunk of ``req_id``. Raises ArenaFull (nothing published, state unchanged),
        PeerDied (the receiver is gone), ArenaError (no ring space within ``timeout_s``)."""
        fast = self._fast.get(req_id)
        if fast is not None and type(chunk) is dict and self._send_rows(req_id, chunk, fast, t0_ns):
            return
        self._ready()
        if req_id in self._released:
            raise ArenaError(f"request {req_id!r} was released by the receiver")
        slabs = self._reqs.get(req_id)
        fresh = slabs is None
        if fresh:
            slabs = {}
        opens: list[tuple] = []
        rows: list[tuple[str, int]] = []
        values: dict[str, Any] = {}
        new: list[tuple[str, _Slab]] = []  # slabs allocated by this call (undone on failure)
        writes: list[tuple[_Slab, torch.Tensor]] = []
        try:
            for path, v in leaves(chunk):
                if not isinstance(v, torch.Tensor):
                    values[path] = (self.kinds.get(path) == "append", v)
                    continue
                if not v.is_cpu:
                    v = v.cpu()
                if not v.is_contiguous():
                    v = v.contiguous()
                append = self.kinds.get(path, "replace") == "append" and v.dim() > 0
                slab = slabs.get(path) if append else None
                n = int(v.shape[0]) if append else 1
                row_shape = tuple(v.shape[1:]) if append else tuple(v.shape)
                if slab is not None and (slab.dtype != v.dtype or slab.row_shape != row_shape):
                    raise ArenaError(f"{req_id!r} key {path!r}: {v.dtype} {tuple(v.shape)} does not match its slab")
                if slab is None or slab.rows + n > slab.cap_rows:
                    have = slab.rows if slab is not None else 0
                    row_bytes = v.numel() * v.element_size() // max(1, n)
                    cap = 1
                    if append:  # the hint when it holds them, else room for more (at least 64 KiB)
                        hint, need = self.length_hints.get(path, 0), have + n
                        grow = max(slab.cap_rows // 4 if slab is not None else need // 8, 65536 // max(1, row_bytes), 1)
                        cap = hint if hint >= need else need + grow
                    page, npg = self._alloc(max(1, cap * row_bytes))
                    grown = _Slab(page, npg, self._base + page * self._page, cap, row_bytes, v.dtype, row_shape)
                    new.append((path, grown))
                    if slab is not None and have:
                        _memmove(grown.addr, slab.addr, have * row_bytes)  # a move: the rows published so far
                    grown.rows = have
                    opens.append((path, page, npg, cap, dtype_name(v.dtype), row_shape, append))
                    slab = grown
                writes.append((slab, v))
                if append:
                    rows.append((path, slab.rows + n))
        except BaseException:
            for _, s in new:
                self._free(s.page, s.npages)
            raise
        for slab, v in writes:  # the payload first ...
            nb = v.numel() * v.element_size()
            if nb:
                _memmove(slab.addr + slab.rows * slab.row_bytes, v.data_ptr(), nb)
        rix = self._rix.get(req_id)
        if rix is None:
            rix = self._rix[req_id] = self._next_rix
            self._next_rix += 1
        keys = []  # key numbers this descriptor announces
        for path in [*values, *(w[0] for w in opens), *(r[0] for r in rows)]:
            if path not in self._keys and len(self._keys) < 0xFFFF:
                self._keys[path] = len(self._keys)
                keys.append((self._keys[path], path))
        msg = wire.dumps((CHUNK, req_id, t0_ns, opens, rows, values, rix, keys))
        ring = self.region.ring_f
        if not ring.push(msg):  # ... then the descriptor that publishes it (back-pressure: wait)
            if not wait_until(lambda: ring.push(msg), self.timeout_s, self._check_owner):
                for _, s in new:
                    self._free(s.page, s.npages)
                raise ArenaError(f"arena {self.region.path.name}: the receiver took nothing for {self.timeout_s}s")
        for path, s in new:  # the receiver now owns the replaced slabs; it frees them
            slabs[path] = s
        for path, n in rows:
            slabs[path].rows = n
        if fresh:
            self._reqs[req_id] = slabs
        self._fast[req_id] = self._template(chunk, slabs)

    def _template(self, chunk: Mapping[str, Any], slabs: dict[str, _Slab]) -> Any:
        """What the next chunk of the request must look like to take the binary path (None: it cannot): a
        flat chunk, the same keys in the same order, append-kind tensors going into their slabs, small
        values (None, bool, int) otherwise."""
        if type(chunk) is not dict:
            return None
        items = []
        for path, v in chunk.items():
            ix = self._keys.get(path)
            slab = slabs.get(path)
            if ix is None:
                return None
            if isinstance(v, torch.Tensor):
                if slab is None or self.kinds.get(path) != "append":
                    return None
                items.append((ix, slab))
            elif v is None or type(v) in (bool, int):
                items.append((ix, None))
            else:
                return None
        return tuple(chunk), items

    def _send_rows(self, req_id: str, chunk: dict[str, Any], fast: Any, t0_ns: int) -> bool:
        """Send a decode step as one binary descriptor (see ``ROWS_HEAD``) when it fits the request's
        template and its slabs' room; False (nothing done) sends it the general way."""
        keys, items = fast
        if self._dead or tuple(chunk) != keys:
            return False
        now = time.monotonic()
        if now - self._last_check >= LIVENESS_EVERY_S:
            return False  # the general path checks the receiver first
        region = self.region
        if not region.ring_b.empty():
            self._drain()
            if req_id not in self._reqs:
                return False
        body = []
        writes = []
        for (ix, slab), v in zip(items, chunk.values()):
            if slab is None:
                if v is None:
                    body.append(ROWS_ITEM.pack(ix, R_NONE, 0))
                elif type(v) is bool:
                    body.append(ROWS_ITEM.pack(ix, R_BOOL, v))
                elif type(v) is int and -(1 << 63) <= v < 1 << 63:
                    body.append(ROWS_ITEM.pack(ix, R_INT, v))
                else:
                    return False
                continue
            if type(v) is not torch.Tensor or v.dtype != slab.dtype or not v.is_cpu or not v.is_contiguous():
                return False
            shape = v.shape
            if shape == slab.one_row:  # a decode step's one row
                n = 1
            elif shape and shape[1:] == slab.row_shape:
                n = shape[0]
            else:
                return False
            if slab.rows + n > slab.cap_rows:
                return False  # the general path grows the slab
            writes.append((slab, v, n))
            body.append(ROWS_ITEM.pack(ix, R_ROWS, slab.rows + n))
        for slab, v, n in writes:  # the rows first ...
            if n:
                _memmove(slab.addr + slab.rows * slab.row_bytes, v.data_ptr(), n * slab.row_bytes)
        msg = _ROWS + ROWS_HEAD.pack(self._rix[req_id], t0_ns, len(body)) + b"".join(body)
        ring = region.ring_f
        if not ring.push(msg):  # ... then the descriptor that publishes them (back-pressure: wait)
            if not wait_until(lambda: ring.push(msg), self.timeout_s, self._check_owner):
                raise ArenaError(f"arena {region.path.name}: the receiver took nothing for {self.timeout_s}s")
        for slab, _, n in writes:
            slab.rows += n
        return True

    def done(self, req_id: str) -> None:
        """The last chunk of ``req_id`` was sent: the receiver keeps it readable even if this process dies."""
        if self._dead:
            self._fail()
        self._reqs.pop(req_id, None)
        self._released.discard(req_id)
        self._fast.pop(req_id, None)
        self._rix.pop(req_id, None)
        msg = wire.dumps((DONE, req_id))
        ring = self.region.ring_f
        if not ring.push(msg) and not wait_until(lambda: ring.push(msg), self.timeout_s, self._check_owner):
            raise ArenaError(f"arena {self.region.path.name}: the receiver took nothing for {self.timeout_s}s")

    release = done

    def inflight(self) -> list[str]:
        return sorted(self._reqs)

    def close(self) -> None:
        for req_id in list(getattr(self, "_chains", ())):  # the receiver drops their slabs once no view is left
            try:
                self.release_chains(req_id, wait=False)
            except Exception:  # noqa: BLE001, S110 - best effort (the receiver also ends them when it finds us closed)
                pass
        if getattr(self, "_u8", None) is not None:
            self._u8 = None
        self.region.close()


def _checked_kinds(kinds: Mapping[str, str] | None) -> dict[str, str]:
    """``kinds`` as a dict, each kind one of :data:`~omni_accum.strategy.KINDS` (a misspelt one dropped rows)."""
    if kinds is not None and not isinstance(kinds, Mapping):
        raise InvalidArgumentError(f"ArenaSender: kinds must be a mapping of key paths to kinds, got {kinds!r:.80}")
    for path, kind in (kinds or {}).items():
        if kind not in KINDS:
            near = close_matches(kind, KINDS) if isinstance(kind, str) else []
            raise InvalidArgumentError(
                f"ArenaSender: kinds[{path!r}] is {kind!r}; valid kinds: {', '.join(KINDS)}"
                + (f" (did you mean {near[0]!r}?)" if near else "")
            )
    return dict(kinds or {})


def _checked_hints(hints: Mapping[str, int] | None) -> dict[str, int]:
    """``length_hints`` as a dict, each hint an int >= 0 (rows), as ``StreamContext.length_hints``."""
    if hints is not None and not isinstance(hints, Mapping):
        raise InvalidArgumentError(f"ArenaSender: length_hints must be a mapping of paths to rows, got {hints!r:.60}")
    for path, rows in (hints or {}).items():
        if type(rows) is not int or rows < 0:
            raise InvalidArgumentError(f"ArenaSender: length_hints[{path!r}] must be an int >= 0 (rows), got {rows!r}")
    return dict(hints or {})


def _try_attach(name: str) -> Region | None:
    try:
        return Region.attach(name)
    except ArenaError:
        return None
