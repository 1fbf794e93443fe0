"""Same-host files under a hostile or crashed neighbour (an adversarial audit):

* a FIFO left under a same-host name (the pair's pointer, its replica mark, a peer hello, a capture's salt, a file the
  reaper removes) was opened without ``O_NONBLOCK``: the open waited for a writer before the file-type check could
  refuse it, and the arena connector's get or put hung for good holding its lock;
* a receiving stage killed together with its reaper (``kill -9`` of its process group, a container's OOM kill) left
  its region in ``/dev/shm`` for good: each receiver takes a fresh random name, so none reused it;
* a process forked from a region's owner ran the owner's ``atexit`` close when it exited normally: the parent's live
  region and its pointer were unlinked and marked closed under it;
* a capture (or status) folder reached through a symlink that another user owns was followed (they could point it
  at another folder later).
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from omni_accum import samehost
from omni_accum.arena import live
from omni_accum.arena.region import W_OWNER_CLOSED


@pytest.fixture
def private(tmp_path, monkeypatch):
    base = tmp_path / "shm"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("OMNI_ACCUM_ARENA_DIR", str(base))
    return samehost.private_dir()


def _returns(call, timeout: float = 30.0):
    """``call()``'s result or exception, from a thread; fails when it is still waiting after ``timeout`` s."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return t.is_alive(), out


def _unblock(fifo: Path) -> None:
    """Let a reader waiting on ``fifo`` go (the code before this change waited there for a writer)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.mark.parametrize("which", ["pointer", "replica mark"])
def test_a_fifo_under_an_arena_name_is_refused_not_waited_on(private, which):
    pair = "omni_0_1"
    fifo = live.pointer_path(pair) if which == "pointer" else live.replicas_path(pair)
    os.mkfifo(fifo, 0o600)
    call = (lambda: live.live_region(pair)) if which == "pointer" else (lambda: live.replicas_marked(pair))
    waiting, out = _returns(call)
    if waiting:
        _unblock(fifo)
    assert not waiting, f"the {which}'s reader still waits on a FIFO"
    assert isinstance(out.get("error"), samehost.SameHostRefused), out
    assert "not a regular file" in str(out["error"])


def test_a_fifo_hello_is_refused_not_waited_on(private):
    from omni_accum.integrations.vllm_omni.peer_channel import SHM_CHANNEL, hello_key

    fifo = private / hello_key(0, 1)
    os.mkfifo(fifo, 0o600)
    waiting, out = _returns(lambda: SHM_CHANNEL.get("0", "1", hello_key(0, 1)))
    if waiting:
        _unblock(fifo)
    assert not waiting, "the hello's reader still waits on a FIFO"
    assert out == {"value": None}  # refused (logged): no hello heard


def test_opening_a_fifo_for_writing_is_refused_not_an_enxio(private):
    fifo = private / "omni_accum_arena_x"
    os.mkfifo(fifo, 0o600)
    waiting, out = _returns(lambda: samehost.open_private(fifo, os.O_WRONLY))
    if waiting:  # the code before this change waited for a reader
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    assert not waiting, "the open for writing still waits on a FIFO"
    assert isinstance(out.get("error"), samehost.SameHostRefused), out
    assert "not a regular file" in str(out["error"])


def test_a_fifo_salt_in_a_capture_folder_is_refused_not_waited_on(tmp_path):
    from omni_accum.capture.writer import CaptureError, CaptureWriter

    folder = tmp_path / "capture"
    folder.mkdir(mode=0o700)
    os.mkfifo(folder / "salt", 0o600)
    waiting, out = _returns(lambda: CaptureWriter(folder, "0"))
    if waiting:
        _unblock(folder / "salt")
    assert not waiting, "the capture writer still waits on a FIFO salt"
    assert isinstance(out.get("error"), CaptureError), out
    assert "salt" in str(out["error"]) and "not a regular file" in str(out["error"])


def test_the_reaper_skips_a_fifo_and_removes_the_rest(tmp_path):
    fifo, plain = tmp_path / "fifo", tmp_path / "plain"
    os.mkfifo(fifo, 0o600)
    plain.write_text("mine")
    reaper = subprocess.Popen([sys.executable, "-I", "-S", "-c", samehost._REAPER], stdin=subprocess.PIPE,
                              text=True, cwd="/")  # fmt: skip
    try:
        reaper.communicate(f"+ {fifo}\tmine\n+ {plain}\tmine\n", timeout=60)  # its parent gone: it removes both
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()
        pytest.fail("the reaper still waits on a FIFO")
    assert reaper.returncode == 0
    assert not plain.exists() and fifo.exists()  # the FIFO did not hold the same content: left


_KILLED_OWNER = """
import os, signal, sys
from omni_accum import samehost
from omni_accum.arena import live
rx = live.create_receiver(sys.argv[1], 1 << 20)
print(rx.region.path, flush=True)
reaper = samehost._reaper[0]
os.kill(reaper.pid, signal.SIGKILL)  # killed with the stage (its process group, an OOM kill of the container)
reaper.wait()
os._exit(0)  # no close, no atexit: the region stays
"""


def test_a_receiver_removes_its_pair_s_regions_whose_owner_died_with_its_reaper(private):
    pair = "omni_0_1"
    got = subprocess.run([sys.executable, "-c", _KILLED_OWNER, pair], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})  # fmt: skip
    assert got.returncode == 0, got.stderr
    left = Path(got.stdout.strip())
    assert left.exists() and left.parent == private  # the dead owner's region, nothing removed it
    other = live.create_receiver("other_0_1", 1 << 20)  # another pair's receiver leaves it alone
    try:
        assert left.exists()
    finally:
        other.close()
    rx = live.create_receiver(pair, 1 << 20)
    try:
        assert not left.exists()
        assert rx.region.path.exists() and live.live_region(pair) == rx.region.path.name[len("omni_accum_arena_"):]
    finally:
        rx.close()


def test_a_forked_child_s_normal_exit_leaves_its_parent_s_region_alone(private):
    rx = live.create_receiver("omni_0_1", 1 << 20)
    try:
        pid = os.fork()
        if pid == 0:  # the child ends as an interpreter does: its atexit handlers (inherited: the owner's close) run
            code = 0
            try:
                atexit._run_exitfuncs()
            except BaseException:  # noqa: BLE001
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert rx.region.path.exists() and live.pointer_path("omni_0_1").exists()
        assert rx.region.q[W_OWNER_CLOSED] == 0
        assert live.live_region("omni_0_1") == rx.region.path.name[len("omni_accum_arena_"):]
    finally:
        rx.close()
    assert not rx.region.path.exists()  # the owner's own close still removes it


@pytest.mark.skipif(os.geteuid() != 0, reason="a link owned by another user needs root to make (lchown)")
def test_a_capture_folder_through_another_user_s_symlink_is_refused(tmp_path):
    from omni_accum.capture.writer import CaptureError, CaptureWriter, folder_problem

    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "capture"
    link.symlink_to(mine)
    assert folder_problem(link) is None  # this user's own link is followed
    os.lchown(link, 65534, 65534)
    said = folder_problem(link)
    assert said is not None and said.startswith(f"capture folder {link}: {link} is a symlink owned by"), said
    with pytest.raises(CaptureError, match="is a symlink owned by"):
        CaptureWriter(link, "0")
    assert list(mine.iterdir()) == []



def test_a_thread_id_is_not_a_live_process():
    """kill(tid, 0) succeeds for a thread of a live process: after a container restart a dead owner's small pid is
    often one, and its region, mark or hello was kept for good."""
    got: list[int] = []
    done = threading.Event()

    def run() -> None:
        got.append(threading.get_native_id())
        done.wait(30)

    t = threading.Thread(target=run)
    t.start()
    try:
        while not got:
            done.wait(0.01)
        assert got[0] != os.getpid()
        assert not samehost.pid_alive(got[0])
        assert samehost.pid_alive(os.getpid())
    finally:
        done.set()
        t.join()


def test_a_child_forked_while_a_warm_step_holds_the_region_s_lock_exits(private):
    """The child's inherited close took the warm lock first, which the parent's (not forked) warm thread held: it
    waited for good."""
    import time

    rx = live.create_receiver("omni_0_1", 1 << 20)
    held, release = threading.Event(), threading.Event()

    def warm() -> None:  # the parent's warm thread, in a warm step at the fork
        with rx.region._warm_lock:
            held.set()
            release.wait(120)

    warmer = threading.Thread(target=warm)
    warmer.start()
    try:
        assert held.wait(60)
        pid = os.fork()
        if pid == 0:
            try:
                atexit._run_exitfuncs()
            finally:
                os._exit(0)
        for _ in range(1200):  # up to a minute: the child exits at once unless it waits on the lock
            if (done := os.waitpid(pid, os.WNOHANG))[0] != 0:
                break
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert done[0] == pid, "the forked child's exit waited on the parent's warm lock"
        assert rx.region.path.exists()
    finally:
        release.set()
        warmer.join()
        rx.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="a link owned by another user needs root to make (lchown)")
def test_a_capture_folder_below_another_user_s_symlink_is_refused(tmp_path):
    from omni_accum.capture.writer import folder_problem

    mine = tmp_path / "mine"
    (mine / "cap").mkdir(parents=True, mode=0o700)
    link = tmp_path / "shared"
    link.symlink_to(mine)
    assert folder_problem(link / "cap") is None  # this user's own link above it is followed
    os.lchown(link, 65534, 65534)
    said = folder_problem(link / "cap")
    assert said is not None, "a foreign link above the folder was followed"
    assert said.startswith(f"capture folder {link / 'cap'}: {link} is a symlink owned by uid"), said
