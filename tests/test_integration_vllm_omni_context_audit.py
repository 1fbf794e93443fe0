"""Which tuned bucket a live request runs (an audit of which strategy a key gets):

* ``OMNI_ACCUM_CONCURRENCY`` set alone put every request in the table's smallest context bucket (the context length
  was left None, which clamps to the first edge: a 50k-token prompt ran the 1k bucket's strategies) and the log read
  "deployment context None tokens x 4"; values from two places were said to come from "the connector extra";
* under an A/B split a request's concurrency counted only its own arm's live requests (6 live on the adapter,
  decided at concurrency 1);
* the full-payload accumulator (``async_chunk: false``) maps a ``cat`` default to upstream's list-then-concatenate-once
  (``token_list``), but not a tuned cell that kept ``cat`` (the tuner's baseline): a per-step ``torch.cat`` there;
* a partial tuned table was deployed without a word in the install line.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm_omni")


def _policy(cells, context_edges=(1000, 2000), conc_edges=(1, 2), key="thinker_embeddings", **table):
    from omni_accum.policy import load_policy
    from omni_accum.policy.environment import current_fingerprint

    return load_policy({
        "default": "cat",
        "tuned": {
            "context_len_edges": list(context_edges),
            "concurrency_edges": list(conc_edges),
            "fingerprint": current_fingerprint("cpu"),
            "cells": [{"key": key, "context_len": c, "concurrency": k, "strategy": s} for c, k, s in cells],
            **table,
        },
    })  # fmt: skip


FOUR = [(1000, 1, "token_list"), (1000, 2, "prealloc"), (2000, 1, "prealloc"), (2000, 2, "cat")]


@pytest.fixture
def no_context_env(monkeypatch):
    monkeypatch.delenv("OMNI_ACCUM_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("OMNI_ACCUM_CONCURRENCY", raising=False)
    return monkeypatch


def _chunk(prompt: int):
    return {"ids": {"prompt": list(range(prompt))}, "thinker_embeddings": torch.zeros(prompt, 4)}


def test_the_concurrency_set_alone_leaves_the_context_length_to_each_request(no_context_env):
    from omni_accum.integrations.vllm_omni.binding import Binding
    from omni_accum.integrations.vllm_omni.deployment import context_label, deployment_context

    no_context_env.setenv("OMNI_ACCUM_CONCURRENCY", "2")
    ctx = deployment_context()
    b = Binding(_policy(FOUR), ("thinker_embeddings",), "tuned.yaml", ctx)
    for rid, prompt, want in (("long", 50000, 2000), ("short", 1500, 1000)):
        b.live_send.add(rid)
        b.decide(rid, _chunk(prompt))
        assert (b.send_ctx[rid].context_len, b.send_ctx[rid].concurrency) == (want, 2), rid
    said = context_label(b.policy, ctx)
    assert "None" not in said, said
    assert said == ("context length per request (the sending stage measures each prompt), concurrency 2 for every "
                    "request from OMNI_ACCUM_CONCURRENCY=2")
    no_context_env.setenv("OMNI_ACCUM_CONTEXT_LEN", "8k")  # both set: one bucket for every request, as before
    both = Binding(_policy(FOUR), ("thinker_embeddings",), "tuned.yaml", deployment_context())
    both.live_send.add("long")
    both.decide("long", _chunk(500))
    assert (both.send_ctx["long"].context_len, both.send_ctx["long"].concurrency) == (2000, 2)


def test_the_label_names_each_setting_where_it_came_from(no_context_env):
    from omni_accum.integrations.vllm_omni.deployment import context_label, deployment_context

    no_context_env.setenv("OMNI_ACCUM_CONCURRENCY", "4")
    extra = {"omni_accum_context_len": 8000}
    said = context_label(_policy(FOUR), deployment_context(extra), extra)
    assert said == ("deployment context 8000 tokens x 4 from the connector extra's omni_accum_context_len=8000, "
                    "OMNI_ACCUM_CONCURRENCY=4"), said
    both = {"omni_accum_context_len": 8000, "omni_accum_concurrency": 2}
    assert context_label(_policy(FOUR), deployment_context(both), both).endswith("x 2 from the connector extra")


def test_doctor_says_the_context_length_is_measured_per_request_when_only_the_concurrency_is_set(no_context_env):
    from omni_accum.cli.doctor import check_context

    no_context_env.setenv("OMNI_ACCUM_CONCURRENCY", "4")
    checks = [c for c in check_context(None) if c.name == "context"]
    assert len(checks) == 1 and checks[0].ok, checks
    assert "None" not in checks[0].detail and "context length per request" in checks[0].detail, checks[0].detail


def test_an_ab_split_counts_the_requests_live_on_the_adapter_whichever_arm_they_run(no_context_env, tmp_path):
    import yaml

    from omni_accum.integrations.vllm_omni import ab
    from omni_accum.integrations.vllm_omni.binding import Binding
    from omni_accum.policy import load_policy

    table = _policy([(1000, 1, "token_list"), (1000, 2, "prealloc"), (1000, 4, "cat")], conc_edges=(1, 2, 4))
    (tmp_path / "tuned.yaml").write_text(yaml.safe_dump(table.model_dump(mode="json", exclude_none=True)))
    arm = {"policy": str(tmp_path / "tuned.yaml")}
    split = {"ab": {"arms": {"a": arm, "b": arm}}}
    top = Binding(load_policy(split), ("thinker_embeddings",), "ab.yaml", None)
    arms_seen, decided = set(), []
    for i in range(6):
        rid = f"req-{i}"
        arm = ab.send_arm(top, rid)
        arms_seen.add(arm.arm)
        arm.live_send.add(rid)  # as the send hook does before it decides
        arm.decide(rid, _chunk(1500))
        decided.append(arm.send_ctx[rid].concurrency)
    assert arms_seen == {"a", "b"}  # the requests did run both arms
    assert decided == [1, 2, 2, 4, 4, 4], decided  # 1..6 live on the adapter: the floor edges of 1, 2, 3, 4, 5, 6


def test_the_full_payload_accumulator_runs_a_tuned_cell_that_kept_cat_as_upstream_does(no_context_env):
    from omni_accum.integrations.vllm_omni.binding import Binding

    tuned = _policy([(1000, 1, "cat"), (2000, 1, "prealloc")], conc_edges=(1,), key="finished")
    b = Binding(tuned, ("thinker_embeddings",), "tuned.yaml", None)
    endpoint = b.full_payload_endpoint
    value = torch.zeros(8, 4)
    assert endpoint.select("finished", value, endpoint.context)[1].name == "token_list"  # not a torch.cat per step
    assert endpoint.select("other", value, endpoint.context)[1].name == "token_list"  # the cat default, as before
    big = endpoint.context.__class__(context_len=2000, concurrency=1)
    assert endpoint.select("finished", value, big)[1].name == "prealloc"  # a cell that won keeps its strategy
    assert b.policy.tuned.cells[0].strategy == "cat"  # the binding's own policy is left as written


def test_the_install_line_says_a_partial_table_is_partial():
    from omni_accum.integrations.vllm_omni.deployment import policy_summary

    partial = policy_summary(_policy(FOUR[:1], complete=False))
    assert "PARTIAL" in partial and "rules and default" in partial, partial
    assert "PARTIAL" not in policy_summary(_policy(FOUR))


def test_a_stale_table_s_requests_are_labelled_with_no_bucket(no_context_env):
    """A table measured in another environment is used by no request: its bucket labels said the bucket all the same."""
    import warnings

    from omni_accum.context import StreamContext
    from omni_accum.integrations.vllm_omni.binding import Binding
    from omni_accum.policy import load_policy

    data = _policy(FOUR).model_dump(mode="json", exclude_none=True)
    data["tuned"]["fingerprint"]["torch"] = "0.0.1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stale = Binding(load_policy(data), ("thinker_embeddings",), "stale.yaml", None)
        assert stale.bucket_labels(StreamContext(context_len=2000, concurrency=2)) == ("none", "none")
    fresh = Binding(_policy(FOUR), ("thinker_embeddings",), "tuned.yaml", None)
    assert fresh.bucket_labels(StreamContext(context_len=2000, concurrency=2)) == ("2000", "2")


def test_a_context_length_set_alone_says_its_concurrency_is_the_default_1(no_context_env):
    """It said "x 1 from OMNI_ACCUM_CONTEXT_LEN=8000" and doctor "an explicit override", though nothing set the 1."""
    from omni_accum.cli.doctor import check_context
    from omni_accum.integrations.vllm_omni.deployment import context_label, deployment_context

    no_context_env.setenv("OMNI_ACCUM_CONTEXT_LEN", "8000")
    said = context_label(_policy(FOUR), deployment_context())
    assert said == "deployment context 8000 tokens x 1 (no concurrency set: 1) from OMNI_ACCUM_CONTEXT_LEN=8000", said
    detail = [c for c in check_context(None) if c.name == "context"][0].detail
    assert "concurrency 1 (not set: 1)" in detail, detail
    no_context_env.setenv("OMNI_ACCUM_CONCURRENCY", "1")
    assert "not set" not in context_label(_policy(FOUR), deployment_context())


def test_a_request_outside_the_table_s_edges_is_said_once_per_stage(no_context_env, caplog):
    """TunedTable.clamped_lookups never counted in a live server (the sender decides with the bucket's edges): an
    operator could not tell that the traffic is outside what the table measured."""
    import logging

    from omni_accum.integrations.vllm_omni.binding import Binding

    caplog.set_level(logging.INFO, "omni_accum")
    b = Binding(_policy(FOUR), ("thinker_embeddings",), "tuned.yaml", None)
    b.live_send.add("inside")
    b.decide("inside", _chunk(1500))
    assert "outside the tuned table's buckets" not in caplog.text
    for rid, prompt in (("long", 50000), ("longer", 90000)):
        b.live_send.add(rid)
        b.decide(rid, _chunk(prompt))
    said = [r.getMessage() for r in caplog.records if "outside the tuned table's buckets" in r.getMessage()]
    assert len(said) == 1 and "'long' (context length 50000, concurrency 2)" in said[0], said
    assert "context_len>=2000, concurrency>=2" in said[0]
