"""The e2e harness's idle-spin cap (``run.py --idle-spin-s``): the CPU platform package's ``vllm.general_plugins``
hook against vLLM's real ``SpinCondition`` (shared-memory message queue readers)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from conftest import require_module

SRC = Path(__file__).resolve().parent.parent / "benchmarks" / "e2e" / "cpu_platform" / "src"


@pytest.fixture()
def e2e_cpu(monkeypatch):
    monkeypatch.syspath_prepend(str(SRC))
    sys.modules.pop("omni_accum_e2e_cpu", None)
    import omni_accum_e2e_cpu

    yield omni_accum_e2e_cpu
    sys.modules.pop("omni_accum_e2e_cpu", None)


@pytest.fixture()
def spin(monkeypatch):
    """vLLM's shm_broadcast module, its SpinCondition restored after the test, sched_yield counted."""
    sb = require_module("vllm.distributed.device_communicators.shm_broadcast", "vLLM's message queue")
    cls = getattr(sb, "SpinCondition", None)
    if cls is None:
        pytest.skip(f"this vLLM ({sys.modules['vllm'].__version__}) has no SpinCondition: the cap does nothing here")
    monkeypatch.setattr(cls, "wait", cls.wait)
    monkeypatch.setattr(cls, "_omni_accum_e2e_idle_spin_s", None, raising=False)
    yields = []
    monkeypatch.setattr(sb, "sched_yield", lambda: yields.append(1))
    return sb, yields


def _close_queue(mq) -> None:
    """Close a vLLM MessageQueue's zmq sockets and contexts now (linger 0): left to the garbage collector, a
    context's ``term()`` waits for ever on a socket with messages still queued, and hangs the test run."""
    import zmq

    contexts = []
    for holder in (mq, getattr(mq, "_spin_condition", None)):
        for value in list(vars(holder).values()) if holder is not None else []:
            if isinstance(value, zmq.Socket) and not value.closed:
                if value.context not in contexts:
                    contexts.append(value.context)
                value.close(linger=0)
    for ctx in contexts:
        ctx.destroy(linger=0)


def _reader(sb):
    import zmq
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    ctx = zmq.Context()
    addr = get_open_zmq_ipc_path()
    writer = sb.SpinCondition(is_reader=False, context=ctx, notify_address=addr)
    reader = sb.SpinCondition(is_reader=True, context=ctx, notify_address=addr)
    return ctx, writer, reader


def test_without_the_variable_vllms_busy_loop_stays(e2e_cpu, spin, monkeypatch):
    sb, yields = spin
    monkeypatch.delenv(e2e_cpu.IDLE_SPIN_ENV, raising=False)
    before = sb.SpinCondition.wait
    e2e_cpu.idle_spin_plugin()
    assert sb.SpinCondition.wait is before
    ctx, writer, reader = _reader(sb)
    try:
        assert reader.busy_loop_s == 1  # vLLM's own: left alone
        reader.busy_loop_s = 3600  # (a loaded host may take more than vLLM's 1 s between the two lines below)
        reader.last_read = time.monotonic()  # as a read just now
        reader.wait(timeout_ms=0)  # within the busy loop after a read: it yields and returns
        assert yields == [1]
    finally:
        ctx.destroy(linger=0)


def test_a_zero_cap_makes_a_reader_sleep_on_the_notification_at_once_and_miss_nothing(e2e_cpu, spin, monkeypatch):
    sb, yields = spin
    monkeypatch.setenv(e2e_cpu.IDLE_SPIN_ENV, "0")
    e2e_cpu.idle_spin_plugin()
    e2e_cpu.idle_spin_plugin()  # loaded twice in one process (vLLM and vllm-omni both load plugins): one wrapper
    assert sb.SpinCondition._omni_accum_e2e_idle_spin_s == 0.0
    ctx, writer, reader = _reader(sb)
    polls = []
    real_poll = reader.poller.poll
    reader.poller.poll = lambda timeout=None: polls.append(timeout) or real_poll(timeout)
    try:
        reader.wait(timeout_ms=0)
        assert yields == [] and polls == [0] and reader.busy_loop_s == 0  # no spin: straight to the poller
        for _ in range(100):  # zmq's SUB joins late: notify until one reaches the reader (each given 1 s to arrive:
            writer.notify()  # none is still in flight after the loop, which the wait below could leave queued)
            if reader.local_notify_socket.poll(1000):
                break
        else:
            pytest.fail("no notification reached the reader")
        reader.wait(timeout_ms=1000)
        assert reader.local_notify_socket.poll(0) == 0  # the wait took the writer's notification
        assert yields == [] and polls == [0, e2e_cpu.RECHECK_MS]  # vLLM's 1000 ms: capped
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("asked", [None, 5000])
def test_a_capped_reader_never_sleeps_longer_than_the_recheck(e2e_cpu, spin, monkeypatch, asked):
    """vLLM asks for ``SHM_READER_RECHECK_INTERVAL_MS`` (5 s) or for no limit: a capped reader looks again after
    ``RECHECK_MS`` whatever it was asked, so that a lost notification costs that and not 5 s."""
    sb, _ = spin
    assert getattr(sb, "SHM_READER_RECHECK_INTERVAL_MS", 5000) == 5000
    monkeypatch.setenv(e2e_cpu.IDLE_SPIN_ENV, "0")
    e2e_cpu.idle_spin_plugin()
    ctx, writer, reader = _reader(sb)
    polls = []
    real_poll = reader.poller.poll
    reader.poller.poll = lambda timeout=None: polls.append(timeout) or real_poll(timeout)
    try:
        reader.wait(timeout_ms=asked)  # nothing sent: the poller times out and the wait returns
        assert polls == [e2e_cpu.RECHECK_MS] and 0 < e2e_cpu.RECHECK_MS < 5000
    finally:
        ctx.destroy(linger=0)


def test_a_message_whose_notification_was_lost_is_still_read_through_vllms_message_queue(e2e_cpu, spin, monkeypatch):
    """vLLM's real MessageQueue, the reader asleep on the notification when the writer writes and the notification
    lost (under load it is): the capped reader finds the message at its own recheck. Every sleep it took through
    vLLM's dequeue (which asks for SHM_READER_RECHECK_INTERVAL_MS, 5 s) was at most ``RECHECK_MS``."""
    import threading

    sb, _ = spin
    monkeypatch.setenv(e2e_cpu.IDLE_SPIN_ENV, "0")
    e2e_cpu.idle_spin_plugin()
    writer = sb.MessageQueue(1, 1)
    made = {}

    def connect():
        made["reader"] = sb.MessageQueue.create_from_handle(writer.export_handle(), 0)
        made["reader"].wait_until_ready()

    t = threading.Thread(target=connect)
    t.start()
    writer.wait_until_ready()
    t.join()
    reader = made["reader"]
    asleep = threading.Event()
    polls = []
    real_poll = reader._spin_condition.poller.poll

    def poll(timeout=None):
        polls.append(timeout)
        asleep.set()
        return real_poll(timeout)

    reader._spin_condition.poller.poll = poll
    monkeypatch.setattr(writer._spin_condition, "notify", lambda: None)  # the notification lost
    got = []
    r = threading.Thread(target=lambda: got.append(reader.dequeue()))
    r.start()
    try:
        assert asleep.wait(30), "the reader never went to sleep on the notification"
        writer.enqueue("row 0")
    finally:
        r.join(30)
        for mq in (reader, writer):
            _close_queue(mq)
    assert got == ["row 0"]
    assert polls and max(polls) == e2e_cpu.RECHECK_MS < sb.SHM_READER_RECHECK_INTERVAL_MS, polls


@pytest.mark.parametrize("bad", ["-1", "soon", "nan"])
def test_a_bad_value_is_named_and_leaves_vllms_loop_alone(e2e_cpu, spin, monkeypatch, bad, caplog):
    sb, _ = spin
    monkeypatch.setenv(e2e_cpu.IDLE_SPIN_ENV, bad)
    before = sb.SpinCondition.wait
    with pytest.raises(ValueError):
        e2e_cpu.idle_spin_s()
    e2e_cpu.idle_spin_plugin()  # never fails vLLM's start
    assert sb.SpinCondition.wait is before


def test_the_harness_package_declares_the_hook_in_vllms_plugin_group():
    text = (SRC.parent / "pyproject.toml").read_text()
    assert '[project.entry-points."vllm.general_plugins"]' in text
    assert 'omni_accum_e2e_idle_spin = "omni_accum_e2e_cpu:idle_spin_plugin"' in text


@pytest.mark.parametrize("cap", [0.0, 30.0])
def test_vllm_016s_spin_timer_sleeps_between_looks_once_past_the_cap(e2e_cpu, spin, monkeypatch, cap):
    """vLLM 0.16.0's readers have no notification (``SpinTimer``: sched_yield until a message comes): past the cap
    they sleep ``POLL_S`` between looks; within it, after a message, they still spin. Its class as in 0.16.0."""
    sb, yields = spin
    monkeypatch.delattr(sb, "SpinCondition")

    class SpinTimer:  # vllm 0.16.0, shm_broadcast.py
        def record_activity(self):
            pass

        def spin(self):
            sb.sched_yield()

    monkeypatch.setattr(sb, "SpinTimer", SpinTimer, raising=False)
    sleeps = []
    monkeypatch.setattr(e2e_cpu.time, "sleep", sleeps.append)
    monkeypatch.setenv(e2e_cpu.IDLE_SPIN_ENV, repr(cap))
    e2e_cpu.idle_spin_plugin()
    t = SpinTimer()
    t.spin()  # no message read yet: idle
    assert sleeps == [e2e_cpu.POLL_S] and yields == []
    t.record_activity()
    t.spin()  # right after a message
    if cap:
        assert yields == [1] and len(sleeps) == 1
    else:
        assert yields == [] and len(sleeps) == 2
