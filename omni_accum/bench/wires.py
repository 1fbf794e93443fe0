"""Wires of the replay engine: what carries a wire payload from sender to receiver, and payload helpers.

A :class:`Wire` carries wire payloads (``inproc``, ``serializer``, ``shm``); :data:`WIRES` maps
names to factories. ``serializer`` and ``shm`` are vllm-omni 0.30.0's real ``OmniSerializer`` and
``SharedMemoryConnector`` (imported lazily, through :mod:`omni_accum.integrations.vllm_omni.classes`).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch

from omni_accum.errors import OmniAccumError
from omni_accum.integrations.vllm_omni.classes import serializer, shm_connector

WireName = Literal["inproc", "serializer", "shm"]


# ---------------------------------------------------------------------------------------------- #
# Payload helpers
# ---------------------------------------------------------------------------------------------- #


def payload_nbytes(obj: Any) -> int:
    """Bytes a payload would occupy on a wire without framing: tensor data, 8 per scalar, string length."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(payload_nbytes(v) + (len(k) if isinstance(k, str) else 8) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return sum(payload_nbytes(v) for v in obj)
    if isinstance(obj, (str, bytes, bytearray)):
        return len(obj)
    return 8


def iter_leaves(payload: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """``(path, value)`` of every leaf of a payload (one level of groups, as vllm-omni nests)."""
    for top, value in payload.items():
        if isinstance(value, Mapping):
            for qual, v in value.items():
                yield f"{top}.{qual}", v
        else:
            yield str(top), value


def _get(view: Mapping[str, Any], path: str) -> Any:
    top, _, qual = path.partition(".")
    if qual and top in view and isinstance(view[top], Mapping):
        return view[top][qual]
    return view[path]


def _has(view: Mapping[str, Any], path: str) -> bool:
    top, _, qual = path.partition(".")
    if qual:
        group = view.get(top)
        return isinstance(group, Mapping) and qual in group
    return path in view


# ---------------------------------------------------------------------------------------------- #
# Wires
# ---------------------------------------------------------------------------------------------- #


class Wire(ABC):
    """Carries one wire payload from the sender to the receiver."""

    name: str = ""

    @abstractmethod
    def carry(self, key: str, payload: Mapping[str, Any]) -> tuple[Mapping[str, Any], int | None]:
        """Return ``(payload as received, bytes on the wire)``; ``key`` is unique per chunk. Bytes None: the
        wire has no count of its own, the caller counts :func:`payload_nbytes` of the payload (outside its clock)."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release every resource (shared-memory segments, lock files)."""


class InprocWire(Wire):
    """No serialization: the receiver gets the sender's objects; bytes are :func:`payload_nbytes`, which the
    caller counts outside its clock (bytes None: the walk costs about as much as the wire-floor step itself)."""

    name = "inproc"

    def carry(self, key: str, payload: Mapping[str, Any]) -> tuple[Mapping[str, Any], int | None]:
        return payload, None


class SerializerWire(Wire):
    """vllm-omni's real ``OmniSerializer`` encode and decode (msgpack, a copy per tensor)."""

    name = "serializer"

    def __init__(self) -> None:
        self._ser = serializer()

    def carry(self, key: str, payload: Mapping[str, Any]) -> tuple[Mapping[str, Any], int]:
        blob = self._ser.serialize(payload)
        return self._ser.deserialize(blob), len(blob)


class ShmWire(Wire):
    """vllm-omni's real ``SharedMemoryConnector``: ``put`` (segment + lock file) then ``get`` (unlinks both)."""

    name = "shm"

    def __init__(self) -> None:
        cls = shm_connector()
        self._tx = cls({"stage_id": 0})
        self._rx = cls({"stage_id": 1})
        self._prefix = f"omniaccum_{os.getpid()}_{id(self):x}"

    def carry(self, key: str, payload: Mapping[str, Any]) -> tuple[Mapping[str, Any], int]:
        put_key = f"{self._prefix}_{key}"
        ok, size, _meta = self._tx.put("0", "1", put_key, payload)
        if not ok:
            raise OmniAccumError(f"SharedMemoryConnector.put failed for key {put_key!r} (see the vllm-omni log)")
        got = self._rx.get("0", "1", put_key)
        if got is None:
            self._tx.cleanup(put_key)
            raise OmniAccumError(f"SharedMemoryConnector.get found nothing for key {put_key!r}")
        return got[0], size

    def close(self) -> None:
        self._tx.close()
        self._rx.close()


WIRES: dict[str, Callable[[], Wire]] = {"inproc": InprocWire, "serializer": SerializerWire, "shm": ShmWire}


def make_wire(name: str) -> Wire:
    factory = WIRES.get(name)
    if factory is None:
        raise OmniAccumError(f"unknown wire {name!r}. Available: {', '.join(WIRES)}")
    return factory()
