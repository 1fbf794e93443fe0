"""``prealloc``: a growable contiguous buffer; amortised O(1) append, zero-copy prefix view on read.

The first chunk is kept by reference (a key that never grows costs nothing). On the first append
a buffer of ``max(initial_capacity, growth_factor x rows)`` rows is allocated on the chunk's
device and dtype, and grows by ``growth_factor`` when full. Capacity never exceeds
``growth_factor x rows + initial_capacity``. A length hint (``StreamContext.length_hints`` naming the
key; a request keeps the context of its first chunk) only sizes the buffer: one that holds the rows
is allocated at the hinted length, within that bound; one below the rows is not used, and rows past
the hint are appended as without one. The view is ``buffer[:rows]``: no copy. Quantized tensors are
refused (``check``): ``cat`` and ``token_list`` join them.

Views are borrowed: the rows they show never change, but writing into a view writes into the
buffer.

``reuse_bytes`` (0 by default) lets a process keep up to that many bytes of CPU buffers for the next
request instead of giving them back to the allocator: a buffer of hundreds of MiB is otherwise fresh
memory every request, and the kernel zeroes and maps each of its pages at the first write (at 32k rows of
``[., 2048]`` bf16, most of the time an append takes). A kept buffer is handed out again only when nothing
but the pool refers to its storage (no accumulator, no view, no tensor derived from one: its storage's use
count is back to what it was when the pool took it), and only to a key of the same dtype and row shape
whose rows it can hold within the capacity bound below; its bytes beyond the rows written are never shown.
The memory kept is resident while idle: that is the price.

Over omni-accum's arena connector (``OmniAccumArenaConnector``) the buffer is the arena itself: the
sender writes each chunk's rows of an append key behind the key's earlier rows in one shared slab,
and the receiver hands them out as a view tagged with that slab's rows so far (``ARENA_TAG``). While
every chunk of the key comes so, right behind the rows held, the accumulator takes that view as its
buffer: no copy on the receiving side, the consumer reads the shared pages. Any other chunk (another
connector's, a trimmed span, a gap) makes it an ordinary buffer from then on (one copy of the rows
held), so the view is always the ``torch.cat`` of the chunks, bit for bit.
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading
from typing import Any

import torch
from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from omni_accum.hookspecs import hookimpl
from omni_accum.strategy import ARENA_TAG, AppendAccumulator, KeyInfo, Strategy, StrategySpec, describe, value_nbytes
from omni_accum.strategy import MergeError  # (strategies import strategy and hookspecs only: docs/architecture.md)


_memmove = ctypes.memmove
_append_check = AppendAccumulator.check  # (no super() lookup per chunk: check runs for every chunk of every key)
#: Copies of fewer bytes go through one memmove (no torch dispatch: ~1 us less per decode step); larger ones
#: (a prefill chunk) through torch's copy, which spreads over the intra-op threads: a 128 MiB copy into fresh
#: pages took 59 ms so against 98 ms for one memmove on a 2-core EPYC.
_MEMMOVE_MAX = 1 << 20


class Params(BaseModel):
    """Params of ``prealloc``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # strict: a number, never a bool (``yes`` was 1) or a string ("2"), as the policy's own numbers
    initial_capacity: int = Field(default=64, ge=1, le=1 << 24, strict=True)
    """Rows allocated at the first append, at least (more when the key already holds more)."""
    growth_factor: float = Field(default=2.0, gt=1.0, le=16.0, strict=True)
    """Capacity multiplier when the buffer is full (> 1)."""
    reuse_bytes: ByteSize = Field(default=ByteSize(0), ge=0, le=1 << 40)
    """CPU buffers this process keeps for later requests, in bytes (``512MiB`` or a number; 0: none)."""

    @field_validator("growth_factor", mode="before")
    @classmethod
    def _finite_growth(cls, v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):  # nan passes every bound; inf is no factor
            raise PydanticCustomError("finite_number", "must be a finite number > 1")
        return v

    @field_validator("reuse_bytes", mode="before")
    @classmethod
    def _bytes_not_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):  # ByteSize would take true as 1 byte
            raise PydanticCustomError("byte_size", "Input should be a number of bytes or a size such as '512MiB'")
        if (isinstance(v, (int, float)) and not v >= 0) or (isinstance(v, str) and v.strip().startswith("-")):
            raise PydanticCustomError("byte_size", "must be >= 0")  # ByteSize: "could not parse value and unit"
        return v


class PreallocAccumulator(AppendAccumulator):
    """A buffer with ``rows`` valid rows; the first chunk is held by reference until an append."""

    __slots__ = ("_first", "_buf", "_cap", "_rows", "_view", "_g", "_init", "_ptr", "_row_bytes", "_chain", "_reuse")

    def __init__(self, key: KeyInfo, params: Params) -> None:
        super().__init__(key)
        self._g = params.growth_factor
        self._init = params.initial_capacity
        self._reuse = int(params.reuse_bytes)
        self._first: torch.Tensor | None = None
        self._buf: torch.Tensor | None = None
        self._cap = 0
        self._rows = 0
        self._view: torch.Tensor | None = None
        self._ptr = 0  # address of the buffer's data when rows may be copied with a plain memmove (else 0)
        self._row_bytes = 0
        self._chain: int | None = None  # the arena chain whose slab is the buffer (see the module docstring)

    @property
    def capacity(self) -> int:
        """Rows the buffer can hold without growing."""
        return int(self._buf.shape[0]) if self._buf is not None else self._rows

    def _target(self, need: int, cap: int) -> int:
        """Capacity to allocate for ``need`` rows; never above ``g x need + initial_capacity``."""
        bound = int(self._g * need) + self._init
        hint = self.key.length_hint
        if hint is not None and hint >= need:
            return min(hint, bound)
        grown = max(self._init, math.ceil(cap * self._g), need)
        return min(grown, bound)

    def check(self, value: Any) -> None:
        if self._mode != 1 and isinstance(value, torch.Tensor) and value.is_quantized:  # later: a new dtype
            raise MergeError(
                f"cannot append {describe(value)}: prealloc holds no quantized tensors (dtype {value.dtype}); give "
                "this key cat or token_list (they join them as torch.cat does), or send value.dequantize()"
            )
        _append_check(self, value)

    def start_tensor(self, value: torch.Tensor) -> None:
        self._first, self._buf, self._view = value, None, value
        self._rows = int(value.shape[0]) if value.dim() else 0
        tag = getattr(value, ARENA_TAG, None)
        self._chain = tag[0] if tag is not None and tag[1] == 0 else None

    def append_tensor(self, value: torch.Tensor) -> None:
        if self._chain is not None:
            tag = getattr(value, ARENA_TAG, None)
            if tag is not None and tag[0] == self._chain and tag[1] == self._rows:
                full = tag[2]  # the slab's rows up to and with this chunk's: the ones held, then the new ones
                self._first = self._view = full
                self._rows = int(full.shape[0])
                return
            self._chain = None  # an ordinary buffer from here on (the append below copies the rows held)
        if value.requires_grad:
            value = value.detach()
        rows = self._rows
        need = rows + value.shape[0]
        buf = self._buf
        if buf is None or need > self._cap:
            cap = self._target(need, self.capacity)
            src = self._first if buf is None else buf[:rows]
            new = _new_buffer(cap, int(self._g * need) + self._init, src, self._reuse) if self._reuse else None
            if new is None:
                new = torch.empty((cap, *src.shape[1:]), dtype=src.dtype, device=src.device)
            new[:rows] = src.detach() if src.requires_grad else src
            self._buf, self._first, self._cap, buf = new, None, cap, new
            self._ptr, self._row_bytes = _raw_copy_target(new)
        if (
            self._ptr
            and (need - rows) * self._row_bytes < _MEMMOVE_MAX
            and buf.data_ptr() == self._ptr  # the storage was not resized through a borrowed view
            and type(value) is torch.Tensor
            and value.layout is torch.strided
            and value.is_contiguous()
            and not value.is_neg()  # a lazily negated view (torch.conj(c).imag): its bytes lack the sign
            and not value.is_conj()
            and value.data_ptr()  # 0: a tensor without storage (autograd's zero tensors)
        ):
            # check() has matched the value's dtype, trailing shape and device (CPU) with the buffer's, and
            # need <= capacity: the rows are value's bytes as they are. Same bytes as the torch copy below,
            # without the ~1 us of indexing and dispatch it costs per step.
            _memmove(self._ptr + rows * self._row_bytes, value.data_ptr(), (need - rows) * self._row_bytes)
        else:
            buf[rows:need] = value
        self._rows = need
        self._view = None

    def own(self, into: torch.Tensor | None = None) -> int:
        """Copy a first chunk held by reference into the buffer now (sized from the key's length hint, as an
        append would size it), so that the next append copies only its own rows. ``into``: the buffer to use
        instead of a new one (rows of the chunk's dtype, row shape and device, contiguous, at least the chunk's
        rows and within the capacity bound: the stage input processor passes the arena slab its put will
        announce, so the put copies nothing); one that does not fit is not used. Returns the bytes copied
        (0: nothing held by reference, or a chunk over the arena). Same rows, same view, bit for bit."""
        first = self._first
        if self._buf is not None or first is None or not first.dim() or not first.shape[0] or self._chain is not None:
            return 0
        rows = int(first.shape[0])
        if (
            into is not None
            and type(into) is torch.Tensor
            and into.dtype == first.dtype
            and into.device == first.device
            and tuple(into.shape[1:]) == tuple(first.shape[1:])
            and rows <= into.shape[0] <= int(self._g * rows) + self._init
            and into.is_contiguous()
            and not into.requires_grad
        ):
            into[:rows] = first.detach() if first.requires_grad else first
            self._buf, self._first, self._cap, self._view = into, None, int(into.shape[0]), None
            self._ptr, self._row_bytes = _raw_copy_target(into)
            return value_nbytes(first)
        self.start_tensor(first[:0])
        self.append_tensor(first)
        return value_nbytes(first)

    def read_tensor(self) -> torch.Tensor:
        view = self._view
        if view is None:
            view = self._view = self._buf[: self._rows]  # type: ignore[index]
        return view

    def current_tensor_meta(self) -> torch.Tensor:
        return self._first if self._buf is None else self._buf  # type: ignore[return-value]

    def clear_tensor(self) -> None:
        self._first = self._buf = self._view = None
        self._rows = self._ptr = 0
        self._chain = None

    def tensor_nbytes(self) -> int:
        return value_nbytes(self._buf if self._buf is not None else self._first)

    def projected_tensor_nbytes(self, value: torch.Tensor) -> int:
        """Bytes held after appending ``value``: the buffer it would grow to (what :meth:`append_tensor` allocates)."""
        need = self._rows + int(value.shape[0])
        buf = self._buf
        cap = int(buf.shape[0]) if buf is not None and need <= buf.shape[0] else self._target(need, self.capacity)
        like = self.current_tensor_meta()
        row = _row_numel(like) * like.element_size()
        return cap * row


# ------------------------------------------------------------------------------------------ buffer reuse
_use_count = getattr(torch._C, "_storage_Use_Count", None)  # private; without it nothing is kept
#: The buffers kept (``reuse_bytes``): [base tensor, :func:`_storage_uses` when only the pool held it].
_pool: list[list[object]] = []
_pool_lock = threading.Lock()


def _storage_uses(t: torch.Tensor) -> tuple[int, int] | None:
    """Who uses ``t``'s storage: the tensors over it (its use count) and the holders of its Python object (a consumer
    may keep only ``view.untyped_storage()``: torch hands that same object out again, so the use count alone does not
    show it). None for a storage moved to shared memory (``share_memory_``, torch's multiprocessing pickler): another
    process may read it, which no count here shows, so it is never given to another request."""
    st = t.untyped_storage()
    if st.is_shared():
        return None
    return int(_use_count(st._cdata)), sys.getrefcount(st)  # type: ignore[misc]


def _new_buffer(cap: int, bound: int, like: torch.Tensor, budget: int) -> torch.Tensor | None:
    """A buffer of ``cap`` rows shaped like ``like``'s rows: the first ``cap`` rows of a kept one nothing else
    uses (one of ``cap`` to ``bound`` rows, so a small request does not pin a much larger buffer), else a new
    one that the pool keeps too while ``budget`` allows (kept ones nothing uses are dropped to make room).
    None: allocate as usual."""
    if _use_count is None or like.device.type != "cpu" or like.is_quantized or like.layout is not torch.strided:
        return None
    shape = tuple(like.shape[1:])
    with _pool_lock:
        _pool[:] = [e for e in _pool if not e[0].untyped_storage().is_shared()]  # type: ignore[attr-defined]
        free = [e for e in _pool if _storage_uses(e[0]) == e[1]]  # type: ignore[arg-type]
        for e in free:
            base: torch.Tensor = e[0]  # type: ignore[assignment]
            if base.dtype == like.dtype and tuple(base.shape[1:]) == shape and cap <= base.shape[0] <= max(cap, bound):
                return base[:cap]  # an alias of the rows asked for: capacity and bytes as for a new buffer
        nbytes = cap * _row_numel(like) * like.element_size()
        if nbytes > budget:
            return None
        held = sum(e[0].nbytes for e in _pool)  # type: ignore[attr-defined]
        if held - sum(e[0].nbytes for e in free) + nbytes > budget:  # type: ignore[attr-defined]
            return None  # no room even without the unused ones: keep them for a request they fit
        for e in free:  # make room: kept buffers nothing uses go first
            if held + nbytes <= budget:
                break
            _pool[:] = [x for x in _pool if x is not e]  # by identity (== on tensors compares values)
            held -= e[0].nbytes  # type: ignore[attr-defined]
        if held + nbytes > budget:
            return None
        base = torch.empty((cap, *shape), dtype=like.dtype, device=like.device)
        _pool.append([base, _storage_uses(base)])
        return base[:cap]


def kept_bytes() -> int:
    """Bytes of the buffers this process keeps for reuse (``reuse_bytes``)."""
    with _pool_lock:
        return sum(e[0].nbytes for e in _pool)  # type: ignore[attr-defined]


def drop_kept() -> None:
    """Forget every kept buffer (the ones still in use are freed when their users let go)."""
    with _pool_lock:
        _pool.clear()


def _raw_copy_target(buf: torch.Tensor) -> tuple[int, int]:
    """``(data address, bytes per row)`` of a buffer whose rows can be written with memmove, else ``(0, 0)``.

    Only a plain contiguous CPU buffer of a real, non-quantized dtype qualifies (complex tensors may
    carry a lazy conjugate bit that raw bytes would lose); anything else takes torch's copy.
    """
    if (
        buf.device.type != "cpu"
        or buf.dtype.is_complex
        or buf.is_quantized
        or not buf.is_contiguous()
        or buf.numel() == 0
    ):
        return 0, 0
    return buf.data_ptr(), _row_numel(buf) * buf.element_size()


def _row_numel(t: torch.Tensor) -> int:
    n = 1
    for d in t.shape[1:]:
        n *= int(d)
    return n


class Prealloc(Strategy):
    name = "prealloc"
    Params = Params

    def new_accumulator(self, key: KeyInfo) -> PreallocAccumulator:
        return PreallocAccumulator(key, self.params)  # type: ignore[arg-type]


@hookimpl
def omni_accum_register_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="prealloc",
            factory=Prealloc,
            params_model=Params,
            kinds=frozenset({"append"}),
            description="growable contiguous buffer: amortised O(1) append, zero-copy prefix view",
            params_grid=({"growth_factor": 1.5}, {"growth_factor": 2.0}, {"growth_factor": 4.0}),
        )
    ]
