"""Receive side in the runner transports (real mixin, real MRv2 data plane, real SHM connector):
``_accumulate_payload`` and the full-payload accumulator, against upstream 0.30.0 results."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.test_integration_vllm_omni import assert_same

pytestmark = pytest.mark.vllm
D = 2048


def _chunks() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    bos = torch.randn(1, 1, D, generator=g).bfloat16()
    out = [
        {
            "embed": {"prefill": torch.randn(11, D, generator=g).bfloat16(), "tts_bos": bos},
            "ids": {"prompt": list(range(10))},
            "meta": {"finished": torch.tensor(False)},
        }
    ]
    for i in range(5):
        out.append(
            {
                "embed": {"decode": torch.randn(1, D, generator=g).bfloat16()},
                "ids": {"output": [i]},
                "meta": {"finished": torch.tensor(i == 4)},
            }
        )
    out.append(
        {
            "embed": {"decode": torch.randn(1, D, generator=g).bfloat16()},
            "meta": {"override_keys": [["embed", "decode"]], "finished": torch.tensor(True)},
        }
    )
    return out


def _feed(r: Any, rid: str, chunks: list[dict]) -> list[dict]:
    return [r._accumulate_payload(rid, c) for c in chunks]


@pytest.mark.parametrize("policy", ["default", "qwen3-omni"])
def test_mixin_accumulate_matches_upstream(vo, runner, policy):
    expected = _feed(runner(), "r", _chunks())
    vo.install(policy)
    r = runner()
    got = _feed(r, "r", _chunks())
    assert_same(got, expected, "views")
    b = r._omni_accum_binding
    assert b.receiver.active_requests == 1
    r.cleanup_finished_request("r")  # upstream's release point
    assert b.receiver.active_requests == 0 and "r" not in r.request_payload


def _span(rows: torch.Tensor, start: int) -> dict:
    return {"embed": {"decode": rows, "decode_token_start": start, "decode_token_end": start + rows.shape[0]}}


def test_data_plane_decode_spans_match_upstream(vo, data_plane):
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(12, D, generator=g).bfloat16()
    pre = {"embed": {"prefill": torch.randn(4, D, generator=g).bfloat16()}, "meta": {"finished": torch.tensor(False)}}
    chunks = [
        pre,
        _span(rows[0:2], 0),
        _span(rows[2:4], 2),  # contiguous
        _span(rows[3:6], 3),  # overlap by one row
        _span(rows[4:6], 4),  # full duplicate
        _span(rows[9:10], 9),  # gap: generic merge (upstream's documented quirk)
    ]
    expected = _feed(data_plane(), "e", chunks)
    vo.install("qwen3-omni")
    dp = data_plane()
    got = _feed(dp, "e", chunks)
    assert_same(got, expected, "views")


def test_data_plane_consumed_rows_are_dropped(vo, data_plane):
    """pop_local_stage_payload removes handed-over decode rows; the next chunk must not replay them."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(4, D, generator=g).bfloat16()
    pre = {"embed": {"prefill": torch.randn(4, D, generator=g).bfloat16()}}

    def run(dp: Any) -> list[dict]:
        views = [dp._accumulate_payload("e", pre), dp._accumulate_payload("e", _span(rows[0:2], 0))]
        dp._local_stage_payload_cache["e"] = views[-1]  # what the receive thread stages for the model
        dp.pop_local_stage_payload("e")
        views.append(dp._accumulate_payload("e", _span(rows[2:4], 2)))
        return views

    expected = run(data_plane())
    vo.install("qwen3-omni")
    got = run(data_plane())
    assert_same(got, expected, "views")
    assert got[-1]["embed"]["decode"].shape == (2, D)


@pytest.mark.parametrize("policy", ["default", "qwen3-omni"])
def test_full_payload_accumulator_matches_upstream(vo, runner, policy):
    g = torch.Generator().manual_seed(4)
    steps = [
        {
            "embed.prefill": torch.randn(5, D, generator=g),
            "codes.audio": torch.randint(0, 9, (1, 16)),
            "meta.left": torch.tensor(1),
            "x": None,
        },
        {
            "embed.prefill": torch.randn(1, D, generator=g),
            "codes.audio": torch.randint(0, 9, (1, 16)),
            "meta.left": torch.tensor(2),
        },
        {
            "embed.prefill": torch.randn(2, D, generator=g),
            "codes.audio": torch.randint(0, 9, (1, 8)),
            "meta.left": None,
        },
    ]

    def run(r: Any) -> Any:
        for s in steps:
            r.accumulate_full_payload_output("q", dict(s), "REQ")
        return r._materialize_full_payload_entry(r._pending_full_payload_send.pop("q"))

    expected = run(runner())
    vo.install(policy)
    got = run(runner())
    assert_same(got, expected, "materialized")
    assert got[0]["embed.prefill"].shape == (8, D) and got[0]["codes.audio"].shape == (1, 8)


def test_replay_through_vllm_omni(vo):
    """``--through vllm-omni``: arms replayed through the real transport, over the real SHM wire."""
    import glob
    import os

    import omni_accum
    import omni_accum.integrations.vllm_omni.replay  # noqa: F401 - registers THROUGH["vllm-omni"]
    from omni_accum.bench.replay import THROUGH, measure

    assert "vllm-omni" in THROUGH
    arms = {
        "upstream": "upstream",
        "default": omni_accum.load_policy("default"),
        "qwen3-omni": omni_accum.load_policy("qwen3-omni"),
    }
    res = measure(
        "qwen3-omni-override-ids", arms, context_len=64, concurrency=2, wire="shm", repeats=1, through="vllm-omni"
    )
    by = {r.arm: r for r in res}
    assert all(r.correct and r.error is None for r in res), [(r.arm, r.mismatch, r.error) for r in res]
    assert by["default"].wire_bytes_per_step == by["upstream"].wire_bytes_per_step
    assert by["qwen3-omni"].wire_bytes_per_step < by["upstream"].wire_bytes_per_step
    assert not glob.glob(f"/dev/shm/omniaccum_{os.getpid()}_*")  # this process's (scripts/test.sh runs two lanes)


def test_override_list_left_off_applies_only_to_chunks_that_carried_it(vo):
    """Through the real transport: send_once leaves an unchanged meta.override_keys off (bit 0 of the
    mask says so); a chunk that never carried the list appends, as upstream's own accumulator does."""
    from omni_accum.context import StreamContext
    from omni_accum.errors import AccumulationError
    from omni_accum.integrations.vllm_omni import marker
    from omni_accum.integrations.vllm_omni.replay import VllmOmniEngine
    from omni_accum.policy import load_policy

    t = [torch.full((1, D), float(i)).bfloat16() for i in range(5)]
    listed = {"override_keys": [["embed", "prefill"]]}
    chunks = [
        {"meta": listed, "embed": {"prefill": t[0]}, "speaker": "a"},
        {"meta": listed, "embed": {"prefill": t[1]}, "speaker": "a"},
        {"embed": {"prefill": t[2]}, "speaker": "a"},
        {"meta": {"finished": False}, "embed": {"prefill": t[3]}, "speaker": "a"},
        {"meta": listed, "embed": {"prefill": t[4]}, "speaker": "a"},
    ]
    upstream = VllmOmniEngine(None, StreamContext())
    ours = VllmOmniEngine(load_policy("qwen3-omni"), StreamContext())
    try:
        for k, chunk in enumerate(chunks):
            want = upstream.merge("r", upstream.encode("r", chunk))["embed"]["prefill"]
            wire = ours.encode("r", chunk)
            if k:
                assert wire[marker.OMITTED_KEY] & 1 == (k in (1, 4)), (k, wire[marker.OMITTED_KEY])
                assert "speaker" not in wire and marker.WIRE_MARKER not in wire
            got = ours.merge("r", wire)["embed"]["prefill"]
            assert torch.equal(got, want), k
        assert torch.equal(got, t[4]) and torch.equal(want, t[4])
    finally:
        upstream.release("r")
        ours.release("r")
        upstream.close()
        ours.close()
    with pytest.raises(AccumulationError, match="malformed wire marker"):
        marker.split_mask(-1)
    assert marker.split_mask(
        marker.omitted_mask({("a", None): 0, ("meta", "override_keys"): 1}, [("a", None)], True)
    ) == (
        1,
        True,
    )
