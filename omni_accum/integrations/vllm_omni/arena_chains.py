"""Append chains of ``OmniAccumArenaConnector``'s puts (see docs/arena.md, "Append chains"): which
tensors of a payload go as rows of the request's chains, and the payload with them written there."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from vllm_omni.distributed.omni_connectors.utils import serialization as _ser

from omni_accum.arena._common import DTYPES

#: Key of a tensor's wire dict (vllm-omni's own tensor encoding) that says which rows of a request's
#: append chain it is: ``[chain number, first row, rows]``.
IN_CHAIN = "__omni_accum_chain__"
TENSOR_MARKER = getattr(_ser, "_TENSOR_MARKER", "__tensor__")
DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}


def request_of(put_key: str) -> str | None:
    """The external request id of a chunk put key (vllm-omni 0.30.0's ``<request>_<stage>_<chunk>``), else None."""
    parts = put_key.rsplit("_", 2)
    if len(parts) == 3 and parts[0] and parts[1].isdigit() and parts[2].isdigit():
        return parts[0]
    return None


def append_test() -> Any:
    """``(path, value) -> bool``: whether the omni-accum policy of the send in progress appends the key
    (its receiver then accumulates the rows), or None outside such a send (omni-accum not installed here)."""
    from omni_accum.integrations.vllm_omni.send import putting_binding  # noqa: PLC0415 - no cycle at import

    b = putting_binding()
    return None if b is None else b.appends


def struct_map(obj: Any) -> dict[str, Any] | None:
    """A msgspec struct (vllm-omni's ``OmniPayloadStruct``) as the map its msgpack encoding is, which the
    receiving side decodes (fields at their default left out, nested structs as maps); None for anything else."""
    fields = getattr(type(obj), "__struct_fields__", None)
    if fields is None:
        return None
    defaults = getattr(type(obj), "__struct_defaults__", ())
    default = dict(zip(fields[len(fields) - len(defaults) :], defaults))
    out: dict[str, Any] = {}
    for f in fields:
        v = getattr(obj, f)
        d = default.get(f, _NO_DEFAULT)
        if v is d or (d is not _NO_DEFAULT and type(v) is type(d) and isinstance(d, (int, float, str, bool)) and v == d):
            continue
        sub = struct_map(v)
        out[f] = v if sub is None else sub
    return out


_NO_DEFAULT = object()


def plain_tensor(t: Any) -> bool:
    """A non-empty dense tensor of a dtype the wire names, whose bytes are its values (not quantized, no lazy
    negation or conjugation): its bytes can be moved as they are."""
    return (
        isinstance(t, torch.Tensor)
        and t.dtype in DTYPE_NAMES
        and t.layout is torch.strided
        and not t.is_quantized
        and not t.is_neg()
        and not t.is_conj()
        and t.numel() > 0
    )


def _chainable(t: Any) -> bool:
    return plain_tensor(t) and t.dim() >= 1 and t.shape[0] > 0


def chain_payload(
    tx: Any, req: str, data: Mapping[str, Any], appends: Any, opens: list, taken: list, refs: list[int]
) -> Any:
    """``data`` with the tensors of append keys written into their chains (as wire dicts naming the rows:
    vllm-omni's tensor encoding with :data:`IN_CHAIN`); the chains' numbers go to ``refs``, new slabs to
    ``opens`` and their pages to ``taken`` (see :meth:`~omni_accum.arena.sender.ArenaSender.append_rows`)."""
    out: dict[str, Any] | None = None
    for top, value in data.items():
        if isinstance(value, Mapping):
            sub: dict[str, Any] | None = None
            for qual, qv in value.items():
                if _chainable(qv) and appends(f"{top}.{qual}", qv):
                    if sub is None:
                        sub = dict(value)
                    sub[qual] = _chained(tx, req, f"{top}.{qual}", qv, opens, taken, refs)
            if sub is not None:
                if out is None:
                    out = dict(data)
                out[top] = sub
        elif _chainable(value) and appends(str(top), value):
            if out is None:
                out = dict(data)
            out[top] = _chained(tx, req, str(top), value, opens, taken, refs)
    return data if out is None else out


def cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the arena copies it: detached, on the CPU, contiguous (no copy when it already is)."""
    t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    return t.contiguous()


def tensor_ref(t: torch.Tensor, shape: list[int], where: str, value: Any) -> dict[str, Any]:
    """vllm-omni's wire dict of a tensor whose bytes are in the arena (``where``: :data:`IN_CHAIN` or the
    connector's page key) instead of in the message."""
    return {TENSOR_MARKER: True, "dtype": DTYPE_NAMES[t.dtype], "shape": shape, "data": b"", where: value}


def _chained(tx: Any, req: str, path: str, t: torch.Tensor, opens: list, taken: list, refs: list) -> dict[str, Any]:
    shape = list(t.shape)
    t = cpu_contiguous(t)
    no, start, rows = tx.append_rows(req, path, t, opens, taken)
    refs.append(no)
    return tensor_ref(t, shape, IN_CHAIN, [no, start, rows])
