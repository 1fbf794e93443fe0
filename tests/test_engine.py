"""Sender/Receiver engine: the public API contract, bad input, per-request state and threads."""

from __future__ import annotations

import threading

import pytest
import torch

import omni_accum
from omni_accum.strategies.prealloc import Params as PreallocParams
from omni_accum.strategies.prealloc import PreallocAccumulator
from omni_accum.strategy import KeyInfo
from omni_accum.testing import as_dict, first_difference


def _prefill(p=5, h=8):
    return torch.randn(p, h).bfloat16()


def test_public_api_contract_nested_payloads():
    policy = omni_accum.load_policy("qwen3-omni")
    ctx = omni_accum.StreamContext(context_len=8000, concurrency=10)
    tx, rx = omni_accum.Sender(policy, context=ctx), omni_accum.Receiver(policy, context=ctx)
    prefill = _prefill()
    chunk0 = {
        "embed": {"prefill": prefill, "tts_bos": torch.ones(1, 1, 8).bfloat16()},
        "ids": {"prompt": [1, 2, 3]},
        "meta": {"finished": torch.tensor(False)},
    }
    view = rx.merge("req-1", tx.encode("req-1", chunk0))
    assert torch.equal(view["embed"]["prefill"], prefill)
    rows = []
    for i in range(10):
        row = torch.randn(1, 8).bfloat16()
        rows.append(row)
        chunk = {
            "embed": {"decode": row, "tts_bos": torch.ones(1, 1, 8).bfloat16()},
            "ids": {"prompt": [1, 2, 3]},
            "meta": {"finished": torch.tensor(i == 9)},
        }
        wire = tx.encode("req-1", chunk)
        assert "tts_bos" not in wire.get("embed", {}) and "ids" not in wire  # sent once
        view = rx.merge("req-1", wire)
        assert torch.equal(view["embed"]["decode"], torch.cat(rows))
        assert view["ids"]["prompt"] == [1, 2, 3]
    assert bool(view["meta"]["finished"]) is True
    assert rx.active_requests == 1 and tx.active_requests == 1
    tx.release("req-1")
    rx.release("req-1")
    assert rx.active_requests == 0 and tx.active_requests == 0


def test_flat_payloads_keep_their_nesting():
    tx, rx = omni_accum.Sender("qwen3-omni-flat"), omni_accum.Receiver("qwen3-omni-flat")
    p = _prefill()
    v = rx.merge("r", tx.encode("r", {"thinker_embeddings": p, "finished": False}))
    row = torch.randn(1, 8).bfloat16()
    v = rx.merge("r", tx.encode("r", {"thinker_embeddings": row, "finished": True}))
    assert set(v) == {"thinker_embeddings", "finished"}
    assert torch.equal(v["thinker_embeddings"], torch.cat([p, row])) and v["finished"] is True


def test_default_sender_passes_chunks_through_untouched():
    tx = omni_accum.Sender("default")
    chunk = {"embed": {"decode": torch.ones(1, 2)}, "meta": {"finished": torch.tensor(True)}}
    assert tx.encode("r", chunk) is chunk


def test_unknown_strategy_lists_available_names():
    with pytest.raises(omni_accum.PolicyError) as ei:
        omni_accum.Receiver({"default": "cat", "rules": [{"match": "embed.decode", "strategy": "prealoc"}]})
    msg = str(ei.value)
    assert "prealoc" in msg and "rules[0]" in msg
    for name in ("cat", "prealloc", "replace", "send_once", "token_list"):
        assert name in msg
    with pytest.raises(omni_accum.UnknownStrategyError, match=r"Available: cat, (.*, )?prealloc"):
        omni_accum.get_manager().spec("nope")


@pytest.mark.parametrize("strategy", ["cat", "token_list", "prealloc"])
@pytest.mark.parametrize(
    ("bad", "expected", "received"),
    [
        (torch.randn(1, 8).float(), "bfloat16", "float32"),
        (torch.randn(1, 9).bfloat16(), "[*, 8]", "[1, 9]"),
        (torch.randn(1, 2, 4).bfloat16(), "[*, 8]", "[1, 2, 4]"),
    ],
    ids=["dtype", "width", "rank"],
)
def test_dtype_or_trailing_shape_change_names_everything_and_keeps_state(strategy, bad, expected, received):
    rx = omni_accum.Receiver({"default": strategy})
    a, b = torch.randn(3, 8).bfloat16(), torch.randn(1, 8).bfloat16()
    rx.merge("req-7", {"embed": {"decode": a}, "speaker": "x"})
    rx.merge("req-7", {"embed": {"decode": b}})
    before = as_dict(rx.view("req-7"))
    with pytest.raises(omni_accum.AccumulationError) as ei:
        # a second, valid key in the same chunk must not be merged either (a chunk is all or nothing)
        rx.merge("req-7", {"speaker": "y", "embed": {"decode": bad}})
    err = ei.value
    assert err.request_id == "req-7" and err.key == "embed.decode" and err.strategy == strategy
    for part in ("req-7", "embed.decode", expected, received):
        assert part in str(err)
    assert first_difference(before, as_dict(rx.view("req-7"))) is None
    # the request is still usable with valid chunks
    c = torch.randn(2, 8).bfloat16()
    assert torch.equal(rx.merge("req-7", {"embed": {"decode": c}})["embed"]["decode"], torch.cat([a, b, c]))


def test_merge_after_release_starts_fresh_and_unknown_release_is_noop():
    rx = omni_accum.Receiver("qwen3-omni")
    rx.merge("r", {"embed": {"decode": torch.ones(2, 4)}})
    assert rx.release("r") is True
    assert rx.release("r") is False
    assert rx.release("never-seen") is False
    v = rx.merge("r", {"embed": {"decode": torch.zeros(1, 4)}})
    assert v["embed"]["decode"].shape == (1, 4)


def test_receiver_that_lost_send_once_state_reports_it():
    tx, rx = omni_accum.Sender("qwen3-omni"), omni_accum.Receiver("qwen3-omni")
    chunk = {"speaker": "Ethan", "embed": {"decode": torch.ones(1, 4)}}
    rx.merge("r", tx.encode("r", chunk))
    rx2 = omni_accum.Receiver("qwen3-omni")  # a restarted receiver; the sender keeps its memory
    with pytest.raises(omni_accum.AccumulationError, match="send_once"):
        rx2.merge("r", tx.encode("r", chunk))
    assert rx.merge("r", tx.encode("r", chunk))["speaker"] == "Ethan"


def test_token_list_materialises_on_read_only():
    rx = omni_accum.Receiver({"default": "token_list"})
    calls = []
    real_cat = torch.cat

    def counting_cat(*a, **k):
        calls.append(1)
        return real_cat(*a, **k)

    torch.cat = counting_cat
    try:
        for _ in range(20):
            v = rx.merge("r", {"x": torch.ones(1, 4)})
        assert calls == []  # never read yet
        assert v["x"].shape == (20, 4) and len(calls) == 1
        assert v["x"].shape == (20, 4) and len(calls) == 1  # cached until the next append
        rx.merge("r", {"x": torch.ones(1, 4)})
        assert rx.view("r")["x"].shape == (21, 4) and len(calls) == 2
    finally:
        torch.cat = real_cat
    assert len(rx.parts("r")["x"]) == 21


def test_prealloc_view_is_zero_copy_and_capacity_bounded():
    rx = omni_accum.Receiver(
        {"default": {"strategy": "prealloc", "params": {"initial_capacity": 8, "growth_factor": 1.5}}}
    )
    first = torch.randn(100, 4)
    rx.merge("r", {"x": first})
    rows = [first]
    for i in range(500):
        row = torch.randn(1 + i % 3, 4)
        rows.append(row)
        v = rx.merge("r", {"x": row})["x"]
        acc = rx._requests["r"].entries["x"].acc
        assert isinstance(acc, PreallocAccumulator)
        n = sum(r.shape[0] for r in rows)
        assert acc.capacity <= 1.5 * n + 8
        assert v.data_ptr() == acc._buf.data_ptr()  # a view of the buffer, no copy
    assert torch.equal(v, torch.cat(rows))


def test_prealloc_exact_growth_with_length_hint():
    ctx = omni_accum.StreamContext(context_len=100, length_hints={"embed.decode": 50})
    rx = omni_accum.Receiver({"default": "prealloc"}, context=ctx)
    for _ in range(50):
        rx.merge("r", {"embed": {"decode": torch.ones(1, 4)}})
    acc = rx._requests["r"].entries["embed"]["decode"].acc
    assert acc.capacity == 50  # allocated once, exactly


def test_prealloc_keeps_the_consumer_view_unchanged_when_caller_reuses_its_tensor():
    rx = omni_accum.Receiver({"default": "prealloc"})
    buf = torch.ones(1, 4)
    rx.merge("r", {"x": torch.zeros(2, 4)})
    rx.merge("r", {"x": buf})
    buf.fill_(7)  # the producer reuses its tensor
    assert torch.equal(rx.view("r")["x"], torch.cat([torch.zeros(2, 4), torch.ones(1, 4)]))


def test_requires_grad_and_non_contiguous_inputs():
    base = torch.randn(4, 6, requires_grad=True)
    nc = base.t()[:, :4]  # non-contiguous [6, 4]
    for name in ("cat", "token_list", "prealloc"):
        rx = omni_accum.Receiver({"default": name})
        rx.merge("r", {"x": torch.zeros(1, 4)})
        v = rx.merge("r", {"x": nc})["x"]
        assert torch.equal(v.detach(), torch.cat([torch.zeros(1, 4), nc.detach()]))


def test_threads_merge_and_release_concurrently():
    policy = omni_accum.load_policy("qwen3-omni")
    tx, rx = omni_accum.Sender(policy), omni_accum.Receiver(policy)
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        try:
            for r in range(40):
                rid = f"t{tid}-r{r}"
                rows = []
                for s in range(15):
                    row = torch.full((1, 4), float(s + tid))
                    rows.append(row)
                    v = rx.merge(rid, tx.encode(rid, {"embed": {"decode": row}, "speaker": f"s{tid}"}))
                    assert torch.equal(v["embed"]["decode"], torch.cat(rows)) and v["speaker"] == f"s{tid}"
                tx.release(rid)
                rx.release(rid)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert rx.active_requests == 0 and tx.active_requests == 0


def test_strategy_for_and_context_validation():
    rx = omni_accum.Receiver("qwen3-omni")
    assert rx.strategy_for("embed.decode", torch.ones(1, 2)) == "prealloc"
    assert rx.strategy_for("meta.finished", torch.tensor(True)) == "replace"
    assert rx.strategy_for("something.else", 1) == "cat"
    with pytest.raises(ValueError, match="concurrency"):
        omni_accum.StreamContext(concurrency=0)


def test_non_mapping_chunk_is_a_clear_error():
    with pytest.raises(omni_accum.AccumulationError, match="mapping"):
        omni_accum.Receiver().merge("r", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(omni_accum.AccumulationError, match="mapping"):
        omni_accum.Sender().encode("r", None)  # type: ignore[arg-type]


def test_membership_tests_do_not_materialise_token_list_views():
    rx = omni_accum.Receiver({"default": "token_list"})
    for _ in range(3):
        v = rx.merge("r", {"x": torch.ones(1, 4), "g": {"y": torch.ones(1, 2)}})
    acc_x = rx._requests["r"].entries["x"].acc
    acc_y = rx._requests["r"].entries["g"]["y"].acc
    assert "x" in v and "g" in v and "y" in v["g"] and "nope" not in v and "nope" not in v["g"]
    assert acc_x._cached is None and acc_y._cached is None  # nothing was concatenated
    assert v["x"].shape == (3, 4) and acc_x._cached is not None


def _raw_path_values():
    big = torch.randn(10, 8).bfloat16()
    return {
        "contiguous": (torch.randn(3, 8).bfloat16(), torch.randn(2, 8).bfloat16()),
        "storage-offset": (torch.randn(3, 8).bfloat16(), big[4:7]),
        "non-contiguous": (torch.randn(3, 8), torch.randn(8, 2).t()),
        "requires-grad": (torch.randn(3, 8), torch.randn(2, 8, requires_grad=True)),
        "parameter": (torch.randn(3, 8), torch.nn.Parameter(torch.randn(2, 8))),
        "zero-rows": (torch.randn(3, 8).bfloat16(), torch.empty(0, 8).bfloat16()),
        "int64-3d": (torch.arange(24).reshape(3, 2, 4), torch.arange(16).reshape(2, 2, 4)),
        "complex-conj": (torch.randn(3, 4, dtype=torch.complex64), torch.randn(2, 4, dtype=torch.complex64).conj()),
        "bool": (torch.ones(3, 5, dtype=torch.bool), torch.zeros(2, 5, dtype=torch.bool)),
        # a real tensor carrying the lazy negative bit: its raw bytes lack the sign
        "neg-bit": (torch.randn(3, 4), torch._neg_view(torch.randn(2, 4))),  # as torch.conj(c).imag gives
        # autograd's zero tensor: no storage (data_ptr 0); a raw copy from it would crash the process
        "zero-tensor": (torch.randn(3, 4), torch._efficientzerotensor((2, 4))),
    }


def _bits(t):
    t = t.resolve_conj().resolve_neg().contiguous()
    return t if t.dtype == torch.bool else t.view(torch.uint8)


@pytest.mark.parametrize("case", list(_raw_path_values()))
def test_prealloc_row_copy_equals_cat_on_every_kind_of_value(case):
    first, value = _raw_path_values()[case]
    acc = PreallocAccumulator(KeyInfo("x"), PreallocParams())
    acc.merge(first)
    for _ in range(3):  # several appends: the buffer grows past its initial capacity on the way
        acc.merge(value)
    want = torch.cat([first.detach(), *[value.detach()] * 3])
    got = acc.read()
    assert got.dtype == want.dtype and got.shape == want.shape
    # bit for bit (a view of the raw bytes, so NaN payloads and -0.0 count too); resolve_conj for the conj bit
    assert torch.equal(_bits(got), _bits(want))
    # the memmove path serves plain CPU dtypes; complex ones (a lazy conj bit) take torch's copy
    assert bool(acc._ptr) is (not want.dtype.is_complex)


@pytest.mark.parametrize("strategy", ["cat", "token_list", "prealloc"])
def test_append_check_refuses_device_and_0d_changes_on_known_keys(strategy):
    rx = omni_accum.Receiver({"default": strategy})
    rx.merge("r", {"x": torch.zeros(2, 4)})
    rx.merge("r", {"x": torch.ones(1, 4)})
    for bad, words in ((torch.zeros(1, 4, device="meta"), "device changed"), (torch.tensor(1.0), "0-d")):
        with pytest.raises(omni_accum.AccumulationError, match=words):
            rx.merge("r", {"x": bad})
    assert torch.equal(rx.view("r")["x"], torch.tensor([[0.0] * 4, [0.0] * 4, [1.0] * 4]))
    # a 0-d first value cannot be appended to, even by a value whose trailing shape looks the same
    rx.merge("s", {"x": torch.tensor(2.0)})
    with pytest.raises(omni_accum.AccumulationError, match="0-d"):
        rx.merge("s", {"x": torch.zeros(1)})


def test_prealloc_storage_resized_through_a_view_is_not_written_blindly():
    # A consumer that resizes the buffer's storage through its borrowed view (against the docs) must
    # not make the next append write through a stale address: it takes torch's checked copy.
    acc = PreallocAccumulator(KeyInfo("x"), PreallocParams())
    acc.merge(torch.zeros(2, 4))
    acc.merge(torch.ones(1, 4))
    view = acc.read()
    view.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError):
        acc.merge(torch.ones(1, 4))


def test_sender_fast_path_never_skips_an_encoder_when_a_leaf_becomes_a_group():
    policy = {"default": "cat", "rules": [{"match": "x.*", "strategy": "send_once"}]}
    tx, rx = omni_accum.Sender(policy), omni_accum.Receiver(policy)
    t = torch.ones(1, 4)
    leaf = {"x": t, "n": 1}
    assert tx.encode("r", leaf) is leaf and tx.encode("r", leaf) is leaf  # no encoder: the chunk itself
    group = {"x": {"a": t}, "n": 2}
    w1 = tx.encode("r", group)
    w2 = tx.encode("r", group)
    assert "a" in w1["x"] and "x" not in w2 and w2[omni_accum.WIRE_MARKER] == 1  # send_once left it off
    back = {"x": t, "n": 3}
    assert tx.encode("r", back) is back
    for w in (leaf, leaf, w1, w2, back):
        view = rx.merge("r", w)
    assert view["n"] == 3 and torch.equal(view["x"], t)


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ([1, 2, 3], [1, 2, 3], True),
        ([1, 2, 3], [1, 2, 4], False),
        ([1, 2], [1, 2, 3], False),
        ([True, 2], [1, 2], False),  # True == 1, but the consumer would see another value
        ([0.0, 1.0], [-0.0, 1.0], False),  # -0.0 == 0.0, but it is another value
        ([float("nan")], [float("nan")], False),  # NaN is never taken as unchanged
        ([["embed", "decode"], ["ids", "output"]], [["embed", "decode"], ["ids", "output"]], True),
        ([["embed", "decode"]], [["embed", "decodE"]], False),
        ([("embed", "decode")], [["embed", "decode"]], False),
        (("a", None, b"x"), ("a", None, b"x"), True),
        ([1, "a"], (1, "a"), False),
        ([torch.ones(2)], [torch.ones(2)], True),
        ([torch.zeros(1)], [-torch.zeros(1)], False),
        ({"a": 1, "b": 2}, {"a": 1, "b": 2}, True),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}, False),  # the consumer would see the old key order
        ({1: "v"}, {True: "v"}, False),  # one key to the dict, but the consumer would see the old one
        ({1: "v"}, {1.0: "v"}, False),
        ([torch._neg_view(torch.ones(2))], [-torch.ones(2)], True),  # lazy negative bit: compared resolved
        ([torch._neg_view(torch.zeros(2))], [torch.zeros(2)], False),  # -0.0 behind the negative bit
        ([torch.tensor([1 + 2j]).conj()], [torch.tensor([1 - 2j])], True),  # lazy conjugate bit
    ],
)
def test_send_once_comparison_is_exact(a, b, same):
    from omni_accum.strategies.send_once import same_value, snapshot

    assert same_value(a, b) is same
    snap = snapshot(a)
    assert same_value(snap, a) is (same_value(a, a))
    if isinstance(a, list):
        a.append(99)  # the snapshot is a private copy: an in-place change is seen
        assert same_value(snap, a) is False


def test_steady_chunks_with_send_once_omissions_merge_without_a_plan(monkeypatch):
    policy = omni_accum.load_policy("qwen3-omni")
    tx, rx = omni_accum.Sender(policy), omni_accum.Receiver(policy)
    rows = [torch.randn(1, 8).bfloat16() for _ in range(8)]

    def chunk(i):
        return {"embed": {"decode": rows[i]}, "speaker": "Ethan", "meta": {"finished": torch.tensor(i == 7)}}

    for i in range(2):
        rx.merge("r", tx.encode("r", chunk(i)))
    calls = []
    real_plan = rx._plan
    monkeypatch.setattr(rx, "_plan", lambda *a: calls.append(a) or real_plan(*a))
    for i in range(2, 7):
        wire = tx.encode("r", chunk(i))
        assert "speaker" not in wire and wire[omni_accum.WIRE_MARKER] == 1  # send_once left it off
        view = rx.merge("r", wire)
        assert view["speaker"] == "Ethan" and torch.equal(view["embed"]["decode"], torch.cat(rows[: i + 1]))
    assert calls == []  # steady state: the marker is covered, no key is new
    # a receiver that lost its send_once state still gets the precise error (from the full path)
    rx2 = omni_accum.Receiver(policy)
    with pytest.raises(omni_accum.AccumulationError, match="lost them"):
        rx2.merge("r", tx.encode("r", chunk(7)))


def test_send_once_always_sends_a_value_it_cannot_copy():
    """Without a private copy an in-place change could not be seen: such a value is never left off."""
    pol = {"default": "send_once"}
    tx, rx = omni_accum.Sender(pol), omni_accum.Receiver(pol)
    w0 = torch.ones(1, requires_grad=True)
    value = [w0 * 2]  # a non-leaf tensor: copy.deepcopy refuses it
    rx.merge("r", tx.encode("r", {"k": value}))
    value.append("new item")  # changed in place
    wire = tx.encode("r", {"k": value})
    assert "k" in wire
    assert rx.merge("r", wire)["k"][1] == "new item"
    assert "k" in tx.encode("r", {"k": value})  # unchanged, but still sent


@pytest.mark.parametrize("strategy", ["cat", "token_list", "prealloc"])
def test_a_legacy_empty_1d_tensor_beside_rows_is_refused_saying_so(strategy):
    """Before rows or after them (docs/library.md): torch.cat skips a ``torch.empty(0)``; omni-accum refuses it, and
    the message says that it is the 1-D empty tensor, and what to send instead."""
    for first, then, says in (
        (torch.zeros(2, 3), torch.empty(0), "legacy empty 1-D tensor after rows (torch.cat skips it; send shape [0, 3]"),
        (torch.empty(0), torch.zeros(2, 3), "rows after a legacy empty 1-D tensor (torch.cat skips it; start the key"),
    ):
        rx = omni_accum.Receiver({"default": strategy})
        rx.merge("r", {"x": first})
        with pytest.raises(omni_accum.AccumulationError, match="trailing shape changed") as e:
            rx.merge("r", {"x": then})
        assert says in str(e.value), str(e.value)
        assert rx.view("r")["x"].shape == first.shape  # the chunk refused, the state as it was
    rx = omni_accum.Receiver({"default": strategy})
    rx.merge("r", {"x": torch.zeros(2)})
    assert rx.merge("r", {"x": torch.empty(0)})["x"].shape == (2,)  # 1-D rows: an empty 1-D chunk is no rows
