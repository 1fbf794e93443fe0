"""A sender that reuses (changes in place) what it sent, in the same process as the receiver: every strategy's view
still equals the reference fed the same objects (upstream's accumulator: the first chunk held as it is until the
second arrives, then ``torch.cat`` / list ``+`` taking each chunk's values when it runs; a replace-kind key holds
the latest value sent)."""

from __future__ import annotations

import pytest
import torch

import omni_accum
from omni_accum import Receiver, Sender
from omni_accum.testing import check_stream, same_bits, scribble

POLICIES = {
    "cat": {"default": "cat"},
    "token_list": {"default": "token_list"},
    "prealloc": {"default": "prealloc"},
    "prealloc-small": {"default": {"strategy": "prealloc", "params": {"initial_capacity": 1, "growth_factor": 1.1}}},
    "prealloc-reuse": {"default": {"strategy": "prealloc", "params": {"reuse_bytes": "1MiB"}}},
    "replace": {"default": "replace"},
    "send_once": {"default": "send_once"},
    "default-preset": "default",
}


def _policy(name):
    if name == "delta":  # the example plugin (examples/plugins): rewrites the wire, so not for meta.override_keys
        return {"default": "delta", "honor_override_keys": False}
    return POLICIES[name]


def _names():
    return [*POLICIES, *(["delta"] if omni_accum.get_manager().get_spec("delta") else [])]


def _append_kind(name):
    policy = omni_accum.load_policy(_policy(name))
    return "append" in omni_accum.get_manager().spec(policy.default.strategy).kinds


def _upstream(held, chunk, append):
    """The reference: vllm-omni 0.30.0's accumulation of one flat chunk, on the very objects sent."""
    out = dict(held)
    for key, value in chunk.items():
        cur = held.get(key)
        if append and isinstance(cur, torch.Tensor) and isinstance(value, torch.Tensor):
            out[key] = torch.cat([cur, value])
        elif append and isinstance(cur, list) and isinstance(value, list):
            out[key] = cur + value
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("name", _names())
def test_a_sender_refilling_one_buffer_every_step_gets_the_reference_view(name):
    """The finding: a buffer filled with 0, 1, 2, 3 and sent each step gave ``token_list`` [3, 3, 3, 3] where
    ``torch.cat`` gives [1, 1, 2, 3] (the first chunk is the buffer itself until the second chunk is merged)."""
    tx, rx = Sender(_policy(name)), Receiver(_policy(name))
    append = _append_kind(name)
    rows, ids, group = torch.zeros(1, 2), [0], {"h": torch.zeros(2, 3, dtype=torch.bfloat16)}
    ref: dict = {}
    for step in range(6):
        rows.fill_(step)
        ids[:] = [step] * (step % 3)  # a list reused too, its length changing
        group["h"].fill_(-step)
        chunk = {"rows": rows, "ids": ids, "h": group["h"]}
        ref = _upstream(ref, chunk, append)
        view = rx.merge("r", tx.encode("r", chunk))
        for key in chunk:
            assert same_bits(view[key], ref[key]), (name, step, key, view[key], ref[key])
    if append:
        assert ref["rows"].flatten().tolist()[:8] == [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]


@pytest.mark.parametrize("name", _names())
def test_a_sent_value_changed_in_place_then_an_equal_new_value(name):
    """``send_once`` left the new value off (it equals the copy it compares with), and a receiver in the same
    process served the changed object; ``delta`` appended to the changed rows."""
    tx, rx = Sender(_policy(name)), Receiver(_policy(name))
    append = _append_kind(name)
    ref: dict = {}
    sent: dict = {}
    for step in range(4):
        x = torch.ones(2, 2) if step % 2 == 0 else torch.cat([torch.ones(2, 2), torch.full((1, 2), 3.0)])
        chunk = {"x": x, "ids": [1, 2]}  # new objects, equal to (or extending) what was sent before it changed
        scribble(sent)  # the sender reuses what it sent last for something else
        ref = _upstream(ref, chunk, append)
        view = rx.merge("r", tx.encode("r", chunk))
        for key in chunk:
            assert same_bits(view[key], ref[key]), (name, step, key, view[key], ref[key])
        sent = chunk


@pytest.mark.parametrize("name", _names())
def test_the_conformance_kit_in_process_mode(name):
    """``check_stream(..., transport=None, reuse=True)``: the kit's own check of the same thing, on a stream of
    nested and flat keys (what ``check_conformance`` runs on random streams)."""
    strategy = omni_accum.load_policy(_policy(name)).default
    stream = [
        {"embed": {"d": torch.full((1, 2), float(i)), "ids": list(range(i % 3))}, "flat": torch.tensor([i])}
        for i in range(8)
    ]
    check_stream(strategy.strategy, stream, strategy.params, transport=None, reuse=True)


def test_the_kit_catches_a_strategy_that_keeps_the_senders_objects():
    """A strategy that keeps every chunk by reference (the old ``token_list``) passes a copying wire but not the
    in-process run with the sender reusing its buffers."""
    from omni_accum.strategy import AppendAccumulator, Strategy, StrategySpec

    class ByReference(AppendAccumulator):
        def __init__(self, key):
            super().__init__(key)
            self._chunks = []

        def start_tensor(self, value):
            self._chunks = [value]

        def append_tensor(self, value):
            self._chunks.append(value)

        def read_tensor(self):
            return torch.cat(self._chunks)

        def current_tensor_meta(self):
            return self._chunks[0]

    class Plugin:
        @omni_accum.hookimpl
        def omni_accum_register_strategies(self):
            factory = type("ByRef", (Strategy,), {"name": "by_ref", "new_accumulator": lambda s, k: ByReference(k)})
            return [StrategySpec(name="by_ref", factory=factory, kinds=frozenset({"append"}))]

    mgr = omni_accum.StrategyManager(load_entrypoints=False)
    mgr.load_entrypoints([])
    mgr.register(Plugin(), name="by_ref")
    stream = [{"x": torch.full((1, 2), float(i))} for i in range(4)]
    check_stream("by_ref", [{k: v.clone() for k, v in c.items()} for c in stream], manager=mgr)  # a copying wire
    with pytest.raises(AssertionError, match="view differs from the reference"):
        check_stream("by_ref", stream, manager=mgr, transport=None, reuse=True)


def test_token_list_copies_only_the_new_chunk_per_step(monkeypatch):
    """The copies are O(chunk) per step: no concatenation until a read, each part one chunk's rows."""
    rx = Receiver({"default": "token_list"})
    buf = torch.zeros(3, 4)
    rx.merge("r", {"x": buf})
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: cats.append(1) or real_cat(*a, **k))
    for step in range(1, 50):
        buf.fill_(step)
        rx.merge("r", {"x": buf})
    assert not cats
    parts = rx.parts("r")["x"]
    assert len(parts) == 50 and all(p.shape == (3, 4) and p.data_ptr() != buf.data_ptr() for p in parts)
    monkeypatch.undo()
    assert torch.equal(rx.view("r")["x"][:, 0], torch.arange(50.0).repeat_interleave(3).clamp(min=1))
