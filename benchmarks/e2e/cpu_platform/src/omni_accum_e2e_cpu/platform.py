"""``CPUOmniPlatform``: vLLM's ``CpuPlatform`` plus the omni-specific interface (stand-in, see package doc)."""

from __future__ import annotations

import os

import psutil
import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum


class CPUOmniPlatform(OmniPlatform, CpuPlatform):
    # vllm-omni 0.30.0 has an OOT member for out-of-tree platforms; 0.16.0's enum has none (UNSPECIFIED:
    # is_cuda() / is_npu() ... all False, as OOT).
    _omni_enum = getattr(OmniPlatformEnum, "OOT", OmniPlatformEnum.UNSPECIFIED)

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return "omni_accum_e2e_cpu.worker.CPUOmniARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        return "omni_accum_e2e_cpu.worker.CPUOmniGenerationWorker"

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        # 0.30.0: the deploy YAMLs in vllm_omni/deploy; 0.16.0: the stage configs (its CUDA platform's path)
        import vllm_omni

        deploy = os.path.join(os.path.dirname(vllm_omni.__file__), "deploy")
        return "vllm_omni/deploy" if os.path.isdir(deploy) else "vllm_omni/model_executor/stage_configs"

    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend, head_size, allow_trtllm_default=False) -> str:
        from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

        return DiffusionAttentionBackendEnum.TORCH_SDPA.get_path()

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def supports_talker_mtp_graph_capture(cls) -> bool:
        return False

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return int(psutil.virtual_memory().available)

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
