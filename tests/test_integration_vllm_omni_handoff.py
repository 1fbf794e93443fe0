"""The hand-off metric: the time from a chunk's put on the sending stage to its merge on the receiving stage,
per stage pair and kind, with its bytes (real adapters, SharedMemoryConnector and the arena connector, CPU)."""

from __future__ import annotations

import os
import re
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.test_integration_vllm_omni import T2T, _receive_and_hand_over, _request, _thinker_steps, _wait, assert_same
from tests.test_integration_vllm_omni import run_thinker_to_talker
from tests.test_integration_vllm_omni_arena_connector import arena_name  # noqa: F401 - a fixture

pytestmark = pytest.mark.vllm

OFF = {"omni_accum_policy": "off"}


def _sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def _prom(pair: str = "0->1") -> dict[str, float]:
    """The hand-off samples of ``pair`` and the skip counters, as Prometheus has them now."""
    from omni_accum.integrations.vllm_omni import handoff

    handoff.publish()
    out = {}
    for kind in ("prefill", "decode", "full"):
        out[f"{kind}.count"] = _sample("omni_accum_handoff_seconds_count", pair=pair, kind=kind)
        out[f"{kind}.bytes"] = _sample("omni_accum_handoff_bytes_total", pair=pair, kind=kind)
    for reason in ("clock_domain", "out_of_range"):
        out[reason] = _sample("omni_accum_handoff_skipped_total", reason=reason)
    return out


def _status(vo, pair: str = "0->1") -> dict[str, dict[str, float]]:
    return vo.status().handoff.get(pair, {})


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}


def _tensor_bytes(payload: Any) -> int:
    """Tensor bytes of a put's values, counted here independently of omni-accum (its marker holds none)."""
    from vllm_omni.data_entry_keys import OmniPayloadStruct, to_dict

    d = to_dict(payload) if isinstance(payload, OmniPayloadStruct) else payload
    n = 0
    for v in d.values():
        for x in v.values() if isinstance(v, dict) else (v,):
            n += x.nbytes if isinstance(x, torch.Tensor) else 0
    return n


@pytest.fixture
def puts(monkeypatch, vllm_omni):
    """Every payload a SharedMemoryConnector puts, as it goes on the wire (installed before omni-accum's
    wrapper of the class put, which then encodes into it)."""
    from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

    seen: list[Any] = []
    orig = SharedMemoryConnector.put

    def put(self, *args, **kwargs):
        seen.append(kwargs.get("data"))
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(SharedMemoryConnector, "put", put)
    return seen


def _pair(adapters, extra: dict, rx_extra: dict | None = None, **kw):
    """A thinker and a talker adapter; the thinker's watcher has heard the talker's hello (when it says one)."""
    from omni_accum.integrations.vllm_omni import peer
    from omni_accum.integrations.vllm_omni.binding import binding_for

    tx = adapters(0, next_func=T2T, extra=extra, **kw)
    rx = adapters(1, extra=extra if rx_extra is None else rx_extra, **kw)
    b = binding_for(tx)
    if rx_extra is None:
        peer.watch(b, tx.connector)
        b._peer.ready()
        _wait(lambda: b._peer.hello is not None, "the thinker to hear the talker's hello")
    return tx, rx


def _run(tx, rx, rid: str) -> list[dict]:
    """One request, thinker to talker (any connector); the payloads the talker was handed."""
    from tests.test_integration_vllm_omni_lifecycle import drive

    return drive(tx, rx, rid, _thinker_steps())


@pytest.fixture
def base(vo, adapters):
    """What the talker is handed by 0.30.0's own code (omni-accum off on both stages)."""
    vo.install(None)
    tx, rx = adapters(0, next_func=T2T, extra=OFF), adapters(1, extra=OFF)
    handed, wire, _ = run_thinker_to_talker(lambda s, **kw: tx if s == 0 else rx, f"oa-ho-base-{os.getpid()}")
    return handed, wire


def _no_marker(handed: list[dict]) -> None:
    for h in handed:
        assert not any(str(k).startswith("__omni_accum") for k in h), sorted(h)


@pytest.mark.parametrize("policy", ["default", "qwen3-omni"])
def test_a_known_stream_gives_exact_counts_and_bytes_per_pair_and_kind(monkeypatch, puts, vo, adapters, base, policy):
    """Thinker adapter -> SHM -> talker adapter: chunk 0 (the whole prompt) is one prefill hand-off, and of the
    five decode chunks those on the sample (every 2nd chunk of the request: chunks 2 and 4) are timed; the
    bytes are those of the timed chunks as they went on the wire; the talker is handed what 0.30.0 hands."""
    monkeypatch.setenv("OMNI_ACCUM_HANDOFF_SAMPLE", "2")
    vo.install(None)
    tx, rx = _pair(adapters, {"omni_accum_policy": policy})
    prom0, stat0 = _prom(), _status(vo)
    puts.clear()
    handed = _run(tx, rx, f"oa-ho-{policy}-{os.getpid()}")
    assert_same(handed, base[0], "handed")
    _no_marker(handed)
    assert len(puts) == 6 == len(handed)
    want = {"prefill.count": 1, "prefill.bytes": _tensor_bytes(puts[0]), "decode.count": 2}
    want["decode.bytes"] = _tensor_bytes(puts[2]) + _tensor_bytes(puts[4])
    assert want["prefill.bytes"] > want["decode.bytes"] > 0
    assert _delta(_prom(), prom0) == want
    stat = _status(vo)
    for kind in ("prefill", "decode"):
        row, was = stat[kind], stat0.get(kind, {"count": 0, "bytes": 0, "seconds_sum": 0.0})
        assert row["count"] - was["count"] == want[f"{kind}.count"]
        assert row["bytes"] - was["bytes"] == want[f"{kind}.bytes"]
        assert row["seconds_max"] >= 0 and row["seconds_sum"] > was["seconds_sum"]  # timed on one clock (no bound)
    assert "full" not in stat


def test_the_arena_connector_carries_the_timestamp_too(monkeypatch, vo, arena_name, adapters):
    """Over the arena connector the marker rides in the payload dict as over SHM: the same hand-offs, the same
    bytes as the SHM run of the same stream."""
    from omni_accum.integrations.vllm_omni import arena_plugin

    monkeypatch.setenv("OMNI_ACCUM_HANDOFF_SAMPLE", "2")
    arena_plugin.register()
    vo.install(None)
    extra = {"omni_accum_policy": "default"}
    p0 = _prom()
    shm = _run(*_pair(adapters, extra), f"oa-ho-shm-{os.getpid()}")
    p1 = _prom()
    tx, rx = _pair(adapters, {**extra, "arena_name": arena_name}, connector="OmniAccumArenaConnector")
    assert type(tx.connector).__name__ == "ArenaConnector"
    assert rx.connector.get("0", "1", "prime") is None  # the region exists before the first put
    handed = _run(tx, rx, f"oa-ho-arena-{os.getpid()}")
    assert tx.connector.health()["arena_puts"] == len(handed)
    p2 = _prom()
    assert_same(handed, shm, "handed")
    over_shm, over_arena = _delta(p1, p0), _delta(p2, p1)
    assert over_shm["prefill.count"] == 1 and over_shm["decode.count"] == 2
    assert over_arena == over_shm


def _raw_put(conn: Any, rid: str, marker: Any, chunk: int = 0) -> None:
    """A chunk as a sender on another machine (or with a broken clock) would put it: a prefill payload and
    omni-accum's marker, straight through the real connector."""
    from omni_accum.integrations.vllm_omni.marker import OMITTED_KEY

    payload = {
        "embed": {"prefill": torch.ones(3, 8, dtype=torch.bfloat16)},
        "hidden_states": {"output": torch.ones(3, 8, dtype=torch.bfloat16)},
        "ids": {"prompt": list(range(3)), "all": list(range(3))},
        "meta": {"finished": torch.tensor(True)},
        OMITTED_KEY: marker,
    }
    ok, _, _ = conn.put(from_stage="0", to_stage="1", put_key=f"{rid}_0_{chunk}", data=payload)
    assert ok


@pytest.mark.parametrize(
    ("why", "clock", "offset_s"),
    [("clock_domain", "0ther0st", 0.0), ("out_of_range", None, 3600.0), ("out_of_range", None, -3600.0)],
)
def test_a_timestamp_from_another_clock_or_far_off_is_skipped_not_measured(vo, adapters, why, clock, offset_s):
    """Another host's clock domain, or a timestamp an hour in the future or the past: no duration (negative
    or absurd) is recorded, the chunk counts as skipped, and the talker is handed the payload without the marker."""
    from omni_accum.integrations.vllm_omni import handoff

    vo.install(None)
    tx, rx = _pair(adapters, {"omni_accum_policy": "default"})
    rid = f"oa-ho-skip-{why}-{int(offset_s)}-{os.getpid()}"
    t_ns = time.monotonic_ns() + int(offset_s * 1e9)
    before, stat0 = _prom(), _status(vo)
    _raw_put(tx.connector, rid, [0, t_ns, clock or handoff.clock_id(), "p"])
    rreq = _request(rid, [], internal="rx-" + rid)
    handed = _receive_and_hand_over(rx, rreq)
    _no_marker([handed])
    assert torch.equal(handed["embed"]["prefill"], torch.ones(3, 8, dtype=torch.bfloat16))
    assert _delta(_prom(), before) == {why: 1}
    assert _status(vo) == stat0
    rx.cleanup(rreq.request_id, rid)


def test_a_timestamp_on_this_clock_is_measured_from_the_put(vo, adapters):
    """The same raw put with this host's clock, taken just before the put: one prefill hand-off, its bytes."""
    from omni_accum.integrations.vllm_omni import handoff

    vo.install(None)
    tx, rx = _pair(adapters, {"omni_accum_policy": "default"})
    rid = f"oa-ho-raw-{os.getpid()}"
    before = _prom()
    _raw_put(tx.connector, rid, [0, time.monotonic_ns(), handoff.clock_id(), "p"])
    rreq = _request(rid, [], internal="rx-" + rid)
    _receive_and_hand_over(rx, rreq)
    assert _delta(_prom(), before) == {"prefill.count": 1, "prefill.bytes": 2 * 3 * 8 * 2 + 1}
    rx.cleanup(rreq.request_id, rid)


def test_a_receiver_that_never_said_hello_gets_no_marker(puts, vo, adapters, base):
    """The talker runs no omni-accum (no hello): the thinker's wire is 0.30.0's, byte for byte."""
    from omni_accum.integrations.vllm_omni.marker import OMITTED_KEY

    vo.install(None)
    tx, rx = _pair(adapters, {"omni_accum_policy": "default"}, rx_extra=OFF)
    before = _prom()
    puts.clear()
    handed, wire, _ = run_thinker_to_talker(lambda s, **kw: tx if s == 0 else rx, f"oa-ho-nohello-{os.getpid()}")
    assert_same(handed, base[0], "handed")
    assert wire == base[1]
    assert puts and not any(isinstance(p, dict) and OMITTED_KEY in p for p in puts)
    assert tx._omni_accum_binding._peer.hello is None
    assert _delta(_prom(), before) == {}


@pytest.fixture
def transports(vllm_omni):
    """Factory of real runner transports in full-payload mode (``async_chunk: false``) over SHM."""
    from vllm_omni.worker.omni_connector_model_runner_mixin import OmniConnectorModelRunnerMixin

    made = []

    def make(stage_id: int, extra: dict) -> Any:
        r = type("Runner", (OmniConnectorModelRunnerMixin,), {})()
        r.init_omni_connectors(
            SimpleNamespace(
                stage_id=stage_id,
                worker_type="ar",
                async_chunk=False,
                stage_connector_config={"name": "SharedMemoryConnector", "extra": {"stage_id": stage_id, **extra}},
                custom_process_next_stage_input_func=None,
            )
        )
        made.append(r)
        return r

    yield make
    for r in made:
        r.shutdown_omni_connectors()


def _full_payload(rows: int) -> dict:
    g = torch.Generator().manual_seed(rows)
    return {
        "embed": {"prefill": torch.randn(rows, 64, generator=g).bfloat16()},
        "hidden_states": {"output": torch.randn(rows, 64, generator=g).bfloat16()},
        "ids": {"prompt": list(range(rows)), "all": list(range(rows + 1))},
        "meta": {"finished": torch.tensor(True)},
    }


def _send_full(tx, rx, rid: str, payload: dict) -> dict:
    """The whole payload from the sending transport to the receiving one, as vllm-omni's runners move it."""
    assert tx.send_full_payload_outputs(None, {rid: payload}) == [rid]
    rx.register_chunk_recv(SimpleNamespace(request_id=rid, external_req_id=rid))
    got: dict = {}
    _wait(lambda: got.update(rx.recv_full_payload_inputs(None) or {}) or rid in got, "the full payload")
    return got[rid]


@pytest.mark.parametrize("rx_policy", ["default", "off"])
def test_a_full_payload_is_one_full_hand_off(vo, transports, rx_policy):
    """``async_chunk: false``: the receiving transport says hello when it is made; the whole payload is one
    ``full`` hand-off with its bytes, and the receiver stores exactly what was sent (the marker taken off).
    A receiving transport without omni-accum says no hello and gets vllm-omni's payload, nothing timed."""
    from omni_accum.integrations.vllm_omni import peer
    from omni_accum.integrations.vllm_omni.binding import binding_for

    vo.install(None)
    rx = transports(1, {"omni_accum_policy": rx_policy})
    tx = transports(0, {"omni_accum_policy": "default"})
    b = binding_for(tx)
    if rx_policy != "off":
        peer.watch(b, tx.connector)
        b._peer.ready()
        _wait(lambda: b._peer.hello is not None, "the sending transport to hear the receiving one's hello")
    before = _prom()
    sent = _full_payload(7)
    got = _send_full(tx, rx, f"oa-ho-full-{rx_policy}-{os.getpid()}", sent)
    assert_same(got, sent, "stored")
    want = {"full.count": 1, "full.bytes": _tensor_bytes(sent)} if rx_policy == "default" else {}
    assert _delta(_prom(), before) == want
    if rx_policy == "default":
        assert _status(vo)["full"]["count"] >= 1
    else:
        assert b._peer.looks >= 1 and b._peer.hello is None  # it looked, heard nothing: nothing was marked


def test_metrics_off_times_nothing(monkeypatch, puts, vo, adapters, base):
    """``OMNI_ACCUM_METRICS=0``: no timestamp goes on the wire, nothing is measured."""
    from omni_accum.integrations.vllm_omni.marker import OMITTED_KEY

    monkeypatch.setenv("OMNI_ACCUM_METRICS", "0")
    vo.install(None)
    tx = adapters(0, next_func=T2T, extra={"omni_accum_policy": "default"})
    rx = adapters(1, extra={"omni_accum_policy": "default"})
    puts.clear()
    handed = _run(tx, rx, f"oa-ho-off-{os.getpid()}")
    assert_same(handed, base[0], "handed")
    assert puts and not any(isinstance(p, dict) and OMITTED_KEY in p for p in puts)


@pytest.mark.parametrize("value", ["every", "1_000", "+5", "\u0663"])  # int() took the last three
def test_a_bad_sample_setting_refuses_install(monkeypatch, vo, value):
    from omni_accum.switches import SettingError

    monkeypatch.setenv("OMNI_ACCUM_HANDOFF_SAMPLE", value)
    said = re.escape(f"OMNI_ACCUM_HANDOFF_SAMPLE={value!r} is not a whole number >= 0")
    with pytest.raises(SettingError, match=said):
        vo.install(None)
    assert not vo.status().installed


# ------------------------------------------------------------------------------------------ units
def test_the_marker_reads_old_and_new_hello_lists_and_timed_masks():
    from omni_accum.integrations.vllm_omni.marker import hello_of, split_mask, stamp_of, with_hello, with_stamp

    old = [6, "abc123", 2, "qwen3-omni"]  # a first chunk's marker before hand-offs were timed
    assert hello_of(old) == ("abc123", 2, "qwen3-omni") and stamp_of(old) is None and split_mask(old) == (3, False)
    new = with_hello(7, "abc123", -1, "default", (123456789, "356176b6", "p"))
    assert new == [7, "abc123", -1, "default", 123456789, "356176b6"]
    assert hello_of(new) == ("abc123", -1, "default") and stamp_of(new) == (123456789, "356176b6", None)
    assert split_mask(new) == (3, True)
    assert with_hello(0, "f", 0, "s") == [0, "f", 0, "s"]  # untimed: the old form
    timed = with_stamp(4, (99, "clock", "d"))
    assert timed == [4, 99, "clock", "d"] and hello_of(timed) is None
    assert stamp_of(timed) == (99, "clock", "d") and split_mask(timed) == (2, False)
    assert stamp_of(tuple(timed)) == (99, "clock", "d")  # a decoder that gives tuples
    for bad in ([4, 99.5, "clock", "d"], [4, 99, 7, "d"], [1, 2, 3], 5, None, [4, "f", 0, "s", "t", "c"]):
        assert stamp_of(bad) is None, bad


def test_the_kind_of_a_chunk_follows_the_request_counts():
    from omni_accum.integrations.vllm_omni.handoff import kind_of

    def task(done: int, prompt: int, placeholders: int = 0) -> dict:
        req = SimpleNamespace(num_computed_tokens=done, num_output_placeholders=placeholders, num_prompt_tokens=prompt)
        return {"request": req}

    assert kind_of(0, None) == "p"  # a request's first chunk
    assert kind_of(3, task(4096, 8192)) == "p"  # chunked prefill: the prompt is not complete
    assert kind_of(3, task(8192, 8192)) == "p"  # the chunk that completes it
    assert kind_of(3, task(8194, 8192, placeholders=1)) == "d"
    assert kind_of(3, task(8193, 8192)) == "d"
    assert kind_of(3, task(0, 8192)) == "d"  # no counts: a later chunk is a decode chunk
    assert kind_of(3, None) == "d"


def test_a_dropped_binding_keeps_its_hand_offs_in_status_and_prometheus():
    """Status and Prometheus are per process: a meter whose binding was garbage collected (an adapter closed)
    still counts, and what it had not published yet is published (status shrank at a collection: a test that
    compared two status reads failed at random)."""
    import gc

    from omni_accum.integrations.vllm_omni import handoff

    pair = "7->8"
    before, prom0 = handoff.summary().get(pair, {}), _prom(pair)
    m = handoff.Meter()
    now = time.monotonic_ns()
    m.record(7, 8, [0, now - 5_000_000, handoff.clock_id(), "p"], {"embed": {"prefill": torch.ones(2, 4)}}, now)
    m.record(7, 8, [0, now, "0ther0st", "p"], {}, now)
    during = handoff.summary()[pair]["prefill"]
    assert during["count"] == before.get("prefill", {}).get("count", 0) + 1
    del m
    gc.collect()
    assert handoff.summary()[pair]["prefill"] == during
    handoff.publish()  # the publisher thread's next round (or exit) publishes a retired meter's last hand-offs
    got = {k: v - prom0.get(k, 0) for k, v in _prom(pair).items() if v - prom0.get(k, 0)}
    assert got == {"prefill.count": 1, "prefill.bytes": 32, "clock_domain": 1}


def test_a_meter_collected_while_its_thread_holds_a_prometheus_lock_does_not_wait_for_it(monkeypatch):
    """A meter's finalizer runs on whichever thread the garbage collector interrupts, maybe one inside
    ``prometheus_client`` holding a lock that is not reentrant (a metric making a child under ``labels()``): the
    finalizer published there, taking that lock again, and the thread (vllm-omni's receiving loop, with the
    adapter's state lock held) waited for itself forever."""
    import gc

    from omni_accum.integrations.vllm_omni import handoff

    held = threading.Lock()  # stands for prometheus_client's lock, held by the interrupted thread
    waited: list[str] = []
    published: list[str] = []

    class Child:
        def observe(self, x):
            pass

        def inc(self, n):
            pass

    class Metric:
        def labels(self, *labels):
            if not held.acquire(timeout=1.0):  # the real lock has no timeout: this thread would hang here
                waited.append("/".join(labels))
            else:
                held.release()
            published.append("/".join(labels))
            return Child()

    monkeypatch.setattr(handoff, "_registry_metrics", lambda: {k: Metric() for k in ("handoff", "handoff_bytes",
                                                                                    "handoff_skipped")})
    m = handoff.Meter()
    now = time.monotonic_ns()
    m.record(37, 38, [0, now - 1_000_000, handoff.clock_id(), "p"], {"embed": {"prefill": torch.ones(2, 4)}}, now)
    with held:  # the collection comes while the lock is held, as from an allocation inside labels()
        del m
        gc.collect()
    assert waited == [] and [p for p in published if p.startswith("37->38")] == []
    handoff.publish()  # later, on the publisher thread, without the lock held: published
    assert waited == [] and not handoff._unpublished
    assert [p for p in published if p.startswith("37->38")] == ["37->38/prefill"] * 2  # the histogram, the bytes


def test_status_sums_are_the_same_to_the_last_bit_whatever_the_order_and_the_collections():
    """Meters are visited in a weak set's order and retire when their binding is collected: the seconds summed
    in status must not depend on either (two equal status reads differed in the last bit and failed CI)."""
    import gc
    import math

    from omni_accum.integrations.vllm_omni import handoff

    pair = "17->18"
    now = time.monotonic_ns()
    # durations whose float sum added one by one, in any of the 120 orders, is not the exactly rounded sum
    ages_ns = [50_469_587, 630_291_950, 58_735_806, 961, 235_474_629]
    meters = [handoff.Meter() for _ in ages_ns]
    for m, age in zip(meters, ages_ns):
        m.record(17, 18, [0, now - age, handoff.clock_id(), "p"], {}, now)
    exact = math.fsum(age / 1e9 for age in ages_ns)
    first = handoff.summary()[pair]["prefill"]
    assert first["count"] == len(ages_ns) and first["seconds_sum"] == exact
    for i in (3, 0, 4):  # retire some, in an order of their own
        meters[i] = None
        gc.collect()
        assert handoff.summary()[pair]["prefill"] == first
    del meters
    gc.collect()
    assert handoff.summary()[pair]["prefill"] == first


def test_a_full_payload_reaches_prometheus_and_the_counts_without_a_flush(vo, transports):
    """``async_chunk: false``: the hand-off was recorded but nothing published it (the meter flushed only at its 256th
    record, the binding was never marked, and ``publish_pending`` returned early), so Prometheus and the status file
    never saw it while the server ran; no binding counted a whole payload sent or received."""
    from omni_accum.integrations.vllm_omni import handoff, peer
    from omni_accum.integrations.vllm_omni.binding import binding_for

    vo.install(None)
    rx = transports(1, {"omni_accum_policy": "default"})
    tx = transports(0, {"omni_accum_policy": "default"})
    b = binding_for(tx)
    peer.watch(b, tx.connector)
    b._peer.ready()
    _wait(lambda: b._peer.hello is not None, "the sending transport to hear the receiving one's hello")
    handoff.publish()  # what earlier tests left unpublished goes now, not during this one
    count = lambda: _sample("omni_accum_handoff_seconds_count", pair="0->1", kind="full")  # noqa: E731
    before = count()
    sent = _full_payload(5)
    _send_full(tx, rx, f"oa-ho-full-pub-{os.getpid()}", sent)
    _wait(lambda: count() - before >= 1, "the full hand-off in Prometheus (the publisher thread; no flush called)")
    assert count() - before == 1
    assert b.stats["chunks_sent"] == 1 and binding_for(rx).stats["chunks_received"] == 1
    rows = {r.chunks_sent: r.chunks_received for r in vo.status().bindings}
    assert rows == {1: 0, 0: 1}, rows


def test_a_whole_payload_is_counted_in_prometheus_as_a_chunk_sent_and_received(vo, transports):
    """``async_chunk: false``: the whole payload's put and get counted in ``stats`` only; no
    ``omni_accum_chunks_total``, ``omni_accum_wire_bytes_total`` or ``omni_accum_requests_total`` series moved, though
    the docs count them as a chunk sent and a chunk received."""
    from omni_accum.integrations.vllm_omni import publishing
    from omni_accum.integrations.vllm_omni.binding import binding_for

    vo.install(None)
    rx = transports(1, {"omni_accum_policy": "default"})
    tx = transports(0, {"omni_accum_policy": "default"})
    sent = _full_payload(5)
    name = binding_for(tx).strategy_name("embed.prefill", sent["embed"]["prefill"])
    assert binding_for(rx).strategy_name("embed.prefill", sent["embed"]["prefill"]) == name
    publishing.publish_pending()
    buckets = {"context_bucket": "none", "concurrency_bucket": "none"}
    series = {
        f"{role}.{what}": (metric, labels)
        for role in ("send", "receive")
        for what, metric, labels in (
            ("chunks", "omni_accum_chunks_total", dict(role=role, key="embed.prefill", strategy=name)),
            ("wire", "omni_accum_wire_bytes_total", dict(role=role, key="embed.prefill")),
            ("requests", "omni_accum_requests_total", dict(role=role, **buckets)),
        )
    }
    before = {k: _sample(metric, **labels) for k, (metric, labels) in series.items()}
    _send_full(tx, rx, f"oa-full-prom-{os.getpid()}", sent)
    publishing.publish_pending()  # what the put and the get marked, at once (else soon, on the publisher thread)
    got = {k: _sample(metric, **labels) - before[k] for k, (metric, labels) in series.items()}
    rows = 5 * 64 * 2  # bf16
    assert got == {
        "send.chunks": 1, "send.wire": rows, "send.requests": 1,
        "receive.chunks": 1, "receive.wire": rows, "receive.requests": 1,
    }  # fmt: skip


def test_publish_pending_publishes_the_hand_off_meters_when_nothing_was_marked():
    """At exit (``publish_pending``, atexit) the meters' last hand-offs were left unpublished when no binding was
    marked: a full-payload server's last ones never reached a multiprocess Prometheus directory."""
    from omni_accum.integrations.vllm_omni import handoff, publishing

    pair = "27->28"
    before = _sample("omni_accum_handoff_seconds_count", pair=pair, kind="full")
    m = handoff.Meter()
    now = time.monotonic_ns()
    m.record(27, 28, [0, now - 1_000_000, handoff.clock_id(), "f"], {"embed": {"prefill": torch.ones(2, 4)}}, now)
    assert _sample("omni_accum_handoff_seconds_count", pair=pair, kind="full") == before  # recorded, not published
    publishing.publish_pending()
    assert _sample("omni_accum_handoff_seconds_count", pair=pair, kind="full") - before == 1
    assert _sample("omni_accum_handoff_bytes_total", pair=pair, kind="full") >= 32
    del m
