"""vllm-omni 0.16: the accumulated payload crosses to the model runner as new rows, not whole, every step.

0.16.0's scheduler attaches every running request's whole ``additional_information`` to each step's
``SchedulerOutput`` (``OmniChunkTransferAdapter.postprocess_scheduler_output`` ->
``attach_cached_additional_information``), and the multiprocessing executor (``distributed_executor_backend:
mp``, what vllm-omni's Qwen3-Omni deploy files set) pickles that output to the worker process: on the talker,
``thinker_embeddings [P+t, 2048]`` every decode step, on top of the adapter's own ``torch.cat``. torch pickles a
tensor's whole *storage*, so a ``prealloc`` view (``buffer[:rows]`` of a buffer of ``growth_factor x`` the rows)
would cross with its spare capacity: twice the bytes of ``off`` per step. That is what made the ``qwen3-omni``
preset slower than ``off`` on a 0.16.0 server (talker time per token ~1.5x).

Here, after 0.16.0 has built the step's output, a tensor of a request's ``additional_information`` whose storage
holds more than its rows (a view omni-accum handed over) is replaced by a small picklable stand-in:

* :class:`RowsFull` the first time (and after the buffer moved): the tensor's own bytes only, out of band when the
  pickler takes protocol 5 buffers (vLLM's message queue does: no copy into the pickle); the worker rebuilds the
  tensor and remembers it under ``(request id, key)``;
* :class:`RowsDelta` afterwards, while the scheduler's tensor is the same buffer grown at the end (same storage,
  offset, dtype and row shape, at least as many rows): only the rows the worker has not seen; the worker appends
  them to what it remembers, in a buffer of its own that grows by doubling, and hands over the prefix.

Unpickling a stand-in *returns a plain tensor*, so 0.16.0's runner (``_update_request_information``: ``dict.update``)
and the model see exactly what they saw before, bit for bit: the rows of the ``torch.cat`` of the chunks. Nothing
of the runner is wrapped. The scheduler holds the last tensor it shipped per request and key (on the request
object: gone with it), which keeps that buffer alive, so a new buffer can never take its address; the worker holds
only a weak reference to what it handed over (its request state owns it), so nothing outlives a request there.

Only with an executor that pickles the output to another process (``mp``, ``ray``); with ``uni`` the runner gets the
scheduler's objects as they are and nothing is changed. A tensor whose storage is its own (``cat``, the ``default``
policy) is left to torch's pickling: ``default`` sends exactly what 0.16.0 sends.
"""

from __future__ import annotations

import functools
import logging
import pickle
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from omni_accum.errors import AccumulationError
from omni_accum.integrations.vllm_omni import whole_payload
from omni_accum.integrations.vllm_omni.binding import binding_for

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger("omni_accum.vllm_omni")

#: Executors that pickle the scheduler's output to the worker processes.
SERIALIZING_BACKENDS = ("mp", "ray")
#: Instance attribute of an adapter: its stage's executor pickles the scheduler output (set at construction).
SERIALIZING_ATTR = "_omni_accum_serializing_executor"
#: Request attribute (scheduler side): ``{key: tensor}``, the last tensor shipped as a stand-in per key.
SHIPPED_ATTR = "_omni_accum_shipped_rows"
#: The counters of a binding's ``stats`` this module keeps.
STATS = ("runner_full", "runner_delta", "runner_bytes_saved")


class RunnerRowsError(AccumulationError):
    """The worker got rows to append to a tensor it does not hold (or holds at another length)."""


# ---------------------------------------------------------------------------------------------- #
# The stand-ins (built on the scheduler, unpickled on the worker)
# ---------------------------------------------------------------------------------------------- #


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).rpartition(".")[2]


def _raw(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's bytes as a flat uint8 array (no copy). (Through numpy, which a vLLM process, where this runs,
    has it: omni-accum's core does not depend on it, and ``omni-accum`` imports this module.)"""
    return t.reshape(-1).view(torch.uint8).numpy()


class RowsFull:
    """A whole tensor, its rows only; the worker remembers it for the deltas that follow."""

    __slots__ = ("req_id", "key", "tensor")

    def __init__(self, req_id: str, key: str, tensor: torch.Tensor) -> None:
        self.req_id, self.key, self.tensor = req_id, key, tensor

    def __reduce_ex__(self, protocol: int) -> tuple[Any, ...]:
        raw = _raw(self.tensor)
        data: Any = pickle.PickleBuffer(raw) if protocol >= 5 else raw.tobytes()
        return (_rebuild_full, (self.req_id, self.key, _dtype_name(self.tensor.dtype), tuple(self.tensor.shape), data))


class RowsDelta:
    """The rows ``start:`` of a tensor whose first ``start`` rows the worker holds."""

    __slots__ = ("req_id", "key", "start", "rows")

    def __init__(self, req_id: str, key: str, start: int, rows: torch.Tensor) -> None:
        self.req_id, self.key, self.start, self.rows = req_id, key, start, rows

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_delta, (self.req_id, self.key, self.start, self.rows))


# Worker side: (request id, key) -> [weak reference to the tensor handed over, its buffer or None].
_held: dict[tuple[str, str], list[Any]] = {}
_held_lock = threading.Lock()


def _remember(req_id: str, key: str, tensor: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    slot = (req_id, key)

    def gone(ref: weakref.ref[torch.Tensor]) -> None:
        with _held_lock:
            entry = _held.get(slot)
            if entry is not None and entry[0] is ref:
                del _held[slot]

    with _held_lock:
        _held[slot] = [weakref.ref(tensor, gone), buf]
    return tensor


def _rebuild_full(req_id: str, key: str, dtype: str, shape: tuple[int, ...], data: Any) -> torch.Tensor:
    # The bytes may be a view of the message queue's ring (reused after this step): copied once, here.
    import numpy as np  # noqa: PLC0415 - see _raw

    flat = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    return _remember(req_id, key, flat.view(getattr(torch, dtype)).reshape(shape), None)


def _rebuild_delta(req_id: str, key: str, start: int, rows: torch.Tensor) -> torch.Tensor:
    with _held_lock:
        entry = _held.get((req_id, key))
    held = entry[0]() if entry is not None else None
    if held is None or held.shape[0] != start:
        have = "nothing" if held is None else f"{held.shape[0]} rows"
        raise RunnerRowsError(
            f"omni-accum: the model runner got rows {start}..{start + rows.shape[0]} of {key!r} for request {req_id!r} "
            f"but holds {have} of it; the scheduler and this worker disagree (set OMNI_ACCUM_VLLM_OMNI=0 and report it)"
        )
    n = start + rows.shape[0]
    buf = entry[1]
    if buf is None or buf.shape[0] < n or held.data_ptr() != buf.data_ptr():
        buf = torch.empty((max(2 * n, 64), *held.shape[1:]), dtype=held.dtype, device=held.device)
        buf[:start].copy_(held)
    buf[start:n].copy_(rows)
    return _remember(req_id, key, buf[:n], buf)


def held_count() -> int:
    """How many (request, key) tensors this worker process remembers (tests, diagnostics)."""
    with _held_lock:
        return len(_held)


# ---------------------------------------------------------------------------------------------- #
# Scheduler side
# ---------------------------------------------------------------------------------------------- #


def _spare(t: torch.Tensor) -> bool:
    """``t`` is a dense CPU tensor of rows whose storage holds more bytes than it shows."""
    return (
        t.device.type == "cpu"
        and t.dim() >= 1
        and t.numel() > 0
        and t.is_contiguous()
        and t.untyped_storage().nbytes() > t.numel() * t.element_size()
    )


def _continues(last: torch.Tensor, t: torch.Tensor) -> bool:
    """``t`` is ``last``'s buffer grown at the end: its first ``len(last)`` rows are ``last``'s rows (``last`` is
    held alive by the caller, so an equal data pointer is the same storage)."""
    return (
        t.dtype == last.dtype
        and t.dim() == last.dim()
        and t.shape[1:] == last.shape[1:]
        and t.shape[0] >= last.shape[0]
        and t.is_contiguous()
        and t.untyped_storage().data_ptr() == last.untyped_storage().data_ptr()
        and t.storage_offset() == last.storage_offset()
    )


def outgoing(stats: dict[str, int], request: Any, req_id: str, info: dict[str, Any], *, fresh: bool) -> dict[str, Any]:
    """The dict to ship for one request's ``additional_information`` (``info`` itself when nothing changes; the
    request's live dict is never modified). ``fresh``: the worker may hold nothing of it (a new or resumed request)."""
    shipped: dict[str, torch.Tensor] = request.__dict__.setdefault(SHIPPED_ATTR, {})
    if fresh:
        shipped.clear()
    out: dict[str, Any] | None = None
    for key, value in info.items():
        if not isinstance(value, torch.Tensor) or not isinstance(key, str):
            continue
        last = shipped.get(key)
        if last is not None and _continues(last, value):
            start = last.shape[0]
            stand_in: Any = RowsDelta(req_id, key, start, value[start:].clone())
            stats["runner_delta"] += 1
            stats["runner_bytes_saved"] += start * value[:1].numel() * value.element_size()
        elif _spare(value):
            stand_in = RowsFull(req_id, key, value)
            stats["runner_full"] += 1
            stats["runner_bytes_saved"] += value.untyped_storage().nbytes() - value.numel() * value.element_size()
        else:
            shipped.pop(key, None)  # torch's pickling: the worker remembers nothing of this key
            continue
        shipped[key] = value
        if out is None:
            out = dict(info)
        out[key] = stand_in
    return info if out is None else out


def ship_rows(stats: dict[str, int], scheduler_output: Any, requests: dict[str, Any]) -> None:
    """Replace, in one step's output, the spare-capacity tensors of every scheduled request's
    ``additional_information`` by stand-ins (new requests' and cached requests' alike)."""
    for nr in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        info, request = getattr(nr, "additional_information", None), requests.get(getattr(nr, "req_id", None))
        if isinstance(info, dict) and request is not None:
            nr.additional_information = outgoing(stats, request, nr.req_id, info, fresh=True)
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    infos = getattr(cached, "additional_information", None)
    if not isinstance(infos, dict):
        return
    resumed = set(getattr(cached, "resumed_req_ids", None) or ())
    for req_id, info in list(infos.items()):
        request = requests.get(req_id)
        if isinstance(info, dict) and request is not None:
            infos[req_id] = outgoing(stats, request, req_id, info, fresh=req_id in resumed)


def serializing(vllm_config: Any) -> bool:
    """The stage's executor pickles the scheduler output to its workers."""
    backend = getattr(getattr(vllm_config, "parallel_config", None), "distributed_executor_backend", None)
    return isinstance(backend, str) and backend in SERIALIZING_BACKENDS


def wrap_init(probe: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[..., Any]:
    """The adapter's constructor: ``probe``'s wrapper, plus whether the stage's executor pickles its output."""

    def wrap(orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
            self.__dict__[SERIALIZING_ATTR] = serializing(vllm_config)
            orig(self, vllm_config, *args, **kwargs)

        return probe(__init__)

    return wrap


def wrap_postprocess(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def postprocess_scheduler_output(self: Any, scheduler_output: Any, requests: Any = None) -> Any:
        result = orig(self, scheduler_output, requests)
        b = binding_for(self) if isinstance(requests, dict) else None
        if b is None:
            return result
        whole_payload.compact_ended(b, self)  # the requests the scheduler let go (0.16.0 never releases them)
        whole_payload.track_ends(b, self, requests)
        if self.__dict__.get(SERIALIZING_ATTR):
            for name in STATS:
                b.stats.setdefault(name, 0)
            ship_rows(b.stats, scheduler_output, requests)
        return result

    return postprocess_scheduler_output

