"""Shared fixtures. With CI=true a missing vllm-omni is a failure, never a skip."""

from __future__ import annotations

import importlib
import os

import pytest
from hypothesis import HealthCheck, settings

import omni_accum

CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")

settings.register_profile(
    "omni_accum", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("omni_accum")


def require_vllm_omni():
    """Import vllm_omni; fail under CI=true, skip otherwise, when it is missing."""
    try:
        return importlib.import_module("vllm_omni")
    except Exception as e:  # noqa: BLE001 - ImportError or a broken CUDA wheel
        if CI:
            pytest.fail(f"vllm-omni 0.30.0 is required when CI=true but cannot be imported: {e!r}")
        pytest.skip(f"vllm-omni not importable here ({e!r}); install with: pip install -e '.[vllm]'")


def require_module(name: str, why: str):
    """Import ``name`` (a declared test dependency); fail under CI=true, skip otherwise, when missing."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        if CI:
            pytest.fail(f"{name} is required when CI=true ({why}) but cannot be imported: {e!r}")
        pytest.skip(f"{name} not installed here ({why}): bash scripts/env.sh installs it")


@pytest.fixture(scope="session")
def vllm_omni():
    return require_vllm_omni()


@pytest.fixture(autouse=True)
def _restore_global_manager():
    """Tests may replace the process-wide strategy manager; put the original back afterwards."""
    before = omni_accum.manager._manager
    yield
    omni_accum.manager._manager = before
