"""The live region of a stage pair, found through a pointer file in the private directory (never a glob).

The receiving process creates its region under a name with a random part, ``<pair>.<16 hex digits>``
(a name already taken gives another one), then writes the pointer file ``omni_accum_arena_<pair>.live``
(whole, through a temporary file of its own) that holds that name. The sending process reads the pointer
(checked: this user's regular file, not a symlink, not writable by others, at most 512 bytes, a name of
this pair) and attaches to the region it names if its owner lives. Both files are in
:func:`omni_accum.samehost.private_dir`; nothing else is looked at, but by a new receiver, which first removes its
own pair's regions whose owner died (a server killed together with its reaper left them: :func:`sweep_pair`).
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Any

from omni_accum import samehost
from omni_accum.arena.region import PREFIX, REPLICAS_SUFFIX, ArenaError, owner_of, path_for, pid_alive

POINTER_SUFFIX = ".live"
#: Attempts at a fresh random name before a receiver gives up (each taken name is someone's live region).
NAME_TRIES = 8


def pointer_path(pair: str) -> Path:
    p = path_for(pair)
    return p.with_name(p.name + POINTER_SUFFIX)


def live_region(pair: str) -> str:
    """The name of stage pair ``pair``'s live region (for :class:`~omni_accum.arena.ArenaSender`). Raises
    ArenaError when there is none (a region whose owner died is removed on the way), SameHostRefused when the
    pointer or the region it names is not this user's (neither is read further)."""
    ptr = pointer_path(pair)
    try:
        body = samehost.read_private(ptr, 512)
    except FileNotFoundError:
        raise ArenaError(f"no live arena {ptr.name} yet: the receiving stage creates it on its first get") from None
    name = body.decode("ascii", "replace")
    if not re.fullmatch(re.escape(pair) + r"\.[0-9a-f]{16}", name):
        raise ArenaError(f"{ptr}: {name[:80]!r} is not a region name of {pair}")
    owner = owner_of(path_for(name))
    if owner is None or not pid_alive(owner):
        if owner is not None:
            path_for(name).unlink(missing_ok=True)  # its owner died without closing it
        # the pointer stays: a new receiver may rewrite it between a read here and an unlink (the pair would then
        # have no pointer, and its sender no region, until a restart); the dead owner's reaper removes it if it
        # still names that region, a new receiver replaces it, sweep_stale() removes it
        raise ArenaError(f"no live arena for {pair}: {name} has no live owner")
    return name


def sweep_pair(pair: str) -> list[Path]:
    """Remove ``pair``'s regions (``<pair>.<16 hex digits>``) whose recorded owner is dead: a receiving stage killed
    together with its reaper (``kill -9`` of its process group, a container's OOM kill) leaves its region, which no
    later receiver reuses (each takes a fresh random name); the removed paths. A region whose header has no owner yet
    (being created) and a file that is not this user's (logged once) are left alone."""
    removed = []
    name = re.compile(re.escape(PREFIX + pair) + r"\.[0-9a-f]{16}")
    for p in sorted(samehost.private_dir().glob(f"{PREFIX}{pair}.*")):
        if not name.fullmatch(p.name):
            continue
        try:
            owner = owner_of(p)
        except samehost.SameHostRefused as e:
            samehost.log_refusal(e, "a stale region")
            continue
        if owner and not pid_alive(owner):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def create_receiver(pair: str, data_bytes: int, **kw: Any) -> Any:
    """A new :class:`~omni_accum.arena.ArenaReceiver` for ``pair`` under a fresh random name, named by the pair's
    pointer file (replacing any earlier pointer). The pair's regions whose owner died go first (:func:`sweep_pair`)."""
    from omni_accum.arena.receiver import ArenaReceiver  # noqa: PLC0415

    sweep_pair(pair)
    for _ in range(NAME_TRIES):
        name = f"{pair}.{secrets.token_hex(8)}"
        try:
            rx = ArenaReceiver(name, data_bytes, **kw)
        except (FileExistsError, ArenaError):
            continue  # taken (a live owner's region, or a file of anyone): another name
        break
    else:
        raise ArenaError(f"arena {pair}: {NAME_TRIES} random names were all taken")
    ptr = pointer_path(pair)
    try:
        samehost.write_private(ptr, name.encode(), "new")
    except BaseException:
        rx.close()
        raise
    rx.region.pointer = ptr
    samehost.track(ptr, name)
    return rx


def replicas_path(pair: str) -> Path:
    p = path_for(pair)
    return p.with_name(p.name + REPLICAS_SUFFIX)


def mark_replica(pair: str) -> None:
    """Say that this process receives on ``pair`` beside the live owner of its region (a replica of the receiving
    stage): the pair's replica mark, holding this pid (whole, through a temporary file; removed by this process's
    reaper when it ends, if it still holds this pid)."""
    path, pid = replicas_path(pair), str(os.getpid())
    samehost.write_private(path, pid.encode(), "mark")
    samehost.track(path, pid)


def replicas_marked(pair: str) -> bool:
    """Whether a live process other than the region's owner receives on ``pair`` (its replica mark names a live
    pid). A mark whose writer died is removed; one that is not this user's is refused (SameHostRefused)."""
    path = replicas_path(pair)
    try:
        body = samehost.read_private(path, 32)
    except FileNotFoundError:
        return False
    text = body.decode("ascii", "replace").strip()
    if text.isdigit() and pid_alive(int(text)):
        return True
    path.unlink(missing_ok=True)  # its writer died (or it is not a pid): no replica says so now
    return False


def unmark_replica(pair: str) -> None:
    """Remove ``pair``'s replica mark if it holds this process's pid (it stops receiving on the pair)."""
    path = replicas_path(pair)
    try:
        if samehost.read_private(path, 32).decode("ascii", "replace").strip() == str(os.getpid()):
            path.unlink(missing_ok=True)
            samehost.untrack(path)
    except (OSError, samehost.SameHostRefused):
        pass
