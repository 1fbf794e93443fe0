"""A/B replay of ``qwen3-omni-seed`` per arm x bucket: one round = one request's whole trace.

Run: ``pytest benchmarks/test_bench_replay.py --benchmark-group-by=group`` (arms side by side per
bucket). ``upstream`` needs vllm-omni (skipped without it). Each round replays the seed's chunk 0
(``[P+1, 2048]`` bf16) and 20 decode steps through a fresh engine over the in-process wire, with
the consumer reading the newest row every chunk; data is generated once, outside the timing.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from omni_accum.bench import build_arms
from omni_accum.replay import InprocWire, make_engine, replay
from omni_accum.context import StreamContext
from omni_accum.workloads import build_stream, load_workload

WORKLOAD = load_workload("qwen3-omni-seed").model_copy(update={"decode_steps": 20})
CONTEXTS = (1000, 8000)
ARMS = ("upstream", "cat", "token_list", "prealloc", "qwen3-omni-flat")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # stable on a shared machine
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("ctx", CONTEXTS)
@pytest.mark.parametrize("arm", ARMS)
def test_replay_seed(benchmark, arm, ctx):
    if arm == "upstream":
        try:
            importlib.import_module("vllm_omni")
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"vllm-omni not importable: {e!r}")
    benchmark.group = f"qwen3-omni-seed ctx={ctx} c=1"
    arms = build_arms(WORKLOAD, [arm])
    streams = [build_stream(WORKLOAD, ctx, 0)]
    ctx_obj = StreamContext(context_len=ctx, concurrency=1)

    def setup():
        return (make_engine(arms[arm], ctx_obj),), {}

    def run(engine):
        replay(WORKLOAD, engine, InprocWire(), streams)

    benchmark.pedantic(run, setup=setup, rounds=5, warmup_rounds=1, iterations=1)
