"""Per-step merge + read of one ``[1, 2048]`` bf16 decode row, at 1k / 8k / 32k rows of context.

Run: ``pytest benchmarks/test_bench_step.py --benchmark-group-by=group`` (not collected by the
default test run). Arms per context: ``bare_copy`` (a row copied into a preallocated tensor: the
floor), and every built-in strategy through ``Receiver.merge`` + reading the newest row of the
whole view (the pre-#1656 consumer). Targets: ``prealloc`` within 3x of ``bare_copy`` and flat in
context (32k vs 1k within 1.5x); ``cat`` shows the O(context) baseline.
"""

from __future__ import annotations

import pytest
import torch

import omni_accum

HIDDEN = 2048
CONTEXTS = (1000, 8000, 32000)
ARMS = ("bare_copy", "cat", "token_list", "prealloc", "replace", "send_once")


def _rounds(arm: str, ctx: int) -> int:
    return 20 if arm in ("cat", "token_list") and ctx >= 8000 else 300


@pytest.mark.parametrize("ctx", CONTEXTS)
@pytest.mark.parametrize("arm", ARMS)
def test_step(benchmark, arm, ctx):
    benchmark.group = f"step ctx={ctx}"
    rounds = _rounds(arm, ctx)
    prefill = torch.randn(ctx, HIDDEN).bfloat16()
    rows = torch.randn(rounds + 8, 1, HIDDEN).bfloat16()
    it = iter(range(rounds + 8))

    if arm == "bare_copy":
        buf = torch.empty(ctx + rounds + 8, HIDDEN, dtype=torch.bfloat16)
        buf[:ctx].copy_(prefill)
        n = [ctx]

        def step():
            i = next(it)
            buf[n[0]].copy_(rows[i, 0])
            n[0] += 1
            return buf[: n[0]][-1]

    else:
        tx = omni_accum.Sender({"default": arm})
        rx = omni_accum.Receiver({"default": arm})
        rx.merge("r", tx.encode("r", {"x": prefill}))
        rx.merge("r", tx.encode("r", {"x": rows[-1]}))  # the first append allocates prealloc's buffer

        def step():
            i = next(it)
            view = rx.merge("r", tx.encode("r", {"x": rows[i]}))
            return view["x"][-1]

    benchmark.pedantic(step, rounds=rounds, warmup_rounds=2, iterations=1)
