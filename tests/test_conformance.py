"""Every built-in strategy meets the conformance contract on random streams (hypothesis)."""

from __future__ import annotations

import pytest
import torch

import omni_accum
from omni_accum.testing import check_conformance, check_stream

BUILTINS = [
    ("cat", {}),
    ("token_list", {}),
    ("prealloc", {}),
    ("prealloc", {"initial_capacity": 1, "growth_factor": 1.01}),
    ("prealloc", {"initial_capacity": 4096, "growth_factor": 16.0}),
    ("replace", {}),
    ("send_once", {}),
]


@pytest.mark.parametrize(("name", "params"), BUILTINS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BUILTINS)])
def test_builtin_conforms(name, params):
    check_conformance(name, params, max_examples=80)


def test_conformance_fixture_is_registered(omni_accum_conformance):
    assert omni_accum_conformance is check_conformance


def test_long_stream_of_decode_rows_bf16():
    rows = [torch.randn(1, 16).bfloat16() for _ in range(200)]
    stream = [{"embed": {"decode": r}} for r in rows]
    for name in ("cat", "token_list", "prealloc"):
        check_stream(name, stream)


def test_kit_catches_a_wrong_view():
    """The kit fails a strategy whose view is wrong (it is not a test that always passes)."""

    class Broken(omni_accum.Strategy):
        name = "broken"

        def new_accumulator(self, key):
            from omni_accum.strategies.replace import ReplaceAccumulator

            return ReplaceAccumulator()  # claims append-kind below but only keeps the last chunk

    @omni_accum.hookimpl
    def omni_accum_register_strategies():
        return [omni_accum.StrategySpec("broken", Broken, kinds=frozenset({"append"}))]

    mgr = omni_accum.StrategyManager()
    mgr.register(type("P", (), {"omni_accum_register_strategies": staticmethod(omni_accum_register_strategies)}), "p")
    stream = [{"k": torch.ones(1, 2)}, {"k": torch.zeros(1, 2)}]
    with pytest.raises(AssertionError, match="differs from the reference"):
        check_stream("broken", stream, manager=mgr)


class TestSendOnce:
    def test_unchanged_value_left_off_the_wire_and_served_from_cache(self):
        tx, rx = omni_accum.Sender({"default": "send_once"}), omni_accum.Receiver({"default": "send_once"})
        bos = torch.randn(1, 1, 8)
        w0 = tx.encode("r", {"embed": {"tts_bos": bos}, "speaker": "Ethan"})
        assert set(w0) == {"embed", "speaker"}
        rx.merge("r", w0)
        w1 = tx.encode("r", {"embed": {"tts_bos": bos.clone()}, "speaker": "Ethan"})
        assert set(w1) == {omni_accum.WIRE_MARKER}  # both omitted; the empty group dropped
        v = rx.merge("r", w1)
        assert torch.equal(v["embed"]["tts_bos"], bos) and v["speaker"] == "Ethan"

    def test_changed_value_is_sent_again_never_stale(self):
        tx, rx = omni_accum.Sender({"default": "send_once"}), omni_accum.Receiver({"default": "send_once"})
        t = torch.zeros(2, 3)
        rx.merge("r", tx.encode("r", {"x": t}))
        t[0, 0] = 1.0  # changed in place: must be seen
        w = tx.encode("r", {"x": t})
        assert "x" in w
        assert torch.equal(rx.merge("r", w)["x"], t)
        w = tx.encode("r", {"x": t.to(torch.float64)})  # same values, other dtype: a change
        assert "x" in w and rx.merge("r", w)["x"].dtype == torch.float64
        w = tx.encode("r", {"x": [1, 2]})
        assert rx.merge("r", w)["x"] == [1, 2]
        assert "x" not in tx.encode("r", {"x": [1, 2]})
        assert "x" in tx.encode("r", {"x": [1, 2, 3]})

    def test_nan_values_are_resent_rather_than_guessed_equal(self):
        tx = omni_accum.Sender({"default": "send_once"})
        t = torch.tensor([float("nan")])
        tx.encode("r", {"x": t})
        assert "x" in tx.encode("r", {"x": t})


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}),  # key order
        ({1: "v"}, {True: "v"}),  # key types: one key to the dict, another value to the consumer
        ({0.0: "v"}, {-0.0: "v"}),
        (torch._neg_view(torch.zeros(2)), torch.zeros(2)),  # -0.0 behind the lazy negative bit
    ],
)
def test_the_bit_for_bit_checker_tells_apart_what_a_consumer_would_see_differently(a, b):
    from omni_accum.testing import first_difference, same_bits

    assert not same_bits(a, b) and not same_bits(b, a)
    assert first_difference(a, b) is not None
    assert same_bits(a, a) and first_difference(a, a) is None


def test_two_nans_of_other_bits_are_told_apart_by_their_bits():
    """The kit's message for a NaN payload or sign changed said ``nan != nan``."""
    import struct

    from omni_accum.testing import first_difference

    a = torch.tensor([1.0, float("nan")])
    b = a.clone()
    b.view(torch.int32)[1] = 0x7FC00001
    said = first_difference({"k": a}, {"k": b})
    assert said.endswith("element [1]: nan (bits 0x7fc00000) != nan (bits 0x7fc00001)"), said
    other = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0]
    said = first_difference({"k": float("nan")}, {"k": other})
    assert said == "k: nan (bits 0x7ff8000000000000) != nan (bits 0x7ff8000000000001)", said
    c = torch.zeros(5, 3, dtype=torch.complex128)  # (its bits viewed as bytes: the index of a differing one was
    d = c.clone()  # past the tensor's end, an IndexError)
    d[3, 1] = complex(0.0, -0.0)
    said = first_difference(c, d)
    assert said.endswith("first at row 3, element [3, 1]: 0j != -0j"), said


# ---------------------------------------------------------------------------------------------- #
# what the kit catches: strategies that passed it and were wrong in ordinary use
# ---------------------------------------------------------------------------------------------- #

from omni_accum.strategies.replace import ReplaceAccumulator  # noqa: E402
from omni_accum.strategy import Accumulator, AppendAccumulator, Encoder, Strategy, StrategySpec  # noqa: E402
from omni_accum.testing import check_interleaved, copy_wire, first_difference, non_contiguous  # noqa: E402


class _Chunks(AppendAccumulator):
    """Chunks kept, copied when merged (the first held as it is until the second), cat on read."""

    __slots__ = ("_c",)

    def start_tensor(self, v):
        self._c = [v]

    def append_tensor(self, v):
        if len(self._c) == 1:
            self._c[0] = self._c[0].clone()
        self._c.append(v.clone())

    def read_tensor(self):
        return self._c[0] if len(self._c) == 1 else torch.cat(self._c)

    def current_tensor_meta(self):
        return self._c[0]


class _ListMut(_Chunks):
    def append_list(self, value):
        self._items.extend(value)  # the bug: the first list is the caller's
        self._list_view = None

    def read_list(self):
        return self._items


class _TupEncoder(Encoder):
    def __init__(self):
        self.prev = None

    def encode(self, v):
        prev, self.prev = self.prev, list(v) if isinstance(v, list) else None
        if isinstance(v, list) and prev is not None and v[: len(prev)] == prev:
            return ("sfx", len(prev), v[len(prev):])  # a tuple marks a suffix: a list once serialized
        return v


class _TupAcc(Accumulator):
    def __init__(self):
        self.v = None

    def merge(self, w):
        self.v = self.v[: w[1]] + list(w[2]) if isinstance(w, tuple) else w

    def read(self):
        return self.v


class _SharedAcc(_Chunks):
    __slots__ = ("_s",)

    def __init__(self, key, store):
        super().__init__(key)
        self._s = store

    @property
    def _c(self):  # the bug: the chunks live on the Strategy, keyed by path only: shared by every request
        return self._s[self.key.path]

    def start_tensor(self, v):
        self._s[self.key.path] = [v]


class _MemcpyAcc(_Chunks):
    def append_tensor(self, v):  # reads v's storage as contiguous rows, as a memmove of data_ptr() does
        flat = torch.empty(0, dtype=v.dtype).set_(v.untyped_storage(), 0, (v.numel(),))
        super().append_tensor(flat.view(v.shape).clone())


def _strategy(acc=None, enc=None, shared=False):
    class S(Strategy):
        def __init__(self, params=None):
            super().__init__(params)
            self.store = {}

        def new_encoder(self, key):
            return enc() if enc else None

        def new_accumulator(self, key):
            return acc(key, self.store) if shared else acc(key) if acc is not _TupAcc else acc()

    return S


@pytest.fixture
def kit_mgr():
    mgr = omni_accum.StrategyManager(load_entrypoints=False)
    mgr.load_entrypoints([])
    specs = [
        StrategySpec("listmut", _strategy(_ListMut), kinds=frozenset({"append"})),
        StrategySpec("tupsuffix", _strategy(_TupAcc, _TupEncoder), kinds=frozenset({"replace"})),
        StrategySpec("shared", _strategy(_SharedAcc, shared=True), kinds=frozenset({"append"})),
        StrategySpec("memcpy", _strategy(_MemcpyAcc), kinds=frozenset({"append"})),
        StrategySpec("latest_default_kinds", _strategy(lambda key: ReplaceAccumulator())),
    ]

    class P:
        @omni_accum.hookimpl
        def omni_accum_register_strategies(self):
            return specs

    mgr.register(P(), name="kitcases")
    return mgr


def test_the_kit_fails_a_strategy_that_changes_the_caller_s_values(kit_mgr):
    stream = [{"ids": [1, 2, 3]}, {"ids": [4]}, {"ids": [5]}]
    check_stream("listmut", stream, manager=kit_mgr)  # over a copying wire the receiver only changes its copy
    with pytest.raises(AssertionError, match=r"chunk 0 as the caller handed it in was changed: ids: \[1, 2, 3\] != "
                                             r"\[1, 2, 3, 4, 5\]"):  # fmt: skip
        check_stream("listmut", stream, manager=kit_mgr, transport=None)


def test_the_kit_s_wire_delivers_tuples_as_lists_as_omniserializer_does(kit_mgr):
    assert copy_wire({"a": ("sfx", 1, (2,))}) == {"a": ["sfx", 1, [2]]}
    stream = [{"ids": [7, 8]}, {"ids": [7, 8, 9]}]
    with pytest.raises(AssertionError, match=r"req-0 chunk 1: view differs.*ids: \[7, 8, 9\] != \['sfx', 2, \[9\]\]"):
        check_stream("tupsuffix", stream, manager=kit_mgr)


def test_the_kit_interleaves_two_requests(kit_mgr):
    a = [{"e": torch.full((1, 2), 1.0)}, {"e": torch.full((1, 2), 1.5)}]
    b = [{"e": torch.full((1, 2), 2.0)}, {"e": torch.full((1, 2), 2.5)}]
    check_stream("shared", a, manager=kit_mgr)  # one request at a time: passes
    with pytest.raises(AssertionError, match=r"req-0 chunk 1: view differs"):
        check_interleaved("shared", [a, b], manager=kit_mgr)
    check_interleaved("cat", [a, b])


def test_the_kit_s_chunks_include_non_contiguous_tensors_and_name_the_first_wrong_row(kit_mgr):
    t = torch.arange(12.0).reshape(4, 3)
    for layout in range(4):
        v = non_contiguous(t, layout)
        assert torch.equal(v, t) and (layout == 0 or not v.is_contiguous() or v.storage_offset())
    stream = [{"e": torch.zeros(1, 3)}, {"e": non_contiguous(t, 3)}]
    check_stream("memcpy", [{"e": torch.zeros(1, 3)}, {"e": t}], manager=kit_mgr)  # contiguous: passes
    with pytest.raises(AssertionError, match=r"e: tensor\(shape=\[5, 3\].*, first at row 1, element \[1, 1\]: 1\.0 "
                                             r"!= 3\.0"):  # fmt: skip
        check_stream("memcpy", stream, manager=kit_mgr, transport=None)
    assert first_difference(torch.ones(2, 2), torch.ones(2, 2)) is None


def test_the_kit_names_the_declared_kinds_rule(kit_mgr):
    """kinds defaults to all three: a latest-value strategy that leaves kinds out is checked as append-kind."""
    with pytest.raises(AssertionError, match=r"the declared kinds \['append', 'replace', 'static'\] include 'append' "
                                             r"\(StrategySpec.kinds defaults to all three"):  # fmt: skip
        check_stream("latest_default_kinds", [{"e": torch.ones(1, 2)}, {"e": torch.ones(1, 2)}], manager=kit_mgr)


def test_the_kit_s_argument_mistakes_are_clear(kit_mgr):
    with pytest.raises(TypeError, match=r"strategy 'cat': params must be a mapping of param names to values, such as "
                                        r"\{'block': 3\}, not str 'block=3'"):  # fmt: skip
        check_conformance("cat", "block=3", manager=kit_mgr)
    kit_mgr.problems.append(("blocked_cat_plugin", "plugin 'blocked_cat_plugin': failed to import"))
    with pytest.raises(omni_accum.errors.UnknownStrategyError, match=r"plugins not loaded here: 'blocked_cat_plugin' "
                                                                     r"failed to load"):  # fmt: skip
        check_conformance("blocked_cat", manager=kit_mgr)


def test_the_kit_fails_an_omit_without_omits_unchanged(kit_mgr):
    class Once(Encoder):
        def __init__(self):
            self.last = None

        def encode(self, v):
            same, self.last = isinstance(v, str) and v == self.last, v
            return omni_accum.strategy.OMIT if same else v

    factory = _strategy(lambda key: ReplaceAccumulator(), Once)
    spec = StrategySpec("undeclared_once", factory, kinds=frozenset({"replace"}))

    class P:
        @omni_accum.hookimpl
        def omni_accum_register_strategies(self):
            return [spec]

    kit_mgr.register(P(), name="onceplug")
    with pytest.raises(omni_accum.AccumulationError, match="set omits_unchanged = True on the Strategy class"):
        check_stream("undeclared_once", [{"s": "Ethan"}, {"s": "Ethan"}], manager=kit_mgr)
