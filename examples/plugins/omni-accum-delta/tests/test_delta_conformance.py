"""The plugin's own tests: the conformance kit omni-accum ships, as a pytest fixture (entry point pytest11)."""

from __future__ import annotations

import torch

import omni_accum
from omni_accum_delta import WIRE_TAG


def test_delta_meets_the_conformance_contract(omni_accum_conformance):
    # Replace-kind: random payload streams and cumulative streams (extensions, resets, bit-level rewrites).
    omni_accum_conformance("delta", max_examples=80)


def test_delta_is_registered_by_this_distribution():
    spec = omni_accum.get_manager().spec("delta")
    assert spec.distribution is not None and spec.distribution[0] == "omni-accum-delta"
    assert spec.kinds == frozenset({"replace"})


def test_only_the_suffix_goes_on_the_wire():
    policy = {"rules": [{"match": "ids.output", "strategy": "delta"}]}
    tx, rx = omni_accum.Sender(policy), omni_accum.Receiver(policy)
    ids = list(range(1000))
    rx.merge("r", tx.encode("r", {"ids": {"output": list(ids)}}))
    ids.append(1000)
    wire = tx.encode("r", {"ids": {"output": list(ids)}})
    assert wire == {"ids": {"output": [WIRE_TAG, 1000, [1000]]}}
    assert rx.merge("r", wire)["ids"]["output"] == ids
    rows = torch.arange(6.0).reshape(3, 2)
    rx.merge("t", tx.encode("t", {"ids": {"output": rows[:2]}}))
    assert tx.encode("t", {"ids": {"output": rows}})["ids"]["output"][1] == 2
