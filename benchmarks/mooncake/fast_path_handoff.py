"""Hand-off of an 8k chunk 0 between two processes on one host: vllm-omni 0.30.0's ``MooncakeStoreConnector``
(``plain``: the whole payload serialized) against ``OmniAccumMooncakeConnector`` (``fast``: the two
append-key tensors through registered buffers, the rest serialized; ``staged``: the same with a 64 MiB
buffer, so that each tensor is copied through it instead of registered itself).

    .venv/bin/python benchmarks/mooncake/fast_path_handoff.py --repeats 15 [--rows 8000] [--json out.json]

Starts its own Mooncake master and holder on free 127.0.0.1 ports and a stage host (vllm-omni imported
once); a sender and a receiver process, each with one connector of each arm. Per repeat and arm (order
rotated every repeat, one warm-up put per arm first): the sender times from just before ``put`` until the
receiver's ``get`` has returned the payload (both read the same monotonic clock), told through a pipe
after the put. The receiver checks every tensor of every hand-off bit for bit against the payload it
regenerates from the same seed. ``plain`` objects are removed after each hand-off, untimed (0.30.0 leaves
them); ``fast`` removes its own on the receiving side (timed, as part of its get).

Prints the median hand-off per arm and their ratio (``fast / plain``); every service and process it
started is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

ARMS = ("plain", "fast", "staged")
KEYS = ("thinker_embeddings", "thinker_hidden_states")  # chunk 0's two [P+1, 2048] bf16 tensors


def payload(seed: int, rows: int) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {k: torch.randn(rows, 2048, generator=g).to(torch.bfloat16) for k in KEYS}
    out["thinker_input_ids"] = list(range(rows))
    out["finished"] = torch.tensor(False)
    return out


def connectors(stage_id: int, extra: dict[str, Any], buffer: str) -> dict[str, Any]:
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory  # noqa: PLC0415
    from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec  # noqa: PLC0415

    from omni_accum.integrations.vllm_omni import mooncake_compat  # noqa: PLC0415

    mooncake_compat.activate()  # the omni_accum_mooncake entry point: compatibility step + registration
    plain = OmniConnectorFactory.create_connector(
        ConnectorSpec(name="MooncakeStoreConnector", extra={**extra, "stage_id": stage_id})
    )
    out = {"plain": plain}
    for arm, size in (("fast", buffer), ("staged", "64MiB")):
        out[arm] = OmniConnectorFactory.create_connector(
            ConnectorSpec(
                name="OmniAccumMooncakeConnector",
                extra={**extra, "stage_id": stage_id, "mooncake_buffer_bytes": size},
            )
        )
        out[arm].append_test = lambda path, value: path in KEYS
    return out


def schedule(repeats: int) -> list[tuple[str, int]]:
    out = [(a, -1) for a in ARMS]
    for rep in range(repeats):
        k = rep % len(ARMS)
        out += [(a, rep) for a in ARMS[k:] + ARMS[:k]]
    return out


def sender(*, pipes: Any, extra: dict[str, Any], rows: int, repeats: int, buffer: str, tag: str) -> dict[str, Any]:
    from omni_accum.bench.stage_host import pipe_ends  # noqa: PLC0415

    rd, wr = pipe_ends(pipes, "tx")
    conns = connectors(0, extra, buffer)
    data = payload(0, rows)
    res: dict[str, Any] = {a: {"us": [], "bytes": 0, "parts": 0} for a in ARMS}
    try:
        for arm, rep in schedule(repeats):
            key = f"{tag}-{arm}-{rep}_0_0"
            t0 = time.perf_counter_ns()
            ok, size, meta = conns[arm].put("0", "1", key, data)
            if not ok:
                raise RuntimeError(f"{arm}: put of {key} failed")
            wr.write(json.dumps([arm, key, rep]) + "\n")
            wr.flush()
            ans = rd.readline().split()
            if not ans or ans[0] != "ok":
                raise RuntimeError(f"receiver: {' '.join(ans) or 'gone'}")
            t1 = int(ans[1])
            if arm == "plain":  # untimed
                conns[arm].store.remove(conns[arm]._make_key(key, "0", "1"), True)  # untimed
            if rep >= 0:
                res[arm]["us"].append((t1 - t0) / 1000.0)
                res[arm]["bytes"] = size
                res[arm]["parts"] = len((meta or {}).get("mooncake_parts", []))
        wr.write("null\n")
        wr.flush()
        res["fast_health"] = conns["fast"].health()
    finally:
        for c in conns.values():
            c.close()
    return res


def receiver(*, pipes: Any, extra: dict[str, Any], rows: int, buffer: str, **_: Any) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    from omni_accum.bench.stage_host import pipe_ends  # noqa: PLC0415

    rd, wr = pipe_ends(pipes, "rx")
    conns = connectors(1, extra, buffer)
    want = payload(0, rows)
    checked = 0
    try:
        for line in rd:
            msg = json.loads(line)
            if msg is None:
                break
            arm, key, _ = msg
            got = conns[arm].get("0", "1", key)
            t1 = time.perf_counter_ns()
            if got is None:
                wr.write(f"error {arm}: nothing for {key}\n")
                wr.flush()
                continue
            obj = got[0]
            bad = [
                k
                for k in KEYS
                if obj[k].dtype != want[k].dtype
                or obj[k].shape != want[k].shape
                or not torch.equal(obj[k].view(torch.uint8), want[k].view(torch.uint8))
            ]
            if bad or obj["thinker_input_ids"] != want["thinker_input_ids"] or bool(obj["finished"]):
                wr.write(f"error {arm}: {key} differs ({', '.join(bad) or 'the small values'})\n")
            else:
                checked += 1
                wr.write(f"ok {t1}\n")
            wr.flush()
    finally:
        for c in conns.values():
            c.close()
    return {"checked": checked}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8000, help="prefill rows of chunk 0 (default 8000: ~66 MB)")
    ap.add_argument("--repeats", type=int, default=15, help="timed hand-offs per arm (default 15)")
    ap.add_argument("--buffer", default="16MiB",
                    help="mooncake_buffer_bytes of the fast arm (default 16MiB, the connector's: each 32.8 MB "
                         "tensor of the default 8000 rows, 8000 x 2048 x 2 bytes, is registered itself and goes in 2 "
                         "parts of at most 16 MiB); the staged arm's is 64MiB (each tensor copied through the "
                         "staging buffer)")
    ap.add_argument("--stage-segment", default="0",
                    help="store memory each stage connector contributes: 0 (the default: a holder process owns it "
                         "all, as the tests) or at least 16MiB, Mooncake's smallest segment (256MiB: as the deploy "
                         "fragment, where the fast path puts into its own); MB is 10^6 bytes, MiB 2^20")
    ap.add_argument("--json", help="write the samples here")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

    from omni_accum.bench.mooncake import Job, MooncakeServices, StageHost, mooncake_problem  # noqa: PLC0415

    problem = mooncake_problem()
    if problem:
        print(f"fast_path_handoff: {problem}", file=sys.stderr)
        return 2
    from omni_accum.bench.mooncake import parse_size, segment_problem  # noqa: PLC0415
    from omni_accum.errors import OmniAccumError  # noqa: PLC0415

    try:
        segment = 0 if args.stage_segment.strip() == "0" else parse_size(args.stage_segment)
    except OmniAccumError as e:  # a user's mistake: one line, no traceback
        print(f"fast_path_handoff: --stage-segment: {e}", file=sys.stderr)
        return 2
    problem = segment_problem(segment, f"--stage-segment {args.stage_segment!r}", zero_ok=True)
    if problem:
        print(f"fast_path_handoff: {problem}", file=sys.stderr)
        return 2
    with MooncakeServices(segment_bytes=1 << 30) as svc:
        host = StageHost(pythonpath=[os.path.dirname(os.path.abspath(__file__))]).start()
        try:
            kw = {"extra": svc.connector_extra(segment=segment), "rows": args.rows, "repeats": args.repeats, "buffer": args.buffer,
                  "tag": f"fp{os.getpid()}"}  # fmt: skip
            tx, rx = host.run(
                [Job("fast_path_handoff:sender", kw), Job("fast_path_handoff:receiver", kw)], timeout=1200
            )
        finally:
            host.stop()
    med = {a: statistics.median(tx[a]["us"]) for a in ARMS}
    print(f"chunk 0: {args.rows} x 2048 bf16 x 2 ({tx['plain']['bytes'] / 1e6:.1f} MB serialized), "
          f"{args.repeats} hand-offs per arm, {rx['checked']} checked bit for bit, stage segment {segment} bytes "
          f"(fast parts in {tx['fast_health']['local_segment'] or 'the segment the master chooses'})")  # fmt: skip
    for a in ARMS:
        us = sorted(tx[a]["us"])
        print(f"  {a:6s} median {med[a] / 1000:8.2f} ms  min {us[0] / 1000:8.2f}  max {us[-1] / 1000:8.2f}  "
              f"put bytes {tx[a]['bytes']}  parts {tx[a]['parts']}")  # fmt: skip
    print(f"  ratio fast / plain (medians): {med['fast'] / med['plain']:.3f}; "
          f"staged / plain: {med['staged'] / med['plain']:.3f}")
    print(f"  fast health: fallbacks {tx['fast_health']['fallbacks']}, remove_errors {tx['fast_health']['remove_errors']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": args.rows, "repeats": args.repeats, "buffer": args.buffer, "sender": tx, "receiver": rx,
                       "median_us": med, "ratio": med["fast"] / med["plain"],
                       "ratio_staged": med["staged"] / med["plain"]}, f, indent=1)  # fmt: skip
    return 0 if rx["checked"] == len(ARMS) * (args.repeats + 1) else 1


if __name__ == "__main__":
    sys.exit(main())
