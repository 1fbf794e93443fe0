"""``omni-accum tune``: write the fastest policy per context length and concurrency for this machine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omni_accum.cli import (
    add_int_list_argument,
    add_threads_argument,
    apply_threads,
    output_path_problem,
    positive_int,
)
from omni_accum.loader import load_policy
from omni_accum.tuner.buckets import DEFAULT_CONCURRENCY, DEFAULT_CONTEXT_LENS, QUICK_CONCURRENCY, QUICK_CONTEXT_LENS
from omni_accum.tuner.report import decision_table, gain_table, show
from omni_accum.tuner.run import TuneOptions, tune

HELP = """\
Replay the workload's trace through every applicable strategy per key (built-ins and plugins,
filtered by the kinds they declare, with a small params grid), in every bucket of context length
x concurrency, arms interleaved round by round. A key leaves the baseline policy only for a win
> 5 %% whose bootstrap 95 %% interval excludes zero; candidates whose views differ from the cat
reference, that raise, or that hold more than the memory budget are excluded and reported. The
output is a policy file (validated, written atomically after every bucket) with the decision per
key per bucket, every candidate's timings and an environment fingerprint; at run time a table
whose fingerprint does not match is ignored with a warning. Ctrl-C leaves the previous file or a
valid partial one; --resume reuses measured buckets.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="measure every strategy on a workload and write the fastest policy",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workload", default="qwen3-omni-seed", help="workload preset name or YAML file (default: %(default)s)"
    )
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
        help="how chunks travel while timing (serializer/shm use vllm-omni's real classes)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where tensors live while timing")
    p.add_argument(
        "--budget-s",
        type=float,
        metavar="S",
        help="stop starting new buckets after S seconds (the file is then partial; --resume goes on)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer buckets, decode steps and rounds, no params grid, no upstream round (a first look)",
    )
    p.add_argument("--resume", action="store_true", help="reuse the buckets already measured in --out")
    p.add_argument("--out", type=Path, metavar="POLICY.yaml", help="where to write the tuned policy")
    p.add_argument(
        "--base",
        default="default",
        metavar="POLICY",
        help="baseline policy (preset or file); its explicit rules are kept and beat the table "
        "(default: %(default)s = vllm-omni 0.30.0 behaviour)",
    )
    p.add_argument(
        "--decode-steps", type=positive_int, metavar="N", help="decode chunks replayed per request (default 8, quick 3)"
    )
    p.add_argument(
        "--max-rounds", type=positive_int, metavar="N", help="most interleaved rounds per bucket (default 3, quick 2)"
    )
    p.add_argument(
        "--memory-budget",
        type=float,
        default=2.0,
        metavar="X",
        help="reject a candidate holding more than X times the accumulated bytes (default %(default)s)",
    )
    p.add_argument(
        "--min-gain-us",
        type=float,
        default=1.0,
        metavar="US",
        help="leave the baseline only for a win of at least US microseconds per step, besides > 5%% with an "
        "interval above zero (default %(default)s)",
    )
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time the tuned policy against upstream vllm-omni, one round per bucket after an untimed "
        "warm-up replay of each, and print the gain (default: on; off with --quick)",
    )
    add_threads_argument(p)
    p.add_argument("--show", metavar="POLICY", help="print the decision table of a tuned policy file and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.show:
        print(show(load_policy(args.show), str(args.show)))
        return 0
    if args.out is None:
        print("omni-accum tune: error: --out POLICY.yaml is required (or --show POLICY)", file=sys.stderr)
        return 2
    problem = output_path_problem(args.out, "--out")
    if problem:
        print(f"omni-accum tune: error: {problem}", file=sys.stderr)
        return 2
    apply_threads(args.threads)
    opts = TuneOptions(
        workload=args.workload,
        out=args.out,
        context_lens=args.context_lens,
        concurrency=args.concurrency,
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
    try:
        res = tune(opts, progress=sys.stderr, log=sys.stderr)
    except KeyboardInterrupt:
        print(
            f"omni-accum tune: interrupted; {args.out} holds the buckets finished so far (or the previous file); "
            "run again with --resume",
            file=sys.stderr,
        )
        return 130
    t = res.policy.tuned
    assert t is not None
    print(decision_table(t))
    verified = [o for o in res.outcomes if o.verify]
    if verified:
        from omni_accum.tuner.core import reference_arm

        ref = reference_arm()
        name = "upstream" if ref == "upstream" else "default"
        print()
        print(
            "gain of the tuned policy over "
            + ("upstream vllm-omni 0.30.0" if name == "upstream" else "the default preset")
            + " (one interleaved round per bucket after a warm-up replay, step p50 and total per request):"
        )
        print(gain_table(res.outcomes, name))
    state = "complete" if res.complete else f"PARTIAL ({res.stopped})"
    print(f"\nwrote {args.out} ({state}) in {res.elapsed_s:.1f} s; check it with: omni-accum validate {args.out}")
    return 0 if res.complete else 3
