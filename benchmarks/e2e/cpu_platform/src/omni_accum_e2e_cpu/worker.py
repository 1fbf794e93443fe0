"""CPU workers / model runners for vllm-omni's AR (thinker, talker) and generation (code2wav) stages.

Each runner puts vllm-omni's runner first in the MRO (its overrides win and chain, through
``super()``, into vLLM's ``CPUModelRunner`` before ``GPUModelRunner``); each worker is vLLM's
``CPUWorker`` with vllm-omni's worker mixin (general plugins, e.g. omni-accum, load in the worker),
building the omni runner instead of the plain CPU one. Stand-in, see the package doc.
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger
from vllm.v1.worker.cpu_model_runner import CPUModelRunner, _torch_cuda_wrapper
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin

logger = init_logger(__name__)


class _CPURunnerMixin:
    """What vLLM's CPU runner does that vllm-omni's runner overrides or adds after its own init."""

    def __init__(self, *args, **kwargs):
        with _torch_cuda_wrapper():  # omni's runner builds CUDA streams / events of its own
            super().__init__(*args, **kwargs)
        self.use_cuda_graph = False
        self.cascade_attn_enabled = False
        self._postprocess_tensors()  # buffers omni's runner allocated after CPUModelRunner's pass

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
