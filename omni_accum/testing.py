"""Conformance kit for strategy authors (its fixture is registered with pytest by :mod:`omni_accum.pytest_plugin`).
Needs hypothesis: ``pip install 'omni-accum[testing]'``.

The contract every strategy meets (docs/plugins.md, "The contract"): for an append-kind strategy the view after
chunk k equals ``torch.cat`` of the chunk values 0..k (list concatenation for lists), bit for bit; for a
replace-kind strategy the view holds the latest value; a strategy that leaves unchanged values off the wire never
serves a stale one; dtype, shape and device never change.

Every wire chunk is checked to hold only plain values (dicts, lists, tuples, tensors, ints, floats, strings,
bytes, bools, None: what vllm-omni's ``OmniSerializer`` carries) and is copied (tensors cloned, lists rebuilt)
before the receiver sees it, as a real connector would, so a receiver cannot lean on objects it shares with the
sender; then the same in process, the sender changing in place what it last sent for a key before it sends the
key again (:func:`scribble`): the view must keep what ``torch.cat``'s would. Replace-kind strategies are also run on :func:`cumulative_streams` (values that
mostly extend the previous one, with resets, truncations, bit-level rewrites and type changes): a strategy that
transforms the wire, such as a delta encoder, must still serve exactly the latest value.

Use it from a test (or through the ``omni_accum_conformance`` fixture, which is the same callable)::

    from omni_accum.testing import check_conformance

    def test_my_strategy_conforms():
        check_conformance("my_strategy", {"some_param": 3})
"""

from __future__ import annotations

import contextlib
import math
import struct
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
from omni_accum.errors import AccumulationError
from omni_accum.manager import StrategyManager, get_manager

DTYPES = (torch.bfloat16, torch.float32, torch.int64, torch.bool)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size(), torch.uint8)
        return t.resolve_conj().resolve_neg().contiguous().view(as_int)
    return t


def same_bits(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` are equal bit for bit (tensors: dtype, shape, device and every bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
            return False
        return bool(torch.equal(_bits(a), _bits(b)))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        # keys in the same order and of the same types (1, 1.0 and True are one key of a dict)
        return same_bits(list(a), list(b)) and all(map(same_bits, a.values(), b.values()))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    if type(a) is float and type(b) is float:  # bits: -0.0 is not 0.0, a NaN is itself
        return struct.pack("<d", a) == struct.pack("<d", b)
    return type(a) is type(b) and a == b


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Describe the first place where ``a`` and ``b`` differ, or None when they are the same."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if not same_bits(list(a), list(b)):
            return f"{path or '<root>'}: keys {list(a.keys())} != {list(b.keys())}"
        for k, x, y in zip(a, a.values(), b.values()):
            d = first_difference(x, y, f"{path}.{k}" if path else str(k))
            if d:
                return d
        return None
    if same_bits(a, b):
        return None
    return f"{path or '<root>'}: {_short(a)} != {_short(b)}"


def _short(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor(shape={list(v.shape)}, dtype={v.dtype})"
    r = repr(v)
    return r if len(r) < 80 else r[:77] + "..."


def as_dict(view: Mapping[str, Any]) -> dict[str, Any]:
    """Materialise a view (RequestView or dict) as plain nested dicts."""
    return {k: (as_dict(v) if isinstance(v, Mapping) else v) for k, v in view.items()}


@dataclass(frozen=True)
class KeySpec:
    """How one key of a random stream looks: ``tensor`` (rows appended), ``list``, ``scalar0d``, ``other``."""

    top: str
    qual: str | None
    kind: str
    dtype: torch.dtype = torch.float32
    trailing: tuple[int, ...] = ()


def _make_value(spec: KeySpec, rows: int, gen: torch.Generator, pick: int) -> Any:
    if spec.kind == "tensor":
        shape = (rows, *spec.trailing)
        if spec.dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=gen).bool()
        if spec.dtype == torch.int64:
            return torch.randint(-1000, 1000, shape, generator=gen)
        return torch.randn(shape, generator=gen).to(spec.dtype)
    if spec.kind == "list":
        return torch.randint(0, 50000, (rows,), generator=gen).tolist()
    if spec.kind == "scalar0d":
        return torch.tensor(bool(pick % 2))
    return ("Ethan", "Chelsie", 7, None)[pick % 4]


@st.composite
def payload_streams(draw: st.DrawFn, *, max_chunks: int = 200, nested: bool | None = None) -> list[dict[str, Any]]:
    """Hypothesis strategy: a stream of 1..max_chunks payload chunks (nested or flat).

    Keys are tensors of bf16/float32/int64/bool with 0..3 rows per chunk (0 = an empty chunk),
    lists of ints, 0-d tensors and plain values; a key may be absent from a chunk, and a chunk may be
    empty. Each key keeps its dtype and trailing shape.
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
        specs.append(KeySpec(top, qual, kind, draw(st.sampled_from(DTYPES)), trailing))
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


PLAIN_TYPES = (int, float, str, bytes, bool, type(None))


def check_plain_wire(value: Any, where: str = "<wire>") -> None:
    """Assert ``value`` holds only what vllm-omni's serializer carries: dicts, lists, tuples, tensors, scalars."""
    if isinstance(value, torch.Tensor) or type(value) in PLAIN_TYPES:
        return
    if isinstance(value, (list, tuple, dict)):
        for k, v in value.items() if isinstance(value, dict) else enumerate(value):
            check_plain_wire(v, f"{where}.{k}" if isinstance(value, dict) else f"{where}[{k}]")
        return
    raise AssertionError(
        f"{where}: {type(value).__module__}.{type(value).__qualname__} on the wire; use plain lists, tensors, ints and "
        "strings (vllm-omni's OmniSerializer does not carry custom classes)"
    )


def copy_wire(value: Any) -> Any:
    """What a connector delivers: the same data in new objects (tensors cloned, lists and dicts rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        items = [copy_wire(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: copy_wire(v) for k, v in value.items()}
    return value


def scribble(value: Any) -> None:
    """Change ``value`` in place (tensors, list items; lists grow by one), as a sender reusing its buffer does."""
    if isinstance(value, torch.Tensor):
        with torch.no_grad(), contextlib.suppress(RuntimeError):  # RuntimeError: an expanded tensor
            value.logical_not_() if value.dtype == torch.bool else value.add_(1)
    elif isinstance(value, (list, tuple, dict)):
        for v in value.values() if isinstance(value, dict) else value:
            scribble(v)
        if isinstance(value, list):
            value.append(-1)


def _reuse_buffers(sent: dict[Any, Any], chunk: Mapping[str, Any]) -> None:
    """Before ``chunk`` is sent: the sender changes the values it last sent for the chunk's keys (:func:`scribble`)."""
    for top, value in chunk.items():
        for key, v in [((top, q), x) for q, x in value.items()] if isinstance(value, dict) else [((top,), value)]:
            scribble(sent.get(key))
            sent[key] = v


class ReferenceError_(Exception):
    """The cat reference itself cannot merge this value (e.g. a 0-d tensor appended)."""


def reference_merge(current: Any, value: Any, append: bool) -> Any:
    """The reference semantics of one key: cat / list + for append-kind, latest value otherwise."""
    if not append:
        return value
    if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
        if current.dim() == 0 or value.dim() == 0:
            raise ReferenceError_("0-d tensor appended")
        if current.dtype != value.dtype or current.shape[1:] != value.shape[1:]:
            raise ReferenceError_("dtype or trailing shape changed")
        return torch.cat([current, value], dim=0)
    if isinstance(current, list) and isinstance(value, list):
        return current + value
    return value


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
    object over as is). ``reuse=True`` (with ``transport=None``: in process): before each chunk the sender changes
    in place the values it last sent for that chunk's keys (:func:`scribble`), as one reusing its buffers does;
    fed the same objects, the reference keeps them as ``torch.cat`` does (the first chunk as it is until the
    second arrives, the rows of every other as they were when merged), and so must the view."""
    mgr = manager or get_manager()
    spec = mgr.spec(strategy)
    append = "append" in spec.kinds
    policy = {"default": {"strategy": strategy, "params": dict(params or {})}, "honor_override_keys": False}
    tx, rx = Sender(policy, manager=mgr), Receiver(policy, manager=mgr)
    ref: dict[str, Any] = {}
    sent: dict[Any, Any] = {}  # reuse: the value each key had when last sent
    for k, chunk in enumerate(stream):
        if reuse:
            _reuse_buffers(sent, chunk)
        try:
            expected = _ref_step(ref, chunk, append)
        except ReferenceError_:
            before = as_dict(rx.view(req_id)) if req_id in rx.request_ids() else None
            try:
                w = tx.encode(req_id, chunk)
                rx.merge(req_id, transport(w) if transport is not None else w)
            except AccumulationError:
                after = as_dict(rx.view(req_id)) if req_id in rx.request_ids() else None
                diff = first_difference(before, after) if before is not None else None
                assert diff is None, f"chunk {k}: state changed by a rejected chunk: {diff}"
                break
            raise AssertionError(f"chunk {k}: {strategy!r} merged a value the cat reference cannot merge") from None
        wire = tx.encode(req_id, chunk)
        _check_wire(wire, chunk, spec.name)
        check_plain_wire(wire, f"strategy {strategy!r}, chunk {k}: wire")
        view = rx.merge(req_id, transport(wire) if transport is not None else wire)
        got = as_dict(view)
        diff = first_difference(expected, got)
        assert diff is None, f"strategy {strategy!r}, chunk {k}: view differs from the reference: {diff}"
        ref = expected
    tx.release(req_id)
    rx.release(req_id)
    assert rx.active_requests == 0 and tx.active_requests == 0


def _ref_step(ref: dict[str, Any], chunk: dict[str, Any], append: bool) -> dict[str, Any]:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in ref.items()}
    for top, value in chunk.items():
        if isinstance(value, dict):
            group = out.get(top)
            group = dict(group) if isinstance(group, dict) else {}
            for q, qv in value.items():
                group[q] = reference_merge(group[q], qv, append) if q in group else qv
            out[top] = group
        else:
            out[top] = (
                reference_merge(out[top], value, append) if top in out and not isinstance(out[top], dict) else value
            )
    return out


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

    Every strategy runs on :func:`payload_streams` through a copying wire, then in process with the sender's values
    changed once sent (``check_stream(..., transport=None, reuse=True)``, half as many examples); a replace-kind
    strategy (no ``append`` in its declared kinds) also runs on :func:`cumulative_streams`.
    """
    mgr = manager or get_manager()
    spec = mgr.spec(strategy)  # UnknownStrategyError, listing the available names, before any example runs
    spec.build(dict(params or {}))  # invalid params fail here, with the Params model's own message

    @settings(max_examples=max_examples, deadline=None, database=None)
    @given(stream=payload_streams(max_chunks=max_chunks))
    def run(stream: list[dict[str, Any]]) -> None:
        check_stream(strategy, stream, params, manager=mgr)

    @settings(max_examples=max(1, max_examples // 2), deadline=None, database=None)
    @given(stream=payload_streams(max_chunks=max_chunks))
    def run_in_process(stream: list[dict[str, Any]]) -> None:
        check_stream(strategy, stream, params, manager=mgr, transport=None, reuse=True)

    run()
    run_in_process()
    if "append" not in spec.kinds:

        @settings(max_examples=max_examples, deadline=None, database=None)
        @given(stream=cumulative_streams(max_chunks=max_chunks))
        def run_cumulative(stream: list[dict[str, Any]]) -> None:
            check_stream(strategy, stream, params, manager=mgr)

        run_cumulative()
