"""The 0.16 scheduler -> model runner crossing (``runner_rows``): what a worker rebuilds is the scheduler's tensor,
bit for bit, while only the rows it lacks cross; a cat tensor crosses as torch pickles it.

The crossing is vLLM's message queue (``shm_broadcast.MessageQueue.enqueue``): ``pickle.dumps`` with protocol 5 and
buffers of 1 MiB or more out of band; the reader unpickles from a ring that the next message overwrites (done
here: the out-of-band bytes are overwritten after each load). The worker side is what 0.16.0's runner does with
the dicts (``info_dict = new``; ``info_dict.update(cached)``). The real 0.16.0 adapter and runner method are in
``test_integration_vllm_omni_v016.py``.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from message_queue import through_message_queue  # tests/ is on sys.path

from omni_accum.integrations.vllm_omni import runner_rows

H = 16


def cross(obj):
    """vLLM's message queue (``benchmarks/_message_queue.py``): what the worker sees and the bytes that crossed."""
    return through_message_queue(obj)


def prealloc_views(p: int, steps: int, cap: int):
    """The rows ``[:p + t]`` of one buffer (what ``prealloc`` hands over) and the ``torch.cat`` reference."""
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(p + steps, H, generator=g).bfloat16()
    buf = torch.empty(cap, H, dtype=torch.bfloat16)
    buf[: p + steps].copy_(rows)
    return buf, rows


def output(new=(), cached=None, resumed=()):
    c = SimpleNamespace(req_ids=list(cached or {}), resumed_req_ids=set(resumed), additional_information=dict(cached or {}))
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r, additional_information=i) for r, i in new],
                           scheduled_cached_reqs=c)  # fmt: skip


def stats():
    return dict.fromkeys(runner_rows.STATS, 0)


class Worker:
    """0.16.0's runner, as far as the dicts go."""

    def __init__(self):
        self.info: dict[str, dict] = {}

    def step(self, so):
        for nr in so.scheduled_new_reqs:
            self.info[nr.req_id] = nr.additional_information
        for rid, d in so.scheduled_cached_reqs.additional_information.items():
            self.info[rid].update(d)


def test_prealloc_views_cross_as_new_rows_and_equal_the_cat_reference():
    p, steps = 500, 40
    buf, rows = prealloc_views(p, steps, cap=2 * p)
    req = SimpleNamespace(additional_information=None)
    st, w = stats(), Worker()
    # the new request: the prefix view with spare capacity; static keys beside it
    info = {"thinker_embeddings": buf[:p], "tts_bos_embed": torch.ones(1, 1, H), "finished": torch.tensor(False)}
    so = output(new=[("r", info)])
    runner_rows.ship_rows(st, so, {"r": req})
    assert info["thinker_embeddings"] is not so.scheduled_new_reqs[0].additional_information["thinker_embeddings"]
    seen, nbytes = cross(so)
    w.step(seen)
    assert st["runner_full"] == 1 and nbytes < 2 * p * H * 2  # the rows only, not the buffer
    for t in range(1, steps + 1):
        live = {"thinker_embeddings": buf[: p + t], "finished": torch.tensor(t == steps)}
        so = output(cached={"r": live})
        runner_rows.ship_rows(st, so, {"r": req})
        assert live["thinker_embeddings"].shape[0] == p + t  # the request's own dict is never changed
        seen, nbytes = cross(so)
        w.step(seen)
        got = w.info["r"]["thinker_embeddings"]
        assert isinstance(got, torch.Tensor) and torch.equal(got.view(torch.int16), rows[: p + t].view(torch.int16))
        assert nbytes < 8 * 1024, f"step {t}: {nbytes} bytes crossed"
    assert st["runner_delta"] == steps and st["runner_full"] == 1
    assert st["runner_bytes_saved"] >= steps * p * H * 2


def test_a_grown_buffer_crosses_whole_once_then_as_rows_again():
    p = 100
    small, rows = prealloc_views(p, 0, cap=p + 2)
    req, st, w = SimpleNamespace(), stats(), Worker()
    so = output(new=[("r", {"e": small[:p]})])
    runner_rows.ship_rows(st, so, {"r": req})
    w.step(cross(so)[0])
    # the buffer moved (prealloc grew): a new storage, more rows
    g = torch.Generator().manual_seed(3)
    extra = torch.randn(5, H, generator=g).bfloat16()
    big = torch.empty(4 * p, H, dtype=torch.bfloat16)
    big[:p].copy_(rows)
    big[p : p + 5].copy_(extra)
    so = output(cached={"r": {"e": big[: p + 5]}})
    runner_rows.ship_rows(st, so, {"r": req})
    assert isinstance(so.scheduled_cached_reqs.additional_information["r"]["e"], runner_rows.RowsFull)
    w.step(cross(so)[0])
    so = output(cached={"r": {"e": big[: p + 5]}})  # no new chunk this step: zero rows cross
    runner_rows.ship_rows(st, so, {"r": req})
    assert isinstance(so.scheduled_cached_reqs.additional_information["r"]["e"], runner_rows.RowsDelta)
    w.step(cross(so)[0])
    assert torch.equal(w.info["r"]["e"].view(torch.int16), torch.cat([rows, extra]).view(torch.int16))
    assert (st["runner_full"], st["runner_delta"]) == (2, 1)


def test_cat_tensors_and_other_values_cross_as_torch_pickles_them():
    """The ``default`` policy (a fresh, exact tensor every step) sends what 0.16.0 sends: nothing replaced."""
    req, st = SimpleNamespace(), stats()
    for t in range(3):
        info = {"thinker_embeddings": torch.randn(10 + t, H), "ids": [1, 2], "finished": torch.tensor(False)}
        so = output(cached={"r": info}) if t else output(new=[("r", info)])
        runner_rows.ship_rows(st, so, {"r": req})
        shipped = so.scheduled_cached_reqs.additional_information["r"] if t else so.scheduled_new_reqs[0].additional_information
        assert shipped is info
    assert st == stats()


def test_a_resumed_request_crosses_whole_again():
    p = 50
    buf, rows = prealloc_views(p, 3, cap=4 * p)
    req, st = SimpleNamespace(), stats()
    runner_rows.ship_rows(st, output(new=[("r", {"e": buf[:p]})]), {"r": req})
    so = output(cached={"r": {"e": buf[: p + 1]}}, resumed=["r"])
    runner_rows.ship_rows(st, so, {"r": req})
    assert isinstance(so.scheduled_cached_reqs.additional_information["r"]["e"], runner_rows.RowsFull)


def test_rows_for_a_tensor_the_worker_does_not_hold_fail_naming_key_and_request():
    stray = runner_rows.RowsDelta("req-9", "thinker_embeddings", 12, torch.zeros(1, H))
    with pytest.raises(runner_rows.RunnerRowsError, match=r"rows 12\.\.13 of 'thinker_embeddings' for request 'req-9'"):
        cross(stray)


def test_the_worker_forgets_a_request_with_its_state():
    p = 64
    buf, _ = prealloc_views(p, 2, cap=2 * p)
    req, st, w = SimpleNamespace(), stats(), Worker()
    before = runner_rows.held_count()
    so = output(new=[("gone", {"e": buf[:p]})])
    runner_rows.ship_rows(st, so, {"gone": req})
    w.step(cross(so)[0])
    so = output(cached={"gone": {"e": buf[: p + 1]}})
    runner_rows.ship_rows(st, so, {"gone": req})
    w.step(cross(so)[0])
    assert runner_rows.held_count() == before + 1
    del w.info["gone"]  # the runner drops a finished request's state
    gc.collect()
    assert runner_rows.held_count() == before


def test_only_pickling_executors_are_served():
    cfg = lambda b: SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=b))  # noqa: E731
    assert runner_rows.serializing(cfg("mp")) and runner_rows.serializing(cfg("ray"))
    assert not runner_rows.serializing(cfg("uni")) and not runner_rows.serializing(cfg(None))
    assert not runner_rows.serializing(SimpleNamespace())


class GrowingRows:
    """A request's key as omni-accum's receivers hand it over: a prefix of a buffer that grows by a factor
    (a new storage when full), or, after a fallback, a fresh exact tensor (0.16.0's ``torch.cat``)."""

    def __init__(self, rng, first: torch.Tensor):
        self.rng, self.rows = rng, first.clone()
        self.buf = None

    def append(self, new: torch.Tensor) -> torch.Tensor:
        self.rows = torch.cat([self.rows, new])
        n = self.rows.shape[0]
        if self.rng.random() < 0.1:  # a fallback: upstream's cat, exact storage
            self.buf = None
            return self.rows.clone()
        if self.buf is None or self.buf.shape[0] < n:
            self.buf = torch.empty(max(2 * n, 8), H, dtype=self.rows.dtype)
            self.buf[:n].copy_(self.rows)
        else:
            self.buf[n - new.shape[0] : n].copy_(new)
        return self.buf[:n]


@pytest.mark.parametrize("seed", range(40))
def test_random_streams_reach_the_worker_as_the_cat_of_their_chunks(seed):
    """Interleaved requests, buffers that grow, fallbacks to exact tensors, steps without the key, resumed
    requests, requests that end: after every step each running request's tensor on the worker equals the
    ``torch.cat`` of its chunks, bit for bit."""
    import random

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    reqs: dict[str, tuple[SimpleNamespace, GrowingRows]] = {}
    st, w, started = stats(), Worker(), 0
    for _ in range(rng.randrange(10, 60)):
        new_reqs, cached, resumed = [], {}, []
        if not reqs or (started < 5 and rng.random() < 0.3):
            rid = f"r{started}"
            started += 1
            rows = GrowingRows(rng, torch.randn(rng.randrange(1, 40), H, generator=g).bfloat16())
            view = rows.rows if rng.random() < 0.5 else rows.append(torch.randn(1, H, generator=g).bfloat16())
            reqs[rid] = (SimpleNamespace(), rows)
            new_reqs.append((rid, {"e": view, "finished": torch.tensor(False)}))
        for rid, (req, rows) in list(reqs.items()):
            if any(r == rid for r, _ in new_reqs):
                continue
            if rng.random() < 0.1:  # the request ends: the worker drops its state
                del reqs[rid]
                w.info.pop(rid, None)
                continue
            info: dict = {"finished": torch.tensor(False)}
            if rng.random() < 0.8:
                info["e"] = rows.append(torch.randn(rng.randrange(0, 3), H, generator=g).bfloat16())
            cached[rid] = info
            if rng.random() < 0.05:
                resumed.append(rid)
        so = output(new=new_reqs, cached=cached, resumed=resumed)
        runner_rows.ship_rows(st, so, {rid: req for rid, (req, _) in reqs.items()})
        w.step(cross(so)[0])
        for rid, (_, rows) in reqs.items():
            got = w.info[rid]["e"]
            assert torch.equal(got.view(torch.int16), rows.rows.view(torch.int16)), f"{rid}: {got.shape} vs {rows.rows.shape}"
    gc.collect()
