"""Every built-in strategy meets the conformance contract on random streams (hypothesis)."""

from __future__ import annotations

import pytest
import torch

import omni_accum
from omni_accum.testing import check_conformance, check_stream

BUILTINS = [
    ("cat", {}),
    ("token_list", {}),
    ("prealloc", {}),
    ("prealloc", {"initial_capacity": 1, "growth_factor": 1.01}),
    ("prealloc", {"initial_capacity": 4096, "growth_factor": 16.0}),
    ("replace", {}),
    ("send_once", {}),
]


@pytest.mark.parametrize(("name", "params"), BUILTINS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BUILTINS)])
def test_builtin_conforms(name, params):
    check_conformance(name, params, max_examples=80)


def test_conformance_fixture_is_registered(omni_accum_conformance):
    assert omni_accum_conformance is check_conformance


def test_long_stream_of_decode_rows_bf16():
    rows = [torch.randn(1, 16).bfloat16() for _ in range(200)]
    stream = [{"embed": {"decode": r}} for r in rows]
    for name in ("cat", "token_list", "prealloc"):
        check_stream(name, stream)


def test_kit_catches_a_wrong_view():
    """The kit fails a strategy whose view is wrong (it is not a test that always passes)."""

    class Broken(omni_accum.Strategy):
        name = "broken"

        def new_accumulator(self, key):
            from omni_accum.strategies.replace import ReplaceAccumulator

            return ReplaceAccumulator()  # claims append-kind below but only keeps the last chunk

    @omni_accum.hookimpl
    def omni_accum_register_strategies():
        return [omni_accum.StrategySpec("broken", Broken, kinds=frozenset({"append"}))]

    mgr = omni_accum.StrategyManager()
    mgr.register(type("P", (), {"omni_accum_register_strategies": staticmethod(omni_accum_register_strategies)}), "p")
    stream = [{"k": torch.ones(1, 2)}, {"k": torch.zeros(1, 2)}]
    with pytest.raises(AssertionError, match="differs from the reference"):
        check_stream("broken", stream, manager=mgr)


class TestSendOnce:
    def test_unchanged_value_left_off_the_wire_and_served_from_cache(self):
        tx, rx = omni_accum.Sender({"default": "send_once"}), omni_accum.Receiver({"default": "send_once"})
        bos = torch.randn(1, 1, 8)
        w0 = tx.encode("r", {"embed": {"tts_bos": bos}, "speaker": "Ethan"})
        assert set(w0) == {"embed", "speaker"}
        rx.merge("r", w0)
        w1 = tx.encode("r", {"embed": {"tts_bos": bos.clone()}, "speaker": "Ethan"})
        assert set(w1) == {omni_accum.WIRE_MARKER}  # both omitted; the empty group dropped
        v = rx.merge("r", w1)
        assert torch.equal(v["embed"]["tts_bos"], bos) and v["speaker"] == "Ethan"

    def test_changed_value_is_sent_again_never_stale(self):
        tx, rx = omni_accum.Sender({"default": "send_once"}), omni_accum.Receiver({"default": "send_once"})
        t = torch.zeros(2, 3)
        rx.merge("r", tx.encode("r", {"x": t}))
        t[0, 0] = 1.0  # changed in place: must be seen
        w = tx.encode("r", {"x": t})
        assert "x" in w
        assert torch.equal(rx.merge("r", w)["x"], t)
        w = tx.encode("r", {"x": t.to(torch.float64)})  # same values, other dtype: a change
        assert "x" in w and rx.merge("r", w)["x"].dtype == torch.float64
        w = tx.encode("r", {"x": [1, 2]})
        assert rx.merge("r", w)["x"] == [1, 2]
        assert "x" not in tx.encode("r", {"x": [1, 2]})
        assert "x" in tx.encode("r", {"x": [1, 2, 3]})

    def test_nan_values_are_resent_rather_than_guessed_equal(self):
        tx = omni_accum.Sender({"default": "send_once"})
        t = torch.tensor([float("nan")])
        tx.encode("r", {"x": t})
        assert "x" in tx.encode("r", {"x": t})


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}),  # key order
        ({1: "v"}, {True: "v"}),  # key types: one key to the dict, another value to the consumer
        ({0.0: "v"}, {-0.0: "v"}),
        (torch._neg_view(torch.zeros(2)), torch.zeros(2)),  # -0.0 behind the lazy negative bit
    ],
)
def test_the_bit_for_bit_checker_tells_apart_what_a_consumer_would_see_differently(a, b):
    from omni_accum.testing import first_difference, same_bits

    assert not same_bits(a, b) and not same_bits(b, a)
    assert first_difference(a, b) is not None
    assert same_bits(a, a) and first_difference(a, a) is None
