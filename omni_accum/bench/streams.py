"""The chunk stream of one request of a workload: the chunk dicts a replay sends, built deterministically.

:func:`build_stream` turns a workload into the chunk dicts of one request, deterministically
(seeded) and once per bucket: the prefill tensors are shared by every request (a 32k x 2048 bf16
context is 128 MB), the decode rows differ per request. :func:`chunk_plans` is the schedule
(prefill chunks, then decode steps).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch

from omni_accum.bench.workloads import KeySpec, Workload

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}


@dataclass(frozen=True)
class ChunkPlan:
    """Where a chunk sits in the schedule."""

    index: int
    prefill_rows: int  # rows of prefill in this chunk (0 for decode chunks)
    is_prefill: bool
    is_last: bool


def chunk_plans(workload: Workload, context_len: int) -> list[ChunkPlan]:
    pre = workload.prefill_chunks(context_len)
    n = len(pre) + workload.decode_steps
    plans = [ChunkPlan(i, r, True, i == n - 1) for i, r in enumerate(pre)]
    plans += [ChunkPlan(len(pre) + j, 0, False, len(pre) + j == n - 1) for j in range(workload.decode_steps)]
    return plans


def _set(chunk: dict[str, Any], path: str, value: Any) -> None:
    top, _, qual = path.partition(".")
    if qual:
        chunk.setdefault(top, {})[qual] = value
    else:
        chunk[top] = value


def _carries(spec: KeySpec, plan: ChunkPlan) -> bool:
    if spec.carried == "every":
        return True
    if spec.carried == "first":
        return plan.index == 0
    if spec.carried == "prefill":
        return plan.is_prefill
    return not plan.is_prefill


def build_stream(workload: Workload, context_len: int, request: int = 0) -> list[dict[str, Any]]:
    """The chunks of request number ``request`` for prefill length ``context_len``.

    Deterministic for (workload, context_len, request). Prefill-sized tensors (the chunks of
    ``first``/``prefill`` keys) are the same objects for every request (cached); decode rows depend
    on ``request``. Chunks must be treated as read-only. A captured workload (``omni_accum.capture.trace``)
    gives its recorded requests' chunks instead.
    """
    recorded = getattr(workload, "recorded_stream", None)
    if recorded is not None:
        return recorded(context_len, request)
    plans = chunk_plans(workload, context_len)
    gen = torch.Generator().manual_seed(workload.seed * 1_000_003 + request * 7919 + 1)
    ids_so_far: dict[str, list[int]] = {}
    out: list[dict[str, Any]] = []
    for plan in plans:
        chunk: dict[str, Any] = {}
        for spec in workload.keys:
            if not _carries(spec, plan):
                continue
            _set(chunk, spec.path, _value(workload, spec, plan, context_len, request, gen, ids_so_far))
        out.append(chunk)
    return out


_SHARED: dict[tuple[Any, ...], Any] = {}


def clear_cache() -> None:
    """Drop cached prefill tensors (they are shared by every request of a bucket)."""
    _SHARED.clear()


def _rows(spec: KeySpec, plan: ChunkPlan) -> int:
    if spec.rows is not None:
        rows = spec.rows
    elif spec.carried in ("first", "prefill") or (spec.carried == "every" and plan.is_prefill):
        rows = plan.prefill_rows or 1
    else:
        rows = 1
    return rows + (spec.extra_first_rows if plan.index == 0 else 0)


#: Elements drawn per float32 block when filling a bf16/fp16 tensor (a multiple of 16, see :func:`_tensor`).
_RANDN_BLOCK = 1 << 20


def _tensor(shape: list[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Seeded values of ``shape``, built in ``dtype``: the same values (and generator state after) as
    ``torch.randn(shape, dtype=float32).to(dtype)`` (``randint`` in int64 for integers).

    A half-precision tensor is filled from float32 blocks of :data:`_RANDN_BLOCK` elements, so a
    prefill tensor never has a float32 copy. CPU ``randn`` draws one uniform per element in order and
    transforms aligned groups of 16 (redrawing the last 16 when the size is no multiple of 16), so
    blocks of a multiple of 16 elements, the last one taking any remainder under 16, give the whole
    draw's values.
    """
    if not dtype.is_floating_point:
        return torch.randint(0, 4096, shape, generator=gen, dtype=dtype)
    if dtype == torch.float32:
        return torch.randn(shape, generator=gen, dtype=dtype)
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    n = flat.numel()
    start = 0
    while start < n:
        end = min(start + _RANDN_BLOCK, n)
        if n - end < 16:
            end = n
        flat[start:end] = torch.randn(end - start, generator=gen, dtype=torch.float32)
        start = end
    return out


def _value(
    workload: Workload,
    spec: KeySpec,
    plan: ChunkPlan,
    context_len: int,
    request: int,
    gen: torch.Generator,
    ids_so_far: dict[str, list[int]],
) -> Any:
    if spec.value == "flag":
        return torch.tensor(plan.is_last)
    if spec.value == "bool":
        return plan.is_last
    if spec.value == "names":
        return [list(p) for p in spec.names]
    shared = plan.is_prefill
    rows = _rows(spec, plan)
    if spec.value == "ids":
        if spec.kind == "static" or shared:
            return list(range(plan.index * 100_000, plan.index * 100_000 + rows))
        new = [int(x) for x in torch.randint(0, 150_000, (rows,), generator=gen)]
        if spec.cumulative:
            acc = ids_so_far.setdefault(spec.path, [])
            acc.extend(new)
            return list(acc)
        return new
    if spec.value == "codes":
        w = spec.windows[min(plan.index, len(spec.windows) - 1)]
        return _tensor([spec.codebooks * w], torch.int64, gen)
    dtype = _DTYPES[spec.dtype]
    if shared or spec.kind == "static":
        key = (
            workload.name,
            workload.seed,
            spec.path,
            context_len,
            plan.index,
            rows,
            tuple(spec.row_shape),
            spec.dtype,
        )
        t = _SHARED.get(key)
        if t is None:
            g = torch.Generator().manual_seed(zlib.crc32(repr(key[1:]).encode()))
            t = _SHARED[key] = _tensor([rows, *spec.row_shape], dtype, g)
        return t
    return _tensor([rows, *spec.row_shape], dtype, gen)


def append_length_hints(workload: Workload, stream: list[dict[str, Any]]) -> dict[str, int]:
    """Final rows of every append-kind key over ``stream`` (one request's chunks): the length hints a
    :class:`~omni_accum.context.StreamContext` gives preallocating strategies."""
    from omni_accum.bench.wires import iter_leaves  # noqa: PLC0415 - wires pulls vllm-omni's classes lazily

    hints: dict[str, int] = {}
    for spec in workload.keys:
        if spec.kind == "append":
            rows = [
                int(v.shape[0])
                for c in stream
                for p, v in iter_leaves(c)
                if p == spec.path and isinstance(v, torch.Tensor) and v.dim() > 0
            ]
            if rows:
                hints[spec.path] = sum(rows)
    return hints
