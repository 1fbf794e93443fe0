"""Runtime isolation: a plugin strategy that raises fails that request only.

The error is an :class:`AccumulationError` naming the plugin, the strategy, the request and the key,
with the strategy's own exception chained; other requests on the same Sender/Receiver go on.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import BaseModel, ConfigDict

import omni_accum
from omni_accum.errors import AccumulationError
from omni_accum.strategy import Accumulator, Encoder, Strategy, StrategySpec

BOOM = "boom"


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    where: str = "merge"


class Bug(Exception):
    pass


class FragileEncoder(Encoder):
    def __init__(self, where: str) -> None:
        self.where = where

    def encode(self, value):
        if self.where == "encode" and value == BOOM:
            raise Bug("encode tripped")
        return value


class FragileAccumulator(Accumulator):
    def __init__(self, where: str) -> None:
        self.where = where
        self.value = None

    def check(self, value):
        if self.where == "check" and value == BOOM:
            raise Bug("check tripped")

    def merge(self, value):
        if self.where == "merge" and value == BOOM:
            raise Bug("merge tripped")
        self.value = value

    def read(self):
        return self.value


class Fragile(Strategy):
    name = "fragile"
    Params = Params

    def new_encoder(self, key):
        if self.params.where == "new_encoder" and key.request_id == "bad":
            raise Bug("new_encoder tripped")
        return FragileEncoder(self.params.where)

    def new_accumulator(self, key):
        if self.params.where == "new_accumulator" and key.request_id == "bad":
            raise Bug("new_accumulator tripped")
        return FragileAccumulator(self.params.where)


class FragilePlugin:
    @omni_accum.hookimpl
    def omni_accum_register_strategies(self):
        return [StrategySpec(name="fragile", factory=Fragile, params_model=Params, kinds=frozenset({"replace"}))]


class RaisingSelector:
    @omni_accum.hookimpl
    def omni_accum_select_strategy(self, key, meta, context, policy):
        if key == "poison":
            raise Bug("selector tripped")
        return None


@pytest.fixture
def manager():
    m = omni_accum.StrategyManager(load_entrypoints=False)
    m.load_entrypoints([])  # built-ins only (the example plugin is not needed here)
    m.register(FragilePlugin(), name="acme_fragile", distribution=("acme-fragile", "0.3.0"))
    return m


def endpoints(manager, where):
    policy = {"default": "cat", "rules": [{"match": "x", "strategy": "fragile", "params": {"where": where}}]}
    return omni_accum.Sender(policy, manager=manager), omni_accum.Receiver(policy, manager=manager)


def assert_names_everything(err: AccumulationError, req: str, where: str) -> None:
    assert err.request_id == req and err.key == "x" and err.strategy == "fragile" and err.plugin == "acme_fragile"
    text = str(err)
    for w in (f"request {req!r}", "key 'x'", "strategy 'fragile'", "plugin 'acme_fragile'", "Bug", f"{where} tripped"):
        assert w in text, (w, text)
    assert isinstance(err.__cause__, Bug)


@pytest.mark.parametrize("where", ["encode", "check", "merge"])
def test_raising_strategy_fails_that_request_only(manager, where):
    tx, rx = endpoints(manager, where)
    t = torch.arange(4.0).reshape(2, 2)
    for req in ("good", "bad", "other"):
        rx.merge(req, tx.encode(req, {"x": "ok", "y": t}))
    with pytest.raises(AccumulationError) as ei:
        rx.merge("bad", tx.encode("bad", {"x": BOOM, "y": t}))
    assert_names_everything(ei.value, "bad", where)
    # other requests on the same Sender/Receiver are unaffected, before and after
    for req in ("good", "other"):
        view = rx.merge(req, tx.encode(req, {"x": "fine", "y": t}))
        assert view["x"] == "fine" and torch.equal(view["y"], torch.cat([t, t]))
    assert rx.active_requests == 3
    # the failed request still shows its state from before the chunk, or refuses to go on; never a wrong view
    if where in ("check", "encode"):
        assert rx.view("bad")["x"] == "ok" and torch.equal(rx.view("bad")["y"], t)
    if where in ("merge", "encode"):
        side = tx if where == "encode" else rx
        with pytest.raises(AccumulationError, match="request failed earlier"):
            if side is tx:
                tx.encode("bad", {"x": "fine"})
            else:
                rx.merge("bad", {"x": "fine"})
    # released, the request id can be used again
    tx.release("bad")
    rx.release("bad")
    assert rx.merge("bad", tx.encode("bad", {"x": "again"}))["x"] == "again"


@pytest.mark.parametrize("where", ["new_encoder", "new_accumulator"])
def test_raising_state_factory_fails_that_request_only(manager, where):
    tx, rx = endpoints(manager, where)
    with pytest.raises(AccumulationError) as ei:
        rx.merge("bad", tx.encode("bad", {"x": 1}))
    assert_names_everything(ei.value, "bad", where)
    assert rx.merge("good", tx.encode("good", {"x": 1}))["x"] == 1


def test_raising_selection_hook_fails_the_chunk_and_names_the_plugin(manager):
    manager.register(RaisingSelector(), name="acme_selector", distribution=("acme-select", "2.0"))
    tx, rx = endpoints(manager, "merge")
    for side, call in (
        ("sender", lambda: tx.encode("r1", {"poison": 1})),
        ("receiver", lambda: rx.merge("r1", {"poison": 1})),
    ):
        with pytest.raises(AccumulationError) as ei:
            call()
        err = ei.value
        assert err.request_id == "r1" and err.key == "poison", side
        text = str(err)
        assert "plugin 'acme_selector' (distribution acme-select 2.0)" in text and "selector tripped" in text, text
        assert isinstance(err.__cause__.__cause__, Bug)
    assert rx.merge("r2", tx.encode("r2", {"x": 5}))["x"] == 5
    # nothing was built for the key: the request's state is whole, and its next chunk merges (docs/reliability.md)
    assert rx.merge("r1", tx.encode("r1", {"x": 6}))["x"] == 6


def test_other_keys_of_a_failed_chunk_are_not_half_merged(manager):
    tx, rx = endpoints(manager, "check")
    rx.merge("r", {"x": "ok", "y": [1]})
    with pytest.raises(AccumulationError):
        rx.merge("r", {"y": [2], "x": BOOM})
    assert rx.view("r")["y"] == [1]  # the check phase runs before any key is merged
