"""How ``OmniAccumMooncakeConnector``'s get waits for a key not in the store yet (``mooncake_get_poll``):
0.30.0's blocking tries, or one ask per call and at most one per interval per key, with the timeouts counted
as 0.30.0 counts them. A scripted store and a scripted clock: no Mooncake needed (the real master's runs are
in test_mooncake_fast.py)."""

from __future__ import annotations

import logging
import threading

import pytest

pytest.importorskip("vllm_omni")

from omni_accum.integrations.vllm_omni import mooncake_connector as mc  # noqa: E402
from omni_accum.integrations.vllm_omni import mooncake_get as mg  # noqa: E402
from omni_accum.integrations.vllm_omni import mooncake_wait as mw  # noqa: E402
from omni_accum.integrations.vllm_omni.mooncake_wire import Encoder  # noqa: E402


@pytest.mark.parametrize(
    "value, seconds",
    [(None, None), ("blocking", None), (" Blocking ", None), ("2ms", 0.002), ("0.005s", 0.005), (0.01, 0.01),
     (1, 1.0), ("1s", 1.0), ("250 ms", 0.25)],
)  # fmt: skip
def test_poll_values(value, seconds):
    assert mw.parse_poll(value) == seconds


@pytest.mark.parametrize(
    "value, message",
    [("fast", "'fast' is not 'blocking' or a duration"), (True, "True is not 'blocking'"),
     ("0ms", "'0ms' is 0 s: it must be from 0.1 ms to 1 s"), ("2s", "'2s' is 2 s: it must be from 0.1 ms"),
     (-1, "-1 is -1 s: it must be from 0.1 ms to 1 s"), ("5 us", "'5 us' is not"),
     (1e-9, "1e-09 is 1e-09 s: it must be from 0.1 ms to 1 s"), ("0.00001s", "'0.00001s' is 1e-05 s: it must be")],
)  # fmt: skip
def test_bad_poll_values_are_named(value, message):
    with pytest.raises(ValueError, match="extra.mooncake_get_poll = " + message.replace("(", r"\(")):
        mw.parse_poll(value)


def test_the_connector_names_a_bad_poll_before_it_needs_mooncake():
    with pytest.raises(ValueError, match=r"OmniAccumMooncakeConnector: extra.mooncake_get_poll = 'soon' is not"):
        mc.MooncakeFastConnector({"mooncake_get_poll": "soon"})
    with pytest.raises(ValueError, match=r"unknown extra key\(s\) 'mooncake_poll'.*mooncake_get_poll"):
        mc.MooncakeFastConnector({"mooncake_poll": "2ms"})


class _Store:
    """Answers ``get`` with nothing until ``ready`` is set, then with the payload; counts the asks."""

    def __init__(self, body: bytes) -> None:
        self.body, self.ready, self.asks = body, False, 0

    def get(self, key):
        self.asks += 1
        return self.body if self.ready else b""


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _connector(monkeypatch, poll: float | None, store: _Store, clock: _Clock):
    conn = object.__new__(mc.MooncakeFastConnector)
    conn.config, conn._closed, conn._rx_lock, conn._count_lock = {}, False, threading.Lock(), threading.Lock()
    conn._init_gets()
    conn.close = lambda: None  # nothing was opened
    conn.get_poll, conn.waits = poll, mw.KeyWaits(poll)
    conn.counts = {"inner_gets": 0, "fast_gets": 0}
    conn.seconds = {k: 0.0 for k in ("get_waited", "get_key", "get_parts", "get_remove")}
    conn.inner = type("Inner", (), {"_metrics": {"timeouts": 0, "gets": 0}, "store": store,
                                    "_make_key": staticmethod(lambda k, f, t: f"{k}@{f}_{t}")})()  # fmt: skip
    monkeypatch.setattr(mg, "monotonic", clock)  # the receiving side's clock
    sleeps = []
    monkeypatch.setattr("time.sleep", lambda s: (sleeps.append(s), setattr(clock, "now", clock.now + s)))
    return conn, sleeps


def _body(payload: dict) -> bytes:
    return bytes(Encoder({}).encode(payload))


def test_a_polling_get_asks_once_per_interval_and_sleeps_only_while_no_key_is_due(monkeypatch, caplog):
    store, clock = _Store(_body({"meta": {"finished": False}, "ids": [1, 2, 3]})), _Clock()
    conn, sleeps = _connector(monkeypatch, 0.002, store, clock)
    assert conn.get("0", "1", "rq_0_0") is None and store.asks == 1  # due again at 100.002
    # another key is asked for at once (nothing waits behind the first)
    clock.now += 0.001
    assert conn.get("0", "1", "rq2_0_0") is None and store.asks == 2 and sleeps == []  # due at 100.003
    # no key is due: the call sleeps until the soonest is (rq's), then asks nothing (its own is not due yet)
    clock.now += 0.0005
    assert conn.get("0", "1", "rq2_0_0") is None and store.asks == 2
    assert sleeps == [pytest.approx(0.0005)] and clock.now == pytest.approx(100.002)
    store.ready = True
    got = conn.get("0", "1", "rq_0_0")  # due now: asked at once
    assert store.asks == 3 and got is not None and got[0]["ids"] == [1, 2, 3] and got[1] == len(store.body)
    assert len(sleeps) == 1 and conn.counts["inner_gets"] == 1 and conn.inner._metrics["timeouts"] == 0
    assert len(conn.waits) == 1  # the found key is forgotten; rq2's still waits
    # the sleep ends when the caller's own key is due: then it is asked in the same call
    store.ready = False
    clock.now += 0.0004
    assert conn.get("0", "1", "rq2_0_0") is None and store.asks == 4
    assert sleeps[-1] == pytest.approx(0.0006) and clock.now == pytest.approx(100.003)

    # a key waited for, its caller retrying every 0.5 ms: about one ask per 2 ms, one timeout (and the key
    # named) per second of waiting, as 0.30.0's 20 tries count one; every sleep within the interval
    clock.now += 1.0  # rq2 given up long ago
    start, asks = clock.now, store.asks
    with caplog.at_level(logging.WARNING):
        while clock.now < start + 2.1:
            conn.get("0", "1", "rq3_0_0")
            clock.now += 0.0005
    assert conn.inner._metrics["timeouts"] == 2
    assert [r.getMessage() for r in caplog.records if "timeout waiting" in r.getMessage()] == [
        "OmniAccumMooncakeConnector: timeout waiting for rq3_0_0@0_1"
    ] * 2
    assert 1000 <= store.asks - asks <= 1060
    assert all(0 < s <= 0.002 for s in sleeps[2:]) and len(sleeps) > 500


def test_a_pause_is_until_the_soonest_key_asked_for_lately():
    w = mw.KeyWaits(0.01)
    assert w.pause(0.0) == 0.0  # nothing asked for
    assert w.due("a", 0.0) and not w.missed("a", 0.0)  # a: due again at 0.01
    assert w.pause(0.004) == pytest.approx(0.006)
    assert w.due("b", 0.005) and not w.missed("b", 0.005)  # b: at 0.015
    assert w.pause(0.006) == pytest.approx(0.004)  # a's, the soonest
    assert w.pause(0.011) == 0.0  # a may be asked now
    # a given up (never asked again): once it was last asked for more than RECENT_S ago it holds nothing back
    assert w.due("b", 0.015) and not w.missed("b", 0.25)  # b: at 0.26
    assert w.pause(0.255) == pytest.approx(0.005)
    assert w.pause(0.5) == 0.0  # b not asked for lately either
    assert mw.KeyWaits(None).pause(0.0) == 0.0  # blocking: the get waits in its own tries


def test_a_blocking_get_is_0_30_0s_twenty_tries(monkeypatch):
    store, clock = _Store(_body({"ids": [4]})), _Clock()
    conn, sleeps = _connector(monkeypatch, None, store, clock)
    assert conn.get("0", "1", "rq_0_0") is None
    assert store.asks == 20 and sleeps == [0.05] * 19 and conn.inner._metrics["timeouts"] == 1
    store.ready = True
    got = conn.get("0", "1", "rq_0_0")
    assert got is not None and got[0]["ids"] == [4] and store.asks == 21 and len(sleeps) == 19


def test_the_keys_remembered_are_bounded():
    w = mw.KeyWaits(0.01)
    for n in range(mw.MAX_KEYS + 10):
        assert w.due(f"k{n}", float(n))
    assert len(w) == mw.MAX_KEYS
    assert w.due("k0", 1e9)  # forgotten: a first ask again
    assert w.found("nope", 5.0) == 0.0
