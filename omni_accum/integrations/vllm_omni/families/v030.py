"""vllm-omni 0.30: the runner accumulation split in two.

* ``_OmniConnectorPayloadTransportMixin._accumulate_payload`` (runner transport, called under
  ``self._lock``): the generic merge, no decode-span rule;
* ``OmniRunnerDataPlane._accumulate_payload`` (MRv2 data plane): the decode-span merge of
  ``embed.decode``; ``merge_tensor_spans`` hands an incoming span over as it is when the held one is empty;
* the full-payload accumulator lives on the transport mixin; ``init_omni_connectors`` moved to
  ``_OmniConnectorRuntimeMixin`` and takes ``synchronous``.

The adapter methods are those of 0.28 (same signatures), and so is the Qwen3-Omni async-chunk
thinker-to-talker stage input processor (``thinker2talker_async_chunk``, a module-level function).
"""

from __future__ import annotations

from omni_accum.integrations.vllm_omni import full_payload, processor, receive, runner, send
from omni_accum.integrations.vllm_omni.families.base import Family, Target, wrap_probe

ADAPTER = "vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter:OmniChunkTransferAdapter"
MIXIN = (
    "vllm_omni.distributed.omni_connectors.model_runner.omni_connector_payload_transport"
    ":_OmniConnectorPayloadTransportMixin"
)
RUNTIME = "vllm_omni.distributed.omni_connectors.model_runner.omni_connector_runtime:_OmniConnectorRuntimeMixin"
DATA_PLANE = "vllm_omni.worker_v2.omni_data_plane:OmniRunnerDataPlane"
RUNNER = "vllm_omni.worker.omni_connector_model_runner_mixin:OmniConnectorModelRunnerMixin"
#: The module of the Qwen3-Omni stage input processors (a bare module: its functions are the targets).
QWEN3_OMNI = "vllm_omni.model_executor.stage_input_processors.qwen3_omni"


def wrap_transport_accumulate(f):
    """The transport mixin: no decode-span rule in 0.30."""
    return runner.wrap_accumulate(f, decode_spans=False)


def wrap_data_plane_accumulate(f):
    """The MRv2 data plane: the decode-span merge."""
    return runner.wrap_accumulate(f, decode_spans=True)


def wrap_transport_init(f):
    """``init_omni_connectors`` while installed: the constructor probe first (a connector extra naming a policy, or
    any extra once a process-wide policy is installed, is checked: ``OMNI_ACCUM_REQUIRED=1`` ends the process on a
    bad one, as for an adapter), then a receiving transport's hello (:func:`.full_payload.wrap_transport_init`)."""
    return full_payload.wrap_transport_init(wrap_probe(f))


def adapter_targets() -> tuple[Target, ...]:
    """The ``OmniChunkTransferAdapter`` methods (the same in 0.28 and 0.30)."""
    return (
        Target(ADAPTER, "__init__", "(self, vllm_config)", wrap_probe),  # a receiving adapter's hello (.peer)
        Target(ADAPTER, "_send_single_request_for_generation", "(self, task, sender_token=None)", send.wrap_send),
        Target(
            ADAPTER,
            "_commit_received_chunk",
            "(self, request, result, *, stage_id, req_id, chunk_id, connector_get_key)",
            receive.wrap_commit,
        ),
        Target(ADAPTER, "_clear_receiver_state_locked", "(self, request_id)", receive.wrap_clear_receiver),
        Target(ADAPTER, "_clear_sender_state_locked", "(self, external_req_id)", send.wrap_clear_sender),
    )


def processor_targets() -> tuple[Target, ...]:
    """The Qwen3-Omni async-chunk thinker-to-talker processor (the same body in 0.28 and 0.30): its prefill
    chunks accumulate under the policy (:mod:`..processor`)."""
    return (
        Target(
            QWEN3_OMNI,
            "thinker2talker_async_chunk",
            "(transfer_manager, multimodal_output, request, is_finished=False)",
            processor.wrap_processor,
        ),
    )


def full_payload_targets(owner: str) -> tuple[Target, ...]:
    """The full-payload accumulator (bodies identical from 0.22 to 0.30; only its class moved)."""
    return (
        Target(
            owner,
            "accumulate_full_payload_output",
            "(self, req_id, pooler_output, request)",
            full_payload.wrap_accumulate_full,
        ),
        Target(owner, "_materialize_full_payload_entry", "(entry)", full_payload.wrap_materialize, static=True),
    )


FAMILY = Family(
    name="0.30",
    versions=("0.30.0",),
    targets=(
        *adapter_targets(),
        Target(MIXIN, "_accumulate_payload", "(self, req_id, payload_data)", wrap_transport_accumulate),
        Target(DATA_PLANE, "_accumulate_payload", "(self, req_id, payload_data)", wrap_data_plane_accumulate),
        *full_payload_targets(MIXIN),
        *processor_targets(),
        # the whole payload's hand-off (kind full, .handoff); a receiving transport's hello (.peer)
        Target(MIXIN, "_send_single_request", "(self, task)", full_payload.wrap_full_send),
        Target(
            MIXIN,
            "_recv_full_payload_result",
            "(self, connector, from_stage, to_stage, connector_get_key, metadata=None)",
            full_payload.wrap_full_recv,
        ),
        Target(
            RUNTIME,
            "init_omni_connectors",
            "(self, model_config, kv_transfer_manager=None, *, synchronous=False)",
            wrap_transport_init,
        ),
    ),
    probes=(
        Target(ADAPTER, "__init__", "(self, vllm_config)", wrap_probe),
        Target(
            RUNTIME,
            "init_omni_connectors",
            "(self, model_config, kv_transfer_manager=None, *, synchronous=False)",
            wrap_probe,
        ),
    ),
    runner_accumulate=MIXIN,
    runner_class=RUNNER,
    span_merge=(DATA_PLANE,),
    data_plane=DATA_PLANE,
    empty_span_takes_incoming=True,
    differences=(
        "runner accumulation split: the transport mixin merges without the decode-span rule (under its lock), "
        "the MRv2 data plane (OmniRunnerDataPlane) merges embed.decode by token span"
    ),
)
