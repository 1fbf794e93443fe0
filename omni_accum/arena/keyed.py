"""The sender's keyed messages (what ``OmniAccumArenaConnector`` puts): tensors written into fresh pages,
and the rows of append keys into the request's *append chains*, one slab per request and key that the
receiver hands out as views (see docs/arena.md, "Append chains"). A mixin of :class:`.sender.ArenaSender`.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from omni_accum.arena import wire
from omni_accum.arena._common import CHAINS_DONE, dtype_name, row_bytes, wait_until
from omni_accum.arena.region import ArenaError, ArenaFull

_memmove = ctypes.memmove


class _Chain:
    """A request's append key in keyed messages: its rows so far in one slab (moved to a larger one when full)."""

    __slots__ = ("no", "page", "npages", "addr", "cap", "rows", "row_bytes", "dtype", "row_shape", "staged")

    def __init__(self, no: int, dtype: Any, row_shape: tuple, row_bytes: int) -> None:
        self.no, self.dtype, self.row_shape, self.row_bytes = no, dtype, row_shape, row_bytes
        self.page = self.npages = self.addr = self.cap = self.rows = 0
        self.staged = False  # a slab :meth:`KeyedMessages.stage` opened here that no message announced yet


#: requests whose append chains a sender keeps at most (the oldest end first; their receivers are told)
CHAINS_KEPT = 16384
#: requests ended here that a sender remembers (a later put of one goes without chains)
ENDED_KEPT = 65536


class KeyedMessages:
    """Keyed messages and append chains; the attributes and page methods are :class:`.sender.ArenaSender`'s."""

    def reclaim(self) -> None:
        """Take back the pages the receiver gave back since (before a message's tensors are written: freed
        pages are reused first, already mapped on both sides, rather than fresh ones)."""
        if not self._dead and not self.region.ring_b.empty():
            self._drain()

    def write_tensor(self, t: torch.Tensor) -> tuple[int, int]:
        """Copy a contiguous CPU tensor into fresh pages; ``(page, npages)``. Raises ArenaFull (nothing
        written). The pages belong to the message :meth:`publish` sends (or go back with :meth:`free`)."""
        nb = t.numel() * t.element_size()
        page, n = self._alloc(nb)
        _memmove(self._base + page * self._page, t.data_ptr(), nb)
        return page, n

    def stage(self, req_id: str, path: str, dtype: torch.dtype, row_shape: tuple, cap: int) -> torch.Tensor:
        """A tensor of ``cap`` rows over a new slab of the request's chain of key ``path``, which no message
        announced yet: rows the caller writes into it (the stage input processor, while the thinker still
        computes) go out with no copy when a later put appends a tensor that starts at the slab's first row
        (:meth:`append_rows` sees its address). The chain must hold no rows yet. The slab is announced by the
        first put that appends to it, moved to a larger one like any slab if the rows outgrow it, and its
        pages go back here if no put announced it before :meth:`release_chains` or :meth:`drop_chains`.
        Raises ArenaFull (nothing taken), ArenaError (the chain already holds rows)."""
        self.reclaim()  # pages the receiver gave back first: already mapped and given, not fresh ones
        chains = self._chains.get(req_id)
        if chains is None:
            if len(self._chains) >= CHAINS_KEPT:
                self.release_chains(next(iter(self._chains)))
            chains = self._chains[req_id] = {}
        c = chains.get(path)
        if c is not None and (c.rows or c.staged):
            raise ArenaError(f"request {req_id!r} key {path!r}: its chain already holds rows")
        row_shape = tuple(row_shape)
        c = _Chain(self._next_chain, dtype, row_shape, row_bytes(dtype, row_shape))
        cap = max(1, int(cap))
        page, npg = self._alloc(cap * c.row_bytes)
        chains[path] = c
        self._next_chain += 1
        c.page, c.npages, c.addr, c.cap, c.staged = page, npg, self._base + page * self._page, cap, True
        off = self.region.data_off + page * self._page
        return self._u8[off : off + cap * c.row_bytes].view(dtype).view(cap, *row_shape)

    def _free_staged(self, chains: Any) -> None:
        for c in chains.values():
            if c.staged:
                self._free(c.page, c.npages)
                c.staged = False
                c.page = c.npages = c.addr = c.cap = 0

    def append_rows(
        self, req_id: str, path: str, t: torch.Tensor, opens: list[tuple[Any, ...]], taken: list[tuple[int, int]]
    ) -> tuple[int, int, int]:
        """Write the rows of ``t`` (contiguous, on the CPU, at least one dimension) behind the rows the
        request's chain of key ``path`` holds, with one copy; ``(chain number, first row, rows)``.

        The chain's slab is opened (or, when full, moved to one twice as large) as needed: its
        opening is appended to ``opens`` (the receiver maps it when the message arrives), its pages to
        ``taken`` (give them back with :meth:`free` if the message is not published). A key whose
        dtype or row shape changes starts a new chain. The pages of a chain's slabs are never reused
        before the receiver gives them back, which it does once no view of them is left. Raises
        ArenaFull (the chains of ``req_id`` are then dropped: see :meth:`drop_chains`)."""
        chains = self._chains.get(req_id)
        if chains is None:
            if len(self._chains) >= CHAINS_KEPT:
                self.release_chains(next(iter(self._chains)))
            chains = self._chains[req_id] = {}
        n = t.shape[0]
        row_shape = tuple(t.shape[1:])
        c = chains.get(path)
        unannounced = None  # a staged slab these rows do not go into: its pages go back once the rows are written
        if c is None or c.dtype is not t.dtype or c.row_shape != row_shape:
            if c is not None and c.staged:
                unannounced = (c.page, c.npages)
            c = chains[path] = _Chain(self._next_chain, t.dtype, row_shape, row_bytes(t.dtype, row_shape))
            self._next_chain += 1
        start = c.rows
        need = start + n
        if need > c.cap:
            cap = max(need + max(64, need // 4), 2 * c.cap)
            try:
                page, npg = self._alloc(cap * c.row_bytes)
            except ArenaFull:
                self.drop_chains(req_id)
                raise
            taken.append((page, npg))
            addr = self._base + page * self._page
            if start:
                _memmove(addr, c.addr, start * c.row_bytes)  # the old slab stays the receiver's until it frees it
            if c.staged:
                unannounced, c.staged = (c.page, c.npages), False
            c.page, c.npages, c.addr, c.cap = page, npg, addr, cap
            opens.append((req_id, path, c.no, page, npg, cap, dtype_name(c.dtype), row_shape))
        elif c.staged:  # this message announces the slab stage() opened
            c.staged = False
            taken.append((c.page, c.npages))
            opens.append((req_id, path, c.no, c.page, c.npages, c.cap, dtype_name(c.dtype), row_shape))
        dst = c.addr + start * c.row_bytes
        if t.data_ptr() != dst:
            _memmove(dst, t.data_ptr(), n * c.row_bytes)
        else:  # the rows were written in place (stage()): nothing to copy
            self.rows_in_place += n
        if unannounced is not None:
            self._free(*unannounced)
        c.rows = need
        return c.no, start, n

    def drop_chains(self, req_id: str) -> None:
        """Forget the chains of ``req_id`` here (after a message of it was not published: the receiver
        holds other rows than they say); its next rows start new chains. The request's end is still
        sent (:meth:`release_chains`): the receiver drops the chains it has of it then."""
        if req_id in self._chains:
            self._free_staged(self._chains[req_id])
            self._chains[req_id] = {}

    def ended(self, req_id: str) -> bool:
        """Whether ``req_id``'s chains were ended here (a later put of it must not start chains: none would end)."""
        return req_id in self._ended

    def release_chains(self, req_id: str, *, wait: bool = True) -> bool:
        """The request is over on this side: the receiver drops its chains' slabs once no view of them is
        left. ``wait=False``: never wait for ring space; False when the ring was full (call again later)."""
        self._ended[req_id] = None
        if len(self._ended) > ENDED_KEPT:
            del self._ended[next(iter(self._ended))]
        chains = self._chains.get(req_id)
        if chains is not None and not self._dead:
            self._free_staged(chains)  # slabs no message announced: the receiver never saw them
        if req_id not in self._chains or self._dead:
            self._chains.pop(req_id, None)
            return True
        msg = wire.dumps((CHAINS_DONE, req_id))
        ring = self.region.ring_f
        if not ring.push(msg):
            if not wait:
                return False
            if not wait_until(lambda: ring.push(msg), self.timeout_s, self._check_owner):
                raise ArenaError(f"arena {self.region.path.name}: the receiver took nothing for {self.timeout_s}s")
        del self._chains[req_id]
        return True

    def free(self, spans: list[tuple[int, int]]) -> None:
        """Give back pages :meth:`write_tensor` took for a message that is not published."""
        for page, n in spans:
            self._free(page, n)

    def publish(
        self,
        key: str,
        body: bytes,
        spans: list[tuple[int, int]],
        opens: list[tuple[Any, ...]] | None = None,
        chains: list[int] | None = None,
    ) -> None:
        """Push the keyed message ``key`` (``body``, the pages its tensors are in, the chain slabs it
        opens and the chains whose rows it names: see :meth:`append_rows`) after the tensors were
        written. Raises PeerDied, ArenaError (over the ring's limit, or no ring space within
        ``timeout_s``); the caller then frees ``spans`` and the opened slabs' pages."""
        self._ready()
        msg = wire.dump_msg(key, body, spans, opens or (), chains or ())
        ring = self.region.ring_f
        if len(msg) > ring.max_message():
            raise ArenaError(
                f"arena {self.region.path.name}: the message {key!r} is {len(msg)} bytes, over the ring's limit "
                f"of {ring.max_message()} (raise ring_bytes)"
            )
        if not ring.push(msg) and not wait_until(lambda: ring.push(msg), self.timeout_s, self._check_owner):
            raise ArenaError(f"arena {self.region.path.name}: the receiver took nothing for {self.timeout_s}s")
