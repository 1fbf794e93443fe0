"""The prefill hand-off of one Qwen3-Omni chunk 0 between two stage processes on one host, in one run:
vllm-omni 0.30.0's ``SharedMemoryConnector`` against ``OmniAccumArenaConnector`` (large tensors received
as views over the arena's pages; and with ``arena_view_bytes: off``, received as copies) against one
memcpy of the payload's tensor bytes.

    .venv/bin/python benchmarks/handoff_chunk0.py --rows 8000,32000 --repeats 5

The sending stage is this process, the receiving stage a spawned one. A chunk 0 is what vllm-omni's
``thinker2talker_async_chunk`` puts for a prompt of P tokens: an ``OmniPayloadStruct`` with
``embed.prefill`` and ``hidden_states.output`` ``[P, 2048]`` bf16 (33 MB each at 8k, 131 MB at 32k),
the three tts embeddings, the prompt's token ids (twice), the finished flag and the speaker. A hand-off
is the sender's ``put`` plus the receiver's ``get`` (each timed in its own process, in lock step; the
wait between them is not counted), until the payload is decoded and readable on the receiving side;
the receiver then drops it (untimed). Arms run interleaved, in a rotating order, each repeat; the first
round is a warm-up (printed as ``cold``: tmpfs pages and page tables touched for the first time) and
left out of the medians; ``arena-warm`` is ``arena`` with the connector's ``arena_warm: all`` (the region's
pages reserved and mapped on both sides when it is created / attached, before the first put), so its
``cold`` is what a server's first request pays with that setting. ``memcpy`` copies the payload's tensor bytes once into a buffer allocated and
touched beforehand (``memcpy-fresh``: into a new allocation, as a receiver that copies out does). Every
arm's first hand-off is checked bit for bit against the payload (untimed). One thread per process.
Read the ratios of one run (the 2-core development VM's absolute times move by 2x from run to run).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import torch
from _rows import rows_and_repeats  # benchmarks/, the folder of this script

ARMS = ("shm", "arena", "arena-warm", "arena-copy", "memcpy", "memcpy-fresh")
CONNECTOR_ARMS = ("shm", "arena", "arena-warm", "arena-copy")
_clock = time.perf_counter_ns


def chunk0(rows: int, seed: int = 0) -> Any:
    from vllm_omni.data_entry_keys import EmbeddingsStruct, HiddenStatesStruct, IdsStruct, MetaStruct, OmniPayloadStruct

    g = torch.Generator().manual_seed(seed)
    bf = lambda *shape: torch.randn(*shape, generator=g).bfloat16()  # noqa: E731
    ids = torch.randint(0, 150000, (rows,), generator=g).tolist()
    return OmniPayloadStruct(
        embed=EmbeddingsStruct(prefill=bf(rows, 2048), tts_bos=bf(1, 2048), tts_eos=bf(1, 2048), tts_pad=bf(1, 2048)),
        hidden_states=HiddenStatesStruct(output=bf(rows, 2048)),
        ids=IdsStruct(all=ids, prompt=ids),
        meta=MetaStruct(finished=torch.tensor(False)),
        speaker="Ethan",
    )


def _connector(arm: str, stage: int, name: str, arena_bytes: int) -> Any:
    if arm == "shm":
        from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

        return SharedMemoryConnector({"stage_id": stage})
    from omni_accum.integrations.vllm_omni.arena_connector import ArenaConnector

    suffix = {"arena": "v", "arena-warm": "w", "arena-copy": "c"}[arm]
    extra = {"stage_id": stage, "arena_name": f"{name}{suffix}", "arena_bytes": arena_bytes}
    if arm == "arena-warm":
        extra["arena_warm"] = "all"
    return ArenaConnector({**extra, "arena_view_bytes": "off"} if arm == "arena-copy" else extra)


def _join_warm(region: Any) -> None:
    t = getattr(region, "_warm_thread", None)
    if t is not None:
        t.join()


def _same(got: Any, want: Any) -> bool:
    from vllm_omni.distributed.omni_connectors.utils.serialization import OmniMsgpackDecoder, OmniMsgpackEncoder

    ref = OmniMsgpackDecoder().decode(OmniMsgpackEncoder().encode(want))

    def eq(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and set(a) == set(b) and all(eq(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))
        return a == b

    return eq(got, ref)


def _receiver(conn: Any, name: str, arena_bytes: int) -> None:
    torch.set_num_threads(1)
    conns = {arm: _connector(arm, 1, name, arena_bytes) for arm in CONNECTOR_ARMS}
    for c in conns.values():
        c.get("0", "1", "create")  # the arena connector's receiver creates its region
    _join_warm(conns["arena-warm"]._rx[("0", "1")].region)  # arena_warm: its pages given before the first put
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] == "quit":
            break
        _, arm, key, rows = cmd
        c = conns[arm]
        before = c.health().get("tensor_views", 0) if arm != "shm" else 0
        t0 = _clock()
        got = c.get("0", "1", key)
        while got is None:  # (a put is published before this is asked; never taken in practice)
            got = c.get("0", "1", key)
        dt = _clock() - t0
        ok = None
        if rows:  # check this one against the payload (untimed)
            ok = _same(got[0], chunk0(rows))
        views = (c.health().get("tensor_views", 0) if arm != "shm" else 0) - before  # tensors received as views
        del got
        conn.send((dt, ok, views))
    for c in conns.values():
        c.close()


def _tensor_bytes(payload: Any) -> list[torch.Tensor]:
    return [payload.embed.prefill, payload.hidden_states.output, payload.embed.tts_bos, payload.embed.tts_eos,
            payload.embed.tts_pad, payload.meta.finished]


def run(rows_list: list[int], repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    name = f"hb{os.getpid()}"
    biggest = max(rows_list) * 2048 * 2 * 2
    arena_bytes = 3 * biggest + (64 << 20)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, name, arena_bytes), daemon=True)
    proc.start()
    assert parent.recv() == "ready"
    senders = {arm: _connector(arm, 0, name, arena_bytes) for arm in CONNECTOR_ARMS}
    for arm in ("arena", "arena-warm", "arena-copy"):
        while senders[arm]._sender(("0", "1")) is None:  # attach before the first timed put
            time.sleep(0.06)
    _join_warm(senders["arena-warm"]._sender(("0", "1")).region)
    results: dict[str, Any] = {}
    try:
        for rows in rows_list:
            payload = chunk0(rows)
            tensors = _tensor_bytes(payload)
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            dst = [torch.empty_like(t) for t in tensors]
            for d in dst:
                d.fill_(0)  # touched: a warm buffer
            times: dict[str, list[float]] = {arm: [] for arm in ARMS}
            checked: dict[str, Any] = {}
            for r in range(repeats + 1):
                order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]
                for arm in order:
                    if arm == "memcpy":
                        t0 = _clock()
                        for d, t in zip(dst, tensors):
                            d.copy_(t)
                        times[arm].append((_clock() - t0) / 1e6)
                        continue
                    if arm == "memcpy-fresh":
                        t0 = _clock()
                        fresh = [t.clone() for t in tensors]
                        times[arm].append((_clock() - t0) / 1e6)
                        del fresh
                        continue
                    key = f"{name}-{arm}-{rows}-{r}_0_0"
                    t0 = _clock()
                    ok, _, meta = senders[arm].put("0", "1", key, payload)
                    put_ns = _clock() - t0
                    if arm != "shm" and not meta.get("arena"):
                        raise SystemExit(f"{arm}: the put fell back to the inner connector ({senders[arm].health()})")
                    parent.send(("get", arm, key, rows if arm not in checked else 0))
                    get_ns, same, views = parent.recv()
                    if arm not in checked:
                        checked[arm] = {"bit_identical": same, "tensor_views": views}
                    times[arm].append((put_ns + get_ns) / 1e6)
            med = {arm: statistics.median(v[1:]) for arm, v in times.items()}
            results[str(rows)] = {
                "payload_bytes": nbytes,
                "median_ms": med,
                "cold_ms": {arm: v[0] for arm, v in times.items()},
                "all_ms": times,
                "checked": checked,
                "arena_over_shm": med["arena"] / med["shm"],
                "arena_over_memcpy": med["arena"] / med["memcpy"],
                "arena_over_memcpy_fresh": med["arena"] / med["memcpy-fresh"],
                "arena_copy_over_shm": med["arena-copy"] / med["shm"],
                "cold_arena_warm_over_arena": times["arena-warm"][0] / times["arena"][0],
            }
            del payload, tensors, dst
    finally:
        parent.send(("quit",))
        proc.join(timeout=120)
        for c in senders.values():
            c.close()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8000,32000", help="prompt lengths P (rows of the [P, 2048] tensors)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per length (after one warm-up round)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    rows_list = rows_and_repeats("handoff_chunk0", args.rows, args.repeats)
    if rows_list is None:
        return 2
    res = run(rows_list, args.repeats)
    print(f"{'P':>6} {'MB':>6} " + " ".join(f"{a:>13}" for a in ARMS) + "  arena/shm arena/memcpy arena-copy/shm")
    for rows, r in res.items():
        med = r["median_ms"]
        print(f"{rows:>6} {r['payload_bytes'] / 1e6:6.1f} " + " ".join(f"{med[a]:10.2f} ms" for a in ARMS)
              + f"  {r['arena_over_shm']:9.4f} {r['arena_over_memcpy']:12.2f} {r['arena_copy_over_shm']:14.3f}")
        print(f"{'':>6} {'cold':>6} " + " ".join(f"{r['cold_ms'][a]:10.2f} ms" for a in ARMS))
        print(f"{'':>13} checked (bit-identical, views): {r['checked']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
