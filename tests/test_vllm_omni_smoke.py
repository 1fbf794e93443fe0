"""Smoke test: the vllm-omni pieces omni-accum hooks (of the installed release: 0.30.0 or 0.28.0) import
on CPU, and the real shared-memory connector round-trips a nested payload bit for bit."""

from __future__ import annotations

import glob
import os

import pytest
import torch

pytestmark = pytest.mark.vllm


def test_hook_classes_import(vllm_omni):
    """Every method the installed release's family wraps or probes imports and is callable."""
    from importlib.metadata import version

    from omni_accum.integrations.vllm_omni import families
    from omni_accum.integrations.vllm_omni.families.base import _resolve
    from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
        OmniChunkTransferAdapter,
    )
    from vllm_omni.distributed.omni_connectors.utils.serialization import OmniSerializer

    fam = families.family_for(version("vllm-omni"))
    assert fam is not None, f"vllm-omni {version('vllm-omni')} is not a supported release"
    for t in fam.targets + fam.probes:
        assert callable(getattr(_resolve(t.owner), t.name)), t.label
    assert callable(OmniChunkTransferAdapter._send_single_request_for_generation)
    assert callable(_resolve(fam.runner_accumulate)._accumulate_payload)
    assert OmniSerializer.deserialize(OmniSerializer.serialize({"a": [1, 2]})) == {"a": [1, 2]}


def test_shm_connector_round_trip(vllm_omni):
    from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

    tx, rx = SharedMemoryConnector({"stage_id": 0}), SharedMemoryConnector({"stage_id": 1})
    key = f"omni_accum_smoke_{os.getpid()}_0_0"
    payload = {
        "embed": {"decode": torch.randn(1, 2048).bfloat16(), "tts_bos": torch.randn(1, 1, 2048).bfloat16()},
        "ids": {"prompt": [1, 2, 3]},
        "meta": {"finished": torch.tensor(False)},
        "speaker": "ethan",
    }
    try:
        ok, size, _ = tx.put("0", "1", key, payload)
        assert ok and size > 4096
        got, got_size = rx.get("0", "1", key)
        assert got_size == size
        assert torch.equal(got["embed"]["decode"], payload["embed"]["decode"])
        assert got["embed"]["decode"].dtype == torch.bfloat16
        assert got["embed"]["tts_bos"].shape == (1, 1, 2048)
        assert got["ids"] == {"prompt": [1, 2, 3]} and got["speaker"] == "ethan"
        assert got["meta"]["finished"].shape == () and not bool(got["meta"]["finished"])
        assert rx.get("0", "1", key) is None  # one-shot
    finally:
        tx.cleanup(key)
        tx.close()
        rx.close()
    assert not glob.glob(f"/dev/shm/*{key}*")
