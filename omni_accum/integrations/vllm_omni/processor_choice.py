"""Which strategies, and how much memory, a request's prefill keys get in the stage input processor (:mod:`.processor`).

The bucket is the one the sender's handshake (:func:`.handshake.decide`) decides for the request, by the same rules
(:func:`live_requests`, :func:`context_of`); both keys are accumulated by omni-accum only when both get an append-kind
strategy other than ``cat`` (:func:`select`); an accumulator is told the prompt's rows (:func:`accumulator`:
``prealloc`` allocates once); the policy's ``max_bytes_per_request`` is checked before a chunk allocates
(:func:`guard`, with :func:`owned_nbytes` for the buffer ``prealloc``'s ``own()`` sizes at the first chunk).
"""

from __future__ import annotations

from typing import Any

import torch

from omni_accum.context import StreamContext
from omni_accum.errors import AccumulationError
from omni_accum.integrations.vllm_omni.binding import Binding
from omni_accum.integrations.vllm_omni.handshake import live_requests
from omni_accum.strategy import KeyInfo

#: The two keys the processor accumulates, as ``(group, key)`` of its output and as key paths.
KEYS = (("embed", "prefill"), ("hidden_states", "output"))
PATHS = tuple(f"{g}.{k}" for g, k in KEYS)
#: The ``cat`` label: the release's own code accumulated (``default``).
UPSTREAM = "cat"


def context_of(b: Binding, prompt_len: int, rid: str) -> StreamContext:
    """The stream context the two keys' strategies are selected in for request ``rid``: the bucket the sender's
    handshake decides for it (:func:`.handshake.decide`, by the same rules): from the prompt length and
    :func:`live_requests`; a deployment context that sets the context length as it is; one that sets only the
    concurrency, that and the prompt length. No tuned table: the binding's."""
    table = b.policy.tuned
    ctx = b.receiver.context
    if table is None:
        return ctx
    dep = b.context
    if dep is not None and dep.context_len is not None:
        return ctx
    concurrency = dep.concurrency if dep is not None else live_requests(b, rid)
    c_edge, k_edge, _ = table.bucket(StreamContext(context_len=prompt_len, concurrency=concurrency))
    return StreamContext(context_len=c_edge, concurrency=k_edge)


def select(b: Binding, value: torch.Tensor, prompt_len: int, rid: str) -> list[tuple[str, Any, Any]] | None:
    """``(path, strategy, spec)`` of both keys when omni-accum accumulates ``rid``'s (both append-kind, neither
    ``cat``), else None (the release's own code)."""
    ctx = context_of(b, prompt_len, rid)
    chosen = [(path, *b.receiver.select(path, value, ctx)) for path in PATHS]
    if all("append" in spec.kinds and spec.name != UPSTREAM for _, _, spec in chosen):
        return chosen
    return None


def accumulator(b: Binding, strategy: Any, name: str, path: str, rid: str, rows: int) -> Any:
    """A fresh accumulator for ``path``, told its final rows; a strategy with an ``initial_capacity``
    (``prealloc``) gets at least those rows, so its buffer is allocated once (the rows are known here, not
    guessed: the processor hands over when they exceed the prompt). ``name``: the strategy's registered name (a
    plugin's subclass of ``Prealloc`` keeps the class attribute ``name = "prealloc"``: built by it, the built-in
    replaced the plugin's strategy for long prompts)."""
    params = getattr(strategy, "params", None)
    fields = getattr(type(params), "model_fields", {})
    if "initial_capacity" in fields:
        limit = fields["initial_capacity"].metadata
        cap = min(rows, min((m.le for m in limit if getattr(m, "le", None) is not None), default=rows))
        if cap > params.initial_capacity:
            strategy = b.receiver.manager.build(name, {**params.model_dump(), "initial_capacity": cap})
    return strategy.new_accumulator(KeyInfo(path, rid, rows))


def owns(value: Any) -> bool:
    """Whether ``own()`` copies a first chunk ``value`` (held by reference) into a buffer: one with rows."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] > 0


def owned_nbytes(acc: Any, value: Any) -> int:
    """Bytes ``acc`` (its first chunk ``value`` merged) holds once :func:`_start` called its ``own()``: the buffer
    an append sizes (``own`` sizes it so: the projection of appending no rows), else what it holds now."""
    if getattr(acc, "own", None) is not None and owns(value):
        return acc.projected_nbytes(value[:0])
    return acc.nbytes()


def guard(limit: int, rid: str, specs: list[Any], accs: list[tuple[str, Any]], sizes: list[tuple[int, int]]) -> None:
    """The Receiver's memory guard (``max_bytes_per_request``) on the two keys ``rid`` accumulates: ``sizes`` is each
    key's ``(bytes held now, bytes held after the step)``; over ``limit`` the step is refused before it allocates
    (an :class:`AccumulationError` naming the key that grows most, its strategy and plugin; nothing changed)."""
    after = sum(n for _, n in sizes)
    if after > limit:
        grow, i = max((n - now, i) for i, (now, n) in enumerate(sizes))
        raise AccumulationError(
            f"would hold {after} bytes after this prefill chunk (key {accs[i][0]!r} grows by {grow}), over "
            f"max_bytes_per_request={limit}; refused before allocating",
            request_id=rid,
            key=accs[i][0],
            strategy=specs[i].name,
            plugin=specs[i].plugin,
        )
