"""The receiver's append chains (keyed messages of ``OmniAccumArenaConnector``; see docs/arena.md,
"Append chains"): each chain's slab mapped as a tensor over the shared pages, its rows handed out as
tagged views, its pages given back once no tensor over them is left. A mixin of
:class:`.receiver.ArenaReceiver` (whose attributes and ``_take`` / ``_post_free`` it uses).
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

    def _open_chains(self, opens: Any) -> None:
        for rid, path, no, page, npg, cap, dt, row_shape in opens:
            dtype = DTYPES[dt]
            off = self._data_off + page * self._page
            mv = memoryview(self.region.mm)[off : off + cap * row_bytes(dtype, row_shape)]
            base = torch.frombuffer(mv, dtype=dtype).view(cap, *row_shape)
            # the pages go back once the last tensor over them is freed (whichever thread frees it)
            weakref.finalize(mv, self._dead_slabs.append, (page, npg))
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

    def reap(self) -> int:
        """Give back the pages of chain slabs no tensor shows any more; how many slabs."""
        dead = self._dead_slabs
        if not dead:
            return 0
        spans = []
        while dead:
            page, npg = dead.popleft()
            if self._live_slabs.pop(page, None) is not None:
                spans.append((page, npg))
        if spans and not self.region.mm.closed:
            self._post_free(None, spans)
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
