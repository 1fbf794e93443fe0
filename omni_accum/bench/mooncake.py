"""``--wire mooncake``: the sender and the receiver in two OS processes, through vllm-omni 0.30.0's real
``MooncakeStoreConnector`` (Mooncake's distributed store).

The parts: :mod:`.mooncake_services` (a master and a holder process owning the memory, on free
127.0.0.1 ports), :mod:`.stage_host` (stage processes forked after one vllm-omni import),
:mod:`.mooncake_occupancy` (what 0.30.0 leaves pinned), and here :func:`measure_mooncake`: one bucket,
every arm, in one sender process and one receiver process, in lock step. The sender encodes a chunk,
``put``s it through the connector and tells the receiver; the receiver ``get``s it, merges it, reads
the consumer's keys and acknowledges. A step is timed in the sender, from before the encode to the
acknowledgement (two pipe hops included, the same for every arm); bytes through the store are the
connector's own ``put`` results. A request's objects are removed once it has finished (untimed), so a
long run does not fill the segment (vllm-omni 0.30.0 never removes them). ``python -m
omni_accum.bench.mooncake holder|stage-host`` runs the helper processes.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omni_accum.errors import OmniAccumError

from omni_accum.bench.mooncake_occupancy import Occupancy, format_occupancy, format_store_table, occupancy
from omni_accum.bench.mooncake_services import (
    HOST,
    MOONCAKE_ENV,
    MooncakeServices,
    MooncakeUnavailable,
    _alive,
    _holder_main,
    free_port,
    listening_ports,
    master_binary,
    mooncake_problem,
    parse_size,
    segment_problem,
)
from omni_accum.bench.stage_host import Job, StageFailed, StageHost, _host_main, _plan, make_connector, pipe_ends

__all__ = [
    "HOST",
    "MOONCAKE_ENV",
    "Job",
    "MooncakeArmResult",
    "MooncakeServices",
    "MooncakeUnavailable",
    "Occupancy",
    "StageFailed",
    "StageHost",
    "_alive",
    "format_occupancy",
    "format_store_table",
    "free_port",
    "listening_ports",
    "make_connector",
    "master_binary",
    "measure_mooncake",
    "mooncake_problem",
    "occupancy",
    "parse_size",
    "run_cli",
]


# ---------------------------------------------------------------------------------------------- #
# The bench pair
# ---------------------------------------------------------------------------------------------- #


@dataclass
class MooncakeArmResult:
    """Store figures of one arm in one bucket, beside its :class:`~omni_accum.bench.replay.ArmResult`."""

    arm: str
    context_len: int
    concurrency: int
    store_bytes_per_step: float = 0.0
    store_bytes_per_request: float = 0.0
    put_bytes_p50: float = 0.0
    puts: int = 0
    failed_puts: int = 0


def _schedule(labels: list[str], repeats: int, warmup: bool) -> list[tuple[str, int]]:
    """(arm, repeat) in replay order: a warm-up replay (repeat -1) per arm, then rotated rounds as measure()."""
    out = [(lab, -1) for lab in labels] if warmup else []
    for rep in range(repeats):
        k = rep % len(labels)
        out += [(lab, rep) for lab in labels[k:] + labels[:k]]
    return out


def _sender(
    *,
    pipes: list,
    extra: dict,
    wl: Any,
    arms: dict,
    cl: int,
    concurrency: int,
    repeats: int,
    warmup: bool,
    keep: bool,
    tag: str,
) -> dict[str, Any]:
    from omni_accum.bench.engines import make_engine  # noqa: PLC0415

    rd, wr = pipe_ends(pipes, "tx")
    ctx, streams = _plan(wl, cl, concurrency)
    conn = make_connector(0, extra)
    res: dict[str, Any] = {
        lab: {"samples": [], "totals": [], "bytes": 0, "puts": 0, "failed": 0, "steps": 0, "sizes": [], "error": None}
        for lab in arms
    }
    try:
        for lab, rep in _schedule(list(arms), repeats, warmup):
            if res[lab]["error"]:  # an arm that failed is reported as failed; the others go on
                continue
            try:
                engine = make_engine(arms[lab], ctx)
            except Exception as e:  # noqa: BLE001 - reported as the arm's failure
                res[lab]["error"] = f"{type(e).__name__}: {e}"
                continue
            rids = [f"{tag}-{lab}-{rep}-{r}" for r in range(concurrency)]
            wr.write(json.dumps(["begin", lab, rep]) + "\n")
            wr.flush()
            steps: list[float] = []
            totals = [0.0] * concurrency
            keys: list[list[str]] = [[] for _ in rids]
            n = len(streams[0])
            try:
                for i in range(n):
                    for r, rid in enumerate(rids):
                        chunk = streams[r][i]
                        _send_step(conn, engine, rd, wr, res[lab], chunk, rid, r, i, rep, steps, totals, keys[r])
                        if i == n - 1:  # the request has finished: its objects may go (untimed)
                            engine.release(rid)
                            if not keep:
                                conn.store.batch_remove(keys[r], True)
                                keys[r] = []
            except StageFailed:
                raise
            except Exception as e:  # noqa: BLE001 - this arm stops here, reported as failed
                res[lab]["error"] = str(e) if isinstance(e, _ArmFailed) else f"{type(e).__name__}: {e}"
                if not keep:  # what the unfinished requests put (untimed)
                    conn.store.batch_remove([k for ks in keys for k in ks], True)
            wr.write(json.dumps(["end", lab, rep]) + "\n")
            wr.flush()
            if not rd.readline().startswith("ok"):
                raise StageFailed("receiver gave no end-of-replay acknowledgement")
            engine.close()
            if rep >= 0 and not res[lab]["error"]:
                res[lab]["samples"].append(steps)
                res[lab]["totals"].append(statistics.fmean(totals))
                res[lab]["steps"] += len(steps)
        wr.write(json.dumps(["stop"]) + "\n")
        wr.flush()
    finally:
        conn.close()
    return res


class _ArmFailed(Exception):
    """The receiver failed on an arm's chunk (its message): the arm stops, the bench goes on."""


def _send_step(conn, engine, rd, wr, st, chunk, rid, r, i, rep, steps, totals, keys) -> None:  # noqa: ANN001, PLR0913
    """One timed step: encode, put, tell the receiver, wait for its acknowledgement."""
    t0 = time.perf_counter_ns()
    sent = engine.encode(rid, chunk)
    ok, size, _ = conn.put("0", "1", f"{rid}_{i}", sent)
    wr.write(json.dumps(["chunk", r, i, ok]) + "\n")
    wr.flush()
    ack = rd.readline()
    dt = (time.perf_counter_ns() - t0) / 1000.0
    keys.append(conn._make_key(f"{rid}_{i}", "0", "1"))
    if not ack:
        raise StageFailed("receiver: gone")
    if not ack.startswith("ok"):
        raise _ArmFailed(ack.strip().removeprefix("error ") or "the receiver failed")
    if rep >= 0:
        steps.append(dt)
        totals[r] += dt
        st["puts"] += 1
        st["bytes"] += int(size) if ok else 0
        if rep == 0:
            st["sizes"].append(int(size) if ok else 0)
        st["failed"] += 0 if ok else 1


def _receiver(
    *, pipes: list, extra: dict, wl: Any, arms: dict, cl: int, concurrency: int, tag: str, **_: Any
) -> dict[str, Any]:
    from omni_accum.bench.engines import make_engine  # noqa: PLC0415
    from omni_accum.bench.replay import _ABSENT, _Read, check_view  # noqa: PLC0415

    import torch  # noqa: PLC0415

    rd, wr = pipe_ends(pipes, "rx")
    ctx, streams = _plan(wl, cl, concurrency)
    reads = [_Read.of(k.path, k.read) for k in wl.keys if k.read != "never"]
    conn = make_connector(1, extra)
    out: dict[str, Any] = {lab: {"peak": 0, "mismatch": None, "error": None} for lab in arms}
    engine = None
    lab, rep = "", 0
    n = len(streams[0])
    try:
        for line in rd:
            msg = json.loads(line)
            if msg[0] == "stop":
                break
            if msg[0] == "begin":
                lab, rep = msg[1], msg[2]
                try:
                    engine = make_engine(arms[lab], ctx)
                except Exception as e:  # noqa: BLE001 - every chunk of the arm then says so, and the sender stops it
                    engine, out[lab]["error"] = None, f"{type(e).__name__}: {e}"
                continue
            if msg[0] == "end":
                if engine is not None:
                    engine.close()
                wr.write("ok\n")
                wr.flush()
                continue
            _, r, i, ok = msg
            try:
                rid = f"{tag}-{lab}-{rep}-{r}"
                got = conn.get("0", "1", f"{rid}_{i}") if ok else None
                if engine is None:
                    raise StageFailed(out[lab]["error"])
                if got is None:
                    raise StageFailed(f"nothing in the store for {rid}_{i}")
                view = engine.merge(rid, got[0])
                for rdk in reads:
                    if rdk.pattern == "end" and i != n - 1:
                        continue
                    val = rdk.lookup(view)
                    if val is not _ABSENT and rdk.pattern == "newest_row" and isinstance(val, (torch.Tensor, list)):
                        val = val[-1:]
                if i == n - 1:
                    st = out[lab]
                    st["peak"] = max(st["peak"], engine.nbytes())
                    if rep == 0 and st["mismatch"] is None and getattr(engine, "checks_views", True):
                        m = check_view(wl, streams[r], view)
                        if m:
                            st["mismatch"] = f"request {r}: {m}"
                    engine.release(rid)
                wr.write("ok\n")
            except Exception as e:  # noqa: BLE001 - the sender stops on it
                out[lab]["error"] = f"{type(e).__name__}: {e}"
                wr.write(f"error {type(e).__name__}: {e}\n")
            wr.flush()
    finally:
        conn.close()
    return out


def measure_mooncake(
    host: StageHost,
    services: MooncakeServices,
    workload: Any,
    arms: Mapping[str, Any],
    *,
    context_len: int | None = None,
    concurrency: int = 1,
    repeats: int = 3,
    warmup: bool = True,
    keep: bool = False,
    timeout: float = 600.0,
) -> tuple[list[Any], list[MooncakeArmResult]]:
    """One bucket: every arm through a sender process and a receiver process (see the module docstring).

    Returns ``(ArmResult per arm, MooncakeArmResult per arm)``; ``ArmResult.wire_bytes_per_step`` is the
    bytes ``put`` through the store per step, ``peak_bytes`` the receiver's accumulation state.
    """
    from omni_accum.bench.replay import ArmResult  # noqa: PLC0415
    from omni_accum.bench.workloads import load_workload  # noqa: PLC0415

    wl = load_workload(workload)
    cl = context_len or wl.context_len
    tag = f"oa{os.getpid()}-{time.monotonic_ns() % 10**9}"
    kw = {
        "extra": services.connector_extra(),
        "wl": wl,
        "arms": dict(arms),
        "cl": cl,
        "concurrency": concurrency,
        "repeats": repeats,
        "warmup": warmup,
        "keep": keep,
        "tag": tag,
    }
    tx, rx = host.run([Job(f"{__name__}:_sender", kw), Job(f"{__name__}:_receiver", kw)], timeout=timeout)
    n_chunks = wl.n_chunks(cl)
    results, store = [], []
    for lab in arms:
        s, r = tx[lab], rx[lab]
        res = ArmResult(lab, cl, concurrency, "mooncake", requests=concurrency, steps=n_chunks)
        res.samples_us = s["samples"]
        res.total_us_per_request = s["totals"]
        res.wire_bytes_per_step = s["bytes"] / s["puts"] if s["puts"] else 0.0
        res.peak_bytes = r["peak"]
        error = s["error"] or r["error"]  # the sender's: what it raised, or what the receiver said it raised
        if error or r["mismatch"]:
            res.correct = False
            res.mismatch = r["mismatch"] or error
            res.error = error
        results.append(res)
        reqs = max(1, concurrency * repeats)
        store.append(
            MooncakeArmResult(
                lab,
                cl,
                concurrency,
                res.wire_bytes_per_step,
                s["bytes"] / reqs,
                statistics.median(s["sizes"]) if s["sizes"] else 0.0,
                s["puts"],
                s["failed"],
            )
        )
    return results, store


def _cli_problem(args: Any) -> str | None:
    if args.view_hop or args.through != "direct" or args.plot:
        return "--wire mooncake takes neither --view-hop, --through vllm-omni nor --plot"
    if args.mooncake_metadata and not args.mooncake_master:
        return "--mooncake-metadata goes with --mooncake-master"
    if args.mooncake_occupancy and args.mooncake_master:
        return "--mooncake-occupancy starts a fresh master per arm; it does not take --mooncake-master"
    if args.mooncake_master:
        from omni_accum.integrations.vllm_omni.mooncake_settings import master_address_problem

        problem = master_address_problem(args.mooncake_master)
        if problem:
            return (f"--mooncake-master {args.mooncake_master!r} {problem}; give HOST:PORT (port 1 to 65535) of a "
                    "running mooncake_master")
    try:
        segment = parse_size(args.mooncake_segment or DEFAULT_SEGMENT)
    except OmniAccumError as e:
        return f"--mooncake-segment: {e}"
    too_small = segment_problem(segment, f"--mooncake-segment {args.mooncake_segment!r}")
    return too_small or mooncake_problem()  # before a master and a holder are started for it


#: ``--mooncake-segment``'s default.
DEFAULT_SEGMENT = "1GiB"


def run_cli(args: Any, wl: Any, arms: Mapping[str, Any]) -> int:
    """``omni-accum bench --wire mooncake`` (called by :mod:`omni_accum.cli.bench` once the arms are built)."""
    from omni_accum.bench.report import BenchRun, format_table, upstream_notes  # noqa: PLC0415
    from omni_accum.bench.results import interrupted_json  # noqa: PLC0415

    problem = _cli_problem(args)
    if problem:
        print(f"omni-accum bench: error: {problem}", file=sys.stderr)
        return 2
    segment = parse_size(args.mooncake_segment or DEFAULT_SEGMENT)
    cls = list(args.context_lens or wl.default_context_lens())
    concs = list(args.concurrency or wl.concurrency)
    metadata = args.mooncake_metadata
    if args.mooncake_master and not metadata:
        metadata = f"http://{args.mooncake_master.rsplit(':', 1)[0]}:8080/metadata"
    where = f"master {args.mooncake_master}" if args.mooncake_master else "own master"
    print(
        f"workload {wl.name}: arms {', '.join(arms)}; wire mooncake ({where}, sender and receiver in two processes); "
        f"{args.repeats} repeats",
        flush=True,
    )
    host = StageHost().start()
    results: list[Any] = []
    run = BenchRun(wl, "mooncake", None, args.repeats, results)
    try:
        if args.mooncake_occupancy:
            for cl in cls:
                occ = occupancy(host, wl, arms, context_len=cl, requests=args.mooncake_occupancy, segment_bytes=segment)
                print(
                    f"\ncontext_len={cl}: {args.mooncake_occupancy} requests per arm, one at a time, nothing removed, "
                    f"segment {segment} bytes"
                )
                print(format_occupancy(occ), flush=True)
            return 0
        with MooncakeServices(segment_bytes=segment, master=args.mooncake_master, metadata=metadata) as svc:
            for cl in cls:
                for c in concs:
                    res, st = measure_mooncake(host, svc, wl, arms, context_len=cl, concurrency=c, repeats=args.repeats)
                    results += res
                    run.store.update({(s.arm, s.context_len, s.concurrency): vars(s) for s in st})
                    print()
                    print(format_table(res, decode_steps=wl.decode_steps))
                    print(format_store_table(st), flush=True)
    except KeyboardInterrupt:
        interrupted_json(run, args.json)  # what finished, marked incomplete (or a line saying nothing was written)
        raise
    finally:
        host.stop()
    if args.json:
        from omni_accum.bench.results import write_json  # noqa: PLC0415

        write_json(run, args.json)
        print(f"wrote {args.json}")
    for line in upstream_notes(results):
        print(line)
    wrong = sorted({r.arm for r in results if not r.correct and r.arm != "upstream"})
    if wrong:
        print(
            f"omni-accum bench: error: arm(s) {', '.join(wrong)} gave views differing from the cat reference",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "holder":
        return _holder_main(argv[1], argv[2], int(argv[3]))
    if argv and argv[0] == "stage-host":
        return _host_main(argv[1:])
    print(
        "usage: python -m omni_accum.bench.mooncake holder MASTER METADATA SEGMENT | stage-host MODULE...",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
