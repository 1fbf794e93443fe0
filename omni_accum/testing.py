"""Conformance kit for strategy authors (also registered as a pytest plugin, entry point ``pytest11``).

The contract every strategy meets (DESIGN.md section 5): for an append-kind strategy the view
after chunk k equals ``torch.cat`` of the chunk values 0..k (list concatenation for lists), bit
for bit; for a replace-kind strategy the view holds the latest value; a strategy that leaves
unchanged values off the wire never serves a stale one; dtype, shape and device never change.

Use it from a test::

    from omni_accum.testing import check_conformance

    def test_my_strategy_conforms():
        check_conformance("my_strategy", {"some_param": 3})

or through the ``omni_accum_conformance`` fixture, which is the same callable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_accum.channel import WIRE_MARKER, Receiver, Sender
from omni_accum.errors import AccumulationError
from omni_accum.manager import StrategyManager, get_manager

DTYPES = (torch.bfloat16, torch.float32, torch.int64, torch.bool)


# ---------------------------------------------------------------------------------------------- #
# Bit-exact comparison
# ---------------------------------------------------------------------------------------------- #


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        size = t.element_size()
        return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}.get(size, torch.uint8))
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
        return list(a.keys()) == list(b.keys()) and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Describe the first place where ``a`` and ``b`` differ, or None when they are the same."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if list(a.keys()) != list(b.keys()):
            return f"{path or '<root>'}: keys {list(a.keys())} != {list(b.keys())}"
        for k in a:
            d = first_difference(a[k], b[k], f"{path}.{k}" if path else str(k))
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


# ---------------------------------------------------------------------------------------------- #
# Random streams
# ---------------------------------------------------------------------------------------------- #


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
    kinds = draw(st.lists(st.sampled_from(["tensor", "tensor", "list", "scalar0d", "other"]), min_size=n_keys, max_size=n_keys))
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


# ---------------------------------------------------------------------------------------------- #
# The reference and the check
# ---------------------------------------------------------------------------------------------- #


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
) -> None:
    """Stream ``stream`` through Sender -> Receiver with every key on ``strategy``; assert the contract."""
    mgr = manager or get_manager()
    spec = mgr.spec(strategy)
    append = "append" in spec.kinds
    policy = {"default": {"strategy": strategy, "params": dict(params or {})}, "honor_override_keys": False}
    tx, rx = Sender(policy, manager=mgr), Receiver(policy, manager=mgr)
    ref: dict[str, Any] = {}
    for k, chunk in enumerate(stream):
        try:
            expected = _ref_step(ref, chunk, append)
        except ReferenceError_:
            before = as_dict(rx.view(req_id)) if req_id in rx.request_ids() else None
            try:
                rx.merge(req_id, tx.encode(req_id, chunk))
            except AccumulationError:
                after = as_dict(rx.view(req_id)) if req_id in rx.request_ids() else None
                diff = first_difference(before, after) if before is not None else None
                assert diff is None, f"chunk {k}: state changed by a rejected chunk: {diff}"
                break
            raise AssertionError(f"chunk {k}: {strategy!r} merged a value the cat reference cannot merge") from None
        wire = tx.encode(req_id, chunk)
        _check_wire(wire, chunk, spec.name)
        view = rx.merge(req_id, wire)
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
            out[top] = reference_merge(out[top], value, append) if top in out and not isinstance(out[top], dict) else value
    return out


def _check_wire(wire: Mapping[str, Any], chunk: Mapping[str, Any], name: str) -> None:
    for top, value in wire.items():
        if top == WIRE_MARKER:
            assert isinstance(value, int), f"{name}: wire marker must be an int, got {value!r}"
            continue
        assert top in chunk, f"{name}: wire carries key {top!r} the chunk does not have"


def check_conformance(
    strategy: str,
    params: Mapping[str, Any] | None = None,
    *,
    manager: StrategyManager | None = None,
    max_examples: int = 60,
    max_chunks: int = 200,
) -> None:
    """Run the property-based conformance contract against ``strategy`` (with ``params``)."""

    @settings(max_examples=max_examples, deadline=None, database=None)
    @given(stream=payload_streams(max_chunks=max_chunks))
    def run(stream: list[dict[str, Any]]) -> None:
        check_stream(strategy, stream, params, manager=manager)

    run()


# ---------------------------------------------------------------------------------------------- #
# pytest plugin
# ---------------------------------------------------------------------------------------------- #

try:
    import pytest

    @pytest.fixture
    def omni_accum_conformance():
        """The :func:`check_conformance` callable: ``omni_accum_conformance("my_strategy", {...})``."""
        return check_conformance

except ImportError:  # pragma: no cover - pytest is only needed to use the fixture
    pass
