"""A user's mistake at a call raises one of omni-accum's documented errors, at that call, naming the bad value
(docs/reliability.md "Only documented errors"); a refused first chunk leaves no request behind."""

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
    UnknownRequestError,
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
    (lambda: omni_accum.load_policy("default", manager="x"), InvalidArgumentError, ["manager must be a", "str"]),
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
    # a user's mistake, named as such: it was a PluginError blaming the built-in selector ("raised TypeError")
    (lambda: Receiver("qwen3-omni").strategy_for(5), InvalidArgumentError, ["path must be a key path", "got int 5"]),
    (lambda: Sender().strategy_for(None), InvalidArgumentError, ["path must be a key path", "NoneType None"]),
    # None was taken as an id, which rx.nbytes(None) (every request) then could not name
    (lambda: Receiver().merge(None, CHUNK), AccumulationError, ["request id must not be None", "give a str"]),
    (lambda: Sender().encode(None, CHUNK), AccumulationError, ["request id must not be None"]),
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


def test_length_hints_cannot_change_after_the_context_checked_them():
    """The context is frozen but its hints were a plain dict: ``ctx.length_hints["x"] = [1]`` after the check gave a
    bare TypeError at the next merge and left the request behind; a str hint failed the request under prealloc."""
    import copy
    import pickle

    ctx = StreamContext(context_len=8, length_hints={"embed.decode": 10})
    with pytest.raises(TypeError):
        ctx.length_hints["embed.decode"] = "100"  # type: ignore[index]
    with pytest.raises(TypeError):
        ctx.length_hints["x"] = [1]  # type: ignore[index]
    assert dict(ctx.length_hints) == {"embed.decode": 10}
    for again in (pickle.loads(pickle.dumps(ctx)), copy.deepcopy(ctx), copy.copy(ctx)):  # pickles and copies
        assert again == ctx and dict(again.length_hints) == {"embed.decode": 10}
        with pytest.raises(TypeError):
            again.length_hints.update(x=1)  # read-only in the copy too
    import dataclasses
    import json

    import yaml

    as_dict = {"context_len": 8, "concurrency": 1, "length_hints": {"embed.decode": 10}}
    assert dataclasses.asdict(ctx) == as_dict and json.loads(json.dumps(dataclasses.asdict(ctx))) == as_dict
    assert yaml.safe_load(yaml.safe_dump(dataclasses.asdict(ctx))) == as_dict  # serialises as a dict does
    rx = Receiver("qwen3-omni", context=ctx)
    rx.merge("r", {"embed": {"decode": torch.ones(1, 2)}})
    assert rx.merge("r", {"embed": {"decode": torch.ones(1, 2)}})["embed"]["decode"].shape == (2, 2)


_NOT_DENSE = {
    "sparse_coo": lambda: torch.ones(2, 3).to_sparse(),
    "sparse_csr": lambda: torch.ones(2, 3).to_sparse_csr(),
    "mkldnn": lambda: torch.ones(2, 3).to_mkldnn(),
    "nested": lambda: torch.nested.nested_tensor([torch.ones(3), torch.ones(2)]),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: sparse CSR is beta, nested tensors a prototype
@pytest.mark.parametrize("policy", ["default", "qwen3-omni", {"default": "token_list"}, {"default": "prealloc"}])
@pytest.mark.parametrize("kind", sorted(_NOT_DENSE))
def test_a_tensor_that_is_not_dense_is_refused_and_the_request_goes_on(policy, kind):
    """Under token_list a sparse chunk after dense rows was taken and the view could never be read again (a bare
    NotImplementedError); under cat and prealloc the strategy raised mid-merge and the request was failed; a nested
    first value was a bare RuntimeError that left the request behind. Refused (the chunk), as a dtype change is."""
    rx = Receiver(policy)
    rx.merge("r", {"embed": {"decode": torch.ones(2, 3)}})
    with pytest.raises(AccumulationError, match="the append strategies hold dense") as e:
        rx.merge("r", {"embed": {"decode": _NOT_DENSE[kind]()}})
    assert e.value.key == "embed.decode"
    view = rx.merge("r", {"embed": {"decode": torch.zeros(1, 3)}})  # the request goes on, its state as it was
    assert torch.equal(view["embed"]["decode"], torch.cat([torch.ones(2, 3), torch.zeros(1, 3)]))
    assert torch.equal(rx.finish("r")["embed"]["decode"], view["embed"]["decode"])
    fresh = Receiver(policy)
    with pytest.raises(AccumulationError, match="the append strategies hold dense"):
        fresh.merge("s", {"embed": {"decode": _NOT_DENSE[kind]()}})  # a first value: no request left
    assert fresh.request_ids() == []


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("strategy", ["replace", "send_once"])
@pytest.mark.parametrize("kind", sorted(_NOT_DENSE))
def test_replace_kinds_hold_a_tensor_that_is_not_dense(strategy, kind):
    """send_once compared values with torch.equal (NotImplementedError for sparse: the request failed); a nested
    value failed its first read's check (a bare RuntimeError). Held and sent again each chunk (no compare)."""
    tx, rx = Sender({"default": strategy}), Receiver({"default": strategy})
    value = _NOT_DENSE[kind]()
    for _ in range(3):
        view = rx.merge("r", tx.encode("r", {"x": value}))
        assert view["x"] is value  # one process: the value itself, as sent
    assert isinstance(rx.view("r", copy=True)["x"], torch.Tensor)


class _PoisonSelector:
    """A selection hook that raises for the key ``poison``."""

    @omni_accum.hookimpl
    def omni_accum_select_strategy(self, key, meta, context, policy):
        if key == "poison":
            raise RuntimeError("selector tripped")
        return None


@pytest.fixture
def poisoned():
    m = omni_accum.StrategyManager(load_entrypoints=False)
    m.load_entrypoints([])  # the built-ins only
    m.register(_PoisonSelector(), name="poison_selector")
    return m


@pytest.mark.parametrize(
    "chunk,seq",
    [
        (CHUNK, -1),
        (CHUNK, "0"),
        ({"x": torch.zeros(1, 2), "__omni_accum__": "bad"}, None),
        ({"x": torch.zeros(1, 2), "meta": {"override_keys": 5}}, None),
        ({"x": torch.zeros(1, 2), "meta": {"override_keys": 5}}, 0),
    ],
    ids=["seq-negative", "seq-str", "malformed-marker", "override-keys-not-a-list", "sequenced-override-keys"],
)
def test_a_refused_first_chunk_leaves_no_request_behind(chunk, seq):
    rx = Receiver("default")
    for i in range(50):
        with pytest.raises(AccumulationError):
            rx.merge(f"r{i}", chunk, seq=seq)
    assert rx.active_requests == 0
    with pytest.raises(UnknownRequestError):
        rx.view("r5")
    rx.merge("r5", CHUNK)  # the request can start afresh
    assert rx.view("r5")["x"].shape == (2, 2)


def test_a_first_chunk_whose_selection_hook_raised_leaves_no_request_on_either_side(poisoned):
    tx, rx = Sender("default", manager=poisoned), Receiver("default", manager=poisoned)
    for i in range(20):
        with pytest.raises(AccumulationError, match="selector tripped"):
            tx.encode(f"r{i}", {"x": torch.zeros(1, 2), "poison": 1})
        with pytest.raises(AccumulationError, match="selector tripped"):
            rx.merge(f"r{i}", {"x": torch.zeros(1, 2), "poison": 1})
    assert tx.active_requests == 0 and rx.active_requests == 0


def test_a_refused_later_chunk_keeps_the_request_and_its_state():
    rx = Receiver("default")
    rx.merge("r", {"x": torch.zeros(2, 2)})
    with pytest.raises(AccumulationError, match="dtype changed"):
        rx.merge("r", {"x": torch.zeros(1, 2, dtype=torch.float64)})
    assert rx.active_requests == 1 and rx.view("r")["x"].shape == (2, 2)


def test_a_refused_first_chunk_that_carried_a_send_once_value_keeps_the_request_failed():
    """The documented contract (reliability.md): the sender now leaves that value off, so the request fails until
    it is released; dropping its state would let a later chunk start the request without that value."""
    pol = {"default": "cat", "rules": [{"match": "spk", "strategy": "send_once"}]}
    tx, rx = Sender(pol), Receiver(pol)
    bad = tx.encode("r", {"spk": torch.ones(1), "x": torch.zeros(1, 2), "meta": {"override_keys": 5}})
    with pytest.raises(AccumulationError, match="override_keys"):
        rx.merge("r", bad)
    assert rx.active_requests == 1
    with pytest.raises(AccumulationError, match="request failed earlier"):
        rx.merge("r", tx.encode("r", {"spk": torch.ones(1), "x": torch.zeros(1, 2)}))


def test_a_selection_hooks_choice_with_params_that_are_not_a_mapping_is_named_and_leaves_no_request():
    """``StrategyChoice("prealloc", params=[1, 2])`` from a hook was a bare TypeError out of ``dict(params)``."""
    from omni_accum.policy.model import StrategyChoice

    class Listy:
        @omni_accum.hookimpl
        def omni_accum_select_strategy(self, key, meta, context, policy):
            return StrategyChoice("prealloc", params=[1, 2], source="listy") if key == "x" else None

    m = omni_accum.StrategyManager(load_entrypoints=False)
    m.load_entrypoints([])
    m.register(Listy(), name="listy")
    rx = Receiver("default", manager=m)
    with pytest.raises(AccumulationError, match=r"chosen by listy: .*refuses params \[1, 2\]: params must be a mapping"):
        rx.merge("r", {"x": torch.ones(1, 2)})
    assert rx.request_ids() == []


def test_an_option_of_one_value_given_twice_is_said_and_the_last_one_used(capsys):
    """``explain --key x --key y`` explained y alone without a word (argparse keeps the last value); a list option
    (``--context-lens``, which adds up its occurrences) says nothing."""
    from omni_accum import cli

    assert cli.main(["explain", "default", "--key", "x", "--key", "y"]) == 0
    out, err = capsys.readouterr()
    assert "key 'y' -> cat" in out and "key 'x'" not in out, out
    assert "omni-accum explain: note: --key given twice (--key 'x', then --key 'y'): the last one is used" in err, err
    assert cli.main(["explain", "default", "--key", "x", "--context-len", "5", "--concurrency", "1"]) == 0
    assert "given twice" not in capsys.readouterr().err


def test_bench_json_given_twice_is_a_usage_error_and_the_parse_leaves_no_bookkeeping(capsys):
    """``bench --json a --json b`` is refused, naming both (which file would get the results?); a parse leaves only
    the options on the namespace (it kept ``_json_given`` and ``_plot_given`` beside them)."""
    from omni_accum import cli

    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["bench", "--json", "a.json", "--json", "b.json"])
    assert e.value.code == 2
    assert "omni-accum bench: error: --json given twice (a.json and b.json); give it once" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["bench", "--json", "a.json", "--plot", "a.png"])
    assert (args.json, args.plot) == ("a.json", "a.png")
    assert [k for k in vars(args) if k.startswith("_")] == [], vars(args)
