"""A capture back into records: every complete, valid line; every other one reported, never fatal.

:func:`read_capture` takes a capture folder (its ``capture-*.jsonl`` files, in the order they were written:
numbers in a name compare as numbers, so ``.10`` comes after ``.9``) or files. A line cut by a
stopped writer (no end of line), a line that is not JSON, or a record with a field of the wrong type is
skipped and reported as a :class:`Problem` naming the file and the line number; the rest is used. Lines
are parsed with :func:`json.loads` only: nothing read is unpickled or evaluated. Within a folder, a
symlink or another non-regular ``capture-*.jsonl`` entry (a folder, a FIFO, a device) is reported and not
read; a symlink, a FIFO or a device named itself is refused (:class:`CaptureError`). Neither is ever opened (opening a
FIFO blocks until a writer comes). A file named twice (``trace cap cap``, a folder and a file in it, two
spellings of one path) is read once, and said so (:meth:`Capture.notes`).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_accum.capture.recorder import VERSION
from omni_accum.capture.writer import FILE_PREFIX, FILE_SUFFIX, CaptureError
from omni_accum.policy.sources import probe  # False for a name no file can have (too long, a NUL byte)

ROLES = ("send", "recv")
KINDS = ("append", "replace")
#: Problems listed one by one; past it, only counted.
MAX_LISTED = 20


@dataclass(frozen=True)
class Problem:
    """A line that was skipped: its file, its line number (1-based; 0: the whole file) and why."""

    file: str
    line: int
    reason: str
    #: The last line of a run of lines skipped for the same reason (a capture of another record version).
    last: int = 0

    def __str__(self) -> str:
        where = f"{self.file}, line {self.line}" if self.line else self.file
        if self.last > self.line:
            where = f"{self.file}, lines {self.line}-{self.last}"
        return f"{where}: {self.reason}"


@dataclass
class Capture:
    """What :func:`read_capture` found: ``records`` (dicts, in file order, each with ``_file``/``_line``
    of where it came from) and ``problems`` (the lines skipped)."""

    files: list[Path] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    #: Files named more than once (as the first naming spelled them), read once.
    repeated: list[Path] = field(default_factory=list)

    def warnings(self) -> list[str]:
        """One line per problem (the first :data:`MAX_LISTED`, then a count of the rest)."""
        out = [f"skipped {p}" for p in self.problems[:MAX_LISTED]]
        if len(self.problems) > MAX_LISTED:
            out.append(f"... and {len(self.problems) - MAX_LISTED} more lines skipped")
        return out

    def notes(self) -> list[str]:
        """One line naming the files given more than once (read once), or none."""
        if not self.repeated:
            return []
        names = [str(p) for p in self.repeated[:MAX_LISTED]]
        more = f" and {len(self.repeated) - MAX_LISTED} more" if len(self.repeated) > MAX_LISTED else ""
        return [f"{', '.join(names)}{more} named more than once: {'each ' if len(self.repeated) > 1 else ''}read once"]


def _special_kind(path: Path) -> str | None:
    """What ``path`` is when it exists and is neither a regular file, a folder nor a symlink (``a FIFO``,
    ``a character device`` ...), from its status alone: never opened."""
    from omni_accum.bench._paths import special_file_kind

    return special_file_kind(path) if probe(path) and not probe(path, "is_symlink") else None


def _name_order(path: Path) -> list[Any]:
    """``path``'s name with its digit runs as numbers: ``capture-0-7.10.jsonl`` after ``capture-0-7.9.jsonl`` (a
    process's files are numbered on, past 9 and across a restart with the same pid)."""
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"([0-9]+)", path.name))]


def capture_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The capture files ``paths`` name: a folder's ``capture-*.jsonl`` files (sorted), or the files given.

    Raises:
        CaptureError: a path that does not exist, an empty one, a FIFO, a device or a socket (never opened), or a
            folder without capture files (named).
    """
    out: list[Path] = []
    for raw in paths:
        if not str(raw).strip():  # Path("") is ".": the working directory, read without a word
            raise CaptureError(
                f"an empty capture path: give a capture folder or a capture file ({FILE_PREFIX}*{FILE_SUFFIX})"
            )
        p = Path(raw)
        kind = _special_kind(p)
        if kind is not None:
            raise CaptureError(
                f"{p}: is {kind}, not a regular file; give a capture folder or a capture file "
                f"({FILE_PREFIX}*{FILE_SUFFIX})"
            )
        if probe(p, "is_dir"):
            try:
                names = list(p.iterdir())
            except PermissionError:
                raise CaptureError(
                    f"{p}: cannot list the folder (permission denied): a capture is private to the user the server "
                    "runs as (folder 0700, files 0600); read it as that user"
                ) from None
            except OSError as e:
                raise CaptureError(f"{p}: cannot list the folder ({e.strerror or e})") from None
            found = sorted((x for x in names if x.name.startswith(FILE_PREFIX) and x.name.endswith(FILE_SUFFIX)),
                           key=_name_order)
            if not found:
                raise CaptureError(
                    f"{p}: no capture files in this folder (expected {FILE_PREFIX}<stage>-<pid>.<n>{FILE_SUFFIX}, "
                    "written by a stage process run with OMNI_ACCUM_CAPTURE or the connector extra omni_accum_capture)"
                )
            out += found
        elif probe(p, "is_symlink"):
            raise CaptureError(f"{p}: {symlink_reason(p)}")
        elif probe(p):
            out.append(p)
        else:
            raise CaptureError(f"{p}: no such capture folder or file")
    return out


def symlink_reason(path: Path) -> str:
    """Why a capture file that is a symlink is not read, and what to give instead."""
    try:
        target = f" ({os.readlink(path)})"
    except OSError:
        target = ""
    return (
        "is a symlink: not read (capture files are opened without following a link, as omni-accum's same-host "
        f"files are: a link planted among them must not make it read another file); give the file it points to{target}"
    )


#: Bytes per element of the tensor dtypes a capture names (other dtype names are not tensors).
ITEM_BYTES = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2, "bfloat16": 2,
    "float32": 4, "float64": 8, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
#: A recorded key larger than this is refused as corrupt (chunk 0 of a 32k prompt is 128 MiB a key).
MAX_KEY_BYTES = 16 << 30


def _number(x: Any) -> bool:
    """A finite number: json.loads reads Infinity and NaN (and integers past a float's range), which no writer
    makes and ``trace --json`` could not print as JSON."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an integer too large for a float
        return False


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_record(rec: Any) -> str | None:
    """Why ``rec`` is not a valid version-1 record, or None."""
    if not isinstance(rec, dict):
        return f"a record is a JSON object, got {type(rec).__name__}"
    if rec.get("v") != VERSION:
        return f"record version {rec.get('v')!r}: this omni-accum reads version {VERSION}"
    checks = (
        ("t", _number(rec.get("t"))),
        ("req", isinstance(rec.get("req"), str) and bool(rec.get("req"))),
        ("pair", isinstance(rec.get("pair"), str) and "->" in rec.get("pair", "")),
        ("role", rec.get("role") in ROLES),
        ("seq", _count(rec.get("seq"))),
        ("dt", _number(rec.get("dt")) and rec.get("dt") >= 0),
        ("keys", isinstance(rec.get("keys"), list)),
        ("handoff_s", rec.get("handoff_s") is None or (_number(rec.get("handoff_s")) and rec["handoff_s"] >= 0)),
        ("arm", rec.get("arm") is None or isinstance(rec.get("arm"), str)),
        ("ctx", rec.get("ctx") is None or _count(rec.get("ctx"))),
    )
    for name, ok in checks:
        if not ok:
            return f"field {name!r}: invalid value {rec.get(name)!r}"
    for i, k in enumerate(rec["keys"]):
        why = _check_key(k)
        if why:
            return f"keys[{i}]: {why}"
    return None


def _check_key(k: Any) -> str | None:
    if not isinstance(k, list) or len(k) not in (6, 7):
        return "expected [path, kind, dtype, shape, bytes, strategy] (and an optional mapping)"
    path, kind, dtype, shape, nbytes, strategy = k[:6]
    if not isinstance(path, str) or not path:
        return f"path {path!r} is not a key path"
    if kind not in KINDS:
        return f"kind {kind!r}: expected {' or '.join(KINDS)}"
    if not isinstance(dtype, str) or not isinstance(strategy, str):
        return "dtype and strategy are names"
    if not isinstance(shape, list) or not all(_count(x) for x in shape) or len(shape) > 16:
        return f"shape {shape!r} is not a list of sizes"
    if not _count(nbytes):
        return f"bytes {nbytes!r} is not a count"
    size = ITEM_BYTES.get(dtype)
    n = size or 8  # a replay allocates every key from its shape (a list, a string, another dtype: 8 bytes an item)
    for x in shape:
        n *= x
    if size is not None and n != nbytes:  # a tensor: its bytes follow from its shape
        return f"bytes {nbytes} do not match shape {shape} of {dtype} ({n} bytes)"
    if n > MAX_KEY_BYTES:
        return f"shape {shape} of {dtype}: {n} bytes, more than a key of a chunk holds ({MAX_KEY_BYTES >> 30} GiB)"
    if len(k) == 7 and not isinstance(k[6], dict):
        return "its seventh element is not a mapping"
    return None


def _read_file(path: Path, into: Capture) -> None:
    name = str(path)
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        mode = None  # gone, or not to be looked at: open() says why
    if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISLNK(mode):  # never opened: a FIFO blocks
        kind = "a directory" if stat.S_ISDIR(mode) else _special_kind(path) or "a special file"
        into.problems.append(Problem(name, 0, f"is {kind}, not a regular file: not read"))
        return
    try:  # O_NONBLOCK: a FIFO put in its place since is not waited on (and is refused below)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        why = symlink_reason(path) if path.is_symlink() else f"cannot read it ({e.strerror or e})"
        if isinstance(e, PermissionError):
            why += ": a capture file is private to the user the server runs as (0600); read it as that user"
        into.problems.append(Problem(name, 0, why))
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            into.problems.append(Problem(name, 0, "not a regular file: not read"))
            return
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read()
    except OSError as e:
        into.problems.append(Problem(name, 0, f"cannot read it ({e.strerror or e})"))
        return
    finally:
        os.close(fd)
    into.files.append(path)
    lines = data.split(b"\n")
    cut = lines.pop()  # after the last newline: empty, or a line the writer never finished
    for no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        _parse(raw, name, no, into)
    if cut.strip():
        into.problems.append(
            Problem(name, len(lines) + 1, "truncated record (no end of line: the writer stopped mid-write)")
        )


def _parse(raw: bytes, name: str, no: int, into: Capture) -> None:
    try:
        rec = json.loads(raw)
    except (ValueError, RecursionError) as e:
        into.problems.append(Problem(name, no, f"not a JSON record ({str(e)[:80]})"))
        return
    why = check_record(rec)
    if why:
        prev = into.problems[-1] if into.problems else None
        if (why.startswith("record version") and prev is not None and prev.file == name and prev.reason == why
                and no == (prev.last or prev.line) + 1):
            into.problems[-1] = Problem(name, prev.line, why, no)  # one line for a whole file of another version
        else:
            into.problems.append(Problem(name, no, why))
        return
    rec["_file"], rec["_line"] = name, no
    into.records.append(rec)


def read_capture(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> Capture:
    """Every valid record of the capture folder(s) or file(s) ``paths``; see the module docstring.

    Raises:
        CaptureError: as :func:`capture_files` (a path that does not exist, an empty one, a FIFO, a device or a
            socket, a folder without capture files).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = Capture()
    seen: dict[Any, Path] = {}
    for p in capture_files(paths):
        try:
            st = os.lstat(p)
            key: Any = (st.st_dev, st.st_ino)  # one file, however spelled (a symlink is a file of its own)
        except OSError:
            key = os.path.abspath(p)
        if key in seen:
            if seen[key] not in out.repeated:
                out.repeated.append(seen[key])
            continue
        seen[key] = p
        _read_file(p, out)
    return out
