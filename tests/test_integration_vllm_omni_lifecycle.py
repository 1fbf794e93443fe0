"""Lifecycle of omni-accum inside the real vllm-omni 0.30.0 classes, on CPU (no mocks of vllm-omni):
uninstall / reinstall mid-request, the fallback to upstream's code for chunks omni-accum refuses,
the deployment context of tuned tables, and the replay engine keeping an installed policy."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.test_integration_vllm_omni import (
    T2T,
    _hear,
    _receive_and_hand_over,
    _request,
    _thinker_steps,
    _wait,
    assert_same,
    no_shm_leftovers,
    wait_for_release,
)

pytestmark = pytest.mark.vllm
D = 2048
POLICIES = ["default", "qwen3-omni"]
LOGGER = "omni_accum.vllm_omni"


def drive(
    tx: Any,
    rx: Any,
    rid: str,
    steps: list[dict],
    *,
    puts_from: int = 3,
    before: Callable[[int], None] = lambda i: None,
    after: Callable[[int], None] = lambda i: None,
) -> list[dict]:
    """Thinker adapter -> SHM -> AR talker adapter, one step at a time; returns the handed-over payloads.

    Steps before ``puts_from`` put nothing (the thinker processor stashes prefill rows); ``before(i)``
    and ``after(i)`` run around step i, while no chunk is in transfer.
    """
    rreq = _request(rid, [], internal="rx-" + rid)
    handed: list[dict] = []
    out_ids: list[int] = []
    sent = 0
    for i, mm in enumerate(steps):
        before(i)
        last = i == len(steps) - 1
        if i >= 3:
            out_ids.append(1000 + i)
        sreq = _request(rid, out_ids, finished=last)
        tx.save_async(multimodal_output=mm, request=sreq)
        if i >= puts_from:
            sent += 1
            _wait(lambda: tx.put_req_chunk.get(rid, 0) >= sent or (last and rid not in tx.put_req_chunk), "put")
            handed.append(_receive_and_hand_over(rx, rreq))
        after(i)
    rx.cleanup(rreq.request_id, rid)
    tx.cleanup(sreq.request_id, rid)
    wait_for_release(tx, rid)
    return handed


def fallback_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "refused a chunk" in r.getMessage()]


# ---------------------------------------------------------------------------------------------- #
# 1. uninstall with a full-payload entry pending
# ---------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("policy", POLICIES)
def test_uninstall_hands_pending_full_payload_entries_back(vo, runner, policy):
    g = torch.Generator().manual_seed(11)
    steps = [
        {"embed.prefill": torch.randn(5, D, generator=g), "codes.audio": torch.randint(0, 9, (1, 16))},
        {"embed.prefill": torch.randn(1, D, generator=g), "codes.audio": torch.randint(0, 9, (1, 16))},
        {"embed.prefill": torch.randn(2, D, generator=g), "meta.left": torch.tensor(3)},
    ]

    def run(r: Any, between: Callable[[], None] = lambda: None) -> Any:
        r.accumulate_full_payload_output("q", dict(steps[0]), "REQ")
        between()
        for s in steps[1:]:
            r.accumulate_full_payload_output("q", dict(s), "REQ")
        return r._materialize_full_payload_entry(r._pending_full_payload_send.pop("q"))

    expected = run(runner())
    vo.install(policy)
    r = runner()
    got = run(r, vo.uninstall)  # the first step under omni-accum, the others under upstream's restored code
    assert_same(got, expected, "materialized")
    assert "_omni_accum_binding" not in r.__dict__


# ---------------------------------------------------------------------------------------------- #
# 2. uninstall detaches every instance; a later install starts clean
# ---------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("policy", POLICIES)
def test_reinstall_mid_request_reseeds_from_upstream(vo, runner, policy):
    chunks = [{"embed": {"decode": torch.full((1, D), float(i)).bfloat16()}} for i in range(4)]
    up = runner()
    expected = [up._accumulate_payload("r", c) for c in chunks]

    r = runner()
    vo.install(policy)
    got = [r._accumulate_payload("r", c) for c in chunks[:2]]
    old = r._omni_accum_binding
    vo.uninstall()
    assert "_omni_accum_binding" not in r.__dict__
    assert type(r._send_side_request_payload) is dict and "r" in r._send_side_request_payload
    assert old.receiver.active_requests == 0
    got.append(r._accumulate_payload("r", chunks[2]))  # upstream's code merges this one alone
    vo.install(policy)
    got.append(r._accumulate_payload("r", chunks[3]))
    assert_same(got, expected, "views")
    assert r._omni_accum_binding is not old
    assert [v["embed"]["decode"][:, 0].tolist() for v in got][-1] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("policy", POLICIES)
def test_uninstall_detaches_adapters_and_reinstall_carries_on(vo, adapters, policy):
    """Adapters: uninstall mid-request releases the sender / receiver state, drops the binding and
    unwraps the connector ``put``; a request running through install, uninstall and install again
    hands the talker exactly what 0.30.0 alone hands it."""
    pid = os.getpid()
    steps = _thinker_steps(seed=5, decode_steps=6)
    base = drive(adapters(0, next_func=T2T), adapters(1), f"oa-lc-base-{pid}", steps)
    assert no_shm_leftovers(f"oa-lc-base-{pid}")

    tx, rx = adapters(0, next_func=T2T), adapters(1)
    bound: dict[str, Any] = {}

    def before(i: int) -> None:
        if i == 3:
            vo.install(policy)
        elif i == 5:  # after two puts under omni-accum
            bound.update(tx=tx._omni_accum_binding, rx=rx._omni_accum_binding)
            vo.uninstall()
            for a in (tx, rx):
                assert "_omni_accum_binding" not in a.__dict__
                assert "put" not in a.connector.__dict__  # never replaced on the instance
                assert not getattr(type(a.connector).put, "__omni_accum_put__", False)  # the class's own again
            assert bound["tx"].sender.active_requests == 0 and not bound["tx"].sent_once
            assert bound["rx"].receiver.active_requests == 0 and not bound["rx"].held_once
        elif i == 7:
            vo.install(policy)

    rid = f"oa-lc-{pid}"
    handed = drive(tx, rx, rid, steps, before=before)
    assert_same(handed, base, "handed")
    assert tx._omni_accum_binding is not bound["tx"] and rx._omni_accum_binding is not bound["rx"]
    assert tx._omni_accum_binding.sender.active_requests == 0
    assert rx._omni_accum_binding.receiver.active_requests == 0
    assert no_shm_leftovers(rid)


# ---------------------------------------------------------------------------------------------- #
# 3. chunks omni-accum refuses: upstream's code takes them, as 0.30.0 does
# ---------------------------------------------------------------------------------------------- #


def _decode_chunks(case: str) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    if case == "dtype":  # upstream's torch.cat promotes
        rows = [
            torch.randn(1, D, generator=g).bfloat16(),
            torch.randn(1, D, generator=g),
            torch.randn(2, D, generator=g),
            torch.randn(1, D, generator=g).bfloat16(),
            torch.randn(1, D, generator=g),
        ]
    else:  # "empty": a legacy empty tensor, then rows (upstream's torch.cat takes it)
        rows = [torch.empty(0), torch.randn(2, D, generator=g), torch.randn(1, D, generator=g)]
    return [{"embed": {"decode": t}, "speaker": "ethan", "meta": {"finished": torch.tensor(False)}} for t in rows]


@pytest.mark.parametrize("case", ["dtype", "empty"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("target", ["runner", "data_plane"])
def test_refused_chunk_falls_back_to_upstream_accumulate(vo, runner, data_plane, caplog, target, policy, case):
    """Runner ``_accumulate_payload``: the views equal 0.30.0's own, chunk by chunk, including the
    send_once values the sender (qwen3-omni) left off a refused chunk; one warning per request."""
    from omni_accum.context import StreamContext
    from omni_accum.integrations.vllm_omni.replay import VllmOmniEngine
    from omni_accum.policy import load_policy

    make = runner if target == "runner" else data_plane
    chunks = _decode_chunks(case)
    up = make()
    expected = [up._accumulate_payload("r", dict(c)) for c in chunks]

    sender = VllmOmniEngine(load_policy(policy), StreamContext())  # encodes as the adapter send hook does
    vo.install(policy)
    t = make()
    got = []
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            for k, c in enumerate(chunks):
                wire = dict(sender.encode("r", c))
                if policy == "qwen3-omni" and k:
                    assert "speaker" not in wire  # left off: upstream's store has it
                got.append(t._accumulate_payload("r", wire))
    finally:
        sender.close()
    assert_same(got, expected, "views")
    b = t._omni_accum_binding
    assert "r" in b.receiver.request_ids()  # the last chunk went through omni-accum again (re-seeded)
    (msg,) = fallback_warnings(caplog)
    assert "'r'" in msg and "'embed.decode'" in msg and "_accumulate_payload" in msg
    t._send_side_request_payload.pop("r")  # upstream's release point
    assert b.receiver.active_requests == 0 and "r" not in b.fell_back


@pytest.mark.parametrize("policy", POLICIES)
def test_refused_step_falls_back_to_upstream_full_payload(vo, runner, caplog, policy):
    g = torch.Generator().manual_seed(8)
    steps = [
        {"embed.prefill": torch.randn(5, D, generator=g).bfloat16(), "codes.audio": torch.randint(0, 9, (1, 16))},
        {"embed.prefill": torch.randn(1, D, generator=g), "codes.audio": torch.randint(0, 9, (1, 16))},
        {"embed.prefill": torch.randn(2, D, generator=g).bfloat16(), "codes.audio": torch.randint(0, 9, (1, 16))},
    ]

    def run(r: Any) -> Any:
        for s in steps:
            r.accumulate_full_payload_output("q", dict(s), "REQ")
        return r._materialize_full_payload_entry(r._pending_full_payload_send.pop("q"))

    expected = run(runner())
    assert expected[0]["embed.prefill"].dtype == torch.float32 and expected[0]["embed.prefill"].shape == (8, D)
    vo.install(policy)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = run(runner())
    assert_same(got, expected, "materialized")
    (msg,) = fallback_warnings(caplog)
    assert "'q'" in msg and "'embed.prefill'" in msg


def _chunked_prefill_steps() -> list[dict]:
    """Thinker steps whose second prefill chunk comes in float32 (the others bfloat16)."""
    steps = _thinker_steps(seed=9, decode_steps=3)
    steps[1]["hidden_states"]["layers"][0] = steps[1]["hidden_states"]["layers"][0].float()
    return steps


@pytest.mark.parametrize("policy", POLICIES)
def test_refused_chunk_falls_back_in_the_adapter(vo, adapters, caplog, policy):
    """AR receiving adapter under chunked prefill, an ``embed.prefill`` chunk in another dtype: every
    handed-over payload is 0.30.0's (default); under qwen3-omni the accumulated prefill view is
    0.30.0's ``torch.cat`` of the chunks so far (promoted), the statics left off are restored, and
    everything else is what 0.30.0 hands over."""
    next_func = "tests.test_integration_vllm_omni.chunked_prefill_thinker2talker"
    pid = os.getpid()
    steps = _chunked_prefill_steps()
    base = drive(adapters(0, next_func=next_func), adapters(1), f"oa-fb-base-{pid}", steps, puts_from=0)
    prefill = [s["hidden_states"]["layers"][0] for s in steps[:3]]
    assert base[1]["embed"]["prefill"].dtype == torch.float32  # 0.30.0 hands the raw chunk over

    vo.install(policy)
    rid = f"oa-fb-{policy}-{pid}"
    tx, rx = adapters(0, next_func=next_func), adapters(1)
    if policy != "default":  # its values are left off once the sender heard the receiver's hello
        _hear(tx)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        handed = drive(tx, rx, rid, steps, puts_from=0)
    assert no_shm_leftovers(rid)
    assert rx._omni_accum_binding.receiver.active_requests == 0
    if policy == "default":
        assert_same(handed, base, "handed")  # cat keys are handed over raw: nothing to refuse
        assert not fallback_warnings(caplog)
        return
    assert tx._omni_accum_binding.stats["omitted"] > 0  # the statics went once
    for k in range(3):
        want = torch.cat(prefill[: k + 1])
        assert_same(handed[k]["embed"]["prefill"], want, f"prefill[{k}]")
        assert_same(
            handed[k]["hidden_states"]["output"],
            torch.cat([s["hidden_states"]["layers"][24] for s in steps[: k + 1]]),
            f"output[{k}]",
        )
        assert_same(
            {key: v for key, v in handed[k].items() if key not in ("embed", "hidden_states")},
            {key: v for key, v in base[k].items() if key not in ("embed", "hidden_states")},
            f"handed[{k}]",
        )
        assert_same(
            {q: v for q, v in handed[k]["embed"].items() if q != "prefill"},
            {q: v for q, v in base[k]["embed"].items() if q != "prefill"},
            f"handed[{k}].embed",
        )
    assert_same(handed[3:], base[3:], "decode")
    (msg,) = fallback_warnings(caplog)
    assert "'embed.prefill'" in msg and "adapter" in msg


# ---------------------------------------------------------------------------------------------- #
# 4. the deployment context of tuned tables
# ---------------------------------------------------------------------------------------------- #


def _tuned_policy() -> dict:
    from omni_accum.policy.environment import current_fingerprint

    def cell(cl: int, c: int, s: str) -> dict:
        return {"key": "thinker_embeddings", "context_len": cl, "concurrency": c, "strategy": s}

    return {
        "version": 1,
        "default": "cat",
        "tuned": {
            "context_len_edges": [1000, 8000],
            "concurrency_edges": [1, 10],
            "fingerprint": current_fingerprint("cpu"),
            "cells": [cell(1000, 1, "cat"), cell(1000, 10, "cat"), cell(8000, 1, "cat"), cell(8000, 10, "prealloc")],
        },
    }


def _strategy(r: Any) -> str:
    r._accumulate_payload("q", {"thinker_embeddings": torch.zeros(4, 8)})
    b = r._omni_accum_binding
    return b.receiver._requests["q"].entries["thinker_embeddings"].spec.name


@pytest.fixture
def no_context_env(monkeypatch):
    monkeypatch.delenv("OMNI_ACCUM_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("OMNI_ACCUM_CONCURRENCY", raising=False)
    return monkeypatch


def test_deployment_context_from_environment(vo, runner, no_context_env, caplog):
    from omni_accum.context import StreamContext

    no_context_env.setenv("OMNI_ACCUM_CONTEXT_LEN", "9000")
    no_context_env.setenv("OMNI_ACCUM_CONCURRENCY", "12")
    vo.install(_tuned_policy())
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        r = runner()
        assert _strategy(r) == "prealloc"
    b = r._omni_accum_binding
    want = StreamContext(context_len=9000, concurrency=12)
    assert b.context == b.receiver.context == b.sender.context == b.full_payload_endpoint.context == want
    assert b.policy.tuned.clamped_lookups > 0  # 12 is above the last concurrency edge: counted
    assert not [m for m in caplog.messages if "tuned table" in m]


def test_deployment_context_from_connector_extra_beats_environment(vo, runner, no_context_env):
    from omni_accum.context import StreamContext

    no_context_env.setenv("OMNI_ACCUM_CONTEXT_LEN", "500")
    no_context_env.setenv("OMNI_ACCUM_CONCURRENCY", "1")
    vo.install(_tuned_policy())
    r = runner({"omni_accum_context_len": "8k", "omni_accum_concurrency": 10})
    assert _strategy(r) == "prealloc"
    assert r._omni_accum_binding.context == StreamContext(context_len=8000, concurrency=10)
    r = runner({"omni_accum_concurrency": 10})  # context length from the environment
    assert _strategy(r) == "cat"
    assert r._omni_accum_binding.context == StreamContext(context_len=500, concurrency=10)


def test_tuned_table_without_context_says_once_how_buckets_are_chosen(vo, runner, no_context_env, caplog):
    """A request without the sender's decision (here: merged by a runner with no sender) resolves in the
    first bucket; the one log line says so, and that the deployment context would fix one bucket for all."""
    vo.install(_tuned_policy())
    with caplog.at_level(logging.INFO, logger=LOGGER):
        strategies = [_strategy(runner()) for _ in range(2)]
    assert strategies == ["cat", "cat"]  # the first bucket
    (rec,) = [r for r in caplog.records if "tuned table" in r.getMessage()]
    msg = rec.getMessage()
    assert rec.levelno == logging.INFO  # the per-request decision is the normal case, not a problem
    assert "decides each request's bucket" in msg and "first bucket" in msg
    assert "OMNI_ACCUM_CONTEXT_LEN" in msg and "omni_accum_concurrency" in msg


@pytest.mark.parametrize(
    ("var", "value"),
    [("OMNI_ACCUM_CONTEXT_LEN", "abc"), ("OMNI_ACCUM_CONCURRENCY", "0"), ("OMNI_ACCUM_CONCURRENCY", "2.5"),
     ("OMNI_ACCUM_CONTEXT_LEN", "\u0663k")],  # Arabic-Indic 3 was taken as 3000: ASCII digits only, as sizes
)  # fmt: skip
def test_bad_context_environment_refuses_install(vo, no_context_env, var, value):
    from omni_accum.integrations.vllm_omni import ContextSettingError

    no_context_env.setenv(var, value)
    with pytest.raises(ContextSettingError, match=f"environment variable {var}={value!r}"):
        vo.install("default")
    assert not vo.is_installed()


def test_bad_context_connector_extra_is_named_and_upstream_runs(vo, runner, no_context_env, caplog):
    """A bad setting in one connector's extra never fails vllm-omni: that instance runs 0.30.0's code,
    and one error says so naming the setting and its value (another, when it is built, names it too)."""
    vo.install("default")
    r = runner({"omni_accum_concurrency": -3})
    with caplog.at_level(logging.ERROR, logger="omni_accum"):
        first = r._accumulate_payload("q", {"x": torch.zeros(1, 2)})
        second = r._accumulate_payload("q", {"x": torch.ones(1, 2)})
    assert torch.equal(first["x"], torch.zeros(1, 2))
    assert torch.equal(second["x"], torch.cat([torch.zeros(1, 2), torch.ones(1, 2)]))  # upstream's merge
    errors = [m for m in caplog.messages if "omni_accum_concurrency=-3" in m]
    # one says this instance runs vllm-omni's own code; the check when the transport is built (as for an adapter:
    # fatal under OMNI_ACCUM_REQUIRED=1) names the setting too
    assert sum("vllm-omni's own code" in m for m in errors) == 1 and len(errors) == 2, caplog.messages
    assert r.__dict__["_omni_accum_binding"] is None


# ---------------------------------------------------------------------------------------------- #
# 5. the --through vllm-omni replay engine keeps an installed policy
# ---------------------------------------------------------------------------------------------- #


def test_replay_engine_keeps_installed_policy(vo, runner):
    from omni_accum.context import StreamContext
    from omni_accum.integrations.vllm_omni import binding as hooks
    from omni_accum.integrations.vllm_omni.replay import VllmOmniEngine

    vo.install("qwen3-omni")
    policy = hooks.Settings.policy
    engine = VllmOmniEngine(None, StreamContext())
    engine.close()
    assert hooks.Settings.policy is policy and vo.is_installed()
    r = runner()
    r._accumulate_payload("q", {"speaker": "a"})
    assert r._omni_accum_binding.policy is policy and r._omni_accum_binding.source == "install()"
