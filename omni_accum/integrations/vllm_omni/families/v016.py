"""vllm-omni 0.16: the receiving adapter accumulates the whole payload.

* ``OmniChunkTransferAdapter._update_request_payload(self, req_id, payload_data)``
  (``distributed/omni_connectors/transfer_adapter/chunk_transfer_adapter.py``) is the only accumulation:
  called by the adapter's receive thread for every chunk of an AR stage, it ``torch.cat``-s each tensor
  key with what it held and joins lists (``finished`` and other values replaced, keys the chunk lacks
  dropped); the payload keys are flat (``thinker_embeddings``, ``thinker_hidden_states``,
  ``tts_bos_embed`` ..., ``finished``; no ``override_keys``). Wrapped by :mod:`..whole_payload`.
* ``OmniChunkTransferAdapter.cleanup(self, request_id, external_req_id=None)`` frees a request's state
  (its ``request_payload`` entry, keyed by the external id): the Receiver is released there.
* ``OmniChunkTransferAdapter.postprocess_scheduler_output(self, scheduler_output, requests=None)`` attaches
  every running request's whole accumulated dict to the step's output, which the ``mp`` executor pickles to the
  worker every step: the views omni-accum handed over cross as their rows only, and after the first time as the
  rows the worker lacks (:mod:`..runner_rows`); the worker's runner is not wrapped.
* no runner transport, no MRv2 data plane, no full-payload accumulator: the scheduler hands the
  accumulated dict to the runner as ``additional_information``.
* the send side (``_send_single_request(self, task)``) is left alone: 0.16.0's Qwen3-Omni
  thinker-to-talker processor sends the per-request statics (``tts_*_embed``, ``thinker_input_ids``,
  ``thinker_sequences``, the prompt's ``thinker_hidden_states``) in the first chunk only, and a decode
  chunk carries ``thinker_embeddings`` (one row) and ``finished``: there is nothing to leave off.
"""

from __future__ import annotations

from omni_accum.integrations.vllm_omni import runner_rows, whole_payload
from omni_accum.integrations.vllm_omni.families.base import Family, Target, wrap_probe

#: The constructor: the probe, and whether the stage's executor pickles the scheduler output (:mod:`..runner_rows`).
INIT = runner_rows.wrap_init(wrap_probe)
ADAPTER = "vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter:OmniChunkTransferAdapter"
RUNNER = "vllm_omni.worker.gpu_model_runner:OmniGPUModelRunner"

FAMILY = Family(
    name="0.16",
    versions=("0.16.0",),
    targets=(
        Target(ADAPTER, "__init__", "(self, vllm_config)", INIT),
        Target(ADAPTER, "_update_request_payload", "(self, req_id, payload_data)", whole_payload.wrap_update_payload),
        Target(ADAPTER, "cleanup", "(self, request_id, external_req_id=None)", whole_payload.wrap_cleanup),
        Target(
            ADAPTER,
            "postprocess_scheduler_output",
            "(self, scheduler_output, requests=None)",
            runner_rows.wrap_postprocess,
        ),
    ),
    probes=(Target(ADAPTER, "__init__", "(self, vllm_config)", INIT),),
    # runner_rows' stand-ins hold only while the adapter attaches the cached dicts as it does and the worker's runner
    # keeps the tensors it unpickles (dict.update): checked, not wrapped
    relies_on=(
        Target(ADAPTER, "attach_cached_additional_information", "(scheduler_output, requests)", None, static=True),
        Target(RUNNER, "_update_additional_information", "(self, scheduler_output)", None),
        Target(RUNNER, "_update_request_information", "(self, request_id, payload_info)", None),
    ),
    runner_accumulate=ADAPTER,
    runner_class=ADAPTER,
    span_merge=(),
    data_plane=None,
    empty_span_takes_incoming=False,
    differences=(
        "the receiving chunk adapter accumulates the whole flat payload (_update_request_payload: torch.cat of "
        "thinker_embeddings per decode step); no runner transport, MRv2 data plane or full-payload accumulator; "
        "no send hook: no hand-off metric, A/B split or capture, and send_once / delta rules only replace the key "
        "on receipt"
    ),
)
