"""What the arena's sender and receiver share: message tags, dtype names, payload paths, waiting."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import Any

import torch

from omni_accum.bench.wires import iter_leaves as leaves  # noqa: F401 - one leaf walk for bench and arena
from omni_accum.strategy import ARENA_TAG  # noqa: F401 - the tag the receiver puts on append chains' rows

#: sender -> receiver message tags (pages go back with :data:`.wire.FREE_TAG`); MSG: one keyed message
#: (the connector's put), its tensors in arena pages the receiver frees once it has copied them out
CHUNK, DONE, MSG = "c", "d", "m"
#: the end of a request's append chains (keyed messages): the receiver drops its slabs once no view of them
#: is left (see :meth:`.sender.ArenaSender.append_rows`)
CHAINS_DONE = "x"

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}

#: A decode step's descriptor in binary (no pickling): b"R", then ROWS_HEAD (the request's number, the
#: sender's stamp, the item count), then one ROWS_ITEM per key: (key number, kind, value). Kinds: an
#: append key's new row count, or a small value (None, a bool, an int). Request and key numbers are
#: announced by the request's CHUNK descriptors (:mod:`.wire`, whose messages start with b"t", never b"R").
ROWS_TAG = 0x52
ROWS_HEAD = struct.Struct("<QqH")
ROWS_ITEM = struct.Struct("<HBq")
R_ROWS, R_NONE, R_BOOL, R_INT = 0, 1, 2, 3

#: how often a waiting side checks that its peer lives (seconds)
LIVENESS_EVERY_S = 0.02


def region_bytes(mm: Any) -> torch.Tensor:
    """The whole mapping ``mm`` as one uint8 tensor, over a memoryview of it: the view holds an export of the mapping,
    so ``mmap.close()`` cannot unmap it while a tensor over it lives (staged prompt rows, a view handed out); the
    pages stay mapped until the mmap is freed, with the last (over the mmap itself, ``close()`` unmapped pages that
    live tensors still pointed at: a segfault)."""
    return torch.frombuffer(memoryview(mm), dtype=torch.uint8)


def row_bytes(dtype: torch.dtype, row_shape: Any) -> int:
    """Bytes of one row of ``row_shape`` (the trailing shape) of ``dtype``."""
    n = dtype.itemsize
    for d in row_shape:
        n *= d
    return n


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def place(view: dict[str, Any], path: str, value: Any) -> None:
    top, _, qual = path.partition(".")
    if qual:
        view.setdefault(top, {})[qual] = value
    else:
        view[top] = value


def wait_until(cond: Callable[[], Any], timeout_s: float, check: Callable[[], None]) -> Any:
    """Poll ``cond`` (spin briefly, then sleep) until it is truthy; ``check`` every LIVENESS_EVERY_S.

    Returns the truthy value, or None after ``timeout_s``. ``check`` raises to abort the wait.
    """
    v = cond()
    if v:
        return v
    start = last = time.monotonic()
    spins = 0
    while True:
        v = cond()
        if v:
            return v
        now = time.monotonic()
        if now - last >= LIVENESS_EVERY_S:
            check()
            last = now
        if now - start >= timeout_s:
            return None
        spins += 1
        if spins > 200:
            time.sleep(0.0002 if now - start < 0.05 else 0.002)
