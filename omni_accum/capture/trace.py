"""A capture as requests per stage pair, and as a workload that ``bench --trace`` / ``tune --trace`` replay.

:func:`build_trace` groups the records of a capture by stage pair, role and request (ordered by time and
chunk index). :func:`captured_workload` turns one pair's requests into a :class:`CapturedWorkload`: a
:class:`~omni_accum.bench.workloads.Workload` whose keys are the captured ones (kind, dtype, row shape;
the key's kind and the consumer's read taken from the built-in preset that has the key: the default one,
else another, e.g. 0.16's flat keys; else the kind recorded, ``delta`` for append keys and ``every`` for the
others) and whose chunk stream per request is the captured one: every chunk with the
recorded keys, shapes and dtypes, in the recorded order (:meth:`CapturedWorkload.recorded_stream`, which
:func:`~omni_accum.bench.streams.build_stream` calls). Values are seeded random data, or the rows kept
with ``values: sample`` tiled to the shape; a flag is set on a request's last chunk only; a replace-kind
tensor re-sent with its shape unchanged is the same value (a capture without values cannot tell). The
sending side's records are replayed (a pair captured on its receiving side only: those).

Buckets: the context lengths are the captured requests' prompt lengths (:meth:`Trace.context_lens`: up to
three edges at their quantiles, rounded down); the concurrency is how many requests overlapped in time
(:meth:`Trace.concurrency`). A bucket replays the captured requests whose prompt length falls in it by the rule
a tuned table applies at run time (edges are floors: the largest edge <= the length; a length under the first
edge: the first bucket), among the edges given by hand when there are (:meth:`CapturedWorkload.set_context_lens`).
It replays all of them, or, past :data:`MAX_REPLAYED`, that many spread over the whole bucket: the first in the
order of a hash of their ids (never the order of the files); in that order, ``concurrency`` at a time, each
next one starting as one ends (:meth:`CapturedWorkload.bucket_requests`, :meth:`CapturedWorkload.replay_note`).
A request replays at most its first ``1 + decode_steps`` chunks (``bench --steps``; ``tune`` cuts them, said).
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
import zlib
from typing import Any

import torch
from pydantic import PrivateAttr

from omni_accum.bench.workloads import Workload
from omni_accum.capture.keys import _read_of
from omni_accum.capture.records import Chunk, KeyRec, Request, Trace, build_trace  # noqa: F401 - re-exported
from omni_accum.capture.writer import CaptureError

#: Captured requests a bucket replays at most (past it: a sample spread over the bucket, said).
MAX_REPLAYED = 32
_SCHEMA_DTYPES = ("bfloat16", "float16", "float32", "int64", "int32")


# ---------------------------------------------------------------------------------- the replayed workload
def _value_type(k: KeyRec) -> str:
    if k.dtype in ("ids", "list"):
        return "ids"
    if k.dtype == "names":
        return "names"
    if k.dtype == "bool" and not k.shape:
        return "flag"
    if k.dtype in ("pybool", "none", "int", "float", "str", "bytes") or not k.shape:
        return "bool"
    return "tensor"


def _key_specs(reqs: list[Request], decided: dict[str, str]) -> list[dict[str, Any]]:
    """One workload key per captured path, in first-seen order; ``decided``: each key's kind (Trace.key_kinds)."""
    first: dict[str, KeyRec] = {}
    where: dict[str, set[str]] = {}
    for r in reqs:
        n = len(r.chunks)
        for i, c in enumerate(r.chunks):
            for k in c.keys:
                first.setdefault(k.path, k)
                where.setdefault(k.path, set()).add("first" if i == 0 else ("last" if i == n - 1 else "mid"))
    specs = []
    for path, k in first.items():
        kind = decided.get(path, "replace")
        value = _value_type(k)
        if kind == "append" and value not in ("tensor", "ids"):
            kind = "replace"
        seen = where[path]
        carried = "first" if seen == {"first"} else ("decode" if "first" not in seen else "every")
        spec: dict[str, Any] = {"path": path, "kind": kind, "value": value, "carried": carried}
        if value == "tensor":
            spec["row_shape"] = list(k.shape[1:]) or []
            spec["dtype"] = k.dtype if k.dtype in _SCHEMA_DTYPES else ("int64" if "int" in k.dtype else "float32")
        spec["read"] = "never" if value == "ids" and kind != "append" else _read_of(path, kind)
        specs.append(spec)
    return specs


class CapturedWorkload(Workload):
    """A :class:`Workload` whose chunk streams are captured requests (see the module docstring)."""

    _requests: list[Request] = PrivateAttr(default_factory=list)
    _edges: list[int] = PrivateAttr(default_factory=list)
    #: Built streams of one bucket (its context length -> (request, chunks, lap) -> chunks): a run measures one
    #: bucket at a time, and holding every bucket's (up to 32 requests each) would exceed what its memory check counts.
    _built: dict[int, dict[tuple[int, int, int], list[dict[str, Any]]]] = PrivateAttr(default_factory=dict)
    _shared: dict[tuple[Any, ...], Any] = PrivateAttr(default_factory=dict)
    _notes: list[str] = PrivateAttr(default_factory=list)

    def requests_for(self, context_len: int) -> list[Request]:
        """The captured requests whose prompt length falls in ``context_len``'s bucket (among the workload's
        context lengths and ``context_len``), else the nearest ones (at most 8); in the order of a hash of their
        ids, so that neither the order nor the sample depends on the order of the capture's files."""
        pool = self._in_bucket(context_len)
        if not pool:
            return sorted(self._requests, key=lambda r: (abs(math.log(max(1, r.prompt_len()) / context_len)),
                                                         _order(r)))[:8]  # fmt: skip
        return sorted(pool, key=_order)

    def bucket_requests(self, context_len: int) -> list[Request]:
        """The captured requests a bucket replays: :meth:`requests_for`, the first :data:`MAX_REPLAYED` of them."""
        return self.requests_for(context_len)[:MAX_REPLAYED]

    def replayed_lengths(self, context_len: int) -> list[int]:
        """Chunks each replayed request of the bucket sends (at most ``1 + decode_steps``), in replay order."""
        return [min(len(r.chunks), 1 + self.decode_steps) for r in self.bucket_requests(context_len)]

    def replay_note(self, context_len: int, concurrency: int = 1) -> str:
        """What a bucket replays: how many of its captured requests, and their cut if any (and, ``concurrency``
        above them, that they are replayed again, with other data, to keep that many in flight)."""
        pool = self._in_bucket(context_len)
        got = self.bucket_requests(context_len)
        if not pool:
            what = f"the {len(got)} nearest captured request(s) (none falls in this bucket)"
        elif len(got) < len(pool):
            what = f"{len(got)} of its {len(pool)} captured requests (a sample spread over them, by hashed id)"
        else:
            what = f"all {len(got)} of its captured request(s)"
        longest = max(len(r.chunks) for r in got)
        cut = sum(1 for r in got if len(r.chunks) > 1 + self.decode_steps)
        if cut:
            what += (f"; {cut} of them cut to their first {1 + self.decode_steps} chunks (1 + {self.decode_steps} "
                     f"decode steps; the longest has {longest})")
        if concurrency > len(got):
            what += f"; each replayed up to {-(-concurrency // len(got))} times, with other data, to keep {concurrency} in flight"
        return f"replays {what}"

    def set_context_lens(self, context_lens: list[int]) -> None:
        """Assign the captured requests to the buckets of ``context_lens`` (edges given by hand), as at run time."""
        self._edges = sorted(set(context_lens))

    def bucket_warnings(self, context_lens: list[int] | None, concurrency: list[int] | None) -> list[str]:
        """What the buckets given by hand replay that the capture does not hold: a context length whose bucket
        holds no captured request (it replays the nearest ones), a concurrency above the capture's most. Given
        context lengths become the buckets the requests are assigned to (:meth:`set_context_lens`)."""
        out = []
        if context_lens:
            self.set_context_lens(context_lens)
        lens = [r.prompt_len() for r in self._requests]
        for cl in sorted(set(context_lens or ())) if lens else ():
            if not self._in_bucket(cl):  # as requests_for finds it
                out.append(
                    f"--context-lens {cl}: no captured request falls in that bucket (the capture's prompts are "
                    f"{min(lens)}-{max(lens)} tokens; a bucket holds the lengths from its edge up to the next edge); "
                    "it replays the nearest ones"
                )
        most = max(self.concurrency) if self.concurrency else None
        for c in sorted(set(concurrency or ())):
            if most is not None and c > most:
                out.append(
                    f"--concurrency {c}: the capture had at most {most} requests at once; that bucket replays its "
                    f"requests {c} at a time"
                )
        return out

    def _in_bucket(self, context_len: int) -> list[Request]:
        """The captured requests whose prompt length falls in ``context_len``'s bucket among the workload's
        context lengths and ``context_len``: the floor rule (a length under the first edge: the first bucket)."""
        edges = sorted({*self._edges, context_len})
        i = edges.index(context_len)
        lo, hi = edges[i] if i else 0, edges[i + 1] if i + 1 < len(edges) else math.inf
        return [r for r in self._requests if lo <= r.prompt_len() < hi]

    def recorded_stream(self, context_len: int, request: int = 0) -> list[dict[str, Any]]:
        """The chunks of the ``request``-th replayed request of ``context_len``'s bucket (:meth:`bucket_requests`,
        cycling), at most ``1 + decode_steps`` of them, with this workload's keys only."""
        pool = self.bucket_requests(context_len)
        r = pool[request % len(pool)]
        n = min(len(r.chunks), 1 + self.decode_steps)
        lap = request // len(pool)  # a request replayed twice at once gets other data the second time
        if context_len not in self._built:  # another bucket: the one before goes (in place: copies share these)
            self._built.clear()
            self._shared.clear()
        built = self._built.setdefault(context_len, {})
        k = (id(r), n, lap)
        full = built.get(k)
        if full is None:
            full = built[k] = self._build(r, n, lap)
        paths = {s.path for s in self.keys}
        out = []
        for chunk in full:
            c: dict[str, Any] = {}
            for top, v in chunk.items():
                if isinstance(v, dict):
                    sub = {q: x for q, x in v.items() if f"{top}.{q}" in paths}
                    if sub:
                        c[top] = sub
                elif top in paths:
                    c[top] = v
            out.append(c)
        return out

    def _build(self, r: Request, n: int, lap: int) -> list[dict[str, Any]]:
        seed = zlib.crc32(f"{self.seed}:{r.req}:{lap}".encode())
        gen = torch.Generator().manual_seed(seed)
        samples = {k.path: k.extra for c in r.chunks[:n] for k in c.keys if k.extra and "sample" in k.extra}
        prev: dict[str, tuple[tuple[int, ...], Any]] = {}
        out = []
        for i, c in enumerate(r.chunks[:n]):
            last = i == n - 1
            chunk: dict[str, Any] = {}
            for k in c.keys:
                value = self._value(k, i, last, gen, samples.get(k.path), prev)
                top, _, qual = k.path.partition(".")
                if qual:
                    chunk.setdefault(top, {})[qual] = value
                else:
                    chunk[top] = value
            out.append(chunk)
        return out

    def _value(self, k: KeyRec, i: int, last: bool, gen: torch.Generator, sample: Any, prev: dict) -> Any:
        extra = k.extra or {}
        if "value" in extra and k.dtype in ("names", "int", "float", "none"):
            return extra["value"]
        if k.dtype in ("pybool", "none"):
            return last if k.dtype == "pybool" else None
        if k.dtype in ("ids", "list"):
            return list(range(i * 100_000, i * 100_000 + (k.shape[0] if k.shape else 0)))
        if k.dtype == "str":
            return "x" * (k.shape[0] if k.shape else 0)
        if k.dtype == "bytes":
            return b"x" * (k.shape[0] if k.shape else 0)
        try:
            dtype = getattr(torch, k.dtype)
        except AttributeError:
            return None
        if not isinstance(dtype, torch.dtype):
            return None
        if dtype == torch.bool and not k.shape:
            return torch.tensor(last)
        if k.kind == "replace" and k.path in prev and prev[k.path][0] == k.shape:
            return prev[k.path][1]  # re-sent unchanged, as far as a capture without values can tell
        t = self._tensor(k, dtype, gen, sample, shared=k.kind == "append" and k.shape and k.shape[0] > 1)
        prev[k.path] = (k.shape, t)
        return t

    def _tensor(self, k: KeyRec, dtype: torch.dtype, gen: torch.Generator, sample: Any, shared: bool) -> torch.Tensor:
        key = (k.path, k.dtype, k.shape)
        if shared and sample is None and key in self._shared:
            return self._shared[key]  # a prefill-sized tensor: one per shape (as the presets share theirs)
        t = _from_sample(sample, dtype, k.shape) if sample is not None else None
        if t is None:
            if dtype.is_floating_point:
                t = torch.randn(k.shape, generator=gen, dtype=torch.float32).to(dtype)
            elif dtype == torch.bool:
                t = torch.zeros(k.shape, dtype=dtype)
            else:
                t = torch.randint(0, 4096, k.shape, generator=gen, dtype=torch.int64).to(dtype)
        if shared and sample is None:
            self._shared[key] = t
        return t


def _from_sample(sample: dict[str, Any], dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The sampled rows tiled to ``shape`` (None when they do not fit it)."""
    try:
        raw = base64.b64decode(sample["sample"], validate=True)
        rows = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, sample["sample_dtype"]))
        rows = rows.reshape(sample["sample_shape"]).to(dtype)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError):
        return None
    if not shape or rows.shape[1:] != tuple(shape[1:]) or rows.shape[0] == 0:
        return None
    reps = -(-shape[0] // rows.shape[0])
    return rows.repeat(reps, *([1] * (len(shape) - 1)))[: shape[0]].clone()


def normal_pair(pair: str) -> str:
    """``0->1`` for ``0->1``, ``0-1``, ``0:1`` or ``0,1`` (a stage pair written without the shell's ``>``)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:->|-|:|,)\s*(\d+)\s*", pair)
    return f"{m.group(1)}->{m.group(2)}" if m else pair


def captured_workload(trace: Trace, pair: str | None = None, name: str | None = None) -> CapturedWorkload:
    """The workload replaying ``pair``'s captured requests (default: the pair with the most bytes).

    Raises:
        CaptureError: the capture holds no request, or none of ``pair`` (naming the pairs it has).
    """
    pairs = trace.pairs()
    if not pairs:
        raise CaptureError("the capture holds no complete record to replay")
    if pair is None:
        pair = max(pairs, key=lambda p: sum(k.nbytes for r in trace.side(p) for c in r.chunks for k in c.keys))
    else:
        pair = normal_pair(pair)
    if pair not in pairs:
        have = ", ".join(pairs)
        hint = " (quote it: --pair '0->1'; the shell took > as a redirection)" if pair.endswith("-") else ""
        raise CaptureError(f"--pair {pair!r}: the capture has no requests of that stage pair; it has {have}{hint}")
    reqs, empty = _with_keys(trace.side(pair))
    if not reqs:
        raise CaptureError(
            f"stage pair {pair}: its {empty} captured chunk(s) carry no payload key (records with \"keys\": [], "
            "written for a chunk with nothing in it): nothing to replay"
            + ("; give another --pair (it has " + ", ".join(p for p in pairs if p != pair) + ")" if len(pairs) > 1 else "")
        )
    layout = [(r.req, [(c.seq, [(k.path, k.dtype, k.shape) for k in c.keys]) for c in r.chunks]) for r in reqs]
    digest = hashlib.sha256(repr(layout).encode()).hexdigest()
    edges = trace.context_lens(pair, of=reqs)  # of the requests replayed: their empty chunks left out
    wl = CapturedWorkload(
        name=name or f"trace {pair}",
        description=f"captured stream of stage pair {pair}: {len(reqs)} requests ({digest[:12]})",
        context_len=edges[len(edges) // 2] if edges else 1,
        decode_steps=max(0, max(len(r.chunks) for r in reqs) - 1),
        concurrency=trace.concurrency_levels(pair, of=reqs),
        context_lens=edges,
        seed=int(digest[:8], 16),
        keys=_key_specs(reqs, trace.key_kinds(pair)),
    )
    wl._requests = reqs
    wl._edges = edges
    if empty:
        wl._notes = [f"stage pair {pair}: left out {empty} captured chunk(s) that carry no payload key (records with "
                     '"keys": []): nothing in them to accumulate']
    return wl


def _with_keys(reqs: list[Request]) -> tuple[list[Request], int]:
    """``reqs`` without their chunks that carry no key (a request left with none: left out), and how many went."""
    out, empty = [], 0
    for r in reqs:
        chunks = [c for c in r.chunks if c.keys]
        empty += len(r.chunks) - len(chunks)
        if len(chunks) == len(r.chunks):
            out.append(r)
        elif chunks:
            out.append(Request(r.req, r.pair, r.role, chunks, r.ctx, r.arm))
    return out, empty


def _order(r: Request) -> tuple[int, str]:
    """Where a captured request comes in a bucket's replay: by a hash of its id (never the files' order)."""
    return zlib.crc32(r.req.encode()), r.req
