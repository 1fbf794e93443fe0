"""Conformance kit for strategy authors (its fixture is registered with pytest by :mod:`omni_accum.pytest_plugin`).
Needs hypothesis: ``pip install 'omni-accum[testing]'``. Its value helpers live in :mod:`omni_accum.kit_values`.

The contract every strategy meets (docs/plugins.md, "The contract"): for an append-kind strategy the view after
chunk k equals ``torch.cat`` of the chunk values 0..k (list concatenation for lists), bit for bit; for a
replace-kind strategy the view holds the latest value; a strategy that leaves unchanged values off the wire never
serves a stale one; dtype, shape and device never change.

Every wire chunk is checked to hold only plain values (dicts, lists, tuples, tensors, ints, floats, strings,
bytes, bools, None: what vllm-omni's ``OmniSerializer`` carries) and is copied (tensors cloned, lists rebuilt)
before the receiver sees it, as a real connector would (tuples arrive as lists), so a receiver cannot lean on
objects it shares with the sender; then in process, the values handed in checked unchanged after every merge;
then in process with the sender changing in place what it last sent for a key before it sends the key again
(:func:`scribble`): the view must keep what ``torch.cat``'s would; then two requests' chunks interleaved through
one sender and one receiver (with the memory guard on, so ``nbytes``/``projected_nbytes`` run): state kept on the
shared Strategy object fails. Tensor chunks come in several memory layouts (:func:`non_contiguous`). Replace-kind
strategies are also run on :func:`cumulative_streams` (values that mostly extend the previous one, with resets,
truncations, bit-level rewrites and type changes): a strategy that transforms the wire, such as a delta encoder,
must still serve exactly the latest value.

Use it from a test (or through the ``omni_accum_conformance`` fixture, which is the same callable)::

    from omni_accum.testing import check_conformance

    def test_my_strategy_conforms():
        check_conformance("my_strategy", {"some_param": 3})
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError as e:  # hypothesis comes with the ``testing`` (and ``test``) extra, not with omni-accum itself
    raise ImportError(
        f"the omni-accum conformance kit needs hypothesis, which is not installed: pip install 'omni-accum[testing]' "
        f"({e})"
    ) from e

from omni_accum.engine import WIRE_MARKER, Receiver, Sender
from omni_accum.errors import AccumulationError, UnknownStrategyError
from omni_accum.kit_values import (  # noqa: F401 - the kit's public helpers, imported from here by plugins' tests
    PLAIN_TYPES,
    ReferenceError_,
    _ref_step,
    _reuse_buffers,
    as_delivered,
    as_dict,
    check_plain_wire,
    copy_wire,
    first_difference,
    non_contiguous,
    reference_merge,
    same_bits,
    scribble,
    snapshot,
)
from omni_accum.manager import StrategyManager, get_manager

DTYPES = (torch.bfloat16, torch.float32, torch.int64, torch.bool)


@dataclass(frozen=True)
class KeySpec:
    """How one key of a random stream looks: ``tensor`` (rows appended), ``list``, ``scalar0d``, ``other``."""

    top: str
    qual: str | None
    kind: str
    dtype: torch.dtype = torch.float32
    trailing: tuple[int, ...] = ()
    layout: int = 0  # tensors: memory layout (:func:`non_contiguous`), 0 contiguous


def _make_value(spec: KeySpec, rows: int, gen: torch.Generator, pick: int) -> Any:
    if spec.kind == "tensor":
        shape = (rows, *spec.trailing)
        if spec.dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen).bool()
        elif spec.dtype == torch.int64:
            t = _edges(torch.randint(-1000, 1000, shape, generator=gen), gen)
        else:
            t = _edges(torch.randn(shape, generator=gen).to(spec.dtype), gen)
        return non_contiguous(t, (spec.layout + pick) % 4 if spec.layout else 0)
    if spec.kind == "list":
        return torch.randint(0, 50000, (rows,), generator=gen).tolist()
    if spec.kind == "scalar0d":
        return torch.tensor(bool(pick % 2))
    return ("Ethan", "Chelsie", 7, None)[pick % 4]


def _edges(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Edge values, which torch.cat keeps bit for bit, in about a third of the elements of one tensor in three."""
    if not t.numel() or torch.randint(0, 3, (1,), generator=gen).item():
        return t
    pool = torch.tensor([2**40 + 1, -(2**53) - 1, -(2**63), 2**63 - 1])  # int64: beyond floats' exact range, min, max
    if t.is_floating_point():  # -0.0, +/-inf, a NaN with a payload and a -NaN (bf16: their top halves)
        nan = torch.tensor([0x7FC10001, -0x3FFFFF], dtype=torch.int32).view(torch.float32)
        nan = nan.view(torch.int16)[1::2].view(t.dtype) if t.element_size() == 2 else nan.to(t.dtype)
        pool = torch.cat([torch.tensor([-0.0, math.inf, -math.inf], dtype=t.dtype), nan])
    edge = pool[torch.randint(0, len(pool), t.shape, generator=gen)]
    return torch.where(torch.randint(0, 3, t.shape, generator=gen).bool(), t, edge)


@st.composite
def payload_streams(draw: st.DrawFn, *, max_chunks: int = 200, nested: bool | None = None) -> list[dict[str, Any]]:
    """Hypothesis strategy: a stream of 1..max_chunks payload chunks (nested or flat).

    Keys are tensors of bf16/float32/int64/bool with 0..3 rows per chunk (0 = an empty chunk; some elements -0.0,
    NaN, +/-inf or large int64), lists of ints, 0-d tensors and plain values; a key may be absent from a chunk, and a
    chunk may be empty. Each key keeps its dtype and trailing shape.
    """
    nest = draw(st.booleans()) if nested is None else nested
    n_keys = draw(st.integers(1, 4))
    kinds = draw(
        st.lists(st.sampled_from(["tensor", "tensor", "list", "scalar0d", "other"]), min_size=n_keys, max_size=n_keys)
    )
    specs = []
    for i, kind in enumerate(kinds):
        top, qual = (("embed", f"k{i}") if i % 2 == 0 else ("meta", f"k{i}")) if nest else (f"key_{i}", None)
        trailing = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))) if kind == "tensor" else ()
        layout = draw(st.integers(0, 3))  # mixed per chunk when not 0: a view, an offset, a strided slice
        specs.append(KeySpec(top, qual, kind, draw(st.sampled_from(DTYPES)), trailing, layout))
    n_chunks = draw(st.integers(1, max_chunks))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    plan = draw(
        st.lists(st.tuples(st.integers(0, (1 << n_keys) - 1), st.integers(0, 3)), min_size=n_chunks, max_size=n_chunks)
    )
    stream = []
    for j, (mask, rows) in enumerate(plan):
        chunk: dict[str, Any] = {}
        for i, spec in enumerate(specs):
            if j > 0 and not (mask >> i) & 1:
                continue
            v = _make_value(spec, rows, gen, j + i)
            if spec.qual is None:
                chunk[spec.top] = v
            else:
                chunk.setdefault(spec.top, {})[spec.qual] = v
        stream.append(chunk)
    return stream


_LIST_FORMS = ("ints", "strs")


@st.composite
def cumulative_streams(draw: st.DrawFn, *, max_chunks: int = 120, nested: bool | None = None) -> list[dict[str, Any]]:
    """Hypothesis strategy: streams of *cumulative* keys, each value usually the previous one extended.

    Per key and chunk: absent, extended by 0..3 items/rows (most often), reset to a new value,
    truncated, rewritten in its prefix (an int list item turned into an equal float or ``True``, a
    float tensor element negated so ``0.0`` becomes ``-0.0``), or changed to another type
    (``None``, a 0-d tensor, a string, a list of floats). Each value is a new object.
    """
    import random

    nest = draw(st.booleans()) if nested is None else nested
    n_keys = draw(st.integers(1, 3))
    forms = draw(st.lists(st.sampled_from(["tensor", "tensor", "ints", "strs"]), min_size=n_keys, max_size=n_keys))
    dtypes = draw(st.lists(st.sampled_from(DTYPES), min_size=n_keys, max_size=n_keys))
    trailing = [tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))) for _ in range(n_keys)]
    ops = ["absent", "extend", "extend", "extend", "extend", "extend", "reset", "truncate", "rewrite", "retype"]
    n_chunks = draw(st.integers(1, max_chunks))
    plan = draw(
        st.lists(st.lists(st.sampled_from(ops), min_size=n_keys, max_size=n_keys), min_size=n_chunks, max_size=n_chunks)
    )
    rng = random.Random(draw(st.integers(0, 2**31 - 1)))

    def rows(i: int, n: int) -> Any:
        if forms[i] == "ints":
            return [rng.randrange(3) for _ in range(n)]
        if forms[i] == "strs":
            return [rng.choice("ab") for _ in range(n)]
        shape = (n, *trailing[i])
        data = torch.tensor([rng.randrange(-2, 3) for _ in range(math.prod(shape))], dtype=torch.int64).reshape(shape)
        return data.to(dtypes[i]) if dtypes[i] != torch.bool else data > 0

    def grow(i: int, cur: Any, n: int) -> Any:
        if isinstance(cur, list):
            return cur + (rows(i, n) if forms[i] in _LIST_FORMS else [0.25] * n)
        if isinstance(cur, torch.Tensor) and cur.dim() > 0:
            return torch.cat([cur, rows(i, n)])
        return rows(i, n)

    def rewrite(cur: Any) -> Any:
        if isinstance(cur, list) and cur:
            out, j = list(cur), rng.randrange(len(cur))
            v = out[j]
            if isinstance(v, bool) or isinstance(v, float):
                out[j] = -v if isinstance(v, float) else not v  # 0.0 -> -0.0: equal, but not the same bits
            elif isinstance(v, int):
                out[j] = float(v) if rng.random() < 0.5 else (v == 1 or v)  # equal value, another type
            elif isinstance(v, str):
                out[j] = v + "x"
            return out
        if isinstance(cur, torch.Tensor) and cur.numel():
            out = cur.clone()
            flat = out.view(-1)
            j = rng.randrange(flat.numel())
            flat[j] = ~flat[j] if out.dtype == torch.bool else (-flat[j] if out.is_floating_point() else flat[j] + 1)
            return out
        return cur

    current: list[Any] = [rows(i, rng.randrange(4)) for i in range(n_keys)]
    stream = []
    for j, chunk_ops in enumerate(plan):
        chunk: dict[str, Any] = {}
        for i, op in enumerate(chunk_ops):
            if j > 0 and op == "absent":
                continue
            cur = current[i]
            if j == 0:
                new = cur
            elif op == "extend":
                new = grow(i, cur, rng.randrange(4))
            elif op == "reset":
                new = rows(i, rng.randrange(5))
            elif op == "truncate" and isinstance(cur, (list, torch.Tensor)) and getattr(cur, "dim", lambda: 1)() > 0:
                new = cur[: max(0, len(cur) - 1 - rng.randrange(2))]
                new = list(new) if isinstance(new, list) else new.clone()
            elif op == "rewrite":
                new = rewrite(cur)
            elif op == "retype":
                new = rng.choice([None, torch.tensor(rng.random() < 0.5), "Ethan", [0.0, 1.0], 7])
            else:
                new = grow(i, cur, 1)
            current[i] = new
            top, qual = ("ids", f"k{i}") if nest else (f"key_{i}", None)
            if isinstance(new, list):
                new = list(new)
            elif isinstance(new, torch.Tensor):
                new = new.clone()
            if qual is None:
                chunk[top] = new
            else:
                chunk.setdefault(top, {})[qual] = new
        stream.append(chunk)
    return stream


def check_stream(
    strategy: str,
    stream: list[dict[str, Any]],
    params: Mapping[str, Any] | None = None,
    *,
    manager: StrategyManager | None = None,
    req_id: str = "req-0",
    transport: Callable[[Any], Any] | None = copy_wire,
    reuse: bool = False,
) -> None:
    """Stream ``stream`` through Sender -> Receiver with every key on ``strategy``; assert the contract.

    ``transport`` stands for the connector between them (default :func:`copy_wire`; ``None`` hands the wire
    object over as is, and then every chunk handed in must be unchanged after each merge). ``reuse=True`` (with
    ``transport=None``: in process): before each chunk the sender changes in place the values it last sent for that
    chunk's keys (:func:`scribble`), as one reusing its buffers does; fed the same objects, the reference keeps them
    as ``torch.cat`` does (the first chunk as it is until the second arrives, the rows of every other as they were
    when merged), and so must the view."""
    spec, tx, rx = _endpoints(strategy, params, manager)
    keep = transport is None and not reuse  # the caller's values must come back as they were handed in
    ref: dict[str, Any] | None = {}
    sent: dict[Any, Any] = {}  # reuse: the value each key had when last sent
    copies: list[tuple[int, Any, Any]] = []
    for k, chunk in enumerate(stream):
        if reuse:
            _reuse_buffers(sent, chunk)
        if keep:
            copies.append((k, chunk, snapshot(chunk)))
        ref = _step(tx, rx, spec, req_id, k, chunk, ref or {}, transport)
        if keep:
            _unchanged(strategy, copies[-1:])
        if ref is None:
            break
    _unchanged(strategy, copies)  # a later merge may change an earlier chunk (extending the first list it held)
    tx.release(req_id)
    rx.release(req_id)
    assert rx.active_requests == 0 and tx.active_requests == 0


def check_interleaved(
    strategy: str,
    streams: list[list[dict[str, Any]]],
    params: Mapping[str, Any] | None = None,
    *,
    manager: StrategyManager | None = None,
    transport: Callable[[Any], Any] | None = copy_wire,
) -> None:
    """Requests ``req-0``, ``req-1``, ... (one per stream) through one Sender and one Receiver, their chunks
    interleaved (round robin), with the memory guard on (so ``nbytes`` and ``projected_nbytes`` run on every chunk):
    each request's view must be its own stream's reference. State kept on the Strategy object (one per params,
    shared by every request and key) instead of on the Encoder/Accumulator fails here."""
    spec, tx, rx = _endpoints(strategy, params, manager, guard=True)
    refs: list[dict[str, Any] | None] = [{} for _ in streams]
    for k in range(max(map(len, streams), default=0)):
        for i, stream in enumerate(streams):
            if k < len(stream) and refs[i] is not None:
                refs[i] = _step(tx, rx, spec, f"req-{i}", k, stream[k], refs[i] or {}, transport)
    for i in range(len(streams)):
        tx.release(f"req-{i}")
        rx.release(f"req-{i}")


def _endpoints(
    strategy: str, params: Mapping[str, Any] | None, manager: StrategyManager | None, guard: bool = False
) -> tuple[Any, Sender, Receiver]:
    mgr = manager or get_manager()
    spec = _spec(mgr, strategy)
    policy: dict[str, Any] = {"default": {"strategy": strategy, "params": _params(strategy, params)}}
    policy.update(honor_override_keys=False, max_bytes_per_request=(1 << 62) if guard else 0)
    return spec, Sender(policy, manager=mgr), Receiver(policy, manager=mgr)


def _spec(mgr: StrategyManager, strategy: str) -> Any:
    """``strategy``'s spec; unknown, the error also names the plugins that did not load here (as a policy's does):
    a plugin that fails to import is only a warning elsewhere, and its strategies are then simply missing."""
    try:
        return mgr.spec(strategy)
    except UnknownStrategyError as e:
        note = mgr.not_loaded_note()
        if not note:
            raise
        raise UnknownStrategyError(strategy, mgr.names(), f"conformance kit{note}") from e


def _params(strategy: str, params: Any) -> dict[str, Any]:
    if params is None or isinstance(params, Mapping):
        return dict(params or {})
    raise TypeError(  # a str such as "block=3" was dict()'s bare ValueError
        f"conformance kit, strategy {strategy!r}: params must be a mapping of param names to values, such as "
        f"{{'block': 3}}, not {type(params).__name__} {params!r:.60}"
    )


def _rule(spec: Any) -> str:
    kinds = sorted(spec.kinds)
    if "append" in spec.kinds:
        return (f"append-kind, the view is torch.cat of the chunks (list + for lists), because the declared kinds "
                f"{kinds} include 'append' (StrategySpec.kinds defaults to all three: declare "
                "kinds=frozenset({'replace'}) for a latest-value strategy)")  # fmt: skip
    return f"replace-kind, the view is the latest value, because the declared kinds {kinds} do not include 'append'"


def _step(
    tx: Sender, rx: Receiver, spec: Any, req_id: str, k: int, chunk: dict[str, Any], ref: dict[str, Any],
    transport: Callable[[Any], Any] | None,
) -> dict[str, Any] | None:  # fmt: skip
    """Send chunk ``k`` of ``req_id`` and check its view; the new reference, or None when the stream ends there (a
    value the cat reference cannot merge, which the strategy must reject leaving the state unchanged)."""
    name = spec.name
    try:  # a copying wire delivers tuples as lists: so does the reference
        expected = _ref_step(ref, as_delivered(chunk) if transport is not None else chunk, "append" in spec.kinds)
    except ReferenceError_:
        before = as_dict(rx.view(req_id)) if req_id in rx.request_ids() else None
        try:
            w = tx.encode(req_id, chunk)
            rx.merge(req_id, transport(w) if transport is not None else w)
        except AccumulationError:
            after = as_dict(rx.view(req_id)) if req_id in rx.request_ids() else None
            diff = first_difference(before, after) if before is not None else None
            assert diff is None, f"{req_id} chunk {k}: state changed by a rejected chunk: {diff}"
            return None
        raise AssertionError(f"{req_id} chunk {k}: {name!r} merged a value the cat reference cannot merge") from None
    wire = tx.encode(req_id, chunk)
    _check_wire(wire, chunk, name)
    check_plain_wire(wire, f"strategy {name!r}, chunk {k}: wire")
    got = as_dict(rx.merge(req_id, transport(wire) if transport is not None else wire))
    diff = first_difference(expected, got)
    assert diff is None, (
        f"strategy {name!r}, {req_id} chunk {k}: view differs from the reference ({_rule(spec)}): {diff}"
    )
    return expected


def _unchanged(name: str, copies: list[tuple[int, Any, Any]]) -> None:
    for k, chunk, copy in copies:
        diff = first_difference(copy, chunk)
        assert diff is None, (
            f"strategy {name!r}: chunk {k} as the caller handed it in was changed: {diff}; a strategy must not "
            "extend, sort or write into the values it is given (copy the first list before extending it)"
        )


def _check_wire(wire: Mapping[str, Any], chunk: Mapping[str, Any], name: str) -> None:
    for top, value in wire.items():
        assert top != WIRE_MARKER or isinstance(value, int), f"{name}: wire marker must be an int, got {value!r}"
        assert top == WIRE_MARKER or top in chunk, f"{name}: wire carries key {top!r} the chunk does not have"


def check_conformance(
    strategy: str,
    params: Mapping[str, Any] | None = None,
    *,
    manager: StrategyManager | None = None,
    max_examples: int = 60,
    max_chunks: int = 200,
) -> None:
    """Run the property-based conformance contract against ``strategy`` (with ``params``).

    Every strategy runs on :func:`payload_streams` through a copying wire; then (half as many examples each) in
    process with the values handed in checked unchanged (``transport=None``), in process with the sender's values
    changed once sent (``transport=None, reuse=True``), and two requests interleaved through one sender and one
    receiver (:func:`check_interleaved`). The semantics checked are those of the declared kinds: a strategy whose
    kinds include ``append`` (the default: all three) must serve ``torch.cat``'s view; a replace-kind strategy (no
    ``append`` in its declared kinds) the latest value, and also runs on :func:`cumulative_streams`.
    """
    mgr = manager or get_manager()
    spec = _spec(mgr, strategy)  # UnknownStrategyError, listing the available names, before any example runs
    mgr.build(strategy, _params(strategy, params), "conformance kit")  # invalid params named, as StrategyManager.params

    @settings(max_examples=max_examples, deadline=None, database=None)
    @given(stream=payload_streams(max_chunks=max_chunks))
    def run(stream: list[dict[str, Any]]) -> None:
        check_stream(strategy, stream, params, manager=mgr)

    @settings(max_examples=max(1, max_examples // 2), deadline=None, database=None)
    @given(stream=payload_streams(max_chunks=max_chunks))
    def run_kept(stream: list[dict[str, Any]]) -> None:
        check_stream(strategy, stream, params, manager=mgr, transport=None)

    @settings(max_examples=max(1, max_examples // 2), deadline=None, database=None)
    @given(stream=payload_streams(max_chunks=max_chunks))
    def run_in_process(stream: list[dict[str, Any]]) -> None:
        check_stream(strategy, stream, params, manager=mgr, transport=None, reuse=True)

    @settings(max_examples=max(1, max_examples // 2), deadline=None, database=None)
    @given(streams=st.lists(payload_streams(max_chunks=max(1, max_chunks // 2)), min_size=2, max_size=2))
    def run_interleaved(streams: list[list[dict[str, Any]]]) -> None:
        check_interleaved(strategy, streams, params, manager=mgr)

    run()
    run_kept()
    run_in_process()
    run_interleaved()
    if "append" not in spec.kinds:

        @settings(max_examples=max_examples, deadline=None, database=None)
        @given(stream=cumulative_streams(max_chunks=max_chunks))
        def run_cumulative(stream: list[dict[str, Any]]) -> None:
            check_stream(strategy, stream, params, manager=mgr)

        run_cumulative()
