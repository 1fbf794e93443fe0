"""``tune()``: the whole tuning run — buckets, budget, resume, atomic writes, verification."""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from omni_accum.errors import OmniAccumError, PolicyError
from omni_accum.tuner.paths import overwrite_problem
from omni_accum.policy.environment import current_fingerprint, table_mismatches
from omni_accum.policy.loader import dump_policy, load_policy
from omni_accum.policy.model import Policy
from omni_accum.policy.tuned import TunedCell
from omni_accum.tuner.buckets import DEFAULT_CONCURRENCY, DEFAULT_CONTEXT_LENS, QUICK_CONCURRENCY, QUICK_CONTEXT_LENS
from omni_accum.tuner.buckets import check_edges, table_size_problem
from omni_accum.tuner.candidates import Candidate, candidate_set_hash
from omni_accum.tuner.files import (
    OutputBusy,
    OutputLock,
    hand_written_problem,
    output_format,
    output_problem,
    partial_path,
    read_resumable,
    resume_source,
    settings_mismatches,
    write_atomic,
)
from omni_accum.tuner.core import (
    VERIFY_ROUNDS,
    BucketOutcome,
    KeyDecision,
    TuneError,
    all_candidates,
    reference_arm,
    tunable_keys,
    tune_bucket,
    verify_bucket,
)
from omni_accum.bench.workload_presets import DEFAULT_WORKLOAD
from omni_accum.bench.workloads import Workload, load_workload


@dataclass
class TuneOptions:
    """Options of one tuning run (see ``omni-accum tune --help``)."""

    workload: str | Workload = DEFAULT_WORKLOAD
    out: Path = Path("tuned-policy.yaml")
    context_lens: list[int] | None = None
    concurrency: list[int] | None = None
    wire: str = "inproc"
    device: str = "cpu"
    budget_s: float | None = None
    """Stop starting new buckets after this many seconds, once one bucket was measured (None or 0: no budget)."""
    quick: bool = False
    resume: bool = False
    base: str = "default"
    decode_steps: int | None = None
    max_rounds: int | None = None
    memory_factor: float = 2.0
    min_gain_us: float = 1.0
    verify: bool | None = None
    """Time the tuned policy against upstream per bucket (default: on, off with ``quick``)."""


@dataclass
class TuneResult:
    policy: Policy
    out: Path
    outcomes: list[BucketOutcome] = field(default_factory=list)
    elapsed_s: float = 0.0
    complete: bool = True
    stopped: str | None = None
    previous: bool = False
    """``--out`` existed before the run (a partial run leaves it as it was)."""


def input_overwrite_problem(opts: TuneOptions) -> str | None:
    """Why ``--out`` would overwrite a file the run reads (workload, ``--base``), or None; ``--resume`` reads --out."""
    inputs = [("the --workload file", opts.workload), ("the --base policy file", opts.base)]
    return overwrite_problem([("--out", opts.out)], inputs)


def _serialise(policy: Policy, wl: Workload, opts: TuneOptions, complete: bool) -> str:
    if output_format(opts.out) == "json":
        return dump_policy(policy, "json")  # JSON has no comments: the description says where it came from
    return _header(wl, opts, complete) + dump_policy(policy)


def _header(wl: Workload, opts: TuneOptions, complete: bool) -> str:
    from datetime import datetime

    from omni_accum.policy.fingerprint import device_name

    state = "complete" if complete else "PARTIAL (run the same command again with --resume to finish)"
    when = datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")  # (not ``time``: tests replace its clock)
    return (
        f"# Tuned by `omni-accum tune` on workload {wl.name!r} over the {opts.wire!r} wire ({state}),\n"
        f"# {when} on {device_name(opts.device)}.\n"
        "# Explicit rules beat the tuned table; the table is ignored (with a warning) when the fingerprint\n"
        f"# does not match the running environment. Inspect with: omni-accum tune --show {opts.out}\n"
    )


def build_output(
    base: Policy,
    wl: Workload,
    opts: TuneOptions,
    cells: list[TunedCell],
    edges: tuple[list[int], list[int]],
    fingerprint: dict,
    skipped: dict[str, str],
    complete: bool,
) -> Policy:
    data = base.model_dump(mode="json", exclude={"tuned"})
    data["description"] = f"tuned on {wl.name} ({opts.wire} wire); baseline: {opts.base}"
    data["tuned"] = {
        "context_len_edges": edges[0],
        "concurrency_edges": edges[1],
        "cells": [c.model_dump(mode="json") for c in cells],
        "fingerprint": fingerprint,
        "workload": wl.name,
        "wire": opts.wire,
        "complete": complete,
        "skipped": skipped,
    }
    return load_policy(data)


def content_hash(model: Any) -> str:
    """Short hash of what a workload or policy says (its ``description`` left out: it changes no measurement)."""
    data = model.model_dump(mode="json", exclude={"description"})
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def tune_settings(
    opts: TuneOptions, wl: Workload, base: Policy, *, decode_steps: int, step_samples: int, rounds: int
) -> dict[str, Any]:
    """Every setting that changes what is measured or decided, recorded as ``tuned.fingerprint.settings``.

    ``--resume`` reuses buckets only when all of them match (bucket edges name the buckets themselves;
    ``--budget-s`` and ``--verify`` change neither the measurements nor the decisions).
    """
    import torch

    return {
        "workload": wl.name,
        "workload_sha256": content_hash(wl),
        "base": str(opts.base),
        "base_sha256": content_hash(base),
        "wire": opts.wire,
        "device": opts.device,
        "threads": torch.get_num_threads(),
        "decode_steps": opts.decode_steps if opts.decode_steps is not None else (
            f"auto (a bucket's captured requests, each cut to 1 + {step_samples} chunks)" if hasattr(wl, "replay_note")
            else f"auto (at least {decode_steps}, >= {step_samples} step samples per round)"),  # fmt: skip
        "max_rounds": rounds,
        "params_grid": not opts.quick,
        "memory_budget": opts.memory_factor,
        "min_gain_us": opts.min_gain_us,
    }


def _resumable(opts: TuneOptions, wl: Workload, fp: dict, log: TextIO | None) -> dict[tuple[int, int], list[TunedCell]]:
    if not opts.resume:
        return {}
    src = resume_source(opts.out)  # the partial file, else --out; another user's is refused
    if src is None:
        return {}
    how = "give another --out, or remove it first (tune replaces only a tuned policy)"
    try:
        old = read_resumable(src, opts.out)
    except PolicyError as e:
        first = e.errors[0] if e.errors else str(e)
        raise TuneError(f"--resume: cannot read {src} as a policy ({first}); left it untouched: {how}") from e
    t = old.tuned
    if t is None:
        raise TuneError(f"--resume: {src} is not a tuned policy (no tuned table); left it untouched: {how}")
    why: list[str] = []
    recorded = t.fingerprint.get("settings")
    if not isinstance(recorded, dict):
        why.append("it records no tuning settings (written by an older omni-accum), so they cannot be checked")
        if t.workload != wl.name or t.wire != opts.wire:
            why.append(f"it was tuned on {t.workload!r}/{t.wire!r}, not {wl.name!r}/{opts.wire!r}")
    else:
        why += settings_mismatches(recorded, fp["settings"])
    if not why and t.fingerprint.get("candidates") != fp.get("candidates"):  # (a setting's change changes it too)
        why.append("its candidate set differs (the strategies or plugins installed changed)")
    diffs = table_mismatches(t, opts.device)
    if diffs:
        why.append("it was measured in another environment (" + "; ".join(diffs) + ")")
    if why and t.complete:  # the user asked to reuse it: measuring everything again is not what --resume means
        msg = f"{src} is a complete tuned policy that this run would not reuse ({'; '.join(why)})"
        raise TuneError(f"--resume: {msg}; left it untouched: drop --resume to tune it again, or give another --out")
    if why:  # (a partial file: the run replaces it; repeat the options it was tuned with to finish it instead)
        _say(log, f"--resume: not reusing {src}, measuring every bucket again: " + "; ".join(why) + " (to finish it "
             "instead, stop this run and give the options it was tuned with)")
        return {}
    _say(log, f"--resume: reusing the buckets of {src}")
    by_bucket: dict[tuple[int, int], list[TunedCell]] = {}
    for c in t.cells:
        by_bucket.setdefault((c.context_len, c.concurrency), []).append(c)
    return by_bucket


def _say(log: TextIO | None, msg: str) -> None:
    if log is not None:
        print(msg, file=log, flush=True)


def tune(opts: TuneOptions, *, progress: TextIO | None = None, log: TextIO | None = None) -> TuneResult:
    """Run the tuner; write ``opts.out`` atomically after every bucket. See :mod:`omni_accum.tuner.core`."""
    t0 = time.monotonic()
    if opts.device not in ("cpu", "cuda"):
        raise TuneError(f"--device {opts.device!r}: choose cpu or cuda")
    if opts.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise TuneError("--device cuda: no CUDA device is available here (torch.cuda.is_available() is False)")
    if not (opts.memory_factor > 0 and math.isfinite(opts.memory_factor)):
        raise TuneError(f"--memory-budget must be a number > 0, got {opts.memory_factor}")
    if not (opts.min_gain_us >= 0 and math.isfinite(opts.min_gain_us)):
        raise TuneError(f"--min-gain-us must be a number >= 0, got {opts.min_gain_us}")
    if opts.budget_s is not None and not opts.budget_s >= 0:
        raise TuneError(f"--budget-s must be >= 0 seconds (0: no budget), got {opts.budget_s}")
    problem = output_problem(opts.out) or input_overwrite_problem(opts)
    problem = problem or (None if opts.resume else hand_written_problem(opts.out))  # --resume says it its way
    if problem:
        raise TuneError(problem)
    try:
        lock = OutputLock(opts.out).acquire()
    except OutputBusy as e:
        raise TuneError(str(e)) from None
    except OSError as e:
        raise TuneError(f"--out {opts.out}: cannot lock it ({e.strerror or e})") from None
    try:
        return _run(opts, t0, progress, log)
    finally:
        lock.release()


def _run(opts: TuneOptions, t0: float, progress: TextIO | None, log: TextIO | None) -> TuneResult:
    wl = load_workload(opts.workload)
    try:
        cls = check_edges(
            "--context-lens", list(opts.context_lens or (QUICK_CONTEXT_LENS if opts.quick else DEFAULT_CONTEXT_LENS))
        )
        concs = check_edges(
            "--concurrency", list(opts.concurrency or (QUICK_CONCURRENCY if opts.quick else DEFAULT_CONCURRENCY))
        )
    except ValueError as e:
        raise TuneError(str(e)) from e
    if opts.decode_steps is not None and opts.decode_steps > wl.decode_steps:  # it was capped, and recorded as given
        raise TuneError(
            f"--decode-steps {opts.decode_steps}: workload {wl.name!r} has {wl.decode_steps} decode steps per request; "
            f"give at most {wl.decode_steps}"
        )
    steps = opts.decode_steps if opts.decode_steps is not None else (3 if opts.quick else 8)
    target = 12 if opts.quick else 24
    captured = hasattr(wl, "replay_note")  # tune --trace: every bucket replays its captured requests

    def bucket_workload(c: int) -> Workload:
        # Enough decode steps that every arm gets ~target step samples per round at any concurrency; a captured
        # request is cut to 1 + target chunks in every bucket alike (said per bucket).
        n = steps if opts.decode_steps is not None else (target if captured else max(steps, -(-target // c)))
        return wl.model_copy(update={"decode_steps": min(wl.decode_steps, n)})

    wl_t = bucket_workload(max(concs))
    rounds = opts.max_rounds or (2 if opts.quick else 3)
    base = load_policy(opts.base)
    arms = base.arm_policies()
    if arms:  # a policy with an ab section runs as its first arm in bench, tune and explain
        first, base = next(iter(arms.items()))
        _say(log, f"--base {opts.base}: an A/B split; tuning from its first arm, {first!r}")
    keys, skipped = tunable_keys(wl_t, base, cls)
    if not keys:
        few = opts.decode_steps is not None and any("one chunk only" in v for v in skipped.values())
        hint = f" (--decode-steps {opts.decode_steps} leaves too few decode chunks: give 2 or more)" if few else ""
        if any("baseline's rules" in v for v in skipped.values()):
            hint += f"; --base {opts.base}'s rules decide keys the table could: give a --base without them (default)"
        raise TuneError(
            f"nothing to tune on workload {wl.name!r}: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()) + hint
        )
    if (problem := table_size_problem(len(cls), len(concs), len(keys))) is not None:
        raise TuneError(problem)
    cands = all_candidates(wl_t, keys, grid=not opts.quick)
    fp = current_fingerprint(
        opts.device, candidate_set_hash(cands, __import__("omni_accum.manager").manager.get_manager())
    )
    fp["settings"] = tune_settings(opts, wl, base, decode_steps=steps, step_samples=target, rounds=rounds)
    reuse = _resumable(opts, wl, fp, log)
    buckets = [(cl, c) for cl in cls for c in concs]
    if gone := sorted(set(reuse) - set(buckets)):  # another grid than the interrupted run's: said, not silently lost
        _say(log, f"--resume: {len(gone)} bucket(s) of the file are not in this run's --context-lens/--concurrency and "
             "are left out of the new table: " + ", ".join(f"{cl}x{c}" for cl, c in gone))
    from omni_accum.bench.runner import BenchError, bucket_memory_problem
    from omni_accum.bench.streams import bucket_steps

    sizes = {"steps": "--decode-steps"}
    problem = next((p for cl, c in buckets if (p := bucket_memory_problem(bucket_workload(c), cl, c, sizes))), None)
    if problem:  # before any bucket: the kernel's out-of-memory killer would end the run without a word (exit 1)
        raise BenchError(problem)
    verify = (not opts.quick) if opts.verify is None else opts.verify
    ref = reference_arm() if verify else None
    bar = None
    if progress is not None:
        from omni_accum.bench.runner import Progress

        n_arms = sum(1 + len(v) for v in cands.values())
        # Pessimistic (every arm for every round); clear decisions end sooner and the bar jumps ahead.
        total = sum((n_arms * rounds + (2 * VERIFY_ROUNDS if ref is not None else 0)) * bucket_steps(bucket_workload(c), cl, c)
                    for cl, c in buckets)  # fmt: skip
        bar = Progress(total, progress)
    result = TuneResult(policy=base, out=Path(opts.out))
    result.previous = Path(opts.out).is_file()
    cells: list[TunedCell] = []
    # The budget only stops *new* buckets, and never before one was measured in this run: every run
    # (with --resume, every next run) makes progress and leaves a valid file.
    deadline = t0 + opts.budget_s if opts.budget_s else None
    measured = written = 0
    try:
        for i, (cl, c) in enumerate(buckets):
            old = reuse.get((cl, c), [])
            if old and {x.key for x in old} >= set(keys):
                outcome = BucketOutcome(cl, c, reused=True)
                for x in old:
                    if x.key in keys:
                        outcome.decisions[x.key] = KeyDecision(  # with a kept baseline's why (it was lost)
                            x.key, Candidate(x.strategy, dict(x.params)), x.baseline, x.margin, x.ci,
                            dict(x.timings_us), dict(x.excluded), dict(x.peak_bytes), x.reason,
                        )  # fmt: skip
            else:
                if deadline is not None and measured and time.monotonic() > deadline:
                    result.stopped = f"budget of {opts.budget_s:g} s spent after {i} of {len(buckets)} buckets"
                    break
                measured += 1
                outcome = tune_bucket(
                    bucket_workload(c),
                    base,
                    keys,
                    cands,
                    context_len=cl,
                    concurrency=c,
                    wire=opts.wire,
                    max_rounds=rounds,
                    memory_factor=opts.memory_factor,
                    min_gain_us=opts.min_gain_us,
                    device=opts.device,
                    progress=bar.advance if bar else None,
                )
            cells += outcome.cells()
            done = i + 1 == len(buckets)
            policy = build_output(base, wl, opts, cells, (cls, concs), fp, skipped, complete=done)
            if ref is not None and not outcome.reused:
                outcome.verify = verify_bucket(
                    bucket_workload(c),
                    policy,
                    ref,
                    context_len=cl,
                    concurrency=c,
                    wire=opts.wire,
                    device=opts.device,
                    progress=bar.advance if bar else None,
                )
            result.outcomes.append(outcome)
            if done:  # (an interrupt in the complete table's write leaves no partial file beside it)
                written = len(cells)
            _write(opts, result, _serialise(policy, wl, opts, done), done)
            result.policy, written = policy, len(cells)
            took = f"{outcome.rounds} round(s), {outcome.seconds:.2f} s" if not outcome.reused else "reused (--resume)"
            took += f"; {bucket_workload(c).replay_note(cl, c)}" if captured else ""  # type: ignore[attr-defined]
            _say(log, f"bucket context_len={cl} concurrency={c}: {took}")
    except KeyboardInterrupt:
        result.stopped = "interrupted"
        result.complete = False
        if len(cells) > written:  # a bucket measured, interrupted in its verification: kept for --resume
            result.policy = build_output(base, wl, opts, cells, (cls, concs), fp, skipped, complete=False)
            _write(opts, result, _serialise(result.policy, wl, opts, False), False)
        raise
    except (MemoryError, RuntimeError) as e:  # a bucket's allocation failed anyway: one line, as bench says it
        from omni_accum.bench.runner import allocation_detail, is_allocation_failure

        if not is_allocation_failure(e):
            raise
        kept = f"; the buckets finished so far are in {result.out}" if result.out == partial_path(opts.out) else ""
        raise BenchError(
            f"context_len={cl} concurrency={c}: out of memory{allocation_detail(e)}; give shorter --context-lens, "
            f"a lower --concurrency or fewer --decode-steps{kept}"
        ) from e
    finally:
        if bar is not None:
            bar.close()
        result.elapsed_s = time.monotonic() - t0
    result.complete = result.stopped is None
    if not result.complete and cells:
        policy = build_output(base, wl, opts, cells, (cls, concs), fp, skipped, complete=False)
        _write(opts, result, _serialise(policy, wl, opts, False), False)
        result.policy = policy
    return result


def _write(opts: TuneOptions, result: TuneResult, text: str, complete: bool) -> None:
    """A complete table goes to ``--out`` (and the partial file beside it goes); an unfinished one only to
    the partial file, so a finished ``--out`` is never replaced by a partial table."""
    part = partial_path(opts.out)
    if complete:
        write_atomic(opts.out, text)
        part.unlink(missing_ok=True)
        result.out = Path(opts.out)
    else:
        write_atomic(part, text, follow_link=False, own=True)  # tune's own file: a link there is replaced
        result.out = part


__all__ = ["OmniAccumError", "TuneOptions", "TuneResult", "input_overwrite_problem", "output_format", "output_problem"]
__all__ += ["partial_path", "tune", "write_atomic"]
