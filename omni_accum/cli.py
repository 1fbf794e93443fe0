"""The ``omni-accum`` command line.

Each command group lives in its own module exposing ``register(subparsers)``; this module only
builds the parser and turns omni-accum's own errors into one-line messages (exit 1) instead of
tracebacks. argparse usage errors exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from omni_accum import __version__
from omni_accum._paths import output_path_problem  # noqa: F401 - re-exported for the command modules
from omni_accum.errors import OmniAccumError

#: Modules contributing subcommands, in the order they appear in ``--help``.
COMMAND_MODULES: tuple[str, ...] = (
    "omni_accum.cli_policy",
    "omni_accum.bench_cli",
    "omni_accum.tuner.cli",
)


def int_list(text: str, examples: str = "1000,8000 or 1k,8k") -> list[int]:
    """argparse type: ``1000,8000``, ``1k`` (or ``1K``) or ``32000`` -> positive integers."""
    try:
        out = [int(x[:-1]) * 1000 if x[-1:] in ("k", "K") else int(x) for x in text.replace(",", " ").split()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected positive integers such as {examples}, got {text!r}") from e
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected positive integers such as {examples}, got {text!r}")
    return out


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-accum",
        description=(
            "Per-key accumulation policies for vllm-omni payload chunks: list strategies, check and "
            "explain policies, benchmark strategies on a workload, and tune a policy for this machine."
        ),
        epilog="Run 'omni-accum COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"omni-accum {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages (plugin loading, hooks)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for command in sub.choices.values():  # -v after the command too (it does not reset one given before)
        command.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log debug messages"
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except OmniAccumError as e:
        print(f"omni-accum: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # an output path that cannot be written (a directory, a missing folder, no space)
        where = f": {e.filename}" if getattr(e, "filename", None) else ""
        print(f"omni-accum: error: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("omni-accum: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
