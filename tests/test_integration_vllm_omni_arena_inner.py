"""The arena connector's messages that went through its inner ``SharedMemoryConnector`` and that no get takes (an
aborted request's chunks: a put before the receiver made its region, or one the region's owner forwarded to a
replica). vllm-omni 0.30.0 unlinks such segments only for a connector that is a ``SharedMemoryConnector``, so they
stayed in ``/dev/shm`` for the server's life; now the process that put them unlinks them after the arena's orphan
time, from its connector's thread (an idle process too). The region's own untaken messages are dropped from that
thread as well. Real connectors from vllm-omni's factory, CPU; the orphan clocks are moved."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch

from tests.test_integration_vllm_omni import _wait
from tests.test_integration_vllm_omni_arena_connector import _connector
from tests.test_samehost import _put_until_arena

pytestmark = pytest.mark.vllm


@pytest.fixture
def quick(monkeypatch):
    from omni_accum.integrations.vllm_omni import arena_pairs

    monkeypatch.delenv("OMNI_ACCUM_METRICS", raising=False)
    monkeypatch.setattr(arena_pairs, "CREATE_RETRY_S", 0.2)
    monkeypatch.setattr(arena_pairs, "REPLICA_CHECK_S", 0.02)
    return monkeypatch


class _Clock:
    """The orphan clock of one connector, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _seg(key: str) -> str:
    return f"/dev/shm/{key}"


def _payload(i: int, rows: int = 600) -> dict[str, Any]:
    g = torch.Generator().manual_seed(i)  # 600 x 64 bf16: 76,800 bytes, above arena_view_bytes (a view when taken)
    return {"embed": {"prefill": torch.randn(rows, 64, generator=g).bfloat16()}, "ids": {"prompt": list(range(i + 2))}}


def test_a_put_the_inner_way_that_no_get_takes_is_unlinked_after_the_orphan_time(vo, quick, caplog):
    """No receiver has made the pair's region yet, so both puts go through the inner connector; one is taken, the
    other's request was aborted on the receiving stage. The sender, idle after its puts, unlinks the untaken one once
    the orphan time has passed, not before, and counts it; the taken one is only forgotten."""
    from tests.test_integration_vllm_omni import assert_same

    name = f"innerorph{os.getpid()}"
    lost, taken = f"lost{os.getpid()}_0_0", f"taken{os.getpid()}_0_0"
    tx, rx = _connector(0, name), None
    clock = tx._inner_orphans.clock = _Clock()
    caplog.set_level(logging.WARNING, "omni_accum")
    try:
        for key, i in ((lost, 1), (taken, 2)):
            assert tx.put("0", "1", key, _payload(i))[2].get("shm") is not None  # the inner way
        assert os.path.exists(_seg(lost)) and os.path.exists(_seg(taken))
        rx = _connector(1, name)
        assert_same(rx.get("0", "1", taken)[0], _payload(2), "taken the inner way")
        assert not os.path.exists(_seg(taken))  # the reader unlinked it
        clock.now += tx.orphan_s - 5  # not yet: a request may still wait for it
        _wait(lambda: tx._inner_orphans.waiting() == 1, "the taken key forgotten by the sender's thread")
        assert os.path.exists(_seg(lost)) and tx.health()["orphans_dropped"] == 0
        clock.now += 10
        _wait(lambda: tx.health()["orphans_dropped"] == 1, "the untaken segment unlinked by the sender's thread")
        assert not os.path.exists(_seg(lost)) and not os.path.exists(f"/dev/shm/shm_{lost}_lockfile.lock")
        assert tx.status_row()["orphans_dropped"] == 1
        assert tx._inner_orphans.waiting() == 0
        said = [r.getMessage() for r in caplog.records if "no get took" in r.getMessage()]
        assert len(said) == 1 and repr(lost) in said[0] and "SharedMemoryConnector" in said[0], said
        assert rx.get("0", "1", lost) is None
    finally:
        for c in (tx, rx):
            if c is not None:
                c.close()
        for key in (lost, taken):
            if os.path.exists(_seg(key)):
                os.unlink(_seg(key))


def test_a_message_the_owner_forwarded_and_no_replica_took_is_unlinked_and_not_counted_as_received(vo, quick):
    """A message in the owner's region when a replica marked the pair is forwarded to the inner connector; its
    request was aborted, so no replica takes it. The owner unlinks it after the orphan time. The forward hands no
    tensor out in the owner's process: ``tensor_views`` / ``tensor_copies`` stay what its own gets made (they counted
    each forwarded tensor as received over the arena)."""
    name = f"fwdorph{os.getpid()}"
    key = f"fwd{os.getpid()}_0_0"
    owner, replica, tx = _connector(1, name), _connector(1, name), _connector(0, name)
    clock = owner._inner_orphans.clock = _Clock()
    try:
        assert owner.get("0", "1", "prime") is None  # the owner makes the pair's region
        for k in _put_until_arena(tx, lambda: {"x": torch.arange(3)}):
            assert owner.get("0", "1", k) is not None  # taken: only the message below waits
        assert tx.put("0", "1", key, _payload(3))[2].get("arena") is not None  # into the owner's region
        views, copies = owner.health()["tensor_views"], owner.health()["tensor_copies"]
        assert replica.get("0", "1", "prime") is None  # in use: the replica marks the pair
        _wait(lambda: owner.counts["forwarded"] >= 1, "the owner's thread forwards what its region holds")
        assert os.path.exists(_seg(key))
        assert (owner.health()["tensor_views"], owner.health()["tensor_copies"]) == (views, copies)
        clock.now += owner.orphan_s + 1
        _wait(lambda: owner.health()["orphans_dropped"] == 1, "the forwarded, untaken segment unlinked by the owner")
        assert not os.path.exists(_seg(key))
    finally:
        for c in (tx, replica, owner):
            c.close()
        if os.path.exists(_seg(key)):
            os.unlink(_seg(key))


@pytest.mark.parametrize("how", ["raises", "says nothing"])
def test_a_segment_that_cannot_be_unlinked_is_tried_again_at_the_next_look(vo, quick, how):
    """The inner connector's clean-up failed once (``SharedMemoryConnector.cleanup`` says nothing when it fails): the
    key is kept, not counted, and unlinked at a later look, counted once."""
    from omni_accum.integrations.vllm_omni.arena_inner import CHECK_S

    name = f"retryorph{os.getpid()}"
    key = f"retry{os.getpid()}_0_0"
    tx = _connector(0, name)
    clock = tx._inner_orphans.clock = _Clock()
    real, calls = tx.inner.cleanup, []

    def flaky(k: str) -> None:
        calls.append(k)
        if len(calls) == 1:
            if how == "raises":
                raise OSError("busy")
            return
        real(k)

    tx.inner.cleanup = flaky
    try:
        assert tx.put("0", "1", key, _payload(4))[2].get("shm") is not None
        clock.now += tx.orphan_s + 1
        _wait(lambda: calls == [key], "the first try")
        assert os.path.exists(_seg(key)) and tx.health()["orphans_dropped"] == 0 and tx._inner_orphans.waiting() == 1
        clock.now += CHECK_S
        _wait(lambda: tx.health()["orphans_dropped"] == 1, "unlinked at a later look")
        assert not os.path.exists(_seg(key)) and calls == [key, key]
    finally:
        tx.close()
        if os.path.exists(_seg(key)):
            os.unlink(_seg(key))


def test_a_key_put_again_by_another_process_is_not_unlinked_with_the_old_one(vo, quick):
    """vllm-omni's keys are ``<request>_<stage>_<chunk>`` and a request id may come again: a later put of the same key
    (here by another process's ``SharedMemoryConnector``) makes a new segment, which this process's old record must not
    unlink when its orphan time comes."""
    from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

    from tests.test_integration_vllm_omni import assert_same

    name = f"reuseorph{os.getpid()}"
    key = f"reuse{os.getpid()}_0_0"
    tx, other = _connector(0, name), SharedMemoryConnector({"stage_id": 0})
    clock = tx._inner_orphans.clock = _Clock()
    try:
        assert tx.put("0", "1", key, _payload(5))[2].get("shm") is not None
        assert other.put("0", "1", key, _payload(6))[0]  # the same key again: a new segment
        clock.now += tx.orphan_s + 1
        _wait(lambda: tx._inner_orphans.waiting() == 0, "the old record forgotten")
        assert os.path.exists(_seg(key)) and tx.health()["orphans_dropped"] == 0
        assert_same(SharedMemoryConnector({"stage_id": 1}).get("0", "1", key)[0], _payload(6), "the later put's")
    finally:
        tx.close()
        other.close()
        if os.path.exists(_seg(key)):
            os.unlink(_seg(key))


def test_a_request_still_taking_its_chunks_keeps_them_past_the_orphan_time(vo, quick):
    """vllm-omni's input wait starts again at each chunk a request receives: a request far behind its sender but still
    taking chunks is alive. Its next chunk is kept for the orphan time counted from the last chunk of it seen taken,
    and unlinked once that has passed with none taken."""
    from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

    name = f"aliveorph{os.getpid()}"
    first, second = f"alive{os.getpid()}_0_1", f"alive{os.getpid()}_0_2"
    tx, rx = _connector(0, name), SharedMemoryConnector({"stage_id": 1})
    clock = tx._inner_orphans.clock = _Clock()
    try:
        for i, key in enumerate((first, second)):
            assert tx.put("0", "1", key, _payload(i))[2].get("shm") is not None
        # (a look at the puts' time first: one at the later time before the take would hold off the next look, the
        # test's clock standing still, and never see it taken)
        looks = tx._inner_orphans
        _wait(lambda: looks._next > clock.now and not looks._looking.locked(), "a look at the puts' time, ended")
        assert rx.get("0", "1", first) is not None  # taken late (seen taken at the next look), but taken
        clock.now += tx.orphan_s - 5
        _wait(lambda: tx._inner_orphans.waiting() == 1, "the taken chunk seen taken")
        clock.now += 10  # past the orphan time counted from the puts, not from the last take
        _wait(lambda: tx._inner_orphans._next > clock.now, "a look at this time")
        assert os.path.exists(_seg(second)) and tx.health()["orphans_dropped"] == 0
        clock.now += tx.orphan_s
        _wait(lambda: tx.health()["orphans_dropped"] == 1, "unlinked once none of its chunks was taken for that long")
        assert not os.path.exists(_seg(second))
    finally:
        tx.close()
        for key in (first, second):
            if os.path.exists(_seg(key)):
                os.unlink(_seg(key))


def _region(quick: Any, name: str) -> tuple[Any, Any, list[float]]:
    """A receiver that made the pair's region, a sender attached to it (every message put so far taken) and the
    region's orphan clock (``arena_connector._now``, moved by the test)."""
    from omni_accum.integrations.vllm_omni import arena_connector

    rx, tx = _connector(1, name), _connector(0, name)
    clock = [1000.0]
    quick.setattr(arena_connector, "_now", lambda: clock[0])
    assert rx.get("0", "1", "prime") is None  # makes the region
    for k in _put_until_arena(tx, lambda: {"x": torch.arange(3)}):
        assert rx.get("0", "1", k) is not None
    return rx, tx, clock


def test_a_receiver_with_no_get_to_make_drops_its_region_s_orphans_from_its_thread(vo, quick):
    """The region's own orphan look ran only at a get, and vllm-omni gets only for requests it holds: a receiving
    stage whose requests were all aborted kept their messages' pages until its next request. The connector's thread
    looks too."""
    from omni_accum.integrations.vllm_omni import arena_connector

    rx, tx, clock = _region(quick, f"idleorph{os.getpid()}")
    try:
        assert tx.put("0", "1", "aborted_0_0", _payload(7))[2].get("arena") is not None  # no get will ever come
        clock[0] += 2 * arena_connector.ORPHAN_CHECK_S  # the next look is due (the gets above made theirs)
        _wait(lambda: rx._seen.get(("0", "1")), "the thread's look sees it waiting")
        clock[0] += rx.orphan_s + 1
        _wait(lambda: rx.health()["orphans_dropped"] == 1, "dropped by the receiver's thread, with no get")
        assert not rx._rx[("0", "1")].pending_keys()
    finally:
        tx.close()
        rx.close()


def test_a_request_still_taking_its_chunks_keeps_them_in_the_region_too(vo, quick):
    """The region's own orphan drop counted a message's age from when a look first saw it waiting: a request far behind
    its sender but still taking chunks lost its next one. Now from the last chunk of it a get took, as vllm-omni's
    wait starts again at each chunk."""
    from omni_accum.integrations.vllm_omni import arena_connector

    req = f"alivereg{os.getpid()}"
    rx, tx, clock = _region(quick, req)
    try:
        for chunk in (1, 2):
            assert tx.put("0", "1", f"{req}_0_{chunk}", _payload(chunk))[2].get("arena") is not None
        clock[0] += 2 * arena_connector.ORPHAN_CHECK_S
        _wait(lambda: len(rx._seen.get(("0", "1"), {})) == 2, "a look sees both waiting")
        clock[0] += rx.orphan_s - 5
        assert rx.get("0", "1", f"{req}_0_1") is not None  # taken late, but taken
        clock[0] += 10  # past the orphan time counted from the first look, not from the take
        _wait(lambda: rx._orphan_check > clock[0], "a look at this time")
        assert rx.health()["orphans_dropped"] == 0 and rx._rx[("0", "1")].pending_keys() == [f"{req}_0_2"]
        clock[0] += rx.orphan_s
        _wait(lambda: rx.health()["orphans_dropped"] == 1, "dropped once none of its chunks was taken for that long")
        assert not rx._rx[("0", "1")].pending_keys()
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("connector", ["SharedMemoryConnector", "OmniAccumArenaConnector"])
def test_an_aborted_request_s_inner_chunks_are_unlinked_at_the_abort(vo, adapters, connector):
    """vllm-omni 0.30.0's adapter unlinks at the abort the chunks an aborted request's sender put, on its save thread,
    for a ``SharedMemoryConnector`` only; over the arena the chunks put the inner way (here no receiver has made the
    region) now go the same way, counted, not after the orphan time. A request whose last chunk was sent keeps its
    chunks for the receiver, on both. Where the adapter has no such clean-up (0.28, 0.16) nothing is wrapped."""
    from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
        OmniChunkTransferAdapter,
    )

    from omni_accum.integrations.vllm_omni import arena_abort, arena_plugin

    from tests.test_integration_vllm_omni import T2T, _request, _thinker_steps

    arena_plugin.register()
    if "_queue_shm_cleanup_locked" not in vars(OmniChunkTransferAdapter):  # no abort clean-up for any connector
        assert not arena_abort.installed()
        assert "_queue_shm_cleanup_locked" in "; ".join(arena_abort._problems())
        return
    assert arena_abort.installed()
    pid = os.getpid()
    arena = connector == "OmniAccumArenaConnector"
    tx = adapters(0, next_func=T2T, connector=connector, extra={"arena_name": f"abort{pid}"} if arena else None)

    def send(rid: str, steps: int, finished: bool = False) -> list[str]:
        out: list[int] = []
        for i, mm in enumerate(_thinker_steps(seed=5, decode_steps=3)[:steps]):
            out += [1000 + i] if i >= 3 else []
            tx.save_async(multimodal_output=mm, request=_request(rid, out, finished=finished and i == steps - 1))
        keys = [f"{rid}_0_{c}" for c in range(steps - 3)]  # the processor puts from the fourth step on
        _wait(lambda: all(os.path.exists(_seg(k)) for k in keys), f"{rid}'s chunks put the inner way")
        return keys

    done, lost = send(f"done{pid}", 5, finished=True), send(f"lost{pid}", 5)
    try:
        tx.cleanup_sender(f"lost{pid}")  # the scheduler's abort, before a last chunk
        # the save thread unlinks the segments, then their lock files, then counts (ci on ea186ef looked between)
        _wait(lambda: not any(os.path.exists(_seg(k)) or os.path.exists(f"/dev/shm/shm_{k}_lockfile.lock") for k in lost)
              and (not arena or tx.connector.health()["aborted_unlinked"] >= 2), "the aborted request's chunks unlinked")
        assert all(os.path.exists(_seg(k)) for k in done)  # (the save thread ran the abort after them)
        if arena:
            h = tx.connector.health()
            assert h["aborted_unlinked"] == 2 and h["orphans_dropped"] == 0 and h["inner_puts"] == 4, h
            assert tx.connector._inner_orphans.waiting() == 2  # the finished request's, for the orphan look
    finally:
        for k in done + lost:
            tx.connector.cleanup(k)


def test_the_abort_clean_up_removes_a_lone_lock_file_and_is_wrapped_once(vo, monkeypatch):
    """A put that failed after opening its lock file leaves the lock file alone, which vllm-omni's clean-up of a
    ``SharedMemoryConnector`` removes: the arena's removes it too (and counts no segment). An install after one of
    the two methods was put back wraps that one only, never one twice (two clean-up tasks per abort)."""
    from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
        OmniChunkTransferAdapter,
    )

    from omni_accum.integrations.vllm_omni import arena_abort

    tx = _connector(0, f"lonelock{os.getpid()}")
    key = f"lonelock{os.getpid()}_0_0"
    lock = f"/dev/shm/shm_{key}_lockfile.lock"
    try:
        open(lock, "wb").close()
        tx.abort_keys([key, f"none{os.getpid()}_0_0"])
        assert not os.path.exists(lock) and tx.health()["aborted_unlinked"] == 0
    finally:
        if os.path.exists(lock):
            os.unlink(lock)
        tx.close()
    if "_queue_shm_cleanup_locked" not in vars(OmniChunkTransferAdapter):  # 0.28, 0.16: nothing to wrap
        return
    wrapped = vars(OmniChunkTransferAdapter)["_queue_shm_cleanup_locked"]
    monkeypatch.setattr(OmniChunkTransferAdapter, "_send_single_request",
                        vars(OmniChunkTransferAdapter)["_send_single_request"].__wrapped__)
    assert not arena_abort.installed() and arena_abort.install() and arena_abort.installed()
    assert vars(OmniChunkTransferAdapter)["_queue_shm_cleanup_locked"] is wrapped
    for name in ("_queue_shm_cleanup_locked", "_send_single_request"):
        assert not getattr(vars(OmniChunkTransferAdapter)[name].__wrapped__, "__omni_accum_arena_abort__", False)
