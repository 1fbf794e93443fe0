"""Output paths checked before long runs (``bench --json/--plot``, ``tune --out``), and the one atomic writer behind
every output (:func:`replace_file`)."""

from __future__ import annotations

import errno
import grp
import hashlib
import os
import pwd
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def special_file_kind(path: str | os.PathLike[str]) -> str | None:
    """What an existing ``path`` is when it is neither a regular file nor a directory (``a character device``,
    ``a FIFO`` ...), or None. Outputs are written through a temporary file and a rename, which would put a
    regular file in its place (``--json /dev/null`` run as root would replace ``/dev/null``)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    for test, kind in (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return None


def output_path_problem(path: str | os.PathLike[str] | None, option: str) -> str | None:
    """Why ``path`` cannot be written as the output of ``option`` (checked before long runs), or None.

    A symlink is checked at its target. An existing target must be a regular file (not a device, a FIFO or a
    socket: :func:`special_file_kind`); a file name over :data:`NAME_MAX` bytes is named as such. The folder must
    exist (a missing one is an error that names it, never created) and be one files can be created in: it is
    probed with a temporary file, so a read-only or virtual file system (``/proc``) is caught up front.
    """
    if path is None:
        return None
    if not str(path).strip():  # Path("") is "." (the current folder): say what was given
        return f"{option} {str(path)!r}: {'an empty' if not str(path) else 'a blank'} path; give a file path"
    p = Path(path)
    too_long = name_too_long(p, option)
    if too_long:
        return too_long
    target = Path(os.path.realpath(p))
    if target.is_dir():
        return f"{option} {p}: is a directory; give a file path"
    kind = special_file_kind(target)
    if kind is not None:
        return f"{option} {p}: is {kind}, not a regular file; give a file path (the output replaces what is there)"
    folder = target.parent
    if not folder.exists():
        return f"{option} {p}: no such folder: {folder} (create it first)"
    if not folder.is_dir():
        return f"{option} {p}: {folder} is not a folder"
    try:
        fd, probe = temp_file(folder, target.name, ".probe")
    except OSError as e:
        return f"{option} {p}: cannot create files in {folder}: {e.strerror or e}"
    os.close(fd)
    os.unlink(probe)
    return None


#: The first bytes of image formats ``bench --plot`` writes, by extension (those checked; matplotlib's other
#: formats, such as ``.raw`` or ``.pgf``, are replaced unchecked).
_IMAGE_MAGIC = {
    ".png": (b"\x89PNG",), ".pdf": (b"%PDF",), ".svg": (b"<?xml", b"<svg"), ".svgz": (b"\x1f\x8b",),
    ".eps": (b"%!PS",), ".ps": (b"%!PS",), ".jpg": (b"\xff\xd8\xff",), ".jpeg": (b"\xff\xd8\xff",),
    ".tif": (b"II*\x00", b"MM\x00*"), ".tiff": (b"II*\x00", b"MM\x00*"), ".webp": (b"RIFF",), ".gif": (b"GIF8",),
}  # fmt: skip


def not_an_output_problem(path: str | os.PathLike[str], option: str) -> str | None:
    """Why ``bench --json``/``--plot`` must not replace the file at ``path``: a non-empty regular file that is no
    earlier output of that option (``--json``: a JSON document with bench's ``wire`` and ``results`` or
    ``buckets``; ``--plot``: an image of the extension's format, where the format has a signature), such as a
    tuned policy or notes given by mistake. None for a new or empty file, and for a symlink (the output replaces
    the link, never the file it points at)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        return None
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16) if option == "--plot" or st.st_size > 256 << 20 else f.read()
    except OSError as e:
        return f"{option} {path}: exists and cannot be read to see what it is ({e.strerror or e}); give another path"
    if option == "--plot":
        magic = _IMAGE_MAGIC.get(Path(path).suffix.lower())
        if magic is None or head.lstrip().startswith(magic):
            return None
        what = f"a {Path(path).suffix.lower()[1:].upper()} image"
    else:
        if st.st_size > 256 << 20:  # too large to read whole: its start, as bench writes it
            ok = head.lstrip().startswith(b"{") and b'"wire":' in head
        else:
            import json

            try:
                doc = json.loads(head)
            except (ValueError, RecursionError):  # (nested past the parser's depth: no bench result either)
                doc = None
            ok = isinstance(doc, dict) and "wire" in doc and ("results" in doc or "buckets" in doc)
        if ok:
            return None
        what = "a bench result (a JSON document with wire and results or buckets)"
    return (f"{option} {path}: exists and is not {what}: left untouched, as writing would replace it; give another "
            "path, or remove the file first")


#: The longest file name, in bytes, on Linux's file systems (ext4, xfs, btrfs, tmpfs): an output's name may be this
#: long, so the names of the helper files beside it (temporary files, probes, locks, tune's partial file) are kept
#: within it (:func:`bounded_name`).
NAME_MAX = 255

#: The random part ``tempfile.mkstemp`` puts between its prefix and suffix.
_RANDOM_CHARS = 8


def bounded_name(head: str, tail: str, room: int = 0) -> str:
    """``head + tail`` when it fits in :data:`NAME_MAX` bytes with ``room`` bytes to spare; else ``head`` cut short,
    then ``~`` and a hash of the whole ``head``, then ``tail``: still one name per output (its lock must be), and a
    name that the output itself can have never makes a helper name the file system refuses."""
    if len(os.fsencode(head + tail)) + room <= NAME_MAX:
        return head + tail
    mark = "~" + hashlib.sha256(os.fsencode(head)).hexdigest()[:16]
    short = head[: NAME_MAX - room - len(os.fsencode(mark + tail))]
    while short and len(os.fsencode(short + mark + tail)) + room > NAME_MAX:  # multi-byte characters
        short = short[:-1]
    return short + mark + tail


def temp_file(folder: str | os.PathLike[str], name: str, suffix: str) -> tuple[int, str]:
    """``tempfile.mkstemp`` of a ``.<name>.XXXXXXXX<suffix>`` in ``folder`` (``O_EXCL``, mode 0600), its name
    within :data:`NAME_MAX` bytes however long ``name`` is."""
    prefix = bounded_name(f".{name}.", "", room=_RANDOM_CHARS + len(suffix))
    return tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=folder)


def name_too_long(path: str | os.PathLike[str], option: str) -> str | None:
    """Why the file name of ``path`` is one no file can have (over :data:`NAME_MAX` bytes), or None."""
    n = len(os.fsencode(Path(path).name))
    if n <= NAME_MAX:
        return None
    return (f"{option} {path}: its file name is {n} bytes long, over the {NAME_MAX} a file name may have: "
            "give a shorter one")


def who(uid: int) -> str:
    """``uid 65534 (nobody)``: a user for messages (the name when the system knows it)."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, OverflowError):
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return f"gid {gid} ({grp.getgrgid(gid).gr_name})"
    except (KeyError, OverflowError):
        return f"gid {gid}"


def foreign_link_problem(link: str | os.PathLike[str], uid: int) -> str:
    """The refusal of a symlink at an output's path that another user than this process's (nor root) owns."""
    return (
        f"{link} is a symlink owned by {who(uid)}, not by this user ({who(os.geteuid())}) nor root: refused, never "
        "followed (another user's link could point the write at any file this user may write): remove it, or give "
        "another path"
    )


def link_target(path: str | os.PathLike[str]) -> Path:
    """Where ``path`` leads, its symlinks followed one by one (``os.path.realpath`` follows any): ``PermissionError``
    (naming the link and its owner) at a link that neither this process's user nor root owns, which another user
    could have planted in a shared folder (``/tmp``) to make this user replace a file of theirs elsewhere; the
    user's own link (``--out`` to a deployed table) is followed."""
    p = os.path.abspath(path)
    for _ in range(40):  # as the kernel's limit on links in a row (ELOOP)
        try:
            st = os.lstat(p)
        except OSError:  # nothing there (yet): where it would be
            break
        if not stat.S_ISLNK(st.st_mode):
            break
        if st.st_uid not in (0, os.geteuid()):
            raise PermissionError(errno.EPERM, foreign_link_problem(p, st.st_uid), p)
        p = os.path.join(os.path.realpath(os.path.dirname(p)), os.readlink(p))  # relative to the link's folder
    else:
        raise OSError(errno.ELOOP, f"too many levels of symbolic links from {path}", str(path))
    return Path(os.path.realpath(p))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _keep_owner(fd: int, path: Path, was: os.stat_result) -> None:
    """Give the temporary file ``fd`` the owner and group of the file it replaces (as root over a service user's
    table: the service must still read it); a warning naming what is lost where this user may not give them."""
    if (os.fstat(fd).st_uid, os.fstat(fd).st_gid) == (was.st_uid, was.st_gid):
        return
    for uid in (was.st_uid, -1):  # only root gives files away; a user may still give a group it is in
        try:
            os.fchown(fd, uid, was.st_gid)
            break
        except OSError:
            pass
    now = os.fstat(fd)
    lost = [who(was.st_uid)] * (now.st_uid != was.st_uid) + [_group(was.st_gid)] * (now.st_gid != was.st_gid)
    if not lost:
        return
    print(f"omni-accum: warning: {path}: was owned by {' and '.join(lost)}, which this user ({who(os.geteuid())}) "
          "cannot give back: the new file is this user's (chown it if another user must read or write it)",
          file=sys.stderr)  # fmt: skip


def _planted(target: Path, was: os.stat_result) -> bool:
    """Whether ``target`` (``was``: its stat) is another user's file (not root's) that every user may write, or that
    sits in a folder every user may write to (``/tmp``): a file another user could have made there first. (A service
    user's group-writable table in its own folder is not: umask 002 makes such files.)"""
    if was.st_uid in (0, os.geteuid()):
        return False
    try:
        folder = os.stat(target.parent).st_mode
    except OSError:
        return True
    return bool(was.st_mode & 0o002 or folder & 0o002)


def replace_file(
    path: str | os.PathLike[str],
    write: Callable[[BinaryIO], object],
    *,
    follow_link: bool = False,
    own: bool = False,
) -> None:
    """Write ``path`` atomically: ``write`` fills a random temporary file in the same folder (``O_EXCL``), which is
    renamed onto ``path``: never a half-written file (a full disk leaves the old one whole), never a file written
    through a link planted there.

    A symlink at ``path`` is replaced itself (``follow_link=False``: bench's outputs, tune's partial file), or
    followed to its target when this user or root owns it (``follow_link=True``: ``tune --out`` may be the link to a
    deployed table; :func:`link_target` refuses another user's link). A device, FIFO or socket there is refused, never
    replaced. An existing file keeps its permission bits, owner and group (but another user's that every user may
    write, or in a folder every user may write to: a new file of this user, not group- or world-writable, with a
    warning); a new one gets ``0666 & ~umask`` as with ``open()``. ``own=True`` (tune's partial file, which
    ``--resume`` trusts only as this user's alone): another
    user's file there is replaced by this user's, with a new file's mode, and the file is never group- or
    world-writable. The folder must exist (never created). An ``OSError`` names ``path``, not the temporary file.
    """
    path = Path(path)
    tmp = None
    try:
        target = link_target(path) if follow_link else Path(os.path.abspath(path))
        if not target.parent.is_dir():
            raise FileNotFoundError(errno.ENOENT, f"no such folder: {target.parent}")
        kind = special_file_kind(target)
        if kind is not None:  # the rename would put a regular file in place of a device, FIFO or socket
            raise OSError(errno.EINVAL, f"is {kind}, not a regular file")
        try:
            was: os.stat_result | None = os.stat(target, follow_symlinks=False)
        except FileNotFoundError:
            was = None
        if was is not None and (not stat.S_ISREG(was.st_mode) or own and was.st_uid != os.geteuid()):
            was = None  # a link replaced, or another user's file taken over: a new file of this user
        planted = was is not None and _planted(target, was)
        if planted:  # another user's file others may write, or in a folder others may write: not given back to them
            print(f"omni-accum: warning: {path}: was owned by {who(was.st_uid)} and "
                  + ("writable by every user" if was.st_mode & 0o002 else "in a folder every user may write to")
                  + f": the new file is this user's ({who(os.geteuid())}), not group- or world-writable (another "
                  "user could have made it there first to get what this user writes)", file=sys.stderr)  # fmt: skip
            was = None
        mode = stat.S_IMODE(was.st_mode) if was is not None else 0o666 & ~_umask()
        if own or planted:  # --resume refuses a partial file others may write: never make one
            mode &= ~0o022
        fd, tmp = temp_file(target.parent, target.name, ".tmp")
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            if was is not None:
                _keep_owner(fh.fileno(), path, was)
            os.fchmod(fh.fileno(), mode)  # after the chown, which may clear bits
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
