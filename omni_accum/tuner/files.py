"""What ``tune`` writes and how: which ``--out`` it takes, atomic replacement, the partial table beside ``--out``,
one run per ``--out``.

* :func:`output_problem`, :func:`hand_written_problem`: an ``--out`` refused before measuring (its extension, its
  folder, a device or FIFO, a file that is not a tuned policy).

* :func:`write_atomic`: a temporary file in the same folder, then a rename: never a half-written file.
* :func:`partial_path`: an unfinished run (stopped by Ctrl-C or ``--budget-s``) keeps its buckets in
  ``t.partial.yaml`` beside ``t.yaml``; ``--out`` itself only ever receives a complete table, so a
  finished file is never replaced by a partial one. ``--resume`` reads the partial file first.
* :class:`OutputLock`: two runs writing one ``--out`` at once would each report "wrote ... (complete)"
  while the file holds one of them; the second is refused instead, naming the first one's pid.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile
from pathlib import Path

from omni_accum.bench._paths import output_path_problem, special_file_kind
from omni_accum.errors import OmniAccumError
from omni_accum.policy.loader import load_policy
from omni_accum.policy.sources import probe
from omni_accum.tuner.core import TuneError

PathLike = str | os.PathLike[str]


def partial_path(out: PathLike) -> Path:
    """Where an unfinished run keeps its buckets: beside ``out``, ``t.yaml`` -> ``t.partial.yaml``."""
    p = Path(out)
    return p.with_name(f"{p.stem}.partial{p.suffix}")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: PathLike, text: str, *, follow_link: bool = True) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never a half-written file.

    A symlink is written through (its target is replaced, the link stays: ``--out`` may be the link to a deployed
    table), or, with ``follow_link=False``, replaced itself (the partial file beside ``--out``, tune's own, which
    nothing deploys: a link planted there is never followed); a device, FIFO or socket there is
    refused (``OSError``), never replaced; an existing file keeps its
    permission bits, a new one gets ``0666 & ~umask`` as with ``open()``. The folder must exist (a
    missing one is an error, never created). An ``OSError`` names ``path``, not the temporary file.
    """
    path = Path(path)
    target = Path(os.path.realpath(path)) if follow_link else Path(os.path.abspath(path))
    tmp = None
    try:
        if not target.parent.is_dir():
            raise FileNotFoundError(errno.ENOENT, f"no such folder: {target.parent}")
        kind = special_file_kind(target)
        if kind is not None:  # the rename would put a regular file in place of a device, FIFO or socket
            raise OSError(errno.EINVAL, f"is {kind}, not a regular file")
        try:
            mode = stat.S_IMODE(os.stat(target, follow_symlinks=follow_link).st_mode)
            mode = mode if follow_link or not os.path.islink(target) else 0o666 & ~_umask()
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.chmod(tmp, mode)
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if isinstance(e, OSError):
            raise OSError(e.errno, e.strerror or str(e), str(path)) from e
        raise


class OutputBusy(OmniAccumError):
    """Another run holds the lock of this output file."""


class OutputLock:
    """An exclusive, non-blocking ``flock`` on ``.<name>.lock`` beside an output file, held for one run.

    The lock file holds the owner's pid (for the message) and is removed when the run ends; a lock file
    left by a killed run is taken over (``flock`` dies with its process). After locking, the path is
    checked to still name the locked file (another run may have removed and recreated it meanwhile).
    """

    def __init__(self, out: PathLike) -> None:
        target = Path(os.path.realpath(out))
        self.path = target.with_name(f".{target.name}.lock")
        self.out = Path(out)
        self._fd: int | None = None

    def acquire(self) -> OutputLock:
        for _ in range(20):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.read(fd, 32).decode("ascii", "replace").strip() or "?"
                os.close(fd)
                raise OutputBusy(
                    f"{self.out} is being written by another omni-accum tune run (pid {owner}; lock {self.path}): "
                    "wait for it to finish, or give another --out"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self._fd = fd
                return self
            os.close(fd)  # removed (and maybe recreated) by the run that held it: lock the current file
        raise OutputBusy(f"{self.out}: could not lock {self.path} (it keeps being replaced)")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # while still locked: a waiting run sees the inode change and retries
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


OUTPUT_FORMATS = {".yaml": "yaml", ".yml": "yaml", ".json": "json"}
"""Extensions ``tune`` writes, and the format of each (``omni-accum validate`` also reads ``.toml``)."""


def output_format(path: str | os.PathLike[str]) -> str:
    """``"yaml"`` or ``"json"`` from the extension of ``path``; :class:`TuneError` for any other."""
    p = Path(path)
    if str(path) == "-":
        raise TuneError("--out -: stdout is not supported (the table is written after every bucket, and --resume reads "
                        "it back): give a .yaml, .yml or .json file")  # fmt: skip
    fmt = OUTPUT_FORMATS.get(p.suffix.lower())
    if fmt is None:
        what = f"{p.suffix!r} files" if p.suffix else "files without an extension"
        raise TuneError(f"--out {p}: tune writes .yaml, .yml (YAML) or .json (JSON) policy files, not {what}")
    return fmt


def output_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``tune`` cannot write its policy to ``path`` (extension, folder), checked before measuring; or None.

    A symlink is checked at its target. The folder (or the nearest existing one, when folders are to be
    created) is probed with a temporary file, so a read-only or virtual file system is caught up front.
    """
    p = Path(path)
    problem = output_path_problem(p, "--out")
    if problem:
        return problem
    try:
        output_format(p)
    except TuneError as e:
        return str(e)
    part = partial_path(p)  # a link there is replaced, never followed; a directory, FIFO or device is in the way
    if probe(part) and not probe(part, "is_symlink") and not probe(part, "is_file"):  # probe: never an OSError
        kind = "a directory" if probe(part, "is_dir") else "not a regular file"
        return (f"--out {path}: {part} is {kind}; tune keeps a stopped run's buckets there (the partial file beside "
                "--out): move it away, or choose another --out")
    return None


def hand_written_problem(out: str | os.PathLike[str]) -> str | None:
    """Why ``tune`` would not replace ``out``: an existing, non-empty file that is not a tuned policy (a hand-written
    policy, or something else), which the run's first bucket would overwrite; or None. ``--resume`` refuses the same
    files (:func:`.run._resumable`)."""
    p = Path(out)
    try:
        if not p.is_file() or p.stat().st_size == 0:
            return None
        tuned = load_policy(p).tuned is not None
    except OmniAccumError:
        tuned = False
    except OSError:
        return None  # output_problem and the write name what is wrong with it
    if tuned:
        return None
    return (
        f"--out {out}: holds a policy that is not a tuned one (or something else), which this run would replace; "
        "left it untouched: give another --out (its rules can be the base: --base FILE), or remove it first"
    )
