"""omni-accum must be active in the processes vllm-omni spawns for its stage engine cores.

vllm-omni 0.30.0 starts each stage's engine core with ``StageEngineCoreProc.run_stage_core`` in a
process made by vLLM's ``get_mp_context()``. That process never calls vllm-omni's
``load_omni_general_plugins()`` (group ``vllm_omni.general_plugins``); the only plugin loading it
does is vLLM's ``load_general_plugins()`` (group ``vllm.general_plugins``), at the top of
``EngineCore.__init__``, before the scheduler builds its ``OmniChunkTransferAdapter``. A plugin that
registered in vllm-omni's group only was installed everywhere but there: inert in a real server.

The child process here is spawned the same way and runs vLLM's real ``EngineCore.__init__`` up to
the executor (which the test makes stop there), then builds the adapter as the scheduler does.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest


class _StopBeforeModel(Exception):
    """Raised by the stand-in executor: EngineCore.__init__ ran everything before the model."""


class _StopExecutor:
    def __init__(self, vllm_config: Any) -> None:
        raise _StopBeforeModel


def stage_core_child(queue: Any, env: dict[str, str]) -> None:
    """What a stage engine-core process does up to its scheduler, then a report on omni-accum."""
    os.environ.update(env)
    report: dict[str, Any] = {"pid": os.getpid()}
    try:
        import vllm_omni.core.sched.omni_scheduler_mixin  # noqa: F401 - the scheduler a stage core builds
        import vllm_omni.plugins as omni_plugins
        from vllm.v1.engine.core import EngineCore

        core = EngineCore.__new__(EngineCore)
        cfg = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_rank_local=1))
        try:
            EngineCore.__init__(core, vllm_config=cfg, executor_class=_StopExecutor, log_stats=False)
        except _StopBeforeModel:
            pass
        report["omni_plugins_loaded"] = omni_plugins.omni_plugins_loaded

        from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
            OmniChunkTransferAdapter,
        )

        from omni_accum.integrations import vllm_omni as integration
        from omni_accum.integrations.vllm_omni import binding as hooks

        report["installed"] = integration.is_installed()
        report["send_wrapped"] = hasattr(
            OmniChunkTransferAdapter.__dict__["_send_single_request_for_generation"], "__omni_accum_original__"
        )
        mc = SimpleNamespace(
            worker_type="ar",
            max_num_seqs=4,
            stage_id=0,
            async_chunk=True,
            stage_connector_config={"name": "SharedMemoryConnector", "extra": {}},
            custom_process_next_stage_input_func=None,
        )
        adapter = OmniChunkTransferAdapter(
            SimpleNamespace(model_config=mc, scheduler_config=SimpleNamespace(max_num_seqs=4))
        )
        try:
            b = hooks.binding_for(adapter)
            report["bound"] = b is not None
            report["policy_source"] = b.source if b is not None else None
        finally:
            adapter.shutdown()
            adapter.connector.close()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        report["error"] = f"{type(e).__name__}: {e}"
    queue.put(report)


def _run_child(env: dict[str, str]) -> dict[str, Any]:
    from vllm.utils.system_utils import get_mp_context

    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # what vLLM forces once CUDA or threads are up
    ctx = get_mp_context()
    assert ctx.get_start_method() == "spawn"
    q = ctx.Queue()
    p = ctx.Process(target=stage_core_child, args=(q, env), name="StageEngineCoreProc_stage0_replica0")
    p.start()
    try:
        report = q.get(timeout=900)  # importing vllm-omni in a fresh process: ~20 s idle, minutes on a loaded machine
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join()
    assert "error" not in report, report.get("error")
    return report


@pytest.fixture
def spawn_env(vllm_omni, monkeypatch):
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    return {"OMNI_ACCUM_POLICY": "qwen3-omni", "OMNI_ACCUM_VLLM_OMNI": "1"}


def test_stage_engine_core_process_installs_and_binds(spawn_env):
    report = _run_child(spawn_env)
    assert report["omni_plugins_loaded"] is False  # vllm-omni's own loader never ran, as in a real stage core
    assert report["installed"] and report["send_wrapped"], report
    assert report["bound"] and report["policy_source"] == "install()", report
    assert report["pid"] != os.getpid()


def test_without_the_vllm_group_entry_the_stage_core_is_inert(spawn_env):
    """The failure the test above guards against: with omni-accum's ``vllm.general_plugins`` entry
    filtered out (``VLLM_PLUGINS`` lists the others), the stage core runs upstream code only."""
    from importlib.metadata import entry_points

    others = [e.name for e in entry_points(group="vllm.general_plugins") if e.name != "omni_accum"]
    report = _run_child({**spawn_env, "VLLM_PLUGINS": ",".join(others) or "none"})
    assert report["omni_plugins_loaded"] is False
    assert not report["installed"] and not report["send_wrapped"] and not report["bound"], report


def test_vllm_group_entry_point_is_registered(vllm_omni):
    from importlib.metadata import entry_points

    from omni_accum.integrations.vllm_omni import activate_from_vllm

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "omni_accum"]
    assert ep.load() is activate_from_vllm


def test_plain_vllm_process_is_left_alone(tmp_path):
    """Outside vllm-omni (``vllm_omni`` not imported) the vLLM-group entry does nothing, imports nothing."""
    import subprocess
    import sys

    code = (
        "import sys; from omni_accum.integrations.vllm_omni import activate_from_vllm; activate_from_vllm(); "
        "print('vllm_omni' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "OMNI_ACCUM_POLICY": "qwen3-omni"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "False", out
