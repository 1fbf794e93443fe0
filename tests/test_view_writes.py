"""What happens when a consumer writes into its view (README "Library use": views are borrowed)."""

from __future__ import annotations

import pytest
import torch

import omni_accum
from omni_accum.testing import copy_wire


def _pair(default: str):
    pol = omni_accum.load_policy("default" if default == "default" else {"default": default})  # the preset
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


def test_view_copy_copies_tensors_inside_tuples_and_other_values():
    """A tensor inside a tuple (and a numpy array) was handed back as it is: a write into the "copy" changed the
    receiver's state; ``torch.Tensor`` itself (it has a ``clone`` attribute) was a bare TypeError."""
    import collections

    import numpy as np

    pair = collections.namedtuple("pair", "a b")
    rx = omni_accum.Receiver("default")
    rx.merge("r", {"meta": {"t": (torch.zeros(2), [torch.zeros(1)]), "np": np.zeros(3), "nt": pair(torch.zeros(1), 2),
                            "cls": torch.Tensor}})  # fmt: skip
    mine = rx.view("r", copy=True)["meta"]
    mine["t"][0].fill_(5)
    mine["t"][1][0].fill_(5)
    mine["np"][:] = 5
    mine["nt"].a.fill_(5)
    live = rx.view("r")["meta"]
    assert live["t"][0].sum() == 0 and live["t"][1][0].sum() == 0 and live["np"].sum() == 0 and live["nt"].a.sum() == 0
    assert type(mine["t"]) is tuple and type(mine["nt"]) is pair and mine["cls"] is torch.Tensor


def _written_after(strategy: str, chunk: int, wire=lambda w: w) -> tuple[list[float], list[float]]:
    """Chunks [[0, 0]], [[1, 1]], ...; the consumer writes 99 into its view after chunk ``chunk`` (1-based).
    Returns (the re-read right after the write, the final view), column 0."""
    tx, rx = _pair(strategy)
    reread = []
    for i in range(4):
        view = rx.merge("r", wire(tx.encode("r", {"x": torch.full((1, 2), float(i))})))
        if i + 1 == chunk:
            view["x"][0, 0] = 99.0
            reread = rx.view("r")["x"][:, 0].tolist()
    return reread, rx.view("r")["x"][:, 0].tolist()


@pytest.mark.parametrize("strategy", ["cat", "prealloc", "token_list", "default"])
@pytest.mark.parametrize("wire", [lambda w: w, copy_wire], ids=["in-process", "copying-wire"])
def test_append_strategies_after_the_first_chunk_keep_a_write(strategy, wire):
    assert _written_after(strategy, 1, wire) == ([99.0], [99.0, 1.0, 2.0, 3.0])


@pytest.mark.parametrize("strategy", ["cat", "prealloc", "default"])
@pytest.mark.parametrize("chunk", [2, 3])
def test_cat_and_prealloc_keep_a_write_after_any_chunk(strategy, chunk):
    reread, final = _written_after(strategy, chunk)
    assert reread[0] == 99.0 and final == [99.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("chunk", [2, 3])
def test_token_list_loses_a_write_after_a_later_chunk_at_the_next_chunk(chunk):
    """It lands in the cached concatenation, which the next chunk replaces (docs/library.md's table)."""
    reread, final = _written_after("token_list", chunk)
    assert reread[0] == 99.0  # re-reads show it until then
    assert final == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("strategy", ["replace", "send_once"])
def test_replace_kinds_serve_a_write_until_the_key_comes_again(strategy):
    tx, rx = _pair(strategy)
    rx.merge("r", tx.encode("r", {"x": torch.zeros(1, 2), "y": 1}))["x"].fill_(7)
    assert rx.merge("r", tx.encode("r", {"y": 2}))["x"].tolist() == [[7, 7]]  # a chunk without the key
    assert rx.merge("r", tx.encode("r", {"x": torch.ones(1, 2)}))["x"].tolist() == [[1, 1]]


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "copying-wire"])
def test_send_once_serves_a_write_into_a_static_value_as_long_as_it_stays_off_the_wire(in_process):
    """Over a copying wire the receiver's copy is written and the unchanged value stays off the wire: the write is
    served for the rest of the request. In process the write lands in the sender's last sent object, so the
    sender sends the value again with the next chunk (before the fix it was left off, and the write served)."""
    for strategy in ("send_once", "replace"):
        tx, rx = _pair(strategy)
        for i in range(4):
            wire = tx.encode("r", {"spk": torch.ones(1, 2)})  # the same static value, a new tensor each chunk
            view = rx.merge("r", wire if in_process else copy_wire(wire))
            if i == 0:
                view["spk"][0, 0] = 99.0
        served = rx.view("r")["spk"].tolist()
        lasting = strategy == "send_once" and not in_process
        assert served == ([[99.0, 1.0]] if lasting else [[1.0, 1.0]]), (strategy, in_process)


def test_merge_returns_one_live_view_per_request():
    """docs/library.md: the same object for every chunk, read when indexed; a tensor read keeps its rows; a copy
    is a snapshot."""
    rx = omni_accum.Receiver({"default": "prealloc"})
    first = rx.merge("r", {"x": torch.zeros(1, 2), "g": {"y": [1]}})
    rows_then = first["x"]
    snapshot = rx.view("r", copy=True)
    second = rx.merge("r", {"x": torch.ones(2, 2), "g": {"y": [2]}})
    assert first is second is rx.view("r")
    assert first["x"].shape == (3, 2) and first["g"]["y"] == [1, 2]  # the first view shows the later chunk
    assert rows_then.shape == (1, 2) and rows_then.sum() == 0  # what was read then keeps its rows
    assert snapshot["x"].shape == (1, 2) and snapshot["g"]["y"] == [1]
    assert rx.merge("other", {"x": torch.zeros(1, 2)}) is not first
