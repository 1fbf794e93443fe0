"""The receiver's tensors over the shared pages (keyed messages of ``OmniAccumArenaConnector``; see
docs/arena.md, "Append chains" and "Zero-copy receive"): each append chain's slab mapped as a tensor, its
rows handed out as tagged views; a message's large tensors handed out as tensors over their own pages.
Either way the pages go back to the sender once no tensor over them is left (a finalizer on the buffer
the tensors share). A mixin of :class:`.receiver.ArenaReceiver` (whose attributes and ``_take`` /
``_post_free`` it uses).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from omni_accum.arena._common import ARENA_TAG, DTYPES, row_bytes
from omni_accum.arena.region import W_SENDER_GEN, ArenaError

#: lineage tokens of append chains, unique in this process (a chain moved to a larger slab keeps its
#: token): what an ARENA_TAG names, so that no accumulator takes another receiver's or sender's rows
_TOKENS = itertools.count(1)


def _died(dead: Any, hooks: list, span: tuple[int, int]) -> None:
    """A finalizer: the last tensor over ``span`` was freed (in whichever thread, at any point of its code)."""
    dead.append(span)
    for hook in hooks:
        try:
            hook()
        except Exception:  # noqa: BLE001, S110 - a finalizer must not raise; the next take reaps
            pass


class ChainViews:
    """Append chains on the receiving side (see the module docstring)."""

    def chain_rows(self, chains: dict[int, tuple[int, torch.Tensor]], no: int, start: int, rows: int) -> torch.Tensor:
        """Rows ``start:start + rows`` of append chain ``no`` (see :meth:`.sender.ArenaSender.append_rows`),
        in the slabs a taken message names (``chains``, from :meth:`take`): a view over the shared pages,
        no copy, tagged with :data:`~._common.ARENA_TAG` (the chain's rows up to them as one view). The
        pages stay the chain's while any tensor over them lives."""
        hit = chains.get(no)
        if hit is None:
            raise ArenaError(f"arena {self.region.path.name}: a message names append chain {no}, never opened")
        token, base = hit
        end = start + rows
        if end > base.shape[0]:
            raise ArenaError(f"arena {self.region.path.name}: rows {start}:{end} of chain {no} are past its slab")
        t = base[start:end]
        setattr(t, ARENA_TAG, (token, start, base[:end]))
        self.chain_views += 1
        return t

    def tensor_view(
        self, page: int, npages: int, dtype: torch.dtype, shape: list[int] | tuple[int, ...]
    ) -> torch.Tensor:
        """The tensor a taken keyed message holds at ``page`` (``npages`` pages, one of its spans), as a
        tensor over the shared pages: no copy. The pages are this tensor's alone until no tensor over
        them is left (views and slices of it included); then :meth:`reap` gives them back to the sender.
        The caller leaves ``(page, npages)`` out of the spans it frees."""
        numel = 1
        for d in shape:
            numel *= d
        self._in_data(page, numel * dtype.itemsize)  # (a message names it: checked)
        off = self._data_off + page * self._page
        mv = memoryview(self.region.mm)[off : off + numel * dtype.itemsize]
        t = torch.frombuffer(mv, dtype=dtype).view(tuple(shape))
        weakref.finalize(mv, _died, self._dead_slabs, self.on_dead, (page, npages))
        del mv
        self._live_slabs[page] = npages
        self.tensor_views += 1
        return t

    def view_bytes(self) -> int:
        """Bytes of the pages that chains and tensor views hold (some tensor may still show them)."""
        return sum(list(self._live_slabs.values())) * self._page

    def _open_chains(self, opens: Any) -> None:
        for rid, path, no, page, npg, cap, dt, row_shape in opens:
            dtype = DTYPES[dt]
            off = self._data_off + page * self._page
            mv = memoryview(self.region.mm)[off : off + cap * row_bytes(dtype, row_shape)]
            base = torch.frombuffer(mv, dtype=dtype).view(cap, *row_shape)
            # the pages go back once the last tensor over them is freed (whichever thread frees it)
            weakref.finalize(mv, _died, self._dead_slabs, self.on_dead, (page, npg))
            del mv
            self._live_slabs[page] = npg
            moved = self._chains.get(no)
            self._chains[no] = (moved[0] if moved is not None else next(_TOKENS), base)
            paths = self._chains_of.setdefault(rid, {})
            old = paths.get(path)
            if old is not None and old != no:
                self._chains.pop(old, None)
            paths[path] = no

    def _end_chains(self, rid: str) -> None:
        for no in self._chains_of.pop(rid, {}).values():
            self._chains.pop(no, None)

    def reap(self, *, wait: bool = True) -> int:
        """Give back the pages of chain slabs and message tensors (:meth:`tensor_view`) no tensor shows any
        more; how many spans. Taking messages (:meth:`take`) reaps first, and so may an :attr:`on_dead`
        hook. ``wait=False``: never wait for room on ring B (what does not fit stays for the next reap)."""
        dead = self._dead_slabs
        if not dead or self.region.closed:
            return 0
        live = self._live_slabs
        spans = []
        while dead:
            span = dead.popleft()
            if span[0] in live:
                spans.append(span)
        if spans and not self._post_free(None, spans, wait=wait):
            dead.extend(spans)  # ring B is full: a later reap sends them
            return 0
        for page, _ in spans:
            live.pop(page, None)
        return len(spans)

    def _new_sender(self, pid: int) -> None:
        """The sender changed (it closed, or another attached): the chains of the one before end. Every
        message published so far is taken off the ring first (each keeps the slabs it shows); chains
        are numbered by sender generation, so a new sender's stay."""
        self._sender_pid = pid
        if self._chains:
            self._pump()
            gen = self.region.q[W_SENDER_GEN] if pid else -1
            for no in [n for n in self._chains if n >> 40 != gen]:
                del self._chains[no]
            for rid, paths in list(self._chains_of.items()):
                for path in [p for p, no in paths.items() if no not in self._chains]:
                    del paths[path]
                if not paths:
                    del self._chains_of[rid]
