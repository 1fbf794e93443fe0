"""What the docs promise when things go wrong inside vllm-omni 0.30.0 (real adapters, runner transports and
SharedMemoryConnector, CPU): a refused chunk whose re-seed is refused too, a plugin's selection hook raising on
the receiving adapter and in the full-payload accumulator, ``OMNI_ACCUM_REQUIRED=1`` with a bad connector extra on an
installed runner transport, and a receiver's hello withdrawn while its process lives."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import omni_accum
from omni_accum.manager import reset_manager
from tests.test_integration_vllm_omni import _hear, _wait, assert_same, run_thinker_to_talker

pytestmark = pytest.mark.vllm

QWEN = {"omni_accum_policy": "qwen3-omni"}
OFF = {"omni_accum_policy": "off"}
CONFIG = Path(__file__).resolve().parents[1] / "config"


@pytest.fixture
def base(vo, adapters):
    """What the talker is handed from 0.30.0's own code (omni-accum installed, the policy off on both stages)."""
    vo.install(None)
    return run_thinker_to_talker(adapters, f"oa-fail-base-{os.getpid()}", extra=OFF)[0]


def _said(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# ------------------------------------------------------------------- max_bytes_per_request refuses the re-seed too
def test_a_chunk_refused_by_the_byte_guard_leaves_the_talker_0_30_0s_payloads(vo, adapters, base, caplog):
    """The first chunk (the prefill, ~100 kB) is over ``max_bytes_per_request``, and so is the re-seed from what was
    handed over: the request is 0.30.0's from then on, and the values the sender leaves off in every later chunk
    (speaker, language) are put back from the chunk handed over. Every chunk equals 0.30.0's, bit for bit."""
    caplog.set_level(logging.WARNING, "omni_accum")
    text = (CONFIG / "qwen3-omni.yaml").read_text() + "\nmax_bytes_per_request: 4096\n"
    handed, _, (tx, rx) = run_thinker_to_talker(
        adapters, f"oa-fail-bytes-{os.getpid()}", extra={"omni_accum_policy": text}, heard=True
    )
    assert tx._omni_accum_binding.stats["omitted"] > 0  # the sender did leave values off
    assert_same(handed, base, "handed")
    assert len(_said(caplog, "omni-accum refused a chunk")) == 1, caplog.text
    assert len(_said(caplog, "could not be re-seeded")) == 1, caplog.text
    assert not _said(caplog, "no longer holds"), caplog.text


# ------------------------------------------------------------------------------ a raising selection hook
def _in_commit() -> bool:
    f = sys._getframe()
    while f is not None:
        if f.f_code.co_name == "_commit_received_chunk":
            return True
        f = f.f_back
    return False


class _RaisingSelector:
    """A plugin whose selection hook raises for ``keys`` (None: every key) where ``when`` says."""

    def __init__(self, keys: set[str] | None, when: Any) -> None:
        self.keys, self.when = keys, when

    @omni_accum.hookimpl
    def omni_accum_select_strategy(self, key, meta, context, policy):
        if (self.keys is None or key in self.keys) and self.when(key, meta):
            raise RuntimeError("selector bug")
        return None


def _register(plugin: Any) -> None:
    """The process-wide manager with ``plugin`` (conftest puts the original back after the test)."""
    m = omni_accum.StrategyManager()
    m.register(plugin, name="acme_boom")
    reset_manager(m)


@pytest.mark.parametrize("keys", [{"embed.decode"}, None], ids=["a-later-key", "every-key"])
def test_a_selection_hook_raising_on_the_receiving_adapter_never_reaches_vllm_omni(
    vo, adapters, base, caplog, keys
):
    """The hook raises on the talker's adapter only (inside ``_commit_received_chunk``; the sender's selections
    succeed): for the key first seen in chunk 1, or for every key from chunk 0 on. No exception reaches vllm-omni
    (which would lose the chunk and leave the request to its timeout); each chunk is handed over as 0.30.0 would,
    the values the sender left off put back; the refusal is logged once."""
    caplog.set_level(logging.WARNING, "omni_accum")
    _register(_RaisingSelector(keys, lambda key, meta: _in_commit()))
    handed, _, (tx, _) = run_thinker_to_talker(adapters, f"oa-fail-select-{os.getpid()}", extra=QWEN, heard=True)
    assert tx._omni_accum_binding.stats["omitted"] > 0
    assert_same(handed, base, "handed")
    said = _said(caplog, "omni-accum refused a chunk")
    assert len(said) == 1 and "selector bug" in said[0] and "acme_boom" in said[0], caplog.text
    assert not _said(caplog, "no longer holds"), caplog.text


_FULL_STEPS = [
    {"embed.prefill": (5, 64), "codes.audio": (1, 16)},
    {"embed.prefill": (1, 64), "codes.audio": (1, 16)},
    {"embed.prefill": (2, 64), "codes.audio": (1, 8)},  # codes.audio restarts (another trailing shape)
]


@pytest.mark.parametrize(
    "keys,when",
    [
        ({"embed.prefill"}, lambda key, meta: True),  # the first step (the entry is started)
        ({"codes.audio"}, lambda key, meta: meta.trailing_shape == (8,)),  # a key restarted in a later step
    ],
    ids=["first-step", "restart"],
)
def test_a_selection_hook_raising_in_the_full_payload_accumulator_leaves_the_step_to_upstream(
    vo, runner, caplog, keys, when
):
    """``accumulate_full_payload_output`` (``async_chunk: false``): the step whose selection raises is upstream's, and
    so is the rest of the request's entry; what is flushed equals 0.30.0's."""
    g = torch.Generator().manual_seed(7)
    steps = [{k: torch.randn(*shape, generator=g) for k, shape in s.items()} for s in _FULL_STEPS]

    def run(r: Any) -> Any:
        for s in steps:
            r.accumulate_full_payload_output("q", dict(s), SimpleNamespace())
        return r._materialize_full_payload_entry(r._pending_full_payload_send.pop("q"))

    expected = run(runner())
    caplog.set_level(logging.WARNING, "omni_accum")
    _register(_RaisingSelector(keys, when))
    vo.install("qwen3-omni")
    r = runner()
    got = run(r)
    assert r._omni_accum_binding is not None
    assert_same(got[0], expected[0], "materialized")
    said = _said(caplog, "omni-accum refused a chunk")
    assert len(said) == 1 and "selector bug" in said[0], caplog.text


# ----------------------------------------------------------------- OMNI_ACCUM_REQUIRED on an installed transport
@pytest.mark.parametrize("required", ["1", "0"])
def test_a_bad_connector_extra_on_an_installed_runner_transport_is_fatal_under_required(vo, monkeypatch, required):
    """Installed by ``OMNI_ACCUM_POLICY`` (no probe left), a runner transport whose connector extra is bad ends the
    process under ``OMNI_ACCUM_REQUIRED=1``, when it is built, as an adapter's does; without it, it runs vllm-omni's
    own code."""
    from conftest import runner_config
    from vllm_omni.worker.omni_connector_model_runner_mixin import OmniConnectorModelRunnerMixin

    monkeypatch.setenv("OMNI_ACCUM_REQUIRED", required)
    vo.install("default")
    r = type("Runner", (OmniConnectorModelRunnerMixin,), {})()
    try:
        cfg = runner_config({"omni_accum_adapter_keys": "embed.prefill"})
        if required == "1":
            with pytest.raises(SystemExit, match="OMNI_ACCUM_REQUIRED=1 and Runner's connector extra.*adapter_keys"):
                r.init_omni_connectors(cfg)
        else:
            r.init_omni_connectors(cfg)
            from omni_accum.integrations.vllm_omni.binding import binding_for

            assert binding_for(r) is None  # logged: "cannot bind"
    finally:
        r.shutdown_omni_connectors()


# ------------------------------------------------------------------------------------ a hello withdrawn
def test_a_hello_withdrawn_while_the_receiver_lives_sends_0_30_0s_payloads_again(vo, adapters, base, monkeypatch,
                                                                                 caplog):  # fmt: skip
    """The talker's adapter is given back to vllm-omni's code (its binding closed, its hello withdrawn) while its
    process goes on: the sender notices within ``ALIVE_S``, says so once, and its next request is 0.30.0's (nothing
    left off); a receiver that says hello again is heard again."""
    from omni_accum.integrations.vllm_omni import peer
    from omni_accum.integrations.vllm_omni.binding import bind
    from tests.test_integration_vllm_omni import T2T

    monkeypatch.setattr(peer, "ALIVE_S", 0.02)
    monkeypatch.setattr(peer, "POLL_S", (0.05, 1.0))  # the watcher's back-off capped at 1 s (30 s in production)
    caplog.set_level(logging.WARNING, "omni_accum")
    tx, rx = adapters(0, next_func=T2T, extra=QWEN), adapters(1, extra=QWEN)
    _hear(tx)
    txb = tx._omni_accum_binding
    bind(rx, None)  # no policy from now on: upstream's code, the hello withdrawn
    _wait(lambda: txb._peer.hello is None and txb._peer.lost >= 1, "the sender to see the hello withdrawn")
    it = iter((tx, rx))
    handed = run_thinker_to_talker(lambda stage_id, **kw: next(it), f"oa-fail-withdrawn-{os.getpid()}")[0]
    assert txb.stats["omitted"] == 0
    assert_same(handed, base, "after the hello was withdrawn")
    mine = [r for r in caplog.records if r.thread == txb._peer._thread.ident]  # (not an earlier test's watcher)
    assert sum("withdrew its hello" in r.getMessage() for r in mine) == 1, caplog.text
    rx2 = adapters(1, extra=QWEN)  # a receiver with omni-accum again
    assert rx2._omni_accum_binding is not None
    _wait(lambda: txb._peer.hello is not None, "the sender to hear the new hello", timeout=60)  # (1 s back-off)
