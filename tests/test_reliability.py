"""Faults, each with its documented behaviour (docs/reliability.md), memory bounds, and policies as data."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import omni_accum
from omni_accum.strategies.prealloc import PreallocAccumulator
from omni_accum.strategy import KeyInfo
from omni_accum.testing import as_dict, first_difference
from conftest import require_module

AccumulationError = omni_accum.AccumulationError


def rows(n: int, h: int = 4, start: float = 0.0) -> list[torch.Tensor]:
    return [torch.full((1, h), start + i) for i in range(n)]


def decode_stream(n: int) -> list[dict]:
    return [
        {"embed": {"decode": r}, "speaker": "Ethan", "meta": {"finished": torch.tensor(i == n - 1)}}
        for i, r in enumerate(rows(n))
    ]


def decode_view(view) -> torch.Tensor:
    return view["embed"]["decode"]


# ---------------------------------------------------------------------------------------------- #
# Duplicates, gaps, reordering: upstream behaviour without seq, detected with seq
# ---------------------------------------------------------------------------------------------- #


def test_without_seq_chunks_merge_as_given_like_upstream():
    rx = omni_accum.Receiver("qwen3-omni")
    a, b = rows(2)
    rx.merge("r", {"embed": {"decode": a}})
    rx.merge("r", {"embed": {"decode": a}})  # a duplicate is merged twice: upstream cannot tell
    v = rx.merge("r", {"embed": {"decode": b}})
    assert torch.equal(decode_view(v), torch.cat([a, a, b]))
    assert rx.sequence("r") is None


def test_duplicate_is_dropped_idempotently_and_counted():
    tx, rx = omni_accum.Sender("qwen3-omni"), omni_accum.Receiver("qwen3-omni")
    chunks = decode_stream(4)
    wires = [tx.encode("r", c) for c in chunks]
    for s in (0, 1, 1, 0, 2, 2, 3, 3):
        v = rx.merge("r", wires[s], seq=s)
    assert torch.equal(decode_view(v), torch.cat([c["embed"]["decode"] for c in chunks]))
    state = rx.sequence("r")
    assert state.duplicates == 4 and state.next_seq == 4 and not state.buffered
    assert rx.duplicates_dropped == 4
    assert rx.finish("r", chunks=4) is not None


def test_out_of_order_chunks_are_merged_in_seq_order():
    tx, rx = omni_accum.Sender("qwen3-omni"), omni_accum.Receiver("qwen3-omni")
    chunks = decode_stream(6)
    wires = [tx.encode("r", c) for c in chunks]  # send_once leaves 'speaker' off chunks 1..5
    assert "speaker" not in wires[3]
    v = rx.merge("r", wires[2], seq=2)
    assert len(v) == 0  # nothing in order yet: the view is the (empty) in-order prefix
    rx.merge("r", wires[1], seq=1)
    assert rx.sequence("r").buffered == (1, 2) and rx.sequence("r").missing == (0,)
    v = rx.merge("r", wires[0], seq=0)  # fills the gap: 0, 1, 2 merged
    assert torch.equal(decode_view(v), torch.cat([c["embed"]["decode"] for c in chunks[:3]]))
    for s in (5, 4, 3):
        v = rx.merge("r", wires[s], seq=s)
    assert torch.equal(decode_view(v), torch.cat([c["embed"]["decode"] for c in chunks]))
    assert v["speaker"] == "Ethan" and bool(v["meta"]["finished"])


def test_gap_is_reported_at_finish_and_when_the_window_overflows():
    rx = omni_accum.Receiver("qwen3-omni", reorder_window=3)
    chunks = decode_stream(8)
    rx.merge("r", chunks[0], seq=0)
    rx.merge("r", chunks[2], seq=2)  # seq 1 lost
    with pytest.raises(AccumulationError) as ei:
        rx.finish("r")
    assert ei.value.missing == (1,) and "missing 1" in str(ei.value)
    before = as_dict(rx.view("r"))
    with pytest.raises(AccumulationError) as ei:
        rx.merge("r", chunks[5], seq=5)  # 4 ahead of next (1), window 3
    err = ei.value
    assert err.seq == 5 and err.missing == (1, 3, 4) and "reorder_window=3" in str(err)
    assert first_difference(before, as_dict(rx.view("r"))) is None  # rejected whole, state unchanged
    # the lost chunk is re-sent: everything buffered merges, in order
    v = rx.merge("r", chunks[1], seq=1)
    assert torch.equal(decode_view(v), torch.cat([c["embed"]["decode"] for c in chunks[:3]]))
    # a tail gap is only visible when finish is told how many chunks were sent
    with pytest.raises(AccumulationError, match="only seqs 0..2 arrived") as ei:
        rx.finish("r", chunks=8)
    assert ei.value.missing == (3, 4, 5, 6, 7)


def test_window_zero_reports_any_gap_at_once_and_huge_seqs_stay_cheap():
    rx = omni_accum.Receiver("default", reorder_window=0)
    rx.merge("r", {"x": torch.ones(1, 2)}, seq=0)
    with pytest.raises(AccumulationError) as ei:
        rx.merge("r", {"x": torch.ones(1, 2)}, seq=10**12)
    assert len(ei.value.missing) == 100 and "more" in str(ei.value)
    for bad in (-1, 1.0, "1", True):
        with pytest.raises(AccumulationError, match="seq must be an int"):
            rx.merge("r", {"x": torch.ones(1, 2)}, seq=bad)


def test_a_request_is_numbered_throughout_or_not_at_all():
    rx = omni_accum.Receiver("default")
    rx.merge("a", {"x": torch.ones(1, 2)}, seq=0)
    with pytest.raises(AccumulationError, match="carry sequence numbers"):
        rx.merge("a", {"x": torch.ones(1, 2)})
    rx.merge("b", {"x": torch.ones(1, 2)})
    with pytest.raises(AccumulationError, match="carried none"):
        rx.merge("b", {"x": torch.ones(1, 2)}, seq=1)
    with pytest.raises(AccumulationError, match="needs chunks merged with seq"):
        rx.finish("b", chunks=1)
    assert rx.finish("b")["x"].shape == (1, 2)


def test_a_rejected_sequenced_chunk_keeps_its_seq_open_for_a_resend():
    rx = omni_accum.Receiver("qwen3-omni")
    a, b = rows(2)
    rx.merge("r", {"embed": {"decode": a}}, seq=0)
    rx.merge("r", {"embed": {"decode": b}}, seq=2)
    with pytest.raises(AccumulationError, match="dtype changed"):
        rx.merge("r", {"embed": {"decode": torch.ones(1, 4, dtype=torch.int64)}}, seq=1)
    assert rx.sequence("r").next_seq == 1
    v = rx.merge("r", {"embed": {"decode": a}}, seq=1)  # the corrected chunk
    assert torch.equal(decode_view(v), torch.cat([a, a, b]))


def test_a_rejected_sequenced_chunk_carrying_a_send_once_value_fails_the_request():
    """The sender recorded the value as delivered: a corrected chunk it encodes again leaves it off."""
    tx, rx = omni_accum.Sender("qwen3-omni"), omni_accum.Receiver("qwen3-omni")
    rx.merge("r", tx.encode("r", {"speaker": "Ethan", "embed": {"decode": torch.ones(1, 4)}}), seq=0)
    bad = tx.encode("r", {"speaker": "Chelsie", "embed": {"decode": torch.ones(1, 5)}})
    with pytest.raises(AccumulationError, match="trailing shape"):
        rx.merge("r", bad, seq=1)
    corrected = tx.encode("r", {"speaker": "Chelsie", "embed": {"decode": torch.ones(1, 4)}})
    assert "speaker" not in corrected
    with pytest.raises(AccumulationError, match="failed earlier.*'speaker'"):
        rx.merge("r", corrected, seq=1)  # never 'Ethan' served as if current
    # the same when the chunk was buffered and is refused as its gap fills
    tx, rx = omni_accum.Sender("qwen3-omni"), omni_accum.Receiver("qwen3-omni")
    w0 = tx.encode("q", {"speaker": "Ethan", "embed": {"decode": torch.ones(1, 4)}})
    w1 = tx.encode("q", {"speaker": "Ethan", "embed": {"decode": torch.ones(1, 4)}})
    w2 = tx.encode("q", {"speaker": "Chelsie", "embed": {"decode": torch.ones(1, 5)}})
    rx.merge("q", w0, seq=0)
    rx.merge("q", w2, seq=2)  # buffered
    with pytest.raises(AccumulationError, match="seq 1 filled the gap"):
        rx.merge("q", w1, seq=1)  # fills the gap; seq 2 is refused
    corrected = tx.encode("q", {"speaker": "Chelsie", "embed": {"decode": torch.ones(1, 4)}})
    with pytest.raises(AccumulationError, match="failed earlier"):
        rx.merge("q", corrected, seq=2)


def test_a_buffered_chunk_that_fails_when_the_gap_fills_names_its_seq():
    rx = omni_accum.Receiver("qwen3-omni")
    a = torch.ones(1, 4)
    rx.merge("r", {"embed": {"decode": torch.ones(1, 5)}}, seq=1)  # wrong width, buffered unchecked
    with pytest.raises(AccumulationError) as ei:
        rx.merge("r", {"embed": {"decode": a}}, seq=0)
    assert ei.value.seq == 1 and ei.value.key == "embed.decode" and "re-send" in str(ei.value)
    assert torch.equal(decode_view(rx.view("r")), a)  # seq 0 merged; seq 1 open again
    assert rx.sequence("r").next_seq == 1 and not rx.sequence("r").buffered


# ---------------------------------------------------------------------------------------------- #
# Value changes, raising strategies, release, restarts
# ---------------------------------------------------------------------------------------------- #


def test_dtype_or_shape_change_mid_stream_rejects_the_chunk_and_keeps_state():
    rx = omni_accum.Receiver("qwen3-omni")
    a = torch.ones(2, 4)
    rx.merge("r", {"embed": {"decode": a}, "codes": {"audio": torch.arange(4)}})
    for bad in (torch.ones(1, 4, dtype=torch.float64), torch.ones(1, 5), torch.ones(4)):
        with pytest.raises(AccumulationError, match="changed mid-stream") as ei:
            rx.merge("r", {"embed": {"decode": bad}, "codes": {"audio": torch.arange(3)}})
        assert ei.value.key == "embed.decode"
        assert torch.equal(rx.view("r")["codes"]["audio"], torch.arange(4))  # whole chunk rejected
    # replace-kind keys may change dtype and shape: the latest value wins
    v = rx.merge("r", {"codes": {"audio": torch.ones(2, 3, dtype=torch.int32)}})
    assert v["codes"]["audio"].dtype == torch.int32


def test_send_once_value_that_changes_is_sent_again():
    tx, rx = omni_accum.Sender("qwen3-omni"), omni_accum.Receiver("qwen3-omni")
    spk = torch.zeros(1, 4)
    assert "speaker" in tx.encode("r", {"speaker": spk})
    rx.merge("r", {"speaker": spk})
    assert "speaker" not in tx.encode("r", {"speaker": spk.clone()})
    spk[0, 0] = -0.0  # same under ==, other bits
    spk2 = spk.clone()
    spk2[0, 0] = 1.0
    wire = tx.encode("r", {"speaker": spk2})
    assert torch.equal(rx.merge("r", wire)["speaker"], spk2)


def test_release_mid_stream_then_more_chunks():
    tx, rx = omni_accum.Sender("qwen3-omni"), omni_accum.Receiver("qwen3-omni")
    chunks = decode_stream(4)
    rx.merge("r", tx.encode("r", chunks[0]))
    rx.release("r")  # the receiver drops the request while the sender goes on
    with pytest.raises(AccumulationError, match="send_once"):  # the static key it lost is reported
        rx.merge("r", tx.encode("r", chunks[1]))
    # without send_once keys nothing marks the loss unless chunks carry seq: then it is a gap
    tx2, rx2 = omni_accum.Sender("default"), omni_accum.Receiver("default")
    rx2.merge("q", tx2.encode("q", {"x": torch.ones(1, 2)}), seq=0)
    rx2.release("q")
    rx2.merge("q", tx2.encode("q", {"x": torch.ones(1, 2)}), seq=1)
    with pytest.raises(AccumulationError) as ei:
        rx2.finish("q")
    assert ei.value.missing == (0,)


def test_merge_for_a_released_request_starts_fresh_and_release_is_idempotent():
    rx = omni_accum.Receiver("qwen3-omni")
    rx.merge("r", {"embed": {"decode": torch.ones(3, 4)}}, seq=0)
    assert rx.release("r") and not rx.release("r")
    v = rx.merge("r", {"embed": {"decode": torch.zeros(1, 4)}}, seq=0)
    assert decode_view(v).shape == (1, 4) and rx.sequence("r").next_seq == 1
    with pytest.raises(AccumulationError, match="no chunk of this request"):
        rx.finish("never-seen")


def test_restarted_receiver_never_serves_a_missing_static_key():
    tx = omni_accum.Sender("qwen3-omni")
    rx = omni_accum.Receiver("qwen3-omni")
    chunk = {"speaker": "Ethan", "embed": {"decode": torch.ones(1, 4), "tts_bos": torch.ones(1, 1, 4)}}
    rx.merge("r", tx.encode("r", chunk))
    restarted = omni_accum.Receiver("qwen3-omni")
    wire = tx.encode("r", chunk)
    assert omni_accum.WIRE_MARKER in wire and "speaker" not in wire
    with pytest.raises(AccumulationError, match="holds 0") as ei:
        restarted.merge("r", wire)
    assert ei.value.request_id == "r" and restarted.active_requests == 0  # a refused first chunk leaves nothing
    # one static changed (sent), one still omitted: the receiver still knows it lacks one
    chunk2 = {**chunk, "speaker": "Chelsie"}
    with pytest.raises(AccumulationError, match="holds 1"):
        restarted.merge("r", tx.encode("r", chunk2))


def test_a_rejected_chunk_carrying_a_send_once_value_fails_the_request_rather_than_serve_it_stale():
    tx, rx = omni_accum.Sender("qwen3-omni"), omni_accum.Receiver("qwen3-omni")
    rx.merge("r", tx.encode("r", {"speaker": "Ethan", "embed": {"decode": torch.ones(1, 4)}}))
    bad = {"speaker": "Chelsie", "embed": {"decode": torch.ones(1, 5)}}  # speaker changes; decode is rejected
    with pytest.raises(AccumulationError, match="trailing shape"):
        rx.merge("r", tx.encode("r", bad))
    # the sender now believes 'Chelsie' delivered and leaves it off; serving 'Ethan' would be stale
    nxt = tx.encode("r", {"speaker": "Chelsie", "embed": {"decode": torch.ones(1, 4)}})
    assert "speaker" not in nxt
    with pytest.raises(AccumulationError, match="failed earlier.*'speaker'"):
        rx.merge("r", nxt)
    # a rejected chunk without send_once values leaves the request usable (state unchanged)
    rx.merge("q", {"embed": {"decode": torch.ones(1, 4)}})
    with pytest.raises(AccumulationError):
        rx.merge("q", {"embed": {"decode": torch.ones(1, 5)}})
    assert decode_view(rx.merge("q", {"embed": {"decode": torch.ones(1, 4)}})).shape == (2, 4)


def test_the_marker_key_is_reserved_and_a_malformed_marker_is_refused():
    tx, rx = omni_accum.Sender("default"), omni_accum.Receiver("default")
    with pytest.raises(AccumulationError, match="reserves it") as ei:
        tx.encode("r", {omni_accum.WIRE_MARKER: 0, "x": 1})
    assert ei.value.key == omni_accum.WIRE_MARKER
    assert tx.active_requests == 0
    for bad in (-1, "2", 1.5, True, None, torch.tensor(1)):
        with pytest.raises(AccumulationError, match="malformed wire marker|off the wire|holds none"):
            rx.merge("r", {omni_accum.WIRE_MARKER: bad, "x": 1})
        for seq in (None, 0):  # sequenced or not, the chunk is refused and nothing merged
            with pytest.raises(AccumulationError, match="malformed wire marker|off the wire|holds none"):
                rx.merge(f"s{seq}", {omni_accum.WIRE_MARKER: bad, "x": 1}, seq=seq)
            assert f"s{seq}" not in rx.request_ids()  # a refused first chunk leaves no request behind
    with pytest.raises(AccumulationError, match="off the wire"):
        rx.merge("r", {omni_accum.WIRE_MARKER: 1})
    rx = omni_accum.Receiver("qwen3-omni")
    rx.merge("r", {"speaker": "Ethan", "embed": {"decode": torch.ones(1, 4)}})
    # a negative count: an override list left off that this receiver never held: refused, never guessed
    with pytest.raises(AccumulationError, match="holds none") as ei:
        rx.merge("r", {omni_accum.WIRE_MARKER: -1})
    assert ei.value.key == "meta.override_keys"
    assert torch.equal(rx.view("r")["embed"]["decode"], torch.ones(1, 4))  # state unchanged


def test_an_override_list_left_off_applies_only_to_chunks_that_carried_it():
    """The wire marker says send_once values were left off; only a negative count says the list was one of them."""
    tx, rx, plain = (
        omni_accum.Sender("qwen3-omni"),
        omni_accum.Receiver("qwen3-omni"),
        omni_accum.Receiver("qwen3-omni"),
    )
    t = [torch.full((1, 2), float(i)) for i in range(5)]
    listed = {"override_keys": [["embed", "prefill"]]}
    chunks = [
        {"meta": listed, "embed": {"prefill": t[0]}, "speaker": "a"},
        {"meta": listed, "embed": {"prefill": t[1]}, "speaker": "a"},  # list left off: it resets
        {"embed": {"prefill": t[2]}, "speaker": "a"},  # no list on this chunk: appends, speaker left off
        {"meta": {"finished": False}, "embed": {"prefill": t[3]}, "speaker": "a"},  # meta, no list: appends
        {"meta": listed, "embed": {"prefill": t[4]}, "speaker": "a"},  # listed again (unchanged): resets
    ]
    want = [t[0], t[1], torch.cat(t[1:3]), torch.cat(t[1:4]), t[4]]
    for k, chunk in enumerate(chunks):
        wire = tx.encode("r", chunk)
        if k:  # a negative count: the override list was left off and still applies
            assert "speaker" not in wire and (wire[omni_accum.WIRE_MARKER] < 0) is (k in (1, 4)), (k, wire)
        got = rx.merge("r", wire)["embed"]["prefill"]
        assert torch.equal(got, want[k]), k
        assert torch.equal(plain.merge("r", chunk)["embed"]["prefill"], want[k]), k  # the list as sent, unencoded


def test_a_raising_strategy_fails_only_its_request():
    # the full matrix (encode, check, merge, state factories, selection) is tests/test_plugin_isolation.py
    class Boom(Exception):
        pass

    rx = omni_accum.Receiver("qwen3-omni")
    acc_cls = PreallocAccumulator
    real = acc_cls.append_tensor

    def boom(self, value):
        if self.key.request_id == "bad":
            raise Boom("append failed")
        return real(self, value)

    acc_cls.append_tensor = boom
    try:
        for rid in ("good", "bad"):
            rx.merge(rid, {"embed": {"decode": torch.ones(1, 4)}})
        with pytest.raises(AccumulationError, match="Boom") as ei:
            rx.merge("bad", {"embed": {"decode": torch.ones(1, 4)}})
        assert ei.value.strategy == "prealloc" and isinstance(ei.value.__cause__, Boom)
        with pytest.raises(AccumulationError, match="failed earlier"):
            rx.merge("bad", {"embed": {"decode": torch.ones(1, 4)}})
        assert decode_view(rx.merge("good", {"embed": {"decode": torch.ones(1, 4)}})).shape == (2, 4)
    finally:
        acc_cls.append_tensor = real
    rx.release("bad")
    assert decode_view(rx.merge("bad", {"embed": {"decode": torch.ones(1, 4)}})).shape == (1, 4)


# ---------------------------------------------------------------------------------------------- #
# Memory bounds
# ---------------------------------------------------------------------------------------------- #


@given(
    init=st.integers(1, 64),
    growth=st.floats(1.01, 16.0),
    first=st.integers(0, 50),
    appends=st.lists(st.integers(0, 40), min_size=1, max_size=60),
    hint=st.none() | st.integers(0, 400),
)
def test_prealloc_capacity_never_exceeds_growth_times_rows_plus_initial(init, growth, first, appends, hint):
    params = omni_accum.get_manager().spec("prealloc").params_model(initial_capacity=init, growth_factor=growth)
    acc = PreallocAccumulator(KeyInfo("x", "r", hint), params)
    acc.merge(torch.zeros(first, 2))
    n = first
    for k in appends:
        projected = acc.projected_nbytes(torch.ones(k, 2))
        acc.merge(torch.ones(k, 2))
        n += k
        assert acc.capacity <= growth * n + init, (acc.capacity, n)
        assert acc.capacity >= n
        assert acc.nbytes() == projected  # the guard's projection is what the buffer then holds
    assert acc.read().shape == (n, 2)


@pytest.mark.parametrize("strategy", ["cat", "token_list", "prealloc", "replace", "send_once"])
@given(
    values=st.lists(
        st.tuples(st.sampled_from(["rows", "ids", "tensors", "dict"]), st.integers(0, 30), st.booleans()),
        min_size=1,
        max_size=30,
    )
)
def test_projected_bytes_is_what_the_state_then_holds(strategy, values):
    """After a merge and a read the state holds its projection; without the read, no more than it."""
    make = {
        "rows": lambda k: torch.ones(k, 3),
        "ids": lambda k: list(range(k)),
        "tensors": lambda k: [torch.ones(2)] * k,
        "dict": lambda k: {"a": torch.ones(k), "b": "x" * k},
    }
    rx = omni_accum.Receiver({"default": strategy, "max_bytes_per_request": 1 << 40})
    for kind, k, read in values:
        value = make[kind](k)  # in a group: a dict there is a leaf value (at the top it would be a group)
        slot = rx._requests["r"].entries["g"].get("x") if "r" in rx.request_ids() else None
        projected = slot.acc.projected_nbytes(value) if slot is not None else None
        view = rx.merge("r", {"g": {"x": value}})
        if read:
            view["g"]["x"]  # token_list caches its concatenation; a list state copies its view
        if projected is not None:
            assert rx.nbytes("r") == projected if read else rx.nbytes("r") <= projected


@pytest.mark.parametrize("strategy", ["cat", "token_list", "prealloc"])
@pytest.mark.parametrize("kind", ["rows", "ids", "tensors"])
@pytest.mark.parametrize("read", [True, False])
def test_max_bytes_guard_holds_whatever_the_consumer_reads(strategy, kind, read):
    """The guard starts from what the state holds now (a read may have cached a concatenation)."""
    make = {"rows": lambda: torch.ones(250), "ids": lambda: list(range(50)), "tensors": lambda: [torch.ones(100)]}
    limit = 5000
    rx = omni_accum.Receiver({"default": strategy, "max_bytes_per_request": limit})
    refused = 0
    for _ in range(40):
        try:
            view = rx.merge("r", {"x": make[kind]()})
        except AccumulationError as e:
            assert "max_bytes_per_request" in str(e)
            refused += 1
            continue
        if read:
            view["x"]
        assert rx.nbytes("r") <= limit
    view = rx.view("r")
    view["x"]  # a final read: still within the limit
    assert refused and rx.nbytes("r") <= limit


def test_max_bytes_guard_counts_a_leaf_a_group_replaces_and_dict_values():
    limit = 4000
    rx = omni_accum.Receiver({"default": "replace", "max_bytes_per_request": limit})
    u8 = torch.uint8
    rx.merge("r", {"x": torch.ones(3000, dtype=u8)})
    rx.merge("r", {"x": {"q": torch.ones(2000, dtype=u8)}})  # the leaf goes: 2000 held, not 5000
    rx.merge("r", {"x": torch.ones(2000, dtype=u8)})  # and back
    assert rx.nbytes("r") == 2000
    with pytest.raises(AccumulationError, match="max_bytes_per_request"):
        rx.merge("r", {"y": {"a": {"t": torch.ones(3000, dtype=u8)}}})  # a dict held as a leaf value counts
    rx.merge("r", {"x": {}})  # an empty group replaces the leaf
    assert rx.nbytes("r") == 0
    rx = omni_accum.Receiver({"default": "cat", "max_bytes_per_request": 800})
    rx.merge("r", {"ids": list(range(50))})
    rx.merge("r", {"ids": list(range(50))})  # 100 ids of 8 bytes: exactly the limit, accepted
    assert rx.nbytes("r") == 800


def test_max_bytes_guard_refuses_before_prealloc_grows_past_it():
    row = 4 * 256  # one float32 row of 256
    policy = {
        "default": {"strategy": "prealloc", "params": {"initial_capacity": 4, "growth_factor": 2.0}},
        "max_bytes_per_request": 30 * row,
    }
    rx = omni_accum.Receiver(policy)
    rx.merge("r", {"x": torch.ones(10, 256)})
    rx.merge("r", {"x": torch.ones(1, 256)})  # the first append grows the buffer to 2 x 10 rows
    acc = rx._requests["r"].entries["x"].acc
    assert acc.capacity == 20 and rx.nbytes("r") == 20 * row
    for _ in range(9):
        rx.merge("r", {"x": torch.ones(1, 256)})
    # 20 rows held; one more row would grow the buffer to 40 rows (over 30 rows): refused before allocating.
    # (Counting the incoming value alone, 21 rows, would have let it through and allocated 40.)
    ptr = acc._buf.data_ptr()
    with pytest.raises(AccumulationError, match="max_bytes_per_request") as ei:
        rx.merge("r", {"x": torch.ones(1, 256)})
    assert "'x' grows by" in str(ei.value) and f"would hold {40 * row} bytes" in str(ei.value)
    assert acc._buf.data_ptr() == ptr and acc.capacity == 20 and rx.view("r")["x"].shape == (20, 256)
    assert rx.nbytes("r") <= 30 * row


def test_max_bytes_guard_counts_replacements_and_new_keys():
    rx = omni_accum.Receiver({"default": "replace", "max_bytes_per_request": 1000})
    for _ in range(5):
        rx.merge("r", {"a": torch.ones(200, dtype=torch.uint8), "b": torch.ones(700, dtype=torch.uint8)})
    with pytest.raises(AccumulationError, match="would hold 1100 bytes"):
        rx.merge("r", {"c": torch.ones(200, dtype=torch.uint8)})
    rx.merge("r", {"b": torch.ones(100, dtype=torch.uint8), "c": torch.ones(300, dtype=torch.uint8)})
    assert rx.nbytes("r") == 600


def test_bench_peak_bytes_is_the_receivers_held_bytes():
    from omni_accum.bench import strategy_arm
    from omni_accum.bench.replay import measure
    from omni_accum.bench.streams import build_stream
    from omni_accum.bench.workloads import load_workload

    wl = load_workload("qwen3-omni-full-payload")
    arms = {name: strategy_arm(wl, name) for name in ("cat", "token_list", "prealloc")}
    res = {r.arm: r for r in measure(wl, arms, context_len=32, concurrency=2, repeats=1)}
    stream = build_stream(wl, 32)
    hidden = sum(c["hidden_states"]["output"].numel() * 2 for c in stream)  # bf16 rows
    ids = 8 * sum(len(c["ids"]["output"]) for c in stream if "ids" in c)
    flag = 1  # meta.finished, a 0-d bool tensor
    # Two requests. cat holds one tensor and one list. prealloc is told the final length (exact growth, no
    # spare rows); its list part keeps the items plus the copy the consumer read. token_list also holds the
    # concatenation its read cached.
    assert res["cat"].peak_bytes == 2 * (hidden + ids + flag)
    assert res["prealloc"].peak_bytes == 2 * (hidden + 2 * ids + flag)
    assert res["token_list"].peak_bytes == 2 * (2 * hidden + 2 * ids + flag)


# ---------------------------------------------------------------------------------------------- #
# Policies are data
# ---------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "name",
    ["os.system", "omni_accum.strategies.cat:Cat", "omni_accum.strategies.cat.Cat", "builtins:eval", "__import__"],
)
def test_import_paths_are_not_strategy_names(name, tmp_path):
    doc = {"default": "cat", "rules": [{"match": "embed.decode", "strategy": name}]}
    with pytest.raises(omni_accum.PolicyError) as ei:
        omni_accum.load_policy(doc)
    msg = str(ei.value)
    assert f"unknown strategy {name!r}" in msg and "Available: cat, " in msg and "prealloc" in msg
    path = tmp_path / "p.yaml"
    path.write_text(f"default: {name!r}\n")
    with pytest.raises(omni_accum.PolicyError, match="Available: cat, "):
        omni_accum.load_policy(str(path))


def test_yaml_python_tags_are_refused(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("default: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(omni_accum.PolicyError, match="policies are data"):
        omni_accum.load_policy(str(path))


# ---------------------------------------------------------------------------------------------- #
# meta.override_keys must travel as itself
# ---------------------------------------------------------------------------------------------- #


def test_override_keys_with_a_wire_rewriting_strategy_is_refused():
    require_module("omni_accum_delta", "the example plugin, installed by scripts/env.sh")
    bad = {"default": "cat", "rules": [{"match": "meta.override_keys", "strategy": "delta"}]}
    for cls in (omni_accum.Sender, omni_accum.Receiver):
        with pytest.raises(omni_accum.PolicyError, match="rewrites the key's wire form"):
            cls(bad)
    with pytest.raises(omni_accum.PolicyError, match=r"from default\)"):
        omni_accum.Receiver({"default": "delta"})
    # allowed when the receiver does not read override_keys, or when the key travels as itself
    omni_accum.Receiver({**bad, "honor_override_keys": False})
    omni_accum.Receiver({"default": "delta", "rules": [{"match": "meta.*", "strategy": "send_once"}]})


def test_override_keys_rewritten_by_a_selection_hook_is_an_accumulation_error():
    require_module("omni_accum_delta", "the example plugin, installed by scripts/env.sh")
    from omni_accum.policy import StrategyChoice

    class Picker:
        @omni_accum.hookimpl
        def omni_accum_select_strategy(self, key, meta, context, policy):
            return StrategyChoice("delta", {}, "test") if key == "meta.override_keys" else None

    mgr = omni_accum.StrategyManager()
    mgr.register(Picker(), name="picker")
    rx = omni_accum.Receiver("qwen3-omni", manager=mgr)
    with pytest.raises(AccumulationError, match="rewrites the key's wire form") as ei:
        rx.merge("r", {"meta": {"override_keys": ["x"]}, "x": torch.ones(1, 2)})
    assert ei.value.key == "meta.override_keys" and ei.value.strategy == "delta"


def test_the_send_once_count_follows_keys_that_turn_from_leaf_to_group_and_back():
    """The marker counts the send_once values the receiver holds; it drops a leaf a group replaces (and the reverse)."""
    pol = {"default": "send_once"}
    tx, rx = omni_accum.Sender(pol), omni_accum.Receiver(pol)
    chunks = [{"spk": "x"}, {"spk": {"a": "y"}}, {"spk": {"a": "y"}}, {"spk": "z"}, {"spk": "z", "lang": "en"}]
    chunks += [{"spk": "z", "lang": "en"}]
    for k, chunk in enumerate(chunks):
        wire = tx.encode("r", chunk)
        assert rx.merge("r", wire).to_dict() == chunk, k
        assert tx._requests["r"].held_once == rx._requests["r"].held_once, k
    assert wire == {omni_accum.WIRE_MARKER: 2}


def _manager_with(strategy_cls):
    """A StrategyManager with the built-ins and one replace-kind test strategy, as a plugin named after it."""
    from omni_accum.strategies.replace import Params as ReplaceParams
    from omni_accum.strategy import StrategySpec

    class plugin:
        @omni_accum.hookimpl
        def omni_accum_register_strategies():
            spec = StrategySpec(
                name=strategy_cls.name, factory=strategy_cls, params_model=ReplaceParams, kinds=frozenset({"replace"})
            )
            return [spec]

    mgr = omni_accum.StrategyManager()
    mgr.register(plugin, name=strategy_cls.name)
    return mgr


def test_a_plugin_raising_in_a_state_factory_or_check_fails_its_request_until_released():
    """docs/plugins.md: a strategy raising in new_encoder, new_accumulator or check fails that request only."""
    from omni_accum.errors import MergeError
    from omni_accum.strategies.replace import Params as ReplaceParams
    from omni_accum.strategies.replace import ReplaceAccumulator
    from omni_accum.strategy import Strategy

    class Bug(Exception):
        pass

    class Acc(ReplaceAccumulator):
        def check(self, value):
            if value == "bug":
                raise Bug("plugin bug in check")
            if value == "refused":
                raise MergeError("refused value")

    class Picky(Strategy):
        name = "picky"
        Params = ReplaceParams

        def new_encoder(self, key):
            if key.path == "no_encoder":
                raise Bug("plugin bug in new_encoder")

        def new_accumulator(self, key):
            if key.path == "no_state":
                raise Bug("plugin bug in new_accumulator")
            return Acc()

    mgr = _manager_with(Picky)
    pol = {"default": "picky", "honor_override_keys": False}  # its encoder would rewrite the override list
    tx, rx = omni_accum.Sender(pol, manager=mgr), omni_accum.Receiver(pol, manager=mgr)
    with pytest.raises(AccumulationError, match="new_encoder raised Bug") as ei:
        tx.encode("r", {"spk": "x", "no_encoder": 1})
    assert ei.value.plugin == "picky"
    with pytest.raises(AccumulationError, match="failed earlier"):
        tx.encode("r", {"spk": "x"})
    tx.release("r")
    assert tx.encode("r", {"spk": "x"}) == {"spk": "x"}
    for bad, words in (({"no_state": 1}, "new_accumulator raised Bug"), ({"n": "bug"}, "check raised Bug")):
        rx.merge("r", {"n": 1})
        with pytest.raises(AccumulationError, match=words):
            rx.merge("r", bad)
        with pytest.raises(AccumulationError, match="failed earlier"):
            rx.merge("r", {"n": 2})
        assert rx.release("r") and rx.merge("r", {"n": 3}).to_dict() == {"n": 3}
        rx.release("r")
    # a value the strategy refuses (MergeError) is a rejected chunk, not a bug: the request goes on
    rx.merge("r", {"n": 1})
    with pytest.raises(AccumulationError, match="refused value"):
        rx.merge("r", {"n": "refused"})
    assert rx.merge("r", {"n": 2}).to_dict() == {"n": 2}


def test_a_first_value_is_checked_before_any_key_of_the_chunk_is_merged():
    """docs/plugins.md: the engine checks every key of a chunk before merging any, new keys included."""
    from omni_accum.errors import MergeError
    from omni_accum.strategies.replace import Params as ReplaceParams
    from omni_accum.strategies.replace import ReplaceAccumulator
    from omni_accum.strategy import Strategy

    class IntsOnly(ReplaceAccumulator):
        def check(self, value):
            if not isinstance(value, int):
                raise MergeError(f"ints only, got {type(value).__name__}")

    class Ints(Strategy):
        name = "ints"
        Params = ReplaceParams

        def new_accumulator(self, key):
            return IntsOnly()

    mgr = _manager_with(Ints)
    rx = omni_accum.Receiver({"default": "cat", "rules": [{"match": "n", "strategy": "ints"}]}, manager=mgr)
    with pytest.raises(AccumulationError, match="ints only, got str"):
        rx.merge("r", {"x": torch.ones(1), "n": "not an int"})
    assert rx.active_requests == 0  # nothing merged: a refused first chunk leaves no request; it can start again
    assert rx.merge("r", {"x": torch.ones(1), "n": 1})["n"] == 1


# ---------------------------------------------------------------------------------------------- #
# prealloc's kept buffers (reuse_bytes)
# ---------------------------------------------------------------------------------------------- #


@pytest.fixture
def no_kept_buffers():
    from omni_accum.strategies import prealloc

    prealloc.drop_kept()
    yield prealloc
    prealloc.drop_kept()


def _filled(params, chunks, hint):
    acc = PreallocAccumulator(KeyInfo("x", "r", hint), params)
    for c in chunks:
        acc.merge(c)
    return acc


def test_a_kept_buffer_is_reused_only_when_nothing_refers_to_it(no_kept_buffers):
    """Bit-for-bit views from a reused buffer; never reused while its accumulator, a view or a tensor made
    from a view still refers to it; another dtype or row shape never gets it; the pool stays in its budget."""
    prealloc = no_kept_buffers
    params = omni_accum.get_manager().spec("prealloc").params_model(reuse_bytes="4KiB")
    g = torch.Generator().manual_seed(0)
    chunks = [[torch.randn(n, 4, generator=g) for n in (5, 7, 9)] for _ in range(4)]
    first = _filled(params, chunks[0], 21)
    addr = first.read().data_ptr()
    assert prealloc.kept_bytes() == 21 * 4 * 4  # the hinted rows, float32
    second = _filled(params, chunks[1], 21)  # the first accumulator still holds its buffer
    assert second.read().data_ptr() != addr and torch.equal(second.read(), torch.cat(chunks[1]))
    view = first.read()
    derived = view.view(torch.uint8)  # a tensor made from the view keeps the storage in use as well
    del first, view
    third = _filled(params, chunks[2], 21)
    assert third.read().data_ptr() != addr
    del derived, third
    other = _filled(params, [c.double() for c in chunks[3]], 21)  # another dtype: a buffer of its own
    assert other.read().data_ptr() != addr
    fourth = _filled(params, chunks[3], 21)  # nothing refers to the first buffer any more: reused
    assert fourth.read().data_ptr() == addr
    assert torch.equal(fourth.read(), torch.cat(chunks[3]))
    assert prealloc.kept_bytes() == 3 * 336 + 672  # three float32 buffers (the fourth reused one) and a float64 one


def test_a_kept_buffer_held_only_through_its_storage_or_shared_with_another_process_is_never_reused(no_kept_buffers):
    """The pool's guard was the storage's use count: a consumer holding only ``view.untyped_storage()`` (torch hands
    that same object out again) or a view moved to shared memory (``share_memory_``, torch's multiprocessing pickler:
    another process reads it) did not count, and the next request's rows were written under it."""
    del no_kept_buffers  # (the fixture: no kept buffers before and after)
    params = omni_accum.get_manager().spec("prealloc").params_model(reuse_bytes="4KiB")
    g = torch.Generator().manual_seed(1)
    chunks = [[torch.randn(n, 4, generator=g) for n in (5, 7, 9)] for _ in range(4)]
    first = _filled(params, chunks[0], 21)
    addr, expect = first.read().data_ptr(), torch.cat(chunks[0]).clone()
    storage = first.read().untyped_storage()  # all a consumer keeps
    del first
    second = _filled(params, chunks[1], 21)
    assert second.read().data_ptr() != addr
    assert torch.equal(torch.empty(0).set_(storage, 0, (21, 4)), expect)  # what the consumer kept is unchanged
    del storage, second
    third = _filled(params, chunks[2], 21)  # nothing refers to it now: reused
    assert third.read().data_ptr() == addr and torch.equal(third.read(), torch.cat(chunks[2]))
    third.read().share_memory_()  # moved to shared memory (as torch's multiprocessing pickler does)
    moved = third.read().data_ptr()
    del third
    fourth = _filled(params, chunks[3], 21)
    assert fourth.read().data_ptr() not in (addr, moved)  # never handed to another request again
    assert torch.equal(fourth.read(), torch.cat(chunks[3]))


def test_the_budget_drops_unused_kept_buffers_first_and_never_grows_past_it(no_kept_buffers):
    prealloc = no_kept_buffers
    params = omni_accum.get_manager().spec("prealloc").params_model(reuse_bytes=700)
    a = _filled(params, [torch.ones(2, 4), torch.ones(19, 4)], 21)  # 336 B, kept
    b = _filled(params, [torch.ones(2, 4), torch.ones(19, 4)], 21)  # 336 B, kept (672)
    c = _filled(params, [torch.ones(2, 4), torch.ones(19, 4)], 21)  # no room, a and b in use: not kept
    assert prealloc.kept_bytes() == 672
    del a
    d = _filled(params, [torch.ones(2, 8), torch.ones(19, 8)], 21)  # 672 B: no room while b is in use
    assert prealloc.kept_bytes() == 672 and d.read().shape == (21, 8)  # a's buffer was not dropped for nothing
    del b, c, d
    e = _filled(params, [torch.ones(2, 8), torch.ones(19, 8)], 21)  # a's and b's unused: dropped, e's kept
    assert prealloc.kept_bytes() == 672
    addr = e.read().data_ptr()
    del e
    assert _filled(params, [torch.ones(2, 8), torch.ones(19, 8)], 21).read().data_ptr() == addr


def test_a_kept_buffer_too_large_for_the_capacity_bound_is_not_handed_out(no_kept_buffers):
    params = omni_accum.get_manager().spec("prealloc").params_model(initial_capacity=1, reuse_bytes="1MiB")
    big = _filled(params, [torch.ones(2, 4), torch.ones(998, 4)], 1000)
    addr = big.read().data_ptr()
    del big
    small = _filled(params, [torch.ones(2, 4), torch.ones(3, 4)], 5)
    assert small.read().data_ptr() != addr and small.capacity <= 2.0 * 5 + 1
    again = _filled(params, [torch.ones(2, 4), torch.ones(900, 4)], 1000)
    assert again.read().data_ptr() == addr and again.capacity == 1000


@given(
    growth=st.floats(1.01, 8.0),
    requests=st.lists(
        st.tuples(st.lists(st.integers(1, 30), min_size=1, max_size=8), st.none() | st.integers(0, 200)),
        min_size=1,
        max_size=8,
    ),
    keep=st.lists(st.booleans(), min_size=8, max_size=8),
)
def test_prealloc_with_kept_buffers_holds_the_bound_and_equals_cat(growth, requests, keep):
    from omni_accum.strategies import prealloc

    prealloc.drop_kept()
    params = omni_accum.get_manager().spec("prealloc").params_model(
        initial_capacity=4, growth_factor=growth, reuse_bytes=4096
    )
    held = []
    try:
        for i, (sizes, hint) in enumerate(requests):
            chunks = [torch.full((n, 3), float(i * 100 + j)) for j, n in enumerate(sizes)]
            acc = PreallocAccumulator(KeyInfo("x", f"r{i}", hint), params)
            n = 0
            for c in chunks:
                projected = acc.projected_nbytes(c)
                acc.merge(c)
                n += c.shape[0]
                assert n <= acc.capacity <= growth * n + 4
                assert acc.nbytes() == projected
            assert torch.equal(acc.read(), torch.cat(chunks))
            for other, other_chunks in held:  # a later request never wrote into rows shown elsewhere
                assert torch.equal(other.read(), torch.cat(other_chunks))
            if keep[i]:
                held.append((acc, chunks))
            assert prealloc.kept_bytes() <= 4096
    finally:
        prealloc.drop_kept()


@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    hint=st.none() | st.integers(0, 200),
    own_at=st.integers(0, 6),
)
def test_prealloc_own_copies_the_first_chunk_once_and_changes_no_view(sizes, hint, own_at):
    """``own()`` (the stage input processor's call after a prompt's first chunk): the chunk held by reference
    moves into a buffer sized as an append would size it; every view stays the cat of the chunks, the bound
    holds, and it copies nothing once a buffer exists (or for an empty first chunk)."""
    params = omni_accum.get_manager().spec("prealloc").params_model(initial_capacity=4, growth_factor=2.0)
    g = torch.Generator().manual_seed(len(sizes) * 1000 + own_at)
    chunks = [torch.randn(n, 3, generator=g) for n in sizes]
    acc = PreallocAccumulator(KeyInfo("x", "r", hint), params)
    n = 0
    for i, c in enumerate(chunks):
        acc.merge(c)
        n += c.shape[0]
        if i == own_at:
            before = acc.current_tensor_meta().untyped_storage().data_ptr()
            copied = acc.own()
            if i == 0 and c.shape[0]:
                assert copied == c.nbytes
                assert acc.current_tensor_meta().untyped_storage().data_ptr() != c.untyped_storage().data_ptr()
            else:
                assert copied == 0 and acc.current_tensor_meta().untyped_storage().data_ptr() == before
        assert torch.equal(acc.read(), torch.cat(chunks[: i + 1]))
        assert n <= acc.capacity <= 2.0 * n + 4 or n == 0


def test_the_memory_guard_names_the_key_its_strategy_and_plugin_in_the_error_fields():
    """The message named the key, but ``.key``, ``.strategy`` and ``.plugin`` were None."""
    rx = omni_accum.Receiver({"default": "prealloc", "max_bytes_per_request": 4096})
    rx.merge("r", {"x": torch.ones(4, 16), "y": [1]})
    with pytest.raises(AccumulationError, match="max_bytes_per_request") as ei:
        rx.merge("r", {"x": torch.ones(64, 16), "y": [2]})
    err = ei.value
    assert (err.request_id, err.key, err.strategy, err.plugin) == ("r", "x", "prealloc", "prealloc")
    assert "'x' grows by" in str(err)
