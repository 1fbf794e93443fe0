"""``omni-accum bench``: replay a workload through every arm and print a table per bucket."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from omni_accum.bench._paths import not_an_output_problem, output_path_problem
from omni_accum.cli import trace as trace_cli
from omni_accum.cli.args import (
    ExamplesHelpFormatter,
    NameListAction,
    OnceAction,
    add_int_list_argument,
    add_threads_argument,
    apply_threads,
    non_negative_int,
    positive_int,
    workload_problem,
)
from omni_accum.bench.workload_presets import DEFAULT_WORKLOAD
from omni_accum.bench.workloads import MAX_ROWS, workload_names

EXAMPLES = r"""examples:
  omni-accum bench --workload qwen3-omni-seed --context-lens 1k,8k --concurrency 1
  omni-accum bench --workload qwen3-omni-seed --arms upstream prealloc qwen3-omni-flat wire-floor \
      --json seed.json --plot seed.png
  omni-accum bench --workload qwen3-omni-seed --concurrency 10 --wire serializer --view-hop serializer \
      --arms upstream qwen3-omni-flat
  omni-accum bench --workload my-traffic.yaml --arms upstream my-policy.yaml --per-key
  omni-accum bench --workload qwen3-omni-seed --wire mooncake --context-lens 1k,8k --concurrency 1 4 \
      --arms upstream qwen3-omni-flat
  omni-accum bench --wire mooncake --mooncake-occupancy 40 --context-lens 8k --mooncake-segment 1GiB"""


def register(subparsers: Any) -> None:
    """Add the ``bench`` subcommand."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark strategies and upstream vllm-omni on a workload",
        description=(
            "Replay a workload's chunk trace (N requests round-robin: encode -> wire -> merge -> consumer read) "
            "through every arm (each first replays it once untimed, to be timed warm), interleaved round by "
            "round, and print a table per bucket of context length x "
            "concurrency. Arms: 'upstream' (vllm-omni 0.30.0's own _accumulate_payload), a strategy name "
            "(applied to the keys it fits, upstream behaviour elsewhere), a policy preset or a policy file, "
            "and 'wire-floor'."
        ),
        epilog=EXAMPLES,
        formatter_class=ExamplesHelpFormatter,
    )
    p.add_argument(
        "--workload",
        metavar="NAME|FILE",
        help=f"workload preset ({', '.join(workload_names())}) or a YAML workload file (default: {DEFAULT_WORKLOAD})",
    )
    p.add_argument("--trace", metavar="DIR", help=trace_cli.TRACE_HELP)
    p.add_argument("--pair", metavar="A->B", help=trace_cli.PAIR_HELP)
    p.add_argument(
        "--arms",
        nargs="+",
        action=NameListAction,
        metavar="ARM",
        help="arms to compare (upstream cat, or upstream,cat): upstream, a strategy, a policy preset or file, or "
        "wire-floor (accumulates nothing: the consumer sees each chunk as it arrives; its step is what the wire "
        "and the read alone cost). Default: upstream; cat, token_list and prealloc when a key is append-kind; "
        "wire-floor when a key is read as deltas (vllm-omni 0.30.0's stream, which its adapter hands over as it "
        "came: the ratios then compare with wire-floor where upstream's code raises); send_once when one is "
        "replace or static; the workload's policy",
    )
    add_int_list_argument(
        p,
        "--context-lens",
        "N",
        f"context lengths (prefill rows, at most {MAX_ROWS // 1000}k), e.g. 1000 8000 or 1k,8k "
        "(default: the workload's)",
    )
    add_int_list_argument(
        p,
        "--concurrency",
        "C",
        "concurrency levels, e.g. 1 10 (default: the workload's)",
    )
    p.add_argument(
        "--wire",
        choices=("inproc", "serializer", "shm", "mooncake", "arena"),
        default="inproc",
        help="inproc (default): no serialization; serializer: vllm-omni's OmniSerializer; shm: its "
        "SharedMemoryConnector; mooncake: its MooncakeStoreConnector, sender and receiver in two processes "
        "(needs omni-accum[mooncake]; starts its own master unless --mooncake-master is given); arena: "
        "omni-accum's shared-memory arena, its vllm-omni connector (OmniAccumArenaConnector) and shm, sender "
        "and receiver in two processes (docs/arena.md; it compares those three arms, so it refuses --arms, "
        "--plot, --per-key, --view-hop, --through vllm-omni and --trace)",
    )
    a = p.add_argument_group("--wire arena")
    a.add_argument(
        "--arena-wait",
        choices=("block", "spin"),
        help="how each process waits for the other between its timed steps (untimed either way): block "
        "(default) sleeps in the control pipe, so every step starts in a process the OS just woke (on a VM, "
        "often with cold caches), as vllm-omni 0.30.0's receiving thread, which waits 1 ms whenever a poll "
        "finds nothing; spin polls it and stays on its CPU (the best case). Both processes and every arm "
        "wait the same way",
    )
    m = p.add_argument_group("--wire mooncake")
    m.add_argument("--mooncake-master", metavar="HOST:PORT", help="use this Mooncake master instead of starting one")
    m.add_argument(
        "--mooncake-metadata",
        metavar="URL",
        help="its metadata server (default with --mooncake-master: http://HOST:8080/metadata)",
    )
    m.add_argument(
        "--mooncake-segment",
        metavar="SIZE",
        help="store memory of the holder process this run starts (default: 1GiB): bytes, or a size as the "
        "connectors read one (MiB/GiB = 2^20/2^30, MB/GB = 10^6/10^9); at least 16MiB (Mooncake's smallest)",
    )
    m.add_argument(
        "--mooncake-occupancy",
        type=positive_int,
        metavar="N",
        help="instead of timing: per arm, a fresh master and --mooncake-segment, then N requests sent as vllm-omni "
        "0.30.0 leaves them (soft-pinned, never removed); prints what each request leaves pinned and when the "
        "segment is full",
    )
    p.add_argument(
        "--view-hop",
        choices=("serializer",),
        help="also serialize the consumer's read every step, as pre-0.30 releases did for a multi-process worker",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=3, metavar="N", help="rounds per bucket, arms interleaved (default: 3)"
    )
    p.add_argument(
        "--steps",
        type=non_negative_int,
        metavar="N",
        help="decode steps per request (default: the workload's); a table's steps/request also counts the "
        "prefill chunk(s)",
    )
    add_threads_argument(p)
    p.add_argument(
        "--through",
        choices=("direct", "vllm-omni"),
        default="direct",
        help="direct (default): call omni-accum's Sender/Receiver (or upstream's method); vllm-omni: every merge goes "
        "through a real vllm-omni 0.30.0 runner transport with omni-accum installed (needs vllm-omni)",
    )
    p.add_argument("--per-key", action="store_true", help="also report wire and held bytes per key")
    p.add_argument(
        "--json",
        action=OnceAction,
        metavar="OUT",
        help="write results as JSON (omni_accum.bench.RESULT_SCHEMA; each arm's status: ok, failed or wrong views; "
        "the table's p50 interval and ratio column with its interval), "
        "atomically (an existing file's mode kept): a symlink at OUT is replaced, not written through; an existing "
        "file that is no bench result (a policy, notes) is refused and left untouched. Ctrl-C "
        "writes the buckets finished "
        '("complete": false)',
    )
    p.add_argument(
        "--plot",
        action=OnceAction,
        metavar="OUT.png",
        help="log-log plot of step latency vs context length (needs matplotlib); the extension gives the format "
        "(.png, .svg, .pdf, ...); written atomically as --json is",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet)
        return Path(a).resolve() == Path(b).resolve()


def _trace_inputs(trace: str | None) -> list[tuple[str, str]]:
    """What ``--trace`` reads: a capture file, or every file of a capture folder (its captures, and its ``salt``,
    which the capture's hashed ids depend on): ``--json DIR/capture-....jsonl`` overwrote the capture replayed.
    Given one capture file, the ``capture-*`` files and ``salt`` beside it are kept too (the rest of its capture)."""
    if not trace:
        return []
    if not os.path.isdir(trace):  # one capture file: the capture's other files beside it are its data too
        folder = os.path.dirname(trace) or "."
        try:
            names = sorted(e.name for e in os.scandir(folder) if e.name == "salt" or e.name.startswith("capture-"))
        except OSError:
            names = []
        beside = [(f"a file of the capture beside --trace {trace}", os.path.join(folder, n)) for n in names]
        return [("the --trace capture file", trace), *beside]
    try:
        names = sorted(e.name for e in os.scandir(trace) if e.is_file())
    except OSError:  # the capture was read already: nothing left unreadable here to overwrite
        return []
    return [(f"a file of the --trace folder {trace}", os.path.join(trace, n)) for n in names]


def _overwrite_problem(args: argparse.Namespace, wl: Any) -> str | None:
    """Why ``--json``/``--plot`` would overwrite an input of the run, or None."""
    from omni_accum import bench
    from omni_accum.policy.sources import probe  # a name no file can have (long policy text) is no file

    outputs = [(option, path) for option, path in (("--json", args.json), ("--plot", args.plot)) if path]
    inputs = [("the --workload file", args.workload)] if probe(args.workload, "is_file") else []
    inputs += [(f"the policy file of arm {f!r}", f) for f in bench.arm_policy_files(wl, args.arms)]
    if wl.policy and probe(wl.policy, "is_file"):
        inputs.append(("the workload's policy file", wl.policy))
    inputs += _trace_inputs(args.trace)
    for option, out in outputs:
        for what, path in inputs:
            if Path(out).exists() and _same_file(out, path):
                return f"{option} {out} is {what} ({path}); writing it would overwrite an input of the run"
    return None


def _usage_error(problem: str) -> int:
    print(f"omni-accum bench: error: {problem}", file=sys.stderr)
    return 2


def _wire_options_problem(args: argparse.Namespace) -> str | None:
    """An option given for another wire than ``--wire`` (it would be ignored), or one ``--wire arena`` ignores."""
    given = lambda name: getattr(args, name, None) not in (None, False)  # noqa: E731
    for wire, names in (
        ("arena", ("arena_wait",)),
        ("mooncake", ("mooncake_master", "mooncake_metadata", "mooncake_segment", "mooncake_occupancy")),
    ):
        stray = [f"--{n.replace('_', '-')}" for n in names if given(n)]
        if stray and args.wire != wire:
            verb = "needs" if len(stray) == 1 else "need"
            return f"{', '.join(stray)} {verb} --wire {wire} (this run's wire: {args.wire})"
    if args.wire == "arena":
        stray = [f"--{n.replace('_', '-')}" for n in ("arms", "plot", "per_key", "view_hop") if given(n)]
        if args.through != "direct":
            stray.append(f"--through {args.through}")
        if stray:
            return (
                f"--wire arena takes none of {', '.join(stray)}: it compares its own arms (arena, connector, shm) "
                "and prints its table (options it takes: --workload, --context-lens, --concurrency, --repeats, "
                "--steps, --threads, --arena-wait, --json)"
            )
    return None


def run(args: argparse.Namespace) -> int:
    from omni_accum import bench
    from omni_accum.bench.workloads import load_workload
    from omni_accum.errors import PolicyError

    problem = _wire_options_problem(args)
    if problem:
        return _usage_error(problem)
    problem = trace_cli.empty_input_problem(args)  # as --arms '': never the default workload by accident
    if problem:
        return _usage_error(problem)
    if args.trace and args.workload:
        return _usage_error(f"--trace {args.trace} and --workload {args.workload}: give one, not both")
    if args.pair and not args.trace:
        return _usage_error(f"--pair {args.pair} needs --trace DIR")
    if args.trace and args.wire in ("arena", "mooncake"):  # their two processes replay C streams of equal length
        return _usage_error(f"--trace with --wire {args.wire}: a capture replays over the inproc, serializer or shm "
                            "wire (a bucket's captured requests, C at a time); the two-process wires replay workloads")
    args.workload = args.workload or DEFAULT_WORKLOAD

    for path, option in ((args.json, "--json"), (args.plot, "--plot")):
        problem = output_path_problem(path, option)
        if problem:
            return _usage_error(problem)
    if args.json and args.plot and _same_file(args.json, args.plot):
        return _usage_error(f"--json {args.json} and --plot {args.plot} are the same file; give two paths")
    problem = bench.context_lens_problem(args.context_lens or [])
    problem = problem or bench.runner.concurrency_problem(args.concurrency or [])
    if problem:
        return _usage_error(problem)
    if args.steps is not None and args.steps > MAX_ROWS:
        return _usage_error(f"--steps {args.steps}: at most {MAX_ROWS} decode steps")
    if args.plot:
        bench.require_matplotlib()  # fail before measuring
        problem = bench.plot_path_problem(args.plot)
        if problem:
            return _usage_error(problem)
    if args.trace:
        wl = trace_cli.trace_workload(args, "omni-accum bench")
        if wl is None:
            return 2
    else:
        problem = workload_problem(args.workload)
        if problem:
            return _usage_error(problem)
        wl = load_workload(args.workload)
    problem = bench.workload_policy_problem(wl, args.workload)
    if problem:
        return _usage_error(problem)
    problem = _overwrite_problem(args, wl)  # an input of the run first: the more telling message
    for path, option in ((args.json, "--json"), (args.plot, "--plot")):
        problem = problem or (path and not_an_output_problem(path, option))  # a policy, notes: not an output
    if problem:
        return _usage_error(problem)
    if args.steps is not None:
        wl = wl.model_copy(update={"decode_steps": args.steps})
    try:
        arms = bench.build_arms(wl, args.arms, warn=sys.stderr, through=args.through)
    except bench.UnknownArmError as e:
        return _usage_error(str(e))
    except PolicyError as e:  # an arm's policy file that does not load: an input named on the command line
        if args.arms is None:  # the default arms: the one policy among them is the workload's own
            return _usage_error(f"{args.workload or f'workload {wl.name!r}'}: field 'policy': {e}")
        return _usage_error(f"--arms: {e}")
    apply_threads(args.threads)
    if args.wire == "arena":
        from omni_accum.arena.pairbench import run_cli as run_arena

        return run_arena(args, wl)
    if args.wire == "mooncake":
        from omni_accum.bench.mooncake import run_cli

        return run_cli(args, wl, arms)
    if args.through == "vllm-omni":
        from omni_accum.bench.replay import VllmOmniUnavailable

        try:
            import omni_accum.integrations.vllm_omni.replay  # noqa: F401 - registers THROUGH["vllm-omni"]
        except ImportError as e:
            raise VllmOmniUnavailable(
                f"--through vllm-omni needs vllm-omni 0.30.0 (pip install 'omni-accum[vllm]'): {e}"
            ) from e
    hop = f", view hop {args.view_hop}" if args.view_hop else ""
    via = " through vllm-omni's runner transport" if args.through == "vllm-omni" else ""
    print(f"workload {wl.name}: arms {', '.join(arms)}; wire {args.wire}{hop}{via}; {args.repeats} repeats", flush=True)

    from omni_accum.bench.results import interrupted_json

    finished = bench.BenchRun(wl, args.wire, args.view_hop, args.repeats)  # what a Ctrl-C leaves to --json

    def show(results: list[Any]) -> None:
        finished.results += results
        print()
        print(bench.format_table(results, decode_steps=wl.decode_steps), flush=True)

    try:
        result = bench.run_bench(
            wl,
            arms,
            context_lens=args.context_lens,
            concurrency=args.concurrency,
            wire=args.wire,
            view_hop=args.view_hop,
            repeats=args.repeats,
            per_key=args.per_key,
            through=args.through,
            progress=None if args.no_progress else sys.stderr,
            on_bucket=show,
        )
    except KeyboardInterrupt:
        interrupted_json(finished, args.json)  # the buckets finished, marked incomplete, as tune keeps its own
        raise
    if result.delta_roundtrip_us is not None:
        print(f"\none decode delta's serializer round trip: {result.delta_roundtrip_us:.1f} us (alone, warm)")
        for line in bench.roundtrip_lines(result):
            print(line)
    if args.json:
        bench.write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        bench.plot(result, args.plot)
        print(f"wrote {args.plot}")
    wrong = sorted({r.arm for r in result.results if not r.correct and r.arm != "upstream"})
    for line in bench.upstream_notes(result.results, args.through):
        print(line)
    if wrong:
        print(
            f"omni-accum bench: error: arm(s) {', '.join(wrong)} gave views differing from the cat reference",
            file=sys.stderr,
        )
        return 1
    return 0
