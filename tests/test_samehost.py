"""Same-host channels that let no one in: the private directory and its checks (omni_accum.samehost), files
planted by another uid and symlinks under every name omni-accum uses (refused, logged, never mapped; the real
pair still connects), and hostile ring frames through the real receiver and sender (dropped and counted, no
code runs, later requests served)."""

from __future__ import annotations

import glob
import logging
import os
import pickle
import pwd
import random
import stat
import struct
import time
from pathlib import Path

import pytest
import torch

from omni_accum import samehost
from omni_accum.arena import ArenaReceiver, ArenaSender, wire
from omni_accum.arena.live import create_receiver, live_region, pointer_path
from omni_accum.arena.region import (
    HEADER,
    MAGIC,
    VERSION,
    W_MAGIC,
    W_OWNER_PID,
    W_READY,
    W_SENDER_PID,
    W_VERSION,
    Region,
    path_for,
)
from omni_accum.samehost import SameHostRefused, check_dir, open_private, private_dir
from waiting import poll  # tests/ is on sys.path (the rootdir conftest's folder), in stage processes too


def _nobody() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user 'nobody' on this host: a file of another uid cannot be planted")


def _name(tag: str) -> str:
    return f"sh_{tag}_{os.getpid()}_{random.randrange(1 << 30)}"


def _region_bytes(owner_pid: int) -> bytes:
    """A region header an attacker could write: magic, version, ready, a live owner pid."""
    q = [0] * (HEADER // 8)
    q[W_MAGIC], q[W_VERSION], q[W_READY], q[W_OWNER_PID] = MAGIC, VERSION, 1, owner_pid
    q[2], q[3], q[4], q[5] = 4096, 1, 4096, 4096  # page, npages, ring sizes
    return struct.pack(f"<{len(q)}Q", *q) + b"\0" * (4 * 4096 + 4096 - HEADER)


def _plant(path: Path, body: bytes, uid: int, mode: int = 0o644) -> Path:
    """A file of uid ``uid`` with a newer mtime than anything of ours."""
    path.write_bytes(body)
    os.chown(path, uid, uid)
    os.chmod(path, mode)
    future = time.time() + 3600
    os.utime(path, (future, future))
    return path


def _key(i: int) -> str:
    """The ``i``-th put key of this process: a put the arena cannot take goes through the inner
    SharedMemoryConnector, which names its segment /dev/shm/<key> (replaced by a put, read and unlinked by
    a get of any process): a fixed name would be shared with a test of another pytest process."""
    return f"k{os.getpid()}_{i}"


def _put_until_arena(tx, payload) -> list[str]:
    """Put until a put goes through the arena (the sender attaches a few ms after the receiver made its
    region; the puts before go through the inner connector); the keys put (``_key(0)``, ``_key(1)``, ...)."""
    keys: list[str] = []

    def put() -> bool:
        keys.append(_key(len(keys)))
        assert tx.put("0", "1", keys[-1], payload())[0]
        return tx.counts["arena_puts"] > 0

    poll(put, 60, 0.06)
    return keys


def _private_names() -> set[str]:
    try:
        return set(os.listdir(private_dir()))
    except FileNotFoundError:  # a reaper removed it empty after private_dir() made it: nothing is in it
        return set()


@pytest.fixture
def clean_private():
    before = _private_names()
    yield private_dir()
    left = _private_names() - before
    for n in left:
        (private_dir() / n).unlink(missing_ok=True)
    assert not left, f"left in the private directory: {sorted(left)}"


# --------------------------------------------------------------------------------------------- the place
def test_the_private_directory_is_this_users_and_0700():
    d = private_dir()
    st = os.lstat(d)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert d.parent == Path(os.environ.get("OMNI_ACCUM_ARENA_DIR") or "/dev/shm")
    assert d.name == f"omni-accum-{os.geteuid()}"


def test_a_private_directory_of_this_user_that_others_may_list_is_narrowed_to_0700(tmp_path, monkeypatch):
    """One made 0755 beforehand (by hand, or an older tool) was taken as it was: other users could list the region
    and hello names in it, which carry the deployment's token. It is narrowed to 0700 when first used."""
    monkeypatch.setenv("OMNI_ACCUM_ARENA_DIR", str(tmp_path))
    d = tmp_path / f"omni-accum-{os.geteuid()}"
    for mode in (0o755, 0o711, 0o700):
        d.mkdir(mode=mode, exist_ok=True)
        os.chmod(d, mode)
        assert private_dir() == d and stat.S_IMODE(os.lstat(d).st_mode) == 0o700, oct(mode)


def test_the_private_directory_removed_empty_by_a_reaper_between_mkdir_and_check_is_made_again(tmp_path, monkeypatch):
    """A reaper of another process removes the directory when it is empty; private_dir() must not fail for that."""
    monkeypatch.setenv("OMNI_ACCUM_ARENA_DIR", str(tmp_path))
    real_check = samehost.check_dir
    removed = []

    def check_after_a_reaper(path, **kw):
        if len(removed) < 3:  # the reaper wins the race three times in a row
            os.rmdir(path)
            removed.append(path)
        return real_check(path, **kw)

    monkeypatch.setattr(samehost, "check_dir", check_after_a_reaper)
    d = private_dir()
    assert len(removed) == 3 and d.is_dir() and stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    removed.clear()
    monkeypatch.setattr(samehost, "_MKDIR_ATTEMPTS", 2)  # a directory that never stays is not looped on forever
    with pytest.raises(FileNotFoundError):
        private_dir()


def test_another_owner_a_writable_mode_and_a_symlink_are_refused_with_path_owner_and_mode(tmp_path):
    uid = _nobody()
    f = _plant(tmp_path / "theirs", b"x", uid)
    with pytest.raises(SameHostRefused, match=rf"{f}: refused \(owned by another user; owner uid {uid}, mode 0o644"):
        open_private(f, os.O_RDONLY)
    mine = tmp_path / "mine"
    mine.write_bytes(b"x")
    os.chmod(mine, 0o620)
    with pytest.raises(SameHostRefused, match=r"group- or world-writable; owner uid 0, mode 0o620"):
        open_private(mine, os.O_RDONLY)
    os.chmod(mine, 0o600)
    os.close(open_private(mine, os.O_RDONLY))  # this user's, 0600: taken
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(SameHostRefused, match=rf"{link}: refused \(a symlink"):
        open_private(link, os.O_RDONLY)
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    check_dir(d)
    os.chown(d, uid, uid)
    with pytest.raises(SameHostRefused, match="owned by another user"):
        check_dir(d)
    dl = tmp_path / "dl"
    dl.symlink_to(d)
    with pytest.raises(SameHostRefused, match="a symlink"):
        check_dir(dl)


def test_a_base_directory_whose_private_directory_is_planted_or_a_symlink_is_refused(tmp_path, monkeypatch):
    uid = _nobody()
    monkeypatch.setenv("OMNI_ACCUM_ARENA_DIR", str(tmp_path))
    (tmp_path / f"omni-accum-{os.geteuid()}").mkdir(mode=0o700)
    os.chown(tmp_path / f"omni-accum-{os.geteuid()}", uid, uid)
    with pytest.raises(SameHostRefused, match=f"omni-accum-{os.geteuid()}: refused \\(owned by another user"):
        private_dir()
    os.rmdir(tmp_path / f"omni-accum-{os.geteuid()}")
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / f"omni-accum-{os.geteuid()}").symlink_to(real)
    with pytest.raises(SameHostRefused, match="a symlink"):
        private_dir()


# ------------------------------------------------------------------------------------ planted and linked
def test_symlinks_in_place_of_every_file_omni_accum_opens_are_refused(clean_private):
    from omni_accum.integrations.vllm_omni.peer import SHM_CHANNEL, hello_key

    pair = _name("link")
    target = private_dir() / f"target_{pair}"
    target.write_bytes(_region_bytes(os.getpid()))
    os.chmod(target, 0o600)
    links = [path_for(f"{pair}.{'a' * 16}"), pointer_path(pair), private_dir() / hello_key(5, 6), path_for(pair)]
    for p in links:
        p.symlink_to(target)
    try:
        with pytest.raises(SameHostRefused, match="a symlink"):
            Region.attach(f"{pair}.{'a' * 16}")  # the region
        with pytest.raises(SameHostRefused, match="a symlink"):
            live_region(pair)  # the pointer file
        with pytest.raises(SameHostRefused, match="a symlink"):
            ArenaReceiver(pair, 1 << 16)  # a region name in place
        assert SHM_CHANNEL.get("5", "6", hello_key(5, 6)) is None  # the hello: refused, read as absent
        with pytest.raises(SameHostRefused, match="a symlink"):
            samehost.read_private(private_dir() / hello_key(5, 6))
        assert target.read_bytes() == _region_bytes(os.getpid())  # nothing written through a link
    finally:
        for p in [*links, target]:
            p.unlink()


def _planted_everywhere(pair: str, hello: str, uid: int) -> list[Path]:
    """Files of uid ``uid`` with a live pid and a newer mtime under every name omni-accum uses (and used)."""
    region = _region_bytes(os.getpid())
    fake = f"{pair}.{'b' * 16}"
    hello_body = b'{"omni_accum_hello": [1, "ffffffffffff", "planted", %d, "%s"]}' % (
        os.getpid(), os.uname().nodename.encode())
    return [
        _plant(path_for(fake), region, uid),  # a region under the pattern
        _plant(pointer_path(pair), fake.encode(), uid),  # the pointer naming it
        _plant(private_dir() / hello, hello_body, uid),  # a hello
        _plant(Path("/dev/shm") / f"omni_accum_arena_{pair}.{os.getpid()}", region, uid),  # the old places
        _plant(Path("/dev/shm") / hello, hello_body, uid),
    ]


def test_files_planted_by_another_uid_are_never_mapped_and_the_real_pair_connects(vllm_omni, caplog):
    from tests.test_integration_vllm_omni_arena_connector import _connector
    from omni_accum.integrations.vllm_omni.peer import SHM_CHANNEL, hello_key

    uid = _nobody()
    name = _name("plant")
    pair = f"{name}_0_1"
    planted = _planted_everywhere(pair, hello_key(0, 1), uid)
    kept = {p: p.read_bytes() for p in planted}
    rx, tx = _connector(1, name), _connector(0, name)
    caplog.set_level(logging.WARNING)
    try:
        assert SHM_CHANNEL.get("0", "1", hello_key(0, 1)) is None  # the planted hello is not read
        assert rx.get("0", "1", _key(0)) is None  # the receiver creates its region, refusing the planted pointer
        assert rx.fallbacks.get("samehost_refused") == 1
        keys = _put_until_arena(tx, lambda: {"x": torch.arange(8)})
        assert tx.counts["arena_puts"] == 1, tx.health()  # the real pair connects
        for k in keys:  # nothing lost (the first puts may go through the inner connector)
            got = rx.get("0", "1", k)
            assert got is not None and torch.equal(got[0]["x"], torch.arange(8))
        fake_region = planted[0]
        assert kept[fake_region] == fake_region.read_bytes()  # never mapped by a sender (it writes its pid there)
        assert struct.unpack_from("<Q", fake_region.read_bytes(), 8 * W_SENDER_PID)[0] == 0
        text = caplog.text
        for p in (pointer_path(pair), private_dir() / hello_key(0, 1)):
            assert f"{p}: refused (owned by another user; owner uid {uid}, mode 0o644" in text, text
        assert f"/dev/shm/omni_accum_arena_{pair}" not in text  # the old places are not even looked at
        SHM_CHANNEL.put("0", "1", hello_key(0, 1), {"omni_accum_hello": [1, "f", "s", os.getpid(), "h"]})
        assert SHM_CHANNEL.get("0", "1", hello_key(0, 1))[0]["omni_accum_hello"][2] == "s"  # ours replaces it
        SHM_CHANNEL.cleanup(hello_key(0, 1))
    finally:
        tx.close()
        rx.close()
        for p in planted:
            p.unlink(missing_ok=True)
    assert not glob.glob(f"{private_dir()}/*{name}*") and not glob.glob(f"/dev/shm/*{name}*")


def test_a_pointer_planted_after_the_receiver_started_makes_puts_fall_back_and_nothing_is_lost(vllm_omni, caplog):
    from tests.test_integration_vllm_omni_arena_connector import _connector

    uid = _nobody()
    name = _name("late")
    pair = f"{name}_0_1"
    rx, tx = _connector(1, name), _connector(0, name)
    try:
        assert rx.get("0", "1", "none") is None  # creates the region
        real = pointer_path(pair).read_bytes()
        os.unlink(pointer_path(pair))
        _plant(pointer_path(pair), f"{pair}.{'c' * 16}".encode(), uid)
        caplog.set_level(logging.WARNING)
        key = f"k{os.getpid()}"
        assert tx.put("0", "1", key, {"x": torch.arange(4)})[0]
        assert tx.counts["inner_puts"] == 1 and tx.fallbacks.get("samehost_refused") == 1
        assert f"{pointer_path(pair)}: refused (owned by another user" in caplog.text
        got = rx.get("0", "1", key)
        assert got is not None and torch.equal(got[0]["x"], torch.arange(4))  # through the inner connector
        os.unlink(pointer_path(pair))
        pointer_path(pair).write_bytes(real)
        os.chmod(pointer_path(pair), 0o600)
    finally:
        tx.close()
        rx.close()
        pointer_path(pair).unlink(missing_ok=True)
    assert not glob.glob(f"{private_dir()}/*{name}*")


def test_a_receiver_whose_random_name_is_taken_creates_another(monkeypatch, clean_private):
    pair = _name("taken")
    from omni_accum.arena import live

    tokens = iter(["d" * 16, "e" * 16])
    real = live.secrets.token_hex
    monkeypatch.setattr(live.secrets, "token_hex", lambda n: next(tokens, None) or real(n))
    squat = path_for(f"{pair}.{'d' * 16}")
    squat.write_bytes(_region_bytes(os.getppid()))  # taken, by a live owner
    os.chmod(squat, 0o600)
    rx = create_receiver(pair, 1 << 16)
    try:
        assert rx.region.path == path_for(f"{pair}.{'e' * 16}")
        assert live_region(pair) == f"{pair}.{'e' * 16}"
    finally:
        rx.close()
        squat.unlink()


# ------------------------------------------------------------------------------------ hostile ring frames
class _Boom:
    def __reduce__(self):
        return (exec, ("open(__import__('os').environ['OA_PWNED'], 'w').write('ran')",))


def _hostile_frames(rx: ArenaReceiver, marker: Path) -> list[bytes]:
    g = random.Random(33)
    npages = rx.region.layout.npages
    good = wire.dump_msg("k", b"\x80", [(0, 1)], (), ())
    return [
        bytes(g.randrange(256) for _ in range(200)),  # random bytes
        b"t" + struct.pack("<I", 0xFFFFFFFF),  # a huge count
        b"s" + struct.pack("<I", 1 << 31) + b"abc",  # a huge length
        good[: len(good) // 2],  # truncated
        pickle.dumps(_Boom()),  # would run code under pickle
        wire.dumps(("c", "r", 0, [("k", npages - 1, 5, 1, "float32", (4,), False)], [], {}, 1, [])),  # off the end
        wire.dumps(("c", "r", 0, [("k", -1, 1, 1, "float32", (4,), False)], [], {}, 1, [])),  # before the data
        wire.dump_msg("k", b"", [(npages, 1)], (), ()),  # pages outside the arena
        wire.dump_msg("k", b"", [], [("r", "p", 1, 0, 1, 1 << 20, "float32", (1024,))], ()),  # a slab too big
        wire.dumps(("m", "k", b"", [], (), ())),  # a keyed message not framed as one
        b"M" + b"\xff" * 20,  # lengths that do not add up
        b"R\x01",  # a truncated binary descriptor
        b"R" + struct.pack("<QqH", 1, 0, 500),  # a binary descriptor with more items than bytes
        wire.dumps(("zz", 1)),  # an unknown tag
        b"",  # empty
        wire.dumps(("c", "r", 0, [], [], {1: (False, 1)}, 1, [])),  # a value's key that is not a name
        wire.dumps(("c", "r", 0, [], [(7, 1)], {}, 1, [])),  # a row count's key that is not a name
    ]


def test_hostile_frames_are_dropped_no_code_runs_and_later_requests_are_served(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("OA_PWNED", str(marker))
    name = _name("frames")
    rx = ArenaReceiver(name, 1 << 20)
    tx = ArenaSender(name, {"emb": "append"})
    try:
        frames = _hostile_frames(rx, marker)
        for f in frames:
            assert tx.region.ring_f.push(f)
        assert rx.poll() is None  # each dropped, none applied
        assert rx.bad_frames == len(frames) and not marker.exists()
        assert rx.pending_keys() == [] and rx.requests() == []
        # keys that collide ("a" and "a.b"): dropped and counted too (it raised AttributeError out of poll)
        assert tx.region.ring_f.push(wire.dumps(("c", "c1", 0, [], [], {"a": (False, [1]), "a.b": (True, [2])}, 1, [])))
        assert rx.poll() is None and rx.bad_frames == len(frames) + 1
        rx.release("c1")
        frames.append(b"")  # counted in the totals below
        assert tx.region.ring_f.push(wire.dump_msg("other-request", b"\x80", [], (), ()))  # valid, another request's
        assert rx.poll() is None and rx.pending_keys() == ["other-request"] and rx.bad_frames == len(frames)
        # a valid frame for another request waits under its own key; ours is served
        chunk = {"emb": torch.arange(12, dtype=torch.float32).view(3, 4), "ids": [1, 2]}
        tx.send("r1", chunk)
        ev = rx.poll(timeout_s=10)
        assert ev is not None and ev.req_id == "r1" and torch.equal(ev.view["emb"], chunk["emb"])
        assert ev.view["ids"] == [1, 2]
        # a length no producer writes: the ring drops what was published, counts it, and goes on
        ring = tx.region.ring_f
        tail = ring._q[ring._tail_i]
        struct.pack_into("<Q", ring._buf, tail % ring.capacity, 1 << 40)
        ring._q[ring._tail_i] = tail + 16
        assert rx.poll() is None and rx.bad_frames == len(frames) + 1
        tx.send("r1", {"emb": torch.ones(1, 4), "ids": [3]})
        ev = rx.poll(timeout_s=10)
        assert ev is not None and ev.view["emb"].shape == (4, 4) and ev.view["ids"] == [3]
        # ring B (receiver -> sender): the same
        for f in [pickle.dumps(_Boom()), wire.dump_free(None, [(10**9, 1)]), b"\xff" * 9]:
            assert rx.region.ring_b.push(f)
        tx.reclaim()
        assert tx.bad_frames == 3 and not marker.exists()
        tx.done("r1")
        rx.release("r1")
    finally:
        tx.close()
        rx.close()
    assert not marker.exists()
    control = tmp_path / "control"
    monkeypatch.setenv("OA_PWNED", str(control))
    pickle.loads(pickle.dumps(_Boom()))  # the frame is a real exploit: under pickle it runs code
    assert control.read_text() == "ran"


def test_hostile_frames_through_the_connector_fall_back_and_the_stage_lives(vllm_omni, tmp_path, monkeypatch):
    from tests.test_integration_vllm_omni_arena_connector import _connector

    marker = tmp_path / "pwned"
    monkeypatch.setenv("OA_PWNED", str(marker))
    name = _name("conn")
    rx, tx = _connector(1, name), _connector(0, name)
    try:
        assert rx.get("0", "1", "none") is None
        keys = _put_until_arena(tx, lambda: {"x": torch.arange(3)})
        assert tx.counts["arena_puts"] == 1
        for k in keys[:-1]:
            assert rx.get("0", "1", k) is not None  # through the inner connector
        sender = next(iter(tx._tx.values()))
        arena = next(iter(rx._rx.values()))
        frames = _hostile_frames(arena, marker)
        for f in frames:
            assert sender.region.ring_f.push(f)
        # a keyed message whose body names a tensor outside the data area: that get falls back
        from omni_accum.integrations.vllm_omni.arena_chains import tensor_ref
        from omni_accum.integrations.vllm_omni.arena_codec import IN_ARENA

        body = tx._encoder.encode({"x": tensor_ref(torch.zeros(4), [4], IN_ARENA, 10**6)})
        sender.publish("bad-body", body, [])
        assert rx.get("0", "1", "bad-body") is None  # dropped; the inner connector has nothing under it
        assert rx.fallbacks.get("bad_frame") == len(frames) + 1 and not marker.exists()
        assert rx.health()["status"] == "healthy"
        got = rx.get("0", "1", keys[-1])
        assert got is not None and torch.equal(got[0]["x"], torch.arange(3))  # served after all that
        assert tx.put("0", "1", "after", {"y": torch.ones(2)})[0]
        got = rx.get("0", "1", "after")
        assert got is not None and torch.equal(got[0]["y"], torch.ones(2))
    finally:
        tx.close()
        rx.close()
    assert not marker.exists()
    assert not glob.glob(f"{private_dir()}/*{name}*") and not glob.glob(f"/dev/shm/*{name}*")


def test_a_private_directory_this_user_may_not_open_is_refused_and_every_put_and_get_falls_back(
    vllm_omni, tmp_path, monkeypatch
):
    """Another user's `mkdir -m 700 /dev/shm/omni-accum-<our uid>` made every put and get raise PermissionError
    (vllm-omni fails a request whose put raises): it is refused as any directory not ours. (Root may open any
    directory, so the denial is simulated.)"""
    import errno

    from tests.test_integration_vllm_omni_arena_connector import _connector

    monkeypatch.setenv("OMNI_ACCUM_ARENA_DIR", str(tmp_path))
    d = tmp_path / f"omni-accum-{os.geteuid()}"
    d.mkdir(mode=0o700)
    real_open = os.open

    def denied(path, flags, *a, **kw):
        if str(path) == str(d) or str(path).startswith(f"{d}/"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(SameHostRefused, match="not accessible to this user \\(permission denied\\)"):
        check_dir(d)
    name = _name("denied")
    rx, tx = _connector(1, name), _connector(0, name)
    try:
        assert rx.get("0", "1", _key(0)) is None
        assert rx.fallbacks.get("samehost_refused", 0) >= 1
        for i in range(3):
            assert tx.put("0", "1", _key(i), {"x": torch.arange(4) + i})[0]
            got = rx.get("0", "1", _key(i))
            assert got is not None and torch.equal(got[0]["x"], torch.arange(4) + i)
        assert tx.counts["arena_puts"] == 0  # all through the inner connector, none failed
    finally:
        tx.close()
        rx.close()


def samehost_errors():
    from omni_accum.arena import ArenaError

    return ArenaError


def test_pids_and_page_sizes_out_of_range_in_a_shared_header_are_not_trusted():
    from omni_accum.arena.region import pid_alive

    assert not pid_alive(1 << 40) and not pid_alive(-1) and pid_alive(os.getpid())  # 1 << 40 raised OverflowError
    name = _name("page")
    with pytest.raises(ValueError, match="page size 3000 is not a power of two"):
        Region.create(name, 1 << 16, page=3000)
    rx = ArenaReceiver(name, 1 << 16)
    try:
        q = memoryview(rx.region.mm)[:HEADER].cast("Q")
        q[2] = 0  # the header's page size, as a hostile or broken writer leaves it
        q.release()
        with pytest.raises(samehost_errors(), match="page size 0 in its header is not a power of two"):
            Region.attach(name)
    finally:
        rx.close()


def test_the_reaper_imports_nothing_from_the_working_directory(tmp_path, monkeypatch):
    """The reaper ran `python -S -c`: the working directory first on sys.path, so a signal.py planted in a shared
    folder the server was started from ran as the serving user."""
    import subprocess
    import sys

    shared, scripts = tmp_path / "shared", tmp_path / "scripts"
    shared.mkdir()
    scripts.mkdir()
    (shared / "signal.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\nfrom _signal import *\n")
    (scripts / "serve.py").write_text(  # a script: its own folder on sys.path, not the working directory
        "from omni_accum import samehost\nsamehost._send('- nothing')\np = samehost._reaper[0]\n"
        "p.stdin.close()\nassert p.wait(30) == 0\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    subprocess.run([sys.executable, str(scripts / "serve.py")], cwd=shared, env=env, check=True, timeout=120)
    assert not (tmp_path / "ran").exists()


def test_a_base_directory_of_another_user_or_writable_by_others_without_the_sticky_bit_is_refused(tmp_path,
                                                                                                  monkeypatch):
    """OMNI_ACCUM_ARENA_DIR owned by another user (mode 0755) was accepted: its owner could move our directory
    away and plant one of theirs; a group-writable base without the sticky bit too."""
    uid = _nobody()
    base = tmp_path / "base"
    base.mkdir(mode=0o755)
    monkeypatch.setenv("OMNI_ACCUM_ARENA_DIR", str(base))
    os.chown(base, uid, uid)
    with pytest.raises(SameHostRefused, match="owned by another user \\(not root, not this user\\)"):
        private_dir()
    os.chown(base, os.geteuid(), os.getegid())
    os.chmod(base, 0o775)  # ours, but others of the group could move our directory away
    with pytest.raises(SameHostRefused, match="group- or world-writable directory without the sticky bit"):
        private_dir()
    os.chmod(base, 0o1777)
    assert private_dir().parent == base  # as /dev/shm: sticky
    monkeypatch.setenv("OMNI_ACCUM_ARENA_DIR", os.path.relpath(base))
    assert samehost.base_dir().is_absolute()  # the reaper runs from /: a relative base would miss every file


def test_chunk_descriptors_whose_keys_are_not_names_are_refused_before_anything_is_applied():
    """Value and row keys that were ints reached the receiver's key split (AttributeError, nothing counted)."""
    layout = type("L", (), {"npages": 4, "page": 4096})()
    for m in (("c", "r", 0, [], [], {1: (False, 1)}, 1, []), ("c", "r", 0, [], [(7, 1)], {}, 1, [])):
        with pytest.raises(wire.BadFrame):
            wire.checked(m, layout)
    assert wire.checked(("c", "r", 0, [], [("a", 1)], {"b": (False, 1)}, 1, []), layout)[1] == "r"


def test_a_forked_child_does_not_keep_its_parents_files_alive(tmp_path, monkeypatch):
    """vLLM forks its workers: a child kept its parent's reaper pipe open, so the files of a parent that ended without
    removing them (a SIGTERM) stayed until every child had ended too."""
    import signal
    import subprocess
    import sys
    import textwrap

    base = tmp_path / "shm"
    base.mkdir(mode=0o700)
    code = textwrap.dedent(
        """
        import os, sys, time
        from omni_accum import samehost
        path = samehost.private_dir() / f"forked_{os.getpid()}"
        samehost.write_private(path, b"x", "test")
        samehost.track(path)
        child = os.fork()
        if child == 0:
            time.sleep(120)
            os._exit(0)
        print(path, child, flush=True)
        os._exit(0)  # ends without removing it: its reaper does
        """
    )
    env = {**os.environ, "OMNI_ACCUM_ARENA_DIR": str(base)}
    parent = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    path, child = parent.stdout.readline().split()  # (the child holds the pipe: read a line, not to its end)
    parent.stdout.close()
    assert parent.wait(timeout=120) == 0
    try:
        assert poll(lambda: not os.path.exists(path), timeout=60), "the parent's file outlived it while its child lives"
        os.kill(int(child), 0)  # (the child still lives)
    finally:
        try:
            os.kill(int(child), signal.SIGKILL)
        except ProcessLookupError:
            pass
