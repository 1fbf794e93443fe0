"""The e2e harness's CPU stand-in keeps vLLM's in-process executor on request (``run.py --executor uni``,
``OMNI_ACCUM_E2E_EXECUTOR``, the package's ``vllm.general_plugins`` hook ``executor_plugin``): vLLM's CPU platform
turns ``uni`` into ``mp`` for a stage of one worker, where a GPU server with tensor parallel size 1 runs ``uni``.
vLLM's own ``CpuPlatform.check_and_update_config`` is stood in for by what it does to the executor (the rest needs a
whole ``VllmConfig``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import e2e_cpu_module


@pytest.fixture(scope="module")
def plugin():
    yield from e2e_cpu_module("", ("vllm.platforms.cpu", "vLLM's CPU platform class"))


@pytest.fixture
def cpu(plugin, monkeypatch):
    """vLLM's CPU platform as it treats the executor (``uni`` becomes ``mp``), and the harness's package."""
    from vllm.platforms.cpu import CpuPlatform

    def check(cls, vllm_config):
        if vllm_config.parallel_config.distributed_executor_backend == "uni":
            vllm_config.parallel_config.distributed_executor_backend = "mp"

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(check))
    return CpuPlatform, plugin


def _config(world_size=1, backend="uni"):
    return SimpleNamespace(parallel_config=SimpleNamespace(world_size=world_size, distributed_executor_backend=backend))


@pytest.mark.parametrize(
    ("env", "world_size", "want"),
    [(None, 1, "mp"), ("mp", 1, "mp"), ("uni", 1, "uni"), ("uni", 2, "mp")],
)
def test_uni_is_kept_for_one_worker_only_when_asked(cpu, monkeypatch, env, world_size, want):
    platform, plugin = cpu
    if env is None:
        monkeypatch.delenv("OMNI_ACCUM_E2E_EXECUTOR", raising=False)
    else:
        monkeypatch.setenv("OMNI_ACCUM_E2E_EXECUTOR", env)
    plugin.executor_plugin()
    plugin.executor_plugin()  # vLLM loads the group once per process; a second load wraps nothing twice
    cfg = _config(world_size)
    platform.check_and_update_config(cfg)
    assert cfg.parallel_config.distributed_executor_backend == want


def test_a_bad_executor_is_named_and_changes_nothing(cpu, monkeypatch, caplog):
    platform, plugin = cpu
    monkeypatch.setenv("OMNI_ACCUM_E2E_EXECUTOR", "ray")
    before = platform.__dict__["check_and_update_config"]
    with caplog.at_level("WARNING", logger="vllm.omni_accum_e2e_cpu"):
        plugin.executor_plugin()
    assert platform.__dict__["check_and_update_config"] is before
    assert "OMNI_ACCUM_E2E_EXECUTOR='ray': one of mp, uni" in caplog.text
    with pytest.raises(ValueError, match="one of mp, uni"):
        plugin.executor()
