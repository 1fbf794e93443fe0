"""``benchmarks/e2e/run.py``'s arm specs (the harness itself runs in tests/test_e2e_server.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

RUN_PY = Path(__file__).resolve().parent.parent / "benchmarks" / "e2e" / "run.py"


@pytest.fixture(scope="module")
def run():
    spec = importlib.util.spec_from_file_location("e2e_run", RUN_PY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["e2e_run"] = mod  # dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("e2e_run", None)


def test_an_arm_with_its_own_deploy_config(run):
    arm = run.make_arm("off@arena")
    assert arm.name == "off@arena" and arm.env == {"OMNI_ACCUM_VLLM_OMNI": "0"}
    assert arm.deploy == RUN_PY.parent / "configs" / "qwen3_omni_cpu_arena.yaml"
    assert "OmniAccumArenaConnector" in arm.deploy.read_text()
    q = run.make_arm(f"qwen3-omni@{RUN_PY.parent / 'configs' / 'qwen3_omni_cpu_full_payload.yaml'}")
    assert q.env["OMNI_ACCUM_POLICY"] == "qwen3-omni" and q.deploy.name == "qwen3_omni_cpu_full_payload.yaml"
    assert run.make_arm("off").deploy is None


def test_an_unknown_deploy_config_is_named(run):
    with pytest.raises(SystemExit, match="nosuch"):
        run.make_arm("off@nosuch")
