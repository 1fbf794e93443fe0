"""``omni-accum bench --wire arena``: sender and receiver in two processes, the arena against ``shm``.

The parent process is the sending stage, a spawned child the receiving stage; both replay the same
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

import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_accum.arena._common import leaves
from omni_accum.bench.reference import check_taken, check_view
from omni_accum.bench.streams import append_length_hints, build_stream, chunk_plans
from omni_accum.bench.workloads import Workload
from omni_accum.context import StreamContext

ARMS = ("arena", "connector", "shm")
_clock = time.perf_counter_ns


def _policy(wl: Workload) -> Any:
    from omni_accum.policy import load_policy

    return load_policy(wl.policy or "default")


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
# The receiving process
# ---------------------------------------------------------------------------------------------- #


def _connector(arm: str, stage_id: int, name: str, data_bytes: int) -> Any:
    """The vllm-omni connector of ``arm`` (``shm`` or ``connector``) for one side of the pair."""
    if arm == "shm":
        from omni_accum.integrations.vllm_omni.classes import shm_connector

        return shm_connector()({"stage_id": stage_id})
    from omni_accum.integrations.vllm_omni.arena_connector import ArenaConnector

    extra = {"stage_id": stage_id, "arena_name": f"{name}c", "ring_bytes": "4MiB"}
    return ArenaConnector({**extra, "arena_bytes": data_bytes} if data_bytes else extra)


class _Pipe:
    """One end of the control pipe; ``spin``: poll it instead of sleeping in ``recv`` (``--arena-wait``)."""

    def __init__(self, conn: Any, spin: bool) -> None:
        self.conn, self.spin = conn, spin
        self.send, self.poll = conn.send, conn.poll

    def recv(self) -> Any:
        if self.spin:
            poll = self.conn.poll
            while not poll(0):
                pass
        return self.conn.recv()


def _receiver_main(
    conn: Any, wl: Workload, cl: int, concurrency: int, name: str, data_bytes: int, spin: bool = False
) -> None:
    torch.set_num_threads(1)
    conn = _Pipe(conn, spin)
    from omni_accum.arena.receiver import ArenaReceiver
    from omni_accum.engine import Receiver

    streams = [build_stream(wl, cl, r) for r in range(concurrency)]
    reads = [(k.path, k.read) for k in wl.keys if k.read != "never"]
    ctx = StreamContext(context_len=cl, concurrency=concurrency, length_hints=append_length_hints(wl, streams[0]))
    rx = ArenaReceiver(name, data_bytes)
    conns: dict[str, Any] = {}  # arm -> the vllm-omni connector it gets from
    policy_rx = None
    conn.send("ready")
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "quit":
                break
            if cmd[0] == "begin":
                if cmd[1] != "arena":
                    if cmd[1] not in conns:
                        conns[cmd[1]] = _connector(cmd[1], 1, name, data_bytes)
                        conns[cmd[1]].get("0", "1", "create")  # the arena connector's receiver makes its region
                    policy_rx = Receiver(_policy(wl), context=ctx)
                conn.send("ok")
                continue
            _, arm, rid, r, last, key = cmd
            t0 = _clock()
            if arm == "arena":
                ev = rx.poll(30.0)
                if ev is None:
                    raise RuntimeError("arena: no chunk within 30 s")
                view = ev.view
            else:
                got = conns[arm].get("0", "1", key)
                view = policy_rx.merge(rid, got[0])
            chunk = streams[r][int(key.rsplit("_", 1)[1])]
            taken = []
            for path, how in reads:
                if how == "end" and not last:
                    continue
                top, _, qual = path.partition(".")
                if how == "delta" and (top not in chunk or (qual and qual not in chunk[top])):
                    continue  # taken with the chunk that carried it
                val = view[top][qual] if qual else view[top]
                if how == "newest_row" and len(val):
                    val = val[-1:]
                elif how == "delta":  # the rows this chunk added (each arm keeps them; none drops them)
                    val = val[-len(chunk[top][qual] if qual else chunk[top]) :]
                    taken.append((path, val))
            dt = (_clock() - t0) / 1000.0
            mismatch = check_taken(chunk, taken) if taken else None
            if last:
                mismatch = mismatch or check_view(wl, streams[r], view)
                if arm == "arena":
                    rx.release(rid)
                else:
                    policy_rx.release(rid)
            conn.send((dt, mismatch))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except Exception:  # noqa: BLE001, S110
            pass
    finally:
        rx.close()
        for c in conns.values():
            c.close()


# ---------------------------------------------------------------------------------------------- #
# The sending process (this one)
# ---------------------------------------------------------------------------------------------- #


def run_pair(
    wl: Workload,
    context_len: int,
    concurrency: int,
    *,
    repeats: int = 3,
    arms: tuple[str, ...] = ARMS,
    wait: str = "block",
) -> list[PairResult]:
    """Measure ``arms`` for one bucket, interleaved round by round (the first round untimed: warm-up).
    ``wait``: how both processes wait for each other between timed steps (``block`` or ``spin``)."""
    spin = wait == "spin"
    from omni_accum.arena.sender import ArenaSender

    streams = [build_stream(wl, context_len, r) for r in range(concurrency)]
    plans = chunk_plans(wl, context_len)
    kinds = {k.path: k.kind for k in wl.keys}
    hints = append_length_hints(wl, streams[0])
    name = f"bench_{os.getpid()}_{context_len}_{concurrency}"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_receiver_main,
        args=(child, wl, context_len, concurrency, name, _arena_bytes(streams), spin),
        daemon=True,
    )
    proc.start()
    parent = _Pipe(parent, spin)
    results = {a: PairResult(a, context_len, concurrency) for a in arms}
    conns: dict[str, Any] = {}  # arm -> the vllm-omni connector it puts to
    try:
        if not parent.poll(600) or parent.recv() != "ready":
            raise RuntimeError("the receiver process did not start")
        tx = ArenaSender(name, kinds, length_hints=hints)
        for rep in range(repeats + 1):
            for arm in arms[rep % len(arms) :] + arms[: rep % len(arms)]:
                res = results[arm]
                if res.error:
                    continue
                parent.send(("begin", arm))
                parent.recv()
                if arm != "arena" and arm not in conns:
                    conns[arm] = _connector(arm, 0, name, 0)
                    if arm == "connector":  # append chains, as omni-accum's send hook has the connector make them
                        from omni_accum.engine import Receiver

                        sel = Receiver(_policy(wl))
                        conns[arm].append_test = lambda p, v, sel=sel: "append" in sel.select(p, v, sel.context)[1].kinds
                policy_tx = None
                if arm != "arena":
                    from omni_accum.engine import Sender

                    policy_tx = Sender(
                        _policy(wl),
                        context=StreamContext(context_len=context_len, concurrency=concurrency, length_hints=hints),
                    )
                totals = [0.0] * concurrency
                for plan in plans:
                    for r in range(concurrency):
                        rid = f"oa{os.getpid()}-{arm}-{rep}-{r}"
                        chunk = streams[r][plan.index]
                        key = f"{rid}_0_{plan.index}"  # vllm-omni's put key: request, stage, chunk
                        t0 = _clock()
                        if arm == "arena":
                            tx.send(rid, chunk)
                        else:
                            ok, _, meta = conns[arm].put("0", "1", key, policy_tx.encode(rid, chunk))
                            if not ok or (arm == "connector" and not (meta or {}).get("arena")):
                                raise RuntimeError(f"{type(conns[arm]).__name__}.put did not go through {arm}: {key}")
                        dt = (_clock() - t0) / 1000.0
                        if plan.is_last:
                            if arm == "arena":
                                tx.done(rid)
                            else:
                                policy_tx.release(rid)
                                if arm == "connector":
                                    conns[arm].release_request(rid)  # as omni-accum's sender-release hook does
                        parent.send(("step", arm, rid, r, plan.is_last, key))
                        reply = parent.recv()
                        if reply[0] == "error":
                            raise RuntimeError(f"receiver: {reply[1]}")
                        dt += reply[0]
                        if reply[1] and res.mismatch is None:
                            res.mismatch = f"request {r}: {reply[1]}"
                        if rep == 0:
                            continue  # warm-up round
                        (res.prefill_us if plan.is_prefill else res.decode_us).append(dt)
                        totals[r] += dt
                if rep:
                    res.totals_us.extend(totals)
        tx.close()
        parent.send(("quit",))
        proc.join(60)
    finally:
        for c in conns.values():
            c.close()
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    return [results[a] for a in arms]


def format_pair_table(rows: list[PairResult]) -> str:
    """One line per arm: prefill hand-off, decode step p50/p99, per-request total, ratios vs shm."""
    base = {(r.context_len, r.concurrency): r for r in rows if r.arm == "shm"}
    out = [
        f"{'bucket':<12} {'wire':<9} {'prefill us':>11} {'step p50 us':>12} {'step p99 us':>12} {'req total ms':>13}"
        "  vs shm (prefill, step, total)  correct"
    ]
    for r in rows:
        dec = sorted(r.decode_us)
        p99 = dec[min(len(dec) - 1, int(0.99 * (len(dec) - 1) + 0.5))] if dec else float("nan")
        pre, step, tot = r.p50(r.prefill_us), r.p50(r.decode_us), r.p50(r.totals_us) / 1000.0
        b = base.get((r.context_len, r.concurrency))
        vs = ""
        if b is not None and r is not b:
            base_tot = b.p50(b.totals_us) / 1000.0
            vs = f"{pre / b.p50(b.prefill_us):.3f}x {step / b.p50(b.decode_us):.3f}x {tot / base_tot:.3f}x"
        ok = "ERROR " + r.error if r.error else ("yes" if r.mismatch is None else f"NO: {r.mismatch}")
        bucket = f"{r.context_len} x c{r.concurrency}"
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
    buckets = []
    for cl in lens:
        for c in levels:
            rows = run_pair(wl, cl, c, repeats=args.repeats, wait=wait)
            print()
            print(format_pair_table(rows), flush=True)
            bad = bad or any(r.mismatch or r.error for r in rows)
            buckets.append({"context_len": cl, "concurrency": c, "arms": [pair_record(r) for r in rows]})
    if getattr(args, "json", None):
        import json

        from omni_accum.tuner.files import write_atomic

        doc = {"wire": "arena", "workload": wl.name, "policy": wl.policy or "default", "wait": wait,
               "repeats": args.repeats, "buckets": buckets}  # fmt: skip
        write_atomic(args.json, json.dumps(doc, indent=2) + "\n", follow_link=False)  # as bench's other --json
        print(f"\nwrote {args.json}")
    return 1 if bad else 0


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
