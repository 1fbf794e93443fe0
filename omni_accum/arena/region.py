"""The shared region of one stage pair: a ``/dev/shm`` file created once by the receiving side.

Layout (every offset a multiple of the page size)::

    header (4 KiB)  64-bit words, one cache line per writer: magic, sizes, pids, heartbeats, ring counters
    page map        one byte per data page: 0 free, else the generation of the sender that allocated it
    ring F          sender -> receiver messages (descriptors)
    ring B          receiver -> sender messages (released slabs)
    data            the slabs of the requests' tensor keys

The file is ``omni_accum_arena_<name>`` in this user's private directory (:mod:`omni_accum.samehost`:
``/dev/shm/omni-accum-<euid>/``, 0700; every open is ``O_NOFOLLOW`` and checked: owner, mode, kind) and
records its owner's pid (the receiver): a new owner reclaims a file whose owner is dead, and refuses one
whose owner lives. The owner unlinks the file when it closes (and at interpreter exit, or by the reaper
process of :func:`omni_accum.samehost.track` when it ends without either); a sender that finds the owner
dead unlinks it too.
"""

from __future__ import annotations

import atexit
import errno
import logging
import mmap
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from omni_accum import samehost
from omni_accum.samehost import PID_LIMIT, pid_alive  # noqa: F401 - re-exported (a same-host helper)
from omni_accum.arena.ring import Ring
from omni_accum.errors import InvalidArgumentError, OmniAccumError

logger = logging.getLogger("omni_accum.arena")

PREFIX = "omni_accum_arena_"
#: A stage pair's replica mark (:mod:`.live`): the pid of a second live receiving process of the pair, not a region.
REPLICAS_SUFFIX = ".replicas"
MAGIC = int.from_bytes(b"OAARENA1", "little")
VERSION = 1
HEADER = 4096

# header word indices (8 bytes each); writers kept on separate 64-byte lines
W_MAGIC, W_VERSION, W_PAGE, W_NPAGES, W_RING_F, W_RING_B, W_DATA_OFF, W_READY = range(8)
W_OWNER_PID, W_OWNER_BEAT, W_OWNER_CLOSED = 8, 9, 10
W_SENDER_PID, W_SENDER_BEAT, W_SENDER_GEN, W_SENDER_CLOSED = 16, 17, 18, 19
W_F_TAIL, W_F_HEAD, W_B_TAIL, W_B_HEAD = 24, 32, 40, 48


class ArenaError(OmniAccumError):
    """An arena could not be created, attached or used."""


class ArenaFull(ArenaError):
    """The arena has no room for a slab now: nothing was written; send this request the ordinary way."""


class PeerDied(ArenaError):
    """The other process of the pair is gone; the requests it had in flight (``requests``) are failed."""

    def __init__(self, message: str, requests: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.requests = list(requests)


def path_for(name: str) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,200}", name):
        raise ArenaError(f"arena name {name!r}: use letters, digits, '_', '.', '-'")
    return samehost.private_dir() / f"{PREFIX}{name}"


def _page_ok(page: int) -> bool:
    return 4096 <= page <= 1 << 30 and not page & (page - 1)


@dataclass(frozen=True)
class Layout:
    page: int
    npages: int
    ring_f: int
    ring_b: int

    @property
    def map_off(self) -> int:
        return HEADER

    @property
    def ring_f_off(self) -> int:
        return _round(HEADER + self.npages, self.page)

    @property
    def ring_b_off(self) -> int:
        return self.ring_f_off + self.ring_f

    @property
    def data_off(self) -> int:
        return _round(self.ring_b_off + self.ring_b, self.page)

    @property
    def size(self) -> int:
        return self.data_off + self.npages * self.page


def _round(n: int, to: int) -> int:
    return (n + to - 1) // to * to


#: madvise(2) advice (Linux 5.14+; Python 3.11's mmap module does not name it).
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class Region:
    """A mapping of an arena file; :meth:`create` (the receiver) or :meth:`attach` (the sender)."""

    def __init__(self, path: Path, mm: mmap.mmap, layout: Layout, owner: bool, fd: int = -1) -> None:
        self.path = path
        self.mm = mm
        self.fd = fd  # the file, kept open to reserve tmpfs pages before they are first written (:meth:`prefault`)
        self.layout = layout
        self.owner = owner
        self._pid = os.getpid()  # a forked child inherits this object (and its atexit close): see _close_locked
        self.closed = False  # this side (its mmap stays open while tensors over it live: they keep the pages mapped)
        self.q = memoryview(mm)[:HEADER].cast("Q")
        self.pages = memoryview(mm)[layout.map_off : layout.map_off + layout.npages]
        self.ring_f = Ring(memoryview(mm)[layout.ring_f_off : layout.ring_b_off], self.q, W_F_TAIL, W_F_HEAD)
        self.ring_b = Ring(
            memoryview(mm)[layout.ring_b_off : layout.ring_b_off + layout.ring_b], self.q, W_B_TAIL, W_B_HEAD
        )
        self.data_off = layout.data_off
        self._unlinked = False
        self.pointer: Path | None = None  # the pointer file naming this region (omni_accum.arena.live), if any
        self._warm: bytearray | None = bytearray(layout.npages)  # data pages this process has prefaulted
        self._populate = True  # MADV_POPULATE_WRITE works here (Linux 5.14+)
        #: held by :meth:`warm` per step and by :meth:`close` (never reserve through a closed descriptor)
        self._warm_lock = threading.RLock()  # re-entrant: a close() reached from within close() never deadlocks
        self._warm_thread: threading.Thread | None = None
        #: what the last :meth:`warm` did: ``{"bytes": warmed, "seconds": s, "stopped": None | why}``
        self.warmed: dict[str, object] | None = None

    # ------------------------------------------------------------------ creation and attachment
    @classmethod
    def create(
        cls, name: str, data_bytes: int, *, page: int = 4096, ring_bytes: int = 1 << 20, back_bytes: int = 256 << 10
    ) -> Region:
        """Create the region (reclaiming a stale one whose owner is dead)."""
        path = path_for(name)
        if type(data_bytes) is not int or data_bytes < 1:  # 0 or -1 made a one-page arena: every send ArenaFull
            raise InvalidArgumentError(f"arena {path}: data_bytes must be an int >= 1 (bytes of slab space), got "
                                       f"{data_bytes!r}")  # fmt: skip
        if not _page_ok(page):  # a sender refuses such a header: no region no one can attach to
            raise ValueError(f"arena {path}: page size {page} is not a power of two >= 4096")
        npages = max(1, _round(data_bytes, page) // page)
        layout = Layout(page, npages, _round(ring_bytes, page), _round(back_bytes, page))
        if os.path.lexists(path):
            owner = owner_of(path)  # SameHostRefused: not this user's file (never read nor reclaimed)
            if owner is not None and owner != os.getpid() and pid_alive(owner):
                raise ArenaError(f"arena {path} is in use by pid {owner} (close it there first)")
            path.unlink(missing_ok=True)  # stale: its owner is dead
        fd = samehost.open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)  # FileExistsError: name taken
        try:
            os.ftruncate(fd, layout.size)  # tmpfs allocates the data pages on first use (prefault)
            # header, page map and rings are written in place by both sides: reserved now, so that a full
            # file system fails here (ENOSPC: the connector receives through its inner connector) and never
            # as a SIGBUS on a first write into a page tmpfs cannot give
            _reserve(fd, 0, layout.data_off, path, f"its header, page map and rings: {layout.ring_f} ring bytes "
                     f"(ring_bytes) and a byte per page of {npages * page} data bytes (arena_bytes)")
            mm = mmap.mmap(fd, layout.size)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        r = cls(path, mm, layout, owner=True, fd=fd)
        q = r.q
        q[W_MAGIC], q[W_VERSION], q[W_PAGE], q[W_NPAGES] = MAGIC, VERSION, page, npages
        q[W_RING_F], q[W_RING_B], q[W_DATA_OFF] = layout.ring_f, layout.ring_b, layout.data_off
        q[W_OWNER_PID] = os.getpid()
        q[W_READY] = 1  # written last: an attaching sender waits for it
        atexit.register(r.close)
        _track(path)
        return r

    @classmethod
    def attach(cls, name: str) -> Region:
        """Map an existing region (the sender's side)."""
        path = path_for(name)
        try:
            fd = samehost.open_private(path, os.O_RDWR)  # SameHostRefused: not this user's (never mapped)
        except FileNotFoundError as e:
            raise ArenaError(f"no arena {path}: the receiving stage creates it") from e
        try:
            size = os.fstat(fd).st_size
            if size < HEADER:
                raise ArenaError(f"arena {path} is not initialised yet")
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        q = memoryview(mm)[:HEADER].cast("Q")
        try:
            if q[W_MAGIC] != MAGIC or q[W_VERSION] != VERSION or not q[W_READY]:
                raise ArenaError(f"arena {path} is not an omni-accum arena of version {VERSION} (or not ready)")
            layout = Layout(q[W_PAGE], q[W_NPAGES], q[W_RING_F], q[W_RING_B])
            if not _page_ok(layout.page):
                raise ArenaError(f"arena {path}: page size {layout.page} in its header is not a power of two >= 4096")
        except BaseException:
            os.close(fd)
            raise
        finally:
            q.release()
        if layout.size != size:
            mm.close()
            os.close(fd)
            raise ArenaError(f"arena {path}: size {size} does not match its header ({layout.size})")
        return cls(path, mm, layout, owner=False, fd=fd)

    # ------------------------------------------------------------------ page tables
    def prefault(self, page: int, n: int) -> None:
        """Map data pages ``page .. page + n`` writable into this process's page tables now, the first
        time this process uses them (the sender, which writes rows into them). tmpfs gives a page on its
        first touch; without this, each decode row that starts a new page costs its writer a page fault
        (several us on a VM) in the step. Pages stay resident once touched (freed slabs are reused, not
        punched), so this runs once per page and process. The contents are untouched
        (``MADV_POPULATE_WRITE``, Linux 5.14); on a kernel without it, the pages fault in as they are written.

        First the pages are reserved in the file (``fallocate``): a file system with no room for them (a full
        ``/dev/shm``) raises :class:`ArenaFull` here (the caller frees the slab; the connector's put falls
        back) instead of a SIGBUS when the sender writes into a page tmpfs cannot give."""
        warm = self._warm
        if warm is None or warm.find(0, page, page + n) < 0:
            return
        ps = mmap.PAGESIZE
        start = self.data_off + page * self.layout.page
        end = start + n * self.layout.page
        start -= start % ps
        if self.fd >= 0:
            try:
                _reserve(self.fd, start, end - start, self.path)
            except OSError as e:
                raise ArenaFull(str(e)) from None
        if self._populate:
            try:
                self.mm.madvise(_POPULATE_WRITE, start, end - start)
            except (OSError, ValueError):  # an older kernel: the pages fault in as they are touched
                self._populate = False
        warm[page : page + n] = b"\1" * n

    def warm(self, nbytes: int, *, background: bool = True, step_bytes: int = 32 << 20) -> threading.Thread | None:
        """Reserve and map the first ``nbytes`` of the data area now (all of it when ``nbytes`` is larger), so
        that the first requests' slabs (allocated first fit, from the lowest pages) find their pages given
        and mapped instead of paying tmpfs's page allocation and this process's page faults inside a hand-off
        (~0.4 s for an 8k-token prefill's 66 MB on a 2-core VM). :meth:`prefault` in ``step_bytes`` steps, in a
        daemon thread unless ``background`` is false (each step releases the GIL in its system calls, and the
        lock is taken per step, so puts and :meth:`close` wait at most one step). Stops at the first step the
        file system has no room for (a full ``/dev/shm``: the rest is reserved as slabs are allocated, or
        falls back as before) or when the region closes. The cost: ``nbytes`` of ``/dev/shm`` held from now
        on instead of as requests first need them. Returns the thread (None when run in place or nothing to
        do); :attr:`warmed` says what was done."""
        page = self.layout.page
        n_all = min(self.layout.npages, max(0, int(nbytes)) // page)
        if n_all <= 0 or self._warm is None:
            return None
        per = max(1, int(step_bytes) // page)

        def run() -> None:
            t0 = time.monotonic()
            done, stopped = 0, None
            for first in range(0, n_all, per):
                n = min(per, n_all - first)
                with self._warm_lock:
                    if self.closed or self.fd < 0:
                        stopped = "closed"
                        break
                    try:
                        self.prefault(first, n)
                    except ArenaFull as e:
                        stopped = f"no room: {e} (arena_warm)"
                        break
                    except (OSError, ValueError) as e:  # the mapping went away under us
                        stopped = f"{type(e).__name__}: {e}"
                        break
                done += n
            self.warmed = {"bytes": done * page, "seconds": time.monotonic() - t0, "stopped": stopped}
            logger.info("omni-accum arena %s: warmed %d of %d bytes in %.3f s (pid=%d)%s", self.path.name,
                        done * page, n_all * page, self.warmed["seconds"], os.getpid(),
                        "" if stopped is None else f"; stopped: {stopped}")

        if not background:
            run()
            return None
        t = threading.Thread(target=run, name=f"omni-accum-arena-warm-{self.path.name}", daemon=True)
        self._warm_thread = t
        t.start()
        return t

    # ------------------------------------------------------------------ liveness
    def peer_pid(self) -> int:
        return int(self.q[W_SENDER_PID] if self.owner else self.q[W_OWNER_PID])

    def peer_alive(self) -> bool:
        pid = self.peer_pid()
        return pid == 0 or pid_alive(pid)

    def beat(self) -> None:
        i = W_OWNER_BEAT if self.owner else W_SENDER_BEAT
        self.q[i] = self.q[i] + 1

    # ------------------------------------------------------------------ teardown
    def unlink(self) -> None:
        if not self._unlinked:
            self._unlinked = True
            try:
                if owner_of(self.path) in (self.q[W_OWNER_PID], None):
                    self.path.unlink(missing_ok=True)
                    if self.pointer is not None:
                        drop_pointer(self.pointer, self.path.name[len(PREFIX) :])
            except (OSError, samehost.SameHostRefused):
                pass

    def close(self) -> None:
        """Mark this side closed; the owner also unlinks the file. Views still held keep the mapping alive."""
        if self.closed:
            return
        if os.getpid() != self._pid:  # a forked child's copy (its exit runs the owner's atexit close): unmap only (the
            return self._unmap()  # region stays its creator's); before the lock, which a thread not forked may hold
        with self._warm_lock:  # a warm step in flight ends first; the next one sees the region closed
            self._close_locked()

    def _close_locked(self) -> None:
        if self.closed:
            return
        try:
            if self.owner:
                self.q[W_OWNER_CLOSED] = 1
            elif self.q[W_SENDER_PID] == os.getpid():  # only the attached sender's own slot (a process that
                self.q[W_SENDER_CLOSED] = 1  # could not attach leaves another sender's, live or dead, alone)
                self.q[W_SENDER_PID] = 0
        except (ValueError, TypeError):
            pass
        if self.owner:
            self.unlink()
            atexit.unregister(self.close)
            _untrack(self.path)
        self._unmap()

    def _unmap(self) -> None:
        self.closed = True
        for mv in (self.pages, self.q):
            mv.release()
        for ring in (self.ring_f, self.ring_b):
            ring._buf.release()
        try:
            self.mm.close()
        except BufferError:
            pass  # tensors over the mapping are still alive: it is unmapped when they are freed
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _reserve(fd: int, offset: int, length: int, path: Path, what: str = "") -> None:
    """Give bytes ``offset .. offset + length`` of the file their pages now. Raises OSError (ENOSPC, its message
    naming the file, the directory and ``what`` they are, with the setting that sized them) when the file system has
    no room for them; a file system that cannot reserve (no ``fallocate``) is left to give pages as they are written."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
            said = f" ({what})" if what else ""
            raise OSError(
                e.errno,
                f"arena {path.name}: no room for {length} bytes{said} in {path.parent} ({os.strerror(e.errno)}: the "
                f"file system is full; free space there or make it larger)",
            ) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


def _track(path: Path) -> None:
    """Have the region removed if its owner ends without closing it (a SIGTERM runs no ``atexit``: vllm-omni's
    stage processes end that way, so do daemon processes): :func:`omni_accum.samehost.track`."""
    try:
        samehost.track(path)
    except OSError:  # no reaper here: the next owner or sweep_stale() removes it
        pass


def _untrack(path: Path) -> None:
    try:
        samehost.untrack(path)
    except OSError:
        pass


def drop_pointer(ptr: Path, name: str) -> None:
    """Remove pointer file ``ptr`` if it still names region ``name`` (a newer receiver may have rewritten it)."""
    try:
        body = samehost.read_private(ptr, 512)
    except (OSError, samehost.SameHostRefused):
        return
    if body == name.encode():
        ptr.unlink(missing_ok=True)
        samehost.untrack(ptr)


def owner_of(path: Path) -> int | None:
    """The owner pid a region's header records; None when unreadable. Raises SameHostRefused for a file that
    is not this user's (or a symlink): it is never read."""
    try:
        fd = samehost.open_private(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        head = os.pread(fd, 8 * (W_OWNER_PID + 1), 0)
    finally:
        os.close(fd)
    if len(head) < 8 * (W_OWNER_PID + 1):
        return None
    return int.from_bytes(head[8 * W_OWNER_PID : 8 * W_OWNER_PID + 8], "little")


def sweep_stale(directory: Path | None = None) -> list[Path]:
    """Remove every arena file of ``directory`` (default: this user's private directory) whose owner is dead, every
    pointer file (:mod:`.live`) whose region is gone or has a dead owner, and every replica mark whose pid is dead;
    the removed paths. A file that is not this user's is left alone (and logged once)."""
    removed = []
    directory = directory or samehost.private_dir()
    files = sorted(directory.glob(PREFIX + "*"))
    for p in [f for f in files if not f.name.endswith(".live")] + [f for f in files if f.name.endswith(".live")]:
        try:
            if p.name.endswith(".live"):  # a pointer, after the regions: one whose region was just removed goes too
                name = samehost.read_private(p, 512).decode("ascii", "replace")
                region = directory / f"{PREFIX}{name}"
                owner = owner_of(region) if re.fullmatch(r"[A-Za-z0-9_.-]{1,200}", name) else None
            elif p.name.endswith(REPLICAS_SUFFIX):  # a mark holds a pid, not a region's header (was swept as one)
                text = samehost.read_private(p, 32).decode("ascii", "replace").strip()
                owner = int(text) if text.isdigit() else None
            else:
                owner = owner_of(p)
        except samehost.SameHostRefused as e:
            samehost.log_refusal(e, "sweep_stale")
            continue
        except OSError:
            continue  # gone meanwhile
        if owner is None or not pid_alive(owner):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed
