"""``OmniAccumMooncakeConnector``'s tensor fast path between two stage processes on a real Mooncake master:
the values received are bit for bit those 0.30.0's connector gives, a payload larger than one registered
buffer goes in parts, a request released mid-transfer completes whole, and nothing is left in the store."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from mooncake_fixtures import *  # noqa: F403 - the fixtures (mooncake, stage_host)

BUFFER = 1 << 20  # the registered buffer: a 2.5 MiB tensor needs 3 parts
APPENDS = {"embed.prefill", "hidden"}
NAME = "OmniAccumMooncakeConnector"

#: (request, chunk, rows of the append tensors, what the case shows)
CASES = [
    ("rq-a", 0, 200, "each tensor fits the staging buffer: copied into it, one batch_put_from per buffer-full"),
    ("rq-b", 0, 640, "larger than the registered buffer: parts, from the tensors' own registered memory"),
    ("rq-c", 0, 640, "released mid-transfer (between the two tensors' batch_put_from)"),
    ("rq-c", 1, 640, "a later put of the released request: serialized"),
    ("rq-d", 0, 1, "no tensor of the threshold's size: serialized"),
    ("rq-e", 0, 640, "the store refuses the second batch_put_from: the first's parts removed, the payload serialized"),
]
REFUSED = "rq-e"


class _Refusing:
    """The store, except that its second ``batch_put_from`` is refused (as a full segment refuses, rc -200)."""

    def __init__(self, store):
        self._store = store
        self.calls = 0
        self.keys: list[str] = []

    def batch_put_from(self, keys, ptrs, sizes, config):
        self.calls += 1
        self.keys += keys
        if self.calls == 2:
            return [-200] * len(keys)
        return self._store.batch_put_from(keys, ptrs, sizes, config)

    def __getattr__(self, name):
        return getattr(self._store, name)
RELEASED = "rq-c"


def _payload(seed: int, rows: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": {
            "prefill": torch.randn(rows, 2048, generator=g).to(torch.bfloat16),
            "tts_bos": torch.randn(1, 64, generator=g),  # not an append key: serialized
        },
        "hidden": torch.randn(rows, 1024, generator=g).to(torch.float16),
        "ids": list(range(rows % 17)),
        "meta": {"finished": torch.tensor(True), "override_keys": ["ids"]},
        "odd": torch.arange(24, dtype=torch.int64).reshape(4, 6).t(),  # not contiguous, serialized
    }


def _same(a, b, where: str, out: list[str]) -> None:
    if type(a) is not type(b):
        out.append(f"{where}: {type(a).__name__} != {type(b).__name__}")
    elif isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{where}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}")
        elif not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            out.append(f"{where}: bytes differ")
    elif isinstance(a, dict):
        if list(a) != list(b):
            out.append(f"{where}: keys {list(a)} != {list(b)}")
        for k in a:
            if k in b:
                _same(a[k], b[k], f"{where}.{k}", out)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{where}: {len(a)} items != {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]", out)
    elif a != b:
        out.append(f"{where}: {a!r} != {b!r}")


def _connector(stage_id: int, extra: dict):
    from omni_accum.integrations.vllm_omni import mooncake_compat
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
    from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec

    mooncake_compat.activate()  # what the omni_accum_mooncake entry point does in a vllm-omni process
    extra = {**extra, "mooncake_buffer_bytes": BUFFER, "mooncake_tensor_min_bytes": "64KiB", "stage_id": stage_id}
    return OmniConnectorFactory.create_connector(ConnectorSpec(name=NAME, extra=extra))


def fast_sender(*, pipes, extra: dict, tag: str, rx_extra: dict | None = None) -> dict:
    from omni_accum.bench.stage_host import pipe_ends

    rd, wr = pipe_ends(pipes, "tx")
    conn = _connector(0, extra)
    conn.append_test = lambda path, value: path in APPENDS
    released_at: list[str] = []

    def release_mid_transfer(put_key: str) -> None:
        if put_key.startswith(f"{tag}{RELEASED}_") and not released_at:
            released_at.append(put_key)
            conn.release_request(f"{tag}{RELEASED}")

    conn.between_parts = release_mid_transfer
    out: dict = {"puts": [], "type": type(conn).__name__}
    parts: list[str] = []
    try:
        for n, (rq, chunk, rows, _) in enumerate(CASES):
            before = dict(conn.counts)
            refusing = None
            if rq == REFUSED:
                conn.inner.store = refusing = _Refusing(conn.inner.store)
            try:
                ok, size, meta = conn.put("0", "1", f"{tag}{rq}_0_{chunk}", _payload(n, rows))
            finally:
                if refusing is not None:
                    conn.inner.store = refusing._store
                    out["refused_keys"] = refusing.keys
            parts += (meta or {}).get("mooncake_parts", [])
            out["puts"].append({
                "ok": ok, "size": size, "parts": len((meta or {}).get("mooncake_parts", [])),
                "fast": conn.counts["fast_puts"] - before["fast_puts"],
            })  # fmt: skip
            wr.write(json.dumps([n, f"{tag}{rq}_0_{chunk}"]) + "\n")
            wr.flush()
            assert rd.readline().strip() == "ok"
        wr.write("null\n")
        wr.flush()
        assert rd.readline().strip() == "done"
        keys = parts + out["refused_keys"] + [conn._make_key(f"{tag}{rq}_0_{c}", "0", "1") for rq, c, _, _ in CASES]
        out["left"] = [k for k, e in zip(keys, conn.store.batch_is_exist(keys)) if e != 0]
        out["released_at"] = released_at
        out["health"] = conn.health()
    finally:
        conn.close()
    return out


def fast_receiver(*, pipes, extra: dict, tag: str, rx_extra: dict | None = None) -> dict:
    from vllm_omni.distributed.omni_connectors.utils.serialization import OmniSerializer

    from omni_accum.bench.stage_host import pipe_ends

    rd, wr = pipe_ends(pipes, "rx")
    conn = _connector(1, {**extra, **(rx_extra or {})})
    out: dict = {"mismatch": [], "sizes": [], "first_none": []}
    try:
        for line in rd:
            msg = json.loads(line)
            if msg is None:
                break
            n, key = msg
            got = conn.get("0", "1", key)
            # with reader threads, the get that finds parts starts their read and returns None, as vllm-omni's
            # receive loop then asks again on its next pass (bounded: 0.30.0's blocking get waits 1 s per call)
            out["first_none"].append(got is None)
            for _ in range(300):
                if got is not None:
                    break
                time.sleep(0.01)
                got = conn.get("0", "1", key)
            if got is None:
                out["mismatch"].append(f"case {n}: nothing received")
            else:
                # what vllm-omni 0.30.0's MooncakeStoreConnector hands over: its serializer's round trip
                want = OmniSerializer.deserialize(OmniSerializer.serialize(_payload(n, CASES[n][2])))
                _same(got[0], want, f"case {n}", out["mismatch"])
                out["sizes"].append(got[1])
            wr.write("ok\n")
            wr.flush()
        out["health"] = conn.health()
        wr.write("done\n")
        wr.flush()
    finally:
        conn.close()
    return out


@pytest.mark.parametrize("read_threads", [0, 2])
def test_fast_path_views_are_bit_identical_between_processes(stage_host, mooncake, read_threads):
    """Also with the receiver's parts read by threads of their own (``mooncake_read_threads``)."""
    from omni_accum.bench.mooncake import Job

    tag = f"fast{os.getpid()}-{read_threads}-"
    kw = {"extra": mooncake.connector_extra(), "tag": tag, "rx_extra": {"mooncake_read_threads": read_threads}}
    tx, rx = stage_host.run([Job("test_mooncake_fast:fast_sender", kw), Job("test_mooncake_fast:fast_receiver", kw)],
                            timeout=300)  # fmt: skip
    assert tx["type"] == "MooncakeFastConnector"
    assert rx["mismatch"] == []  # every value, every case: dtype, shape and bytes as 0.30.0's connector gives
    puts = tx["puts"]
    assert all(p["ok"] for p in puts)
    assert [p["fast"] for p in puts] == [1, 1, 1, 0, 0, 0]
    # 200 x 2048 bf16 (800 KiB) + 200 x 1024 fp16 (400 KiB): two parts, one of each tensor
    assert puts[0]["parts"] == 2
    # 640 x 2048 bf16 = 2.5 MiB -> 3 parts of a 1 MiB buffer; 640 x 1024 fp16 = 1.25 MiB -> 2
    assert puts[1]["parts"] == 5 and puts[2]["parts"] == 5
    assert tx["released_at"] == [f"{tag}rq-c_0_0"]  # released between two batch_put_from calls of that put
    assert rx["sizes"] == [p["size"] for p in puts]  # what was put is what was got
    h_tx, h_rx = tx["health"], rx["health"]
    # the first tensor's 3 parts were put (then removed: not in "left"), the second's 2 refused
    assert len(tx["refused_keys"]) == 5
    assert h_tx["fast_puts"] == 3 and h_tx["inner_puts"] == 3 and h_tx["fallbacks"] == {"mooncake_put_error": 1}
    # the tensors larger than the buffer went from their own registered memory (rq-b, rq-c, rq-e: 2 each);
    # the receiver read those of rq-b and rq-c straight into its tensors
    assert h_tx["direct_tensors"] == 6 and h_rx["direct_tensors"] == 4
    assert h_tx["puts"] == 6 and h_tx["bytes_transferred"] == sum(p["size"] for p in puts)
    assert h_rx["fast_gets"] == 3 and h_rx["inner_gets"] == 3 and h_rx["fallbacks"] == {}
    assert h_rx["read_threads"] == read_threads and h_rx["background_reads"] == (3 if read_threads else 0)
    # the get that found parts returned None while a reader thread read them; a serialized payload came at once
    assert rx["first_none"] == [bool(read_threads) and p["fast"] == 1 for p in puts]
    assert h_rx["remove_errors"] == 0
    # the receiver removed every fast-path key and part it took; 0.30.0's puts stay as 0.30.0 leaves them
    assert tx["left"] == [mooncake_key(tag, "rq-c", 1), mooncake_key(tag, "rq-d", 0), mooncake_key(tag, "rq-e", 0)]


def mooncake_key(tag: str, rq: str, chunk: int) -> str:
    return f"{tag}{rq}_0_{chunk}@0_1"


# ---------------------------------------------------------------------------------------------- #
# Through vllm-omni's chunk adapter: omni-accum's sending policy picks the tensors
# ---------------------------------------------------------------------------------------------- #

RIDS = 2
DECODE = 4


def _capturing(stage_fn: str, **kw):
    """Run ``mooncake_fixtures.<stage_fn>`` and add its connector's fast-path counts to what it returns."""
    import mooncake_fixtures as mf

    made = []
    orig = mf._adapter

    def adapter(*a, **k):
        made.append(orig(*a, **k))
        return made[-1]

    mf._adapter = adapter
    try:
        info = getattr(mf, stage_fn)(**kw)
    finally:
        mf._adapter = orig
    conn = made[0].connector
    info["connector"] = type(conn).__name__
    info["fast"] = {k: v for k, v in getattr(conn, "counts", {}).items()}
    info["fallbacks"] = dict(getattr(conn, "fallbacks", {}))
    info["get_poll"] = "blocking" if getattr(conn, "get_poll", None) is None else conn.get_poll
    info["fast_seconds"] = dict(getattr(conn, "seconds", {}))
    return info


def fast_thinker(**kw):
    return _capturing("thinker_stage", **kw)


def fast_talker(**kw):
    return _capturing("talker_stage", **kw)


def _adapter_run(stage_host, mooncake, label: str, name: str, env: dict, extra: dict | None = None) -> tuple[dict, dict]:
    from mooncake_fixtures import deploy_connector

    from omni_accum.bench.mooncake import Job

    rids = [f"mf-{label}-{os.getpid()}-{n}" for n in range(RIDS)]
    connector = deploy_connector(mooncake)
    # every appended tensor takes the fast path (this stream's prefill chunks are small), in parts of 4 KiB
    connector = {"name": name, "extra": {**connector["extra"], "mooncake_tensor_min_bytes": 1,
                                         "mooncake_buffer_bytes": 4096, **(extra or {})}
                 if name == NAME else connector["extra"]}  # fmt: skip
    base = {"OMNI_ACCUM_VLLM_OMNI": "1", "OMNI_ACCUM_POLICY": "qwen3-omni", "OMNI_ACCUM_METRICS": "0",
            "OMNI_ACCUM_DEPLOYMENT": f"mf-{label}-{os.getpid()}", **env}  # fmt: skip
    jobs = [
        Job("test_mooncake_fast:fast_thinker", {"connector": connector, "rids": rids, "decode_steps": DECODE}, base),
        Job("test_mooncake_fast:fast_talker", {"connector": connector, "rids": rids, "chunks": DECODE}, base),
    ]
    tx, rx = stage_host.run(jobs, timeout=300)
    rx["handed"] = {rid.split("-", 3)[-1]: v for rid, v in rx["handed"].items()}
    return tx, rx


def test_adapter_views_through_the_fast_path_equal_0_30_0s(stage_host, mooncake):
    """vllm-omni's thinker -> talker adapters over OmniAccumMooncakeConnector (qwen3-omni policy): the talker is
    handed bit for bit what it is handed over 0.30.0's MooncakeStoreConnector with omni-accum off; the tensors
    of the keys the policy appends went through registered buffers, in parts."""
    from test_integration_vllm_omni import assert_same

    up_tx, up_rx = _adapter_run(stage_host, mooncake, "up", "MooncakeStoreConnector", {"OMNI_ACCUM_VLLM_OMNI": "0"})
    assert up_tx["connector"] == "MooncakeStoreConnector"
    # 0.30.0's blocking get, then the polling get (one ask per call, at most one per 2 ms per key)
    # and with the parts read by reader threads, vllm-omni's receive loop asking again on its next pass
    threads = {"mooncake_read_threads": 2}
    for label, extra in (("fast", {}), ("poll", {"mooncake_get_poll": "2ms"}), ("threads", threads)):
        tx, rx = _adapter_run(stage_host, mooncake, label, NAME, {}, extra)
        assert tx["connector"] == "MooncakeFastConnector", label
        assert tx["installed"] and rx["installed"] and tx["errors"] == 0
        assert tx["fast"]["fast_puts"] > 0 and tx["fast"]["fast_parts"] > tx["fast"]["fast_puts"], tx["fast"]
        assert rx["fast"]["fast_gets"] == tx["fast"]["fast_puts"], (rx["fast"], tx["fast"])
        assert tx["fallbacks"] == {} and rx["fallbacks"] == {}
        assert tx["binding_wire_bytes"] == tx["bytes"]  # what the put returned is what the binding counted
        assert_same(rx["handed"], up_rx["handed"], f"handed ({label})")  # bit for bit, every request, every step
        assert rx["active_after_cleanup"] == 0
        assert rx["get_poll"] == (0.002 if label == "poll" else "blocking"), rx["get_poll"]
        assert rx["fast"]["background_reads"] == (rx["fast"]["fast_gets"] if label == "threads" else 0), rx["fast"]
        assert rx["fast_seconds"]["get_parts"] > 0 and tx["fast_seconds"]["put_parts"] > 0


def test_a_get_that_finds_nothing_names_the_key_it_waited_for(monkeypatch, caplog):
    """As 0.30.0's connector, a get that finds nothing in its 20 tries is counted and logged with the key (the
    one line that tells which chunk a stalled stage waits for, as seen in a link-down run across hosts)."""
    import logging
    import threading

    from omni_accum.integrations.vllm_omni import mooncake_connector as mc

    class _Empty:
        def get(self, key):
            return b""

    conn = object.__new__(mc.MooncakeFastConnector)
    conn.config, conn._closed, conn._rx_lock = {}, False, threading.Lock()
    conn.get_poll, conn.waits = None, mc.KeyWaits(None)
    conn.close = lambda: None  # nothing was opened (vllm-omni's base class closes at garbage collection)
    conn.inner = type("Inner", (), {"_metrics": {"timeouts": 0, "gets": 0}, "store": _Empty(),
                                    "_make_key": staticmethod(lambda k, f, t: f"{k}@{f}_{t}")})()  # fmt: skip
    monkeypatch.setattr("time.sleep", lambda s: None)
    with caplog.at_level(logging.WARNING):
        assert conn.get("0", "1", "req-7_0_0") is None
    assert conn.inner._metrics["timeouts"] == 1
    assert [r.getMessage() for r in caplog.records if "timeout waiting" in r.getMessage()] == [
        f"{NAME}: timeout waiting for req-7_0_0@0_1"
    ]


@pytest.mark.parametrize(
    "value, message",
    [("remote", "'remote' is not one of local, any"), ("", "'' is not one of local, any"),
     (True, "True is not one of local, any")],
)  # fmt: skip
def test_a_bad_parts_segment_is_named_with_the_choices(value, message):
    from omni_accum.integrations.vllm_omni import mooncake_connector as mc

    with pytest.raises(ValueError, match=f"{NAME}: extra.mooncake_parts_segment = {message}"):
        mc.MooncakeFastConnector({"mooncake_parts_segment": value})


@pytest.mark.parametrize("parts_segment", ["local", "any"])
@pytest.mark.parametrize("segment", [0, 512 << 20])
def test_the_parts_go_to_this_process_s_segment_only_when_asked_and_contributed(parts_segment, segment):
    """``local`` (the default) prefers this process's own segment when it contributes one; ``any`` keeps 0.30.0's
    replication config, so the master chooses (as for 0.30.0's own puts)."""
    from conftest import require_module

    from omni_accum.integrations.vllm_omni import mooncake_compat
    from omni_accum.integrations.vllm_omni import mooncake_connector as mc

    require_module("mooncake.store", "Mooncake's ReplicateConfig; installed by scripts/env.sh")
    was_applied = mooncake_compat.is_applied()
    assert mooncake_compat.apply_soft_pin()  # as the connector's set-up does: 0.30.0's name on Mooncake 0.3.13
    try:
        _check_part_pin(mc, parts_segment, segment)
    finally:
        if not was_applied:
            mooncake_compat.remove()


def _check_part_pin(mc, parts_segment: str, segment: int) -> None:
    conn = object.__new__(mc.MooncakeFastConnector)
    conn.close = lambda: None  # nothing was opened
    plain = object()  # 0.30.0's config, as its connector made it
    store = type("Store", (), {"get_hostname": lambda self: "10.0.0.2:12345"})()
    conn.inner = type("Inner", (), {"pin": plain, "segment": segment, "store": store})()
    conn.parts_segment, conn._pin, conn.local_segment = parts_segment, None, None
    pin = conn._part_pin()
    if parts_segment == "local" and segment:
        assert pin is not plain and pin.preferred_segment == "10.0.0.2:12345" and pin.with_soft_pin
        assert conn.local_segment == "10.0.0.2:12345"
    else:
        assert pin is plain and conn.local_segment is None
    assert conn._part_pin() is pin  # made once


@pytest.mark.parametrize("value", [-1, 65, "x", "", True, 1.5, "2.0"])
def test_a_bad_number_of_read_threads_is_named_with_the_range(value):
    from omni_accum.integrations.vllm_omni import mooncake_connector as mc

    with pytest.raises(ValueError, match=rf"{NAME}: extra.mooncake_read_threads = .* is not a whole number from 0 "
                                         r"\(reads in the get, the default\) to 64"):  # fmt: skip
        mc.MooncakeFastConnector({"mooncake_read_threads": value})


class _Buf:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


def test_background_reads_run_apart_hand_over_once_and_close_their_buffers():
    """:class:`BackgroundReads`: a read runs on a thread of its own (the caller does not wait), ``take`` says it is
    running until it ends, then hands its result over once; a failed read (None) is reported as done with None; each
    reader thread makes one staging buffer, and ``close`` waits for the reads, then closes the buffers."""
    from omni_accum.integrations.vllm_omni.mooncake_reads import DONE, NONE, RUNNING, BackgroundReads

    made: list[_Buf] = []
    reads = BackgroundReads(2, lambda: made.append(_Buf()) or made[-1])
    go = threading.Event()
    reads.start("k1", lambda buf: go.wait() and ("payload", buf))
    assert reads.take("k1") == (RUNNING, None)  # still waiting for `go`: start did not wait for it
    assert reads.take("other") == (NONE, None)
    go.set()
    reads._reads["k1"][0].result(timeout=60)  # the read's own future: it has ended
    state, got = reads.take("k1")
    assert state == DONE and got[0] == "payload" and got[1] is made[0]
    assert reads.take("k1") == (NONE, None)  # handed over once
    reads.start("k2", lambda buf: None)  # a failed read (counted by the connector's own code)
    reads._reads["k2"][0].result(timeout=60)
    assert reads.take("k2") == (DONE, None)
    assert 1 <= len(made) <= 2 and not any(b.closed for b in made)
    reads.close()
    assert all(b.closed for b in made) and len(reads) == 0


def test_a_finished_read_that_no_get_takes_is_dropped(monkeypatch):
    """A request aborted while its parts were read: the result is dropped after RESULT_TTL_S, not kept forever."""
    from omni_accum.integrations.vllm_omni import mooncake_reads as mr

    reads = mr.BackgroundReads(1, lambda: None)
    reads.start("gone", lambda buf: ("payload", 1))
    reads._reads["gone"][0].result(timeout=60)  # the read has ended
    now = [time.monotonic() + mr.RESULT_TTL_S + 1]
    monkeypatch.setattr(mr.time, "monotonic", lambda: now[0])
    reads.start("next", lambda buf: ("payload", 2))  # each start expires what no get took in time
    assert reads.dropped == 1 and reads.take("gone") == (mr.NONE, None)
    reads.close()
