"""What a reliability audit found inside vllm-omni 0.30.0 (real adapters and SharedMemoryConnector, CPU): a plugin
raising on the sending side (the connector's ``put``) lost every chunk of its request; a receiver's hello withdrawn
mid-request left the requests in flight without the values the sender left off; a bad on/off switch went unreported
at activation when ``OMNI_ACCUM_POLICY`` is unset; an empty ``arena_name`` was refused, and an empty
``omni_accum_policy`` turned omni-accum off, though both mean the key left out."""

from __future__ import annotations

import logging
import os
import sys

import pytest

import omni_accum
from omni_accum.manager import reset_manager
from omni_accum.policy import StrategyChoice
from omni_accum.strategy import Accumulator, Encoder, Strategy, StrategySpec
from tests.test_integration_vllm_omni import (
    T2T,
    _hear,
    _receive_and_hand_over,
    _request,
    _thinker_steps,
    _wait,
    assert_same,
    no_shm_leftovers,
    run_thinker_to_talker,
)

pytestmark = pytest.mark.vllm

QWEN = {"omni_accum_policy": "qwen3-omni"}
OFF = {"omni_accum_policy": "off"}


@pytest.fixture
def base(vo, adapters):
    """What the talker is handed from 0.30.0's own code (omni-accum installed, the policy off on both stages)."""
    vo.install(None)
    return run_thinker_to_talker(adapters, f"oa-audit-base-{os.getpid()}", extra=OFF)[0]


def _said(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _refused_total() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("omni_accum_fallbacks_total", {"reason": "refused_chunk"}) or 0.0


# ------------------------------------------------------------------ 1. a plugin raising on the sending side
def _sending() -> bool:
    f = sys._getframe()
    while f is not None:
        if f.f_code.co_name == "_send_single_request_for_generation":
            return True
        f = f.f_back
    return False


class _SenderSelector:
    """A selection hook that raises on the sending adapter only, for ``keys`` (None: every key)."""

    def __init__(self, keys: set[str] | None) -> None:
        self.keys = keys

    @omni_accum.hookimpl
    def omni_accum_select_strategy(self, key, meta, context, policy):
        if (self.keys is None or key in self.keys) and _sending():
            raise RuntimeError("selector bug on the sender")
        return None


class _LastEncoder(Encoder):
    def encode(self, value):
        if bool(value):  # meta.finished: the request's last chunk, after speaker and language were left off
            raise RuntimeError("encoder bug at the last chunk")
        return value


class _Latest(Accumulator):
    def __init__(self) -> None:
        self.value = None

    def merge(self, value):
        self.value = value

    def read(self):
        return self.value


class _Fragile(Strategy):
    name = "fragile_last"

    def new_encoder(self, key):
        return _LastEncoder()

    def new_accumulator(self, key):
        return _Latest()


class _FragileFinished:
    """``meta.finished`` under a strategy whose encoder raises on the request's last chunk (both ends choose it)."""

    @omni_accum.hookimpl
    def omni_accum_register_strategies(self):
        return [StrategySpec(name="fragile_last", factory=_Fragile, kinds=frozenset({"replace"}))]

    @omni_accum.hookimpl
    def omni_accum_select_strategy(self, key, meta, context, policy):
        return StrategyChoice(strategy="fragile_last", source="test") if key == "meta.finished" else None


@pytest.mark.vllm
@pytest.mark.parametrize(
    "plugin,left_off",
    [
        (lambda: _SenderSelector(None), False),  # the first chunk (every key's selection raises)
        (lambda: _SenderSelector({"embed.decode"}), False),  # chunk 1 (the key it brings first)
        (_FragileFinished, True),  # the last chunk, after send_once values were left off the earlier ones
    ],
    ids=["selection-first-chunk", "selection-later-key", "encoder-last-chunk"],
)
def test_a_plugin_raising_on_the_sending_side_loses_no_chunk(vo, adapters, base, caplog, plugin, left_off):
    """The sender's put caught nothing: vllm-omni's save loop dropped the chunk, recorded a send failure, and the
    Sender's failed request refused every later one (no chunk arrived). Now the chunk and the rest of the request
    are put as vllm-omni built them; the talker, whatever it held of the request's earlier (encoded) chunks, is
    handed 0.30.0's payloads; counted as ``refused_chunk``, said once."""
    caplog.set_level(logging.WARNING)
    m = omni_accum.StrategyManager()
    m.register(plugin(), name="acme_boom")
    reset_manager(m)
    before = _refused_total()
    handed, _, (tx, rx) = run_thinker_to_talker(adapters, f"oa-audit-send-{os.getpid()}", extra=QWEN, heard=True)
    txb = tx._omni_accum_binding
    assert (txb.stats["omitted"] > 0) is left_off  # the receiver held values the sender had left off
    assert txb.stats["puts"] == len(handed) == len(base)
    assert_same(handed, base, "handed")
    said = _said(caplog, "omni-accum refused a chunk in the send hook")
    assert len(said) == 1 and "bug" in said[0], caplog.text
    assert not _said(caplog, "Send gave up"), caplog.text  # vllm-omni's own: nothing reached its save loop
    assert not _said(caplog, "no longer holds"), caplog.text
    # released with the request: by the adapter's cleanup, or (when the save loop's terminal put ran after it) by
    # that put's own release, on the save loop's thread (a bounded wait, not a speed check)
    _wait(lambda: not txb.sender.request_ids() and not txb.live_send, "the request released on the sender")
    txb.publish()
    assert _refused_total() - before == 1


# ------------------------------------------------------------------ 2. a hello withdrawn mid-request
def test_a_hello_withdrawn_mid_request_sends_every_value_again(vo, adapters, base, monkeypatch, caplog):
    """The talker's adapter is given back to vllm-omni's code (its binding closed, its hello withdrawn) after two
    chunks of a request announced to it (speaker and language left off chunk 1): once the sender saw the withdrawal,
    the request's later chunks carry every value again and no marker, so the talker, running 0.30.0's code, is handed
    0.30.0's payloads (it lacked speaker and language, and kept the marker key, in every later chunk)."""
    from omni_accum.integrations.vllm_omni import peer
    from omni_accum.integrations.vllm_omni.binding import bind

    monkeypatch.setattr(peer, "ALIVE_S", 0.02)
    caplog.set_level(logging.INFO, "omni_accum")
    tx, rx = adapters(0, next_func=T2T, extra=QWEN), adapters(1, extra=QWEN)
    _hear(tx)
    txb = tx._omni_accum_binding
    rid = f"oa-audit-withdrawn-{os.getpid()}"
    rreq = _request(rid, [], internal="rx-" + rid)
    steps, out_ids, handed, sent = _thinker_steps(), [], [], 0
    for i, mm in enumerate(steps):
        last = i == len(steps) - 1
        if i >= 3:
            out_ids.append(1000 + i)
        if sent == 2 and rx.__dict__.get("_omni_accum_binding") is not None:
            assert txb.stats["omitted"] == 2  # chunk 1 left speaker and language off
            bind(rx, None)  # no policy from now on: upstream's code, the hello withdrawn
            # (the watcher clears the hello, then counts it lost: the request under way sees the count)
            _wait(lambda: txb._peer.hello is None and txb._peer.lost >= 1, "the sender to see the hello withdrawn")
        sreq = _request(rid, out_ids, finished=last)
        tx.save_async(multimodal_output=mm, request=sreq)
        if i < 3:
            continue
        sent += 1
        _wait(lambda: tx.put_req_chunk.get(rid, 0) >= sent or (last and rid not in tx.put_req_chunk), "put")
        handed.append(_receive_and_hand_over(rx, rreq))
    rx.cleanup(rreq.request_id, rid)
    tx.cleanup(sreq.request_id, rid)
    assert txb.stats["omitted"] == 2  # nothing left off after the withdrawal
    assert_same(handed, base, "handed")
    assert len(_said(caplog, "1 request(s) in flight on stage 0 send vllm-omni's own payloads")) == 1, caplog.text
    assert no_shm_leftovers(rid)


# ------------------------------------------------------------------ 3. a bad switch without OMNI_ACCUM_POLICY
@pytest.mark.parametrize("policy", [None, "off"])
def test_a_bad_switch_is_reported_at_activation_without_a_policy(vo, monkeypatch, caplog, policy):
    """``OMNI_ACCUM_METRICS=maybe`` with ``OMNI_ACCUM_POLICY`` unset (or off): activation said only "not installed
    yet", patched the probes and left ``Settings.refused`` empty; the switch was found later, at a connector's
    install. Now it is refused at activation, as with a policy: logged naming the variable and value, nothing
    patched, the reason in the status; ``OMNI_ACCUM_REQUIRED=1`` ends the process."""
    from omni_accum.integrations.vllm_omni.activation import _probes_patched, activate
    from omni_accum.integrations.vllm_omni.binding_settings import Settings

    monkeypatch.setattr(Settings, "refused", None)
    for name in ("OMNI_ACCUM_REQUIRED", "OMNI_ACCUM_VLLM_OMNI", "OMNI_ACCUM_POLICY"):
        monkeypatch.delenv(name, raising=False)
    if policy is not None:
        monkeypatch.setenv("OMNI_ACCUM_POLICY", policy)
    monkeypatch.setenv("OMNI_ACCUM_METRICS", "maybe")
    with caplog.at_level(logging.ERROR, logger="omni_accum"):
        activate()
    assert "omni-accum not installed" in caplog.text and "OMNI_ACCUM_METRICS='maybe'" in caplog.text
    assert Settings.refused is not None and "OMNI_ACCUM_METRICS='maybe'" in Settings.refused
    assert not _probes_patched() and not vo.is_installed()
    monkeypatch.setenv("OMNI_ACCUM_REQUIRED", "1")
    with pytest.raises(SystemExit, match="OMNI_ACCUM_METRICS='maybe'"):
        activate()


# ------------------------------------------------------------------ 4. arena_name empty or blank
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_arena_name_is_the_default(monkeypatch, value):
    """docs/arena.md: ``arena_name`` absent or empty is the default; an empty or blank one was refused."""
    from omni_accum.integrations.vllm_omni.arena_settings import parse_settings

    monkeypatch.delenv("OMNI_ACCUM_ARENA_NAME", raising=False)
    s = parse_settings({"arena_name": value})
    assert (s.arena_name, s.arena_name_from) == ("omni", "the default")
    monkeypatch.setenv("OMNI_ACCUM_ARENA_NAME", "srv-2")
    s = parse_settings({"arena_name": value})
    assert (s.arena_name, s.arena_name_from) == ("srv-2", "OMNI_ACCUM_ARENA_NAME")
    with pytest.raises(ValueError, match=r"extra.arena_name = 'a b'"):
        parse_settings({"arena_name": "a b"})


# ------------------------------------------------------------------ 5. omni_accum_policy empty or blank
@pytest.mark.parametrize("value", ["", "  ", None])
def test_an_empty_omni_accum_policy_is_the_key_left_out(vo, adapters, monkeypatch, value):
    """``omni_accum_policy: ""`` in a connector extra turned omni-accum off for that connector, also with
    ``OMNI_ACCUM_POLICY`` set; only ``off`` (and YAML's false) opt out. Empty, blank or no value: the process-wide
    policy, and none without one."""
    from omni_accum.integrations.vllm_omni.activation import activate
    from omni_accum.integrations.vllm_omni.binding import binding_for
    from omni_accum.integrations.vllm_omni.binding_settings import _policy_source

    assert _policy_source({"omni_accum_policy": value})[0] is None  # no process-wide policy: none
    for name in ("OMNI_ACCUM_REQUIRED", "OMNI_ACCUM_VLLM_OMNI", "OMNI_ACCUM_METRICS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMNI_ACCUM_POLICY", "qwen3-omni")
    activate()
    b = binding_for(adapters(0, next_func=T2T, extra={"omni_accum_policy": value}))
    assert b is not None and b.source == "install()"  # OMNI_ACCUM_POLICY's, installed by activate()
    assert binding_for(adapters(0, next_func=T2T, extra=OFF)) is None  # off still opts out
    assert binding_for(adapters(0, next_func=T2T, extra={"omni_accum_policy": False})) is None
