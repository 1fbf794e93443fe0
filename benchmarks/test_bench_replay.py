"""A/B replay of ``qwen3-omni-seed`` per arm x bucket: one round = one request's whole trace.

Run: ``pytest benchmarks/test_bench_replay.py --benchmark-group-by=group`` (arms side by side per
bucket: context length x concurrency). ``upstream`` needs vllm-omni (skipped without it). Each
round replays the seed's chunk 0 (``[P+1, 2048]`` bf16) and a few decode steps (20 at concurrency
1, 5 at concurrency 10) for every request, round-robin, through a fresh engine over the in-process
wire, with the consumer reading the newest row every chunk; data is generated once, outside the
timing.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from omni_accum.bench import build_arms
from omni_accum.bench.replay import InprocWire, make_engine, replay
from omni_accum.context import StreamContext
from omni_accum.bench.streams import build_stream
from omni_accum.bench.workloads import load_workload

SEED = load_workload("qwen3-omni-seed")
CONTEXTS = (1000, 8000)
CONCURRENCY = tuple(SEED.concurrency)  # the seed's two cases: 1 and 10
#: Decode steps per request: fewer at concurrency 10, so a round stays short.
DECODE_STEPS = {1: 20, 10: 5}
ARMS = ("upstream", "cat", "token_list", "prealloc", "qwen3-omni-flat")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # stable on a shared machine
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("conc", CONCURRENCY, ids=lambda c: f"c{c}")
@pytest.mark.parametrize("ctx", CONTEXTS)
@pytest.mark.parametrize("arm", ARMS)
def test_replay_seed(benchmark, arm, ctx, conc):
    if arm == "upstream":
        try:
            importlib.import_module("vllm_omni")
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"vllm-omni not importable: {e!r}")
    workload = SEED.model_copy(update={"decode_steps": DECODE_STEPS.get(conc, 5)})
    benchmark.group = f"qwen3-omni-seed ctx={ctx} c={conc} decode={workload.decode_steps}"
    arms = build_arms(workload, [arm])
    streams = [build_stream(workload, ctx, r) for r in range(conc)]
    ctx_obj = StreamContext(context_len=ctx, concurrency=conc)

    def setup():
        return (make_engine(arms[arm], ctx_obj),), {}

    def run(engine):
        replay(workload, engine, InprocWire(), streams)

    benchmark.pedantic(run, setup=setup, rounds=5, warmup_rounds=1, iterations=1)
