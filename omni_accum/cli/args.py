"""Argument types and options shared by the ``omni-accum`` command modules.

Integer lists (``1000,8000``, ``1k``, repeated flags), name lists (``a,b`` or ``a b``), options given at most
once, bounded integers and ``--threads``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any


class ExamplesHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Wraps the description like argparse's default, keeps the examples epilog as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)


def int_list(text: str, examples: str = "1000,8000 or 1k,8k") -> list[int]:
    """argparse type: ``1000,8000``, ``1k`` (or ``1K``) or ``32000`` -> positive integers."""
    parts = text.split(",")
    if len(parts) > 1 and any(not part.strip() for part in parts):
        raise argparse.ArgumentTypeError(
            f"expected positive integers such as {examples}, got {text!r} (an empty item between commas)"
        )
    try:
        out = [int(x[:-1]) * 1000 if x[-1:] in ("k", "K") else int(x) for x in text.replace(",", " ").split()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected positive integers such as {examples}, got {text!r}") from e
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected positive integers such as {examples}, got {text!r}")
    return out


def file_path(text: str) -> Path:
    """An output file's path (``Path("")`` would be the current folder: an empty one is refused as such)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: {'an empty' if not text else 'a blank'} path; give a file path")
    return Path(text)


def int_value(text: str) -> int:
    """argparse type: one positive integer, ``8000`` or ``8k``."""
    out = int_list(text, "8000 or 8k")
    if len(out) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer such as 8000 or 8k, got {text!r}")
    return out[0]


def _bounded_int(low: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"int>={low}"
    return parse


positive_int = _bounded_int(1)
non_negative_int = _bounded_int(0)


def add_int_list_argument(
    p: argparse.ArgumentParser,
    flag: str,
    metavar: str,
    help: str,  # noqa: A002
    examples: str | None = None,
) -> None:
    """An option taking integers as ``1000 8000``, ``1000,8000`` or ``1k``, repeated or not, as one flat list.

    ``examples`` shows valid values in errors (default: ``1,10`` for a concurrency flag, else context lengths).
    """
    if examples is None:
        examples = "1,10" if "concurrency" in flag else "1000,8000 or 1k,8k"

    def parse(text: str) -> list[int]:
        return int_list(text, examples)

    parse.__name__ = "integer list"  # argparse names the type in some messages
    p.add_argument(flag, type=parse, nargs="+", action=IntListAction, metavar=metavar, help=help)


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """``--threads N``: torch intra-op threads while measuring (bench and tune)."""
    p.add_argument(
        "--threads",
        type=non_negative_int,
        default=1,
        metavar="N",
        help="torch intra-op threads while measuring (default: 1, stable on a shared machine; 0: torch's default)",
    )


def apply_threads(n: int) -> None:
    """Set torch's intra-op threads (0 keeps torch's default)."""
    if n:
        import torch

        torch.set_num_threads(n)


class IntListAction(argparse.Action):
    """``--opt 1000 8000``, ``--opt 1000,8000`` and repeated ``--opt`` all give one flat list."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        items = list(getattr(namespace, self.dest, None) or [])
        for part in values:
            items.extend(part)
        setattr(namespace, self.dest, items)


class NameListAction(argparse.Action):
    """``--opt a b``, ``--opt a,b`` and repeated ``--opt`` all give one flat list of names; an empty item between
    commas (``a,,b``, ``a,``) is a usage error, as in the number lists (:func:`int_list`)."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        items = list(getattr(namespace, self.dest, None) or [])
        for part in values:
            if os.path.exists(part):  # a file whose name holds a comma
                items.append(part)
                continue
            names = part.split(",")
            if len(names) > 1 and any(not x.strip() for x in names):
                parser.error(f"{option_string}: expected names such as a,b, got {part!r} (an empty item between commas)")
            items.extend(x for x in names if x.strip())
        if not items:
            parser.error(f"{option_string}: expected one or more names, got {' '.join(values)!r}")
        setattr(namespace, self.dest, items)


#: The options given so far while a command's arguments are parsed: ``{dest: (option string, value)}`` on the
#: namespace, which the command parser removes when it is done (:func:`given_before`).
SEEN = "_omni_accum_options_given"


def given_before(namespace: argparse.Namespace, dest: str, option_string: str | None, value: Any) -> Any:
    """The ``(option string, value)`` option DEST had earlier in this parse, or None; records this one."""
    seen = namespace.__dict__.setdefault(SEEN, {})
    before = seen.get(dest)
    seen[dest] = (option_string, value)
    return before


class OnceAction(argparse.Action):
    """An option that may be given once: a second occurrence is a usage error naming both values."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        before = given_before(namespace, self.dest, option_string, values)
        if before is not None:
            parser.error(f"{option_string} given twice ({before[1]} and {values}); give it once")
        setattr(namespace, self.dest, values)


def workload_problem(name: str) -> str | None:
    """Why ``--workload NAME`` names neither a preset nor a valid workload file: a usage error (exit 2), or None.

    A FIFO or a device is refused without being opened (it could block or never end).
    """
    from omni_accum.bench.workloads import PRESETS, WorkloadError, load_workload
    from omni_accum.policy.sources import probe

    if name in PRESETS:
        return None
    if probe(name, "is_file"):  # an invalid file is a usage error too, as an unknown name is
        try:
            load_workload(name)
        except WorkloadError as e:
            return f"--workload {name}: {e}"
        return None
    if probe(name) and not probe(name, "is_dir"):
        return f"--workload {name}: not a regular file; give a YAML or JSON workload file or a preset name"
    try:
        load_workload(name)
    except WorkloadError as e:
        return f"--workload {name}: {e}"
    return None
