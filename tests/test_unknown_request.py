"""Looking up a request a Sender/Receiver holds no state for raises the documented error."""

from __future__ import annotations

import pytest
import torch

import omni_accum
from omni_accum.errors import OmniAccumError, UnknownRequestError


def _rx():
    rx = omni_accum.Receiver("default")
    rx.merge("r1", {"x": torch.zeros(2, 3)})
    return rx


@pytest.mark.parametrize("method", ["view", "nbytes", "parts"])
def test_unknown_request_is_documented_error(method):
    rx = _rx()
    with pytest.raises(UnknownRequestError) as e:
        getattr(rx, method)("nope")
    assert isinstance(e.value, OmniAccumError) and isinstance(e.value, KeyError)
    msg = str(e.value)
    assert "'nope'" in msg and "1 request" in msg and not msg.startswith('"')
    assert e.value.request_id == "nope"


def test_unknown_request_still_caught_as_keyerror():
    rx = _rx()
    try:
        rx.view("gone")
    except KeyError:
        pass
    rx.release("r1")
    with pytest.raises(KeyError, match="0 requests"):
        rx.view("r1")


@pytest.mark.parametrize("endpoint", ["Sender", "Receiver"])
def test_unhashable_request_id(endpoint):
    ep = getattr(omni_accum, endpoint)("default")
    call = ep.encode if endpoint == "Sender" else ep.merge
    with pytest.raises(OmniAccumError, match="request id"):
        call(["a"], {"x": torch.zeros(1)})
    with pytest.raises(OmniAccumError, match="request id"):
        ep.release(["a"])
    if endpoint == "Receiver":
        with pytest.raises(UnknownRequestError):
            ep.view(["a"])
