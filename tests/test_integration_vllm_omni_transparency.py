"""omni-accum changes nothing of vllm-omni that it was not asked to change (vllm-omni's own unit
tests pass with it installed): the connector object keeps its own ``put``, and no hooked path raises
where 0.30.0 does not."""

from __future__ import annotations

import os
from unittest.mock import MagicMock

import pytest
import torch

from tests.test_integration_vllm_omni import T2T, _request, _thinker_steps, _wait, assert_same, run_thinker_to_talker

pytestmark = pytest.mark.vllm


def _save_steps(tx, rid: str, n: int) -> None:
    out_ids: list[int] = []
    for i, mm in enumerate(_thinker_steps()[:n]):
        if i >= 3:
            out_ids.append(1000 + i)
        tx.save_async(multimodal_output=mm, request=_request(rid, out_ids))


def test_a_mocked_connector_put_stays_the_mock(vo, adapters):
    """A connector whose ``put`` is a MagicMock (as vllm-omni's adapter tests set it) keeps it: ``called``,
    ``call_args``, ``assert_called_once``, ``reset_mock`` work, and it receives what vllm-omni built."""
    from vllm_omni.data_entry_keys import OmniPayloadStruct

    vo.install("qwen3-omni")
    tx = adapters(0, next_func=T2T)
    mock = MagicMock(return_value=(True, 10, None))
    tx.connector.put = mock
    rid = f"oa-mock-{os.getpid()}"
    _save_steps(tx, rid, 4)  # 3 prefill chunks stashed by the processor, then one put
    _wait(lambda: mock.call_count >= 1, "put")
    assert tx.connector.put is mock
    mock.assert_called_once()
    assert isinstance(mock.call_args.kwargs["data"], OmniPayloadStruct)
    assert mock.call_args.kwargs["put_key"] == f"{rid}_0_0"
    mock.reset_mock()
    assert not mock.called
    assert tx._omni_accum_binding is not None  # bound all the same
    tx.cleanup("int-" + rid, rid)


def test_connector_instance_untouched_and_bytes_still_saved(vo, adapters):
    vo.install("qwen3-omni")
    rid = f"oa-inst-{os.getpid()}"
    _, wire, (tx, rx) = run_thinker_to_talker(adapters, rid, heard=True)
    for a in (tx, rx):
        assert "put" not in a.connector.__dict__
    assert tx._omni_accum_binding.stats["omitted"] > 0  # send_once still leaves values off the wire
    sent = tx._omni_accum_binding.stats
    assert sent["chunks_sent"] == sent["puts"] == 6  # one put per decode step (the first carries the prefill)
    assert rx._omni_accum_binding.stats["chunks_received"] == 6
    vo.uninstall()
    assert not getattr(type(tx.connector).put, "__omni_accum_put__", False)


def test_a_put_wrapped_after_binding_still_encodes(vo, adapters, monkeypatch):
    """Production code that wraps the instance's ``put`` after omni-accum bound (calling through to the
    connector's own) sees the call, and omni-accum's encoding still applies underneath."""
    vo.install("qwen3-omni")
    rid0 = f"oa-wrap0-{os.getpid()}"
    _, plain_wire, _ = run_thinker_to_talker(adapters, rid0, extra={"omni_accum_policy": "off"})
    seen: list[str] = []
    real_make = adapters

    def make(stage_id, **kw):
        a = real_make(stage_id, **kw)
        if stage_id == 0:
            inner = a.connector.put
            a.connector.put = lambda **k: (seen.append(k["put_key"]), inner(**k))[1]
        return a

    rid = f"oa-wrap-{os.getpid()}"
    handed, wire, (tx, _) = run_thinker_to_talker(make, rid, heard=True)
    assert len(seen) == 6
    assert wire < plain_wire
    assert tx._omni_accum_binding.stats["omitted"] > 0


def test_full_payload_with_a_connector_without_dict(vo, data_plane):
    """A data plane whose connector is a bare ``object()`` (no ``__dict__``): the hooked full-payload
    path gives what 0.30.0 gives, and raises nothing."""
    rows = [torch.arange(6, dtype=torch.float32).reshape(2, 3) + i for i in range(3)]

    def run(install: bool):
        dp = data_plane()
        saved = dp._omni_connector
        dp._omni_connector = object()
        try:
            if install:
                vo.install("default")
            for r in rows:
                dp.accumulate_full_payload_output("r1", {"x": r, "flag": torch.tensor(True)}, request=None)
            entry = dp._pending_full_payload_send.pop("r1")
            return type(dp)._materialize_full_payload_entry(entry)
        finally:
            dp._omni_connector = saved
            vo.uninstall()

    upstream = run(False)
    hooked = run(True)
    assert_same(hooked, upstream, "materialized")


def test_full_payload_keeps_upstream_append_semantics_under_qwen3_omni(vo, data_plane):
    """The full-payload accumulator appends every 2-D+ tensor step (the talker's codec rows); a key the
    policy gives a replace-kind strategy for async-chunk mode (``codes.audio: replace``, ``send_once``)
    still appends there: only the storage follows the policy. (A real server with async_chunk off
    handed code2wav one frame instead of 64 before.)"""
    g = torch.Generator().manual_seed(3)
    steps = [
        {
            "codes.audio": torch.randint(0, 2048, (1, 16), generator=g),
            "embed.tts_bos": torch.ones(1, 4),
            "hidden": torch.randn(1, 8, generator=g),
        }
        for _ in range(5)
    ]

    def run(policy):
        dp = data_plane()
        try:
            if policy:
                vo.install(policy)
            for st in steps:
                dp.accumulate_full_payload_output("r1", dict(st), request=None)
            return type(dp)._materialize_full_payload_entry(dp._pending_full_payload_send.pop("r1"))
        finally:
            vo.uninstall()

    upstream = run(None)
    assert upstream[0]["codes.audio"].shape == (5, 16)  # upstream appends the codec rows
    assert_same(run("qwen3-omni"), upstream, "qwen3-omni")
    assert_same(run("default"), upstream, "default")
