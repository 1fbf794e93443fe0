"""Shared fixtures. With CI=true a missing vllm-omni is a failure, never a skip."""

from __future__ import annotations

import contextlib
import importlib
import os
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

import fuzzing  # tests/ is on sys.path (the rootdir conftest's folder)
import omni_accum

CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large]
# Derandomized by default: every run draws the same examples (a suite that fails at random is a defect);
# OMNI_ACCUM_FUZZ=long explores new ones (tests/fuzzing.py).
settings.register_profile("omni_accum", deadline=None, suppress_health_check=_SUPPRESS, derandomize=True, database=None)
settings.register_profile("omni_accum_long", deadline=None, suppress_health_check=_SUPPRESS, derandomize=False)
settings.load_profile("omni_accum_long" if fuzzing.LONG else "omni_accum")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # A long fuzz's seed, printed in the header, unless --hypothesis-seed gave one (read by hypothesis' plugin).
    if fuzzing.LONG and getattr(config.option, "hypothesis_seed", None) is None:
        config.option.hypothesis_seed = fuzzing.SEED


def pytest_collection_modifyitems(config, items):
    # The end-to-end server test last: the test command builds its virtualenv in the background meanwhile.
    items.sort(key=lambda item: item.path.name == "test_e2e_server.py")


def pytest_report_header(config):
    if fuzzing.LONG:
        seed = getattr(config.option, "hypothesis_seed", fuzzing.SEED)
        return f"property tests: long fuzz (OMNI_ACCUM_FUZZ=long), {fuzzing.SCALE}x examples, --hypothesis-seed={seed}"
    return "property tests: derandomized (the same examples every run; OMNI_ACCUM_FUZZ=long explores new ones)"


def require_vllm_omni():
    """Import vllm_omni; fail under CI=true, skip otherwise, when it is missing."""
    try:
        return importlib.import_module("vllm_omni")
    except Exception as e:  # noqa: BLE001 - ImportError or a broken CUDA wheel
        if CI:
            pytest.fail(f"vllm-omni (0.30.0 or 0.28.0) is required when CI=true but cannot be imported: {e!r}")
        pytest.skip(f"vllm-omni not importable here ({e!r}); install with: pip install -e '.[vllm]'")


def require_module(name: str, why: str):
    """Import ``name`` (a declared test dependency); fail under CI=true, skip otherwise, when missing."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        if CI:
            pytest.fail(f"{name} is required when CI=true ({why}) but cannot be imported: {e!r}")
        pytest.skip(f"{name} not installed here ({why}): bash scripts/env.sh installs it")


#: The end-to-end harness's CPU stand-in package (not installed in .venv: imported from its source).
E2E_CPU_SRC = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "e2e", "cpu_platform", "src"
)


def e2e_cpu_module(name: str, *requires: tuple[str, str]):
    """Yield ``omni_accum_e2e_cpu.<name>`` (the package itself for ``""``) imported from the harness's source, after
    ``require_module`` of each ``(module, why)`` it builds on; the source folder leaves ``sys.path`` afterwards (a
    generator for a fixture)."""
    import sys

    for module, why in requires:
        require_module(module, why)
    sys.path.insert(0, E2E_CPU_SRC)
    try:
        yield importlib.import_module(f"omni_accum_e2e_cpu.{name}" if name else "omni_accum_e2e_cpu")
    finally:
        sys.path.remove(E2E_CPU_SRC)


@pytest.fixture(scope="session")
def vllm_omni():
    return require_vllm_omni()


@pytest.fixture(scope="session")
def shared_stage_host(vllm_omni):
    """One ``StageHost`` (vllm-omni and Mooncake imported once, stage processes forked from it per run) for the test
    process, started by the first test that asks (``mooncake_fixtures``); stopped at the end, and gone."""
    from mooncake_fixtures import start_shared_host

    from omni_accum.bench.mooncake import _alive

    host = start_shared_host()
    try:
        yield host
    finally:
        pid = host.pid
        host.stop()
        assert pid is None or not _alive(pid)


@pytest.fixture(autouse=True)
def _restore_global_manager():
    """Tests may replace the process-wide strategy manager; put the original back afterwards."""
    before = omni_accum.manager._manager
    yield
    omni_accum.manager._manager = before


# ---------------------------------------------------------------------------------------------- #
# Real vllm-omni classes (the installed release: 0.30.0 or 0.28.0) on CPU, shared by the integration tests
# ---------------------------------------------------------------------------------------------- #


@pytest.fixture
def vo(vllm_omni):
    """The integration module; every test leaves vllm-omni unpatched."""
    from omni_accum.integrations import vllm_omni as integration

    integration.uninstall()
    yield integration
    integration.uninstall()


def runner_config(extra: dict | None = None) -> Any:
    """A model config for runner transports (AR worker, SharedMemoryConnector with ``extra``)."""
    return SimpleNamespace(
        stage_id=1,
        worker_type="ar",
        async_chunk=True,
        # vllm-omni puts the stage id into the connector extra (0.28: EngineArgs; 0.30: resolve_connector_spec)
        stage_connector_config={"name": "SharedMemoryConnector", "extra": {"stage_id": 1, **(extra or {})}},
        custom_process_next_stage_input_func=None,
    )


def close_binding(obj: Any) -> None:
    """Close ``obj``'s omni-accum binding, withdrawing its hello. A receiving adapter's hello lives under one key
    per stage pair and process; ``uninstall`` reaches only live objects, so an adapter dropped before it left its
    hello behind, and a later test's sender in this process (a live pid) marked requests for a receiver that runs
    0.30.0's code."""
    b = obj.__dict__.get("_omni_accum_binding")
    if b is not None:
        b.close()


@pytest.fixture
def runner(vllm_omni):
    """Factory of real runner transports (``OmniConnectorModelRunnerMixin`` + SharedMemoryConnector)."""
    from vllm_omni.worker.omni_connector_model_runner_mixin import OmniConnectorModelRunnerMixin

    stack = contextlib.ExitStack()  # every one is shut down, also when another's shutdown raises

    def make(extra: dict | None = None) -> Any:
        r = type("Runner", (OmniConnectorModelRunnerMixin,), {})()
        r.init_omni_connectors(runner_config(extra))
        stack.callback(r.shutdown_omni_connectors)
        stack.callback(close_binding, r)  # first: its hello withdrawn while it is alive
        return r

    with stack:
        yield make


@pytest.fixture
def data_plane(vllm_omni):
    """Factory of real MRv2 data planes (``OmniRunnerDataPlane``). On a release without one (0.28) a
    test skips when it makes one: the release has no such path to test."""
    from omni_accum.integrations.vllm_omni.families import current

    stack = contextlib.ExitStack()

    def make() -> Any:
        fam = current()
        if fam.data_plane is None:
            pytest.skip(f"vllm-omni {fam.version} has no MRv2 data plane (OmniRunnerDataPlane)")
        from vllm_omni.worker_v2.omni_data_plane import OmniRunnerDataPlane

        dp = OmniRunnerDataPlane(SimpleNamespace(), runner_config())
        stack.callback(dp.close)
        return dp

    with stack:
        yield make


@pytest.fixture
def adapters(vllm_omni):
    """Factory of real OmniChunkTransferAdapters; all are shut down and their SHM keys removed."""
    from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
        OmniChunkTransferAdapter,
    )

    stack = contextlib.ExitStack()  # each adapter shut down and its connector closed, whatever another one raises

    def make(
        stage_id: int,
        *,
        worker_type: str = "ar",
        next_func: str | None = None,
        extra: dict | None = None,
        connector: str = "SharedMemoryConnector",
    ):
        mc = SimpleNamespace(
            worker_type=worker_type,
            max_num_seqs=8,
            stage_id=stage_id,
            async_chunk=True,
            # the stage id in the connector extra, as vllm-omni's own config puts it (0.28's connector reads it there)
            stage_connector_config={"name": connector, "extra": {"stage_id": stage_id, **(extra or {})}},
            custom_process_next_stage_input_func=next_func,
            hf_config=SimpleNamespace(talker_config=SimpleNamespace(accept_hidden_layer=24)),
        )
        a = OmniChunkTransferAdapter(SimpleNamespace(model_config=mc, scheduler_config=SimpleNamespace(max_num_seqs=8)))
        stack.callback(a.connector.close)
        stack.callback(a.shutdown)  # last in, first out: shut down, then its connector closed
        stack.callback(close_binding, a)  # first of all: its hello withdrawn while it is alive
        return a

    with stack:
        yield make
