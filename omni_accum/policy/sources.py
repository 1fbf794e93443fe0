"""Where policy text comes from: preset names, files, ``-`` (stdin) and inline text on the command line.

A file is read only when it is a regular file of at most :data:`MAX_POLICY_BYTES`; a FIFO or a device is
refused without being opened, and blank text (an empty file, an empty stdin) is an error, never the default
policy by accident.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from importlib import resources
from pathlib import Path

from omni_accum.errors import PolicyArgumentError, PolicyError

PRESET_SUFFIX = ".yaml"
#: The largest policy file (or stdin) read: a policy is a few KiB, a tuned table a few hundred.
MAX_POLICY_BYTES = 1024 * 1024  # ~4 s to validate; the largest table tune writes (512 cells) is ~0.36 MB


# ---------------------------------------------------------------------------------------------- #
# Presets
# ---------------------------------------------------------------------------------------------- #


def preset_names() -> list[str]:
    """Names of the policy presets shipped in ``omni_accum.config``."""
    root = resources.files("omni_accum.config")
    return sorted(p.name[: -len(PRESET_SUFFIX)] for p in root.iterdir() if p.name.endswith(PRESET_SUFFIX))


def preset_text(name: str) -> tuple[str, str]:
    """Return ``(source label, YAML text)`` of a preset."""
    names = preset_names()
    if name not in names:
        raise PolicyError(f"unknown policy preset {name!r}. Available presets: {', '.join(names)}")
    res = resources.files("omni_accum.config").joinpath(name + PRESET_SUFFIX)
    return f"preset {name!r}", res.read_text(encoding="utf-8")


def probe(path: str | os.PathLike[str], test: str = "exists") -> bool:
    """``Path(path).exists()`` (``test``: or ``"is_file"``, ``"is_dir"``), False for a name no file can have
    (longer than the system allows, or with a NUL byte) or one that cannot be looked at: policy text is often
    probed as a path first, and must not fail as one (``OSError: File name too long``)."""
    try:
        return bool(getattr(Path(path), test)())
    except (OSError, ValueError):
        return False


_FORMATS = {".json": "json", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml"}


def read_source(source: str | os.PathLike[str], origin: str | None = None) -> tuple[str, str, str]:
    """Return ``(label, text, format)`` for a path or a preset name. ``origin``: the environment variable
    ``source`` was read from (``OMNI_ACCUM_POLICY``), named first in each error (``OMNI_ACCUM_POLICY=nope: ...``)."""
    if origin is None:
        return _read_source(source)
    try:
        return _read_source(source)
    except PolicyError as e:
        raise PolicyError(f"{origin}={source}: {e}", source=f"{origin}={source}") from e


def _str_path(source: str | os.PathLike[str]) -> str:
    """``os.fspath(source)``; :class:`PolicyArgumentError` for a path-like whose ``__fspath__`` gives no str."""
    kind = type(source).__name__
    try:
        name = os.fspath(source)
    except TypeError as e:  # __fspath__ returned neither str nor bytes
        raise PolicyArgumentError(f"a path-like {kind} whose __fspath__ gives no str path: {e}") from None
    if not isinstance(name, str):
        raise PolicyArgumentError(
            f"a path-like {kind} whose __fspath__ returns {type(name).__name__} ({name!r:.60}): give a str path "
            "(decode bytes first)"
        )
    return name


def _read_source(source: str | os.PathLike[str]) -> tuple[str, str, str]:
    name = _str_path(source)  # a path-like's own str (str() of one may be its repr)
    path = Path(name)
    suffix = path.suffix.lower()
    if suffix not in _FORMATS and name in preset_names():  # no file of that name can be a policy (suffix)
        label, text = preset_text(name)
        return label, text, "yaml"
    if probe(path, "is_file"):
        fmt = _FORMATS.get(suffix)
        if fmt is None:
            raise PolicyError(f"{path}: unsupported policy file type {suffix!r}. Use .yaml, .yml, .json or .toml")
        try:
            with path.open(encoding="utf-8") as fh:
                size = os.fstat(fh.fileno()).st_size
                text = fh.read(MAX_POLICY_BYTES + 1) if size <= MAX_POLICY_BYTES else ""
        except UnicodeDecodeError as e:
            raise PolicyError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}): a policy is "
                              "YAML, JSON or TOML text") from e
        except OSError as e:
            raise PolicyError(f"{path}: cannot read policy file: {e}") from e
        if size > MAX_POLICY_BYTES or len(text) > MAX_POLICY_BYTES:
            raise _too_large(str(path), f"{size} bytes" if size > MAX_POLICY_BYTES else "more")
        if not text.strip():
            raise _no_text(str(path), "the file")
        return str(path), text, fmt
    if not name.strip():
        raise PolicyError("an empty policy argument: give a preset name, a policy file, policy text or a mapping")
    if probe(path, "is_dir"):
        raise PolicyError(f"{path}: is a directory, not a policy file (give a .yaml, .yml, .json or .toml file)")
    if probe(path):  # a FIFO, a device (/dev/zero) or a socket: never opened (it could block or never end)
        raise PolicyError(f"{path}: not a regular file ({_file_kind(path)}); give a .yaml, .yml, .json or .toml file")
    if name in preset_names():
        label, text = preset_text(name)
        return label, text, "yaml"
    if suffix in _FORMATS or os.sep in name:
        where = "" if path.is_absolute() else f" (a relative path, read from the working directory {os.getcwd()})"
        raise PolicyError(f"{name}: no such policy file{where}")
    raise PolicyError(f"{name!r} is neither a policy file nor a preset. Available presets: {', '.join(preset_names())}")


def _file_kind(path: Path) -> str:
    mode = path.stat().st_mode
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in (*kinds, (stat.S_ISSOCK, "a socket")) if test(mode)), "a special file")


def _too_large(label: str, size: str) -> PolicyError:
    limit = f"{MAX_POLICY_BYTES} bytes ({MAX_POLICY_BYTES >> 20} MiB)"
    msg = (f"{label}: too large for a policy ({size}; the limit is {limit}): a policy is a few KiB, a tuned table "
           "at most ~0.4 MB (512 cells; an older, larger one: tune it again with fewer --context-lens or --concurrency)")
    return PolicyError(msg, source=label)


def _no_text(label: str, what: str) -> PolicyError:
    """Blank policy text (a failed redirection or pipeline, say) is an error, whether from a file or stdin."""
    msg = f"{label}: no policy text ({what} is empty or holds only blanks; to name the default policy, give 'default')"
    return PolicyError(msg, source=label)


_INLINE_RE = re.compile(r"^\s*(\{|\[|[A-Za-z_][\w-]*\s*:(\s|$))")


def is_inline_policy(text: str) -> bool:
    """True when ``text`` is policy text, not a path or preset name: ``{...}``, ``[...]`` (refused as not a mapping),
    ``key: ...`` or several lines. One line ending in a policy file suffix (``[draft].yaml``) is a path."""
    if "\n" in text.strip():
        return True
    match = _INLINE_RE.match(text)
    if match is None:
        return False
    return match.group(1)[0] not in "{[" or Path(text.strip()).suffix.lower() not in _FORMATS


def read_policy_argument(arg: str) -> tuple[str, str, str]:
    """``(label, text, format)`` of a command-line POLICY: ``-`` (stdin), a file, a preset, or inline YAML/JSON text.

    A file or preset of that name wins over inline text; inline text and stdin are read as YAML (JSON is YAML).
    """
    if arg == "-":
        text = sys.stdin.read(MAX_POLICY_BYTES + 1)
        if len(text) > MAX_POLICY_BYTES:
            raise _too_large("<stdin>", "more")
        if not text.strip():  # a pipeline whose first command failed, or '-' given twice
            raise _no_text("<stdin>", "stdin")
        return "<stdin>", text, "yaml"
    if not arg.strip():
        raise PolicyError(
            "an empty POLICY argument: give a preset name, a policy file, inline YAML, or - for stdin", source="''"
        )
    if not probe(arg) and arg not in preset_names() and is_inline_policy(arg):
        return "<inline>", arg, "yaml"
    return read_source(arg)
