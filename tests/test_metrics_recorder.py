"""The metrics Recorder's hot-path bookkeeping against what prometheus_client itself would record."""

from __future__ import annotations

import pytest
import torch

prometheus_client = pytest.importorskip("prometheus_client", reason="the [vllm] extra brings prometheus_client")

from omni_accum.integrations.vllm_omni import metrics  # noqa: E402


def _sample(name: str, **labels: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


def _on() -> metrics.Recorder:
    r = metrics.Recorder()
    if not r.on:
        pytest.fail("metrics are off here (OMNI_ACCUM_METRICS set?)")
    return r


def test_the_local_histogram_publishes_what_observe_would():
    strategy = "hist-check"
    times = [3e-7, 1e-6, 4e-6, 1e-5, 2.4e-5, 0.2, 3.0, 7e-4, 7e-4]
    before = {
        le: _sample("omni_accum_merge_seconds_bucket", strategy=strategy, le=le)
        for le in ("1e-06", "2.5e-05", "0.001", "+Inf")
    }
    before_sum = _sample("omni_accum_merge_seconds_sum", strategy=strategy)
    r = _on()
    for t in times:
        r.merge(strategy, t)
    r.flush()
    # Prometheus buckets are cumulative "less or equal" counts.
    expect = {"1e-06": 2, "2.5e-05": 5, "0.001": 7, "+Inf": 9}
    for le, n in expect.items():
        assert _sample("omni_accum_merge_seconds_bucket", strategy=strategy, le=le) - before[le] == n, le
    assert _sample("omni_accum_merge_seconds_sum", strategy=strategy) - before_sum == pytest.approx(sum(times))
    r.flush()  # nothing new: nothing added
    assert _sample("omni_accum_merge_seconds_bucket", strategy=strategy, le="+Inf") - before["+Inf"] == 9


def test_a_histogram_without_the_internal_layout_gets_one_observe_per_event():
    seen: list[float] = []

    class Child:
        def observe(self, amount: float) -> None:
            seen.append(amount)

    counts = [0] * (len(metrics.MERGE_BUCKETS) + 1)
    sums = [0.0] * len(counts)
    counts[0], sums[0] = 2, 1e-6
    counts[-1], sums[-1] = 1, 5.0
    metrics._observe_many(Child(), counts, sums)
    assert len(seen) == 3 and sum(seen) == pytest.approx(5.000001)
    assert sorted(seen) == pytest.approx([5e-7, 5e-7, 5.0])


def test_counts_follow_a_key_whose_value_type_changes_and_skip_markers():
    names = {torch.Tensor: "prealloc", list: "token_list"}

    def name_of(path: str, value: object) -> str:
        return names[torch.Tensor if isinstance(value, torch.Tensor) else list]

    role = "recorder-check"
    r = _on()
    t = torch.zeros(2, 8, dtype=torch.bfloat16)  # 32 bytes
    for payload in (
        {"g": {"x": t}, "y": t, "__m": 1},
        {"g": {"x": [1, 2]}, "y": t, "__m": 1},
        {"g": {"x": t}, "y": [3], "__m": 1},
    ):
        first = r.chunk_leaves(role, payload, name_of, skip=("__m",))
        assert first in ("prealloc", "token_list")
    r.flush()
    assert _sample("omni_accum_chunks_total", role=role, key="g.x", strategy="prealloc") == 2
    assert _sample("omni_accum_chunks_total", role=role, key="g.x", strategy="token_list") == 1
    assert _sample("omni_accum_chunks_total", role=role, key="y", strategy="prealloc") == 2
    assert _sample("omni_accum_chunks_total", role=role, key="y", strategy="token_list") == 1
    assert _sample("omni_accum_wire_bytes_total", role=role, key="g.x") == 2 * 32  # lists count 0
    assert _sample("omni_accum_wire_bytes_total", role=role, key="y") == 2 * 32
    assert _sample("omni_accum_chunks_total", role=role, key="__m", strategy="prealloc") == 0


def test_the_first_append_kind_key_names_the_merge():
    r = _on()
    kinds = {"a": "send_once", "b": "replace", "c": "prealloc"}
    got = r.chunk_leaves("first-check", {"a": 1, "b": 2, "c": torch.zeros(1)}, lambda p, v: kinds[p])
    assert got == "prealloc"
    assert r.chunk_leaves("first-check", {"a": 1, "b": 2}, lambda p, v: kinds[p]) is None


def test_bytes_kept_off_are_counted_per_key():
    r = _on()
    v = torch.zeros(1, 1, 16, dtype=torch.float32)  # 64 bytes
    chunk = {"embed": {"tts_bos": v, "tts_eos": v}, "spk": "Ethan"}
    for _ in range(3):
        r.kept_off_leaves(chunk, [("embed", "tts_bos"), ("spk", None)], lambda p, val: "kept-check")
    r.flush()
    assert _sample("omni_accum_wire_bytes_saved_total", key="embed.tts_bos", strategy="kept-check") == 3 * 64
    assert _sample("omni_accum_wire_bytes_saved_total", key="spk", strategy="kept-check") == 3 * 5  # a string's length
    assert _sample("omni_accum_wire_bytes_saved_total", key="embed.tts_eos", strategy="kept-check") == 0
