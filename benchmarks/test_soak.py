"""Soak: 10,000 Qwen3-Omni requests through one Sender / Receiver pair; resident memory must stay flat.

Each request is a thinker -> talker stream of the ``qwen3-omni`` preset's keys at real widths
(hidden 2048, bf16): a prefill chunk (``embed.prefill``, ``hidden_states.output``, the three
``embed.tts_*`` constants, ``ids.prompt``, ``speaker``, ``language``, ``meta.*``), then decode
chunks (``embed.decode`` rows appended; statics repeated; on every other request
``meta.override_keys`` lists ``embed.decode``, so it is replaced each step, the 2026-03..05 pattern).
Eight requests are in
flight at once, round-robin; every chunk is copied on its way (as a connector delivers new
tensors); each request is released when finished. Resident memory (psutil RSS) is sampled after
a warm-up of 1,000 requests and then every 500; the figure is the growth of the last sample, and
of the highest, over the warm-up sample. Target: < 5 %.

Not collected by the default test run (``testpaths = ["tests"]``). Run either way::

    python -m pytest benchmarks/test_soak.py -s          # asserts the target
    python benchmarks/test_soak.py [--requests 10000]   # prints the figure
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass

import torch

import omni_accum
from omni_accum.testing import copy_wire

H = 2048
PREFILL = 48
DECODE = 16
IN_FLIGHT = 8
WARMUP = 1000
SAMPLE_EVERY = 500
TARGET_PCT = 5.0


def _stream(seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    tts = {f"tts_{n}": torch.randn(1, 1, H, generator=g).bfloat16() for n in ("bos", "eos", "pad")}
    prompt = torch.randint(0, 150_000, (PREFILL,), generator=g).tolist()
    statics = {"speaker": "Ethan", "language": "en"}
    chunks = [
        {
            "embed": {"prefill": torch.randn(PREFILL + 1, H, generator=g).bfloat16(), **tts},
            "hidden_states": {"output": torch.randn(PREFILL + 1, H, generator=g).bfloat16()},
            "ids": {"prompt": prompt},
            **statics,
            "meta": {"finished": torch.tensor(False)},
        }
    ]
    for s in range(DECODE):
        chunks.append(
            {
                "embed": {"decode": torch.randn(1, H, generator=g).bfloat16(), **tts},
                "ids": {"prompt": prompt},
                **statics,
                "meta": {"finished": torch.tensor(s == DECODE - 1)},
            }
        )
        if seed % 2:  # the 2026-03..05 pattern: embed.decode replaced every step, listed in meta.override_keys
            chunks[-1]["meta"]["override_keys"] = [["embed", "decode"]]
    return chunks


@dataclass
class SoakResult:
    requests: int
    seconds: float
    rss_warm: int
    rss_end: int
    rss_max: int

    @property
    def growth_pct(self) -> float:
        return 100.0 * (self.rss_end - self.rss_warm) / self.rss_warm

    @property
    def max_growth_pct(self) -> float:
        return 100.0 * (self.rss_max - self.rss_warm) / self.rss_warm

    def line(self) -> str:
        mib = 1 << 20
        return (
            f"soak: {self.requests} requests ({PREFILL + 1} prefill rows + {DECODE} decode rows of [1, {H}] bf16, "
            f"{IN_FLIGHT} in flight, qwen3-omni) in {self.seconds:.1f}s; "
            f"RSS after warm-up {self.rss_warm / mib:.1f} MiB, "
            f"end {self.rss_end / mib:.1f} MiB ({self.growth_pct:+.2f} %), max {self.rss_max / mib:.1f} MiB "
            f"({self.max_growth_pct:+.2f} %); target < {TARGET_PCT:.0f} %"
        )


def soak(requests: int = 10_000, progress: bool = False) -> SoakResult:
    import psutil

    proc = psutil.Process()
    policy = omni_accum.load_policy("qwen3-omni")
    tx, rx = omni_accum.Sender(policy), omni_accum.Receiver(policy)
    streams = [_stream(i) for i in range(IN_FLIGHT * 2)]
    n_chunks = len(streams[0])
    t0 = time.perf_counter()
    rss_warm = rss_max = 0
    started = finished = 0
    flight: list[tuple[str, list[dict], int]] = []
    while finished < requests:
        while len(flight) < IN_FLIGHT and started < requests:
            flight.append((f"req-{started}", streams[started % len(streams)], 0))
            started += 1
        nxt = []
        for rid, chunks, i in flight:
            view = rx.merge(rid, copy_wire(tx.encode(rid, chunks[i])))
            view["embed"]["decode" if i else "prefill"]  # the consumer reads
            if i + 1 == n_chunks:
                rows = 1 if "override_keys" in view["meta"] else DECODE
                assert view["embed"]["decode"].shape == (rows, H) and view["speaker"] == "Ethan"
                assert view["hidden_states"]["output"].shape == (PREFILL + 1, H)
                tx.release(rid)
                rx.release(rid)
                finished += 1
                if finished == WARMUP or (finished > WARMUP and finished % SAMPLE_EVERY == 0):
                    gc.collect()
                    rss = proc.memory_info().rss
                    if finished == WARMUP:
                        rss_warm = rss
                    rss_max = max(rss_max, rss)
                    if progress:
                        print(f"  {finished} requests: RSS {rss / (1 << 20):.1f} MiB", file=sys.stderr)
            else:
                nxt.append((rid, chunks, i + 1))
        flight = nxt
    gc.collect()
    rss_end = proc.memory_info().rss
    assert rx.active_requests == 0 and tx.active_requests == 0
    return SoakResult(requests, time.perf_counter() - t0, rss_warm, rss_end, max(rss_max, rss_end))


def test_soak_resident_memory_stays_flat():
    res = soak()
    print("\n" + res.line())
    assert res.growth_pct < TARGET_PCT and res.max_growth_pct < TARGET_PCT, res.line()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=10_000, help="requests to stream (default 10000; >= 1000)")
    args = ap.parse_args(argv)
    if args.requests <= WARMUP:
        ap.error(f"--requests must be above the warm-up of {WARMUP}")
    res = soak(args.requests, progress=True)
    print(res.line())
    return 0 if res.growth_pct < TARGET_PCT and res.max_growth_pct < TARGET_PCT else 1


if __name__ == "__main__":
    sys.exit(main())
