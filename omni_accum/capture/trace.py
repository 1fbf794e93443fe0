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
three edges at their quantiles); the concurrency is how many requests overlapped in time
(:meth:`Trace.concurrency`). A bucket replays the captured requests whose prompt length falls in it.
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import PrivateAttr

from omni_accum.bench.workloads import MAX_ROWS, Workload
from omni_accum.capture.keys import _read_of, kind_of_key
from omni_accum.capture.reader import Capture
from omni_accum.capture.writer import CaptureError

_NOT_ROWS = ("ids", "list", "names", "str", "bytes")
_SCHEMA_DTYPES = ("bfloat16", "float16", "float32", "int64", "int32")


@dataclass(frozen=True)
class KeyRec:
    """One key of a recorded chunk."""

    path: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    strategy: str
    extra: dict[str, Any] | None = None


@dataclass
class Chunk:
    seq: int
    t: float
    dt: float
    keys: list[KeyRec]
    handoff_s: float | None = None


@dataclass
class Request:
    """One request's chunks on one side of one stage pair."""

    req: str
    pair: str
    role: str
    chunks: list[Chunk] = field(default_factory=list)
    ctx: int | None = None
    arm: str | None = None

    @property
    def start(self) -> float:
        return self.chunks[0].t

    @property
    def end(self) -> float:
        return self.chunks[-1].t

    def prompt_len(self) -> int:
        """The recorded prompt length, else the rows of the first chunk's longest tensor key (the prefill)."""
        if self.ctx:
            return self.ctx
        rows = [k.shape[0] for k in self.chunks[0].keys if k.shape and k.dtype not in _NOT_ROWS]
        return max(rows, default=1) or 1


@dataclass
class Trace:
    """The requests of a capture, by ``(pair, role)``."""

    requests: dict[tuple[str, str], list[Request]] = field(default_factory=dict)

    def pairs(self) -> list[str]:
        return sorted({p for p, _ in self.requests}, key=_pair_order)

    def side(self, pair: str) -> list[Request]:
        """The requests replayed for ``pair``: the sending side's, else the receiving side's."""
        return self.requests.get((pair, "send")) or self.requests.get((pair, "recv")) or []

    def concurrency(self, pair: str) -> list[int]:
        """Per request of ``pair`` (in start order): how many requests were streaming when it started."""
        reqs = sorted(self.side(pair), key=lambda r: r.start)
        return [sum(1 for o in reqs if o.start <= r.start <= o.end) for r in reqs]

    def warnings(self) -> list[str]:
        """Keys whose rows change shape or dtype within a pair (an appended key's rows, any tensor's dtype):
        requests of two models or servers in one capture folder, say, which a replay takes as they came."""
        from omni_accum.capture.reader import ITEM_BYTES

        out = []
        for pair in self.pairs():
            forms: dict[str, set[str]] = {}
            for r in self.side(pair):
                for c in r.chunks:
                    for k in c.keys:
                        if k.dtype in ITEM_BYTES and k.shape:
                            row = list(k.shape[1:]) if kind_of_key(k.path, k.kind) == "append" else None
                            forms.setdefault(k.path, set()).add(k.dtype if row is None else f"{k.dtype} rows {row}")
            for path, got in forms.items():
                if len(got) > 1:
                    out.append(
                        f"stage pair {pair}: key {path} comes as {', '.join(sorted(got))}: requests of other models "
                        "or servers in one capture folder? (replayed as they came)"
                    )
        return out

    def context_lens(self, pair: str, most: int = 3) -> list[int]:
        """Bucket edges of context length: the prompt lengths at up to ``most`` quantiles (rounded to 2
        significant digits, capped at the bench's row bound)."""
        lens = sorted(r.prompt_len() for r in self.side(pair))
        if not lens:
            return []
        qs = [lens[min(len(lens) - 1, int(q * (len(lens) - 1) + 0.5))] for q in _quantiles(most)]
        return sorted({min(MAX_ROWS, _round2(x)) for x in qs})

    def concurrency_levels(self, pair: str, most: int = 3) -> list[int]:
        """Bucket edges of concurrency: the overlaps at up to ``most`` quantiles."""
        conc = sorted(self.concurrency(pair))
        if not conc:
            return [1]
        return sorted({conc[min(len(conc) - 1, int(q * (len(conc) - 1) + 0.5))] for q in _quantiles(most)})


def _quantiles(most: int) -> list[float]:
    return [0.5] if most <= 1 else [i / (most - 1) * 0.8 + 0.1 for i in range(most)]  # 10 % .. 90 %


def _round2(x: int) -> int:
    if x < 100:
        return max(1, x)
    p = 10 ** (int(math.log10(x)) - 1)
    return int(round(x / p) * p)


def _pair_order(pair: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in pair.split("->"))
    except ValueError:
        return (1 << 30,)


def build_trace(capture: Capture) -> Trace:
    """Group ``capture``'s records by pair, role and request; chunks ordered by time, then index."""
    out = Trace()
    index: dict[tuple[str, str, str], Request] = {}
    for rec in capture.records:
        k = (rec["pair"], rec["role"], rec["req"])
        r = index.get(k)
        if r is None:
            r = index[k] = Request(rec["req"], rec["pair"], rec["role"])
            out.requests.setdefault((rec["pair"], rec["role"]), []).append(r)
        keys = [KeyRec(x[0], x[1], x[2], tuple(x[3]), x[4], x[5], x[6] if len(x) > 6 else None) for x in rec["keys"]]
        r.chunks.append(Chunk(rec["seq"], float(rec["t"]), float(rec["dt"]), keys, rec.get("handoff_s")))
        if rec.get("ctx") is not None and r.ctx is None:
            r.ctx = rec["ctx"]
        if rec.get("arm") is not None:
            r.arm = rec["arm"]
    for reqs in out.requests.values():
        for r in reqs:
            r.chunks.sort(key=lambda c: (c.t, c.seq))
        reqs.sort(key=lambda r: r.start)
    sent = {(r.pair, r.req): r.ctx for (_, role), reqs in out.requests.items() if role == "send" for r in reqs}
    for (_, role), reqs in out.requests.items():  # a receiving side knows the prompt length from its sender
        if role == "recv":
            for r in reqs:
                r.ctx = r.ctx or sent.get((r.pair, r.req))
    return out


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


def _key_specs(reqs: list[Request]) -> list[dict[str, Any]]:
    """One workload key per captured path, in first-seen order."""
    first: dict[str, KeyRec] = {}
    kinds: dict[str, set[str]] = {}
    where: dict[str, set[str]] = {}
    for r in reqs:
        n = len(r.chunks)
        for i, c in enumerate(r.chunks):
            for k in c.keys:
                first.setdefault(k.path, k)
                kinds.setdefault(k.path, set()).add(k.kind)
                where.setdefault(k.path, set()).add("first" if i == 0 else ("last" if i == n - 1 else "mid"))
    specs = []
    for path, k in first.items():
        kind = kind_of_key(path, "append" if "append" in kinds[path] else "replace")
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
    _built: dict[tuple[int, int], list[dict[str, Any]]] = PrivateAttr(default_factory=dict)
    _shared: dict[tuple[Any, ...], Any] = PrivateAttr(default_factory=dict)

    def requests_for(self, context_len: int) -> list[Request]:
        """The captured requests a bucket of ``context_len`` replays: those whose prompt length falls in
        its bucket (among the workload's context lengths and ``context_len``), else the nearest ones."""
        reqs = self._requests
        pool = self._in_bucket(context_len)
        if not pool:
            pool = sorted(reqs, key=lambda r: abs(math.log(max(1, r.prompt_len()) / context_len)))[:8]
        return pool

    def bucket_warnings(self, context_lens: list[int] | None, concurrency: list[int] | None) -> list[str]:
        """What the buckets given by hand replay that the capture does not hold: a context length whose bucket
        holds no captured request (it replays the nearest ones), a concurrency above the capture's most."""
        out = []
        lens = [r.prompt_len() for r in self._requests]
        for cl in sorted(set(context_lens or ())) if lens else ():
            if not self._in_bucket(cl):  # as requests_for finds it
                out.append(
                    f"--context-lens {cl}: no captured request falls in that bucket (the capture's prompts are "
                    f"{min(lens)}-{max(lens)} tokens); it replays the nearest ones"
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
        """The captured requests whose prompt length falls in ``context_len``'s bucket (among the workload's
        context lengths and ``context_len``)."""
        edges = sorted({*self._edges, context_len})
        i = edges.index(context_len)
        lo, hi = edges[i] if i else 0, edges[i + 1] if i + 1 < len(edges) else math.inf
        return [r for r in self._requests if lo <= r.prompt_len() < hi]

    def recorded_stream(self, context_len: int, request: int = 0) -> list[dict[str, Any]]:
        """The chunks of the ``request``-th captured request of ``context_len``'s bucket (cycling), at most
        ``1 + decode_steps`` of them, with this workload's keys only."""
        pool = self.requests_for(context_len)
        r = pool[request % len(pool)]
        n = min(len(r.chunks), 1 + self.decode_steps)
        lap = request // len(pool)  # a request replayed twice at once gets other data the second time
        k = (id(r), n, lap)
        full = self._built.get(k)
        if full is None:
            full = self._built[k] = self._build(r, n, lap)
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
    reqs = trace.side(pair)
    layout = [(r.req, [(c.seq, [(k.path, k.dtype, k.shape) for k in c.keys]) for c in r.chunks]) for r in reqs]
    digest = hashlib.sha256(repr(layout).encode()).hexdigest()
    edges = trace.context_lens(pair)
    wl = CapturedWorkload(
        name=name or f"trace {pair}",
        description=f"captured stream of stage pair {pair}: {len(reqs)} requests ({digest[:12]})",
        context_len=edges[len(edges) // 2] if edges else 1,
        decode_steps=max(0, max(len(r.chunks) for r in reqs) - 1),
        concurrency=trace.concurrency_levels(pair),
        context_lens=edges,
        seed=int(digest[:8], 16),
        keys=_key_specs(reqs),
    )
    wl._requests = reqs
    wl._edges = edges
    return wl

