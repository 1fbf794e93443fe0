"""The policy audit's findings 3 and 6 on vllm-omni's real classes (CPU):

* ``max_bytes_per_request`` holds on the full-payload accumulator (``async_chunk: false``, a real runner
  transport's ``accumulate_full_payload_output``) and on the stage input processor's chunked-prefill
  accumulation (the real ``thinker2talker_async_chunk`` of a real adapter): a step that would make one request
  hold more is refused before the strategy allocates and the request goes to vllm-omni's own code, its payload
  bit-identical to omni-accum off, counted and logged once; under the limit the request stays on omni-accum;
* the processor accumulates a request in the tuned bucket the sender's handshake then decides for it (the
  requests live on the sending adapter, on every arm of an A/B split; the prompt's length when only the
  concurrency is set), not at concurrency 1 or the first context edge.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch

from tests.test_integration_vllm_omni import assert_same
from tests.test_integration_vllm_omni_processor import T2T, _drive, _request_at, _steps

pytestmark = pytest.mark.vllm

LOGGER = "omni_accum.vllm_omni"
D = 2048
ROW = D * 2  # bytes of one bf16 row (the processor's thinker outputs)


def _fallbacks(reason: str) -> float:
    from prometheus_client import REGISTRY

    from omni_accum.integrations.vllm_omni import publishing

    publishing.publish_pending()  # a count still pending on a binding reaches Prometheus now
    return REGISTRY.get_sample_value("omni_accum_fallbacks_total", {"reason": reason}) or 0.0


def _warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and text in r.getMessage()]


# ---------------------------------------------------------------------------------------------- #
# Finding 3: the full-payload accumulator (async_chunk: false)
# ---------------------------------------------------------------------------------------------- #


def _full_steps(width: int = D) -> list[dict]:
    g = torch.Generator().manual_seed(21 + width)
    return [
        {"embed.prefill": torch.randn(5, width, generator=g), "codes.audio": torch.randint(0, 9, (1, 16))},
        {"embed.prefill": torch.randn(4, width, generator=g), "codes.audio": torch.randint(0, 9, (1, 16))},
        {"embed.prefill": torch.randn(60, width, generator=g), "meta.left": torch.tensor(3)},
        {"embed.prefill": torch.randn(90, width, generator=g), "codes.audio": torch.randint(0, 9, (1, 16))},
        {"embed.prefill": torch.randn(2, width, generator=g), "meta.left": None},
    ]


def _run_full(r: Any, plans: dict[str, list[dict]]) -> tuple[dict[str, Any], dict[str, list[int | None]]]:
    """The requests' steps through ``r``'s accumulator, interleaved, then each materialized payload; per request
    and step the bytes omni-accum's accumulators hold for it (None: the entry is upstream's own)."""
    from omni_accum.integrations.vllm_omni.full_payload import PolicyChunks

    held: dict[str, list[int | None]] = {rid: [] for rid in plans}
    for i in range(max(len(s) for s in plans.values())):
        for rid, steps in plans.items():
            if i < len(steps):
                r.accumulate_full_payload_output(rid, dict(steps[i]), "REQ")
                chunks = r._pending_full_payload_send[rid][0]
                mine = isinstance(chunks, PolicyChunks)
                held[rid].append(sum(a.nbytes() for a in chunks.accs.values()) if mine else None)
    return {rid: r._materialize_full_payload_entry(r._pending_full_payload_send.pop(rid)) for rid in plans}, held


def _guarded(limit: int, strategy: str = "prealloc") -> dict:
    return {"default": strategy, "max_bytes_per_request": limit}


@pytest.mark.parametrize("refused_at", [0, 1, 2, 3])
def test_full_payload_over_max_bytes_falls_back_bit_identical(vo, runner, caplog, refused_at):
    """The step that would take a request's accumulators past ``max_bytes_per_request`` is refused before any
    strategy allocates: upstream's method takes it, and the rest of that request, from the rows held; its
    materialized payload is 0.30.0's bit for bit, one ``refused_chunk``, one warning. A small request beside it
    stays on omni-accum to the end."""
    big, small = _full_steps(), _full_steps(width=8)
    expected, _ = _run_full(runner(), {"big": big, "small": small})
    vo.install(_guarded(10**9))
    _, free = _run_full(runner(), {"big": big})  # what prealloc holds after each step without the guard
    free = free["big"]
    assert refused_at == 0 or free[refused_at] > free[refused_at - 1]  # its buffer grows at that step
    limit = free[refused_at] - 1
    vo.uninstall()
    vo.install(_guarded(limit))
    before = _fallbacks("refused_chunk")
    rid = f"big-{refused_at}"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got, held = _run_full(runner(), {rid: big, "small": small})
    assert_same(got[rid], expected["big"], "materialized over the limit")
    assert_same(got["small"], expected["small"], "materialized under the limit")
    assert held[rid][:refused_at] == free[:refused_at]  # omni-accum's until then, under the limit
    assert held[rid][refused_at:] == [None] * (len(big) - refused_at)  # upstream's from the refused step on
    assert None not in held["small"] and max(held["small"]) <= limit  # omni-accum's every step
    assert _fallbacks("refused_chunk") - before == 1
    (msg,) = _warnings(caplog, "refused a chunk")
    assert f"{rid!r}" in msg and "max_bytes_per_request" in msg and "'embed.prefill'" in msg


# ---------------------------------------------------------------------------------------------- #
# Finding 3: the stage input processor (chunked prefill)
# ---------------------------------------------------------------------------------------------- #


@pytest.fixture
def upstream(vo, adapters):
    """A thinker adapter running vllm-omni's own processor (nothing installed)."""
    return adapters(0, next_func=T2T)


def _drive_held(
    tx: Any, plans: dict[str, tuple[list[int], list[dict]]]
) -> tuple[dict[str, list[Any]], dict[str, list[int | None]]]:
    """:func:`_drive` of several requests, interleaved; per request and step what the processor returned and the
    bytes omni-accum holds for it afterwards (None: its entry is not a ``_Held``)."""
    from vllm_omni.data_entry_keys import to_dict

    from omni_accum.integrations.vllm_omni.processor import _Held

    got: dict[str, list[Any]] = {rid: [] for rid in plans}
    held: dict[str, list[int | None]] = {rid: [] for rid in plans}
    for i in range(max(len(steps) for _, steps in plans.values())):
        for rid, (sizes, steps) in plans.items():
            if i < len(steps):
                p = tx.custom_process_next_stage_input_func(tx, steps[i], _request_at(rid, sizes, i), False)
                got[rid].append(None if p is None else to_dict(p))
                entry = tx.request_payload.get(rid)
                held[rid].append(sum(a.nbytes() for _, a in entry.accs) if isinstance(entry, _Held) else None)
                if p is not None:
                    tx.put_req_chunk[rid] += 1
    return got, held


SIZES = [50, 50, 50, 20]  # prompt 170 rows, then one decode row: prealloc's buffer is 171 rows per key
SMALL = [20, 20, 10]


@pytest.mark.parametrize(
    "strategy, limit, refused_at",
    [
        ("prealloc", 2 * 171 * ROW - 1, 0),  # the two buffers of the prompt's rows + 1 would pass it: chunk 0
        ("token_list", 500 * ROW, 2),  # chunks + their cached concatenation: 400 rows' worth at chunk 1, 600 at 2
    ],
)
def test_processor_over_max_bytes_falls_back_bit_identical(vo, adapters, upstream, caplog, strategy, limit, refused_at):
    """The prefill chunk that would take a request's two keys' accumulators past ``max_bytes_per_request`` is
    refused before the strategy allocates: the release's own processor takes that request from the rows held,
    every payload is 0.30.0's bit for bit, one ``processor_refused``, one warning. A request with a short prompt
    beside it stays on omni-accum for its whole prefill."""
    steps, small = _steps(SIZES, seed=6), _steps(SMALL, seed=7)
    want = {"big": _drive(upstream, "big", SIZES, steps), "small": _drive(upstream, "small", SMALL, small)}
    vo.install(_guarded(limit, strategy))
    tx = adapters(0, next_func=T2T)
    before = _fallbacks("processor_refused")
    rid, sid = f"big-{strategy}-{os.getpid()}", f"small-{strategy}-{os.getpid()}"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got, held = _drive_held(tx, {rid: (SIZES, steps), sid: (SMALL, small)})
    assert_same(got[rid], want["big"], "over the limit")
    assert_same(got[sid], want["small"], "under the limit")
    assert all(h is not None and h <= limit for h in held[rid][:refused_at])  # omni-accum's until then, within it
    assert held[rid][refused_at:] == [None] * (len(steps) - refused_at)  # the release's from the refused chunk on
    assert all(h is not None and h <= limit for h in held[sid][: len(SMALL)])  # omni-accum's whole prefill
    assert _fallbacks("processor_refused") - before == 1
    (msg,) = _warnings(caplog, "stage input processor")
    assert f"{rid!r}" in msg and "max_bytes_per_request" in msg


# ---------------------------------------------------------------------------------------------- #
# Finding 6: the processor's bucket is the one the sender's handshake decides
# ---------------------------------------------------------------------------------------------- #


def _tuned(cells: dict[tuple[int, int], str], context_edges: list[int]) -> dict:
    """A tuned table (measured here) giving both prefill keys the strategy of each (context, concurrency) cell."""
    from omni_accum.policy.environment import current_fingerprint

    return {
        "default": "cat",
        "tuned": {
            "context_len_edges": context_edges,
            "concurrency_edges": [1, 4],
            "fingerprint": current_fingerprint("cpu"),
            "cells": [
                {"key": key, "context_len": c, "concurrency": k, "strategy": s}
                for key in ("embed.prefill", "hidden_states.output")
                for (c, k), s in cells.items()
            ],
        },
    }


@pytest.fixture
def no_context_env(monkeypatch):
    monkeypatch.delenv("OMNI_ACCUM_CONTEXT_LEN", raising=False)
    monkeypatch.delenv("OMNI_ACCUM_CONCURRENCY", raising=False)
    return monkeypatch


def _prefill_then_put(tx: Any, b: Any, rid: str, sizes: list[int], seed: int) -> tuple[str, Any]:
    """Request ``rid``'s prefill through ``tx``'s processor, then the adapter's put of the payload it hands over
    through ``b`` (the send hook's encode: the handshake decides the bucket). Returns the strategy the processor
    accumulated the prefill in and the stream context the sender decided."""
    from omni_accum.integrations.vllm_omni.processor import _Held
    from omni_accum.integrations.vllm_omni.send import encode_payload

    steps = _steps(sizes, seed=seed)
    p = tx.custom_process_next_stage_input_func(tx, steps[0], _request_at(rid, sizes, 0), False)
    held = tx.request_payload[rid]
    assert p is None and isinstance(held, _Held)
    for j in range(1, len(steps)):
        p = tx.custom_process_next_stage_input_func(tx, steps[j], _request_at(rid, sizes, j), False)
    assert p is not None  # the prompt's rows and one decode row, handed over
    encode_payload(b, rid, p)  # the put of the request's first chunk
    tx.put_req_chunk[rid] += 1
    return held.strategy, b.send_ctx[rid]


def test_processor_bucket_is_the_senders_decided_bucket_with_requests_live(vo, adapters, no_context_env):
    """Requests put one after another on the same sending adapter, none released: request i's prefill is
    accumulated under the strategy of the bucket the handshake decides for it when its first chunk goes out
    (concurrency i + 1: token_list up to 3 live, prealloc from 4)."""
    from omni_accum.integrations.vllm_omni.binding import binding_for

    vo.install(_tuned({(1000, 1): "token_list", (1000, 4): "prealloc"}, [1000]))
    tx = adapters(0, next_func=T2T)
    b = binding_for(tx)
    seen = []
    for i in range(5):
        strategy, ctx = _prefill_then_put(tx, b, f"live-{i}-{os.getpid()}", [300, 300], seed=40 + i)
        seen.append((ctx.concurrency, strategy, b.receiver.select("embed.prefill", torch.zeros(2, D), ctx)[1].name))
    assert [c for c, _, _ in seen] == [1, 1, 1, 4, 4]
    assert [a for _, a, _ in seen] == [d for _, _, d in seen] == ["token_list"] * 3 + ["prealloc"] * 2


def test_processor_bucket_follows_the_sender_under_an_ab_split(vo, adapters, no_context_env, tmp_path):
    """An A/B split: the requests live on every arm of the adapter count, as the handshake counts them."""
    import yaml

    from omni_accum.integrations.vllm_omni import ab
    from omni_accum.integrations.vllm_omni.binding import binding_for

    table = tmp_path / "tuned.yaml"
    table.write_text(yaml.safe_dump(_tuned({(1000, 1): "token_list", (1000, 4): "prealloc"}, [1000])))
    vo.install({"ab": {"arms": {"a": {"policy": str(table)}, "b": {"policy": str(table)}}}})
    tx = adapters(0, next_func=T2T)
    top = binding_for(tx)
    seen, arms = [], set()
    for i in range(5):
        # ids unique to this process (their chunks go through /dev/shm) that the split's hash sends to a, b, a, b, a
        rid = next(r for j in range(10_000) if top.split.arm_for(r := f"ab-{i}-{j}-{os.getpid()}") == "ab"[i % 2])
        arm = ab.send_arm(top, rid)  # the send hook's routing
        arms.add(arm.arm)
        strategy, ctx = _prefill_then_put(tx, arm, rid, [300, 300], seed=50 + i)
        seen.append((ctx.concurrency, strategy, arm.receiver.select("embed.prefill", torch.zeros(2, D), ctx)[1].name))
    assert arms == {"a", "b"}  # the requests ran both arms
    assert [c for c, _, _ in seen] == [1, 1, 1, 4, 4]
    assert [a for _, a, _ in seen] == [d for _, _, d in seen] == ["token_list"] * 3 + ["prealloc"] * 2


def test_processor_bucket_follows_the_sender_when_only_the_concurrency_is_set(vo, adapters, no_context_env):
    """``OMNI_ACCUM_CONCURRENCY`` alone: the prompt's length picks the context bucket on both (2500 tokens: the
    2000 bucket), not the first edge."""
    from omni_accum.integrations.vllm_omni.binding import binding_for

    no_context_env.setenv("OMNI_ACCUM_CONCURRENCY", "4")
    cells = {(1000, 1): "prealloc", (1000, 4): "token_list", (2000, 1): "token_list", (2000, 4): "prealloc"}
    vo.install(_tuned(cells, [1000, 2000]))
    tx = adapters(0, next_func=T2T)
    b = binding_for(tx)
    strategy, ctx = _prefill_then_put(tx, b, f"conc-{os.getpid()}", [1300, 1200], seed=60)
    assert (ctx.context_len, ctx.concurrency) == (2000, 4)
    assert strategy == b.receiver.select("embed.prefill", torch.zeros(2, D), ctx)[1].name == "prealloc"
