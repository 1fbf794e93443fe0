"""Inputs against outputs: no command writes over a file it reads in the same run.

A path is compared by what it names, not how it is spelled (relative, absolute, ``..``, a symlink):
:func:`os.path.samefile` when both exist, else the resolved paths. ``tune`` checks ``--out`` against
its workload and ``--base`` files (bench's own check in ``cli/bench.py`` follows the same rule).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from omni_accum.policy.sources import probe

PathLike = str | os.PathLike[str]


def same_file(a: PathLike, b: PathLike) -> bool:
    """True when ``a`` and ``b`` name one file (symlinks followed), however each is spelled."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet): compare where they would be
        return os.path.realpath(a) == os.path.realpath(b)


def input_file(source: object) -> Path | None:
    """``source`` as a path when it names an existing file (a preset name or a mapping gives None)."""
    if isinstance(source, (str, os.PathLike)) and str(source) and probe(source, "is_file"):  # policy text: no file
        return Path(source)
    return None


def overwrite_problem(
    outputs: Iterable[tuple[str, PathLike | None]], inputs: Iterable[tuple[str, object]]
) -> str | None:
    """Why writing an output would overwrite an input of the same run, or None.

    ``outputs``: ``(option, path)`` pairs (None: not written); ``inputs``: ``(what, source)`` pairs,
    where only sources naming an existing file count (preset names and mappings are not files).
    """
    files = [(what, p) for what, src in inputs if (p := input_file(src)) is not None]
    for option, out in outputs:
        if out is None:
            continue
        for what, path in files:
            if same_file(out, path):
                return f"{option} {out} is {what} ({path}); writing it would overwrite an input of the run"
    return None
