"""Engines of the replay engine: how an arm accumulates (its sender and receiver for a set of requests).

An arm runs as an :class:`Engine` (``encode``/``merge``/``release``/``nbytes``): :class:`PolicyEngine`
wraps omni-accum's Sender/Receiver, :class:`UpstreamEngine` runs vllm-omni 0.30.0's own
``_OmniConnectorPayloadTransportMixin._accumulate_payload``, :class:`WireFloorEngine` does not
accumulate at all. An arm may also be any callable ``(StreamContext) -> Engine``. :data:`THROUGH`
maps ``through`` modes to engine factories (``direct`` here; integrations register more).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any, Union

from omni_accum.bench.wires import _get, iter_leaves
from omni_accum.context import StreamContext
from omni_accum.engine import Receiver, Sender
from omni_accum.engine.endpoint import _iter_slots
from omni_accum.errors import OmniAccumError
from omni_accum.integrations.vllm_omni.classes import transport_mixin
from omni_accum.manager import RESERVED_NAMES
from omni_accum.policy.model import Policy
from omni_accum.strategy import value_nbytes

UPSTREAM, WIRE_FLOOR = RESERVED_NAMES  # arms of every bench: no strategy may take their names


# ---------------------------------------------------------------------------------------------- #
# Engines (how an arm accumulates)
# ---------------------------------------------------------------------------------------------- #


class Engine(ABC):
    """One arm's sender and receiver for a set of requests."""

    @abstractmethod
    def encode(self, req_id: str, chunk: Mapping[str, Any]) -> Mapping[str, Any]:
        """What the sender puts on the wire for ``chunk``."""

    @abstractmethod
    def merge(self, req_id: str, wire: Mapping[str, Any]) -> Mapping[str, Any]:
        """Merge a received wire payload; return the consumer's view."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held by accumulation state, all requests together."""

    @abstractmethod
    def release(self, req_id: str) -> None:
        """Drop the state of ``req_id`` on both sides."""

    def hop_value(self, req_id: str, path: str, read: Any) -> Any:
        """What a view hop ships for key ``path`` whose consumer read ``read`` (default: the read)."""
        return read

    def consume(self, req_id: str, path: str) -> None:  # noqa: B027 - optional
        """The consumer took key ``path`` (read ``delta``): drop what the receiver holds of it (default:
        nothing, for an engine whose views are not accumulated)."""

    def key_nbytes(self) -> dict[str, int]:
        """Bytes held per key path, all requests together (may be empty when not cheap)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional
        """Release resources."""


class PolicyEngine(Engine):
    """omni-accum's :class:`Sender` and :class:`Receiver` under one policy."""

    def __init__(self, policy: Policy, context: StreamContext) -> None:
        self.tx = Sender(policy, context=context)
        self.rx = Receiver(policy, context=context)

    def encode(self, req_id: str, chunk: Mapping[str, Any]) -> Mapping[str, Any]:
        return self.tx.encode(req_id, chunk)

    def merge(self, req_id: str, wire: Mapping[str, Any]) -> Mapping[str, Any]:
        return self.rx.merge(req_id, wire)

    def nbytes(self) -> int:
        return self.rx.nbytes()

    def key_nbytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for rid in self.rx.request_ids():
            for slot in _iter_slots(self.rx._requests[rid].entries):
                out[slot.path] = out.get(slot.path, 0) + slot.acc.nbytes()
        return out

    def consume(self, req_id: str, path: str) -> None:
        # The key's slot goes; its next chunk starts a new one (as the live integration re-seeds the Receiver
        # from upstream's dict after 0.30.0's data plane popped consumed rows).
        st = self.rx._requests.get(req_id)
        if st is not None:
            top, _, qual = path.partition(".")
            group = st.entries.get(top)
            if qual and isinstance(group, dict):
                group.pop(qual, None)
            elif not qual:
                st.entries.pop(top, None)

    def hop_value(self, req_id: str, path: str, read: Any) -> Any:
        # A strategy keeping per-chunk parts (token_list) ships its parts, as pre-0.30 releases shipped the list.
        parts = _get(self.rx.parts(req_id), path)
        return parts if isinstance(parts, list) and len(parts) > 1 else read

    def release(self, req_id: str) -> None:
        self.tx.release(req_id)
        self.rx.release(req_id)


class WireFloorEngine(Engine):
    """The floor of a step: no accumulation at all; the consumer sees the chunk just received.

    Its step cost is one delta's trip over the wire (and view hop), measured in the same run as
    the other arms. Its views are not accumulated, so they are not checked.
    """

    checks_views = False

    def __init__(self, context: StreamContext | None = None) -> None:
        pass

    def encode(self, req_id: str, chunk: Mapping[str, Any]) -> Mapping[str, Any]:
        return chunk

    def merge(self, req_id: str, wire: Mapping[str, Any]) -> Mapping[str, Any]:
        return wire

    def nbytes(self) -> int:
        return 0

    def release(self, req_id: str) -> None:
        pass


class UpstreamEngine(Engine):
    """The installed vllm-omni release's own runner merge, called unbound (``_accumulate_payload`` of
    :func:`~omni_accum.integrations.vllm_omni.classes.transport_mixin`: 0.30.0's
    ``_OmniConnectorPayloadTransportMixin``, 0.28's ``OmniConnectorModelRunnerMixin``, 0.16's chunk adapter).

    The sender is the identity (upstream sends every key of every chunk).
    """

    def __init__(self, context: StreamContext | None = None) -> None:
        mixin = transport_mixin()
        self._fn = mixin._accumulate_payload
        self._state = SimpleNamespace(_send_side_request_payload={})

    def encode(self, req_id: str, chunk: Mapping[str, Any]) -> Mapping[str, Any]:
        return chunk

    def merge(self, req_id: str, wire: Mapping[str, Any]) -> Mapping[str, Any]:
        return self._fn(self._state, req_id, wire)

    def nbytes(self) -> int:
        return sum(value_nbytes(v) for p in self._state._send_side_request_payload.values() for _, v in iter_leaves(p))

    def key_nbytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self._state._send_side_request_payload.values():
            for path, v in iter_leaves(p):
                out[path] = out.get(path, 0) + value_nbytes(v)
        return out

    def consume(self, req_id: str, path: str) -> None:
        # As 0.30.0's data plane (``pop_local_stage_payload``) drops consumed rows; the group is copied, not
        # changed in place: upstream's first merge stores the wire's own dicts, which a replay shares.
        drop_key(self._state._send_side_request_payload.get(req_id), path)

    def release(self, req_id: str) -> None:
        self._state._send_side_request_payload.pop(req_id, None)


def drop_key(payload: Any, path: str) -> None:
    """Remove key ``path`` from an accumulated upstream payload dict, copying its group (never in place)."""
    if not isinstance(payload, dict):
        return
    top, _, qual = path.partition(".")
    if not qual:
        payload.pop(top, None)
    elif isinstance(payload.get(top), dict) and qual in payload[top]:
        payload[top] = {k: v for k, v in payload[top].items() if k != qual}


#: An arm as :func:`measure` takes it: a policy, ``"upstream"``, or an engine factory.
Arm = Union[Policy, str, Callable[[StreamContext], Engine]]

#: ``through`` modes of :func:`measure`: a function turning an arm and a context into an engine.
#: ``direct`` calls omni-accum (or upstream) in this process; other modes (``vllm-omni``, through
#: the real adapter) register here.
THROUGH: dict[str, Callable[[Arm, StreamContext], Engine]] = {}


def _direct(arm: Arm, context: StreamContext) -> Engine:
    if isinstance(arm, Policy):
        return PolicyEngine(arm, context)
    if arm == UPSTREAM:
        return UpstreamEngine(context)
    if arm == WIRE_FLOOR:
        return WireFloorEngine(context)
    if callable(arm):
        return arm(context)
    raise OmniAccumError(f"an arm must be a Policy, {UPSTREAM!r} or an engine factory, got {arm!r}")


THROUGH["direct"] = _direct


def make_engine(arm: Arm, context: StreamContext, through: str = "direct") -> Engine:
    factory = THROUGH.get(through)
    if factory is None:
        raise OmniAccumError(f"unknown --through mode {through!r}. Available: {', '.join(THROUGH)}")
    return factory(arm, context)
