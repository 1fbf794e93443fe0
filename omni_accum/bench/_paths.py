"""Output paths checked before long runs (``bench --json/--plot``, ``tune --out``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def output_path_problem(path: str | os.PathLike[str] | None, option: str) -> str | None:
    """Why ``path`` cannot be written as the output of ``option`` (checked before long runs), or None.

    A symlink is checked at its target. The folder must exist (a missing one is an error that names it,
    never created) and be one files can be created in: it is probed with a temporary file, so a
    read-only or virtual file system (``/proc``) is caught up front.
    """
    if path is None:
        return None
    p = Path(path)
    target = Path(os.path.realpath(p))
    if target.is_dir():
        return f"{option} {p}: is a directory; give a file path"
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
