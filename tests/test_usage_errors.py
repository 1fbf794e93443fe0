"""A user's mistake at a call raises one of omni-accum's documented errors, at that call, naming the bad value
(docs/reliability.md "Only documented errors")."""

from __future__ import annotations

import pytest
import torch

import omni_accum
from omni_accum import (
    AccumulationError,
    InvalidArgumentError,
    OmniAccumError,
    PolicyArgumentError,
    PolicyError,
    Receiver,
    Sender,
    StreamContext,
)

CHUNK = {"x": torch.zeros(2, 2)}


def _sequenced_receiver() -> Receiver:
    rx = Receiver("default")
    rx.merge("s", CHUNK, seq=0)
    return rx


#: (call, the error class, text the message must hold: the bad value and what is valid)
MISTAKES = [
    (lambda: omni_accum.load_policy([1, 2]), PolicyArgumentError, ["got list [1, 2]", "a mapping"]),
    (lambda: omni_accum.load_policy(5), PolicyArgumentError, ["got int 5", "a preset name"]),
    (lambda: omni_accum.load_policy(b"default: cat"), PolicyArgumentError, ["got bytes", "decode bytes"]),
    (lambda: Sender(5), PolicyArgumentError, ["got int 5"]),
    (
        lambda: Receiver().merge("r", CHUNK, context="8k"),
        InvalidArgumentError,
        ["context must be a StreamContext", "'8k'"],
    ),
    (
        lambda: Sender().encode("r", CHUNK, context={"context_len": 5}),
        InvalidArgumentError,
        ["context must be a StreamContext", "dict"],
    ),
    (lambda: Sender("default", context=8000), InvalidArgumentError, ["context must be a StreamContext", "8000"]),
    (lambda: Receiver(manager="x"), InvalidArgumentError, ["manager must be a StrategyManager", "str"]),
    (lambda: Receiver(reorder_window=-1), InvalidArgumentError, ["reorder_window must be an int >= 0", "-1"]),
    (lambda: Receiver(reorder_window=True), InvalidArgumentError, ["reorder_window", "True"]),
    (lambda: _sequenced_receiver().finish("s", chunks="1"), AccumulationError, ["chunks must be an int >= 0", "'1'"]),
    (lambda: Receiver().finish(["x"]), AccumulationError, ["request id must be hashable", "list"]),
    (lambda: Receiver().sequence(["x"]), AccumulationError, ["request id must be hashable", "list"]),
    (lambda: StreamContext(context_len=-5), InvalidArgumentError, ["context_len must be an int >= 0 or None", "-5"]),
    (lambda: StreamContext(context_len="8k"), InvalidArgumentError, ["context_len", "'8k'"]),
    (lambda: StreamContext(context_len=True), InvalidArgumentError, ["context_len", "True"]),
    (lambda: StreamContext(concurrency=0), InvalidArgumentError, ["concurrency must be an int >= 1", "0"]),
    (lambda: StreamContext(concurrency=2.0), InvalidArgumentError, ["concurrency", "2.0"]),
    (lambda: StreamContext(length_hints=[1, 2]), InvalidArgumentError, ["length_hints must be a mapping", "[1, 2]"]),
    (lambda: StreamContext(length_hints={"x": "100"}), InvalidArgumentError, ["an int >= 0", "'x': '100'"]),
    (lambda: StreamContext(length_hints={"x": -5}), InvalidArgumentError, ["an int >= 0", "'x': -5"]),
    (lambda: StreamContext(length_hints={"x": 2.5}), InvalidArgumentError, ["'x': 2.5"]),
    (lambda: StreamContext(length_hints={1: 5}), InvalidArgumentError, ["key paths (str)", "1: 5"]),
]


@pytest.mark.parametrize("call,cls,texts", MISTAKES, ids=[f"mistake{i}" for i in range(len(MISTAKES))])
def test_a_mistake_raises_a_documented_error_naming_the_value(call, cls, texts):
    with pytest.raises(OmniAccumError) as e:
        call()
    assert type(e.value) is cls, type(e.value).__mro__
    for text in texts:
        assert text in str(e.value), (text, str(e.value))


@pytest.mark.parametrize("call,cls,texts", [m for m in MISTAKES if issubclass(m[1], InvalidArgumentError)])
def test_argument_errors_are_still_value_and_type_errors(call, cls, texts):
    """What such mistakes raised before (ValueError from StreamContext and reorder_window, TypeError from
    load_policy(5)) is still caught by the same ``except``."""
    for old in (ValueError, TypeError):
        with pytest.raises(old):
            call()


def test_the_new_error_classes_sit_in_the_hierarchy():
    assert issubclass(PolicyArgumentError, PolicyError) and issubclass(PolicyArgumentError, InvalidArgumentError)
    assert issubclass(omni_accum.SettingError, OmniAccumError) and issubclass(omni_accum.SettingError, ValueError)
    from omni_accum import switches

    assert switches.SettingError is omni_accum.errors.SettingError  # still importable where it was


def test_length_hints_are_copied_when_the_context_is_made():
    hints = {"x": 4}
    ctx = StreamContext(length_hints=hints)
    hints["x"] = 1000
    assert ctx.length_hints == {"x": 4}
