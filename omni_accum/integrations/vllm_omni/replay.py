"""``--through vllm-omni`` for the replay engine: every chunk goes through the real vllm-omni 0.30.0 code.

The receiving side of each arm is a real runner transport (``OmniConnectorModelRunnerMixin``
with a real ``SharedMemoryConnector``); each merge is its ``_accumulate_payload``. For a policy arm
omni-accum is installed and bound to that instance, so the merge runs through the hook (Receiver,
decode spans, release by upstream's own ``cleanup_finished_request``); the ``upstream`` arm runs the
unhooked 0.30.0 method. The sender side of a policy arm encodes as the adapter send hook does
(send_once values left off, the bit mask on the wire). The replay's own wire (inproc, serializer,
shm) carries the payload between the two.

Registering: ``import omni_accum.integrations.vllm_omni.replay`` adds ``"vllm-omni"`` to
:data:`omni_accum.bench.replay.THROUGH`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from omni_accum.context import StreamContext
from omni_accum.errors import OmniAccumError
from omni_accum.bench.replay import THROUGH, UPSTREAM, Arm, Engine, iter_leaves
from omni_accum.integrations.vllm_omni import activation as integration
from omni_accum.integrations.vllm_omni.binding import bind
from omni_accum.integrations.vllm_omni.send import encode_payload
from omni_accum.policy import Policy
from omni_accum.strategy import value_nbytes

THROUGH_NAME = "vllm-omni"


class VllmOmniEngine(Engine):
    """One arm through a real vllm-omni runner transport (and, for a policy, the installed hooks)."""

    def __init__(self, policy: Policy | None, context: StreamContext) -> None:
        from vllm_omni.worker.omni_connector_model_runner_mixin import OmniConnectorModelRunnerMixin

        integration.ensure_patched()  # signature-checked; a policy set by install() stays as it is
        mc = SimpleNamespace(
            stage_id=1,
            worker_type="ar",
            async_chunk=True,
            custom_process_next_stage_input_func=None,
            stage_connector_config={"name": "SharedMemoryConnector", "extra": {}},
        )
        self.runner = type("ReplayRunner", (OmniConnectorModelRunnerMixin,), {})()
        self.runner.init_omni_connectors(mc)
        self.binding = bind(self.runner, policy, context)

    def encode(self, req_id: str, chunk: Mapping[str, Any]) -> Mapping[str, Any]:
        b = self.binding
        if b is None:
            return chunk
        return encode_payload(b, req_id, chunk)  # what the adapter send hook puts on the wire

    def merge(self, req_id: str, wire: Mapping[str, Any]) -> Mapping[str, Any]:
        return self.runner._accumulate_payload(req_id, dict(wire))

    def consume(self, req_id: str, path: str) -> None:
        # As 0.30.0's data plane drops consumed rows from the accumulator; with a binding, the hook re-seeds its
        # Receiver from that dict at the next merge.
        from omni_accum.bench.engines import drop_key

        drop_key(self.runner._send_side_request_payload.get(req_id), path)

    def nbytes(self) -> int:
        if self.binding is not None:
            return self.binding.receiver.nbytes()
        store = self.runner._send_side_request_payload
        return sum(value_nbytes(v) for p in store.values() for _, v in iter_leaves(p))

    def release(self, req_id: str) -> None:
        self.runner.cleanup_finished_request(req_id)  # upstream's release path (pops the accumulator)
        if self.binding is not None:
            self.binding.sender.release(req_id)
            self.binding.sent_once.pop(req_id, None)

    def close(self) -> None:
        self.runner.shutdown_omni_connectors()


def through_vllm_omni(arm: Arm, context: StreamContext) -> Engine:
    """``THROUGH["vllm-omni"]``: a policy arm or ``"upstream"`` through the real transport."""
    if isinstance(arm, Policy):
        return VllmOmniEngine(arm, context)
    if arm == UPSTREAM:
        return VllmOmniEngine(None, context)
    raise OmniAccumError(f"--through {THROUGH_NAME} takes policy arms and {UPSTREAM!r}, got {arm!r}")


THROUGH[THROUGH_NAME] = through_vllm_omni
