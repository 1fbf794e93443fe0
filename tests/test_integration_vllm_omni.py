"""omni-accum installed into the real vllm-omni 0.30.0 classes, on CPU (no mocks of vllm-omni).

Payloads come from vllm-omni's own ``thinker2talker_async_chunk`` fed with synthetic thinker
outputs of the real shapes, and travel through real adapters and a real SharedMemoryConnector.
"""

from __future__ import annotations

import glob
import os
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.vllm

D, P = 2048, 10
T2T = "vllm_omni.model_executor.stage_input_processors.qwen3_omni.thinker2talker_async_chunk"


def _thinker_steps(seed: int = 0, decode_steps: int = 6) -> list[dict]:
    """Thinker outputs: chunked prefill (4, 4, 2 rows), then one row per decode step."""
    g = torch.Generator().manual_seed(seed)
    consts = {k: torch.randn(1, 1, D, generator=g).bfloat16() for k in ("tts_bos", "tts_eos", "tts_pad")}
    out = []
    for rows in (4, 4, 2) + (1,) * decode_steps:
        layers = {0: torch.randn(rows, D, generator=g).bfloat16(), 24: torch.randn(rows, D, generator=g).bfloat16()}
        out.append({"hidden_states": {"layers": layers}, "embed": dict(consts)})
    return out


def _entries(**kv: str) -> Any:
    return SimpleNamespace(entries={k: SimpleNamespace(list_data=[v]) for k, v in kv.items()})


def _request(rid: str, out_ids: list[int], *, finished: bool = False, internal: str | None = None) -> Any:
    prompt = list(range(100, 100 + P))
    r = SimpleNamespace(
        request_id=internal or "int-" + rid,
        external_req_id=rid,
        prompt_token_ids=prompt,
        output_token_ids=list(out_ids),
        all_token_ids=prompt + list(out_ids),
        additional_information=_entries(speaker="Ethan", language="English"),
        resumable=False,
        num_computed_tokens=0,
        num_output_placeholders=0,
        sampling_params=None,
        status=None,
    )
    r.is_finished = lambda: finished
    return r


def _wait(cond, what: str, timeout: float = 10.0) -> None:
    """Poll for the adapters' background threads (a hang guard, not a speed check)."""
    for _ in range(int(timeout / 0.005)):
        if cond():
            return
        time.sleep(0.005)
    if not cond():
        raise AssertionError(f"never happened: {what}")


def _receive_and_hand_over(rx, rreq):
    """One scheduler step of the AR receiving adapter: load, commit, hand the payload over, then detach it."""
    rx.load_async(rreq)
    _wait(lambda: rreq.request_id in rx._pending_ar_prompt_updates, "receive")
    rx.requests_with_ready_chunks.add(rreq.request_id)
    rx._apply_pending_ar_prompt_updates({rreq.request_id: rreq})
    handed = rreq.additional_information
    so = SimpleNamespace(scheduled_cached_reqs=SimpleNamespace(req_ids=[rreq.request_id]))
    type(rx).attach_cached_additional_information(so, {rreq.request_id: rreq})
    rx.requests_with_ready_chunks.discard(rreq.request_id)
    return handed


def _hear(tx) -> None:
    """Wait until sending adapter ``tx`` has heard its receiver's hello (see ``run_thinker_to_talker``)."""
    from omni_accum.integrations.vllm_omni import peer
    from omni_accum.integrations.vllm_omni.binding import binding_for

    binding = binding_for(tx)  # made on first use
    peer.watch(binding, tx.connector)  # what the first send does
    _wait(binding._peer.ready, "the receiver's hello heard", timeout=30)


def run_thinker_to_talker(
    make, rid: str, *, extra: dict | None = None, heard: bool = False
) -> tuple[list[dict], int, list]:
    """Thinker adapter -> SHM -> AR talker adapter; returns (handed-over payloads, wire bytes, adapters).

    ``heard``: first wait until the sender has heard the receiver's hello, as in a server after its first requests
    (a request that starts sooner is sent as 0.30.0's payload; over shared memory the first send looks itself,
    over another connector it waits only 50 ms for the watcher, which a loaded machine can miss). For a test whose assertions need the request announced."""
    tx = make(0, next_func=T2T, extra=extra)
    rx = make(1, extra=extra)
    if heard:
        _hear(tx)
    rreq = _request(rid, [], internal="rx-" + rid)
    steps = _thinker_steps()
    handed: list[dict] = []
    out_ids: list[int] = []
    sent = 0
    for i, mm in enumerate(steps):
        last = i == len(steps) - 1
        if i >= 3:
            out_ids.append(1000 + i)
        sreq = _request(rid, out_ids, finished=last)
        tx.save_async(multimodal_output=mm, request=sreq)
        if i < 3:
            continue  # prefill rows (<= P) stashed by the processor, nothing put
        sent += 1
        _wait(lambda: tx.put_req_chunk.get(rid, 0) >= sent or (last and rid not in tx.put_req_chunk), "put")
        handed.append(_receive_and_hand_over(rx, rreq))
    wire = tx.connector.health()["bytes_transferred"]
    rx.cleanup(rreq.request_id, rid)
    tx.cleanup(sreq.request_id, rid)
    wait_for_release(tx, rid)
    return handed, wire, [tx, rx]


def wait_for_release(tx: Any, rid: str) -> None:
    """After the adapters' cleanup of ``rid``: vllm-omni counts a put when it queues it, so the save loop's terminal
    put (and the sender's release after it) may still be running; a bounded wait for the release (a hang guard)."""
    b = tx.__dict__.get("_omni_accum_binding")
    if b is not None:
        _wait(lambda: rid not in b.sender.request_ids() and rid not in b.live_send, "the sender's release")


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def no_shm_leftovers(rid: str) -> bool:
    return not glob.glob(f"/dev/shm/*{rid}*")


# ---------------------------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def baseline(vllm_omni, tmp_path_factory):
    """What the talker receives from 0.30.0 alone (no omni-accum installed)."""
    from omni_accum.integrations import vllm_omni as integration
    from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
        OmniChunkTransferAdapter,
    )

    integration.uninstall()
    made = []

    def make(*a, **k):
        mc_extra = k.get("extra")
        mc = SimpleNamespace(
            worker_type=k.get("worker_type", "ar"),
            max_num_seqs=8,
            stage_id=a[0],
            async_chunk=True,
            stage_connector_config={"name": "SharedMemoryConnector", "extra": {"stage_id": a[0], **(mc_extra or {})}},
            custom_process_next_stage_input_func=k.get("next_func"),
            hf_config=SimpleNamespace(talker_config=SimpleNamespace(accept_hidden_layer=24)),
        )
        ad = OmniChunkTransferAdapter(
            SimpleNamespace(model_config=mc, scheduler_config=SimpleNamespace(max_num_seqs=8))
        )
        made.append(ad)
        return ad

    rid = f"oa-base-{os.getpid()}"
    try:
        handed, wire, _ = run_thinker_to_talker(make, rid)
    finally:
        for ad in made:
            ad.shutdown()
            ad.connector.close()
    assert no_shm_leftovers(rid)
    return handed, wire


def test_baseline_shape(baseline):
    handed, _ = baseline
    assert handed[0]["embed"]["prefill"].shape == (P + 1, D)
    assert handed[0]["hidden_states"]["output"].shape == (P + 1, D)
    assert all(h["embed"]["decode"].shape == (1, D) for h in handed[1:])
    assert handed[1]["speaker"] == "ethan" and handed[1]["language"] == ["English"]


@pytest.mark.parametrize("metrics", ["0", "1"])
def test_default_policy_consumer_payloads_identical(vo, adapters, baseline, monkeypatch, metrics):
    """``default``: the talker is handed 0.30.0's payloads, and the wire is 0.30.0's byte for byte, but for
    (metrics on) the hand-off's timestamp in the marker of the timed chunks (here chunk 0 only: the decode
    chunks are off the sample of every 16th; tests/test_integration_vllm_omni_handoff.py)."""
    monkeypatch.setenv("OMNI_ACCUM_METRICS", metrics)
    vo.install("default")
    rid = f"oa-def-{metrics}-{os.getpid()}"
    handed, wire, (tx, rx) = run_thinker_to_talker(adapters, rid)
    assert_same(handed, baseline[0], "handed")
    if metrics == "0":
        assert wire == baseline[1]
    else:  # chunk 0 timed (its sender heard the talker's hello in time): 4 small items under a 19-byte key
        meter = rx._omni_accum_binding.__dict__.get("_handoff")
        timed = meter is not None and sum(s[0] for s in meter.slots.values()) == 1
        assert (0 < wire - baseline[1] < 64) if timed else wire == baseline[1], (wire, baseline[1], timed)
    b_tx, b_rx = tx._omni_accum_binding, rx._omni_accum_binding
    assert b_tx.stats["omitted"] == 0
    assert b_tx.sender.active_requests == 0 and b_rx.receiver.active_requests == 0  # released at cleanup
    assert no_shm_leftovers(rid)


def test_qwen3_preset_equal_views_fewer_wire_bytes(vo, adapters, baseline):
    vo.install("qwen3-omni")
    rid = f"oa-q3-{os.getpid()}"
    handed, wire, (tx, rx) = run_thinker_to_talker(adapters, rid, heard=True)
    assert_same(handed, baseline[0], "handed")  # send_once values restored, prefill view equal
    assert wire < baseline[1], (wire, baseline[1])
    assert tx._omni_accum_binding.stats["omitted"] > 0
    assert rx._omni_accum_binding.receiver.active_requests == 0
    assert no_shm_leftovers(rid)


def test_policy_from_connector_extra_via_activation(vo, adapters, baseline, monkeypatch):
    monkeypatch.delenv("OMNI_ACCUM_POLICY", raising=False)
    vo.activate()
    assert not vo.is_installed()  # only the constructor probes
    rid = f"oa-ex-{os.getpid()}"
    handed, wire, (tx, _) = run_thinker_to_talker(adapters, rid, extra={"omni_accum_policy": "qwen3-omni"}, heard=True)
    assert vo.is_installed()
    assert tx._omni_accum_binding.source == "connector extra omni_accum_policy"
    assert_same(handed, baseline[0], "handed")
    assert wire < baseline[1]


def test_no_policy_nothing_changes(vo, adapters, baseline, monkeypatch):
    from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
        OmniChunkTransferAdapter as A,
    )

    probed = {t.name for t in vo.PROBES}  # the constructor: probed (and a target once installed)
    adapter = [t.name for t in vo.TARGETS if t.owner.endswith(":OmniChunkTransferAdapter")]
    before = {n: A.__dict__.get(n) for n in adapter if n not in probed}
    monkeypatch.delenv("OMNI_ACCUM_POLICY", raising=False)
    vo.activate()
    assert not vo.is_installed()
    assert {n: A.__dict__.get(n) for n in before} == before and before
    rid = f"oa-none-{os.getpid()}"
    handed, wire, (tx, rx) = run_thinker_to_talker(adapters, rid)
    assert_same(handed, baseline[0], "handed")
    assert wire == baseline[1]
    assert tx.__dict__.get("_omni_accum_binding", None) is None and not vo.is_installed()


def test_switch_off_patches_nothing(vo, monkeypatch):
    from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
        OmniChunkTransferAdapter as A,
    )

    init = A.__init__
    monkeypatch.setenv("OMNI_ACCUM_VLLM_OMNI", "0")
    monkeypatch.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    vo.activate()
    assert A.__init__ is init and not vo.is_installed()


def test_install_uninstall_idempotent(vo, monkeypatch):
    raw = {t: vo._resolve(t.owner).__dict__[t.name] for t in vo.TARGETS}
    vo.install("qwen3-omni")
    patched = {t: vo._resolve(t.owner).__dict__[t.name] for t in vo.TARGETS}
    assert all(patched[t] is not raw[t] for t in vo.TARGETS)
    vo.install("qwen3-omni")
    monkeypatch.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    vo.activate()
    assert {t: vo._resolve(t.owner).__dict__[t.name] for t in vo.TARGETS} == patched  # not wrapped twice
    vo.uninstall()
    assert {t: vo._resolve(t.owner).__dict__[t.name] for t in vo.TARGETS} == raw
    assert not vo.is_installed()
    vo.uninstall()  # safe when not installed


def test_signature_mismatch_refuses_and_patches_nothing(vo, monkeypatch):
    from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
        OmniChunkTransferAdapter as A,
    )

    def _commit_received_chunk(self, request, result, stage_id, req_id):  # a "newer" signature
        return True

    monkeypatch.setattr(A, "_commit_received_chunk", _commit_received_chunk)
    raw = {t: vo._resolve(t.owner).__dict__[t.name] for t in vo.TARGETS}
    with pytest.raises(vo.InstallRefused) as ei:
        vo.install("qwen3-omni")
    msg = str(ei.value)
    assert "OmniChunkTransferAdapter._commit_received_chunk" in msg and "0.30.0" in msg and "vllm-omni" in msg
    assert {t: vo._resolve(t.owner).__dict__[t.name] for t in vo.TARGETS} == raw
    assert not vo.is_installed()
    monkeypatch.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    vo.activate()  # logs the refusal, patches nothing
    assert {t: vo._resolve(t.owner).__dict__[t.name] for t in vo.TARGETS} == raw


def test_entry_point_registered(vllm_omni):
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="vllm_omni.general_plugins") if e.name == "omni_accum"]
    from omni_accum.integrations.vllm_omni import activate

    assert ep.load() is activate


# ---------------------------------------------------------------------------------------------- #
# Chunked prefill (vllm-omni PR #2997): the sender sends each prefill chunk as it comes, the AR
# receiver concatenates. 0.30.0 concatenates on the sender side, so the tests above only ever
# hand a whole ``embed.prefill`` over; here it arrives in several chunks.
# ---------------------------------------------------------------------------------------------- #


def chunked_prefill_thinker2talker(transfer_manager, multimodal_output, request, is_finished=False):
    """``thinker2talker_async_chunk`` without the sender-side stash: one payload per prefill chunk.

    Prefill steps (no output token yet) send their rows as ``embed.prefill`` /
    ``hidden_states.output`` with the per-request statics; decode steps go to the real processor.
    """
    from vllm_omni.data_entry_keys import (
        EmbeddingsStruct,
        HiddenStatesStruct,
        IdsStruct,
        MetaStruct,
        OmniPayloadStruct,
    )
    from vllm_omni.model_executor.stage_input_processors import qwen3_omni as q

    if request.output_token_ids:
        return q.thinker2talker_async_chunk(transfer_manager, multimodal_output, request, is_finished=is_finished)
    layers = multimodal_output["hidden_states"]["layers"]
    embed = multimodal_output["embed"]
    return OmniPayloadStruct(
        embed=EmbeddingsStruct(
            prefill=layers[0].detach().cpu(),
            tts_bos=embed["tts_bos"],
            tts_eos=embed["tts_eos"],
            tts_pad=embed["tts_pad"],
        ),
        hidden_states=HiddenStatesStruct(output=layers[24].detach().cpu()),
        ids=IdsStruct(prompt=list(request.prompt_token_ids)),
        meta=MetaStruct(finished=torch.tensor(is_finished, dtype=torch.bool)),
        speaker=q.extract_speaker_from_request(request),
        language=q.extract_language_from_request(request),
    )


def run_chunked_prefill(make, rid: str, *, heard: bool = False) -> tuple[list[dict], list[dict], list]:
    """Thinker adapter (chunked prefill) -> SHM -> AR talker adapter (``heard``: as ``run_thinker_to_talker``'s).

    Returns (handed-over payloads, thinker steps, adapters); one payload is handed over per step.
    """
    tx = make(0, next_func=f"{__name__}.chunked_prefill_thinker2talker")
    rx = make(1)
    if heard:
        _hear(tx)
    rreq = _request(rid, [], internal="rx-" + rid)
    steps = _thinker_steps(seed=3, decode_steps=3)
    handed: list[dict] = []
    out_ids: list[int] = []
    for i, mm in enumerate(steps):
        last = i == len(steps) - 1
        if i >= 3:
            out_ids.append(1000 + i)
        sreq = _request(rid, out_ids, finished=last)
        tx.save_async(multimodal_output=mm, request=sreq)
        _wait(lambda: tx.put_req_chunk.get(rid, 0) >= i + 1 or (last and rid not in tx.put_req_chunk), "put")
        handed.append(_receive_and_hand_over(rx, rreq))
    rx.cleanup(rreq.request_id, rid)
    tx.cleanup(sreq.request_id, rid)
    return handed, steps, [tx, rx]


def test_chunked_prefill_receiver_concatenates(vo, adapters):
    """AR receiver, several ``embed.prefill`` / ``hidden_states.output`` chunks: under qwen3-omni the
    view handed over is torch.cat of the chunks so far (bit for bit); under ``default`` every handed
    payload is what 0.30.0 alone hands over (the raw deltas)."""
    pid = os.getpid()
    base, steps, _ = run_chunked_prefill(adapters, f"oa-cp-base-{pid}")
    prefill_rows = [s["hidden_states"]["layers"][0] for s in steps[:3]]
    hidden_rows = [s["hidden_states"]["layers"][24] for s in steps[:3]]
    for k in range(3):  # 0.30.0 alone hands each chunk's rows over as they come
        assert torch.equal(base[k]["embed"]["prefill"], prefill_rows[k])
        assert torch.equal(base[k]["hidden_states"]["output"], hidden_rows[k])
    assert all("prefill" not in h["embed"] for h in base[3:])
    assert no_shm_leftovers(f"oa-cp-base-{pid}")

    vo.install("default")
    rid = f"oa-cp-def-{pid}"
    handed, _, (tx, rx) = run_chunked_prefill(adapters, rid)
    assert_same(handed, base, "handed")
    assert rx._omni_accum_binding.receiver.active_requests == 0
    assert no_shm_leftovers(rid)

    vo.install("qwen3-omni")
    rid = f"oa-cp-q3-{pid}"
    handed, _, (tx, rx) = run_chunked_prefill(adapters, rid, heard=True)
    assert tx._omni_accum_binding.stats["omitted"] > 0  # the statics went once
    for k in range(3):
        for got, rows in (
            (handed[k]["embed"]["prefill"], prefill_rows),
            (handed[k]["hidden_states"]["output"], hidden_rows),
        ):
            want = torch.cat(rows[: k + 1])
            assert got.dtype == want.dtype and got.shape == want.shape == (sum(r.shape[0] for r in rows[: k + 1]), D)
            assert torch.equal(got, want), k
        want = {key: value for key, value in base[k].items() if key not in ("embed", "hidden_states")}
        assert_same({key: value for key, value in handed[k].items() if key in want}, want, f"handed[{k}]")
        assert_same(
            {q: v for q, v in handed[k]["embed"].items() if q != "prefill"},
            {q: v for q, v in base[k]["embed"].items() if q != "prefill"},
            f"handed[{k}].embed",
        )
    assert_same(handed[3:], base[3:], "decode")  # decode deltas as upstream
    assert rx._omni_accum_binding.receiver.active_requests == 0
    assert no_shm_leftovers(rid)
