"""The metrics Recorder's hot-path bookkeeping against what prometheus_client itself would record."""

from __future__ import annotations

import pytest
import torch
from conftest import CI

try:
    import prometheus_client
except ImportError:  # the [vllm] extra brings it; a failure under CI=true, as every declared test dependency
    if CI:
        raise
    pytest.skip("prometheus_client not installed here (the [vllm] extra brings it)", allow_module_level=True)

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
    for t in times:  # the merge time goes under the strategy of the chunk's first append-kind key
        r.received({"x": torch.zeros(1)}, t, lambda p, v: strategy, ())
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

    r = _on()
    t = torch.zeros(2, 8, dtype=torch.bfloat16)  # 32 bytes
    payloads = (
        {"g": {"x": t}, "y": t, "__m": 1},
        {"g": {"x": [1, 2]}, "y": t, "__m": 1},
        {"g": {"x": t}, "y": [3], "__m": 1},
    )
    before = {
        (name, role, key, strategy): _sample(name, role=role, key=key, **({"strategy": strategy} if strategy else {}))
        for name in ("omni_accum_chunks_total", "omni_accum_wire_bytes_total")
        for role in ("send", "receive")
        for key in ("g.x", "y", "__m")
        for strategy in (("prealloc", "token_list") if name == "omni_accum_chunks_total" else (None,))
    }

    def got(name: str, role: str, key: str, strategy: str | None = None) -> float:
        labels = {"strategy": strategy} if strategy else {}
        return _sample(name, role=role, key=key, **labels) - before[(name, role, key, strategy)]

    for p in payloads:
        r.received(p, 1e-5, name_of, ("__m",))
        table: dict = {}
        assert r.sent(table, p, p, name_of, ("__m",)) == []  # nothing left off
        assert table == {("g", "x"): 0, ("y", None): 1}
    r.flush()
    for role in ("send", "receive"):
        assert got("omni_accum_chunks_total", role, "g.x", "prealloc") == 2
        assert got("omni_accum_chunks_total", role, "g.x", "token_list") == 1
        assert got("omni_accum_chunks_total", role, "y", "prealloc") == 2
        assert got("omni_accum_chunks_total", role, "y", "token_list") == 1
        assert got("omni_accum_wire_bytes_total", role, "g.x") == 2 * 32  # lists count 0
        assert got("omni_accum_wire_bytes_total", role, "y") == 2 * 32
        assert got("omni_accum_chunks_total", role, "__m", "prealloc") == 0


def test_a_sent_chunk_numbers_its_keys_in_wire_order_and_counts_what_was_left_off():
    r = _on()
    v = torch.zeros(1, 1, 16, dtype=torch.float32)  # 64 bytes
    row = torch.zeros(1, 16, dtype=torch.bfloat16)  # 32 bytes
    chunk = {"embed": {"decode": row, "tts_bos": v, "tts_eos": v}, "spk": "Ethan", "meta": {"finished": True}}
    wire = {"embed": {"decode": row, "tts_eos": v}, "meta": {"finished": True}, "__m": 1}  # tts_bos, spk left off
    table = {("embed", "tts_bos"): 0, ("spk", None): 1}  # numbered by an earlier chunk
    before = {
        k: _sample("omni_accum_wire_bytes_saved_total", key=k, strategy="kept-check") for k in ("embed.tts_bos", "spk")
    }
    wire_before = _sample("omni_accum_wire_bytes_total", role="send", key="embed.decode")
    for _ in range(3):
        omitted = r.sent(table, chunk, wire, lambda p, val: "kept-check", ("__m",))
        assert omitted == [("embed", "tts_bos"), ("spk", None)]
    assert table == {
        ("embed", "tts_bos"): 0,
        ("spk", None): 1,
        ("embed", "decode"): 2,
        ("embed", "tts_eos"): 3,
        ("meta", "finished"): 4,
    }
    r.flush()
    saved = {k: _sample("omni_accum_wire_bytes_saved_total", key=k, strategy="kept-check") - n for k, n in before.items()}
    assert saved == {"embed.tts_bos": 3 * 64, "spk": 3 * 5}  # a string's length
    assert _sample("omni_accum_wire_bytes_saved_total", key="embed.tts_eos", strategy="kept-check") == 0
    assert _sample("omni_accum_wire_bytes_total", role="send", key="embed.decode") - wire_before == 3 * 32


def test_metrics_off_still_number_and_find_what_was_left_off():
    r = metrics.Recorder()
    r.on = False
    table: dict = {}
    chunk = {"a": {"x": 1, "y": 2}, "b": 3}
    assert r.sent(table, chunk, {"a": {"y": 2}}, lambda p, v: "replace", ()) == [("a", "x"), ("b", None)]
    assert table == {("a", "y"): 0}
    assert not r._all and not r._saved_slots  # nothing counted


def test_a_run_of_chunks_leaving_the_same_keys_off_counts_each_keys_bytes_per_chunk():
    """A key is left off only while its value is unchanged (``omits_unchanged``), so the request's run of
    chunks leaving the same keys off counts chunks at each key's bytes; a chunk that sends a key ends the
    run, and the next run counts the new value's bytes. Runs of equal sizes share one counter."""
    r = _on()
    small, big = torch.zeros(16, dtype=torch.float32), torch.zeros(32, dtype=torch.float32)  # 64 B, 128 B
    labels = {"k": {"key": "k", "strategy": "kept-run"}, "j": {"key": "j", "strategy": "kept-run"}}
    before = {k: _sample("omni_accum_wire_bytes_saved_total", **v) for k, v in labels.items()}
    kept: dict = {}
    table: dict = {}

    def send(value, k_on_wire: bool, kept=kept, table=table):
        chunk = {"k": value, "j": "abc"}  # j: a 3-byte string, left off every time
        wire = {"k": value} if k_on_wire else {}
        left = r.sent(table, chunk, wire, lambda p, v: "kept-run", (), kept)
        assert left == ([("j", None)] if k_on_wire else [("k", None), ("j", None)])

    for value, k_on_wire in [(small, False), (small, False), (big, True), (big, False), (small, True), (small, False)]:
        send(value, k_on_wire)
    send(small, False, {}, {})  # another request, the same keys and sizes left off: the same counter
    assert len(r._runs) == 3  # (k 64 B, j), (j), (k 128 B, j)
    r.flush()
    saved = {k: _sample("omni_accum_wire_bytes_saved_total", **v) - before[k] for k, v in labels.items()}
    assert saved == {"k": 64 + 64 + 128 + 64 + 64, "j": 3 * 7}


@pytest.mark.parametrize("max_runs", [1, metrics.MAX_RUNS])
def test_a_value_sent_anew_is_counted_by_its_own_bytes_also_past_max_runs(monkeypatch, max_runs):
    r = _on()
    monkeypatch.setattr(metrics, "MAX_RUNS", max_runs)
    labels = {"key": "k", "strategy": f"kept-many-{max_runs}"}
    before = _sample("omni_accum_wire_bytes_saved_total", **labels)
    kept: dict = {}
    # a value changes only on the wire (then nothing is left off: the run ends); a new size starts a new
    # run, and only the first run gets a counter
    for size, on_wire in [(4, False), (8, True), (8, False), (8, False), (16, True), (16, False)]:
        chunk = {"k": torch.zeros(size, dtype=torch.uint8)}
        wire = chunk if on_wire else {}
        assert r.sent({}, chunk, wire, lambda p, v: labels["strategy"], (), kept) == ([] if on_wire else [("k", None)])
    assert len(r._runs) == min(3, max_runs)
    r.flush()
    assert _sample("omni_accum_wire_bytes_saved_total", **labels) - before == 4 + 8 + 8 + 16


def _race(*targets) -> None:
    """Run ``targets`` on threads of their own, switching threads as often as the interpreter allows."""
    import sys
    import threading

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=t) for t in targets]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(old)


def test_bytes_left_off_stay_exact_when_another_thread_flushes():
    import threading

    r = _on()
    labels = {"key": "g.s", "strategy": "kept-race-run"}
    before = _sample("omni_accum_wire_bytes_saved_total", **labels)
    v = torch.zeros(3, dtype=torch.uint8)
    n = 20000
    start = threading.Barrier(2)

    def sending() -> None:
        start.wait()
        kept: dict = {}
        for i in range(n):
            if i % 1000 == 0:
                kept = {}  # a new request now and then: a new run, the same counter
            r.sent({}, {"g": {"s": v}}, {}, lambda p, val: "kept-race-run", (), kept)

    def publishing() -> None:
        start.wait()
        for _ in range(n // 7):
            r.flush()

    _race(sending, publishing)
    r.flush()
    assert _sample("omni_accum_wire_bytes_saved_total", **labels) - before == 3 * n


def test_counts_stay_exact_when_another_thread_flushes_while_this_one_counts():
    """vllm-omni 0.30.0 calls the hooks from several threads (its chunk transfer adapter receives on one,
    saves on another, releases on the scheduler's): a flush on one thread must neither lose what another
    counts meanwhile nor publish it twice."""
    import threading

    key, strategy, reason = "race.k", "race-prealloc", "race-reason"
    t = torch.zeros(1, 4, dtype=torch.bfloat16)  # 8 bytes
    n = 20000
    before = (
        _sample("omni_accum_chunks_total", role="receive", key=key, strategy=strategy),
        _sample("omni_accum_wire_bytes_total", role="receive", key=key),
        _sample("omni_accum_merge_seconds_count", strategy=strategy),
        _sample("omni_accum_fallbacks_total", reason=reason),
    )
    r = _on()
    name_of = lambda p, v: strategy  # noqa: E731
    start = threading.Barrier(2)

    def receiving() -> None:
        start.wait()
        for _ in range(n):
            r.received({key: t}, 1e-6, name_of, ())  # counts, and flushes every FLUSH_EVERY chunks itself

    def publishing() -> None:
        start.wait()
        for i in range(n):
            r.fallback(reason)
            if i % 7 == 0:
                r.flush()

    _race(receiving, publishing)
    r.flush()
    after = (
        _sample("omni_accum_chunks_total", role="receive", key=key, strategy=strategy),
        _sample("omni_accum_wire_bytes_total", role="receive", key=key),
        _sample("omni_accum_merge_seconds_count", strategy=strategy),
        _sample("omni_accum_fallbacks_total", reason=reason),
    )
    assert [a - b for a, b in zip(after, before)] == [n, n * t.nbytes, n, n]


def test_a_forked_child_can_flush_though_another_thread_was_flushing_at_the_fork():
    import os

    r = _on()
    r._flushing.acquire()  # as if a flush were under way on another thread when the process forked
    try:
        pid = os.fork()
        if pid == 0:  # the child: its flush must not wait for a thread it does not have
            free = False
            try:
                free = r._flushing.acquire(blocking=False)
                if free:
                    r._flushing.release()
                    r.flush()
            finally:
                os._exit(0 if free else 3)
        _, status = os.waitpid(pid, 0)
    finally:
        r._flushing.release()
    assert os.waitstatus_to_exitcode(status) == 0


class _Interleaving(dict):
    """A table whose first ``get`` of a missing key lets ``meanwhile`` run before it answers: another
    thread making the same entry between this thread's lookup and its store."""

    def __init__(self, meanwhile) -> None:
        super().__init__()
        self.meanwhile = meanwhile

    def get(self, key, default=None):
        found = super().get(key, default)
        if found is None and self.meanwhile is not None:
            run, self.meanwhile = self.meanwhile, None
            run()
        return found


def test_a_merge_time_list_made_by_two_threads_at_once_is_one_list():
    """Two threads asking for a new strategy's merge times at once get the same list, the one flush
    reads: the second maker's list used to replace the first's, whose times were then never published."""
    r = _on()
    other: list = []
    r._hist = _Interleaving(lambda: other.append(r._times("raced")))
    mine = r._times("raced")
    assert mine is other[0] is r._hist["raced"]


def test_a_kept_off_slot_made_by_two_threads_at_once_counts_both():
    """The same for the slot of bytes a strategy kept off the wire: both threads' bytes are published."""
    r = _on()
    labels = {"key": "raced", "strategy": "kept-race"}
    before = _sample("omni_accum_wire_bytes_saved_total", **labels)
    value = torch.zeros(8, dtype=torch.float32)  # 32 B
    name_of = lambda p, v: "kept-race"  # noqa: E731
    r._saved_slots = _Interleaving(lambda: r.sent({}, {"raced": value}, {}, name_of, (), {}))
    r.sent({}, {"raced": value}, {}, name_of, (), {})
    r.flush()
    assert _sample("omni_accum_wire_bytes_saved_total", **labels) - before == 64
