"""Opt-in sequence numbers on the receiver: duplicates dropped, a bounded reorder window, gaps named.

Without ``seq`` chunks merge in the order given, as upstream vllm-omni does. With it (0, 1, 2, ...
per request) :class:`omni_accum.engine.receiver.Receiver` drops duplicates, buffers early chunks and
reports gaps. See ``docs/reliability.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from omni_accum.engine.endpoint import _Request
from omni_accum.errors import AccumulationError
from omni_accum.engine.views import RequestView, request_view

#: Default number of chunks a receiver buffers per request while it waits for a missing ``seq``.
REORDER_WINDOW = 16


@dataclass(frozen=True)
class SequenceState:
    """Where a sequenced request stands on the receiver (see :meth:`Receiver.sequence`).

    Attributes:
        next_seq: the sequence number the receiver merges next.
        buffered: sequence numbers that arrived early and wait in the reorder window, ascending.
        missing: sequence numbers below the highest buffered one that have not arrived (a gap).
        duplicates: duplicated chunks dropped for this request.
    """

    next_seq: int
    buffered: tuple[int, ...]
    missing: tuple[int, ...]
    duplicates: int


class SequencedMerge:
    """The receiver's sequencing methods (mixed into :class:`~omni_accum.engine.receiver.Receiver`)."""

    reorder_window: int
    _dups: int

    def _merge_sequenced(self, req_id: str, st: _Request, wire: Mapping[str, Any], seq: int) -> None:
        if type(seq) is not int or seq < 0:
            raise AccumulationError(f"seq must be an int >= 0, got {seq!r}", request_id=req_id)
        nxt = st.next_seq
        if nxt is None:
            if st.entries:
                raise AccumulationError(
                    f"chunk with seq {seq}, but earlier chunks of this request carried none; "
                    "number every chunk of a request, or none",
                    request_id=req_id,
                    seq=seq,
                )
            nxt = st.next_seq = 0
        if seq < nxt or seq in st.pending:
            st.dups += 1
            with self._lock:
                self._dups += 1
            return
        if seq > nxt:
            if seq - nxt > self.reorder_window:
                missing = _missing(nxt, seq, st.pending)
                raise AccumulationError(
                    f"chunk arrived {seq - nxt} ahead of the next expected seq {nxt}, beyond reorder_window="
                    f"{self.reorder_window}: still missing {_fmt_seqs(missing, seq - nxt - len(st.pending))}; "
                    "chunk rejected (state unchanged). Re-send the missing chunks, or release the request",
                    request_id=req_id,
                    seq=seq,
                    missing=missing,
                )
            st.pending[seq] = _held(wire)  # a copy: the sender may reuse its tensors once it has sent them
            return
        try:
            self._apply(req_id, st, self._plan(req_id, st, wire))
        except AccumulationError:
            self._fail_if_sender_diverged(st, wire)
            raise
        st.next_seq = nxt = seq + 1
        while st.pending and nxt in st.pending:
            w = st.pending.pop(nxt)
            try:
                self._apply(req_id, st, self._plan(req_id, st, w))
            except AccumulationError as e:
                self._fail_if_sender_diverged(st, w)
                raise AccumulationError(
                    f"buffered chunk rejected after seq {seq} filled the gap: {e.reason}; it was dropped: re-send it",
                    request_id=req_id,
                    key=e.key,
                    strategy=e.strategy,
                    plugin=e.plugin,
                    seq=nxt,
                ) from e
            st.next_seq = nxt = nxt + 1

    def finish(self, req_id: str, *, chunks: int | None = None) -> RequestView:
        """The final view of ``req_id``, after checking that no chunk is missing.

        Raises :class:`AccumulationError` (with ``missing``) when sequenced chunks wait in the reorder
        window behind a gap, or when ``chunks`` (the number the sender sent; needs ``seq``) is not the
        number merged; also when the request holds no state (never merged, or released) or failed.
        Does not release the request.
        """
        if chunks is not None and (type(chunks) is not int or chunks < 0):
            raise AccumulationError(f"finish: chunks must be an int >= 0 or None, got {chunks!r}", request_id=req_id)
        st = self._table_get(req_id)
        if st is None:
            missing = tuple(range(min(chunks or 0, 100)))
            raise AccumulationError(
                "finish: no chunk of this request was merged (never sent, or released)",
                request_id=req_id,
                missing=missing,
            )
        with st.lock:
            if st.failed is not None:
                raise AccumulationError(f"request failed earlier ({st.failed}); release it", request_id=req_id)
            nxt = st.next_seq
            if chunks is not None and nxt is None:
                raise AccumulationError(
                    "finish(chunks=...) needs chunks merged with seq; this request's carried none", request_id=req_id
                )
            if st.pending:
                last = max(st.pending)
                missing = _missing(nxt or 0, last, st.pending)
                raise AccumulationError(
                    f"finish with a gap: seqs {_fmt_seqs(tuple(sorted(st.pending)), len(st.pending))} wait for "
                    f"missing {_fmt_seqs(missing, last - (nxt or 0) - len(st.pending) + 1)}",
                    request_id=req_id,
                    missing=missing,
                )
            if chunks is not None and nxt != chunks:
                if nxt is not None and nxt < chunks:
                    missing = tuple(range(nxt, min(chunks, nxt + 100)))
                    raise AccumulationError(
                        f"finish: the sender sent {chunks} chunks but only seqs 0..{nxt - 1} arrived; missing "
                        f"{_fmt_seqs(missing, chunks - nxt)}",
                        request_id=req_id,
                        missing=missing,
                    )
                raise AccumulationError(f"finish: expected {chunks} chunks, merged {nxt}", request_id=req_id)
        return request_view(st)

    def sequence(self, req_id: str) -> SequenceState | None:
        """Where sequenced request ``req_id`` stands, or None (unknown, or merged without ``seq``)."""
        st = self._table_get(req_id)
        if st is None or st.next_seq is None:
            return None
        with st.lock:
            nxt, pending = st.next_seq, dict(st.pending)
            last = max(pending) if pending else nxt
            return SequenceState(nxt, tuple(sorted(pending)), _missing(nxt, last, pending), st.dups)

    @property
    def duplicates_dropped(self) -> int:
        """Duplicated sequenced chunks dropped, all requests together (released ones included)."""
        return self._dups


def _held(wire: Mapping[str, Any]) -> dict[str, Any]:
    """A chunk as it is now, for the reorder window: its tensors cloned, its dicts, lists and tuples copied (each
    as its own kind), any other value as it is. A chunk merged at once is not copied (upstream merges it so)."""
    return {k: _copied(v) for k, v in wire.items()}


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):  # a group (a dict subclass is one too): a plain dict of its values
        return {k: _copied(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_copied(v) for v in value)
    return value


def _missing(nxt: int, upto: int, pending: Mapping[int, Any]) -> tuple[int, ...]:
    """Seqs in ``[nxt, upto)`` not buffered in ``pending``: the first 100 at most."""
    out: list[int] = []
    s = nxt
    while s < upto and len(out) < 100:
        if s not in pending:
            out.append(s)
        s += 1
    return tuple(out)


def _fmt_seqs(seqs: tuple[int, ...], total: int) -> str:
    """``3, 4, 7`` (and how many more when the list was cut)."""
    text = ", ".join(map(str, seqs[:20]))
    more = total - min(len(seqs), 20)
    return f"{text} (and {more} more)" if more > 0 else text
