"""The chunk stream of one request of a workload: the chunk dicts a replay sends, built deterministically.

:func:`build_stream` turns a workload into the chunk dicts of one request, deterministically
(seeded) and once per bucket: the prefill tensors are shared by every request (a 32k x 2048 bf16
context is 128 MB), the decode rows differ per request. :func:`chunk_plans` is the schedule
(prefill chunks, then decode steps).
"""

from __future__ import annotations

import math
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
            _set(chunk, spec.path, _value(workload, spec, plan, context_len, gen, ids_so_far))
        out.append(chunk)
    return out


def bucket_streams(workload: Workload, context_len: int, concurrency: int) -> list[list[dict[str, Any]]]:
    """The streams one bucket replays: ``concurrency`` requests of a workload; every request a captured workload
    replays in that bucket (``replayed_lengths``), at least ``concurrency`` (cycling), ``concurrency`` at a time."""
    lengths = getattr(workload, "replayed_lengths", None)
    n = concurrency if lengths is None else max(concurrency, len(lengths(context_len)))
    return [build_stream(workload, context_len, r) for r in range(n)]


def bucket_steps(workload: Workload, context_len: int, concurrency: int) -> int:
    """The steps (chunks of every request) one replay of a bucket takes, nothing built."""
    lengths = getattr(workload, "replayed_lengths", None)
    if lengths is None:
        return concurrency * workload.n_chunks(context_len)
    got = lengths(context_len)
    return sum(got[r % len(got)] for r in range(max(concurrency, len(got))))


def schedule(lengths: list[int], concurrency: int) -> list[list[tuple[int, int]]]:
    """The rounds of a replay: ``(request, chunk)`` steps, ``concurrency`` requests in flight, round-robin in
    request order; a request that ends leaves its place to the next one, from the next round on."""
    pending = iter([r for r, n in enumerate(lengths) if n > 0])
    slots: list[int | None] = [None] * max(1, concurrency)
    pos = [0] * len(lengths)
    rounds: list[list[tuple[int, int]]] = []
    while True:
        for s, r in enumerate(slots):
            if r is None or pos[r] >= lengths[r]:
                slots[s] = next(pending, None)
        steps = [(r, pos[r]) for r in slots if r is not None]
        if not steps:
            return rounds
        for r, _ in steps:
            pos[r] += 1
        rounds.append(steps)


#: The prefill-sized tensors of one bucket (workload, seed, prompt length), shared by its requests; a stream of
#: another bucket drops them (a bench or tune run measures one bucket at a time: holding every bucket's would add
#: up to GiBs over a run's prompt lengths, beyond what its memory check counts per bucket).
_SHARED: dict[tuple[Any, ...], Any] = {}
_SHARED_BUCKET: list[Any] = [None]


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
        bucket = (workload.name, workload.seed, context_len)
        if _SHARED_BUCKET[0] != bucket:
            _SHARED.clear()
            _SHARED_BUCKET[0] = bucket
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


# ---------------------------------------------------------------------------------------------- #
# What a bucket's streams and the receiver's state take, worked out from the shapes (nothing is built)
# ---------------------------------------------------------------------------------------------- #

_ITEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int64": 8, "int32": 4}
#: Bytes counted per element of an ids list (a CPython int and its pointer in the list).
_LIST_ITEM = 36


@dataclass(frozen=True)
class StreamBytes:
    """The bytes one bucket holds before and while it is replayed, per part (see :func:`stream_nbytes`).

    ``shared``: the prefill-sized and static tensors, built once per bucket and shared by every request;
    ``prefill``/``decode``: each request's own values in its prefill / decode chunks (decode rows, ids, codes);
    ``held_prefill``/``held_decode``: the receiver's copy, per request in flight, of those chunks' keys not read
    as deltas (an append key's every value, a replace key's largest)."""

    shared: int = 0
    prefill: int = 0
    decode: int = 0
    held_prefill: int = 0
    held_decode: int = 0
    shared_decode: int = 0  # the part of ``shared`` in decode chunks (a captured workload's replayed requests)
    #: A captured workload's bucket: its requests built (``shared``), and the most one of them builds again when
    #: ``concurrency`` exceeds them (it is replayed once more, with other data; prefill-sized tensors shared).
    pool: int = 0
    lap: int = 0
    lap_decode: int = 0

    def per_request(self) -> int:
        return self.prefill + self.decode + self.held_prefill + self.held_decode

    def _laps(self, concurrency: int) -> int:
        return max(0, concurrency - self.pool) if self.pool else 0

    def total(self, concurrency: int) -> int:
        """Every request's stream is built before the replay, and ``concurrency`` requests are in flight."""
        return self.shared + self._laps(concurrency) * self.lap + concurrency * self.per_request()

    def decode_total(self, concurrency: int) -> int:
        """The part of :meth:`total` that grows with the decode steps."""
        return (self.shared_decode + self._laps(concurrency) * self.lap_decode
                + concurrency * (self.decode + self.held_decode))  # fmt: skip


def _groups(workload: Workload, context_len: int) -> list[tuple[int, int, int, bool]]:
    """The schedule as runs of like chunks: ``(first index, count, prefill rows, is prefill)`` (no per-chunk list)."""
    pre = workload.prefill_chunks(context_len)
    out = [(0, 1, pre[0], True)] if pre else []
    if len(pre) > 2:
        out.append((1, len(pre) - 2, pre[1], True))
    if len(pre) > 1:
        out.append((len(pre) - 1, 1, pre[-1], True))
    if workload.decode_steps:
        out.append((len(pre), workload.decode_steps, 0, False))
    return out


def _key_nbytes(spec: KeySpec, start: int, count: int, prefill_rows: int, is_prefill: bool) -> tuple[int, int, int]:
    """``(shared, own, largest value)`` bytes of ``spec``'s values in a run of ``count`` like chunks."""
    plan = ChunkPlan(start, prefill_rows, is_prefill, False)
    if spec.value in ("bool", "names"):
        return 0, 0, 0
    if spec.value == "flag":
        return 0, count, 1
    rows = _rows(spec, plan)
    if spec.value == "ids":
        if spec.cumulative and spec.kind != "static" and not is_prefill:  # 1, 2, ... n times the rows, as built
            return 0, _LIST_ITEM * rows * count * (count + 1) // 2, _LIST_ITEM * rows * count
        return 0, _LIST_ITEM * rows * count, _LIST_ITEM * rows
    if spec.value == "codes":
        w = spec.windows
        head = w[start : start + count] if start < len(w) else []
        frames = sum(head) + (count - len(head)) * w[-1]
        return 0, 8 * spec.codebooks * frames, 8 * spec.codebooks * max([*head, w[-1]])
    one = rows * math.prod(spec.row_shape) * _ITEM_BYTES[spec.dtype]
    if is_prefill or spec.kind == "static":
        return one * count, 0, one
    return 0, one * count, one


def stream_nbytes(workload: Workload, context_len: int) -> StreamBytes:
    """What a bucket of ``context_len`` holds (:class:`StreamBytes`), from the workload's shapes, dtypes and steps:
    nothing is allocated, so a bucket too large for the machine is found before it is built."""
    recorded = getattr(workload, "bucket_requests", None)
    if recorded is not None:
        return _recorded_nbytes(workload, context_len)
    parts = dict.fromkeys(("shared", "prefill", "decode", "held_prefill", "held_decode"), 0)
    for spec in workload.keys:
        kept = (0, "held_prefill")  # a replace key's receiver keeps its largest value only
        for start, count, rows, is_prefill in _groups(workload, context_len):
            if spec.carried == "first":
                if start != 0:
                    continue
                count = 1
            elif (spec.carried == "prefill" and not is_prefill) or (spec.carried == "decode" and is_prefill):
                continue
            shared, own, largest = _key_nbytes(spec, start, count, rows, is_prefill)
            side = "prefill" if is_prefill else "decode"
            parts["shared"] += shared
            parts[side] += own
            if spec.read == "delta":
                continue
            if spec.kind == "append":
                parts[f"held_{side}"] += shared + own
            else:
                kept = max(kept, (largest, f"held_{side}"))
        parts[kept[1]] += kept[0]
    return StreamBytes(**parts)


def _recorded_nbytes(workload: Any, context_len: int) -> StreamBytes:
    """:func:`stream_nbytes` of a captured workload, from the recorded bytes of each key: every request the bucket
    replays is built before the replay (``shared``; a prefill-sized append tensor once per shape, as the replay
    shares it; a replace tensor re-sent with its shape unchanged once), and each request in flight holds the
    receiver's copy (``held_*``: the largest of the requests', its first chunk as the prefill)."""
    delta = {k.path for k in workload.keys if k.read == "delta"}
    append = {k.path for k in workload.keys if k.kind == "append"}
    best = (0, 0)
    built = built_decode = 0
    lap = (0, 0)  # the most one request builds of its own (all but the prefill-sized tensors), and its decode part
    shapes: set[tuple[Any, ...]] = set()
    pool = workload.bucket_requests(context_len)
    for r in pool:
        held_pre = held_dec = own = own_decode = 0
        last: dict[str, int] = {}
        prev: dict[str, tuple[int, ...]] = {}
        for i, c in enumerate(r.chunks[: 1 + workload.decode_steps]):
            for k in c.keys:
                n = int(k.nbytes)
                shape = (k.path, k.dtype, k.shape)
                if k.kind == "append" and k.shape and k.shape[0] > 1 and not (k.extra and "sample" in k.extra):
                    n_built = 0 if shape in shapes else n
                    shapes.add(shape)
                else:
                    n_built = 0 if k.kind == "replace" and prev.get(k.path) == k.shape else n
                    own, own_decode = own + n_built, own_decode + (n_built if i else 0)
                prev[k.path] = k.shape
                built += n_built
                built_decode += n_built if i else 0
                if k.path in delta:
                    continue
                if k.path in append:
                    held_pre, held_dec = (held_pre + n, held_dec) if i == 0 else (held_pre, held_dec + n)
                else:
                    last[k.path] = max(last.get(k.path, 0), n)
        held_pre += sum(last.values())
        best = max(best, (held_pre, held_dec), key=sum)
        lap = max(lap, (own, own_decode))
    return StreamBytes(built, 0, 0, *best, shared_decode=built_decode, pool=len(pool), lap=lap[0], lap_decode=lap[1])
