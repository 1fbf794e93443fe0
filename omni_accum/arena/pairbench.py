"""``omni-accum bench --wire arena``: sender and receiver in two processes, the arena against ``shm``.

The parent process is the sending stage, a spawned child the receiving stage (one for the whole run, told each
bucket in turn: :mod:`omni_accum.arena.pairrecv`); both replay the same
workload streams (N requests round-robin). Each step runs in lock step, and each side times only its
own work: the sender its encode + write + publish, the receiver its take + merge + the consumer's
read. A step's latency is the sum (waiting for the other process and the control pipe are not
counted, so a loaded machine's scheduling delays are left out of both arms alike). How the processes
wait for each other (``--arena-wait``) still matters: ``block`` sleeps in the control pipe, so each
timed step starts in a process the OS just woke (on a VM, with caches other work may have used), as
vllm-omni 0.30.0's receiving thread does (it waits 1 ms whenever a poll finds nothing); ``spin`` polls
it and stays on its CPU (the best case). Arms:

* ``arena``: :class:`~omni_accum.arena.ArenaSender` -> :class:`~omni_accum.arena.ArenaReceiver`;
* ``connector``: as ``shm``, over ``OmniAccumArenaConnector`` (the arena as a vllm-omni connector:
  the append keys' rows written once into the request's append chains, which the receiver's
  ``prealloc`` takes as its buffer; other tensors copied into the arena and out again; the rest in
  vllm-omni's msgpack encoding);
* ``shm``: the workload's policy (omni-accum ``Sender.encode``), vllm-omni 0.30.0's
  ``SharedMemoryConnector`` ``put`` then ``get`` in the other process, ``Receiver.merge``.

The receiver checks every request's final view against the ``torch.cat`` reference (untimed), and each
``delta`` read (the rows a chunk added, which the consumer takes) against that chunk. No arm here drops
the rows taken (the arena keeps them in place in its slab), so a ``delta`` key's state grows as ``cat``'s.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_accum.arena._common import leaves
from omni_accum.arena.pairrecv import ArmFailed, ReceiverProcess, clock, connector, policy_of
from omni_accum.bench.streams import append_length_hints, build_stream, chunk_plans
from omni_accum.bench.workloads import Workload
from omni_accum.context import StreamContext

ARMS = ("arena", "connector", "shm")


def _arena_bytes(streams: list[list[dict[str, Any]]]) -> int:
    """Slab space for every request of ``streams`` at once, in pages: the connector's append chains hold up to
    about twice their rows (headroom, a move as they grow) and a request's chains until the receiver lets go."""
    n = sum(
        v.numel() * v.element_size() + 8192
        for s in streams
        for c in s
        for _, v in leaves(c)
        if isinstance(v, torch.Tensor)
    )
    return int(n * 2.5) + (64 << 20)


@dataclass
class PairResult:
    arm: str
    context_len: int
    concurrency: int
    prefill_us: list[float] = field(default_factory=list)  # the first chunk of each request
    decode_us: list[float] = field(default_factory=list)
    totals_us: list[float] = field(default_factory=list)  # per request
    mismatch: str | None = None
    error: str | None = None

    def p50(self, xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------------------------------------- #
# The sending process (this one)
# ---------------------------------------------------------------------------------------------- #


@dataclass
class _SendBucket:
    """The sending side of one bucket."""

    wl: Workload
    context_len: int
    concurrency: int
    name: str  # the bucket's arena (and, with "c", its connector's region)
    streams: list[Any]
    tx: Any = None  # its ArenaSender
    conns: dict[str, Any] = field(default_factory=dict)  # arm -> the vllm-omni connector it puts to

    def __post_init__(self) -> None:
        self.plans = chunk_plans(self.wl, self.context_len)
        self.hints = append_length_hints(self.wl, self.streams[0])

    def close(self) -> None:
        try:
            if self.tx is not None:
                self.tx.close()
        finally:
            for c in self.conns.values():
                c.close()


def run_pair(
    wl: Workload,
    context_len: int,
    concurrency: int,
    *,
    repeats: int = 3,
    arms: tuple[str, ...] = ARMS,
    wait: str = "block",
    receiver: ReceiverProcess | None = None,
) -> list[PairResult]:
    """Measure ``arms`` for one bucket, interleaved round by round (the first round untimed: warm-up).
    ``wait``: how both processes wait for each other between timed steps (``block`` or ``spin``);
    ``receiver``: the run's receiving process (one of its own, stopped at the end, when None). An arm that
    fails (its connector cannot be made, a view cannot be had) is given up with its ``error`` and no times; the
    others go on."""
    streams = [build_stream(wl, context_len, r) for r in range(concurrency)]
    b = _SendBucket(wl, context_len, concurrency, f"bench_{os.getpid()}_{context_len}_{concurrency}", streams)
    rxp = receiver or ReceiverProcess(wait == "spin")
    results = {a: PairResult(a, context_len, concurrency) for a in arms}
    try:
        try:
            rxp.bucket(wl, context_len, concurrency, b.name, _arena_bytes(streams))
        except ArmFailed as e:  # the receiving process or the bucket's set-up there: no arm can run
            for res in results.values():
                res.error = str(e)
            return [results[a] for a in arms]
        for rep in range(repeats + 1):
            for arm in arms[rep % len(arms) :] + arms[: rep % len(arms)]:
                res = results[arm]
                if res.error:
                    continue
                try:
                    _round(rxp, b, arm, res, rep)
                except Exception as e:  # noqa: BLE001 - this arm's row says why; the other arms go on
                    res.error = str(e) if isinstance(e, ArmFailed) else f"{type(e).__name__}: {e}"
                    res.prefill_us, res.decode_us, res.totals_us = [], [], []  # an arm given up reports no time
    finally:
        try:
            b.close()
        finally:
            if receiver is None:
                rxp.close()
    return [results[a] for a in arms]


def _round(rxp: ReceiverProcess, b: _SendBucket, arm: str, res: PairResult, rep: int) -> None:
    """One round of ``arm`` in bucket ``b``: every request's chunks, step by step with the receiver (round 0
    untimed: warm-up)."""
    if arm != "arena" and arm not in b.conns:  # made before the receiver's side: a failure here costs it nothing
        b.conns[arm] = connector(arm, 0, b.name, 0)
        if arm == "connector":  # append chains, as omni-accum's send hook has the connector make them
            from omni_accum.engine import Receiver

            sel = Receiver(policy_of(b.wl))
            b.conns[arm].append_test = lambda p, v, sel=sel: "append" in sel.select(p, v, sel.context)[1].kinds
    if arm == "arena" and b.tx is None:
        from omni_accum.arena.sender import ArenaSender

        b.tx = ArenaSender(b.name, {k.path: k.kind for k in b.wl.keys}, length_hints=b.hints)
    rxp.ask("begin", arm)
    policy_tx = None
    if arm != "arena":
        from omni_accum.engine import Sender

        ctx = StreamContext(context_len=b.context_len, concurrency=b.concurrency, length_hints=b.hints)
        policy_tx = Sender(policy_of(b.wl), context=ctx)
    totals = [0.0] * b.concurrency
    for plan in b.plans:
        for r in range(b.concurrency):
            rid = f"oa{os.getpid()}-{arm}-{rep}-{r}"
            chunk = b.streams[r][plan.index]
            key = f"{rid}_0_{plan.index}"  # vllm-omni's put key: request, stage, chunk
            t0 = clock()
            if arm == "arena":
                b.tx.send(rid, chunk)
            else:
                ok, _, meta = b.conns[arm].put("0", "1", key, policy_tx.encode(rid, chunk))
                if not ok or (arm == "connector" and not (meta or {}).get("arena")):
                    raise RuntimeError(f"{type(b.conns[arm]).__name__}.put did not go through {arm}: {key}")
            dt = (clock() - t0) / 1000.0
            if plan.is_last:
                if arm == "arena":
                    b.tx.done(rid)
                else:
                    policy_tx.release(rid)
                    if arm == "connector":
                        b.conns[arm].release_request(rid)  # as omni-accum's sender-release hook does
            took, mismatch = rxp.ask("step", arm, rid, r, plan.is_last, key)
            dt += took
            if mismatch and res.mismatch is None:
                res.mismatch = f"request {r}: {mismatch}"
            if rep == 0:
                continue  # warm-up round
            (res.prefill_us if plan.is_prefill else res.decode_us).append(dt)
            totals[r] += dt
    if rep:
        res.totals_us.extend(totals)


def format_pair_table(rows: list[PairResult]) -> str:
    """One line per arm: prefill hand-off, decode step p50/p99, per-request total, ratios vs shm."""
    base = {(r.context_len, r.concurrency): r for r in rows if r.arm == "shm"}
    out = [
        f"{'bucket':<12} {'wire':<9} {'prefill us':>11} {'step p50 us':>12} {'step p99 us':>12} {'req total ms':>13}"
        "  vs shm (prefill, step, total)  correct"
    ]
    for r in rows:
        bucket = f"{r.context_len} x c{r.concurrency}"
        if r.error:
            out.append(f"{bucket:<12} {r.arm:<9} {'-':>11} {'-':>12} {'-':>12} {'-':>13}  {'':<29}  ERROR {r.error}")
            continue
        dec = sorted(r.decode_us)
        p99 = dec[min(len(dec) - 1, int(0.99 * (len(dec) - 1) + 0.5))] if dec else float("nan")
        pre, step, tot = r.p50(r.prefill_us), r.p50(r.decode_us), r.p50(r.totals_us) / 1000.0
        b = base.get((r.context_len, r.concurrency))
        vs = ""
        if b is not None and r is not b and not b.error:
            base_tot = b.p50(b.totals_us) / 1000.0
            vs = f"{pre / b.p50(b.prefill_us):.3f}x {step / b.p50(b.decode_us):.3f}x {tot / base_tot:.3f}x"
        ok = "yes" if r.mismatch is None else f"NO: {r.mismatch}"
        out.append(f"{bucket:<12} {r.arm:<9} {pre:11.1f} {step:12.1f} {p99:12.1f} {tot:13.2f}  {vs:<29}  {ok}")
    return "\n".join(out)


def run_cli(args: Any, wl: Workload) -> int:
    """``omni-accum bench --wire arena``: every bucket, a table each; 1 when a view differs from the reference."""
    lens = args.context_lens or wl.default_context_lens()
    levels = args.concurrency or list(wl.concurrency)
    wait = getattr(args, "arena_wait", None) or "block"
    print(
        f"workload {wl.name}: wires arena, connector (OmniAccumArenaConnector), shm (SharedMemoryConnector); "
        f"policy {wl.policy or 'default'}; two processes, waiting for each other by {wait}; {args.repeats} repeats"
    )
    bad = False
    doc = {"wire": "arena", "workload": wl.name, "policy": wl.policy or "default", "wait": wait,
           "repeats": args.repeats, "complete": True, "stopped": None, "buckets": []}  # fmt: skip
    receiver = ReceiverProcess(wait == "spin")  # one for the run's buckets, started at the first
    try:
        for cl in lens:
            for c in levels:
                rows = run_pair(wl, cl, c, repeats=args.repeats, wait=wait, receiver=receiver)
                print()
                print(format_pair_table(rows), flush=True)
                bad = bad or any(r.mismatch or r.error for r in rows)
                doc["buckets"].append({"context_len": cl, "concurrency": c, "arms": [pair_record(r) for r in rows]})
    except KeyboardInterrupt:  # the buckets that finished, marked incomplete, as bench's other wires keep theirs
        from omni_accum.bench.results import interrupted_write

        def write() -> None:
            doc.update(complete=False, stopped="interrupted")
            _write_json(doc, args.json)

        interrupted_write(getattr(args, "json", None), len(doc["buckets"]), write)
        raise
    finally:
        receiver.close()
    if getattr(args, "json", None):
        _write_json(doc, args.json)
        print(f"\nwrote {args.json}")
    return 1 if bad else 0


def _write_json(doc: dict[str, Any], path: str) -> None:
    import json

    from omni_accum.tuner.files import write_atomic

    write_atomic(path, json.dumps(doc, indent=2) + "\n", follow_link=False)  # as bench's other --json


def pair_record(r: PairResult) -> dict[str, Any]:
    """One arm of one bucket for ``--json``: p50s (microseconds), every sample, and what went wrong."""
    def p50(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None  # JSON has no NaN

    return {
        "arm": r.arm,
        "prefill_us_p50": p50(r.prefill_us),
        "decode_us_p50": p50(r.decode_us),
        "total_us_p50": p50(r.totals_us),
        "prefill_us": r.prefill_us,
        "decode_us": r.decode_us,
        "totals_us": r.totals_us,
        "mismatch": r.mismatch,
        "error": r.error,
    }
