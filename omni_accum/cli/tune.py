"""``omni-accum tune``: write the fastest policy per context length and concurrency for this machine."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

from omni_accum.cli import trace as trace_cli
from omni_accum.cli.args import (
    add_int_list_argument,
    add_threads_argument,
    apply_threads,
    file_path,
    positive_int,
    workload_problem,
)
from omni_accum.errors import OmniAccumError
from omni_accum.policy.loader import load_policy
from omni_accum.tuner.core import TuneError
from omni_accum.tuner.buckets import DEFAULT_CONCURRENCY, DEFAULT_CONTEXT_LENS, QUICK_CONCURRENCY, QUICK_CONTEXT_LENS
from omni_accum.tuner.report import decision_table, gain_table, show
from omni_accum.tuner.run import TuneOptions, input_overwrite_problem, output_problem, partial_path, tune
from omni_accum.bench.workload_presets import DEFAULT_WORKLOAD
from omni_accum.bench.workloads import workload_names

HELP = """\
Replay the workload's trace through every applicable strategy per key (built-ins and plugins,
filtered by the kinds they declare, with a small params grid), in every bucket of context length
x concurrency, arms interleaved round by round. A key leaves the baseline policy only for a win
beyond the noise (its whole 95 % interval above 5 %: Student's t over the rounds' ratios, the first round
timed warm; the interval's low end saving at least --min-gain-us per step; --quick's 2 rounds act on large
gains only, t's 12.7); every kept baseline is listed with its reason under the decision table.
Candidates whose views differ from the cat reference, that raise, or that hold more than the memory
budget are excluded and reported (a baseline that raises on a key is left for the fastest correct
candidate). The default workload is qwen3-omni-0.30, the stream vllm-omni 0.30.0 sends. The
output is a policy file (validated, written atomically after every bucket) with the decision per
key per bucket, every candidate's timings and an environment fingerprint; at run time a table
whose fingerprint does not match is ignored with a warning. --out only ever receives a complete
table: a run stopped early (Ctrl-C, --budget-s) keeps its buckets in a partial file beside it
(t.yaml -> t.partial.yaml) and leaves --out as it was; --resume goes on from there. One run at a
time per --out (a second is refused). The file is YAML for .yaml/.yml and JSON for .json. Exit
status: 0 complete, 3 partial (--budget-s spent), 130 interrupted, 2 on a usage error (an option,
--out, --workload, --base), 1 on other errors (a bucket that does not fit in memory).
"""


def _number(low: float, *, strict: bool) -> Callable[[str], float]:
    """An argparse type: a finite float ``> low`` (``strict``) or ``>= low``; the error names the value."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or (value <= low if strict else value < low):
            raise argparse.ArgumentTypeError(f"must be a number {'>' if strict else '>='} {low:g}, got {text!r}")
        return value

    return parse


positive_float = _number(0, strict=True)
non_negative_float = _number(0, strict=False)


EXAMPLES = """examples:
  omni-accum tune --quick --out tuned.yaml
  omni-accum tune --out tuned.yaml --context-lens 1k,8k,32k --concurrency 1,10 --budget-s 600
  omni-accum tune --out tuned.yaml --context-lens 1k,8k,32k --concurrency 1,10 --budget-s 600 --resume
  omni-accum tune --workload qwen3-omni-seed --out old-release.yaml --no-progress
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="measure every strategy on a workload and write the fastest policy",
        description=HELP,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workload",
        metavar="NAME|FILE",
        help=f"workload preset ({', '.join(workload_names())}) or a YAML workload file (default: {DEFAULT_WORKLOAD})",
    )
    p.add_argument("--trace", metavar="DIR", help=trace_cli.TRACE_HELP)
    p.add_argument("--pair", metavar="A->B", help=trace_cli.PAIR_HELP)
    add_int_list_argument(
        p,
        "--context-lens",
        "N",
        f"bucket edges of context length (default: {' '.join(map(str, DEFAULT_CONTEXT_LENS))}; "
        f"--quick: {' '.join(map(str, QUICK_CONTEXT_LENS))})",
    )
    add_int_list_argument(
        p,
        "--concurrency",
        "C",
        f"bucket edges of concurrency (default: {' '.join(map(str, DEFAULT_CONCURRENCY))}; "
        f"--quick: {' '.join(map(str, QUICK_CONCURRENCY))})",
    )
    p.add_argument(
        "--wire",
        choices=["inproc", "serializer", "shm"],
        default="inproc",
        help="how chunks travel while timing (serializer/shm use vllm-omni's real classes; default: %(default)s)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where tensors live while timing (default: %(default)s)",
    )
    p.add_argument(
        "--budget-s",
        type=non_negative_float,
        metavar="S",
        help="stop starting new buckets once S seconds have passed; a run always measures at least one bucket, "
        "so every run makes progress. With buckets left they go to the partial file beside --out (exit status 3) "
        "and --resume goes on. Default (and 0): no budget",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer buckets, decode steps and rounds, no params grid, no upstream round (a first look)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="reuse the buckets already measured (in the partial file beside --out, else in --out; refused from a "
        "file of another user, a group- or world-writable one, or a link at the partial file) when every setting "
        "recorded there (workload and --base contents, wire, device, threads, decode steps, rounds, grid, memory "
        "budget, min gain), the "
        "candidates and the environment match; otherwise say which differ and measure again (refused, leaving "
        "the file untouched, if it is not a tuned policy): give the interrupted command again, with --resume",
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--out",
        type=file_path,
        metavar="FILE",
        help="where to write the tuned policy (required unless --show): .yaml or .yml (YAML) or .json (JSON); "
        "written atomically, through a symlink to its target (a deployed table; another user's link is refused), "
        "keeping an existing file's permissions, owner and group (the partial file beside it replaces a link "
        "there, as bench --json does)",
    )
    target.add_argument("--show", metavar="POLICY", help="print the decision table of a tuned policy file and exit")
    p.add_argument(
        "--base",
        default="default",
        metavar="POLICY",
        help="baseline policy (preset or file); its explicit rules are kept and beat the table "
        "(default: %(default)s = vllm-omni 0.30.0 behaviour)",
    )
    p.add_argument(
        "--decode-steps",
        type=positive_int,
        metavar="N",
        help="decode chunks replayed per request, exactly N, at most the workload's (default: at least 8, or 3 with "
        "--quick, raised at low concurrency so that each round gets >= 24 step samples, 12 with --quick)",
    )
    p.add_argument(
        "--max-rounds", type=positive_int, metavar="N", help="most interleaved rounds per bucket (default 3, quick 2)"
    )
    p.add_argument(
        "--memory-budget",
        type=positive_float,
        default=2.0,
        metavar="X",
        help="reject a candidate holding more than X (> 0) times the accumulated bytes (default %(default)s)",
    )
    p.add_argument(
        "--min-gain-us",
        type=non_negative_float,
        default=1.0,
        metavar="US",
        help="leave the baseline only when the low end of the win's interval saves at least US (>= 0) "
        "microseconds per step, besides the whole interval above 5%% (default %(default)s)",
    )
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time the tuned policy against upstream vllm-omni, two rounds per bucket (each first in one) after an "
        "untimed warm-up replay of each, and print the gain (default: on; off with --quick)",
    )
    add_threads_argument(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr (as bench)")
    # what --show leaves unused: every option of a run (their defaults, to tell one given)
    measuring = {a.dest: (a.default, a.option_strings[-1]) for a in p._actions if a.dest not in _WITH_SHOW}
    p.set_defaults(func=run, _measuring=measuring)


#: Options that mean something beside --show (it prints a table and measures nothing).
_WITH_SHOW = ("help", "show", "verbose", "no_progress", "threads")


def run(args: argparse.Namespace) -> int:
    if args.show is not None:
        unused = [opt for dest, (default, opt) in getattr(args, "_measuring", {}).items()
                  if getattr(args, dest, default) != default]  # fmt: skip
        if unused:  # they were ignored without a word
            print(f"omni-accum tune: error: --show prints a tuned policy's table and measures nothing: it takes none "
                  f"of {', '.join(unused)}", file=sys.stderr)  # fmt: skip
            return 2
        try:
            shown = load_policy(args.show)
        except OmniAccumError as e:  # a usage error (2), as for `omni-accum show`
            print(f"omni-accum tune: error: {e}", file=sys.stderr)
            return 2
        print(show(shown, str(args.show)))
        return 0
    if args.out is None:
        print("omni-accum tune: error: --out FILE is required (or --show POLICY)", file=sys.stderr)
        return 2
    problem = output_problem(args.out)
    if problem is None:
        from omni_accum.bench.runner import concurrency_problem, context_lens_problem

        problem = context_lens_problem(args.context_lens or [])  # bench's bound (a 2000k request is ~8 GB)
        problem = problem or concurrency_problem(args.concurrency or [])
    if problem:
        print(f"omni-accum tune: error: {problem}", file=sys.stderr)
        return 2
    problem = trace_cli.empty_input_problem(args)  # as --base '': never the default workload by accident
    if problem:
        print(f"omni-accum tune: error: {problem}", file=sys.stderr)
        return 2
    if args.trace and args.workload:
        print(f"omni-accum tune: error: --trace {args.trace} and --workload {args.workload}: give one", file=sys.stderr)
        return 2
    if args.pair and not args.trace:
        print(f"omni-accum tune: error: --pair {args.pair} needs --trace DIR", file=sys.stderr)
        return 2
    workload = args.workload or DEFAULT_WORKLOAD
    if args.trace:  # the capture is the workload; its buckets unless given
        workload = trace_cli.trace_workload(args, "omni-accum tune")
        if workload is None:
            return 2
    opts = TuneOptions(
        workload=workload,
        out=args.out,
        context_lens=args.context_lens or (workload.context_lens if args.trace else None),
        concurrency=args.concurrency or (workload.concurrency if args.trace else None),
        wire=args.wire,
        device=args.device,
        budget_s=args.budget_s,
        quick=args.quick,
        resume=args.resume,
        base=args.base,
        decode_steps=args.decode_steps,
        max_rounds=args.max_rounds,
        memory_factor=args.memory_budget,
        min_gain_us=args.min_gain_us,
        verify=args.verify,
    )
    problem = input_overwrite_problem(opts)  # before anything is read or measured: exit 2 as bench does
    if not problem and not args.trace:
        problem = workload_problem(workload)
    if not problem:
        try:
            load_policy(args.base)
        except OmniAccumError as e:
            problem = f"--base {args.base!r}: {e}"
    if problem:
        print(f"omni-accum tune: error: {problem}", file=sys.stderr)
        return 2
    apply_threads(args.threads)
    started = time.time()
    try:
        res = tune(opts, progress=None if args.no_progress else sys.stderr, log=sys.stderr)
    except TuneError as e:  # it cannot run as asked (an option, the --out file, the device): a usage error
        print(f"omni-accum tune: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        part = partial_path(args.out)
        kept = f"{args.out} is as it was" if Path(args.out).exists() else f"{args.out} was not written"
        if part.is_file() and part.stat().st_mtime >= started - 1:
            done = f"the buckets finished so far are in {part}"
        else:  # (a partial file of an earlier run is not this run's work)
            done = "no bucket was finished" + (f" in this run ({part} is an earlier run's)" if part.is_file() else "")
        print(f"omni-accum tune: interrupted; {kept}; {done}: run the same command again with --resume to finish",
              file=sys.stderr)  # fmt: skip
        return 130
    t = res.policy.tuned
    if t is None:  # not reached: a run measures at least one bucket or raises
        print(f"omni-accum tune: error: nothing was measured; {args.out} was not written", file=sys.stderr)
        return 3
    print(decision_table(t))
    verified = [o for o in res.outcomes if o.verify]
    if verified:
        from omni_accum.tuner.core import reference_arm

        ref = reference_arm()
        name = "upstream" if ref == "upstream" else "default"
        print()
        floor = all(o.verify.get("reference") == "wire-floor" for o in verified)
        print(
            "gain of the tuned policy over "
            + ("upstream vllm-omni 0.30.0" if name == "upstream" else "the default preset")
            + (" (here: wire-floor, what its adapter does with this stream)" if floor else "")
            + " (two rounds per bucket after a warm-up replay, one in each order; step p50 and total per request):"
        )
        print(gain_table(res.outcomes, name, str(args.base)))
    if res.complete:
        print(f"\nwrote {res.out} (complete) in {res.elapsed_s:.1f} s; check it with: omni-accum validate {res.out}")
    else:
        kept = f"{args.out} is as it was" if res.previous else f"{args.out} was not written"
        print(
            f"\nwrote {res.out} (PARTIAL: {res.stopped}) in {res.elapsed_s:.1f} s; {kept}; "
            f"run the same command again with --resume to finish"
        )
    return 0 if res.complete else 3
