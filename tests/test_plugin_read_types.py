"""A plugin whose ``read()`` returns the wrong type never reaches the consumer (issue 32, item 8).

The receiver checks a new key's first read once per key and request (a tensor chunk reads as a tensor
of its dtype, a list chunk as a list, another value as its type); a mismatch fails the request as a
raising strategy does, and the vllm-omni integration falls back to 0.30.0's own code for the chunk,
counted as any refused chunk.
"""

from __future__ import annotations

import logging

import pytest
import torch
from pydantic import BaseModel, ConfigDict

import omni_accum
from omni_accum.errors import AccumulationError
from omni_accum.strategy import Accumulator, Strategy, StrategySpec

READS: list[str] = []  # one entry per read() call of a LiarAccumulator


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    lie: bool = True


class LiarAccumulator(Accumulator):
    """Appends like ``cat``; reads as a string when it lies."""

    def __init__(self, lie: bool) -> None:
        self.lie = lie
        self.value = None

    def merge(self, value):
        if isinstance(value, torch.Tensor) and isinstance(self.value, torch.Tensor):
            self.value = torch.cat([self.value, value])
        elif isinstance(value, list) and isinstance(self.value, list):
            self.value = self.value + value
        else:
            self.value = value

    def read(self):
        READS.append("read")
        return "not a tensor" if self.lie else self.value


class Liar(Strategy):
    name = "liar"
    Params = Params

    def new_accumulator(self, key):
        return LiarAccumulator(self.params.lie)


class LiarPlugin:
    @omni_accum.hookimpl
    def omni_accum_register_strategies(self):
        return [StrategySpec(name="liar", factory=Liar, params_model=Params, kinds=frozenset({"append"}))]


def liar_manager() -> omni_accum.StrategyManager:
    m = omni_accum.StrategyManager(load_entrypoints=False)
    m.load_entrypoints([])  # built-ins only
    m.register(LiarPlugin(), name="acme_liar", distribution=("acme-liar", "0.1.0"))
    return m


def policy(match: str, lie: bool = True) -> dict:
    return {"default": "cat", "rules": [{"match": match, "strategy": "liar", "params": {"lie": lie}}]}


@pytest.mark.parametrize(
    "value", [torch.zeros(2, 3, dtype=torch.bfloat16), [1, 2], 7], ids=["tensor", "list", "int"]
)
def test_a_wrong_read_type_fails_the_request_and_names_the_plugin(value):
    rx = omni_accum.Receiver(policy("x"), manager=liar_manager())
    t = torch.arange(4.0).reshape(2, 2)
    rx.merge("good", {"y": t})
    with pytest.raises(AccumulationError) as ei:
        rx.merge("bad", {"x": value, "y": t})
    err = ei.value
    assert err.request_id == "bad" and err.key == "x" and err.strategy == "liar" and err.plugin == "acme_liar"
    assert "read() returned str" in str(err) and "acme_liar" in str(err), str(err)
    with pytest.raises(AccumulationError, match="request failed earlier"):  # never a string in a view
        rx.merge("bad", {"y": t})
    assert torch.equal(rx.merge("good", {"y": t})["y"], torch.cat([t, t]))  # other requests go on
    rx.release("bad")


def test_a_wrong_dtype_is_refused_too():
    class Upcast(LiarAccumulator):
        def read(self):
            return self.value.float()

    class UpcastStrategy(Liar):
        def new_accumulator(self, key):
            return Upcast(False)

    class UpcastPlugin:
        @omni_accum.hookimpl
        def omni_accum_register_strategies(self):
            return [StrategySpec(name="upcast", factory=UpcastStrategy, kinds=frozenset({"append"}))]

    m = omni_accum.StrategyManager(load_entrypoints=False)
    m.load_entrypoints([])
    m.register(UpcastPlugin(), name="acme_upcast")
    rx = omni_accum.Receiver({"default": "upcast"}, manager=m)
    with pytest.raises(AccumulationError, match=r"dtype.*bfloat16"):
        rx.merge("r", {"emb": {"x": torch.zeros(1, 4, dtype=torch.bfloat16)}})


def test_the_check_reads_once_per_key_and_request_not_per_chunk():
    """An honest plugin: the check reads each new key once; later chunks of the request add no read."""
    rx = omni_accum.Receiver(policy("*", lie=False), manager=liar_manager())
    READS.clear()
    for req in ("a", "b"):
        for i in range(50):
            rx.merge(req, {"x": torch.full((1, 2), float(i)), "g": {"ids": [i]}})
    assert len(READS) == 2 * 2  # two keys, two requests
    assert torch.equal(rx.view("a")["x"], torch.arange(50.0).repeat_interleave(2).reshape(50, 2))
    assert rx.view("b")["g"]["ids"] == list(range(50))


@pytest.mark.vllm
def test_the_runner_hook_falls_back_and_counts_it(vo, runner, caplog):
    """Real runner transport (``_accumulate_payload``): under the lying plugin every chunk is handed to
    0.30.0's own code (the consumer gets upstream's ``torch.cat``, never the string), each counted in
    ``omni_accum_fallbacks_total{reason="refused_chunk"}``, warned once for the request."""
    from prometheus_client import REGISTRY

    def fallbacks() -> float:
        return REGISTRY.get_sample_value("omni_accum_fallbacks_total", {"reason": "refused_chunk"}) or 0.0

    chunks = [{"embed": {"decode": torch.full((1, 8), float(i))}, "speaker": "ethan"} for i in range(3)]
    up = runner()
    expected = [up._accumulate_payload("r", dict(c)) for c in chunks]
    previous = omni_accum.manager._manager
    omni_accum.reset_manager(liar_manager())
    try:
        vo.install(policy("embed.decode"))
        r = runner()
        fb0 = fallbacks()
        with caplog.at_level(logging.WARNING, logger="omni_accum.vllm_omni"):
            got = [r._accumulate_payload("r", dict(c)) for c in chunks]
        r._omni_accum_binding.publish()
    finally:
        vo.uninstall()
        omni_accum.reset_manager(previous)
    for g, e in zip(got, expected):
        assert isinstance(g["embed"]["decode"], torch.Tensor)
        assert torch.equal(g["embed"]["decode"], e["embed"]["decode"]) and g["speaker"] == e["speaker"]
    assert fallbacks() - fb0 == len(chunks)
    warned = [r.getMessage() for r in caplog.records if "refused a chunk" in r.getMessage()]
    assert len(warned) == 1 and "read() returned str" in warned[0] and "'embed.decode'" in warned[0], warned
