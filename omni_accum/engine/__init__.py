"""The engine: :class:`Sender` and :class:`Receiver`, per-request, per-key strategy state.

``Sender.encode`` turns a payload chunk into what goes on the wire (strategies with an encoder,
such as ``send_once``, may leave keys off). ``Receiver.merge`` merges a wire chunk into the
request's state and returns the consumer's view: a read-only :class:`RequestView` mapping with
the payload's own nesting, whose leaves are read from the strategies lazily (a ``token_list`` key
is only concatenated when the consumer reads it).

Payloads are vllm-omni's: a mapping whose values are leaves (tensors, lists, scalars) or groups
(a dict of leaves: ``{"embed": {"decode": t}}``, key path ``embed.decode``). Deeper dicts are leaf
values, as in vllm-omni 0.30.0. Merging follows 0.30.0's ``_accumulate_payload``: keys a chunk
lists in ``meta.override_keys`` are replaced for that chunk; keys absent from a chunk keep their
value.

Thread safety: one lock per request and one for the request table, so one thread may merge or
release some requests while others merge other requests. One request must not be merged by two
threads at once (vllm-omni never does).

Ordering: without a sequence number chunks are merged in the order ``merge`` is called (as
upstream does: a duplicated chunk is merged twice, a lost one is never noticed). With the opt-in
``seq`` argument (0, 1, 2, ... per request) the receiver drops duplicates, buffers chunks that
arrive early in a bounded reorder window and reports gaps (:meth:`Receiver.merge`,
:meth:`Receiver.finish`). The wire itself is unchanged. See ``docs/reliability.md``.

Modules: :mod:`~omni_accum.engine.endpoint` (what both ends share), :mod:`~omni_accum.engine.sender`,
:mod:`~omni_accum.engine.receiver`, :mod:`~omni_accum.engine.views` (the consumer's view) and
:mod:`~omni_accum.engine.sequencing` (``seq=``). This package was ``omni_accum.channel``.
"""

from __future__ import annotations

from omni_accum.engine.endpoint import WIRE_MARKER
from omni_accum.engine.receiver import Receiver
from omni_accum.engine.sender import Sender
from omni_accum.engine.sequencing import REORDER_WINDOW, SequenceState
from omni_accum.engine.views import GroupView, RequestView

# The package's public names; the modules' own (``endpoint._Slot``, ``endpoint.rewrites_wire``) are imported from them.
__all__ = ["REORDER_WINDOW", "WIRE_MARKER", "GroupView", "Receiver", "RequestView", "Sender", "SequenceState"]
