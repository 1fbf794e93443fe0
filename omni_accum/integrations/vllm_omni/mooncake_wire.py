"""The wire format of :class:`.mooncake_connector.MooncakeFastConnector`'s tensor fast path.

A payload goes as vllm-omni 0.30.0's serialized message (its msgpack encoder and decoder) in which each tensor
taken off the serializer is replaced by a reference: vllm-omni's tensor dict (``dtype``, ``shape``) with, under
:data:`IN_STORE`, the list of its parts ``[[part key, bytes], ...]``. Each part is an object of its own in the
store, keyed ``<chunk key>#oa<nonce>.<tensor>.<part>`` (:data:`PART_SEP`), its bytes a slice of the tensor's. The
receiver's :class:`Decoder` allocates each referenced tensor and lists the parts to read into it; a reference that
names another key's parts, too many parts, or parts that do not add up to the tensor's bytes is refused.

:class:`Buffer` is a staging buffer registered with the store (``register_buffer``), one per direction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy
import torch
from vllm_omni.distributed.omni_connectors.utils import serialization as _ser

from omni_accum.arena._common import DTYPES
from omni_accum.integrations.vllm_omni.arena_chains import tensor_ref

#: Key of a tensor's wire dict (vllm-omni's tensor encoding) listing its parts: ``[[part key, bytes], ...]``.
IN_STORE = "__omni_accum_mooncake__"
#: The separator of a part's key from its chunk's key (``<chunk key>#oa<nonce>.<tensor>.<part>``).
PART_SEP = "#oa"
#: At most this many parts per tensor are read (a reference naming more is malformed).
MAX_PARTS = 1 << 16


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a CPU contiguous tensor, as a flat uint8 tensor over the same memory."""
    return t.reshape(-1).view(torch.uint8)


class Encoder(_ser.OmniMsgpackEncoder):
    """vllm-omni's payload encoding; a tensor in ``parts`` (by id) becomes a reference to its parts."""

    def __init__(self, parts: dict[int, tuple[torch.Tensor, list[list[Any]]]]) -> None:
        super().__init__()
        self.parts = parts  # id(tensor) -> (its CPU contiguous copy or itself, [[part key, bytes], ...])

    def _encode_tensor(self, tensor: torch.Tensor) -> dict[str, Any]:
        hit = self.parts.get(id(tensor))
        if hit is None:
            return super()._encode_tensor(tensor)
        return tensor_ref(hit[0], list(tensor.shape), IN_STORE, hit[1])


class Decoder(_ser.OmniMsgpackDecoder):
    """vllm-omni's payload decoding; a referenced tensor comes out allocated, its parts to read in ``todo``."""

    def __init__(self) -> None:
        super().__init__()
        self.prefix = ""
        self.todo: list[tuple[torch.Tensor, list[tuple[str, int]]]] = []

    def _decode_tensor(self, obj: dict[str, Any]) -> torch.Tensor:
        parts = obj.get(IN_STORE)
        if parts is None:
            return super()._decode_tensor(obj)
        dtype, shape = DTYPES.get(obj.get("dtype")), obj.get("shape")
        if dtype is None or not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"a tensor reference of dtype {obj.get('dtype')!r}, shape {shape!r}")
        numel = 1
        for n in shape:
            numel *= n
        if not isinstance(parts, list) or not 0 < len(parts) <= MAX_PARTS:
            raise ValueError("a tensor reference without its parts")
        checked: list[tuple[str, int]] = []
        for p in parts:
            if not (isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and type(p[1]) is int and p[1] > 0):
                raise ValueError(f"a part {str(p)[:80]!r} is not [key, bytes]")
            if not p[0].startswith(self.prefix):
                raise ValueError(f"a part {p[0][:80]!r} is not one of this key's")
            checked.append((p[0], p[1]))
        if sum(n for _, n in checked) != numel * dtype.itemsize:
            raise ValueError(f"the parts of a {obj['dtype']} tensor of shape {shape} do not add up to its bytes")
        t = torch.empty(shape, dtype=dtype)
        self.todo.append((t, checked))
        return t


class Buffer:
    """A staging buffer registered with the store (``register_buffer``), unregistered by :meth:`close`."""

    def __init__(self, store: Any, nbytes: int) -> None:
        self.store = store
        self.mem = torch.empty(nbytes, dtype=torch.uint8)
        self.ptr = self.mem.data_ptr()
        self.nbytes = nbytes
        rc = store.register_buffer(self.ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"register_buffer({nbytes} bytes) returned {rc}")

    def close(self) -> None:
        if self.store is not None:
            try:
                self.store.unregister_buffer(self.ptr)
            finally:
                self.store = None


class PartsLost(RuntimeError):
    """A part listed by a payload's key is not in the store (evicted, removed): the chunk cannot be delivered."""

    def __init__(self, part: str, nbytes: int) -> None:
        super().__init__(f"part {part} ({nbytes} bytes) is not in the store (evicted or removed)")
        self.part = part


def read_parts(store: Any, buf: Buffer | None, todo: list[tuple[torch.Tensor, list[tuple[str, int]]]],
               register: Callable[[torch.Tensor], bool],
               unregister: Callable[[torch.Tensor], None]) -> tuple[int, int]:  # fmt: skip
    """Read the parts ``todo`` lists (a :class:`Decoder`'s) into their tensors; return the bytes read and how many
    parts were read the plain way (below).

    Parts go through ``buf`` (``batch_get_into`` a buffer-full at a time, then one copy each); a tensor larger than
    the buffer (or any tensor, when there is no buffer: ``buf`` None, its registration failed) that ``register``
    accepts is read straight into its own memory (``unregister`` after). A part that cannot be read through registered
    memory (no buffer and the tensor not registrable, or ``batch_get_into`` failing for it) is read with the store's
    plain ``get`` (through the client's own registered buffer, ``localbuf``) and copied into its tensor: the same
    bytes. A part the store does not have raises :class:`PartsLost` naming it; one it has but does not return whole
    raises ``RuntimeError`` naming it."""
    plan = []  # (part key, destination bytes, offset, length): through the staging buffer
    plain = []  # the same, read with the store's plain get
    total = 0
    for t, parts in todo:
        flat = bytes_of(t)
        offs = [0]
        for _, ln in parts[:-1]:
            offs.append(offs[-1] + ln)
        if (buf is None or flat.numel() > buf.nbytes) and register(flat):
            # read straight into the tensor's own (registered) memory
            try:
                got = store.batch_get_into([pk for pk, _ in parts], [flat.data_ptr() + o for o in offs],
                                           [ln for _, ln in parts])  # fmt: skip
            finally:
                unregister(flat)
            plain += [(pk, flat, o, ln) for (pk, ln), o, rc in zip(parts, offs, got) if rc != ln]
            total += flat.numel()
            continue
        for (pk, ln), o in zip(parts, offs):
            (plan if buf is not None and ln <= buf.nbytes else plain).append((pk, flat, o, ln))
            if buf is None or ln > buf.nbytes:
                total += ln
    k = 0
    while k < len(plan):
        assert buf is not None  # only parts that fit it are planned
        batch, used = [], 0
        while k < len(plan) and used + plan[k][3] <= buf.nbytes:
            batch.append((plan[k], used))
            used += plan[k][3]
            k += 1
        got = store.batch_get_into([p[0] for p, _ in batch], [buf.ptr + u for _, u in batch],
                                   [p[3] for p, _ in batch])  # fmt: skip
        for ((pk, flat, off, ln), u), rc in zip(batch, got):
            if rc != ln:
                plain.append((pk, flat, off, ln))
                continue
            flat[off : off + ln].copy_(buf.mem[u : u + ln])
        total += used
    missing = []
    for pk, flat, off, ln in plain:
        data = store.get(pk)
        if data is not None and len(data) == ln:
            flat[off : off + ln].numpy()[:] = numpy.frombuffer(data, dtype=numpy.uint8)
        else:
            missing.append((pk, ln, 0 if data is None else len(data)))
    if missing:
        there = store.batch_is_exist([pk for pk, _, _ in missing])
        for (pk, ln, n), e in zip(missing, there):
            if e == 0:
                raise PartsLost(pk, ln)
        pk, ln, n = missing[0]
        raise RuntimeError(f"part {pk} ({ln} bytes) is in the store but could not be read ({n} bytes came)")
    return total, len(plain)
