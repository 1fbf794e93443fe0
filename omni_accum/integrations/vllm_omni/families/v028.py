"""vllm-omni 0.28: one runner mixin.

* ``OmniConnectorModelRunnerMixin._accumulate_payload`` (``vllm_omni/worker/omni_connector_model_runner_mixin.py``)
  is the only runner accumulation, called by the receive thread outside ``self._lock``, and it merges
  ``embed.decode`` by token span (``merge_tensor_spans``: contiguous rows appended, overlapping rows
  trimmed, a full duplicate dropped, a gap left to the generic merge; an empty held span is
  concatenated with the incoming one, where 0.30 hands the incoming one over as it is);
* no MRv2 data plane (``vllm_omni.worker_v2`` does not exist);
* the full-payload accumulator and ``init_omni_connectors(self, model_config, kv_transfer_manager=None)``
  live on that mixin.

The adapter methods are those of 0.30 (:func:`.v030.adapter_targets`), and so is the Qwen3-Omni
async-chunk thinker-to-talker processor (:func:`.v030.processor_targets`: its prefill branch is 0.30's,
line for line).
"""

from __future__ import annotations

from omni_accum.integrations.vllm_omni import full_payload, runner
from omni_accum.integrations.vllm_omni.families.base import Family, Target, wrap_probe
from omni_accum.integrations.vllm_omni.families.v030 import (
    ADAPTER,
    adapter_targets,
    full_payload_targets,
    processor_targets,
    wrap_transport_init,
)

MIXIN = "vllm_omni.worker.omni_connector_model_runner_mixin:OmniConnectorModelRunnerMixin"


def wrap_mixin_accumulate(f):
    """The runner mixin: the decode-span merge (0.28 has it in the mixin itself)."""
    return runner.wrap_accumulate(f, decode_spans=True)


FAMILY = Family(
    name="0.28",
    versions=("0.28.0",),
    targets=(
        *adapter_targets(),
        Target(MIXIN, "_accumulate_payload", "(self, req_id, payload_data)", wrap_mixin_accumulate),
        *full_payload_targets(MIXIN),
        *processor_targets(),
        # the whole payload's hand-off (kind full) and a receiving transport's hello, as in 0.30 (0.28's get
        # takes no metadata; init_omni_connectors is the mixin's, without ``synchronous``)
        Target(MIXIN, "_send_single_request", "(self, task)", full_payload.wrap_full_send),
        Target(
            MIXIN,
            "_recv_full_payload_result",
            "(self, connector, from_stage, to_stage, connector_get_key)",
            full_payload.wrap_full_recv,
        ),
        Target(
            MIXIN, "init_omni_connectors", "(self, model_config, kv_transfer_manager=None)",
            wrap_transport_init,
        ),  # fmt: skip
    ),
    probes=(
        Target(ADAPTER, "__init__", "(self, vllm_config)", wrap_probe),
        Target(MIXIN, "init_omni_connectors", "(self, model_config, kv_transfer_manager=None)", wrap_probe),
    ),
    runner_accumulate=MIXIN,
    runner_class=MIXIN,
    span_merge=(MIXIN,),
    data_plane=None,
    empty_span_takes_incoming=False,
    differences=(
        "one runner mixin (OmniConnectorModelRunnerMixin) merges embed.decode by token span, outside its lock; "
        "no MRv2 data plane"
    ),
)
