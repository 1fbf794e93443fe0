"""The Qwen3-Omni async-chunk thinker-to-talker stage input processor: its prefill accumulation under the policy.

Under chunked prefill (stage 0 ``max_num_batched_tokens`` below the prompt length) vllm-omni's
``thinker2talker_async_chunk`` (``stage_input_processors/qwen3_omni.py``, the same in 0.28.0 and
0.30.0) holds the first chunk's payload in ``transfer_manager.request_payload`` and ``torch.cat``\\ s
``embed.prefill`` and ``hidden_states.output`` again for every prefill chunk until the rows exceed the
prompt: quadratic in the number of chunks. The wrapper (:func:`wrap_processor`) gives those two keys
the strategies the sending binding's policy names for them (the same key paths as everywhere):

* both append-kind and neither ``cat`` (``prealloc`` under the ``qwen3-omni`` preset): the chunks go
  into the strategies' accumulators (``prealloc``: one buffer of the prompt's rows + 1, the rows the
  processor hands over, so every chunk's rows are copied once, each as it comes: the first chunk's too,
  which ``prealloc`` would otherwise hold by reference until the next append. Without chunked prefill
  that first chunk is the whole prompt, and the release holds it until the thinker's first decode step:
  its copy is then made while the thinker computes that step, not after it, and the hand-over copies
  one row), and the payload handed over carries their views (``prealloc``: the filled rows of that
  buffer, no final copy), equal to the ``torch.cat`` bit for bit. The rest of the payload is the
  release's own, built by its own function;
* anything else (``default``: ``cat``): the release's own function, untouched.

vllm-omni looks the processor up by its dotted path when an adapter or runner transport is made;
activation wraps the module attribute, and an instance made before the wrappers were installed (the
one whose connector extra installs them) gets the wrapper in its own attribute (:func:`adopt`).

While omni-accum accumulates a request, its entry in ``request_payload`` is a :class:`_Held` (so the
adapter's own clean-up, which pops that entry, frees it); any failure turns it into the release's
own entry (the ``torch.cat`` of the chunks so far) and runs the release's function, counted in
``omni_accum_fallbacks_total{reason="processor_refused"|"processor_error"}``. The policy's
``max_bytes_per_request`` is the Receiver's guard here too: a chunk that would make the two keys'
accumulators hold more for the request (``prealloc``: its buffer of the prompt's rows + 1, at the first
chunk) is refused before the strategy allocates, and the release's code takes the request from there
(``processor_refused``, logged once per request). The strategies are selected in the tuned bucket the
sender's handshake decides for the request (the prompt length, the requests live on the sending adapter:
:func:`.handshake.live_requests`). Per request, the time
spent in the processor over its prefill chunks and the bytes its accumulation copied are published as
``omni_accum_processor_merge_seconds{stage,strategy}`` and ``omni_accum_processor_bytes_copied_total``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from omni_accum.errors import AccumulationError, MergeError, OmniAccumError
from omni_accum.integrations.vllm_omni import instances
from omni_accum.integrations.vllm_omni import prometheus
from omni_accum.integrations.vllm_omni.binding import Binding, binding_for, published_later
from omni_accum.integrations.vllm_omni.binding_settings import Settings
from omni_accum.integrations.vllm_omni.processor_choice import (
    KEYS,
    UPSTREAM,
    accumulator,
    guard,
    owned_nbytes,
    owns,
    select,
)
from omni_accum.strategy import value_nbytes

logger = logging.getLogger("omni_accum.vllm_omni")

#: Instance attributes vllm-omni keeps the resolved processor in (the adapter's, a runner transport's).
_ATTRS = ("custom_process_next_stage_input_func", "_custom_process_func")
_MAX_TIMED = 4096  # requests timed under the release's own code at once (an aborted one leaves a float)
_warned: set[tuple[int, str]] = set()


class _Held(dict):
    """``request_payload[rid]`` while omni-accum accumulates ``rid``: empty as a dict (only this module
    reads it; :func:`_to_upstream` turns it into the release's entry), with the per-key accumulators and
    their rows, the latest chunk's payload (its other keys), the time spent and the bytes copied so far."""

    __slots__ = ("accs", "rows", "last", "seconds", "copied", "strategy", "specs")

    def __init__(self, accs: list[tuple[str, Any]], rows: list[int], last: Any, strategy: str) -> None:
        super().__init__()
        self.accs, self.rows, self.last, self.strategy = accs, rows, last, strategy
        self.seconds, self.copied = 0.0, 0
        self.specs: list[Any] = []  # the keys' strategy specs (the byte guard names them)


def _stage(tm: Any) -> str:
    sid = getattr(getattr(tm, "connector", None), "stage_id", None)
    if sid is None:
        sid = getattr(tm, "_stage_id", None)
    return str(sid) if sid is not None else "unknown"


def _probe_value(mm: Any) -> Any:
    """The embedding layer's tensor of a thinker output (layer 0: what ``embed.prefill`` takes), else None."""
    hs = mm.get("hidden_states") if isinstance(mm, Mapping) else None
    layers = hs.get("layers") if isinstance(hs, Mapping) else None
    if not isinstance(layers, Mapping):
        return None
    value = layers.get(0)
    if value is None:
        value = layers.get("0")
    return value if isinstance(value, torch.Tensor) else None


def _storage(t: Any) -> int:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else 0


def _rows(value: Any) -> int:
    return int(value.shape[0]) if isinstance(value, torch.Tensor) and value.dim() else 0


def _in_arena(tm: Any, rid: str, path: str, value: Any, rows: int) -> torch.Tensor | None:
    """A buffer of ``rows`` rows for ``path`` in the arena slab the adapter's next put of ``rid`` appends to
    (``OmniAccumArenaConnector.stage_rows``), else None: the accumulator's own memory."""
    connector = getattr(tm, "connector", None)
    stage_rows = getattr(connector, "stage_rows", None)
    sid = getattr(connector, "stage_id", None)
    if stage_rows is None or not isinstance(sid, int) or not isinstance(value, torch.Tensor) or not value.is_cpu:
        return None
    return stage_rows(str(sid), str(sid + 1), rid, path, value.dtype, tuple(value.shape[1:]), rows)


def _start(b: Binding, chosen: list[tuple[str, Any, Any]], rid: str, out: Any, tm: Any = None) -> _Held:
    final = len(out.ids.prompt) + 1  # the rows handed over: the prompt's, then the first decode step's
    values = [getattr(getattr(out, group), key) for group, key in KEYS]
    specs = [spec for _, _, spec in chosen]
    accs = [(path, accumulator(b, strategy, spec.name, path, rid, final)) for path, strategy, spec in chosen]
    limit = b.policy.max_bytes_per_request
    if limit:  # the first merge's bytes, before it
        guard(limit, rid, specs, accs, [(0, acc.projected_nbytes(v)) for (_, acc), v in zip(accs, values)])
    for (_, acc), value in zip(accs, values):
        acc.merge(value)
    if limit:  # then the buffer own() copies the chunk into, before it is allocated
        guard(limit, rid, specs, accs, [(acc.nbytes(), owned_nbytes(acc, v)) for (_, acc), v in zip(accs, values)])
    copied = 0
    for (path, acc), value in zip(accs, values):
        own = getattr(acc, "own", None)
        if own is not None:  # prealloc: the rows go into the buffer now, not at the first decode step ...
            # ... and over the arena connector, into the slab the put will announce (the put copies none)
            copied += own(_in_arena(tm, rid, path, value, final) if owns(value) else None)
    held = _Held(accs, [_rows(v) for v in values], out, specs[0].name)
    held.specs, held.copied = specs, copied
    return held


def _append(held: _Held, out: Any, limit: int = 0, rid: str = "") -> int:
    """Append this chunk's rows of both keys (checked first, and against ``limit``, the policy's
    ``max_bytes_per_request`` for request ``rid``: both or neither). Returns the bytes copied: the chunk's rows,
    and the rows held when the accumulator moved them (a new buffer)."""
    values = [getattr(getattr(out, g), k) for g, k in KEYS]
    for (_, acc), value in zip(held.accs, values):
        acc.check(value)
    if limit:
        sizes = [(acc.nbytes(), acc.projected_nbytes(value)) for (_, acc), value in zip(held.accs, values)]
        guard(limit, rid, held.specs, held.accs, sizes)
    copied = 0
    for i, ((_, acc), value) in enumerate(zip(held.accs, values)):
        before = _storage(acc.current_tensor_meta())
        acc.merge_checked(value)
        n = _rows(value)
        copied += value_nbytes(value)
        if n and _storage(acc.current_tensor_meta()) != before:
            copied += value_nbytes(value) // n * held.rows[i]
    for i, value in enumerate(values):  # both appended: the rows held move on together
        held.rows[i] += _rows(value)
    return copied


def _views(held: _Held) -> tuple[list[torch.Tensor], int]:
    """The consumer's tensors (contiguous, equal to the ``torch.cat`` of the chunks) and the bytes a read
    copied (a strategy whose read concatenates; ``prealloc``'s view is its buffer's filled rows: none)."""
    views, copied = [], 0
    for _, acc in held.accs:
        view = acc.read()
        if not isinstance(view, torch.Tensor):
            raise AccumulationError(f"the view is a {type(view).__name__}, not a tensor")
        if not view.is_contiguous():
            view = view.contiguous()
        if _storage(view) != _storage(acc.current_tensor_meta()):
            copied += value_nbytes(view)
        views.append(view)
    return views, copied


def _to_upstream(held: _Held) -> dict[str, Any]:
    """The release's own ``request_payload`` entry for what ``held`` holds: ``to_dict`` of the latest chunk's
    payload with the two keys' ``torch.cat`` so far (the accumulators' views, bit for bit, cut to the rows
    both keys took: an append that failed half-way leaves no row of its chunk behind)."""
    from vllm_omni.data_entry_keys import to_dict

    entry = to_dict(held.last)
    for (group, key), (_, acc), rows in zip(KEYS, held.accs, held.rows):
        entry.setdefault(group, {})[key] = acc.read()[:rows]
    return entry


def held_nbytes(store: dict[str, Any]) -> int:
    """Bytes the accumulators of ``store``'s requests in prefill hold (the held-bytes gauge reads it on the
    publisher thread while the adapter's thread changes the store: a copy of its values, then what each holds)."""
    total = 0
    for held in list(store.values()):
        if isinstance(held, _Held):
            total += sum(acc.nbytes() for _, acc in held.accs)
    return total


def _give_back(store: dict[str, Any], rid: str) -> None:
    """Turn omni-accum's entry for ``rid`` (if any) into the release's own."""
    held = store.get(rid)
    if isinstance(held, _Held):
        dict.__setitem__(store, rid, _to_upstream(held))


def _fall_back(b: Binding | None, rid: Any, error: Exception) -> None:
    reason = "processor_refused" if isinstance(error, (OmniAccumError, MergeError)) else "processor_error"
    if b is not None:
        b.metrics.fallback(reason)
        published_later(b)
    else:
        prometheus.fallback(reason)
    key = (id(b), str(rid))
    if key not in _warned:
        if len(_warned) > _MAX_TIMED:
            _warned.clear()
        _warned.add(key)
        logger.warning(
            "omni-accum: the stage input processor's accumulation of request %r failed (%s: %s); vllm-omni's own "
            "processor handles it from here (not logged again for this request)",
            rid,
            type(error).__name__,
            error,
        )


def _observe(b: Binding, tm: Any, strategy: str, seconds: float, copied: int) -> None:
    if b.metrics.on:
        prometheus.processor_observe(_stage(tm), strategy, seconds, copied)


def _timed_upstream(b: Binding, orig: Callable[..., Any], args: tuple[Any, ...], rid: str, store: dict) -> Any:
    """The release's own processor (``cat``), timed per request for the metrics; the bytes copied are those of
    its ``torch.cat``\\ s (each one writes both keys' rows so far)."""
    timed = b.__dict__.setdefault("_omni_accum_processor_timed", {})
    before = store.get(rid)
    t0 = time.perf_counter()
    out = orig(*args)
    seconds, copied = timed.pop(rid, (0.0, 0))
    seconds += time.perf_counter() - t0
    after = store.get(rid)
    if out is not None:
        if before is not None:  # the release concatenated the held rows with this chunk's
            copied += sum(value_nbytes(getattr(getattr(out, g, None), k, None)) for g, k in KEYS)
            _observe(b, args[0], UPSTREAM, seconds, copied)
    elif after is not None:
        if before is not None and after is not before:
            copied += sum(value_nbytes(after.get(g, {}).get(k)) for g, k in KEYS)
        if len(timed) >= _MAX_TIMED:
            timed.pop(next(iter(timed)))
        timed[rid] = (seconds, copied)
    return out


def wrap_processor(orig: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of ``thinker2talker_async_chunk`` (see the module docstring)."""

    @functools.wraps(orig)
    def thinker2talker_async_chunk(
        transfer_manager: Any, multimodal_output: Any, request: Any, is_finished: bool = False
    ) -> Any:
        args = (transfer_manager, multimodal_output, request, is_finished)
        store = getattr(transfer_manager, "request_payload", None)
        b = binding_for(transfer_manager) if Settings.installed else None
        if b is None or not isinstance(store, dict):
            if isinstance(store, dict):
                _give_back(store, getattr(request, "external_req_id", None))  # uninstalled meanwhile
            return orig(*args)
        rid = request.external_req_id
        held = store.get(rid)
        try:
            if transfer_manager.put_req_chunk[rid] != 0:
                return orig(*args)
            if held is not None and not isinstance(held, _Held):  # the release's own entry: it goes on
                return _timed_upstream(b, orig, args, rid, store)
            chosen = None
            if held is None:
                value = _probe_value(multimodal_output)
                if value is None:
                    return orig(*args)  # no thinker layers: the release returns None
                chosen = select(b, value, len(request.prompt_token_ids), rid)
                if chosen is None:
                    return _timed_upstream(b, orig, args, rid, store)
        except Exception as e:  # noqa: BLE001 - a plugin never fails vllm-omni's processor
            _fall_back(b, rid, e)
            _give_back(store, rid)
            return orig(*args)
        t0 = time.perf_counter()
        if held is not None:
            dict.pop(store, rid)  # the release's function must see no entry (it builds this chunk alone)
        try:
            out = orig(transfer_manager, multimodal_output, request, True)  # this chunk's payload, stored nowhere
        except BaseException:
            if held is not None:
                dict.__setitem__(store, rid, held)
            raise
        if out is None:  # the release returns None before it touches its entry
            if held is not None:
                dict.__setitem__(store, rid, held)
            return None
        try:
            return _merge(b, store, rid, held, chosen, out, is_finished, t0, transfer_manager)
        except Exception as e:  # noqa: BLE001 - the release's own code takes the chunk
            _fall_back(b, rid, e)
            if held is not None:
                try:
                    dict.__setitem__(store, rid, _to_upstream(held))
                except Exception:  # noqa: BLE001 - a strategy that cannot even be read: the chunk starts afresh
                    logger.exception("omni-accum: request %r: the rows held cannot be read back", rid)
            return orig(*args)

    return thinker2talker_async_chunk


def _merge(
    b: Binding, store: dict, rid: str, held: _Held | None, chosen: Any, out: Any, is_finished: bool, t0: float, tm: Any
) -> Any:
    """One prefill chunk through the accumulators: None while the prompt is incomplete, else the payload with
    the two keys' views (the release's rule: rows above the prompt's, or the request finished)."""
    out.meta.finished = torch.tensor(is_finished, dtype=torch.bool)  # what the release's own call sets
    if held is None:
        if is_finished:  # a one-chunk request: handed over as it is, nothing accumulated
            return out
        held = _start(b, chosen, rid, out, tm)
        held.seconds += time.perf_counter() - t0
        dict.__setitem__(store, rid, held)
        if b.prefill_nbytes is None:  # the held-bytes gauge counts these rows too (the adapter's store, for good)
            b.prefill_nbytes = functools.partial(held_nbytes, store)
        return None
    copied = _append(held, out, b.policy.max_bytes_per_request, rid)
    held.last = out
    if not is_finished and held.rows[0] <= len(out.ids.prompt):
        held.copied += copied
        held.seconds += time.perf_counter() - t0
        dict.__setitem__(store, rid, held)
        return None
    (prefill, output), read_copied = _views(held)
    out.embed.prefill, out.hidden_states.output = prefill, output
    held.copied += copied + read_copied
    held.seconds += time.perf_counter() - t0
    _observe(b, tm, held.strategy, held.seconds, held.copied)
    return out


def adopt(obj: Any) -> None:
    """An adapter or runner transport just made: a processor it resolved before the wrapper was installed
    (the instance whose connector extra installed omni-accum) is replaced by the wrapper."""
    if not Settings.installed:
        return
    for attr in _ATTRS:
        fn = obj.__dict__.get(attr) if hasattr(obj, "__dict__") else None
        if fn is None or getattr(fn, "__omni_accum_original__", None) is not None:
            continue
        current = _current_wrapper(fn)
        if current is not None:
            setattr(obj, attr, current)


def _current_wrapper(fn: Any) -> Any:
    """The installed wrapper whose original is ``fn``, else None."""
    import sys

    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    wrapped = getattr(module, getattr(fn, "__name__", ""), None) if module is not None else None
    return wrapped if getattr(wrapped, "__omni_accum_original__", None) is fn else None


def _detach(obj: Any) -> None:
    """Uninstall: the instance's processor is the release's own again, and omni-accum's entries the release's."""
    for attr in _ATTRS:
        fn = obj.__dict__.get(attr) if hasattr(obj, "__dict__") else None
        original = getattr(fn, "__omni_accum_original__", None)
        if original is not None:
            setattr(obj, attr, original)
    store = getattr(obj, "request_payload", None)
    if isinstance(store, dict):
        for rid in [k for k, v in list(store.items()) if isinstance(v, _Held)]:
            _give_back(store, rid)


instances.DETACH_HOOKS.append(_detach)
