"""What ``tune`` writes and how: which ``--out`` it takes, atomic replacement, the partial table beside ``--out``,
one run per ``--out``.

* :func:`output_problem`, :func:`hand_written_problem`: an ``--out`` refused before measuring (its extension, its
  folder, a device or FIFO, a file that is not a tuned policy, another user's symlink).

* :func:`write_atomic`: a temporary file in the same folder, then a rename: never a half-written file
  (:func:`omni_accum.bench._paths.replace_file`, bench's writer too).
* :func:`partial_path`: an unfinished run (stopped by Ctrl-C or ``--budget-s``) keeps its buckets in
  ``t.partial.yaml`` beside ``t.yaml``; ``--out`` itself only ever receives a complete table, so a
  finished file is never replaced by a partial one. ``--resume`` reads the partial file first, and only
  when it is this user's own (:func:`read_resumable`): in a shared folder another user could plant one.
* :class:`OutputLock`: two runs writing one ``--out`` at once would each report "wrote ... (complete)"
  while the file holds one of them; the second is refused instead, naming the first one's pid.
* :func:`settings_mismatches`: the recorded settings (:data:`SETTING_OPTIONS`) in which a file ``--resume`` reads
  differs from this run, named by the option that sets each.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path
from typing import Any

from omni_accum import samehost
from omni_accum.bench._paths import bounded_name, link_target, output_path_problem, replace_file, who
from omni_accum.errors import OmniAccumError
from omni_accum.policy.loader import build_policy, load_policy, parse_text
from omni_accum.policy.model import Policy
from omni_accum.policy.sources import MAX_POLICY_BYTES, probe
from omni_accum.tuner.core import TuneError

PathLike = str | os.PathLike[str]


def partial_path(out: PathLike) -> Path:
    """Where an unfinished run keeps its buckets: beside ``out``, ``t.yaml`` -> ``t.partial.yaml`` (for a name
    within 8 bytes of the longest a file may have, its stem is cut short and ends in a hash of it: ``bounded_name``)."""
    p = Path(out)
    return p.with_name(bounded_name(p.stem, f".partial{p.suffix}"))


def write_atomic(path: PathLike, text: str, *, follow_link: bool = True, own: bool = False) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never a half-written file.

    A symlink is written through (its target is replaced, the link stays: ``--out`` may be the link to a deployed
    table) when this user or root owns it (another user's link is refused, ``PermissionError`` naming it and its
    owner: planted in a shared folder, it would make this user replace a file of theirs elsewhere), or, with
    ``follow_link=False``, replaced itself (the partial file beside ``--out``, tune's own, which nothing deploys: a
    link planted there is never followed); a device, FIFO or socket there is refused (``OSError``), never replaced;
    an existing file keeps its permission bits, owner and group (root updating a service user's table: the service
    must still read it; ``own=True``, the partial file: another user's file is replaced by this user's, never
    group- or world-writable, as ``--resume`` trusts it), a new one gets ``0666 & ~umask`` as with ``open()``. The
    folder must exist (a missing one is an error, never created). An ``OSError`` names ``path``, not the temporary
    file.
    """
    data = text.encode("utf-8")
    replace_file(path, lambda fh: fh.write(data), follow_link=follow_link, own=own)


def resume_source(out: PathLike) -> Path | None:
    """The file ``--resume`` reads: the partial file beside ``out`` when anything is there (a link too, refused by
    :func:`read_resumable`, never passed over for ``out``), else ``out`` when it is a file; or None."""
    part = partial_path(out)
    if os.path.lexists(part):
        return part
    return Path(out) if probe(out, "is_file") else None


def read_resumable(src: Path, out: PathLike) -> Policy:
    """``src`` (:func:`resume_source`) read as a policy, once it is found to be this user's own file.

    Its buckets go into the complete table as they are: one that another user wrote (another owner than this
    process's user, a group- or world-writable file, a symlink: :func:`omni_accum.samehost.open_private`, the
    checks of the same-host files) could plant any cell (a ``prealloc`` of 16 MiB rows). ``out`` itself may be this
    user's (or root's) link to a deployed table, whose target is checked. :class:`TuneError` names the file and
    why; ``PolicyError`` for a file that is no policy. The text parsed is the one read from the checked descriptor.
    """
    where = f"--resume: {src}"
    try:
        path = link_target(src) if src == Path(out) else src  # the partial file is tune's own: never followed
        fd = samehost.open_private(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO is never waited on
    except samehost.SameHostRefused as e:
        raise TuneError(f"--resume: {e}; reused nothing and left it as it is: remove it (or "
                        "give another --out) to measure every bucket, or, for a table you wrote, make it yours alone "
                        "(chown, chmod go-w)") from None  # fmt: skip
    except OSError as e:
        raise TuneError(f"{where}: cannot read it ({e.strerror or e}); left it as it is") from None
    with os.fdopen(fd, "rb") as fh:
        raw = fh.read(MAX_POLICY_BYTES + 1)
    if len(raw) > MAX_POLICY_BYTES:
        raise TuneError(f"{where}: over {MAX_POLICY_BYTES} bytes, larger than any table tune writes; left it as it is")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TuneError(f"{where}: not UTF-8 text, not a policy tune wrote; left it as it is") from None
    return build_policy(parse_text(text, output_format(src), str(src)), str(src), text)


class OutputBusy(OmniAccumError):
    """Another run holds the lock of this output file."""


def lock_path(path: PathLike) -> Path:
    """``.<name>.lock`` beside ``path`` (its name within the limit of a file name however long ``path``'s is)."""
    p = Path(path)
    return p.with_name(bounded_name(f".{p.name}", ".lock"))


class OutputLock:
    """Exclusive, non-blocking ``flock`` locks on ``.<name>.lock`` beside an output file and beside its partial file,
    held for one run: a run on ``t.yaml`` writes ``t.partial.yaml`` too, which a second run given
    ``--out t.partial.yaml`` would write meanwhile and the first would then remove.

    A lock file holds the owner's pid (for the message) and is removed when the run ends; a lock file
    left by a killed run is taken over (``flock`` dies with its process). After locking, the path is
    checked to still name the locked file (another run may have removed and recreated it meanwhile). A symlink at
    a lock's path is refused, never followed; so is another user's symlink at ``out`` (:func:`link_target`).
    """

    def __init__(self, out: PathLike) -> None:
        self.out = Path(out)
        self.paths: list[Path] = []
        self._fds: list[int] = []

    def acquire(self) -> OutputLock:
        part = partial_path(self.out)
        try:
            for path, what in (
                (lock_path(link_target(self.out)), f"{self.out} is being written"),
                (lock_path(Path(os.path.realpath(part.parent)) / part.name), f"{self.out}: its partial file {part} "
                 "is being written"),
            ):  # fmt: skip
                if path not in self.paths:  # --out a link to its own partial file: one lock
                    self._fds.append(self._lock(path, what))
                    self.paths.append(path)
        except BaseException:
            self.release()
            raise
        return self

    def _lock(self, path: Path, what: str) -> int:
        for _ in range(20):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as e:  # ELOOP (O_NOFOLLOW), or EACCES (protected_symlinks) at a link planted there
                try:
                    st = os.lstat(path)
                except OSError:
                    raise e from None
                if not stat.S_ISLNK(st.st_mode):
                    raise
                raise OSError(e.errno, f"{path} is a symlink owned by {who(st.st_uid)}, where tune keeps its lock "
                              "file: refused, never followed (the pid would be written elsewhere); remove it",
                              str(path)) from None  # fmt: skip
            held = False
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    owner = os.read(fd, 32).decode("ascii", "replace").strip() or "?"
                    raise OutputBusy(
                        f"{what} by another omni-accum tune run (pid {owner}; lock {path}): "
                        "wait for it to finish, or give another --out"
                    ) from None
                held = True
                try:
                    same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # a full disk: nothing is left behind
                    return fd
            except BaseException:
                if held:  # ours while locked: removed (no 0-byte lock file left by a failed pid write)
                    self._unlink(path, fd)
                os.close(fd)
                raise
            os.close(fd)  # removed (and maybe recreated) by the run that held it: lock the current file
        raise OutputBusy(f"{self.out}: could not lock {path} (it keeps being replaced)")

    @staticmethod
    def _unlink(path: Path, fd: int) -> None:
        try:
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        except OSError:
            pass

    def release(self) -> None:
        while self._fds:
            fd, path = self._fds.pop(), self.paths.pop()
            self._unlink(path, fd)  # while still locked: a waiting run sees the inode change and retries
            os.close(fd)
        self.paths.clear()

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

    A symlink is checked at its target, and refused when another user than this one (or root) owns it. The folder
    (or the nearest existing one, when folders are to be created) is probed with a temporary file, so a read-only
    or virtual file system is caught up front.
    """
    p = Path(path)
    problem = output_path_problem(p, "--out")
    if problem:
        return problem
    try:
        link_target(p)
    except PermissionError as e:  # another user's link: followed, it could point the table at any file of ours
        return f"--out {path}: {e.strerror}"
    except OSError:
        pass  # a loop of links: the write names it
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


#: Recorded settings compared by ``--resume``, with the option that sets each.
SETTING_OPTIONS = {
    "workload_sha256": "--workload",
    "base_sha256": "--base",
    "wire": "--wire",
    "device": "--device",
    "threads": "--threads",
    "decode_steps": "--decode-steps",
    "max_rounds": "--max-rounds",
    "params_grid": "--quick (params grid)",
    "memory_budget": "--memory-budget",
    "min_gain_us": "--min-gain-us",
}


def settings_mismatches(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Each recorded setting where ``old`` (the file's) differs from ``new`` (this run's), old vs new value."""
    out = []
    for k, option in SETTING_OPTIONS.items():
        was, now = old.get(k), new.get(k)
        if was == now:
            continue
        if k == "workload_sha256":
            was_pair, now_pair = (w.removeprefix("trace ") if (w := str(x.get("workload", ""))).startswith("trace ")
                                  else "" for x in (old, new))  # fmt: skip
            if was_pair and now_pair and was_pair != now_pair:  # tune --trace of another stage pair
                out.append(f"--pair: tuned on stage pair {was_pair} of the capture, now {now_pair}")
            elif now_pair:  # a capture (tune --trace) that grew or changed
                out.append(f"--trace: the capture ({new.get('workload')}) changed since (hash {was}, now {now})")
            elif old.get("workload") != new.get("workload"):
                out.append(f"{option}: tuned on {old.get('workload')!r}, now {new.get('workload')!r}")
            else:
                out.append(f"{option}: the content of {new.get('workload')!r} changed (hash {was}, now {now})")
        elif k == "base_sha256":
            out.append(
                f"{option}: tuned against {old.get('base')!r} (content hash {was}), now {new.get('base')!r} "
                f"(content hash {now})"
            )
        elif k == "params_grid":  # recorded as the grid on: --quick is the grid off
            out.append(f"--quick: tuned {'without' if was else 'with'} it, now {'without' if now else 'with'} it")
        else:
            out.append(f"{option}: tuned with {was!r}, now {now!r}")
    return out
