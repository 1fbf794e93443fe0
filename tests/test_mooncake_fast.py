"""``OmniAccumMooncakeConnector``'s tensor fast path between two stage processes on a real Mooncake master:
the values received are bit for bit those 0.30.0's connector gives, a payload larger than one registered
buffer goes in parts, a request released mid-transfer completes whole, and nothing is left in the store."""

from __future__ import annotations

import json
import os
import re
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
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
    from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec

    from omni_accum.integrations.vllm_omni import mooncake_compat

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
            for _ in range(6000):  # ~60 s on a loaded host; ends as soon as the read does
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
    conn.config, conn._closed, conn._rx_lock, conn._count_lock = {}, False, threading.Lock(), threading.Lock()
    conn._init_gets()
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
    monkeypatch.setattr(mr, "_now", lambda: now[0])
    reads.start("next", lambda buf: ("payload", 2))  # each start expires what no get took in time
    assert reads.dropped == 1 and reads.take("gone") == (mr.NONE, None)
    reads.close()


# ---------------------------------------------------------------------------------------------- #
# Parts that cannot be read: read another way, or (gone from the store) the chunk removed and its request failed
# ---------------------------------------------------------------------------------------------- #


def _log_lines() -> list[tuple[str, str]]:
    """Every record of omni-accum's integration logger from now on, as (level, message)."""
    import logging

    lines: list[tuple[str, str]] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append((record.levelname, record.getMessage()))

    lg = logging.getLogger("omni_accum.vllm_omni")
    lg.addHandler(Keep())
    lg.setLevel(logging.INFO)
    return lines


class _Adapter:
    """Stands in for vllm-omni 0.30.0's receiving chunk adapter: what the connector reads of it and calls."""

    def __init__(self, mapping: dict[str, str]) -> None:
        self.request_ids_mapping = mapping  # internal request id -> external (the chunk keys' prefix)
        self._receiver_state_lock = threading.Lock()
        self.failed: dict[str, str] = {}

    def record_receive_failure(self, request_id: str, reason: str) -> None:
        self.failed.setdefault(request_id, reason)


def _get_until(conn, key: str, done, tries: int = 6000):  # ~60 s at most: a loaded host's read, not a clock
    """Get ``key`` as vllm-omni's receive loop does, until ``done(got)`` (a reader thread's read ends in between)."""
    got = conn.get("0", "1", key)
    for _ in range(tries):
        if done(got):
            break
        time.sleep(0.01)
        got = conn.get("0", "1", key)
    return got


def lost_part_job(*, pipes, extra: dict, tag: str, rx_extra: dict) -> dict:
    conn = _connector(1, {**extra, **rx_extra})
    conn.append_test = lambda path, value: path in APPENDS
    lines = _log_lines()
    rqs = ["lost-a", "lost-b"]
    adapter = _Adapter({f"int-{rq}": f"{tag}{rq}" for rq in rqs})
    conn.attach_receiver(adapter)
    out: dict = {"got": [], "missing": [], "keys": []}
    try:
        for n, rq in enumerate(rqs):
            get_key = f"{tag}{rq}_0_0"
            ok, _, meta = conn.put("0", "1", get_key, _payload(n, 640))
            parts = meta["mooncake_parts"]
            assert ok and len(parts) == 5
            assert conn.store.remove(parts[1], True) == 0  # evicted, as past the master's watermark
            out["missing"].append(parts[1])
            out["keys"] += [conn._make_key(get_key, "0", "1"), *parts]
            lost = conn.counts["lost_chunks"]
            got = _get_until(conn, get_key, lambda g, n=lost: conn.counts["lost_chunks"] > n)
            out["got"] += [got is None] + [conn.get("0", "1", get_key) is None for _ in range(3)]  # asked again
        out["left"] = [k for k, e in zip(out["keys"], conn.store.batch_is_exist(out["keys"])) if e != 0]
        out["health"] = conn.health()
        out["failed"] = adapter.failed
        out["lines"] = lines
    finally:
        conn.close()
    return out


@pytest.mark.parametrize("rx_extra", [{}, {"mooncake_get_poll": "2ms"}, {"mooncake_read_threads": 1}],
                         ids=["blocking", "poll", "threads"])  # fmt: skip
def test_a_chunk_whose_part_was_evicted_is_removed_counted_once_logged_once_and_its_request_failed(
        stage_host, mooncake, rx_extra):  # fmt: skip
    """A part gone from the store (Mooncake evicts soft-pinned objects past its watermark): the get returns None, one
    warning names the key and the missing part, ``mooncake_get_error`` counts the chunk once however often it is asked
    for, the key and its other parts are removed, and the receiving adapter is told to fail the request (vllm-omni
    0.30.0's ``record_receive_failure``) instead of waiting 600 s; no "timeout waiting" line for a key that was
    there."""
    from omni_accum.bench.mooncake import Job

    tag = f"lost{os.getpid()}-{len(rx_extra) and list(rx_extra)[0]}-"
    kw = {"extra": mooncake.connector_extra(), "tag": tag, "rx_extra": rx_extra}
    (out,) = stage_host.run([Job("test_mooncake_fast:lost_part_job", kw)], timeout=300)
    assert out["got"] == [True] * 8
    h = out["health"]
    assert h["fallbacks"] == {"mooncake_get_error": 2} and h["lost_chunks"] == 2 and h["fast_gets"] == 0
    assert out["left"] == []  # the key and every part of both chunks: nothing left behind
    assert sorted(out["failed"]) == ["int-lost-a", "int-lost-b"]
    for rq, missing in zip(["lost-a", "lost-b"], out["missing"]):
        key = f"{tag}{rq}_0_0@0_1"
        assert key in out["failed"][f"int-{rq}"] and missing in out["failed"][f"int-{rq}"]
        said = [m for lvl, m in out["lines"] if lvl == "WARNING" and f"chunk {key} lost" in m]
        assert len(said) == 1 and missing in said[0] and "removed from the store" in said[0], out["lines"]
    assert not [m for _, m in out["lines"] if "timeout waiting" in m], out["lines"]


class _NoRegister:
    """The store, except that no memory can be registered (an RDMA memlock limit on the receiving host, say)."""

    def __init__(self, store):
        self._store = store

    def register_buffer(self, ptr, n):
        return -1

    def __getattr__(self, name):
        return getattr(self._store, name)


class _GetIntoFails:
    """The store, except that ``batch_get_into`` fails for every part (their keys still exist)."""

    def __init__(self, store, plain_too: bool):
        self._store, self.plain_too = store, plain_too

    def batch_get_into(self, keys, ptrs, sizes):
        return [-1] * len(keys)

    def get(self, key):
        return b"" if self.plain_too and PART_SEP in key else self._store.get(key)

    def __getattr__(self, name):
        return getattr(self._store, name)


PART_SEP = "#oa"


def plain_read_job(*, pipes, extra: dict, tag: str) -> dict:
    from vllm_omni.distributed.omni_connectors.utils.serialization import OmniSerializer

    conn = _connector(1, extra)
    conn.append_test = lambda path, value: path in APPENDS
    out: dict = {"mismatch": [], "got": [], "phases": {}}
    cases = [("staged", 200, 20), ("direct", 640, 21), ("get-into", 640, 22), ("unreadable", 640, 23)]
    try:
        for name, rows, seed in cases:
            assert conn.put("0", "1", f"{tag}{name}_0_0", _payload(seed, rows))[0]
        real = conn.inner.store
        conn.inner.store = _NoRegister(real)  # from here on nothing registers (the send buffer did before)
        for name, rows, seed in cases[:2]:
            got = conn.get("0", "1", f"{tag}{name}_0_0")
            want = OmniSerializer.deserialize(OmniSerializer.serialize(_payload(seed, rows)))
            out["got"].append(got is not None)
            if got is not None:
                _same(got[0], want, name, out["mismatch"])
        out["phases"]["no_register"] = conn.health()
        # registration works again, but batch_get_into fails for every part: the plain get reads them
        conn._no_buffer_until["rx"] = 0.0
        conn.inner.store = _GetIntoFails(real, plain_too=False)
        got = conn.get("0", "1", f"{tag}get-into_0_0")
        want = OmniSerializer.deserialize(OmniSerializer.serialize(_payload(22, 640)))
        out["got"].append(got is not None)
        if got is not None:
            _same(got[0], want, "get-into", out["mismatch"])
        # parts that are there but cannot be read at all: counted once, the key kept; readable again: delivered
        conn.inner.store = _GetIntoFails(real, plain_too=True)
        out["unreadable"] = [conn.get("0", "1", f"{tag}unreadable_0_0") is None for _ in range(3)]
        out["phases"]["unreadable"] = conn.health()
        conn.inner.store = real
        got = conn.get("0", "1", f"{tag}unreadable_0_0")
        out["got"].append(got is not None)
        out["health"] = conn.health()
        keys = [conn._make_key(f"{tag}{name}_0_0", "0", "1") for name, *_ in cases]
        out["left"] = [k for k, e in zip(keys, conn.store.batch_is_exist(keys)) if e != 0]
    finally:
        conn.close()
    return out


def test_parts_that_cannot_be_read_through_registered_memory_are_read_the_plain_way_bit_for_bit(stage_host, mooncake):
    """A receiver that cannot register memory (a receive buffer, a tensor's own) and a ``batch_get_into`` that fails:
    the parts are read with the store's plain get, the chunk delivered bit for bit; registration is counted once (per
    retry period), not once per get. Parts that are in the store but unreadable count ``mooncake_get_error`` once for
    the chunk and keep its key, so a later get delivers it."""
    from omni_accum.bench.mooncake import Job

    tag = f"plain{os.getpid()}-"
    (out,) = stage_host.run([Job("test_mooncake_fast:plain_read_job", {"extra": mooncake.connector_extra(),
                                                                        "tag": tag})], timeout=300)  # fmt: skip
    assert out["got"] == [True, True, True, True] and out["mismatch"] == []
    first = out["phases"]["no_register"]
    # 200 rows: 2 parts through the (unregistrable) staging buffer; 640: 3 + 2 parts of tensors not registrable
    assert first["fallbacks"] == {"mooncake_register_error": 1} and first["plain_parts"] == 7
    assert first["fast_gets"] == 2 and first["buffers_registered"] == {"tx": True, "rx": False}
    assert out["unreadable"] == [True, True, True]
    assert out["phases"]["unreadable"]["fallbacks"]["mooncake_get_error"] == 1
    h = out["health"]
    assert h["fast_gets"] == 4 and h["plain_parts"] == 7 + 5 and h["lost_chunks"] == 0  # the last read as usual
    assert h["fallbacks"] == {"mooncake_register_error": 1, "mooncake_get_error": 1}
    assert out["left"] == []


def dropped_read_job(*, pipes, extra: dict, tag: str) -> dict:
    from vllm_omni.distributed.omni_connectors.utils.serialization import OmniSerializer

    from omni_accum.integrations.vllm_omni import mooncake_reads as mr

    conn = _connector(1, {**extra, "mooncake_read_threads": 1, "mooncake_get_poll": "2ms"})
    conn.append_test = lambda path, value: path in APPENDS
    lines = _log_lines()
    out: dict = {"mismatch": []}
    get_key = f"{tag}slow_0_0"
    key = conn._make_key(get_key, "0", "1")
    try:
        assert conn.put("0", "1", get_key, _payload(30, 640))[0]
        assert conn.get("0", "1", get_key) is None  # its read started on the reader thread
        conn.reads._reads[key][0].result(timeout=60)  # the read has finished; no get took it
        with conn.reads._lock:  # the receive loop came round later than RESULT_TTL_S
            dropped = conn.reads._expire(time.monotonic() + mr.RESULT_TTL_S + 1)
        conn.reads._let_go_of(dropped)  # outside the lock, as a take does
        out["dropped"] = conn.reads.dropped
        out["still_there"] = conn.store.is_exist(key) == 1
        got = _get_until(conn, get_key, lambda g: g is not None)
        out["got"] = got is not None
        if got is not None:
            want = OmniSerializer.deserialize(OmniSerializer.serialize(_payload(30, 640)))
            _same(got[0], want, "slow", out["mismatch"])
        out["gone_after"] = conn.store.is_exist(key) == 0
        out["said"] = [m for lvl, m in lines if lvl == "WARNING" and "dropped the finished read" in m]
        out["health"] = conn.health()
    finally:
        conn.close()
    return out


def test_a_read_no_get_took_in_time_is_dropped_with_its_key_kept_so_the_request_still_gets_its_chunk(
        stage_host, mooncake):  # fmt: skip
    """``mooncake_read_threads``: a finished read of a request still waiting that its get did not take within
    RESULT_TTL_S (a slow pass of vllm-omni's receive loop) is dropped, logged, and read again by the next get: the key
    and its parts are removed by the get that takes a read, not by the reader thread."""
    from omni_accum.bench.mooncake import Job

    tag = f"drop{os.getpid()}-"
    (out,) = stage_host.run([Job("test_mooncake_fast:dropped_read_job", {"extra": mooncake.connector_extra(),
                                                                          "tag": tag})], timeout=300)  # fmt: skip
    assert out["dropped"] == 1 and out["still_there"] is True
    assert out["got"] is True and out["mismatch"] == [] and out["gone_after"] is True
    assert len(out["said"]) == 1 and f"{tag}slow_0_0@0_1" in out["said"][0] and "stay in the store" in out["said"][0]
    assert out["health"]["reads_dropped"] == 1 and out["health"]["background_reads"] == 2


class _RegisterOnce:
    """A store whose ``register_buffer`` fails its first call only."""

    def __init__(self):
        self.calls = 0

    def register_buffer(self, ptr, n):
        self.calls += 1
        return -1 if self.calls == 1 else 0

    def unregister_buffer(self, ptr):
        return 0


def test_a_receive_buffer_that_cannot_be_registered_does_not_stop_the_puts(monkeypatch):
    """The send and receive buffers have their own registration state: the talker sends and receives on one
    connector, and a failed receive buffer sent every later put serialized. A failed direction is tried again after
    REGISTER_RETRY_S, not never."""
    from omni_accum.integrations.vllm_omni import mooncake_connector as mc

    conn = object.__new__(mc.MooncakeFastConnector)
    conn.close = lambda: None  # nothing was opened
    store = _RegisterOnce()
    conn.inner = type("Inner", (), {"store": store})()
    conn.buffer_bytes, conn._tx_buf, conn._rx_buf = 4096, None, None
    conn._no_buffer_until, conn.fallbacks, conn._count_lock = {"tx": 0.0, "rx": 0.0}, {}, threading.Lock()
    conn._init_gets()
    now = [100.0]
    monkeypatch.setattr(mc, "monotonic", lambda: now[0])
    assert conn._buffer("rx") is None  # its registration failed
    assert conn._buffer("tx") is not None  # the send side registers its own
    assert conn.fallbacks == {"mooncake_register_error": 1}
    assert conn._buffer("rx") is None and store.calls == 2  # not tried again at once
    now[0] += mc.REGISTER_RETRY_S + 1
    assert conn._buffer("rx") is not None and store.calls == 3


def test_a_receiving_adapter_is_made_known_to_its_mooncake_connector():
    """omni-accum's adapter hook attaches a receiving adapter to its connector (a lost chunk then fails its request)."""
    from omni_accum.integrations.vllm_omni import activation

    seen = []
    conn = type("Conn", (), {"stage_id": 1, "attach_receiver": lambda self, a: seen.append(a)})()
    rx = type("Adapter", (), {"connector": conn, "receives_chunks": True})()
    tx = type("Adapter", (), {"connector": type("Conn", (), {"stage_id": 0, "attach_receiver": seen.append})(),
                              "receives_chunks": False})()  # fmt: skip
    activation._on_made(rx)
    activation._on_made(tx)
    assert seen == [rx]


@pytest.mark.parametrize("extra, message", [
    ({"mooncake_buffer_bytes": "64GiB"}, "'64GiB' is 68719476736 bytes; it takes from 4096 to 1073741824 bytes"),
    ({"mooncake_buffer_bytes": 10**15}, "1000000000000000 bytes; it takes from 4096 to 1073741824 bytes"),
    ({"mooncake_buffer_bytes": "100"}, "'100' is 100 bytes; it takes from 4096"),
    ({"mooncake_tensor_min_bytes": 0}, "0 is 0 bytes; it takes at least 1 bytes"),
    ({"mooncake_read_threads": "\u0663"}, "is not a whole number from 0"),  # an Arabic-Indic 3: ASCII digits only
    ({"mooncake_get_poll": 1e-9}, "1e-09 is 1e-09 s: it must be from 0.1 ms to 1 s"),
])  # fmt: skip
def test_the_fast_path_s_sizes_and_numbers_are_bounded_and_named(extra, message):
    from omni_accum.integrations.vllm_omni.mooncake_settings import parse_settings

    with pytest.raises(ValueError, match=f"{NAME}: extra.{next(iter(extra))} = .*" + re.escape(message)):
        parse_settings(extra)


def test_a_size_reads_the_same_written_as_bytes_or_with_a_unit():
    """``mooncake_tensor_min_bytes``: ``1B`` is 1, as 1 is (a string went through the arena's 4096-byte minimum)."""
    from omni_accum.integrations.vllm_omni.mooncake_settings import notes, parse_settings

    for a, b in (("1B", 1), ("4KiB", 4096), ("256KiB", 256 << 10)):
        assert parse_settings({"mooncake_tensor_min_bytes": a}).tensor_min_bytes == b
        assert parse_settings({"mooncake_tensor_min_bytes": b}).tensor_min_bytes == b
    big = {"mooncake_buffer_bytes": "64MiB", "segment": 32 << 20}
    (note,) = notes(big, parse_settings(big))
    assert "mooncake_buffer_bytes (67108864 bytes) is larger than extra.segment (33554432 bytes)" in note
    assert notes({"segment": 0}, parse_settings({})) == [] and notes({}, parse_settings({})) == []


def test_a_failed_mooncake_setup_names_the_addresses_it_was_given(monkeypatch):
    """0.30.0's connector says only "Mooncake setup failed: -1" after ~90 s of retries against an unreachable master;
    omni-accum's connector names the master, the metadata server, the host and the protocol it used."""
    from omni_accum.integrations.vllm_omni import mooncake_connector as mc

    class Failing:
        def __init__(self, config):
            raise RuntimeError("Mooncake setup failed: -1")

    monkeypatch.setattr(mc, "_prepare", lambda: None)
    monkeypatch.setattr(mc, "_inner_class", lambda: Failing)
    extra = {"master": "10.0.0.1:50151", "metadata_server": "http://10.0.0.1:8080/metadata", "host": "10.0.0.2"}
    with pytest.raises(RuntimeError) as e:
        mc.MooncakeFastConnector(extra)
    said = str(e.value)
    assert said.startswith(f"{NAME}: Mooncake setup failed with master '10.0.0.1:50151', metadata_server "
                           "'http://10.0.0.1:8080/metadata', host '10.0.0.2', proto 'tcp': Mooncake setup failed: -1")


def _no_setup(monkeypatch, mc) -> None:
    """vllm-omni's connector (whose Mooncake setup retries ~90 s against a bad address) fails the test if built."""

    class NeverBuilt:
        def __init__(self, config):
            pytest.fail(f"Mooncake's setup reached with {config!r}")

    monkeypatch.setattr(mc, "_prepare", lambda: None)
    monkeypatch.setattr(mc, "_inner_class", lambda: NeverBuilt)


GOOD_STORE = {"master": "10.0.0.1:50151", "metadata_server": "http://10.0.0.1:8080/metadata", "host": "10.0.0.2"}


@pytest.mark.parametrize("change, said", [
    ({"master": "10.0.0.1"}, "extra.master = '10.0.0.1' has no port (HOST:PORT)"),
    ({"master": "http://10.0.0.1:50151"}, "extra.master = 'http://10.0.0.1:50151' has a scheme (http://)"),
    ({"metadata_server": "10.0.0.1:8080/metadata"}, "extra.metadata_server = '10.0.0.1:8080/metadata' has no scheme: "
                                                    "Mooncake takes it for an etcd address"),
    ({"proto": "tpc"}, "extra.proto = 'tpc' is not a protocol Mooncake knows (did you mean tcp?): the stage does not "
                       "start; one of: tcp, rdma"),
    ({"mastr": "10.0.0.1:50151"}, "extra.mastr: vllm-omni's MooncakeStoreConnector reads no 'mastr' (did you mean "
                                  "master?)"),
    ({"PROTO": "rdma"}, "extra.PROTO: vllm-omni's MooncakeStoreConnector reads no 'PROTO' (did you mean proto?); "
                        "without proto it uses 'tcp'"),  # written otherwise: compared as keys are (it was ignored)
    ({"host": ""}, "extra.host = '' is not an address"),
    ({"master": "etcd://10.0.0.1"}, "extra.master = 'etcd://10.0.0.1' (Mooncake's HA form, "
                                    "etcd://HOST:PORT[;HOST:PORT]): etcd endpoint '10.0.0.1' has no port"),
])  # fmt: skip
def test_a_bad_store_setting_is_refused_when_built_naming_the_key_before_mooncake_s_setup(monkeypatch, change, said):
    """0.30.0's connector took these as given: Mooncake's setup then retried ~90 s and failed naming no address, or
    waited on etcd. The connector refuses them when it is built, as ``doctor --deploy`` names them."""
    from omni_accum.integrations.vllm_omni import mooncake_connector as mc

    _no_setup(monkeypatch, mc)
    extra = {k: v for k, v in {**GOOD_STORE, **change}.items() if not (k == "master" and "mastr" in change)}
    with pytest.raises(ValueError) as e:
        mc.MooncakeFastConnector({**extra, "stage_id": 0})
    assert str(e.value).startswith(f"{NAME}: {said}"), str(e.value)


@pytest.mark.parametrize("key, value", [("segment", "512MiB"), ("localbuf", 67108864.0), ("segment", -1),
                                        ("localbuf", "64MiB"), ("localbuf", 0), ("segment", True)])
def test_a_size_of_the_store_written_otherwise_than_in_bytes_is_named_not_blamed_on_the_master(monkeypatch, key,
                                                                                                value):  # fmt: skip
    """``segment: "512MiB"`` failed at once inside Mooncake's setup ("incompatible function arguments"), and the
    connector's message blamed the master and named no key."""
    from omni_accum.integrations.vllm_omni import mooncake_connector as mc

    _no_setup(monkeypatch, mc)
    with pytest.raises(ValueError) as e:
        mc.MooncakeFastConnector({**GOOD_STORE, key: value})
    said = str(e.value)
    assert said.startswith(f"{NAME}: extra.{key} = {value!r}: vllm-omni passes it to Mooncake's setup as a whole "
                           "number of bytes"), said
    assert f"give {key} in bytes" in said and "master" not in said, said


@pytest.mark.parametrize("extra", [
    GOOD_STORE, {}, {**GOOD_STORE, "metadata_server": "P2PHANDSHAKE"}, {**GOOD_STORE, "master": "[fd00::1]:50151"},
    {**GOOD_STORE, "metadata_server": "etcd://10.0.0.1:2379", "segment": 0, "localbuf": 1 << 30, "proto": "rdma"},
    {**GOOD_STORE, "metadata_server": "10.0.0.1:2379"},  # an etcd endpoint: doctor notes it, it may be right
    {**GOOD_STORE, "proto": "nvlink"},  # not in the CPU build: doctor notes it
    # (review) Mooncake's HA master, found in etcd; transports of other Mooncake builds, and one omni-accum does not
    # know with no close match: the connector refused them
    {**GOOD_STORE, "master": "etcd://10.0.0.1:2379;10.0.0.2:2379"}, {**GOOD_STORE, "master": "etcd://10.0.0.1:2379"},
    {**GOOD_STORE, "proto": "ubshmem"}, {**GOOD_STORE, "proto": "sunrise_link"}, {**GOOD_STORE, "proto": "quantum"},
])  # fmt: skip
def test_store_settings_that_may_be_right_reach_mooncake_s_setup_unchanged(monkeypatch, extra):
    from omni_accum.integrations.vllm_omni import mooncake_connector as mc

    seen = []

    class Inner:
        def __init__(self, config):
            seen.append(config)

        def close(self):
            pass

    monkeypatch.setattr(mc, "_prepare", lambda: None)
    monkeypatch.setattr(mc, "_inner_class", lambda: Inner)
    mc.MooncakeFastConnector({**extra, "stage_id": 1, "mooncake_get_poll": "2ms"}).close()
    assert seen == [{**extra, "stage_id": 1}]


def test_every_shipped_fast_path_deploy_builds(monkeypatch):
    """The checks refuse no connector of the deploys this repository ships (``doctor`` reads them the same way)."""
    from pathlib import Path

    import yaml

    from omni_accum.integrations.vllm_omni import mooncake_connector as mc

    built = []

    class Inner:
        def __init__(self, config):
            built.append(config)

        def close(self):
            pass

    monkeypatch.setattr(mc, "_prepare", lambda: None)
    monkeypatch.setattr(mc, "_inner_class", lambda: Inner)
    root = Path(__file__).resolve().parents[1]
    deploys = sorted(root.glob("config/deploy/*.yaml")) + sorted(root.glob("benchmarks/e2e/configs/**/*.yaml"))
    files = [f for f in deploys if NAME in f.read_text()]
    assert len(files) >= 4, files
    for f in files:
        for conn in yaml.safe_load(f.read_text())["connectors"].values():
            if conn["name"] == NAME:
                mc.MooncakeFastConnector({**conn["extra"], "stage_id": 0}).close()
    assert len(built) >= len(files)


def test_a_staging_buffer_larger_than_the_segment_is_warned_about_as_the_docs_say(monkeypatch, caplog):
    """Not refused (parts of smaller tensors fit; with ``any`` or another holder a larger segment may take them): the
    connector warns when it is built, and docs/mooncake.md says so rather than stating a limit."""
    import logging
    from pathlib import Path

    from omni_accum.integrations.vllm_omni import mooncake_connector as mc

    class Inner:
        def __init__(self, config):
            pass

        def close(self):
            pass

    monkeypatch.setattr(mc, "_prepare", lambda: None)
    monkeypatch.setattr(mc, "_inner_class", lambda: Inner)
    with caplog.at_level(logging.WARNING, logger="omni_accum.vllm_omni"):
        mc.MooncakeFastConnector({**GOOD_STORE, "segment": 32 << 20, "mooncake_buffer_bytes": "64MiB"}).close()
    (said,) = [r.getMessage() for r in caplog.records if "mooncake_buffer_bytes" in r.getMessage()]
    assert "larger than extra.segment (33554432 bytes)" in said, said
    assert "another stage's (or holder's) segment" in said, said  # where Mooncake puts it (it said: "refused")
    docs = (Path(__file__).resolve().parents[1] / "docs" / "mooncake.md").read_text()
    block = docs[docs.index("      mooncake_buffer_bytes: 16MiB"):docs.index("      mooncake_tensor_min_bytes: 256KiB")]
    assert "at most the segment" not in block and "warn" in block, block


def test_an_idle_servers_gets_let_go_of_finished_reads_no_get_took(monkeypatch, caplog):
    """A finished read was dropped only when the next read started: an idle server (gets of other keys, no new read)
    held aborted requests' reads, up to MAX_HELD_BYTES, for good."""
    import logging

    from omni_accum.integrations.vllm_omni import mooncake_reads

    reads = mooncake_reads.BackgroundReads(1, lambda: None)
    try:
        reads.start("aborted_0_0", lambda buf: torch.zeros(1024))
        clock = [time.monotonic()]
        monkeypatch.setattr(mooncake_reads, "_now", lambda: clock[0])
        waited = 0
        while reads.take("other")[0] == mooncake_reads.NONE and not reads._reads["aborted_0_0"][1] and waited < 600:
            time.sleep(0.1)  # (the read finishing on its thread)
            waited += 1
        assert reads._reads["aborted_0_0"][1] and reads.dropped == 0
        reads._reads["aborted_0_0"][0].result(timeout=60)  # (its finish time is noted a moment before it is done)
        caplog.set_level(logging.WARNING, "omni_accum")
        clock[0] += mooncake_reads.RESULT_TTL_S + 2  # no read starts; gets of other keys go on
        assert reads.take("other") == (mooncake_reads.NONE, None)
        assert reads.dropped == 1 and len(reads) == 0 and "dropped the finished read of aborted_0_0" in caplog.text
    finally:
        monkeypatch.undo()
        reads.close()
