"""Where a capture goes: one JSON-lines file per process, bounded, crash-safe, private.

A :class:`CaptureWriter` appends complete lines to ``DIR/capture-<stage>-<pid>.<n>.jsonl`` with
``os.write`` on an ``O_APPEND`` descriptor, whole lines only: lines (ASCII text) wait in a small buffer (at most
``buffer_bytes``, default 16 KiB, and :data:`FLUSH_AFTER_S` seconds: a system call per record would
cost about half of a record's budget) and go out in one write, and :meth:`CaptureWriter.flush` runs
when a request is released and at exit. A process killed at any point (``kill -9``) leaves every file
readable up to its last complete line (what was still buffered is lost; a write cut by the kill leaves
a cut last line, which the reader reports and skips).
A process writes at most ``max_bytes`` in all: its files rotate at ``max_bytes / keep`` bytes and only
the newest ``keep`` stay (the oldest is removed when a new one opens). A writer only ever writes to and
removes files it made itself (``O_EXCL``): its first file is numbered after the files of its stage and pid
already in ``DIR``, so a restarted process that got the same pid (pid 1 in a container, every time) goes on
after the previous run's files and never appends to them or rotates them away. ``DIR`` is made with mode 0700
when missing; files are made 0600 and never through a symlink (a symlink, or a file that is not this user's
private file, planted under a name of this stage and pid is refused). A capture holds no pickles and nothing
that is evaluated: JSON text only.

``DIR/salt`` (0600, made once by the first writer) salts the request hashes: every process of one
capture hashes a request id the same way, and a hash cannot be looked up against a list of ids from
outside the capture.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import secrets
import stat
import threading
import time
from pathlib import Path

from omni_accum.errors import OmniAccumError

#: Bytes one process writes to a capture at most (over all its rotated files).
DEFAULT_MAX_BYTES = 64 << 20
#: Files one process keeps (the newest ones); each holds at most ``max_bytes / keep`` bytes.
DEFAULT_KEEP = 4
#: Bytes of complete lines buffered before one write (0: a write per record).
DEFAULT_BUFFER_BYTES = 16 << 10
#: Seconds a buffered line waits at most (checked at the next record; a release or exit flushes too).
FLUSH_AFTER_S = 1.0
SALT_FILE = "salt"
FILE_PREFIX = "capture-"
FILE_SUFFIX = ".jsonl"
_FLUSH_AFTER_US = int(FLUSH_AFTER_S * 1_000_000)
_monotonic_ns = time.monotonic_ns
# O_EXCL: a new file every time, never one already there (another run's, or planted: a symlink is not followed)
_OPEN_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_CLOEXEC", 0))


class CaptureError(OmniAccumError):
    """A capture cannot be written (its folder, a file, a setting): the message names it."""


def file_name(stage: str, pid: int, n: int) -> str:
    """``capture-<stage>-<pid>.<n>.jsonl``."""
    return f"{FILE_PREFIX}{stage}-{pid}.{n}{FILE_SUFFIX}"


def file_number(name: str, stage: str, pid: int) -> int | None:
    """``n`` of a file named ``capture-<stage>-<pid>.<n>.jsonl`` (:func:`file_name`), or None for another name."""
    head = f"{FILE_PREFIX}{stage}-{pid}."
    if not (name.startswith(head) and name.endswith(FILE_SUFFIX)):
        return None
    n = name[len(head) : len(name) - len(FILE_SUFFIX)]
    return int(n) if n.isascii() and n.isdigit() else None


def _foreign_link(d: Path) -> str | None:
    """Why a symlink on the way to ``d`` (the folder itself or any folder above it) is refused: one that neither this
    process's user nor root owns (another user could point it at another folder later), or None."""
    p = Path(os.path.abspath(d))
    for prefix in [*reversed(p.parents), p]:
        try:
            st = os.lstat(prefix)
        except OSError:
            return None  # missing from here on (made 0700 by this user)
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, os.geteuid()):
            try:
                name = f" ({pwd.getpwuid(st.st_uid).pw_name})"
            except (KeyError, OverflowError):
                name = ""
            return (f"{prefix} is a symlink owned by uid {st.st_uid}{name}, not by this user nor root: refused, never "
                    "followed (another user could point it at another folder later): remove it, or name another folder")
    return None


def folder_problem(directory: str | os.PathLike[str], what: str = "capture folder") -> str | None:
    """Why ``directory`` cannot hold this user's private files (a capture, status files), or None. An existing
    folder must be a folder of this process's user that no other user may write to (they could plant files, a
    capture's salt among them, or swap them for links), not reached through a symlink another user owns (they could
    point it at another folder later); a missing one, a folder that can be made (mode 0700)."""
    d = Path(directory)
    link = _foreign_link(d)  # planted in a shared folder, swapped later: never followed
    if link is not None:
        return f"{what} {d}: {link}"
    try:
        st = os.stat(d, follow_symlinks=True)
    except FileNotFoundError:
        parent = d.absolute().parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not os.access(parent, os.W_OK | os.X_OK):
            return f"{what} {d}: cannot be made ({parent} is not writable by this user)"
        return None
    except OSError as e:
        return f"{what} {d}: cannot read it ({e.strerror or e})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{what} {d}: not a folder"
    euid = os.geteuid()
    if st.st_uid != euid:
        return f"{what} {d}: belongs to uid {st.st_uid}, not to this process's user (uid {euid})"
    if st.st_mode & 0o022:
        return (
            f"{what} {d}: mode {stat.S_IMODE(st.st_mode):04o} lets other users write to it (files could "
            f"be planted): chmod 700 {d}, or name a new folder (made 0700)"
        )
    if not os.access(d, os.W_OK | os.X_OK):
        return f"{what} {d}: not writable by this user"
    return None


def prepare_dir(directory: str | os.PathLike[str], what: str = "capture folder") -> Path:
    """``directory``, made with mode 0700 when missing (and every folder above it made here); :class:`CaptureError`
    when it is not a folder of this user that only this user may write to (:func:`folder_problem`)."""
    d = Path(directory)
    try:
        missing = [p for p in (d, *d.absolute().parents) if not os.path.lexists(p)]
        for p in reversed(missing):  # every folder made here is 0700 (mkdir's parents would follow the umask)
            with contextlib.suppress(FileExistsError):  # another process made it meanwhile (folder_problem checks)
                os.mkdir(p, 0o700)
    except OSError as e:
        raise CaptureError(f"{what} {d}: cannot make it ({e.strerror or e})") from None
    problem = folder_problem(d, what)
    if problem:
        raise CaptureError(problem)
    return d


def read_salt_if_present(directory: Path) -> str | None:
    """The salt in ``DIR/salt``, or None when the file is not there (never made here)."""
    path = directory / SALT_FILE
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)  # a FIFO: not waited on
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CaptureError(f"capture salt {path}: cannot open it ({e.strerror or e}; a symlink is refused)") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CaptureError(f"capture salt {path}: not a regular file; remove it (the first process makes it again)")
        return os.read(fd, 256).decode("ascii", "replace").strip() or None
    finally:
        os.close(fd)


def read_salt(directory: Path) -> str:
    """The capture's salt (``DIR/salt``), made by the first process that asks (atomically: a link of a
    complete file, so a second process never reads half of one)."""
    path = directory / SALT_FILE
    for _ in range(3):
        text = read_salt_if_present(directory)
        if text:
            return text
        tmp = directory / f".{SALT_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            try:
                os.write(fd, (secrets.token_hex(16) + "\n").encode())
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process made it first: read theirs
        except OSError as e:
            raise CaptureError(f"capture salt {path}: cannot make it ({e.strerror or e})") from None
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    raise CaptureError(f"capture salt {path}: empty")


class CaptureWriter:
    """Complete lines into this process's capture files under ``directory`` (see the module docstring).

    :meth:`write` may be called from several threads (a list append; writes and rotation take a lock). A write
    that fails (disk full, a removed folder) turns the writer off and is reported once through ``on_error``; it
    never raises into the caller's hot path. A file removed while written (the folder's files cleared, the
    folder and its salt kept) is followed by the next one at the next write.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        stage: str,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        keep: int = DEFAULT_KEEP,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        on_error=None,
    ) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 4096:
            raise CaptureError(f"capture max_bytes={max_bytes!r}: give a whole number of bytes >= 4096")
        if not isinstance(keep, int) or keep < 1:
            raise CaptureError(f"capture keep={keep!r}: give a whole number of files >= 1")
        self.directory = prepare_dir(directory)
        self.stage = str(stage)
        self.pid = os.getpid()
        self.max_bytes = max_bytes
        self.keep = keep
        self.file_bytes = max(1024, max_bytes // keep)
        self.on_error = on_error
        self.salt = read_salt(self.directory)
        self.lines = 0
        self.dropped = 0
        self.buffer_bytes = max(0, int(buffer_bytes))
        self._buf: list[bytes] = []
        self._buffered = 0
        self._since = 0  # us: when the oldest buffered line came
        self._lock = threading.Lock()
        self._n = 0
        self._mine: list[int] = []  # numbers of the files this writer made, oldest first: the only ones it removes
        self._fd = -1
        self._size = 0
        self.closed = False
        self._open(self._first_number())

    @property
    def path(self) -> Path:
        """The file being written."""
        return self.directory / file_name(self.stage, self.pid, self._n)

    def _first_number(self) -> int:
        """The number after those of this stage and pid's files already in the folder (0: none): a restarted
        process with the same pid goes on after the previous run's files, which sort before its own. Each one is
        checked by :meth:`_check_taken` (one planted under such a name is refused)."""
        try:
            names = os.listdir(self.directory)
        except OSError as e:
            raise CaptureError(f"capture folder {self.directory}: cannot list it ({e.strerror or e})") from None
        top = -1
        for name in names:
            n = file_number(name, self.stage, self.pid)
            if n is not None:
                self._check_taken(self.directory / name)
                top = max(top, n)
        return top + 1

    def _check_taken(self, path: Path) -> None:
        """A file already at ``path`` (never written here): :class:`CaptureError` unless it is this user's private
        regular file (another run's, or another writer's of this process), which is left as it is."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return  # removed meanwhile: its number is skipped all the same
        except OSError as e:
            raise CaptureError(f"capture file {path}: cannot look at it ({e.strerror or e})") from None
        if stat.S_ISLNK(st.st_mode):
            raise CaptureError(f"capture file {path} is a symlink: refused (never followed)")
        if not stat.S_ISREG(st.st_mode):
            raise CaptureError(f"capture file {path}: not a regular file")
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:  # made by someone else, or for others to read
            raise CaptureError(
                f"capture file {path}: owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}: not this "
                "user's private file (refused)"
            )

    def _open(self, n: int) -> None:
        """Make file ``n`` (or the first free number after it) and write to it from now on; past ``keep`` files
        made here, remove the oldest of them (never a file this writer did not make)."""
        while True:
            path = self.directory / file_name(self.stage, self.pid, n)
            try:
                fd = os.open(path, _OPEN_FLAGS, 0o600)
                break
            except FileExistsError:
                self._check_taken(path)
                n += 1  # another run's file with this pid, or another writer's: left to it
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise CaptureError(f"capture file {path} is a symlink: refused (never followed)") from None
                raise CaptureError(f"capture file {path}: cannot open it ({e.strerror or e})") from None
        old, self._fd, self._n, self._size = self._fd, fd, n, 0
        if old >= 0:
            os.close(old)
        mine = self._mine
        mine.append(n)
        while len(mine) > self.keep:
            try:
                os.unlink(self.directory / file_name(self.stage, self.pid, mine.pop(0)))
            except OSError:
                pass

    def write(self, line: str, now_us: int | None = None) -> None:
        """Append ``line`` (one complete record, ASCII text ending in a newline; it is encoded with the others
        when they go out). It reaches the file at the latest when :data:`FLUSH_AFTER_S` seconds have passed by
        the next record (``now_us``: that record's ``time.monotonic_ns() // 1000``, read here when not given),
        or at :meth:`flush`. After :meth:`close` or a failed write, lines are dropped at the next flush
        (counted in ``dropped``)."""
        buf = self._buf
        buf.append(line)
        size = self._buffered = self._buffered + len(line)
        if size >= self.buffer_bytes:  # also every line when buffer_bytes is 0
            self.flush()
            return
        now = _monotonic_ns() // 1000 if now_us is None else now_us
        if len(buf) == 1:
            self._since = now
        elif now - self._since > _FLUSH_AFTER_US:
            self.flush()

    def flush(self) -> None:
        """Write the buffered lines (whole lines, one ``os.write`` per file they go to)."""
        with self._lock:
            buf = self._buf
            if not buf:
                return
            lines = buf[:]
            del buf[: len(lines)]
            self._buffered = sum(map(len, buf)) if buf else 0  # lines another thread added meanwhile
            if self.closed:
                self.dropped += len(lines)
                return
            data = "".join(lines).encode()
            if self._size + len(data) <= self.file_bytes:  # the usual case: all of it fits in the file
                self._emit(data, len(lines))
                return
            out: list[bytes] = []
            size = 0
            for text in lines:  # a file's last write never crosses its size bound
                line = text.encode()
                if out and self._size + size + len(line) > self.file_bytes:
                    self._emit(b"".join(out), len(out))
                    out, size = [], 0
                out.append(line)
                size += len(line)
            if out:
                self._emit(b"".join(out), len(out))

    def _emit(self, data: bytes, records: int) -> None:
        """One write of whole lines (``records`` of them; under the lock), rotating first when the file would pass
        its bound."""
        if self.closed:
            return
        n = len(data)
        try:
            removed = os.fstat(self._fd).st_nlink == 0
        except OSError:
            removed = False
        if removed and not self._reopen():
            return
        if self._size + n > self.file_bytes and self._size:
            try:
                self._open(self._n + 1)
            except CaptureError as e:
                self._fail(str(e))
                return
        done = 0
        try:
            done = os.write(self._fd, data)
            while done < n:  # a short write (a nearly full disk): the rest, or the error that stops it
                wrote = os.write(self._fd, data[done:])
                if wrote <= 0:
                    raise OSError(errno.EIO, "the disk took none of the rest of the line")
                done += wrote
        except OSError as e:
            # no cut line stays behind (lines go out whole): the file is cut back to the end of its last whole
            # line (the file is this writer's alone, so that is _size plus the whole lines of this write)
            whole = data.rfind(b"\n", 0, done) + 1
            if whole < done:
                try:
                    os.ftruncate(self._fd, self._size + whole)
                except OSError:
                    pass  # left cut: the reader reports the cut last line and uses the rest
            self._size += whole
            self.lines += data.count(b"\n", 0, whole)
            self._fail(
                f"capture file {self.path}: write failed after {done} of {n} bytes ({e.strerror or e}); "
                "capture stopped"
            )
            return
        self._size += n
        self.lines += records  # one per write(), as its caller promised (counting the newlines cost more)

    def _reopen(self) -> bool:
        """The file being written was removed (under the lock): go on in the next file when the capture's folder
        and salt are still there (its files were cleared), else stop and report it (the folder was removed: a
        new salt would hash requests another way than this process's records so far)."""
        path = self.path
        try:
            same = read_salt_if_present(self.directory) == self.salt
        except CaptureError:
            same = False
        if same:
            try:
                self._open(self._n + 1)
                return True
            except CaptureError as e:
                self._fail(str(e))
                return False
        self._fail(
            f"capture file {path} was removed with its folder or salt; capture stopped in pid {self.pid} "
            "(restart the server to capture again)"
        )
        return False

    def _fail(self, message: str) -> None:
        self.closed = True
        self.dropped += 1
        if self.on_error is not None:
            try:
                self.on_error(message)
            except Exception:  # noqa: BLE001 - a report never fails the hot path
                pass

    def close(self) -> None:
        """Write what is buffered and close the file (later writes are dropped)."""
        self.flush()
        with self._lock:
            self.closed = True
            if self._fd >= 0:
                try:
                    os.close(self._fd)
                except OSError:
                    pass
                self._fd = -1

    def files(self) -> list[Path]:
        """This writer's capture files that exist now, oldest first (never another run's of the same pid)."""
        return [p for i in self._mine if (p := self.directory / file_name(self.stage, self.pid, i)).is_file()]
