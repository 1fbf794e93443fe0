"""Correctness of a replay: a request's final view against the ``torch.cat`` reference, bit for bit.

Used by :func:`omni_accum.bench.replay.measure` on the first repeat of every arm (re-exported there).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch

from omni_accum.bench.wires import _get, _has, iter_leaves
from omni_accum.bench.workloads import Workload


def check_view(workload: Workload, stream: list[dict[str, Any]], view: Mapping[str, Any]) -> str | None:
    """None when ``view`` equals the reference after the whole ``stream``; else the first mismatch.

    Reference per key kind: ``append`` is the concatenation (``torch.cat`` along dim 0, list ``+``)
    of every value sent; ``replace``/``static`` is the last value sent. Compared bit for bit,
    slice by slice (no reference tensor is built). Append keys and every key the consumer reads
    are checked; replace/static keys it never reads are not (upstream concatenates the constant
    ``meta.override_keys`` list, which no consumer reads). Keys read as ``delta`` are not either: the
    consumer takes them and the receiver drops them chunk by chunk, and :func:`check_taken` checks each take.
    """
    for spec in workload.keys:
        if (spec.kind != "append" and spec.read == "never") or spec.read == "delta":
            continue
        values = [dict(iter_leaves(c))[spec.path] for c in stream if spec.path in dict(iter_leaves(c))]
        if not values:
            continue
        if not _has(view, spec.path):
            return f"key {spec.path!r}: missing from the view"
        got = _get(view, spec.path)
        if spec.kind == "append" and len(values) > 1:
            msg = _check_concat(got, values)
        else:
            msg = _diff(got, values[-1])
        if msg:
            return f"key {spec.path!r}: {msg}"
    return None


def check_taken(chunk: Mapping[str, Any], taken: list[tuple[str, Any]]) -> str | None:
    """None when every ``(path, value)`` the consumer took (read ``delta``) after ``chunk`` equals that
    chunk's value of the key, bit for bit (it takes every chunk that carries the key, so what accumulated
    since its last take is that chunk's value); else the first mismatch."""
    sent = dict(iter_leaves(chunk))
    for path, got in taken:
        if path not in sent:
            return f"key {path!r}: taken after a chunk that does not carry it"
        msg = _diff(got, sent[path])
        if msg:
            return f"key {path!r}: the rows taken differ from the chunk's: {msg}"
    return None


def _check_concat(got: Any, values: list[Any]) -> str | None:
    if isinstance(values[0], list):
        want = list(itertools.chain.from_iterable(values))
        return _diff(got, want)
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor, got {type(got).__name__}"
    rows = sum(int(v.shape[0]) for v in values)
    if got.shape[0] != rows or got.shape[1:] != values[0].shape[1:] or got.dtype != values[0].dtype:
        return (
            f"shape/dtype {list(got.shape)} {got.dtype}, "
            f"expected {[rows, *values[0].shape[1:]]} {values[0].dtype}"
        )
    off = 0
    for i, v in enumerate(values):
        n = int(v.shape[0])
        if not torch.equal(got[off : off + n], v):
            return f"rows {off}..{off + n} (chunk {i}) differ from the cat reference"
        off += n
    return None


def _diff(got: Any, want: Any) -> str | None:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"expected a tensor, got {type(got).__name__}"
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"got {list(got.shape)} {got.dtype}, expected {list(want.shape)} {want.dtype}"
        return None if torch.equal(got, want) else "values differ"
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            n = len(got) if hasattr(got, "__len__") else "?"
            return f"expected a list of {len(want)}, got {type(got).__name__} of {n}"
        for i, (g, w) in enumerate(zip(got, want)):
            m = _diff(g, w)
            if m:
                return f"item {i}: {m}"
        return None
    return None if got == want else f"got {got!r}, expected {want!r}"
