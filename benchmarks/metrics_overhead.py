"""Per-chunk cost of omni-accum's metrics inside vllm-omni: the send hook (encode) and a real runner
transport's ``_accumulate_payload`` hook, with metrics on and off, interleaved in one process.

    .venv/bin/python benchmarks/metrics_overhead.py [--steps 2000] [--rounds 7] [--block 1]

Prints the p50 per chunk of each arm (metrics on and off on alternate steps of the same requests, or in
alternate runs of ``--block`` steps) and their difference (the target is <= 2 us per chunk at p50), also
for the send hook and the receive hook apart (each stage's process pays its own), then the
metrics work alone on the same chunk, and the capture arm (``OMNI_ACCUM_CAPTURE``: a record per chunk, paired
on/off in the send hook, then the record alone on each side). The "off" arm is what ``OMNI_ACCUM_METRICS=0``
runs (no merge callback).
On a shared 2-core VM the difference moves by a few tenths of a us from run to run, and reads about 1 us
higher with ``--block 64`` (metrics on for 64 chunks in a row, as a deployment runs them) than alternating.
The capture arm pairs the send hook only (the runner receive hook timed above records nothing: the receive
record is the chunk adapter's commit hook), so its paired figure is what the sending stage's process pays; the
receive record is timed alone, on a chunk that carries a foreign clock stamp (read every time; in a deployment
only a timed chunk carries one) and on one without, and "both" adds the two records alone, to set beside the metrics' "both".
Bytes per record are counted in the files the capture's rotation kept (until 2026-12-02 the count divided those
files' bytes by every record written, rotated-away ones included, and read about half the true size).
A benchmark, not a test: it asserts nothing and is not collected by pytest.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from types import SimpleNamespace

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000, help="decode steps per round (default 2000)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per arm (default 7)")
    ap.add_argument(
        "--block",
        type=int,
        default=1,
        help="steps in a row with metrics on, then as many off (default 1: alternate steps). A deployment runs "
        "with metrics on or off for good: blocks of 64 measure that steady state, and read higher here",
    )
    args = ap.parse_args()

    from vllm_omni.worker.omni_connector_model_runner_mixin import OmniConnectorModelRunnerMixin

    from omni_accum.integrations import vllm_omni as vo
    from omni_accum.integrations.vllm_omni.binding import Binding
    from omni_accum.integrations.vllm_omni.binding_settings import DEFAULT_ADAPTER_KEYS
    from omni_accum.integrations.vllm_omni.send import encode_payload
    from omni_accum.policy import load_policy

    policy = load_policy("qwen3-omni")
    vo.install(policy)
    cfg = SimpleNamespace(
        stage_id=1,
        worker_type="ar",
        async_chunk=True,
        custom_process_next_stage_input_func=None,
        stage_connector_config={"name": "SharedMemoryConnector", "extra": {}},
    )
    runner = type("Runner", (OmniConnectorModelRunnerMixin,), {})()
    runner.init_omni_connectors(cfg)
    tx = Binding(policy, DEFAULT_ADAPTER_KEYS, "bench")
    g = torch.Generator().manual_seed(0)
    consts = {k: torch.randn(1, 1, 2048, generator=g).bfloat16() for k in ("tts_bos", "tts_eos", "tts_pad")}
    rows = [torch.randn(1, 2048, generator=g).bfloat16() for _ in range(64)]
    prefill = torch.randn(1000, 2048, generator=g).bfloat16()

    def one_round(tag: str, first_on: bool, statics: bool) -> dict[str, list[float]]:
        """One request of ``args.steps`` decode chunks, metrics switched on and off step by step (paired:
        both arms see the same request, buffer sizes and machine load). ``statics``: every decode chunk
        carries the three tts embeddings and the speaker again (send_once leaves them off); else only
        the first chunk does, as vllm-omni 0.30.0's thinker-to-talker stream sends them."""
        rx = runner._omni_accum_binding if "_omni_accum_binding" in runner.__dict__ else None
        for b in (tx, rx):
            if b is not None:
                b.metrics.on = True
        rid = f"{tag}"
        chunk = {"embed": {"prefill": prefill, **consts}, "meta": {"finished": torch.tensor(False)}, "speaker": "Ethan"}
        runner._accumulate_payload(rid, encode_payload(tx, rid, chunk))
        rx = runner._omni_accum_binding
        merged = rx.metrics.merged
        out: dict[str, list[float]] = {"on": [], "off": [], "on_send": [], "off_send": [], "on_recv": [], "off_recv": []}
        for i in range(args.steps):
            on = ((i // args.block) % 2 == 0) is first_on
            tx.metrics.on = rx.metrics.on = on
            rx.receiver.on_merge = merged if on else None  # as OMNI_ACCUM_METRICS=0 leaves it
            chunk = {"embed": {"decode": rows[i % 64]}, "meta": {"finished": torch.tensor(False)}}
            if statics:
                chunk["embed"].update(consts)
                chunk["speaker"] = "Ethan"
            t0 = time.perf_counter()
            wire = encode_payload(tx, rid, chunk)
            t1 = time.perf_counter()
            runner._accumulate_payload(rid, wire)
            t2 = time.perf_counter()
            arm = "on" if on else "off"
            out[arm].append(t2 - t0)
            out[arm + "_send"].append(t1 - t0)  # what the sending stage's process pays
            out[arm + "_recv"].append(t2 - t1)  # what the receiving stage's process pays
        tx.metrics.on = rx.metrics.on = True
        rx.receiver.on_merge = merged
        runner._send_side_request_payload.pop(rid)
        tx.sender.release(rid)
        tx.live_send.discard(rid)
        tx.sent_once.pop(rid, None)
        return out

    for statics, what in ((True, "tts embeddings and speaker in every chunk, left off by send_once"),
                          (False, "nothing left off: the statics in the first chunk only, as 0.30.0 sends them")):
        one_round("warm", True, statics)
        rounds = [one_round(f"r{r}-{statics}", r % 2 == 0, statics) for r in range(args.rounds)]
        p50 = {arm: statistics.median(statistics.median(r[arm]) for r in rounds) * 1e6 for arm in ("on", "off")}
        def diff(part: str = "") -> float:
            return statistics.median(statistics.median(r["on" + part]) - statistics.median(r["off" + part]) for r in rounds) * 1e6

        print(
            f"p50 per chunk (send hook + runner receive hook, decode step, qwen3-omni, {what}; {args.steps} steps x "
            f"{args.rounds} rounds, metrics on and off in alternate runs of {args.block} step(s)): on {p50['on']:.1f} us, off "
            f"{p50['off']:.1f} us ({p50['on'] / p50['off']:.3f}x); median of the rounds' differences {diff():+.2f} us "
            f"(the send hook's {diff('_send'):+.2f} us, the receive hook's {diff('_recv'):+.2f} us: each stage's process pays its own)"
        )
    isolated(tx, runner._omni_accum_binding, consts, rows[0], args.rounds)
    capture_cost(tx, rows, args.steps, args.rounds)
    vo.uninstall()


def capture_cost(tx, rows, steps: int, rounds: int) -> None:
    """The capture arm (``OMNI_ACCUM_CAPTURE``): the send hook with a capture attached and without, on alternate
    decode chunks of the same requests (paired, as the metrics above), then the record alone per decode chunk on
    each side (the send hook's record and the receive hook's, which also reads the hand-off stamp)."""
    import tempfile
    import timeit

    from omni_accum.capture import ChunkRecorder, CaptureWriter
    from omni_accum.integrations.vllm_omni import capture
    from omni_accum.integrations.vllm_omni.send import encode_payload

    folder = tempfile.mkdtemp(prefix="oa-capture-bench-")
    w = CaptureWriter(folder, "0")
    kind_of = capture._kind_of(tx)
    cap = capture.Capture(w, ChunkRecorder(w, "send", "0->1", kind_of), ChunkRecorder(w, "recv", "0->1", kind_of))
    fin = torch.tensor(False)
    diffs = []
    for r in range(rounds):
        rid = f"cap-{r}"
        on_t, off_t = [], []
        for i in range(steps):
            on = (i % 2 == 0) is (r % 2 == 0)
            tx.__dict__["_capture"] = cap if on else None
            chunk = {"embed": {"decode": rows[i % 64]}, "meta": {"finished": fin, "is_segment_finished": fin}}
            t0 = time.perf_counter()
            encode_payload(tx, rid, chunk)
            (on_t if on else off_t).append(time.perf_counter() - t0)
        diffs.append((statistics.median(on_t) - statistics.median(off_t)) * 1e6)
        tx.sender.release(rid)
        tx.live_send.discard(rid)
        tx.sent_once.pop(rid, None)
    tx.__dict__.pop("_capture", None)
    chunk = {"embed": {"decode": rows[0]}, "meta": {"finished": fin, "is_segment_finished": fin}}
    n = 20000
    send_us = min(timeit.repeat(lambda: capture.sent(cap, "iso", chunk, None), number=n, repeat=max(3, rounds))) / n
    raw = [0, time.monotonic_ns(), "x", "d"]
    recv_us = min(timeit.repeat(lambda: capture.received(cap, None, "iso", chunk, raw), number=n,
                                repeat=max(3, rounds))) / n
    plain_us = min(timeit.repeat(lambda: capture.received(cap, None, "iso", chunk, 0), number=n,
                                 repeat=max(3, rounds))) / n  # a chunk with no stamp (a bare mask)

    def p50_us(fn) -> float:
        """p50 of single timed calls minus the p50 of timing nothing (the clock's own cost): the same
        statistic as the paired figures, for one side alone."""
        pc = time.perf_counter
        calls, empty = [], []
        for _ in range(n):
            t0 = pc()
            fn()
            t1 = pc()
            t2 = pc()
            empty.append(pc() - t2)
            calls.append(t1 - t0)
        return (statistics.median(calls) - statistics.median(empty)) * 1e6

    p50_send = p50_us(lambda: capture.sent(cap, "iso", chunk, None))
    p50_recv = p50_us(lambda: capture.received(cap, None, "iso", chunk, raw))
    p50_plain = p50_us(lambda: capture.received(cap, None, "iso", chunk, 0))
    w.close()
    size = lines = 0
    for f in os.listdir(folder):  # the files rotation kept (the older ones are gone with their lines)
        if f.startswith("capture-"):
            with open(os.path.join(folder, f), "rb") as fh:
                data = fh.read()
            size, lines = size + len(data), lines + data.count(b"\n")
    for f in os.listdir(folder):
        os.unlink(os.path.join(folder, f))
    os.rmdir(folder)
    print(
        f"capture (OMNI_ACCUM_CAPTURE), per decode chunk: the send hook with a capture minus without, median of "
        f"{rounds} rounds' p50 differences {statistics.median(diffs):+.2f} us; the record alone (best of "
        f"{max(3, rounds)} x {n}): send side {send_us * 1e6:.2f} us, receive side {recv_us * 1e6:.2f} us "
        f"({plain_us * 1e6:.2f} us on a chunk without a stamp, as most decode chunks are), "
        f"both {(send_us + recv_us) * 1e6:.2f} us; at p50 ({n} single calls timed): send side {p50_send:.2f} us, "
        f"receive side {p50_recv:.2f} us ({p50_plain:.2f} us without a stamp) (target: <= 2 us per chunk at p50); "
        f"{size / max(1, lines):.0f} bytes per record"
    )


def isolated(tx, rx, consts, row, rounds: int) -> None:
    """The metrics work alone, on the same decode chunk: what the send hook adds (its one walk over the
    chunk, which numbers the keys and finds those left off in any case, with metrics on minus the same
    walk with them off: the keys on the wire and the bytes send_once kept off) and what the receive hook
    adds (its keys, counted in the merge's own pass over them, and the merge time). The hooks' own p50 above varies by more than this between rounds
    on a shared machine."""
    import timeit

    from omni_accum.integrations.vllm_omni.marker import MARKERS, OMITTED_KEY, SendTable

    chunk = {"embed": {"decode": row, **consts}, "meta": {"finished": torch.tensor(False)}, "speaker": "Ethan"}
    wire = {"embed": {"decode": row}, "meta": {"finished": chunk["meta"]["finished"]}, OMITTED_KEY: 30}
    table = SendTable()
    tx.metrics.sent(table, chunk, chunk, tx.strategy_name, MARKERS, table.kept)  # numbers the six keys, as a first chunk
    n = 20000

    def per_call(fn) -> float:
        return min(timeit.repeat(fn, number=n, repeat=max(3, rounds))) / n * 1e6

    def send() -> None:
        tx.metrics.sent(table, chunk, wire, tx.strategy_name, MARKERS, table.kept)

    plain = {"embed": {"decode": row}, "meta": {"finished": chunk["meta"]["finished"]}}  # nothing left off

    def send_plain() -> None:
        tx.metrics.sent(table, plain, plain, tx.strategy_name, MARKERS, table.kept)

    rx.metrics.on = True
    tx.metrics.on = False
    walk, walk_plain = per_call(send), per_call(send_plain)
    tx.metrics.on = True
    send_on, plain_on = per_call(send), per_call(send_plain)
    # The receive hook counts in the merge's own pass (Receiver.on_merge -> Recorder.merged over the
    # (slot, value) pairs the merge already holds), which also adds the merge time to the histogram.
    rid = "isolated"
    fin = chunk["meta"]["finished"]
    rx.receiver.merge(rid, {"embed": {"decode": row}, "meta": {"finished": fin}})
    ent = rx.receiver._lookup(rid).entries
    pairs = [(ent["embed"]["decode"], row), (ent["meta"]["finished"], fin)]  # the wire's keys, as the merge holds them
    rec = rx.metrics

    clock = time.perf_counter

    def receive() -> None:  # the runner hook's steady path: the merge counts the keys and records its time
        rec.arm(clock())
        rec.merged(pairs)

    recv = per_call(receive)
    rx.metrics.on = False
    recv_off = per_call(receive)
    rx.metrics.on = True
    rx.receiver.release(rid)
    s, r = send_on - walk, recv - recv_off
    print(
        f"metrics work alone, per decode chunk (best of {max(3, rounds)} x {n}): send side {s:.2f} us "
        f"({send_on:.2f} us walk with metrics on, {walk:.2f} us off), receive side {r:.2f} us, "
        f"both {s + r:.2f} us (target: <= 2 us)\n"
        f"  a decode chunk with nothing left off (vllm-omni 0.30.0's talker stream sends its send_once keys "
        f"in the first chunk only): send side {plain_on - walk_plain:.2f} us, both {plain_on - walk_plain + r:.2f} us"
    )


if __name__ == "__main__":
    main()
