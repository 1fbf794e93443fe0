"""Strategy selection is cached per endpoint: bounded (per-request contexts do not grow memory) and keyed by all a
selection hook is given (docs/plugins.md, ``omni_accum_select_strategy``)."""

from __future__ import annotations

import pytest
import torch

import omni_accum
from omni_accum import Receiver, Sender, StreamContext
from omni_accum.engine import endpoint
from omni_accum.policy import StrategyChoice


def test_per_request_contexts_keep_the_selection_cache_bounded(monkeypatch):
    monkeypatch.setattr(endpoint, "SELECTION_CACHE_SIZE", 16, raising=False)  # old code: no bound at all
    tx, rx = Sender("qwen3-omni"), Receiver("qwen3-omni")
    chunk = {"embed": {"decode": torch.ones(1, 4), "tts_bos": torch.ones(1, 1, 4)}, "meta": {"finished": 0}}
    sizes = []
    for r in range(200):
        ctx = StreamContext(context_len=r, concurrency=1 + r % 7)  # a context of its own per request
        view = rx.merge(str(r), tx.encode(str(r), chunk, context=ctx), context=ctx)
        assert torch.equal(view["embed"]["decode"], chunk["embed"]["decode"])
        tx.release(str(r))
        rx.release(str(r))
        sizes.append((len(tx._selected), len(rx._selected)))
    assert max(max(s) for s in sizes) == 16  # filled up to the bound, never past it
    assert len(rx._selected) == 16 and tx.active_requests == rx.active_requests == 0


def test_the_default_bound_is_a_few_thousand_selections():
    assert 256 <= endpoint.SELECTION_CACHE_SIZE <= 65536


class _HintReader:
    """Picks ``prealloc`` for ``x`` when the stream context hints at 100 rows or more, else ``token_list``."""

    def __init__(self) -> None:
        self.calls = 0

    @omni_accum.hookimpl
    def omni_accum_select_strategy(self, key, meta, context, policy):
        if key != "x":
            return None
        self.calls += 1
        long = context.length_hints.get("x", 0) >= 100
        return StrategyChoice(strategy="prealloc" if long else "token_list", params={}, source="hint reader")


@pytest.fixture
def hint_reader():
    m = omni_accum.StrategyManager(load_entrypoints=False)
    m.load_entrypoints([])
    hook = _HintReader()
    m.register(hook, name="hint_reader")
    return m, hook


def test_a_selection_hook_that_reads_length_hints_sees_each_requests_hints(hint_reader):
    manager, hook = hint_reader
    rx = Receiver("default", manager=manager)
    names = []
    for r, hint in enumerate([500, 1, 500, 1]):
        ctx = StreamContext(context_len=8000, length_hints={"x": hint})  # only the hints differ
        rx.merge(f"r{r}", {"x": torch.ones(1, 2)}, context=ctx)
        names.append(rx._requests[f"r{r}"].entries["x"].spec.name)
    assert names == ["prealloc", "token_list", "prealloc", "token_list"]
    assert hook.calls == 2  # the same arguments again: the cached choice


def test_the_hook_runs_once_per_distinct_arguments_not_once_per_request(hint_reader):
    """What docs/plugins.md says: cached per (key path, first value's kind, dtype, trailing shape, rank, context)."""
    manager, hook = hint_reader
    rx = Receiver("default", manager=manager)
    for r in range(10):
        rx.merge(f"r{r}", {"x": torch.ones(1, 2)})
        rx.release(f"r{r}")
    assert hook.calls == 1
    rx.merge("other-dtype", {"x": torch.ones(1, 2, dtype=torch.float64)})
    rx.merge("other-shape", {"x": torch.ones(1, 3)})
    assert hook.calls == 3
