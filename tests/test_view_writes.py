"""What happens when a consumer writes into its view (README "Library use": views are borrowed)."""

from __future__ import annotations

import pytest
import torch

import omni_accum


def _pair(default: str):
    pol = omni_accum.load_policy({"default": default})
    return omni_accum.Sender(pol), omni_accum.Receiver(pol)


@pytest.mark.parametrize("strategy", ["cat", "prealloc", "token_list"])
def test_a_write_into_a_view_shows_in_every_later_view_under_append_strategies(strategy):
    tx, rx = _pair(strategy)
    first = torch.zeros(2, 3)
    view = rx.merge("r", tx.encode("r", {"x": first}))["x"]
    assert view.data_ptr() == first.data_ptr()  # in process the first view is the producer's own tensor
    view.add_(5)
    assert first.sum().item() == 30  # ... so the write reached the producer's tensor too
    later = rx.merge("r", tx.encode("r", {"x": torch.ones(1, 3)}))["x"]
    assert later[:2].eq(5).all() and later[2].eq(1).all()  # the written rows were accumulated as written
    later.zero_()
    assert rx.view("r")["x"].sum().item() == 0  # a re-read returns the written tensor


def test_the_default_preset_behaves_as_cat():
    pol = omni_accum.load_policy("default")
    tx, rx = omni_accum.Sender(pol), omni_accum.Receiver(pol)
    rx.merge("r", tx.encode("r", {"x": torch.zeros(1, 2)}))["x"].fill_(7)
    assert rx.merge("r", tx.encode("r", {"x": torch.ones(1, 2)}))["x"].tolist() == [[7, 7], [1, 1]]


@pytest.mark.parametrize("strategy", ["replace", "send_once"])
def test_under_replace_strategies_a_write_lasts_until_the_next_value(strategy):
    tx, rx = _pair(strategy)
    rx.merge("r", tx.encode("r", {"x": torch.zeros(1, 2)}))["x"].fill_(7)
    assert rx.view("r")["x"].tolist() == [[7, 7]]
    assert rx.merge("r", tx.encode("r", {"x": torch.ones(1, 2)}))["x"].tolist() == [[1, 1]]


@pytest.mark.parametrize("strategy", ["cat", "prealloc", "token_list", "replace", "send_once"])
def test_view_copy_gives_tensors_a_consumer_may_write_into(strategy):
    tx, rx = _pair(strategy)
    sent = torch.zeros(2, 3)
    rx.merge("r", tx.encode("r", {"x": sent, "g": {"y": torch.zeros(1, 2)}}))
    mine = rx.view("r", copy=True)
    assert isinstance(mine, dict) and isinstance(mine["g"], dict)
    mine["x"].add_(5)
    mine["g"]["y"].add_(5)
    assert sent.sum().item() == 0
    assert rx.view("r")["x"].sum().item() == 0 and rx.view("r")["g"]["y"].sum().item() == 0
