"""Findings of an audit of the library API: each test fails on the code before its fix.

A split policy runs as its first arm in the library; arena senders and receivers refuse bad kinds, hints and sizes;
``bench.replay.measure`` and ``build_arms`` check their arguments; ``prealloc`` refuses quantized tensors and says
what its params need; ``Policy.rules`` is read-only; early sequenced chunks are held as copies; an unhashable id is
an AccumulationError everywhere; ``view(copy=)`` takes a bool; the library docs match the API.
"""

from __future__ import annotations

import inspect
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch

import omni_accum
import omni_accum.strategies.prealloc as prealloc_module
from conftest import require_module
from omni_accum.arena import ArenaReceiver, ArenaSender, path_for
from omni_accum.errors import AccumulationError, InvalidArgumentError, PolicyError, UnknownRequestError
from omni_accum.policy.model import Policy, Rule
from omni_accum.testing import same_bits

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _split(tmp_path: Path, arm_text: str) -> dict:
    arm = tmp_path / "arm.yaml"
    arm.write_text(arm_text)
    return {"ab": {"arms": {"first": {"policy": str(arm)}, "second": {"policy": "default"}}}}


# -- 1. a policy with an ab section runs as its first arm ------------------------------------------------------ #


def test_the_first_arms_byte_guard_applies_through_the_split(tmp_path):
    split = _split(tmp_path, "default: cat\nmax_bytes_per_request: 100\n")
    rx = omni_accum.Receiver(split)
    assert rx.policy.max_bytes_per_request == 100 and rx.policy.ab is None  # the arm's own policy
    with pytest.raises(AccumulationError, match="max_bytes_per_request=100"):
        rx.merge("r", {"x": torch.zeros(100, 8)})  # 3200 bytes
    assert rx.active_requests == 0
    assert omni_accum.Sender(split).policy.max_bytes_per_request == 100


def test_the_first_arms_honor_override_keys_false_is_honoured(tmp_path):
    rx = omni_accum.Receiver(_split(tmp_path, "default: cat\nhonor_override_keys: false\n"))
    a, b = torch.randn(2, 3), torch.randn(1, 3)
    rx.merge("r", {"x": a})
    view = rx.merge("r", {"x": b, "meta": {"override_keys": ["x"]}})
    assert same_bits(view["x"], torch.cat([a, b]))  # not reset: the arm does not honour override_keys


def test_an_arm_giving_override_keys_a_wire_rewriting_strategy_is_refused(tmp_path):
    require_module("omni_accum_delta", "the example plugin, installed by scripts/env.sh")
    split = _split(tmp_path, "default: cat\nrules:\n  - {match: meta.override_keys, strategy: delta}\n")
    for cls in (omni_accum.Sender, omni_accum.Receiver):
        with pytest.raises(PolicyError, match="rewrites the key's wire form"):
            cls(split)


# -- 2, 11. arena kinds, length hints and sizes ------------------------------------------------------------- #


def _absent_arena() -> str:
    return f"test_audit_absent_{id(object())}"


@pytest.mark.parametrize("kind", ["apend", "Append", 3, None])
def test_an_arena_sender_refuses_an_unknown_kind(kind):
    with pytest.raises(InvalidArgumentError) as e:
        ArenaSender(_absent_arena(), {"x": kind}, attach_timeout_s=0.0)
    msg = str(e.value)
    assert "kinds['x']" in msg and repr(kind) in msg and "append, replace, static" in msg
    if kind == "apend":
        assert "did you mean 'append'" in msg
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("rows", [-5, 2.5, float("nan"), True, "100"])
def test_an_arena_sender_refuses_a_length_hint_that_is_no_row_count(rows):
    said = f"length_hints['x'] must be an int >= 0 (rows), got {rows!r}"
    with pytest.raises(InvalidArgumentError, match=re.escape(said)):
        ArenaSender(_absent_arena(), {"x": "append"}, length_hints={"x": rows}, attach_timeout_s=0.0)


@pytest.mark.parametrize("data_bytes", [0, -1, 1.5, True, "1MiB"])
def test_an_arena_receiver_refuses_data_bytes_below_one(data_bytes):
    name = _absent_arena()
    said = f"data_bytes must be an int >= 1 (bytes of slab space), got {data_bytes!r}"
    with pytest.raises(InvalidArgumentError, match=re.escape(said)):
        ArenaReceiver(name, data_bytes)
    assert not path_for(name).exists()


# -- 3, 9. bench arguments ---------------------------------------------------------------------------------- #


def _small_workload():
    from omni_accum.bench.workloads import load_workload

    return load_workload("qwen3-omni-seed").model_copy(update={"decode_steps": 2})


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"context_len": 0}, "context_len must be an int >= 1 or None"),
        ({"context_len": -8}, "context_len must be an int >= 1 or None"),
        ({"context_len": 8.0}, "context_len must be an int >= 1 or None"),
        ({"context_len": True}, "context_len must be an int >= 1 or None"),
        ({"repeats": 0}, "repeats must be an int >= 1, got 0"),
        ({"repeats": True}, "repeats must be an int >= 1, got True"),
        ({"concurrency": 0}, "concurrency must be an int >= 1, got 0"),
        ({"device": "bogus"}, "device must be a torch device name"),
        ({"device": 0}, "device must be a torch device name"),
        ({"through": "bogus"}, "unknown --through mode 'bogus'; through must be one of 'direct'"),
        ({"wire": 3}, "unknown wire 3; wire must be one of 'inproc', 'serializer', 'shm'"),
    ],
)
def test_measure_checks_its_arguments_up_front(kwargs, named):
    from omni_accum.bench import build_arms
    from omni_accum.bench.replay import measure

    wl = _small_workload()
    with pytest.raises(InvalidArgumentError, match=re.escape(named)):
        measure(wl, build_arms(wl, ["cat"]), **{"context_len": 8, "repeats": 1, **kwargs})


@pytest.mark.parametrize("arms", [["cat"], "cat", None])
def test_measure_refuses_arms_that_are_no_mapping(arms):
    from omni_accum.bench.replay import measure

    with pytest.raises(InvalidArgumentError, match=r"measure: arms must be a mapping of labels to arms \(build_arms"):
        measure(_small_workload(), arms, context_len=8, repeats=1)


def test_build_arms_refuses_one_str_of_names():
    from omni_accum.bench import arm_policy_files, build_arms

    wl = _small_workload()
    said = "build_arms: names must be a list of arm names, got str 'upstream,prealloc' (['upstream', 'prealloc']?)"
    with pytest.raises(InvalidArgumentError, match=re.escape(said)):
        build_arms(wl, "upstream,prealloc")
    with pytest.raises(InvalidArgumentError, match="every arm name must be a str, got 3"):
        build_arms(wl, ["cat", 3])
    with pytest.raises(InvalidArgumentError, match="arm_policy_files: names must be a list"):
        arm_policy_files(wl, "my-policy.yaml")
    assert list(build_arms(wl, ("cat",))) == ["cat"]  # any sequence of names


# -- 4, 10. prealloc ------------------------------------------------------------------------------------------- #


def _quantized(rows: int) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantized tensors
        return torch.quantize_per_tensor(torch.randn(rows, 4), 0.1, 0, torch.qint8)


def test_prealloc_refuses_quantized_tensors_in_check_and_cat_joins_them():
    rx = omni_accum.Receiver({"default": "prealloc"})
    with pytest.raises(AccumulationError, match=r"prealloc holds no quantized tensors \(dtype torch.qint8\)") as e:
        rx.merge("r", {"x": _quantized(3)})
    assert e.value.key == "x" and e.value.strategy == "prealloc" and rx.active_requests == 0  # left as it was
    a, b = torch.randn(2, 4), torch.randn(1, 4)
    rx.merge("r", {"x": a})
    with pytest.raises(AccumulationError, match="dtype changed mid-stream"):
        rx.merge("r", {"x": _quantized(2)})
    assert same_bits(rx.merge("r", {"x": b})["x"], torch.cat([a, b]))  # not failed: the chunk was refused whole
    cat = omni_accum.Receiver({"default": "cat"})
    q1, q2 = _quantized(3), _quantized(2)
    cat.merge("r", {"x": q1})
    assert torch.equal(cat.merge("r", {"x": q2})["x"].int_repr(), torch.cat([q1, q2]).int_repr())


@pytest.mark.parametrize(
    ("params", "said"),
    [
        ({"growth_factor": float("nan")}, "growth_factor: must be a finite number > 1 (got nan)"),
        ({"growth_factor": float("inf")}, "growth_factor: must be a finite number > 1 (got inf)"),
        ({"reuse_bytes": -1}, "reuse_bytes: must be >= 0 (got -1)"),
        ({"reuse_bytes": "-1MiB"}, "reuse_bytes: must be >= 0 (got '-1MiB')"),
    ],
)
def test_prealloc_params_say_what_they_need(params, said):
    with pytest.raises(PolicyError, match=re.escape(said)):
        omni_accum.load_policy({"default": {"strategy": "prealloc", "params": params}})


# -- 5. Policy.rules is read-only --------------------------------------------------------------------------- #


def test_policy_rules_refuse_changes_and_still_read_dump_and_pickle_as_a_list():
    p = omni_accum.load_policy("qwen3-omni")
    n = len(p.rules)
    for change in (
        lambda: p.rules.append(Rule(match="x", strategy="prealloc")),
        lambda: p.rules.extend([]),
        lambda: p.rules.insert(0, p.rules[0]),
        lambda: p.rules.__setitem__(0, p.rules[1]),
        lambda: p.rules.__delitem__(0),
        lambda: p.rules.pop(),
        lambda: p.rules.clear(),
        lambda: p.rules.sort(key=str),
        lambda: p.rules.reverse(),
        lambda: p.rules.remove(p.rules[0]),
        lambda: Policy().rules.append(Rule(match="x", strategy="cat")),
    ):
        with pytest.raises(TypeError, match="Policy.rules is read-only"):
            change()
    with pytest.raises(TypeError, match="read-only"):
        p.rules += []
    assert len(p.rules) == n and p.rules == list(p.rules) and Policy().rules == []
    assert omni_accum.load_policy(omni_accum.dump_policy(p)) == p
    q = pickle.loads(pickle.dumps(p))
    assert q == p and q.match_rule("embed.decode") == p.match_rule("embed.decode")
    with pytest.raises(TypeError):
        q.rules.append(Rule(match="x", strategy="cat"))
    assert isinstance(p.model_dump()["rules"], list)


# -- 6. early sequenced chunks are held as copies ---------------------------------------------------------- #


@pytest.mark.parametrize("policy", ["default", "qwen3-omni", {"default": "prealloc"}, {"default": "token_list"}])
def test_a_chunk_held_in_the_reorder_window_is_a_copy_of_the_senders_values(policy):
    rx = omni_accum.Receiver(policy)
    c0 = {"x": torch.randn(2, 3), "g": {"y": torch.randn(1, 4)}, "ids": [1, 2]}
    c1 = {"x": torch.randn(1, 3), "g": {"y": torch.randn(2, 4)}, "ids": [3], "t": (torch.ones(1),)}
    ref = {"x": torch.cat([c0["x"], c1["x"]]), "y": torch.cat([c0["g"]["y"], c1["g"]["y"]]), "t": c1["t"][0].clone()}
    rx.merge("r", c1, seq=1)  # early: held until seq 0 arrives
    c1["x"].fill_(7.0)  # the sender reuses its buffers once a chunk is sent
    c1["g"]["y"].zero_()
    c1["ids"].append(99)
    c1["t"][0].fill_(5.0)
    c1["g"]["z"] = torch.ones(1)
    view = rx.merge("r", c0, seq=0)
    assert same_bits(view["x"], ref["x"]) and same_bits(view["g"]["y"], ref["y"])
    assert same_bits(view["t"][0], ref["t"])
    assert view["ids"] == [1, 2, 3] and "z" not in view["g"]


def test_a_chunk_merged_at_once_is_not_copied():
    rx = omni_accum.Receiver("default")
    t = torch.randn(2, 3)
    assert rx.merge("r", {"x": t}, seq=0)["x"] is t  # the first chunk is the sender's tensor, as upstream's


# -- 7, 8. request ids and view(copy=) ---------------------------------------------------------------------- #


@pytest.mark.parametrize("method", ["view", "nbytes", "parts"])
def test_an_unhashable_id_is_an_accumulation_error_for_lookups_too(method):
    rx = omni_accum.Receiver("default")
    rx.merge("r", {"x": torch.zeros(1, 2)})
    with pytest.raises(AccumulationError, match=r"a request id must be hashable \(a str\), got list") as e:
        getattr(rx, method)(["a"])
    assert isinstance(e.value, UnknownRequestError) and isinstance(e.value, KeyError)  # what they raised before
    assert str(e.value) == "a request id must be hashable (a str), got list"
    with pytest.raises(AccumulationError, match="must be hashable"):
        rx.merge(["a"], {"x": torch.zeros(1, 2)})


@pytest.mark.parametrize("copy", ["no", 1, 0, None, [True]])
def test_view_copy_must_be_a_bool(copy):
    rx = omni_accum.Receiver("default")
    rx.merge("r", {"x": torch.zeros(1, 2)})
    said = f"view: copy must be True or False, got {type(copy).__name__}"
    with pytest.raises(InvalidArgumentError, match=re.escape(said)):
        rx.view("r", copy=copy)
    assert isinstance(rx.view("r", copy=True), dict) and rx.view("r", copy=False) is rx.view("r")


# -- 12. the library docs match the API ----------------------------------------------------------------------- #


def test_library_docs_name_the_real_parameters_and_the_refused_off_source():
    text = (DOCS / "library.md").read_text()
    assert "`rx.nbytes(req_id=None)`" in text and "req_id" in inspect.signature(omni_accum.Receiver.nbytes).parameters
    assert 'load_policy("off")` raises `PolicyError`' in text
    with pytest.raises(PolicyError, match="'off' is neither a policy file nor a preset"):
        omni_accum.load_policy("off")
    assert "leaves no request at all, unless the request is marked failed by it" in text
    assert "a request keeps the context of its first chunk" in text and "only sizes a buffer" in text
    assert "exactly the hinted length" not in text + prealloc_module.__doc__


def test_a_refused_first_chunk_that_fails_its_request_leaves_it_behind_as_documented():
    """The documented exception: a first chunk refused while carrying a send_once value fails the request."""
    rx = omni_accum.Receiver({"default": "cat", "rules": [{"match": "spk", "strategy": "send_once"}]})
    with pytest.raises(AccumulationError):
        rx.merge("r", {"spk": "a", "x": torch.zeros(2, 2).to_sparse()})  # the append strategies hold dense tensors
    assert rx.active_requests == 1
    with pytest.raises(AccumulationError, match="request failed earlier"):
        rx.merge("r", {"x": torch.zeros(1, 2)})
