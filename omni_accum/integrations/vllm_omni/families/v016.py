"""vllm-omni 0.16: the receiving adapter accumulates the whole payload.

* ``OmniChunkTransferAdapter._update_request_payload(self, req_id, payload_data)``
  (``distributed/omni_connectors/transfer_adapter/chunk_transfer_adapter.py``) is the only accumulation:
  called by the adapter's receive thread for every chunk of an AR stage, it ``torch.cat``-s each tensor
  key with what it held and joins lists (``finished`` and other values replaced, keys the chunk lacks
  dropped); the payload keys are flat (``thinker_embeddings``, ``thinker_hidden_states``,
  ``tts_bos_embed`` ..., ``finished``; no ``override_keys``). Wrapped by :mod:`..whole_payload`.
* ``OmniChunkTransferAdapter.cleanup(self, request_id, external_req_id=None)`` frees a request's state
  (its ``request_payload`` entry, keyed by the external id): the Receiver is released there.
* no runner transport, no MRv2 data plane, no full-payload accumulator: the scheduler hands the
  accumulated dict to the runner as ``additional_information``.
* the send side (``_send_single_request(self, task)``) is left alone: 0.16.0's Qwen3-Omni
  thinker-to-talker processor sends the per-request statics (``tts_*_embed``, ``thinker_input_ids``,
  ``thinker_sequences``, the prompt's ``thinker_hidden_states``) in the first chunk only, and a decode
  chunk carries ``thinker_embeddings`` (one row) and ``finished``: there is nothing to leave off.
"""

from __future__ import annotations

from omni_accum.integrations.vllm_omni import whole_payload
from omni_accum.integrations.vllm_omni.families.base import Family, Target, wrap_probe

ADAPTER = "vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter:OmniChunkTransferAdapter"

FAMILY = Family(
    name="0.16",
    versions=("0.16.0",),
    targets=(
        Target(ADAPTER, "__init__", "(self, vllm_config)", wrap_probe),
        Target(ADAPTER, "_update_request_payload", "(self, req_id, payload_data)", whole_payload.wrap_update_payload),
        Target(ADAPTER, "cleanup", "(self, request_id, external_req_id=None)", whole_payload.wrap_cleanup),
    ),
    probes=(Target(ADAPTER, "__init__", "(self, vllm_config)", wrap_probe),),
    runner_accumulate=ADAPTER,
    runner_class=ADAPTER,
    span_merge=(),
    data_plane=None,
    empty_span_takes_incoming=False,
    differences=(
        "the receiving chunk adapter accumulates the whole flat payload (_update_request_payload: torch.cat of "
        "thinker_embeddings per decode step); no runner transport, MRv2 data plane or full-payload accumulator"
    ),
)
