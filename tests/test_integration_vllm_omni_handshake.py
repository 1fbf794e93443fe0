"""The stage handshake: the sender decides a request's tuned bucket and says which policy it runs in the
request's first wire marker; the receiver follows the bucket, and hands a request sent under another
policy to vllm-omni 0.30.0's own code (real runner transports and adapters, CPU)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tests.test_integration_vllm_omni import assert_same, run_thinker_to_talker

pytestmark = pytest.mark.vllm


def _tuned(key: str, small: str, large: str) -> dict:
    return _tuned_cells(key, [(1000, 1, small), (32000, 1, large)], [1000, 32000], [1])


def _tuned_cells(key: str, cells: list[tuple[int, int, str]], context_edges: list[int], conc_edges: list[int]) -> dict:
    """A policy whose tuned table (measured here) gives ``key`` the strategy of each (context, concurrency) cell."""
    from omni_accum.policy.environment import current_fingerprint

    return {
        "default": "cat",
        "tuned": {
            "context_len_edges": context_edges,
            "concurrency_edges": conc_edges,
            "fingerprint": current_fingerprint("cpu"),
            "cells": [{"key": key, "context_len": c, "concurrency": k, "strategy": s} for c, k, s in cells],
        },
    }


def _sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def no_context_env(monkeypatch):
    monkeypatch.delenv("OMNI_ACCUM_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("OMNI_ACCUM_CONCURRENCY", raising=False)
    return monkeypatch


def test_1k_and_32k_requests_take_their_own_buckets(vo, runner, no_context_env):
    """One deployment, two prompts: the sender decides each request's bucket from its prefill rows, the
    receiving runner transport follows it (strategies per request), and the metrics say which bucket."""
    from omni_accum.integrations.vllm_omni.binding import Binding
    from omni_accum.integrations.vllm_omni.binding_settings import DEFAULT_ADAPTER_KEYS
    from omni_accum.integrations.vllm_omni.marker import OMITTED_KEY, hello_of
    from omni_accum.integrations.vllm_omni.send import encode_payload
    from omni_accum.policy import load_policy

    policy = load_policy(_tuned("thinker_embeddings", "token_list", "prealloc"))
    tx = Binding(policy, DEFAULT_ADAPTER_KEYS, "tuned.yaml")
    vo.install(policy)
    rx = runner()
    before = {
        c: _sample("omni_accum_requests_total", role="receive", context_bucket=c, concurrency_bucket="1")
        for c in ("1000", "32000")
    }
    got = {}
    for rid, rows in (("r-1k", 1000), ("r-32k", 32000)):
        first = torch.randn(rows, 8).bfloat16()
        wire = encode_payload(tx, rid, {"thinker_embeddings": first})
        fp, bucket, source = hello_of(wire[OMITTED_KEY])
        assert fp == tx.fingerprint and source == "tuned.yaml"
        got[rid] = bucket
        view = rx._accumulate_payload(rid, wire)
        assert OMITTED_KEY not in view
        step = torch.randn(1, 8).bfloat16()
        view = rx._accumulate_payload(rid, encode_payload(tx, rid, {"thinker_embeddings": step}))
        assert torch.equal(view["thinker_embeddings"], torch.cat([first, step]))
    assert got == {"r-1k": 0, "r-32k": 1}
    b = rx._omni_accum_binding
    strategies = {rid: b.receiver._requests[rid].entries["thinker_embeddings"].spec.name for rid in got}
    assert strategies == {"r-1k": "token_list", "r-32k": "prealloc"}
    edges = {"r-1k": 1000, "r-32k": 32000}
    assert {rid: tx.sender._requests[rid].context.context_len for rid in got} == edges  # both ends, one bucket
    assert {rid: b.receiver._requests[rid].context.context_len for rid in got} == edges
    for rid in got:
        rx._send_side_request_payload.pop(rid)  # upstream's release: the metrics are published soon after
    from omni_accum.integrations.vllm_omni.binding import publish_pending

    publish_pending()  # at once (else on the publisher thread)
    for c in ("1000", "32000"):
        after = _sample("omni_accum_requests_total", role="receive", context_bucket=c, concurrency_bucket="1")
        assert after - before[c] == 1, c


def test_deployment_context_still_overrides(vo, runner, no_context_env):
    from omni_accum.integrations.vllm_omni.binding import Binding
    from omni_accum.integrations.vllm_omni.binding_settings import DEFAULT_ADAPTER_KEYS
    from omni_accum.integrations.vllm_omni.marker import OMITTED_KEY, hello_of
    from omni_accum.integrations.vllm_omni.send import encode_payload
    from omni_accum.policy import load_policy

    no_context_env.setenv("OMNI_ACCUM_CONTEXT_LEN", "32000")
    policy = load_policy(_tuned("thinker_embeddings", "token_list", "prealloc"))
    tx = Binding(policy, DEFAULT_ADAPTER_KEYS, "t", context=vo.deployment_context())
    wire = encode_payload(tx, "r-small", {"thinker_embeddings": torch.zeros(10, 8)})
    assert hello_of(wire[OMITTED_KEY])[1] == 1  # the explicit setting, not the 10 rows


def _combo(adapters, tx_policy: str, rx_policy: str, rid: str, *, heard: bool = False):
    def make(stage_id, **kw):
        return adapters(stage_id, **{**kw, "extra": {"omni_accum_policy": tx_policy if stage_id == 0 else rx_policy}})

    return run_thinker_to_talker(make, rid, heard=heard)


@pytest.mark.parametrize(
    ("tx_policy", "rx_policy"),
    [
        ("default", "default"),
        ("default", "off"),
        ("off", "default"),
        ("off", "off"),
        # a policy that changes the wire (send_once leaves the statics off, prealloc accumulates)
        ("qwen3-omni", "qwen3-omni"),
        ("off", "qwen3-omni"),
        ("default: prealloc", "off"),  # receiver-side strategies only: nothing left off, nothing marked
        # a sender that would change the wire, beside a receiver without omni-accum: no hello came, so the
        # sender sends 0.30.0's payloads (nothing left off, no marker)
        ("qwen3-omni", "off"),
    ],
)
def test_four_on_off_combinations_hand_over_what_0_30_0_does(vo, adapters, tx_policy, rx_policy):
    vo.install(None)  # patched; each connector's extra decides
    base, _, _ = _combo(adapters, "off", "off", f"oa-hs-base-{os.getpid()}")
    heard = tx_policy == "qwen3-omni" and rx_policy != "off"  # its values are left off once the hello is heard
    handed, _, (tx, rx) = _combo(adapters, tx_policy, rx_policy, f"oa-hs-{tx_policy}-{rx_policy}-{os.getpid()}",
                                 heard=heard)  # fmt: skip
    assert_same(handed, base, "handed")
    assert (tx._omni_accum_binding is not None) == (tx_policy != "off")
    assert (rx._omni_accum_binding is not None) == (rx_policy != "off")
    if tx_policy == "qwen3-omni":
        omitted = tx._omni_accum_binding.stats["omitted"]
        assert (omitted > 0) == (rx_policy != "off")  # values were left off (and put back) only for omni-accum
    if rx_policy == "qwen3-omni":
        assert rx._omni_accum_binding.stats["chunks_received"] == len(handed)  # omni-accum took every chunk


def test_policy_mismatch_is_logged_counted_and_handed_to_0_30_0(vo, adapters, caplog):
    vo.install(None)
    base, _, _ = _combo(adapters, "off", "off", f"oa-mm-base-{os.getpid()}")
    before = _sample("omni_accum_fallbacks_total", reason="policy_mismatch")
    rid = f"oa-mm-{os.getpid()}"
    with caplog.at_level(logging.ERROR, logger="omni_accum"):
        handed, _, (tx, rx) = _combo(adapters, "qwen3-omni", "default", rid, heard=True)
    assert tx._omni_accum_binding.stats["omitted"] > 0  # the sender left values off ...
    assert_same(handed, base, "handed")  # ... and the consumer still sees 0.30.0's payloads
    errors = [m for m in caplog.messages if "another policy" in m]
    assert len(errors) == 1, caplog.messages  # once per request
    txb, rxb = tx._omni_accum_binding, rx._omni_accum_binding
    assert txb.fingerprint in errors[0] and rxb.fingerprint in errors[0] and txb.fingerprint != rxb.fingerprint
    assert "policy from extra" in errors[0] and "connector extra omni_accum_policy" in errors[0]
    rx.connector  # noqa: B018 - still usable
    rxb.publish()
    assert _sample("omni_accum_fallbacks_total", reason="policy_mismatch") - before == 1


def test_default_sender_announces_nothing(vo, adapters):
    """A sender whose policy cannot change the wire adds no marker: a receiver without omni-accum gets
    exactly 0.30.0's payload (no extra key)."""
    vo.install(None)
    handed, _, _ = _combo(adapters, "default", "off", f"oa-quiet-{os.getpid()}")
    for h in handed:
        assert not any(str(k).startswith("__omni_accum") for k in h), sorted(h)


def _sender(policy_spec: dict):
    from omni_accum.integrations.vllm_omni.binding import Binding
    from omni_accum.integrations.vllm_omni.binding_settings import DEFAULT_ADAPTER_KEYS
    from omni_accum.policy import load_policy

    return Binding(load_policy(policy_spec), DEFAULT_ADAPTER_KEYS, "tuned.yaml")


def _bucket(tx, rid: str, chunk: dict) -> int:
    from omni_accum.integrations.vllm_omni.marker import OMITTED_KEY, hello_of
    from omni_accum.integrations.vllm_omni.send import encode_payload

    return hello_of(encode_payload(tx, rid, chunk)[OMITTED_KEY])[1]


def test_chunked_prefill_is_decided_by_the_prompt_length_the_chunk_carries(vo, no_context_env):
    """The first of several prefill chunks has the chunk's rows, not the prompt's: ``ids.prompt`` (the
    whole prompt) decides; without it the rows of the first append key do."""
    tx = _sender(_tuned_cells("embed.prefill", [(1000, 1, "token_list"), (32000, 1, "prealloc")], [1000, 32000], [1]))
    prefill_chunk = torch.zeros(2048, 8)  # one chunk of a chunked prefill
    with_prompt = {"embed": {"prefill": prefill_chunk}, "ids": {"prompt": list(range(40000))}}
    assert _bucket(tx, "r-chunked", with_prompt) == 1  # 40000 tokens: the 32k bucket
    tensor_prompt = {"embed": {"prefill": prefill_chunk}, "ids": {"prompt": torch.arange(33000)}}
    assert _bucket(tx, "r-tensor-prompt", tensor_prompt) == 1
    assert _bucket(tx, "r-rows", {"embed": {"prefill": prefill_chunk}}) == 0  # 2048 rows: the 1k bucket
    assert _bucket(tx, "r-rows-32k", {"embed": {"prefill": torch.zeros(32000, 8)}}) == 1
    assert tx.sender._requests["r-chunked"].context.context_len == 32000  # the sender encodes in it too


def test_a_first_chunk_without_an_append_key_nor_a_prompt_takes_the_first_bucket(vo, no_context_env):
    tx = _sender(_tuned_cells("embed.prefill", [(1000, 1, "token_list"), (32000, 1, "prealloc")], [1000, 32000], [1]))
    assert _bucket(tx, "r-meta-only", {"meta": {"finished": torch.tensor(False)}, "speaker": "Ethan"}) == 0
    assert _bucket(tx, "r-prompt-only", {"ids": {"prompt": list(range(32000))}, "speaker": "Ethan"}) == 1


def test_the_concurrency_is_the_requests_live_on_the_sender(vo, no_context_env):
    """Requests live on the sending binding when a request's first chunk goes out (itself included) give
    its concurrency bucket; released ones no longer count."""
    from omni_accum.integrations.vllm_omni.send import _release_sender

    tx = _sender(
        _tuned_cells("embed.prefill", [(1000, 1, "token_list"), (1000, 4, "prealloc")], [1000], [1, 4])
    )
    first = {"embed": {"prefill": torch.zeros(1000, 8)}}
    got = [_bucket(tx, f"r-{i}", first) for i in range(5)]
    assert got == [0, 0, 0, 1, 1]  # concurrency 1, 2, 3 -> the c1 bucket; 4, 5 -> c4
    for i in range(5):
        _release_sender(tx, f"r-{i}")  # what the adapter's sender-state release runs
    assert _bucket(tx, "r-after", first) == 0  # alone again
