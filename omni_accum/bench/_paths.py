"""Output paths checked before long runs (``bench --json/--plot``, ``tune --out``)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


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
    socket: :func:`special_file_kind`). The folder must exist (a missing one is an error that names it,
    never created) and be one files can be created in: it is probed with a temporary file, so a
    read-only or virtual file system (``/proc``) is caught up front.
    """
    if path is None:
        return None
    if not str(path).strip():  # Path("") is "." (the current folder): say what was given
        return f"{option} {str(path)!r}: {'an empty' if not str(path) else 'a blank'} path; give a file path"
    p = Path(path)
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
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".probe", dir=folder)
    except OSError as e:
        return f"{option} {p}: cannot create files in {folder}: {e.strerror or e}"
    os.close(fd)
    os.unlink(probe)
    return None
