"""The arena connector without a region for a pair: a private directory it cannot use (a bad
``OMNI_ACCUM_ARENA_DIR``), a second receiver or a second sender of a pair. Each is counted in
``omni_accum_fallbacks_total``, said once naming what to fix (the variable and its value; the ``arena_name`` and
where it came from), shown in ``status().connectors``, and the receiving side tries again every ``CREATE_RETRY_S``:
it turned the arena off for the server's life, unseen, and said "one receiving process per stage pair" whatever the
cause. Real connectors from vllm-omni's factory, CPU."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import pytest
import torch

from tests.test_integration_vllm_omni import _wait
from tests.test_integration_vllm_omni_arena_connector import _connector
from tests.test_samehost import _key, _put_until_arena

pytestmark = pytest.mark.vllm
NAME = "OmniAccumArenaConnector"


def _chunk_key(request: str) -> str:
    """vllm-omni's put key of the request's first chunk (``<request>_<stage>_<chunk>``), this process's pid in the
    request id: a chunk that goes the inner way is /dev/shm/<key>, which a fixed name would share with a test of
    another pytest process."""
    return f"{request}p{os.getpid()}_0_0"


def _fallbacks(reason: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("omni_accum_fallbacks_total", {"reason": reason}) or 0.0


def _row(name: str, stage: int) -> dict[str, Any]:
    from omni_accum.integrations.vllm_omni import reporting

    rows = [r for r in reporting.status().connectors if r["arena_name"] == name and r["stage"] == stage]
    assert len(rows) == 1, reporting.status().connectors
    return rows[0]


def _from_env(stage_id: int, **extra: Any) -> Any:
    """A connector whose ``extra`` names no ``arena_name`` (``OMNI_ACCUM_ARENA_NAME`` gives it)."""
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
    from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec

    from omni_accum.integrations.vllm_omni import arena_plugin

    arena_plugin.register()
    return OmniConnectorFactory.create_connector(ConnectorSpec(name=NAME, extra={"stage_id": stage_id, **extra}))


@pytest.fixture
def quick_retry(monkeypatch):
    from omni_accum.integrations.vllm_omni import arena_pairs

    monkeypatch.delenv("OMNI_ACCUM_METRICS", raising=False)
    monkeypatch.setattr(arena_pairs, "CREATE_RETRY_S", 0.2)
    return monkeypatch


@pytest.mark.parametrize("bad", ["missing", "a plain file", "world-writable without the sticky bit"])
def test_a_bad_arena_dir_is_counted_named_and_tried_again(vo, quick_retry, tmp_path, caplog, bad):
    base = tmp_path / "shm"
    if bad == "a plain file":
        base.write_text("")
    elif bad != "missing":
        base.mkdir()
        os.chmod(base, 0o777)
    quick_retry.setenv("OMNI_ACCUM_ARENA_DIR", str(base))
    reason = "samehost_refused" if bad.startswith("world") else "arena_unavailable"
    name = f"baddir{os.getpid()}_{len(bad)}"
    before = _fallbacks(reason)
    caplog.set_level(logging.WARNING, "omni_accum")
    rx, tx = _connector(1, name), _connector(0, name)
    try:
        assert rx.get("0", "1", _key(0)) is None
        said = [r.getMessage() for r in caplog.records if f"arena {name}_0_1" in r.getMessage()]
        assert said and f"OMNI_ACCUM_ARENA_DIR={str(base)!r}" in said[0], caplog.text
        assert "tries again every 0.2 s" in said[0] and "one receiving process" not in said[0], said
        assert _fallbacks(reason) - before >= 1
        row = _row(name, 1)
        assert str(base) in row["inner_only"][f"{name}_0_1 (receive)"] and row["regions"] == [], row
        payload = {"x": torch.arange(6)}
        assert tx.put("0", "1", _key(1), payload)[0]  # nothing is lost meanwhile: the inner connector
        assert torch.equal(rx.get("0", "1", _key(1))[0]["x"], payload["x"])
        if bad == "a plain file":  # fixed: the next try makes the region, the sender attaches
            base.unlink()
            base.mkdir(mode=0o700)
        elif bad == "missing":
            base.mkdir(mode=0o700)
        else:
            os.chmod(base, 0o1777)  # as /dev/shm
        time.sleep(0.25)
        assert rx.get("0", "1", _key(2)) is None and rx.health()["regions"] == [f"{name}_0_1 (receive)"]
        keys = _put_until_arena(tx, lambda: payload)
        for k in keys:
            assert torch.equal(rx.get("0", "1", k)[0]["x"], payload["x"])
        assert rx.health()["inner_only"] == {} and tx.health()["inner_only"] == {}
        assert _row(name, 1)["inner_only"] == {} and _row(name, 0)["arena_puts"] == 1
    finally:
        tx.close()
        rx.close()


def test_a_second_receiver_is_counted_names_the_arena_name_and_its_source_and_takes_over_later(vo, quick_retry,
                                                                                                  caplog):
    """Two servers (or two stage processes) on one host with the same arena_name: the second receiver's pair goes
    through SharedMemoryConnector, counted (``arena_in_use``), the message names the arena_name and where it came
    from (here ``OMNI_ACCUM_ARENA_NAME``); once the first is gone, the second makes the pair's region."""
    name = f"twice{os.getpid()}"
    quick_retry.setenv("OMNI_ACCUM_ARENA_NAME", name)
    caplog.set_level(logging.WARNING, "omni_accum")
    first, second = _from_env(1), _from_env(1)
    try:
        assert first.get("0", "1", _key(0)) is None  # the pair's region
        before = _fallbacks("arena_in_use")
        assert second.get("0", "1", _key(0)) is None
        assert second.fallbacks == {"in_use": 1} and _fallbacks("arena_in_use") - before == 1
        text = caplog.text
        assert f"arena_name {name!r} (from OMNI_ACCUM_ARENA_NAME) is taken on this host" in text, text
        assert f"in use by a live receiver (pid {os.getpid()})" in text, text
        assert "another server on this host needs its own" in text, text
        rows = [r for r in _from_status(name) if r["inner_only"]]
        assert len(rows) == 1 and rows[0]["fallbacks"] == {"in_use": 1}, rows
        assert "arena_in_use" in next(iter(rows[0]["inner_only"].values()))
        first.close()
        time.sleep(0.25)
        assert second.get("0", "1", _key(1)) is None
        assert second.health()["regions"] == [f"{name}_0_1 (receive)"] and second.health()["inner_only"] == {}
    finally:
        second.close()
        first.close()


def _from_status(name: str) -> list[dict[str, Any]]:
    from omni_accum.integrations.vllm_omni import reporting

    return [r for r in reporting.status().connectors if r["arena_name"] == name and r["status"] == "healthy"]


def test_a_second_sender_counts_each_put_it_sends_the_inner_way(vo, quick_retry, caplog):
    name = f"twotx{os.getpid()}"
    caplog.set_level(logging.WARNING, "omni_accum")
    rx, tx, other = _connector(1, name), _connector(0, name), _connector(0, name)
    try:
        assert rx.get("0", "1", "prime") is None
        keys = _put_until_arena(tx, lambda: {"x": torch.arange(3)})
        before = _fallbacks("arena_sender_in_use")
        for i in range(3):
            assert other.put("0", "1", f"o{os.getpid()}_{i}", {"x": torch.arange(3) + i})[0]
        assert other.fallbacks == {"sender_in_use": 3} and other.counts["inner_puts"] == 3
        assert _fallbacks("arena_sender_in_use") - before == 3
        assert f"another process sends on arena_name {name!r} (from extra.arena_name)" in caplog.text, caplog.text
        for i in range(3):  # nothing lost
            assert torch.equal(rx.get("0", "1", f"o{os.getpid()}_{i}")[0]["x"], torch.arange(3) + i)
        for k in keys:
            assert rx.get("0", "1", k) is not None
        assert "sender_in_use" in next(iter(other.health()["inner_only"].values()))
    finally:
        for c in (other, tx, rx):
            c.close()


def test_a_bad_arena_name_from_the_environment_is_named_as_the_variable(vo, monkeypatch):
    """It was reported as a bad ``extra.arena_name``, a key the deploy does not have."""
    monkeypatch.setenv("OMNI_ACCUM_ARENA_NAME", "my/server")
    with pytest.raises(ValueError, match=r"OMNI_ACCUM_ARENA_NAME='my/server' \(no extra.arena_name\): use letters"):
        _from_env(1)
    with pytest.raises(ValueError, match=r"extra.arena_name = 'a b': use letters"):  # the extra's own: as before
        _from_env(1, arena_name="a b")
    monkeypatch.setenv("OMNI_ACCUM_ARENA_NAME", "fine")
    c = _from_env(1)
    try:
        assert c.arena_name == "fine" and c.arena_name_from == "OMNI_ACCUM_ARENA_NAME"
    finally:
        c.close()


def test_the_status_file_carries_each_arena_connector_s_row(vo, quick_retry, tmp_path):
    """health() is in-process only (vllm-omni never calls it): the status file now says what it says."""
    import json

    from omni_accum.integrations.vllm_omni import reporting

    quick_retry.setenv("OMNI_ACCUM_STATUS_DIR", str(tmp_path / "status"))
    quick_retry.setenv("OMNI_ACCUM_ARENA_DIR", str(tmp_path / "missing"))
    name = f"sf{os.getpid()}"
    rx = _connector(1, name)
    try:
        assert rx.get("0", "1", f"k{os.getpid()}") is None
        path = reporting.write()
        _wait(lambda: os.path.exists(path), "the status file")
        with open(path, encoding="utf-8") as f:
            rows = [r for r in json.load(f)["connectors"] if r["arena_name"] == name]
        assert len(rows) == 1 and rows[0]["fallbacks"] == {"unavailable": 1}, rows
        assert "OMNI_ACCUM_ARENA_DIR=" in rows[0]["inner_only"][f"{name}_0_1 (receive)"]
    finally:
        rx.close()


@pytest.fixture
def quick_replicas(quick_retry):
    from omni_accum.integrations.vllm_omni import arena_pairs

    quick_retry.setattr(arena_pairs, "REPLICA_CHECK_S", 0.02)
    return quick_retry


def _payload(i: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(i)
    return {"embed": {"prefill": torch.randn(300, 64, generator=g).bfloat16()}, "ids": {"prompt": list(range(i + 2))}}


def _get_within(c: Any, key: str, seconds: float = 10.0) -> Any:
    """The payload a get of ``key`` finds (polled: the owner forwards it from another thread; a hang guard)."""
    got: list[Any] = []
    _wait(lambda: got.append(c.get("0", "1", key)) or got[-1] is not None, f"{key}: a get that finds it", seconds)
    return got[-1][0]


def test_a_replica_of_the_receiving_stage_gets_its_requests_chunks_sent_before_and_after_it_said_so(vo,
                                                                                                     quick_replicas):
    """Two receiving processes of one stage pair (vllm-omni's ``num_replicas: 2`` on the talker): the ring has one
    reader, the region's owner, and the sender cannot tell which replica a message is for. The replica's chunks went
    into the owner's region and no get of the replica ever found them (vllm-omni fails such a request after its input
    wait, 10 min). Now a message put before the replica said so is forwarded by the owner, with no get of the
    owner's own (an idle owner), and later ones go through SharedMemoryConnector; the same values in both."""
    from tests.test_integration_vllm_omni import assert_same

    from omni_accum.arena.live import replicas_path

    name = f"replicas{os.getpid()}"
    owner, replica, tx = _connector(1, name), _connector(1, name), _connector(0, name)
    try:
        assert owner.get("0", "1", "prime") is None  # the owner makes the pair's region
        _put_until_arena(tx, lambda: {"x": torch.arange(3)})
        early = tx.counts["arena_puts"]
        r1, r2, r3, r4 = (_chunk_key(f"r{i}") for i in range(1, 5))
        assert tx.put("0", "1", r1, _payload(1))[0] and tx.counts["arena_puts"] == early + 1  # into the region
        before = _fallbacks("arena_replicas")
        got = _get_within(replica, r1)  # its first get: in use, so it marks the pair; the owner forwards
        assert_same(got, _payload(1), "forwarded")
        # (the forwarded segment is readable a moment before the owner's thread counts it)
        _wait(lambda: owner.counts["forwarded"] >= 1, "the owner's forward counted")
        assert replicas_path(f"{name}_0_1").exists()
        _wait(lambda: tx._shared(("0", "1")), "the sender sees the replica mark")
        assert tx.put("0", "1", r2, _payload(2))[2].get("shm") is not None  # the inner way
        assert tx.fallbacks.get("replicas", 0) >= 1 and _fallbacks("arena_replicas") - before >= 1
        assert "arena_replicas" in next(iter(tx.health()["inner_only"].values()))
        assert_same(_get_within(replica, r2), _payload(2), "sent the inner way")
        assert tx.put("0", "1", r3, _payload(3))[2].get("shm") is not None
        assert_same(_get_within(owner, r3), _payload(3), "the owner's own request")  # found the inner way too
        replica.close()  # it no longer receives: its mark goes, and the sender sends through the arena again
        assert not replicas_path(f"{name}_0_1").exists()
        _wait(lambda: not tx._shared(("0", "1")), "the sender sees the mark gone")
        assert tx.put("0", "1", r4, _payload(4))[2].get("arena") is not None  # the arena again
        assert tx.health()["inner_only"] == {}
        assert_same(_get_within(owner, r4), _payload(4), "through the arena")
    finally:
        for c in (tx, replica, owner):
            c.close()


def test_a_replica_mark_whose_writer_died_is_removed_and_not_followed(vo, quick_replicas, tmp_path):
    import subprocess
    import sys

    from omni_accum import samehost
    from omni_accum.arena.live import replicas_marked, replicas_path

    name = f"deadmark{os.getpid()}"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    samehost.write_private(replicas_path(f"{name}_0_1"), dead.stdout.strip().encode(), "test")
    assert not replicas_marked(f"{name}_0_1") and not replicas_path(f"{name}_0_1").exists()
    rx, tx = _connector(1, name), _connector(0, name)
    try:
        assert rx.get("0", "1", "prime") is None
        _put_until_arena(tx, lambda: {"x": torch.arange(3)})
        assert tx.put("0", "1", f"k{os.getpid()}", _payload(0))[2].get("arena") is not None and tx.fallbacks == {}
    finally:
        tx.close()
        rx.close()


def _owner_process(name: str, ready: Any, stop: Any) -> None:
    """A talker replica that made the pair's region and then has no request of its own (no get)."""
    c = _connector(1, name)
    c.get("0", "1", "prime")
    ready.set()
    stop.wait(60)
    c.close()


def _replica_process(name: str, key: str, seed: int, go: Any, out: Any) -> None:
    """A talker replica whose first get comes after the chunk for its request was put into the owner's region."""
    from tests.test_integration_vllm_omni import assert_same

    c = _connector(1, name)
    go.wait(60)
    try:
        assert_same(_get_within(c, key, 30.0), _payload(seed), "in the replica")
        out.put("same")
    except AssertionError as e:
        out.put(str(e))
    finally:
        c.close()


def test_replicas_in_processes_of_their_own_get_every_chunk(vo, quick_retry):
    """As above across three processes (pids differ; the owner never gets, so only its forwarding thread can
    help): without it the replica never found its chunk."""
    from omni_accum.arena.live import replicas_path
    from tests.forked import context, process  # forked from a server that imported vllm-omni once

    ctx = context()
    name = f"mpreplicas{os.getpid()}"
    ready, stop, go, out = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    owner = process(_owner_process, name, ready, stop)
    replica = process(_replica_process, name, _chunk_key("r7"), 7, go, out)
    owner.start()
    replica.start()
    tx = _connector(0, name)
    try:
        assert ready.wait(120), "the owner made no region"
        _put_until_arena(tx, lambda: {"x": torch.arange(3)})
        assert tx.put("0", "1", _chunk_key("r7"), _payload(7))[2].get("arena") is not None  # into the owner's region
        go.set()
        assert out.get(timeout=120) == "same"  # (a hang guard)
        replica.join(30)
        assert replica.exitcode == 0 and not replicas_path(f"{name}_0_1").exists()  # its mark went with it
    finally:
        stop.set()
        go.set()
        tx.close()
        for p in (replica, owner):
            p.join(30)
            if p.is_alive():
                p.kill()
    assert owner.exitcode == 0


def test_two_replicas_that_made_their_regions_at_the_same_moment_both_get_their_chunks(vo, quick_replicas):
    """Both receivers found no region (their first gets at one moment) and each made one; the pointer named only the
    later, so the sender put everything there and the other never saw its chunks, with no mark written. The one whose
    region the pointer does not name now marks the pair, and both get their requests' chunks."""
    from tests.test_integration_vllm_omni import assert_same

    from omni_accum.arena.region import ArenaError
    from omni_accum.integrations.vllm_omni import arena_pairs

    name = f"racing{os.getpid()}"
    first, second, tx = _connector(1, name), _connector(1, name), _connector(0, name)
    real = arena_pairs.live_region
    try:
        assert first.get("0", "1", "prime") is None  # makes a region
        calls = []

        def not_yet(base):  # the second receiver looked before the first one's pointer was there
            if not calls:
                calls.append(base)
                raise ArenaError("no live arena yet")
            return real(base)

        quick_replicas.setattr(arena_pairs, "live_region", not_yet)
        assert second.get("0", "1", "prime") is None  # makes another; the pointer now names it
        quick_replicas.setattr(arena_pairs, "live_region", real)
        assert len(first.health()["regions"]) == len(second.health()["regions"]) == 1
        _put_until_arena(tx, lambda: {"x": torch.arange(3)})
        key_a, key_b = _chunk_key("rA"), _chunk_key("rB")
        assert tx.put("0", "1", key_a, _payload(5))[0] and tx.put("0", "1", key_b, _payload(6))[0]
        assert_same(_get_within(first, key_a), _payload(5), "the receiver the pointer does not name")
        assert_same(_get_within(second, key_b), _payload(6), "the one it names")
    finally:
        for c in (tx, second, first):
            c.close()


def test_a_receiver_without_a_region_forgets_the_requests_it_took_after_the_orphan_time(vo, quick_retry, tmp_path):
    """Each get records when its request last took a chunk (the orphan look spares a request still taking them);
    that record was pruned only by the look of a connector with a region: one with none (a directory it cannot
    use, a receiving replica) kept an entry per request for good."""
    from omni_accum.integrations.vllm_omni import arena_connector

    clock = [1000.0]
    quick_retry.setattr(arena_connector, "_now", lambda: clock[0])
    base = tmp_path / "shm"
    base.write_text("")  # not a directory: no region
    quick_retry.setenv("OMNI_ACCUM_ARENA_DIR", str(base))
    name = f"noregion{os.getpid()}"
    rx, tx = _connector(1, name), _connector(0, name)
    try:
        for i in range(5):
            key = _chunk_key(f"r{i}")
            assert tx.put("0", "1", key, {"x": torch.arange(3) + i})[0]
            assert torch.equal(rx.get("0", "1", key)[0]["x"], torch.arange(3) + i)
        assert rx.health()["regions"] == [] and len(rx._alive) == 5
        clock[0] += rx.orphan_s + arena_connector.ORPHAN_CHECK_S + 1
        key = _chunk_key("r5")
        assert tx.put("0", "1", key, {"x": torch.arange(2)})[0] and rx.get("0", "1", key) is not None
        assert sorted(rx._alive) == [f"r5p{os.getpid()}"], rx._alive
    finally:
        tx.close()
        rx.close()
