"""The example third-party strategy ``delta`` (examples/plugins/omni-accum-delta), installed for real.

Conformance runs in the plugin's own tests through the kit fixture; here: the wire form, resets,
flat wire bytes through vllm-omni's own serializer, the override-ids workload, lost state.
"""

from __future__ import annotations

import pytest
import torch

import omni_accum
from omni_accum.errors import AccumulationError
from omni_accum.testing import as_dict, check_plain_wire, first_difference, same_bits


@pytest.fixture(scope="module")
def plugin():
    try:
        import omni_accum_delta
    except ImportError as e:
        pytest.fail(f"omni-accum-delta is not installed (pip install examples/plugins/omni-accum-delta): {e}")
    return omni_accum_delta


POLICY = {
    "default": "cat",
    "rules": [{"match": "ids.output", "strategy": "delta"}, {"match": "meta.*", "strategy": "replace"}],
}


def pair(policy=POLICY):
    return omni_accum.Sender(policy), omni_accum.Receiver(policy)


def test_list_suffix_on_the_wire_full_value_in_the_view(plugin):
    tx, rx = pair()
    ids: list[int] = []
    for step in range(50):
        ids = ids + [1000 + step]
        wire = tx.encode("r", {"ids": {"output": list(ids)}})
        tag, start, payload = wire["ids"]["output"]
        assert tag == plugin.WIRE_TAG and start == step and payload == [1000 + step]
        view = rx.merge("r", wire)["ids"]["output"]
        assert view == ids and type(view) is list
    assert rx.view("r")["ids"]["output"] is rx.view("r")["ids"]["output"]  # cached until the next append


def test_tensor_rows_suffix(plugin):
    tx, rx = pair()
    full = torch.randn(3, 8, dtype=torch.bfloat16)
    for step in range(20):
        wire = tx.encode("r", {"ids": {"output": full.clone()}})
        start, payload = plugin.parse_wire(wire["ids"]["output"])
        assert start == (0 if step == 0 else full.shape[0] - 2) and payload.shape[0] == (3 if step == 0 else 2)
        assert same_bits(rx.merge("r", wire)["ids"]["output"], full)
        full = torch.cat([full, torch.randn(2, 8, dtype=torch.bfloat16)])


@pytest.mark.parametrize(
    "before, after",
    [
        ([1, 2, 3], [1, 2]),  # shorter
        ([1, 2, 3], [1, 9, 3, 4]),  # prefix rewritten
        ([1, 2, 3], [1, 2.0, 3, 4]),  # equal, but another type
        ([1, 2], [True, 2, 3]),  # equal, but another type
        ([1, 2], ["a"]),
        ([1, 2], None),
        ([1, 2], torch.tensor([1, 2, 3])),
        (torch.zeros(2, 2), torch.cat([-torch.zeros(2, 2), torch.ones(1, 2)])),  # 0.0 -> -0.0: other bits
        (torch.zeros(2, 2), torch.zeros(3, 2, dtype=torch.float64)),
        (torch.zeros(2, 2), torch.zeros(3, 3)),
        (torch.zeros(2, 2), torch.tensor(1.0)),
        ([0.5, 1.0], [0.5, 1.0, 2.0]),  # no exact element type: always whole
    ],
)
def test_a_value_that_does_not_extend_the_previous_one_is_sent_whole(plugin, before, after):
    tx, rx = pair()
    rx.merge("r", tx.encode("r", {"ids": {"output": before}}))
    wire = tx.encode("r", {"ids": {"output": after}})
    assert plugin.parse_wire(wire["ids"]["output"])[0] in (0, plugin.OPAQUE)
    assert same_bits(rx.merge("r", wire)["ids"]["output"], after)


def test_values_that_never_grow_go_on_the_wire_as_they_are(plugin):
    tx, rx = pair()
    flag, t = torch.tensor(False), torch.ones(2, 3)
    for value in (flag, None, "Ethan", 7, t):
        wire = tx.encode("r", {"ids": {"output": value}})
        assert wire["ids"]["output"] is value
        assert same_bits(rx.merge("r", wire)["ids"]["output"], value)
    wire = tx.encode("r", {"ids": {"output": (1, 2)}})
    assert wire["ids"]["output"] == [plugin.WIRE_TAG, plugin.OPAQUE, (1, 2)]  # tuples become lists on a real wire
    assert rx.merge("r", wire)["ids"]["output"] == (1, 2)


def test_upstream_mutating_its_own_list_in_place_is_seen(plugin):
    tx, rx = pair()
    ids = [1, 2]
    rx.merge("r", tx.encode("r", {"ids": {"output": ids}}))
    ids.append(3)  # the same object, grown
    assert rx.merge("r", tx.encode("r", {"ids": {"output": ids}}))["ids"]["output"] == [1, 2, 3]
    ids[0] = 7  # the same object, rewritten: a reset
    wire = tx.encode("r", {"ids": {"output": ids}})
    assert wire["ids"]["output"][1] == 0 and rx.merge("r", wire)["ids"]["output"] == [7, 2, 3]


def test_lost_receiver_state_is_an_error_never_a_wrong_view(plugin):
    tx, rx = pair()
    rx.merge("r", tx.encode("r", {"ids": {"output": [1, 2]}}))
    rx.release("r")  # e.g. a restarted receiver
    with pytest.raises(AccumulationError) as ei:
        rx.merge("r", tx.encode("r", {"ids": {"output": [1, 2, 3]}}))
    err = ei.value
    assert err.strategy == "delta" and err.plugin == "delta" and err.key == "ids.output" and err.request_id == "r"
    assert "index 2" in str(err) and "holds no sequence" in str(err) and "release the request" in str(err)


def test_malformed_wire_is_rejected(plugin):
    _, rx = pair()
    for bad in (
        [1, 2, 3],
        ["omni_accum.delta/0", 0, [1]],
        [plugin.WIRE_TAG, "0", [1]],
        [plugin.WIRE_TAG, 0, 5],
        [plugin.WIRE_TAG, 3, 5],
    ):
        with pytest.raises(AccumulationError, match="delta"):
            rx.merge(f"r{bad!r}", {"ids": {"output": bad}})


def test_override_keys_do_not_reset_delta_state(plugin):
    """2026-03..05 chunks list ids.output in meta.override_keys: replace-kind keys keep their state."""
    tx, rx = pair()
    ids: list[int] = []
    for step in range(10):
        ids = ids + [step]
        chunk = {"ids": {"output": list(ids)}, "meta": {"override_keys": [["embed", "decode"], ["ids", "output"]]}}
        assert rx.merge("r", tx.encode("r", chunk))["ids"]["output"] == ids


def test_override_ids_workload_views_match_upstream(plugin):
    from omni_accum.bench.streams import build_stream
    from omni_accum.bench.workloads import load_workload

    wl = load_workload("qwen3-omni-override-ids")
    stream = build_stream(wl, 64)
    ref_tx, ref_rx = pair({"default": "cat"})
    tx, rx = pair({"default": "cat", "rules": [{"match": "ids.output", "strategy": "delta"}]})
    for k, chunk in enumerate(stream):
        want = as_dict(ref_rx.merge("r", ref_tx.encode("r", chunk)))
        got = as_dict(rx.merge("r", tx.encode("r", chunk)))
        assert first_difference(want, got) is None, f"chunk {k}: {first_difference(want, got)}"
        if "ids" in chunk and "output" in chunk["ids"]:
            assert got["ids"]["output"] == chunk["ids"]["output"]


def test_wire_survives_vllm_omni_serializer_and_stays_flat(plugin, vllm_omni):
    from vllm_omni.distributed.omni_connectors.utils.serialization import OmniSerializer

    tx, rx = pair()
    _, rx_plain = pair({"default": "cat", "rules": [{"match": "ids.output", "strategy": "replace"}]})
    sizes, plain_sizes = [], []
    ids: list[int] = []
    emb = torch.randn(2, 16, dtype=torch.bfloat16)
    for step in range(2000):
        ids = ids + [(step * 7919) % 150000]
        chunk = {"ids": {"output": list(ids)}}
        if step % 100 == 0:
            chunk["ids"]["tensor"] = emb = torch.cat([emb, torch.randn(1, 16, dtype=torch.bfloat16)])
        wire = tx.encode("r", chunk)
        check_plain_wire(wire)
        data = OmniSerializer.serialize(wire)
        sizes.append(len(data))
        plain_sizes.append(len(OmniSerializer.serialize(chunk)))
        view = rx.merge("r", OmniSerializer.deserialize(data))
        assert view["ids"]["output"] == ids
        rx_plain.merge("r", OmniSerializer.deserialize(OmniSerializer.serialize(chunk)))
    decode = [s for i, s in enumerate(sizes) if i % 100]
    assert max(decode[-100:]) <= max(decode[:100]) + 4, "delta wire bytes grow with the output"
    assert max(decode) < 80 and plain_sizes[-1] > 100 * max(decode)  # flat, vs O(n) for the whole list
