"""CPU workers / model runners for vllm-omni's AR (thinker, talker) and generation (code2wav) stages.

Each runner puts vllm-omni's runner first in the MRO (its overrides win and chain, through
``super()``, into vLLM's ``CPUModelRunner`` before ``GPUModelRunner``); each worker is vLLM's
``CPUWorker`` with vllm-omni's worker mixin (general plugins, e.g. omni-accum, load in the worker),
building the omni runner instead of the plain CPU one. Stand-in, see the package doc.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.worker.cpu_model_runner import CPUModelRunner, _torch_cuda_wrapper
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin

logger = init_logger(__name__)


def discarded_generators(runner) -> dict[int, torch.Generator]:
    """The seeded requests' generators whose sample this step is discarded (a prefill not yet complete)."""
    batch = getattr(runner, "input_batch", None)
    mask = getattr(runner, "discard_request_mask", None)
    gens = getattr(batch, "generators", None)
    if not gens or mask is None or not hasattr(mask, "np"):
        return {}
    return {int(i): gens[int(i)] for i in np.nonzero(mask.np[: batch.num_reqs])[0] if int(i) in gens}


class _CPURunnerMixin:
    """What vLLM's CPU runner does that vllm-omni's runner overrides or adds after its own init.

    Seeded sampling with a discarded sample: vLLM 0.30.0's ``_bookkeeping_sync`` rewinds the generator of a
    seeded request whose sample a step discards (its prefill is not complete yet: chunked prefill, or several
    prompts sharing one step's token budget) with ``gen.set_offset(gen.get_offset() - 4)``, the offset of CUDA's
    Philox generator; a CPU generator has none and raises "CPU Generator does not use offset", which kills the
    stage (seen on the talker, whose requests are seeded, with four 32k prompts at once). Here the same rewind is
    done the CPU way: each such generator's state is saved before the step samples and put back after, and the
    generator is kept out of vLLM's rewind."""

    def __init__(self, *args, **kwargs):
        with _torch_cuda_wrapper():  # omni's runner builds CUDA streams / events of its own
            super().__init__(*args, **kwargs)
        self.use_cuda_graph = False
        self.cascade_attn_enabled = False
        self._postprocess_tensors()  # buffers omni's runner allocated after CPUModelRunner's pass

    def sample_tokens(self, *args, **kwargs):
        self._e2e_rewind = {i: g.get_state() for i, g in discarded_generators(self).items()}
        try:
            return super().sample_tokens(*args, **kwargs)
        finally:
            self._e2e_rewind = {}

    def _bookkeeping_sync(self, *args, **kwargs):
        held = discarded_generators(self)
        gens = self.input_batch.generators
        for i in held:
            del gens[i]  # out of vLLM's set_offset
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            saved = getattr(self, "_e2e_rewind", None) or {}
            for i, g in held.items():
                if i in saved:
                    g.set_state(saved[i])  # as if the discarded sample had not drawn
                gens[i] = g

    def _init_device_properties(self) -> None:
        self.num_sms = None

    def _sync_device(self) -> None:
        return None


class CPUOmniARModelRunner(_CPURunnerMixin, GPUARModelRunner, CPUModelRunner):
    pass


class CPUOmniGenerationModelRunner(_CPURunnerMixin, GPUGenerationModelRunner, CPUModelRunner):
    pass


class _CPUOmniWorker(OmniWorkerMixin, CPUWorker):
    model_runner_cls: type  # vllm-omni checks this attribute (omni_connector_validation)

    def init_device(self):
        if getattr(self, "use_v2_model_runner", False):
            logger.warning("%s forces the v1 model runner (omni hooks).", type(self).__name__)
            self.use_v2_model_runner = False
        super().init_device()
        # vLLM 0.30.0's CPUWorker sets self.device; 0.16.0's passes torch.device("cpu") to its runner and
        # leaves self.device None
        self.model_runner = self.model_runner_cls(self.vllm_config, getattr(self, "device", None) or torch.device("cpu"))


class CPUOmniARWorker(_CPUOmniWorker):
    """CPU worker for the autoregressive stages (thinker, talker)."""

    model_runner_cls = CPUOmniARModelRunner


class CPUOmniGenerationWorker(_CPUOmniWorker):
    """CPU worker for the non-autoregressive generation stage (code2wav)."""

    model_runner_cls = CPUOmniGenerationModelRunner
