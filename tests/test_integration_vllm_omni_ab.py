"""Live A/B through the real vllm-omni adapters (SharedMemoryConnector, CPU): both stages agree on every
request's arm — when the first chunk announces it, when the receiver has no omni-accum (plain payloads), and
when the receiver never sees a request's first chunk."""

from __future__ import annotations

import json
import os

import pytest

from omni_accum.integrations.vllm_omni.binding import publish_pending
from omni_accum.policy import load_policy
from tests.test_integration_vllm_omni import (
    _receive_and_hand_over,
    _request,
    _thinker_steps,
    _wait,
    assert_same,
    run_thinker_to_talker,
)

pytestmark = pytest.mark.vllm

SPLIT = {"ab": {"arms": {"control": {"policy": "default"}, "treatment": {"policy": "qwen3-omni", "weight": 1}}}}
AB = {"omni_accum_policy": SPLIT}
OFF = {"omni_accum_policy": "off"}


def _t2t() -> str:
    from tests.test_integration_vllm_omni import T2T

    return T2T


def _ids(prefix: str, per_arm: int = 2) -> list[str]:
    """Request ids, ``per_arm`` of each arm (as the split's hash lays them out)."""
    split = load_policy(SPLIT).ab
    got: dict[str, list[str]] = {}
    i = 0
    while min((len(v) for v in got.values()), default=0) < per_arm or len(got) < 2:
        rid = f"{prefix}-{i}"
        got.setdefault(split.arm_for(rid), []).append(rid)
        i += 1
    return [r for v in got.values() for r in v[:per_arm]]


@pytest.fixture
def arms_seen(monkeypatch):
    """Record the arm each stage put each request on: ``{"send": {ext id: arm}, "receive": {ext id: arm}}``."""
    from omni_accum.integrations.vllm_omni import ab

    seen: dict[str, dict[str, str]] = {"send": {}, "receive": {}}
    send_arm, receive_arm = ab.send_arm, ab.receive_arm

    def send(b, ext_id):
        arm = send_arm(b, ext_id)
        assert seen["send"].setdefault(ext_id, arm.arm) == arm.arm, f"{ext_id}: two arms within one request"
        return arm

    def receive(b, adapter, req_id, payload, key=None):
        arm = receive_arm(b, adapter, req_id, payload, key)
        ext = req_id.removeprefix("rx-")  # the receiving adapter's id of request rid is rx-<rid> (_request)
        assert seen["receive"].setdefault(ext, arm.arm) == arm.arm, f"{ext}: two arms within one request"
        return arm

    monkeypatch.setattr(ab, "send_arm", send)
    monkeypatch.setattr(ab, "receive_arm", receive)
    return seen


@pytest.fixture
def base(vo, adapters):
    """What 0.30.0 alone hands the talker (omni-accum off on both stages)."""
    vo.install(None)
    it = iter((adapters(0, next_func=_t2t(), extra=OFF), adapters(1, extra=OFF)))
    return run_thinker_to_talker(lambda stage_id, **kw: next(it), f"oa-ab-base-{os.getpid()}")[0]


def _run(tx, rx, rid: str):
    it = iter((tx, rx))
    return run_thinker_to_talker(lambda stage_id, **kw: next(it), rid)[0]


def _bound(adapter):
    from omni_accum.integrations.vllm_omni.binding import binding_for

    b = binding_for(adapter)
    assert b is not None and b.arms is not None, "the split's binding was not made"
    return b


def _no_marker(handed: list[dict]) -> None:
    for h in handed:
        assert not any(str(k).startswith("__omni_accum") for k in h), sorted(h)


def test_both_stages_agree_on_every_requests_arm_and_hand_over_what_0_30_0_does(
    vo, adapters, base, arms_seen, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("OMNI_ACCUM_METRICS", raising=False)
    vo.install(None)
    tx, rx = adapters(0, next_func=_t2t(), extra=AB), adapters(1, extra=AB)
    txb, rxb = _bound(tx), _bound(rx)
    ids = _ids(f"oa-ab-{os.getpid()}")
    _run(tx, rx, f"oa-ab-warm-{os.getpid()}")  # the receiver's hello reaches the sender
    _wait(lambda: txb._peer.hello is not None, "the sender to see the receiver's hello")
    publish_pending()
    before = _ab_samples()
    # The receiver follows the arm the first chunk announces, not its own hash: make its hash say "control".
    real = rxb.split
    rxb.split = type("AllControl", (), {"arm_for": staticmethod(lambda rid: "control")})()
    try:
        chunks = {}
        for rid in ids:
            handed = chunks[rid] = _run(tx, rx, rid)
            assert_same(handed, base, rid)
    finally:
        rxb.split = real
    wanted = {rid: real.arm_for(rid) for rid in ids}
    assert {r: arms_seen["send"][r] for r in ids} == wanted
    assert {r: arms_seen["receive"][r] for r in ids} == wanted
    assert set(wanted.values()) == {"control", "treatment"}
    assert txb.stats["omitted"] > 0  # the treatment arm (qwen3-omni) left values off; the receiver put them back
    for arm in rxb.arms.values():
        assert not arm.foreign and not arm.fell_back  # every request ran its arm's policy, none went to 0.30.0
    assert rxb.arms["treatment"].fingerprint == f"{rxb.fingerprint}/treatment" == txb.arms["treatment"].fingerprint
    # The metrics carry the arm: requests on each side, every chunk's merge time, each first chunk's hand-off.
    publish_pending()
    after = _ab_samples()
    for arm in ("control", "treatment"):
        n = sum(1 for a in wanted.values() if a == arm)
        assert after[("requests", arm, "send")] - before[("requests", arm, "send")] == n
        assert after[("requests", arm, "receive")] - before[("requests", arm, "receive")] == n
        assert after[("merge", arm)] - before[("merge", arm)] == sum(len(chunks[r]) for r in ids if wanted[r] == arm)
        assert after[("handoff", arm)] - before[("handoff", arm)] == n  # the first chunk, timed as prefill
    # ... and omni-accum ab reads them from a scrape.
    from prometheus_client import REGISTRY, generate_latest

    from omni_accum.cli import main

    scrape = tmp_path / "metrics.txt"
    scrape.write_bytes(generate_latest(REGISTRY))
    assert main(["ab", "--metrics", str(scrape), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    merge = next(g for g in got["groups"] if g["what"] == "merge")
    assert set(merge["arms"]) >= {"control", "treatment"} and merge["baseline"] == "control"
    assert merge["arms"]["treatment"]["count"] >= after[("merge", "treatment")] - before[("merge", "treatment")]


def _ab_samples() -> dict[tuple[str, ...], float]:
    from prometheus_client import REGISTRY

    def v(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    out = {}
    for arm in ("control", "treatment"):
        for role in ("send", "receive"):
            out[("requests", arm, role)] = v("omni_accum_ab_requests_total", arm=arm, role=role)
        out[("merge", arm)] = v("omni_accum_ab_merge_seconds_count", arm=arm)
        out[("handoff", arm)] = v("omni_accum_ab_handoff_seconds_count", arm=arm, pair="0->1", kind="prefill")
    return out


def test_a_receiver_without_omni_accum_gets_plain_payloads_on_either_arm(vo, adapters, base, arms_seen):
    vo.install(None)
    tx, rx = adapters(0, next_func=_t2t(), extra=AB), adapters(1, extra=OFF)
    txb = _bound(tx)
    ids = _ids(f"oa-ab-plain-{os.getpid()}")
    for rid in ids:
        handed = _run(tx, rx, rid)
        assert_same(handed, base, rid)
        _no_marker(handed)
    from omni_accum.integrations.vllm_omni.binding import binding_for

    assert binding_for(rx) is None  # no omni-accum on the talker
    assert {arms_seen["send"][r] for r in ids} == {"control", "treatment"}  # the sender still split them ...
    assert not arms_seen["receive"]
    assert txb.stats["omitted"] == 0  # ... and sent each as vllm-omni built it
    assert txb._peer.hello is None


def _run_losing_the_first_chunk(tx, rx, rid: str) -> list[dict]:
    """As ``run_thinker_to_talker``, but the request's first chunk never reaches the receiver: it is taken
    off the connector before the receiver loads it, and the receiver asks for the second one first."""
    rreq = _request(rid, [], internal="rx-" + rid)
    handed, out_ids, sent = [], [], 0
    steps = _thinker_steps()
    for i, mm in enumerate(steps):
        last = i == len(steps) - 1
        if i >= 3:
            out_ids.append(1000 + i)
        sreq = _request(rid, out_ids, finished=last)
        tx.save_async(multimodal_output=mm, request=sreq)
        if i < 3:
            continue
        sent += 1
        _wait(lambda: tx.put_req_chunk.get(rid, 0) >= sent or (last and rid not in tx.put_req_chunk), "put")
        if sent == 1:
            lost = rx.connector.get("0", "1", f"{rid}_0_0")  # the first chunk, lost on the way
            assert lost is not None
            rx.get_req_chunk[rreq.request_id] = 1
            continue
        handed.append(_receive_and_hand_over(rx, rreq))
    rx.cleanup(rreq.request_id, rid)
    tx.cleanup(sreq.request_id, rid)
    return handed


def test_a_request_whose_first_chunk_is_lost_still_runs_the_senders_arm(vo, adapters, arms_seen):
    vo.install(None)
    tx, rx = adapters(0, next_func=_t2t(), extra=AB), adapters(1, extra=AB)
    txb, rxb = _bound(tx), _bound(rx)
    _run(tx, rx, f"oa-ab-warm2-{os.getpid()}")
    _wait(lambda: txb._peer.hello is not None, "the sender to see the receiver's hello")
    ids = _ids(f"oa-ab-lost-{os.getpid()}")
    for rid in ids:
        handed = _run_losing_the_first_chunk(tx, rx, rid)
        assert handed  # the later chunks were handed over
    wanted = {rid: txb.split.arm_for(rid) for rid in ids}
    assert {r: arms_seen["send"][r] for r in ids} == wanted
    # The receiver never saw the hello: it took the arm of the sender's request id (its adapter's mapping), the
    # sender's own rule, so the same arm: never a request of one arm read under the other's policy.
    assert {r: arms_seen["receive"][r] for r in ids} == wanted
    assert set(wanted.values()) == {"control", "treatment"}
    for arm in rxb.arms.values():
        assert not arm.foreign  # no request was taken for another policy's


def test_a_capture_under_a_split_names_each_requests_arm_and_that_arms_strategies(
    vo, adapters, tmp_path, monkeypatch
):
    """OMNI_ACCUM_CAPTURE with an A/B split: every record (both stages) names the arm its request ran, and the
    strategy column is that arm's policy's (control `default`: cat; treatment `qwen3-omni`: not cat)."""
    from omni_accum.capture.reader import read_capture
    from omni_accum.capture.recorder import request_hash
    from omni_accum.capture.writer import read_salt
    from omni_accum.integrations.vllm_omni import capture

    folder = tmp_path / "cap"
    monkeypatch.setenv("OMNI_ACCUM_CAPTURE", str(folder))
    vo.install(None)
    try:
        tx, rx = adapters(0, next_func=_t2t(), extra=AB), adapters(1, extra=AB)
        split = _bound(tx).split
        ids = _ids(f"oa-ab-cap-{os.getpid()}")
        for rid in ids:
            _run(tx, rx, rid)
        capture.flush_all()
    finally:
        capture.close_all()
    salt = read_salt(folder)
    arm_of = {request_hash(salt, rid): split.arm_for(rid) for rid in ids}
    cap = read_capture(folder)
    assert cap.problems == []
    seen: dict[tuple[str, str], set[str]] = {}
    for rec in cap.records:
        assert rec["arm"] == arm_of[rec["req"]], rec
        for key in rec["keys"]:
            if key[0] == "embed.prefill":
                seen.setdefault((rec["arm"], rec["role"]), set()).add(key[5])
    assert set(arm_of.values()) == {"control", "treatment"}
    for role in ("send", "recv"):
        assert seen[("control", role)] == {"cat"}, seen
        assert "cat" not in seen[("treatment", role)], seen
