"""``omni_accum.arena.sweep_stale()`` removes every stale arena file: regions whose owner is dead, and the pointer
files (``<pair>.live``) that name such a region or one that is gone; a live receiver's files stay."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from omni_accum.arena import sweep_stale
from omni_accum.arena.live import create_receiver, pointer_path
from omni_accum.samehost import private_dir, write_private
from waiting import poll  # tests/ is on sys.path (the rootdir conftest's folder)

#: A receiver in a process of its own that copies its region and pointer to argv[1], then ends without closing them
#: (its reaper removes the originals: the copies are what a process leaves when it had no reaper).
_CHILD = textwrap.dedent(
    """
    import os, shutil, sys
    from omni_accum.arena.live import create_receiver
    rx = create_receiver(sys.argv[2], 1 << 20, ring_bytes=1 << 16)
    for p in rx.region.path.parent.iterdir():
        if sys.argv[2] in p.name:
            shutil.copy2(p, os.path.join(sys.argv[1], p.name))
    os._exit(0)
    """
)


def _dead_receivers_files(tmp_path, monkeypatch, pair: str):
    """A private directory of this test's own (``OMNI_ACCUM_ARENA_DIR``) and the folder holding the files a receiver
    of ``pair`` left when it ended without closing them (see :data:`_CHILD`)."""
    base, left = tmp_path / "shm", tmp_path / "left"
    base.mkdir(mode=0o700)
    left.mkdir(mode=0o700)
    monkeypatch.setenv("OMNI_ACCUM_ARENA_DIR", str(base))
    subprocess.run([sys.executable, "-c", _CHILD, str(left), pair], check=True, timeout=120)
    return left


def test_sweep_stale_removes_a_dead_owners_region_and_the_pointers_naming_dead_or_missing_regions(
    tmp_path, monkeypatch
):
    left = _dead_receivers_files(tmp_path, monkeypatch, f"sweepdead_{os.getpid()}_0_1")
    dead = sorted(p.name for p in left.iterdir())
    assert len(dead) == 2 and any(n.endswith(".live") for n in dead), dead  # the region and its pointer
    gone = left / pointer_path(f"sweepgone_{os.getpid()}_0_1").name  # a pointer whose region is not there
    write_private(gone, f"sweepgone_{os.getpid()}_0_1.0123456789abcdef".encode(), "test")

    removed = sweep_stale(left)
    assert sorted(p.name for p in removed) == sorted([*dead, gone.name])
    assert not list(left.iterdir())

    rx = create_receiver(f"sweeplive_{os.getpid()}_0_1", 1 << 20, ring_bytes=1 << 16)  # alive: both files stay
    try:
        mine = {rx.region.path.name, pointer_path(f"sweeplive_{os.getpid()}_0_1").name}
        assert mine <= {p.name for p in private_dir().iterdir()}
        assert not mine & {p.name for p in sweep_stale()}
        assert mine <= {p.name for p in private_dir().iterdir()}
    finally:
        rx.close()


def test_a_sender_finding_a_dead_owners_region_leaves_the_pointer_to_the_reaper_and_the_next_receiver(
    tmp_path, monkeypatch
):
    """A sender that found the pair's region without a live owner removed the pointer file after reading it again: a
    new receiver's pointer written between that read and the unlink was removed, and the pair's sender found no
    region until a restart (its puts went the inner connector's way). A sender removes the dead region only; the
    pointer is the dead owner's reaper's (it removes it if it still names that region), a new receiver's (it
    replaces it) or ``sweep_stale()``'s."""
    import pytest

    from omni_accum.arena import live
    from omni_accum.arena.region import ArenaError

    pair = f"sweepdrop_{os.getpid()}_0_1"
    left = _dead_receivers_files(tmp_path, monkeypatch, pair)
    # the dead receiver's reaper removes its originals in a moment: wait for that, then put the copies where the
    # sender looks (linking sooner raced the reaper: "File exists", or a copy it removed)
    assert poll(lambda: not any(pair in n for n in os.listdir(private_dir())), timeout=60)
    for p in left.iterdir():  # the dead receiver's region and pointer
        os.link(p, private_dir() / p.name)
    ptr = live.pointer_path(pair)
    named = ptr.read_bytes()
    with pytest.raises(ArenaError, match="no live owner"):
        live.live_region(pair)
    assert ptr.read_bytes() == named  # left
    assert not (private_dir() / ("omni_accum_arena_" + named.decode())).exists()  # the dead owner's region: removed
    assert [p.name for p in sweep_stale()] == [ptr.name]


def test_sweep_stale_keeps_a_live_replica_s_mark_and_removes_a_dead_one_s(tmp_path, monkeypatch):
    """A pair's replica mark (``<pair>.replicas``, a pid) matched the regions' pattern and was read as a region: no
    region header, so no owner, and ``sweep_stale()`` removed a live replica's mark (its sender then went back to
    the region until the mark was written again)."""
    from omni_accum.arena import live

    base = tmp_path / "shm"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("OMNI_ACCUM_ARENA_DIR", str(base))
    pair, dead_pair = f"sweeprep_{os.getpid()}_0_1", f"sweepdeadrep_{os.getpid()}_0_1"
    live.mark_replica(pair)  # this process: alive
    try:
        ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                               text=True, check=True, timeout=60).stdout.strip()  # fmt: skip
        write_private(live.replicas_path(dead_pair), ended.encode(), "test")  # a replica that ended
        assert [p.name for p in sweep_stale()] == [live.replicas_path(dead_pair).name]
        assert live.replicas_marked(pair)
        assert live.replicas_path(pair).exists()
    finally:
        live.unmark_replica(pair)
