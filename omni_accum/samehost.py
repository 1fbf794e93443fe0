"""Same-host files in a private place: one directory per user that only that user can enter.

Every file omni-accum creates on a host for its same-host channels (the arena's regions and the pointer
files that name them, the peer hellos and their temporary files) lives in :func:`private_dir`,
``/dev/shm/omni-accum-<euid>/`` (``OMNI_ACCUM_ARENA_DIR`` replaces ``/dev/shm``), created with mode 0700.
Before anything in it is trusted, the directory and each file are checked: :func:`check_dir` and
:func:`open_private` open with ``O_NOFOLLOW`` and ``fstat`` what they opened; a symlink, another owner than
the effective uid, a group- or world-writable mode, or another kind of file raises :class:`SameHostRefused`,
whose message names the path, the owner and the mode. Callers log it once per path (:func:`log_refusal`)
and fall back (the connector sends through its inner connector: nothing is lost).

Files are removed when their process ends without removing them (a SIGTERM runs no ``atexit``) by a small
reaper process per process that creates files here (:func:`track`): multiprocessing's resource tracker only
removes names directly in ``/dev/shm``.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

from omni_accum.errors import OmniAccumError

ENV_DIR = "OMNI_ACCUM_ARENA_DIR"
DEFAULT_BASE = "/dev/shm"
#: The largest file this module reads whole (pointer files, hellos).
SMALL_MAX = 65536

logger = logging.getLogger("omni_accum.samehost")


class SameHostRefused(OmniAccumError):
    """A same-host file or directory that omni-accum does not trust (another owner, a symlink, a writable mode)."""

    def __init__(self, path: str | os.PathLike[str], why: str, st: os.stat_result | None = None) -> None:
        owner = st.st_uid if st is not None else "?"
        mode = oct(stat.S_IMODE(st.st_mode)) if st is not None else "?"
        super().__init__(
            f"{path}: refused ({why}; owner uid {owner}, mode {mode}; omni-accum trusts only what uid "
            f"{os.geteuid()} owns, not group- or world-writable, not a symlink)"
        )
        self.path = str(path)


#: Above Linux's largest pid (2**22): a pid read from shared memory that is not a process.
PID_LIMIT = 1 << 22


def pid_alive(pid: int) -> bool:
    """True when ``pid`` is a running process (a zombie, killed but not yet reaped, counts as dead; so does the id of
    a thread of another process, which ``kill(pid, 0)`` accepts too: a dead owner's small pid is often one after a
    container restart)."""
    if not 0 < pid < PID_LIMIT:  # a pid from a shared header or hello: no process has one out of range
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # no /proc: trust kill(0)
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("State", "?").split()[:1] in (["Z"], ["X"]):
        return False
    tgid = fields.get("Tgid", "").strip()
    return not tgid.isdigit() or int(tgid) == pid


def base_dir() -> Path:
    """``$OMNI_ACCUM_ARENA_DIR``, else ``/dev/shm``."""
    return Path(os.path.abspath(os.environ.get(ENV_DIR) or DEFAULT_BASE))  # the reaper runs from /


#: How often :func:`private_dir` makes its directory again when a reaper removes it empty in between.
_MKDIR_ATTEMPTS = 8


def describe_base() -> str:
    """Where the private directory's base comes from, for messages: ``OMNI_ACCUM_ARENA_DIR='/x'``, or
    ``/dev/shm (OMNI_ACCUM_ARENA_DIR is not set)``."""
    raw = os.environ.get(ENV_DIR)
    return f"{ENV_DIR}={raw!r}" if raw else f"{DEFAULT_BASE} ({ENV_DIR} is not set)"


def _checked_base() -> Path:
    """:func:`base_dir`, checked: a directory of root or this user, not writable by others without the sticky bit."""
    base = base_dir()
    st = os.stat(base)  # the base may be a symlink (/dev/shm -> /run/shm); what it is must be safe
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(base))
    if st.st_uid not in (0, os.geteuid()):  # its owner could move our directory away and plant another
        raise SameHostRefused(base, "a base directory owned by another user (not root, not this user)", st)
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:  # others could move our directory away, ours or not
        raise SameHostRefused(base, "a group- or world-writable directory without the sticky bit", st)
    return base


def private_dir_problem() -> str | None:
    """Why :func:`private_dir` fails here (the message names :func:`describe_base`), or None; creates nothing
    (``omni-accum doctor``). Without it the arena connector has no region and no peer hello is written or read
    over shared memory: every payload then goes vllm-omni's own way."""
    try:
        base = _checked_base()
        d = base / f"omni-accum-{os.geteuid()}"
        if os.path.lexists(d):
            check_dir(d)
        elif not os.access(base, os.W_OK | os.X_OK):
            return f"{describe_base()}: {base} is not writable by this user (uid {os.geteuid()})"
    except SameHostRefused as e:
        return f"{describe_base()}: {e}"
    except OSError as e:
        return f"{describe_base()}: {e.filename or base_dir()}: {e.strerror or e}"
    return None


def private_dir() -> Path:
    """This user's directory under :func:`base_dir` (created 0700 when missing, checked every time; one of this
    user's that others may list or enter, e.g. made 0755 beforehand, is narrowed to 0700: region and hello names
    carry the deployment's token)."""
    base = _checked_base()
    d = base / f"omni-accum-{os.geteuid()}"
    for attempt in range(_MKDIR_ATTEMPTS):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        try:
            check_dir(d, private=True)
            return d
        except FileNotFoundError:
            # another process's reaper removed the directory empty between the mkdir and the check: make it again
            if attempt == _MKDIR_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _check(path: str | os.PathLike[str], st: os.stat_result, kind: str) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise SameHostRefused(path, "a symlink", st)
    if kind == "dir" and not stat.S_ISDIR(st.st_mode):
        raise SameHostRefused(path, "not a directory", st)
    if kind == "file" and not stat.S_ISREG(st.st_mode):
        raise SameHostRefused(path, "not a regular file", st)
    if st.st_uid != os.geteuid():
        raise SameHostRefused(path, "owned by another user", st)
    if st.st_mode & 0o022:
        raise SameHostRefused(path, "group- or world-writable", st)


def _lstat(path: str | os.PathLike[str]) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _refuse_link(path: str | os.PathLike[str], e: OSError) -> None:
    if e.errno in (errno.EACCES, errno.EPERM):  # e.g. a directory another user made under our name, mode 0700
        try:
            st = os.lstat(path)
        except OSError:
            st = None
        raise SameHostRefused(path, "not accessible to this user (permission denied)", st) from None
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        try:
            st = os.lstat(path)
        except OSError:
            st = None
        raise SameHostRefused(path, "a symlink" if st is None or stat.S_ISLNK(st.st_mode) else "not a directory",
                              st) from None


def check_dir(path: str | os.PathLike[str], private: bool = False) -> None:
    """Raise SameHostRefused unless ``path`` is a directory (not a symlink) of this uid, not group/world writable;
    ``private``: then also narrowed to 0700 where group or others may read or enter it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        _refuse_link(path, e)
        raise
    try:
        st = os.fstat(fd)
        _check(path, st, "dir")
        if private and st.st_mode & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def open_private(path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
    """``os.open`` with ``O_NOFOLLOW``, then the checks on what was opened; the fd (the caller closes it).
    Raises SameHostRefused (nothing left open), or the OSError of the open (FileNotFoundError, FileExistsError).

    Opened with ``O_NONBLOCK`` (no effect on a regular file), so that a FIFO left under the name is refused by the
    checks instead of waited on for a writer that never comes (the open would hang its caller for good)."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, mode)
    except FileNotFoundError:
        if not flags & os.O_CREAT or Path(path).parent != private_dir():
            raise
        fd = os.open(path, flags, mode)  # the directory was removed empty: again
    except OSError as e:
        if e.errno == errno.ENXIO:  # O_WRONLY on a FIFO with no reader
            raise SameHostRefused(path, "not a regular file (a FIFO or a socket)", _lstat(path)) from None
        _refuse_link(path, e)
        raise
    try:
        _check(path, os.fstat(fd), "file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_private(path: str | os.PathLike[str], limit: int = SMALL_MAX) -> bytes:
    """The bytes of a small private file (at most ``limit``; a larger file is refused)."""
    fd = open_private(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise SameHostRefused(path, f"{size} bytes, over the limit of {limit}", os.fstat(fd))
        return os.read(fd, limit + 1)[:limit]
    finally:
        os.close(fd)


def write_private(path: Path, body: bytes, tmp_tag: str) -> None:
    """Write ``path`` whole or not at all: a temporary file of an unguessable name (``O_EXCL``), then a rename."""
    import secrets  # noqa: PLC0415

    tmp = path.with_name(f".{path.name}.{tmp_tag}.{secrets.token_hex(8)}.tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_logged: set[str] = set()


def log_refusal(e: SameHostRefused, what: str = "") -> bool:
    """Log ``e`` (a warning) once per path; True the first time."""
    if e.path in _logged:
        return False
    _logged.add(e.path)
    logger.warning("omni-accum same-host channel%s: %s", f" ({what})" if what else "", str(e))
    return True


# ------------------------------------------------------------------------------ removal at process end
_REAPER = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
held, dirs = {}, set()
for line in sys.stdin:
    op, _, rest = line.rstrip("\\n").partition(" ")
    path, _, expect = rest.partition("\\t")
    if op == "+":
        held[path] = expect
        dirs.add(os.path.dirname(path))
    else:
        held.pop(path, None)
for path, expect in held.items():
    try:
        if expect:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO: not waited on
            try:
                same = os.read(fd, 4096).decode(errors="replace") == expect
            finally:
                os.close(fd)
            if not same:
                continue
        os.unlink(path)
    except OSError:
        pass
for d in dirs:  # the private directory, if no other process has a file there now (a creator makes it again)
    try:
        os.rmdir(d)
    except OSError:
        pass
"""
_reaper: list = [None, 0]  # [Popen, pid of the process that started it]
_reaper_lock = threading.Lock()
_inherited: list = []  # reapers of the parent a forked child holds (not waited for, not written to)


def _forget_reaper_in_child() -> None:
    """A forked child (vLLM forks its workers) must not hold its parent's reaper pipe open: the reaper removes the
    parent's files when it reads the end of its input, which would wait for every child too. The child's copy of
    the pipe is pointed at /dev/null; the child starts a reaper of its own at its first tracked file."""
    global _reaper_lock
    p = _reaper[0]
    if p is not None and p.stdin is not None:
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, p.stdin.fileno())
            finally:
                os.close(null)
        except (OSError, ValueError):
            pass
        _inherited.append(p)  # its Popen object is the parent's: never waited for here
    _reaper[:] = [None, 0]
    _reaper_lock = threading.Lock()  # maybe held by another thread of the parent at the fork


os.register_at_fork(after_in_child=_forget_reaper_in_child)


def _send(line: str) -> None:
    with _reaper_lock:
        p, pid = _reaper
        if p is None or pid != os.getpid() or p.poll() is not None:
            # -I: the standard library only (with -c the working directory comes first on sys.path, and a
            # signal.py planted in a shared one would run as the serving user); cwd "/" for the same reason
            p = subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER], stdin=subprocess.PIPE, close_fds=True,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, cwd="/")
            _reaper[:] = [p, os.getpid()]
        try:
            p.stdin.write(line + "\n")
            p.stdin.flush()
        except (OSError, ValueError):
            pass


def track(path: Path, expect: str = "") -> None:
    """Have ``path`` removed when this process ends without :func:`untrack` (if it still holds ``expect``,
    when given: a pointer file another process may have rewritten since)."""
    if "\n" not in str(path) and "\t" not in str(path):
        _send(f"+ {path}\t{expect}")


def untrack(path: Path) -> None:
    if _reaper[0] is not None and _reaper[1] == os.getpid():
        _send(f"- {path}")
