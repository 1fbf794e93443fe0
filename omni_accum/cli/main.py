"""The ``omni-accum`` command line: the parser and ``main``.

Each command family lives in its own module of :mod:`omni_accum.cli` exposing
``register(subparsers)`` (:mod:`~omni_accum.cli.policy`: ``strategies``, ``validate``,
``explain``, ``show``; :mod:`~omni_accum.cli.bench`; :mod:`~omni_accum.cli.tune`;
:mod:`~omni_accum.cli.trace`; :mod:`~omni_accum.cli.ab`); this module only builds the parser and turns omni-accum's own errors into one-line messages (exit 1) instead
of tracebacks. argparse usage errors exit 2, as do the commands' own (the rule is in the parser's epilog).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NoReturn

from omni_accum import __version__
from omni_accum.cli import ab, bench, doctor, policy, trace, tune
from omni_accum.cli.args import SEEN, given_before
from omni_accum.errors import OmniAccumError
from omni_accum.manager import ENV_TRACE
from omni_accum.switches import _env_flag, ensure_visible_logging

#: Modules contributing subcommands, in the order they appear in ``--help``.
COMMAND_MODULES: tuple[ModuleType, ...] = (policy, bench, tune, trace, ab, doctor)
#: vLLM's log level (read when it is first imported): WARNING while a command runs unless -v or the user set it.
VLLM_LEVEL = "VLLM_LOGGING_LEVEL"


class _StoreOnce(argparse._StoreAction):
    """An option that takes one value, given twice: the last one is used, as argparse does (a wrapper script may add an
    override), and a note on stderr names both (argparse kept the last one without a word)."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]  # noqa: ANN001
        before = given_before(namespace, self.dest, option_string, values)
        if option_string is not None and before is not None:
            first, was = before
            print(f"{parser.prog}: note: {option_string} given twice ({first} {_shown(was)}, then {option_string} "
                  f"{_shown(values)}): the last one is used", file=sys.stderr)
        super().__call__(parser, namespace, values, option_string)


def _shown(value: Any) -> str:
    return repr(os.fspath(value)) if isinstance(value, os.PathLike) else repr(value)


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an argument it does not know is its own error (``omni-accum validate: error:
    unrecognized arguments: --jsn``, with its usage), not the top-level parser's, which named no command. An option
    that takes one value, given twice, is said (:class:`_StoreOnce`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)
        # "-1k" and "-5,8" are values (refused by the option's type, naming them), not unknown options: argparse's
        # own pattern takes only plain negative numbers ("--context-lens -1k": "expected at least one argument")
        self._negative_number_matcher = re.compile(r"^-\d[\w.,]*$")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]  # noqa: ANN001
        # doctor --json prints JSON, always: a usage error too ({"ok": false, "error": ...} on stdout, as its own)
        self._json_errors = self.prog.endswith(" doctor") and "--json" in (args if args is not None else sys.argv[1:])
        ns, extras = super().parse_known_args(args, namespace)
        ns.__dict__.pop(SEEN, None)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras

    def error(self, message: str) -> NoReturn:
        if getattr(self, "_json_errors", False):
            print(json.dumps({"ok": False, "error": message}, indent=2))
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-accum",
        description=(
            "Per-key accumulation policies for vllm-omni payload chunks: list strategies, check and "
            "explain policies, benchmark strategies on a workload, tune a policy for this machine, summarise a "
            "capture of a server's own stream, compare the arms of a live A/B split, and check a deployment."
        ),
        epilog="Run 'omni-accum COMMAND --help' for the options of a command. Exit status of every command: 0 done; "
        "1 it ran and found a problem (validate: an invalid policy; bench: a wrong view; a bucket that does not fit "
        "in memory) or failed while running; 2 a usage error: an option's value, or an input named on the command "
        "line that is unknown or invalid (a workload, a policy, an arm, an output path); 3 tune stopped at "
        "--budget-s; 130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"omni-accum {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log debug messages (plugin loading, hooks) and vLLM's info lines (hidden otherwise unless "
        "VLLM_LOGGING_LEVEL is set)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_CommandParser)
    for module in COMMAND_MODULES:
        module.register(sub)
    for command in sub.choices.values():  # -v after the command too (it does not reset one given before)
        command.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            default=argparse.SUPPRESS,
            help="log debug messages and vLLM's info lines",
        )
    return parser


def _unknown_before_command(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """The options before COMMAND that ``omni-accum`` itself does not have: with no command after them, argparse
    said only that COMMAND is required (``omni-accum --bogus``), not what was wrong with them."""
    known = [s for action in parser._actions for s in action.option_strings]
    unknown = []
    for arg in argv:
        if not arg.startswith("-") or arg in ("-", "--"):
            break  # the command (or the end of the options; '-' is argparse's to judge)
        name = arg.split("=", 1)[0]
        if name.startswith("--"):
            ok = any(k.startswith(name) for k in known)  # (an abbreviation, one or ambiguous, is argparse's to judge)
        else:
            ok = all(f"-{c}" in known for c in name[1:])  # -v, and short flags together (-vv, -vh)
        if not ok:
            unknown.append(arg)
    return unknown


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    unknown = _unknown_before_command(parser, argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (before COMMAND: -h, --version and -v; a "
                     "command's own options go after it)")  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if args.verbose or _env_flag(ENV_TRACE):  # omni_accum's own lines on stderr (root's WARNING hides INFO/DEBUG)
        ensure_visible_logging(logging.DEBUG if args.verbose else logging.INFO, "%(levelname)s %(message)s")
    prefix = f"omni-accum {args.command}"  # one prefix per command, as argparse's usage errors have
    # vLLM's INFO lines when a command imports it (its platform, vllm-omni's patches) are not the command's output:
    # its warnings and errors only, unless -v or VLLM_LOGGING_LEVEL asks for more; unset again at the end (a caller
    # of main() keeps its environment; vLLM reads the level once, when first imported: if the command imported it,
    # it stays at WARNING in the caller's process).
    quiet = not args.verbose and VLLM_LEVEL not in os.environ
    if quiet:
        os.environ[VLLM_LEVEL] = "WARNING"
    try:
        return int(args.func(args) or 0)
    except OmniAccumError as e:
        print(f"{prefix}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader stopped reading (| head): not an error of this command
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        except (OSError, ValueError, AttributeError):  # stdout is no file (a test's stand-in)
            pass
        return 0
    except OSError as e:  # an output path that cannot be written (a directory, a missing folder, no space)
        where = f": {e.filename}" if getattr(e, "filename", None) else ""
        print(f"{prefix}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    except (MemoryError, RuntimeError) as e:  # an allocation no check foresaw: one line, not a traceback
        from omni_accum.bench.runner import allocation_detail, is_allocation_failure

        if not is_allocation_failure(e):
            raise
        print(f"{prefix}: error: out of memory{allocation_detail(e)}; give smaller sizes", file=sys.stderr)
        return 1
    finally:
        if quiet:
            os.environ.pop(VLLM_LEVEL, None)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
