"""The replay engine: every arm's final views equal the cat reference; wires; failures reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import require_vllm_omni
from omni_accum.bench import _malloc
from omni_accum.bench._malloc import SLACK
from omni_accum.bench import build_arms, strategy_arm
from omni_accum.errors import OmniAccumError
from omni_accum.bench.replay import ArmResult, PolicyEngine, VllmOmniUnavailable, check_view, measure
from omni_accum.bench.streams import build_stream
from omni_accum.bench.workloads import load_workload, workload_names

SMALL_P = {"talker-code2wav": 1}
LOCAL_ARMS = ["cat", "token_list", "prealloc", "send_once", "replace", "default", "qwen3-omni", "qwen3-omni-flat"]


def small(name: str, steps: int = 4):
    return load_workload(name).model_copy(
        update={"decode_steps": steps, "prefill_chunk": 16 if name == "qwen3-omni-chunked-prefill" else None}
    )


def local_arms(wl):
    names = [n for n in LOCAL_ARMS if n not in ("send_once", "replace") or wl.keys_of_kind("replace", "static")]
    names = [n for n in names if n not in ("cat", "token_list", "prealloc") or wl.keys_of_kind("append")]
    return build_arms(wl, names)


def _expected_wrong(wl_name: str, arm: str) -> bool:
    # Upstream-equivalent behaviour concatenates code2wav windows; only replace-kind policies serve them right.
    return wl_name == "talker-code2wav" and arm in ("default", "qwen3-omni-flat")


@pytest.mark.parametrize("name", workload_names())
def test_every_arm_ends_with_the_cat_reference_inproc(name):
    wl = small(name)
    results = measure(wl, local_arms(wl), context_len=SMALL_P.get(name, 40), concurrency=3, repeats=1)
    for r in results:
        assert r.error is None, (r.arm, r.error)
        assert r.correct is not _expected_wrong(name, r.arm), (r.arm, r.mismatch)


def test_samples_and_figures_shape():
    wl = small("qwen3-omni-seed", steps=5)
    res = measure(wl, build_arms(wl, ["cat", "prealloc"]), context_len=32, concurrency=2, repeats=3)
    assert [r.arm for r in res] == ["cat", "prealloc"]
    for r in res:
        assert isinstance(r, ArmResult) and r.key == "*"
        assert len(r.samples_us) == 3 and all(len(s) == 2 * 6 for s in r.samples_us)
        assert len(r.repeat_medians()) == 3 and len(r.total_us_per_request) == 3
        assert r.step_us_p50 > 0 and r.step_us_p99 >= r.step_us_p50
        assert r.peak_bytes >= 2 * (33 + 5) * 2048 * 2 and r.wire_bytes_per_step > 0
        assert r.requests == 2 and r.steps == 6 and r.correct


def test_per_key_stats_and_send_once_saves_wire_bytes():
    wl = small("qwen3-omni-override-ids", steps=6)
    arms = build_arms(wl, ["default", "send_once"])
    res = {r.arm: r for r in measure(wl, arms, context_len=16, repeats=1, per_key=True)}
    assert res["send_once"].correct and res["default"].correct
    assert (
        res["send_once"].per_key["meta.override_keys"].wire_bytes_per_step
        < res["default"].per_key["meta.override_keys"].wire_bytes_per_step
    )
    assert res["send_once"].wire_bytes_per_step < res["default"].wire_bytes_per_step


def test_a_wrong_engine_is_flagged_with_the_first_mismatch():
    wl = small("qwen3-omni-seed")
    policy = strategy_arm(wl, "prealloc")

    class Lossy(PolicyEngine):
        def merge(self, req_id, wire):
            if "thinker_embeddings" in wire and wire["thinker_embeddings"].shape[0] == 1:
                wire = {k: v for k, v in wire.items() if k != "thinker_embeddings"}  # drops decode rows
            return super().merge(req_id, wire)

    res = measure(wl, {"lossy": lambda ctx: Lossy(policy, ctx), "ok": policy}, context_len=8, repeats=1)
    assert not res[0].correct and "thinker_embeddings" in res[0].mismatch and "request 0" in res[0].mismatch
    assert res[1].correct


def test_a_raising_arm_is_reported_and_the_others_go_on():
    wl = small("qwen3-omni-seed")

    def broken(ctx):
        raise RuntimeError("boom")

    res = measure(wl, {"broken": broken, "cat": build_arms(wl, ["cat"])["cat"]}, context_len=8, repeats=2)
    assert res[0].error == "RuntimeError: boom" and not res[0].correct and not res[0].samples_us
    assert res[1].correct and len(res[1].samples_us) == 2


def test_warmup_replays_each_arm_once_untimed_and_failures_still_surface():
    wl = small("qwen3-omni-seed")
    policy = build_arms(wl, ["prealloc"])["prealloc"]
    built = []

    def counted(ctx):
        built.append(ctx)
        return PolicyEngine(policy, ctx)

    def broken(ctx):
        raise RuntimeError("boom")

    res = measure(wl, {"counted": counted, "broken": broken}, context_len=8, repeats=2, warmup=True)
    assert len(built) == 3  # one warm-up replay, then two measured repeats
    assert len(res[0].samples_us) == 2 and res[0].correct
    assert all(len(rep) == wl.n_chunks(8) for rep in res[0].samples_us)  # only measured steps are kept
    assert res[1].error == "RuntimeError: boom" and not res[1].samples_us


def test_check_view_reports_missing_key():
    wl = small("qwen3-omni-seed")
    stream = build_stream(wl, 8, 0)
    assert "missing" in check_view(wl, stream, {})


def test_missing_vllm_omni_is_a_clear_error(monkeypatch):
    def fail(name):
        raise ImportError("No module named 'vllm_omni'")

    wl = small("qwen3-omni-seed")
    cat = build_arms(wl, ["cat"])
    from omni_accum.integrations.vllm_omni import classes as vllm_omni_classes

    monkeypatch.setattr(vllm_omni_classes, "_import_module", fail)
    with pytest.raises(VllmOmniUnavailable, match="upstream arm needs vllm-omni"):
        measure(wl, {"upstream": "upstream"}, context_len=8, repeats=1)
    with pytest.raises(VllmOmniUnavailable, match="serializer wire"):
        measure(wl, cat, context_len=8, repeats=1, wire="serializer")
    assert issubclass(VllmOmniUnavailable, OmniAccumError)


def test_unknown_wire_and_through():
    wl = small("qwen3-omni-seed")
    with pytest.raises(OmniAccumError, match="unknown wire"):
        measure(wl, build_arms(wl, ["cat"]), context_len=8, repeats=1, wire="pigeon")
    with pytest.raises(OmniAccumError, match="unknown --through mode 'nowhere'"):  # refused before any arm runs
        measure(wl, build_arms(wl, ["cat"]), context_len=8, repeats=1, through="nowhere")


# -- with vllm-omni ------------------------------------------------------------------------------ #


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["qwen3-omni-seed", "qwen3-omni-override-ids", "qwen3-omni-full-payload"])
def test_upstream_arm_runs_the_real_method_and_matches(name):
    require_vllm_omni()
    wl = small(name)
    res = measure(wl, build_arms(wl, ["upstream", "prealloc"]), context_len=24, concurrency=2, repeats=1)
    assert all(r.correct for r in res), [(r.arm, r.mismatch) for r in res]


@pytest.mark.vllm
def test_serializer_wire_with_view_hop_keeps_views_exact():
    require_vllm_omni()
    wl = small("qwen3-omni-seed")
    arms = build_arms(wl, ["upstream", "token_list", "prealloc", "send_once", "qwen3-omni-flat"])
    res = measure(wl, arms, context_len=24, concurrency=2, repeats=1, wire="serializer", view_hop="serializer")
    assert all(r.correct for r in res), [(r.arm, r.mismatch) for r in res]
    # serialized bytes include framing: more than the raw tensor bytes of a decode row
    assert all(r.wire_bytes_per_step > 2048 * 2 for r in res)


def test_view_hop_on_a_stream_read_as_deltas_ships_before_the_receiver_drops():
    """0.30.0's stream (keys read as deltas): the hop used to look the key up after the consumer's take had dropped
    it (KeyError 'prefill' in every arm, cat included)."""
    wl = small("qwen3-omni-0.30")
    arms = build_arms(wl, ["cat", "token_list", "prealloc", "qwen3-omni"])
    res = measure(wl, arms, context_len=24, concurrency=2, repeats=1, wire="serializer", view_hop="serializer")
    assert all(r.correct and r.error is None for r in res), [(r.arm, r.mismatch) for r in res]


def _ours(pid: int) -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f"omniaccum_{pid}_" in f)


@pytest.mark.vllm
def test_shm_wire_leaves_nothing_in_dev_shm():
    require_vllm_omni()
    before = set(os.listdir("/dev/shm"))
    wl = small("qwen3-omni-override-ids")
    arms = build_arms(wl, ["upstream", "send_once", "qwen3-omni"])
    res = measure(wl, arms, context_len=24, concurrency=3, repeats=2, wire="shm")
    assert all(r.correct for r in res), [(r.arm, r.mismatch) for r in res]
    assert _ours(os.getpid()) == []
    leftover = {f for f in set(os.listdir("/dev/shm")) - before if f"omniaccum_{os.getpid()}_" in f}  # this process's
    assert leftover == set()


@pytest.mark.vllm
def test_shm_wire_cleans_up_when_an_arm_fails():
    require_vllm_omni()
    wl = small("qwen3-omni-seed")
    policy = strategy_arm(wl, "cat")

    class Failing(PolicyEngine):
        def merge(self, req_id, wire):
            raise RuntimeError("receiver died")

    res = measure(wl, {"failing": lambda ctx: Failing(policy, ctx)}, context_len=8, repeats=1, wire="shm")
    assert res[0].error is not None
    assert _ours(os.getpid()) == []


def test_wire_floor_arm_is_not_checked_and_costs_least():
    wl = small("qwen3-omni-seed", steps=6)
    res = measure(wl, build_arms(wl, ["wire-floor", "cat"]), context_len=64, repeats=1)
    assert res[0].correct and res[0].peak_bytes == 0 and res[1].correct


_REPEAT_MEMORY_SCRIPT = r"""
import json, sys
import torch
from omni_accum.bench import build_arms
from omni_accum.bench.replay import measure
from omni_accum.bench.streams import build_stream
from omni_accum.bench.workloads import load_workload

torch.set_num_threads(1)
wl = load_workload("qwen3-omni-seed").model_copy(update={"decode_steps": 40})
steps = len(build_stream(wl, 8000, 0))
peaks, rounds = [0, 0], [0]

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

def progress(_):
    rounds[0] += 1
    rep = 0 if rounds[0] <= steps else 1
    peaks[rep] = max(peaks[rep], rss_mib())

measure(wl, build_arms(wl, ["token_list"]), context_len=8000, concurrency=2, wire="serializer",
        repeats=2, progress=progress)
print(json.dumps(peaks))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and /proc are Linux's")
def test_a_second_repeat_holds_no_more_memory_than_the_first():
    # Regression: glibc raised its mmap threshold after the first repeat, so the second repeat's
    # growing concatenations came from a fragmenting heap: +1 concatenation per step (here 1.0 ->
    # 3.4 GiB; a three-repeat bench at concurrency 10 ran out of memory). The replay's HeapGuard
    # returns the holes' pages to the OS between rounds once memory grew by more than its slack.
    require_vllm_omni()
    out = subprocess.run([sys.executable, "-c", _REPEAT_MEMORY_SCRIPT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = json.loads(out.stdout.strip().splitlines()[-1])
    allowed = first + SLACK / 2**20 + 128
    assert second <= allowed, f"peak RSS {first:.0f} MiB in repeat 1, {second:.0f} MiB in repeat 2"


def test_heap_guard_trims_only_past_its_slack(monkeypatch):
    rss = [1000]
    trims = []
    monkeypatch.setattr(_malloc, "resident_bytes", lambda: rss[0])
    monkeypatch.setattr(_malloc, "_malloc_trim", lambda: lambda pad: trims.append(pad) or rss.__setitem__(0, 1100))
    guard = _malloc.HeapGuard(slack=500)
    rss[0] = 1400  # grown by 400: within the slack
    guard()
    assert trims == []
    rss[0] = 900  # shrank: growth now counts from here
    guard()
    rss[0] = 1450  # grown by 550 since the low point
    guard()
    assert trims == [0] and guard.trims == 1
    rss[0] = 1500  # 400 above the post-trim 1100
    guard()
    assert guard.trims == 1


def test_delta_reads_take_the_rows_and_the_receiver_drops_them():
    """read 'delta' (0.30.0's talker takes each embed.decode row once): every arm hands over exactly the chunk's
    rows and holds at most one chunk of them; an engine that keeps the rows is caught by the check."""
    from omni_accum.policy import load_policy

    wl = small("qwen3-omni-0.30", steps=5)
    wl = wl.model_copy(update={"keys": [k for k in wl.keys if k.path != "meta.is_segment_finished"]})
    arms = {"upstream": "upstream", "default": load_policy("default"), "qwen3-omni": load_policy("qwen3-omni")}
    for r in measure(wl, arms, context_len=32, concurrency=2, repeats=1, check=True, per_key=True):
        assert r.error is None and r.correct, (r.arm, r.mismatch)
        assert r.per_key["embed.decode"].peak_bytes <= 2 * 2048 * 2, r.arm  # one bf16 row per request

    class Keeps(PolicyEngine):
        def consume(self, req_id, path):
            pass

    def keeps(ctx):
        return Keeps(load_policy("default"), ctx)

    (r,) = measure(wl, {"keeps": keeps}, context_len=32, concurrency=1, repeats=1, check=True)
    assert not r.correct and "taken after a chunk that does not carry it" in r.mismatch  # embed.prefill kept
