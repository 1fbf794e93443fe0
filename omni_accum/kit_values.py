"""The conformance kit's value helpers (re-exported by :mod:`omni_accum.testing`, where plugins import them): bit-exact
comparison and the first difference, what a connector delivers (:func:`copy_wire`), what the wire may carry, the
sender reusing its buffers, the caller's values checked unchanged.

Needs torch only, so the kit's message helpers import without hypothesis or the engine.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Mapping
from typing import Any

import torch


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its element's size (a complex tensor: its real and imaginary parts', one more dim)."""
    if t.is_floating_point() or t.is_complex():
        t = t.resolve_conj().resolve_neg().contiguous()
        if t.is_complex():
            t = torch.view_as_real(t)
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size(), torch.uint8)
        return t.view(as_int)
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
    """Describe the first place where ``a`` and ``b`` differ, or None when they are the same (for two tensors of one
    shape: the first differing row and element, with both values)."""
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
    sa, sb = _short(a), _short(b)
    if sa == sb and type(a) is float and type(b) is float:  # two NaNs of other bits: 'nan != nan' said nothing
        sa, sb = f"{sa} (bits 0x{struct.pack('>d', a).hex()})", f"{sb} (bits 0x{struct.pack('>d', b).hex()})"
    return f"{path or '<root>'}: {sa} != {sb}{_where_tensors_differ(a, b)}"


def _where_tensors_differ(a: Any, b: Any) -> str:
    """``, first at row 3, element [3, 1]: 0.5 != -0.5`` for two tensors of one dtype, shape and device; else ''.
    A wrong row in a view of thousands is found at a glance (the shapes alone say nothing when they match)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return ""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device or a.is_nested or a.layout != torch.strided:
        return ""
    at = (_bits(a) != _bits(b)).nonzero()
    if not len(at):
        return ""
    index = tuple(at[0].tolist())[: a.dim()]  # (a complex tensor's bits have one more dim)
    row = f"row {index[0]}, " if index else ""
    x, y = repr(a[index].item()), repr(b[index].item())
    if x == y and not a.is_complex():  # NaNs of other sign or payload: their bits say how they differ
        x, y = (f"{v} (bits 0x{int(_bits(t)[index].item()) & ((1 << 8 * t.element_size()) - 1):x})"
                for v, t in ((x, a), (y, b)))
    return f", first at {row}element {list(index)}: {x} != {y}"


def _short(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor(shape={list(v.shape)}, dtype={v.dtype})"
    r = repr(v)
    return r if len(r) < 80 else r[:77] + "..."


def as_dict(view: Mapping[str, Any]) -> dict[str, Any]:
    """Materialise a view (RequestView or dict) as plain nested dicts."""
    return {k: (as_dict(v) if isinstance(v, Mapping) else v) for k, v in view.items()}


PLAIN_TYPES = (int, float, str, bytes, bool, type(None))


def check_plain_wire(value: Any, where: str = "<wire>") -> None:
    """Assert ``value`` holds only what vllm-omni's serializer carries: dicts, lists, tuples (delivered as lists),
    tensors, scalars."""
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
    """What a connector delivers: the same data in new objects (tensors cloned, lists and dicts rebuilt), and every
    tuple a list, as vllm-omni's OmniSerializer (msgpack) delivers it: a receiver telling its own marks from the
    values by ``isinstance(w, tuple)`` works in process and serves a wrong view across processes."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return [copy_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: copy_wire(v) for k, v in value.items()}
    return value


def as_delivered(value: Any) -> Any:
    """``value`` with every tuple a list (nothing else copied): what the consumer of a copying wire is served."""
    if isinstance(value, (list, tuple)):
        items = [as_delivered(v) for v in value]
        return items if isinstance(value, tuple) or any(x is not y for x, y in zip(items, value)) else value
    if isinstance(value, dict):
        out = {k: as_delivered(v) for k, v in value.items()}
        return out if any(out[k] is not v for k, v in value.items()) else value
    return value


def snapshot(value: Any) -> Any:
    """A deep copy of a caller's chunk (tensors cloned, containers rebuilt in their own types), to check later that
    nothing the caller handed in was changed: a strategy must not extend, sort or write into the caller's values."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        items = [snapshot(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
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


def non_contiguous(t: torch.Tensor, layout: int) -> torch.Tensor:
    """``t``'s values in another memory layout: 0 as it is, 1 at a storage offset, 2 a column slice (strided), 3 a
    transposed view; a strategy that reads ``data_ptr()`` as contiguous rows serves wrong rows for 1 to 3."""
    if layout == 1:
        big = torch.empty((t.shape[0] + 1, *t.shape[1:]), dtype=t.dtype)
        big[1:] = t
        return big[1:]
    if layout == 2 and t.dim() >= 2:
        big = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
        big[..., ::2] = t
        return big[..., ::2]
    if layout == 3 and t.dim() >= 2:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    return t


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
