"""The peer hello: a sender changes the wire (leaves values off, marks requests) only for requests that start
after its receiving stage said it runs omni-accum (real adapters and SharedMemoryConnector, CPU)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

import pytest

from omni_accum.samehost import private_dir
from tests.test_integration_vllm_omni import _wait, assert_same, run_thinker_to_talker

pytestmark = pytest.mark.vllm

QWEN = {"omni_accum_policy": "qwen3-omni"}
OFF = {"omni_accum_policy": "off"}


def _pair(adapters, tx_extra: dict, rx_extra: dict):
    """A thinker adapter and a talker adapter, made in that order (as ``run_thinker_to_talker`` does)."""
    return adapters(0, next_func=_t2t(), extra=tx_extra), adapters(1, extra=rx_extra)


def _t2t() -> str:
    from tests.test_integration_vllm_omni import T2T

    return T2T


def _run(pair, rid: str, *, heard: bool = False):
    """One request through the given pair of adapters (``heard``: after the sender heard the receiver's hello)."""
    it = iter(pair)
    return run_thinker_to_talker(lambda stage_id, **kw: next(it), rid, heard=heard)[0]


@pytest.fixture
def base(vo, adapters):
    vo.install(None)
    return _run(_pair(adapters, OFF, OFF), f"oa-peer-base-{os.getpid()}")


def _no_marker(handed: list[dict]) -> None:
    for h in handed:
        assert not any(str(k).startswith("__omni_accum") for k in h), sorted(h)


def test_a_tuned_table_sender_beside_a_receiver_without_omni_accum_marks_nothing(vo, adapters, base):
    """A tuned table marks every announced request's first chunk (its bucket): with no hello, none is."""
    from tests.test_integration_vllm_omni_handshake import _tuned

    tuned = {"omni_accum_policy": _tuned("thinker_embeddings", "token_list", "prealloc")}
    tx, rx = _pair(adapters, tuned, OFF)
    handed = _run((tx, rx), f"oa-peer-tuned-{os.getpid()}")
    assert_same(handed, base, "handed")
    _no_marker(handed)
    assert tx._omni_accum_binding.announces and tx._omni_accum_binding._peer.looks >= 1
    assert {r.peer for r in vo.status().bindings} == {"waiting for stage 1's hello"}


def test_a_receiver_that_says_hello_later_gets_marked_requests_from_then_on(vo, adapters, base):
    """The talker's adapter was made before omni-accum was installed: it says hello at its first chunk. The
    request under way stays 0.30.0's; the next one is announced and leaves values off."""
    vo.uninstall()
    rx = adapters(1, extra=QWEN)  # no constructor wrapper yet: no hello
    vo.install(None)
    tx = adapters(0, next_func=_t2t(), extra=QWEN)
    first = _run((tx, rx), f"oa-peer-late-1-{os.getpid()}")
    txb = tx._omni_accum_binding
    assert txb.stats["omitted"] == 0  # no hello yet: nothing left off
    assert_same(first, base, "first request")
    _wait(lambda: txb._peer.hello is not None, "the sender to see the hello")
    assert txb._peer.hello[1] == rx._omni_accum_binding.fingerprint
    second = _run((tx, rx), f"oa-peer-late-2-{os.getpid()}")
    assert txb.stats["omitted"] > 0  # now values are left off, and put back by the receiver
    assert_same(second, base, "second request")


def test_the_first_request_is_announced_however_late_the_watcher_thread_runs(vo, adapters, base, monkeypatch):
    """A loaded host may run the sender's watcher thread long after its first send (ci100: an e2e server's first
    request went unannounced, its hand-off untimed). Over shared memory the first look is made on the sending
    thread, so the first request after a receiver's hello is announced whenever the watcher thread gets to run."""
    from omni_accum.integrations.vllm_omni import peer

    run = peer.PeerWatch._run

    def late(self):  # the watcher thread's first chance to run comes a second after it was started
        if not self._stop.wait(1.0):
            run(self)

    monkeypatch.setattr(peer.PeerWatch, "_run", late)
    tx, rx = _pair(adapters, QWEN, QWEN)  # the receiver says hello when it is made
    handed = _run((tx, rx), f"oa-peer-first-{os.getpid()}")
    txb = tx._omni_accum_binding
    assert txb._peer.looks == 1 and txb._peer.hello is not None
    assert txb.stats["omitted"] > 0  # announced: static values left off, and put back by the receiver
    assert_same(handed, base, "first request")


def test_a_refused_private_folder_never_fails_the_first_send(vo, monkeypatch, tmp_path):
    """The first look moved onto the sending thread: a private folder refused (world-writable without the sticky bit,
    or one another user made) raised out of it into the send (a refused chunk each request; a full payload's put
    failed in vllm-omni's save loop). It is no hello, and the watcher still starts."""
    from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

    from omni_accum.integrations.vllm_omni import peer

    bad = tmp_path / "shm"
    bad.mkdir()
    bad.chmod(0o777)
    monkeypatch.setenv("OMNI_ACCUM_ARENA_DIR", str(bad))
    w = peer.PeerWatch(SharedMemoryConnector({"stage_id": 0}), 0)
    try:
        assert isinstance(w.chan, peer.ShmChannel)
        assert w.ready() is False and w._thread is not None and w.looks == 1
        assert w.ready() is False  # (no look raising on a later call either)
    finally:
        w.close()
    closed = peer.PeerWatch(SharedMemoryConnector({"stage_id": 0}), 0)
    closed.close()
    assert closed.ready() is False and closed.looks == 0  # a watch closed before its first send looks no more


def test_another_deployments_hello_is_not_read(vo, adapters, base, monkeypatch):
    """Two servers on one host: the token in the key keeps them apart."""
    monkeypatch.setenv("OMNI_ACCUM_DEPLOYMENT", "server-a")
    adapters(1, extra=QWEN)  # server a's talker says hello
    monkeypatch.setenv("OMNI_ACCUM_DEPLOYMENT", "server-b")
    tx, rx = _pair(adapters, QWEN, OFF)  # server b: its talker runs without omni-accum
    handed = _run((tx, rx), f"oa-peer-two-{os.getpid()}")
    assert tx._omni_accum_binding.stats["omitted"] == 0
    assert_same(handed, base, "handed")
    _no_marker(handed)


@pytest.fixture
def put_hello():
    """Put a hello for stage 0 as stage 1 would, naming process ``pid``; withdrawn afterwards."""
    import socket

    from omni_accum.integrations.vllm_omni.peer import HELLO, SHM_CHANNEL, hello_key, machine_id

    keys = []

    def put(pid: int) -> str:
        keys.append(key := hello_key(0, 1))
        hello = [1, "f" * 12, "test", pid, socket.gethostname(), machine_id()]  # as announce() puts it
        assert SHM_CHANNEL.put("0", "1", key, {HELLO: hello})[0]
        return key

    yield put
    for key in keys:
        SHM_CHANNEL.cleanup(key)


def test_a_hello_from_a_process_no_longer_alive_is_ignored(vo, adapters, base, put_hello):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tx, rx = _pair(adapters, QWEN, OFF)
    put_hello(dead.pid)  # left by a receiver killed with -9 (and no resource tracker to remove it)
    handed = _run((tx, rx), f"oa-peer-dead-{os.getpid()}")
    assert tx._omni_accum_binding.stats["omitted"] == 0
    assert tx._omni_accum_binding._peer.hello is None
    assert_same(handed, base, "handed")


def test_a_hello_is_judged_by_its_process_id_only_from_the_same_machine():
    """Cloned machines share a host name: a live receiver's hello from another one (its pid is no process here) is
    taken, not ignored; one from this machine whose process is gone is stale. An older omni-accum's hello (no
    machine id) is judged by its host name, as before."""
    import socket

    from omni_accum.integrations.vllm_omni import peer

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host, here = socket.gethostname(), peer.machine_id()
    other = "0123456789ab" if here != "0123456789ab" else "ba9876543210"
    assert not peer._stale([1, "f" * 12, "t", dead.pid, host, other])  # a clone's live receiver
    assert not peer.same_machine([1, "f" * 12, "t", dead.pid, host, other])
    assert peer._stale([1, "f" * 12, "t", dead.pid, host, here])
    assert not peer._stale([1, "f" * 12, "t", os.getpid(), host, here])
    assert peer._stale([1, "f" * 12, "t", dead.pid, host]) and not peer._stale([1, "f" * 12, "t", dead.pid, "elsewhere"])
    assert len(here) == 12 and peer.machine_id() == here


def test_a_sender_that_never_hears_its_receiver_says_so_once_naming_the_deployment_token(monkeypatch, caplog):
    """Stages on separate hosts started without one OMNI_ACCUM_DEPLOYMENT never find each other's hello: the sender
    sends 0.30.0's payloads silently. It now says so, once, with the key it looks for and its token."""
    import logging
    import time

    from omni_accum.integrations.vllm_omni import peer

    monkeypatch.setattr(peer, "QUIET_WARN_S", 0.0)
    monkeypatch.setattr(peer, "POLL_S", (0.01, 0.01))
    monkeypatch.setenv(peer.ENV_DEPLOYMENT, "tok-on-this-host")
    looks = []
    conn = type("Conn", (), {"stage_id": 0, "get": lambda self, *a: looks.append(a)})()  # never finds a hello
    w = peer.PeerWatch(conn, 0)
    with caplog.at_level(logging.WARNING, logger="omni_accum.vllm_omni"):
        try:
            assert not w.ready()
            for _ in range(500):
                if len(looks) >= 5:
                    break
                time.sleep(0.01)
        finally:
            w.close()
    said = [m for r in caplog.records if "has not heard" in (m := r.getMessage()) and w.key in m]  # this watch's
    assert len(looks) >= 5 and len(said) == 1, (len(looks), said)
    assert "stage 0 has not heard stage 1's hello (key omni_accum_hello_tok-on-this-host_0_1)" in said[0]
    assert "OMNI_ACCUM_DEPLOYMENT (this one has 'tok-on-this-host'" in said[0]


def test_a_receiver_that_goes_away_is_named_gone_not_never_heard(monkeypatch, caplog):
    """A sender that heard its receiver and then saw it go said 'is gone' and at once also 'has not heard ... give
    every stage process the same OMNI_ACCUM_DEPLOYMENT' (advice for stages that never found each other)."""
    import logging
    import socket
    import time

    from omni_accum.integrations.vllm_omni import peer

    monkeypatch.setattr(peer, "QUIET_WARN_S", 0.0)
    monkeypatch.setattr(peer, "POLL_S", (0.01, 0.01))
    monkeypatch.setattr(peer, "ALIVE_S", 0.01)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    hello = [1, "f" * 12, "test", live.pid, socket.gethostname(), peer.machine_id()]
    looks = []

    def get(self, *a):
        looks.append(a)
        return ({peer.HELLO: hello}, 0)

    w = peer.PeerWatch(type("Conn", (), {"stage_id": 0, "get": get})(), 0)
    with caplog.at_level(logging.WARNING, logger="omni_accum.vllm_omni"):
        try:
            w.ready()  # starts the watch (its first look may take longer than ready waits: first imports)
            for _ in range(1000):
                if w.hello is not None:
                    break
                time.sleep(0.01)
            assert w.hello is not None, looks
            live.kill()
            live.wait()
            n = len(looks)
            for _ in range(500):  # the watch sees it gone, then looks again (and finds the same stale hello)
                if w.hello is None and len(looks) >= n + 5:
                    break
                time.sleep(0.01)
        finally:
            w.close()
            live.kill()
    said = [r.getMessage() for r in caplog.records]
    assert w.hello is None and len(looks) >= n + 5, (w.hello, len(looks), n)
    assert sum("is gone" in m for m in said) == 1, said
    assert not any("has not heard" in m for m in said), said


def test_a_sender_whose_receiver_dies_goes_back_to_0_30_0_payloads(vo, adapters, base, monkeypatch, put_hello):
    from omni_accum.integrations.vllm_omni import peer

    monkeypatch.setattr(peer, "ALIVE_S", 0.02)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tx, rx = _pair(adapters, QWEN, OFF)
        put_hello(live.pid)  # a receiver that said hello (then is replaced by one without omni-accum)
        first = _run((tx, rx), f"oa-peer-gone-1-{os.getpid()}", heard=True)
        txb = tx._omni_accum_binding
        assert txb._peer.hello is not None and txb.stats["omitted"] > 0  # it believed the hello
        del first  # (that request went to a receiver that could not put the values back: the case to end)
    finally:
        live.kill()
        live.wait()
    _wait(lambda: txb._peer.hello is None, "the sender to see its receiver gone")
    omitted = txb.stats["omitted"]
    handed = _run((tx, rx), f"oa-peer-gone-2-{os.getpid()}")
    assert txb.stats["omitted"] == omitted
    assert_same(handed, base, "after the receiver died")


def test_hellos_are_withdrawn_when_omni_accum_is_uninstalled(vo, adapters, base):
    from omni_accum.integrations.vllm_omni.peer import hello_key

    tx, rx = _pair(adapters, QWEN, QWEN)
    _run((tx, rx), f"oa-peer-withdraw-{os.getpid()}", heard=True)
    assert tx._omni_accum_binding._peer.hello is not None
    d = private_dir()  # /dev/shm/omni-accum-<euid>/: the hellos live there, nowhere else
    assert glob.glob(f"{d}/{hello_key(0, 1)}")  # read, not consumed: the stage's other senders read it too
    assert not glob.glob(f"/dev/shm/*{hello_key(0, 1)}*")
    vo.uninstall()
    assert not glob.glob(f"{d}/*{hello_key(0, 1)}*")  # nor a lock or temporary file


def test_the_deployment_token_is_inherited_by_processes_started_after_activation(vo, monkeypatch):
    from omni_accum.integrations.vllm_omni import peer

    monkeypatch.delenv("OMNI_ACCUM_DEPLOYMENT", raising=False)
    tok = peer.deployment_token()
    assert tok and os.environ["OMNI_ACCUM_DEPLOYMENT"] == tok and peer.deployment_token() == tok
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['OMNI_ACCUM_DEPLOYMENT'])"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert child.stdout.strip() == tok


def test_status_says_who_said_hello(vo, adapters, base):
    tx, rx = _pair(adapters, QWEN, QWEN)
    _run((tx, rx), f"oa-peer-status-{os.getpid()}", heard=True)
    rows = {r.peer for r in vo.status().bindings}
    fp = rx._omni_accum_binding.fingerprint
    assert "told stage 0" in rows and f"heard stage 1 (pid {os.getpid()}, fingerprint {fp})" in rows, rows


def test_a_hello_of_a_process_ended_by_sigterm_is_removed(vo):
    """vllm-omni ends its stage processes with SIGTERM (no atexit): omni-accum's reaper process removes the hello."""
    import signal

    from omni_accum.integrations.vllm_omni.peer import hello_key

    key = hello_key(7, 8)
    code = (
        "import sys, time\n"
        "from omni_accum.integrations.vllm_omni.peer import SHM_CHANNEL\n"
        f"SHM_CHANNEL.put('7', '8', {key!r}, {{'omni_accum_hello': [1, 'f', 's', 1, 'h']}})\n"
        "print('put', flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "OMNI_ACCUM_DEPLOYMENT": os.environ["OMNI_ACCUM_DEPLOYMENT"]}
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "put"
        assert os.path.exists(f"{private_dir()}/{key}")
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait()
    _wait(lambda: not os.path.exists(f"{private_dir()}/{key}"), "omni-accum's reaper to remove the hello")


def test_a_hello_that_could_not_be_written_is_said_so_and_tried_again(vo, monkeypatch, tmp_path, adapters, caplog):
    """The status said ``told stage 0`` although the hello was never written (a private directory it could not use),
    and it was never tried again: the sender sent vllm-omni's own payloads for the server's life, unseen."""
    import logging

    from omni_accum.integrations.vllm_omni import peer

    base = tmp_path / "shm"
    monkeypatch.setenv("OMNI_ACCUM_ARENA_DIR", str(base))  # not there yet
    monkeypatch.setattr(peer, "HELLO_RETRY_S", (60.0, 120.0), raising=False)  # the test runs the timer's retry
    tries: list[str] = []
    real_put = peer.SHM_CHANNEL.put

    def put(*args, **kwargs):
        tries.append(args[2])
        return real_put(*args, **kwargs)

    monkeypatch.setattr(peer.SHM_CHANNEL, "put", put)
    caplog.set_level(logging.WARNING, "omni_accum")
    vo.install(None)
    rx = adapters(1, extra=QWEN)  # says hello when it is made: the put fails
    b = rx._omni_accum_binding
    (row,) = [r.peer for r in vo.status().bindings]
    assert row.startswith("could not tell stage 0 (") and "No such file or directory" in row, row
    assert len(tries) == 1 and "could not tell stage 0 it runs omni-accum" in caplog.text
    peer.announce(rx, b)  # a later call within HELLO_RETRY_S tries nothing
    assert len(tries) == 1
    timer = b._hello_timer
    assert timer.is_alive() and timer.interval == pytest.approx(60.01)  # the retry is due after HELLO_RETRY_S[0]
    base.mkdir(mode=0o700)
    timer.cancel()
    stage, why, _, delay = b._hello_failed
    b._hello_failed = (stage, why, time.monotonic(), delay)  # its time has come ...
    timer.function()  # ... and the timer fires (here at once: no wait on this machine's load)
    assert vo.status().bindings[0].peer == "told stage 0"
    assert len(tries) == 2 and os.path.exists(f"{private_dir()}/{peer.hello_key(0, 1)}")
    assert caplog.text.count("could not tell stage 0") == 1  # said once
    peer.withdraw(b)  # (while OMNI_ACCUM_ARENA_DIR still names its directory)
    assert not os.path.exists(f"{private_dir()}/{peer.hello_key(0, 1)}")


def test_a_replica_withdrawing_leaves_the_hello_another_replica_wrote_since(vo, adapters, base):
    """Replicas of a receiving stage on one host (vllm-omni's ``num_replicas``) share the hello key: the first to
    close removed the hello the others wrote, and every sender went back to 0.30.0's payloads for good."""
    import json

    from omni_accum.integrations.vllm_omni import peer

    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        rx = adapters(1, extra=QWEN)  # says hello when it is made
        key, path = peer.hello_key(0, 1), f"{private_dir()}/{peer.hello_key(0, 1)}"
        assert json.loads(open(path).read())[peer.HELLO][3] == os.getpid()
        hello = [1, "f" * 12, "sibling", sibling.pid, peer.socket.gethostname(), peer.machine_id()]
        assert peer.SHM_CHANNEL.put("0", "1", key, {peer.HELLO: hello})[0]  # the sibling's, written over this one
        peer.withdraw(rx._omni_accum_binding)
        assert json.loads(open(path).read())[peer.HELLO][3] == sibling.pid  # the sibling's hello stays
        peer.SHM_CHANNEL.cleanup(key)
        rx2 = adapters(1, extra=QWEN)
        assert json.loads(open(path).read())[peer.HELLO][3] == os.getpid()
        peer.withdraw(rx2._omni_accum_binding)  # its own: removed
        assert not os.path.exists(path)
    finally:
        sibling.kill()
        sibling.wait()
        peer.SHM_CHANNEL.cleanup(peer.hello_key(0, 1))


def test_a_receiver_whose_hello_another_replica_removed_says_it_again(vo, adapters, base):
    """The other half: a live receiver whose hello was removed by a replica's withdrawal writes it again at its next
    chunk after a second at most, and its senders hear it again."""
    from omni_accum.integrations.vllm_omni import peer

    tx, rx = _pair(adapters, QWEN, QWEN)
    _run((tx, rx), f"oa-peer-replica-1-{os.getpid()}", heard=True)
    path = f"{private_dir()}/{peer.hello_key(0, 1)}"
    peer.SHM_CHANNEL.cleanup(peer.hello_key(0, 1))  # as a replica's withdrawal of the hello it wrote over this one
    _wait(lambda: tx._omni_accum_binding._peer.hello is None, "the sender to notice the hello gone")
    rx._omni_accum_binding._hello_check = 0.0  # (its next look is due: else within ALIVE_S)
    _run((tx, rx), f"oa-peer-replica-2-{os.getpid()}")  # its chunks: the receiver sees its hello gone
    assert os.path.exists(path)
    _wait(lambda: tx._omni_accum_binding._peer.hello is not None, "the sender to hear the hello again")
    handed = _run((tx, rx), f"oa-peer-replica-3-{os.getpid()}")
    assert tx._omni_accum_binding.stats["omitted"] > 0  # values left off again: the receiver runs omni-accum
    assert_same(handed, base, "handed")
