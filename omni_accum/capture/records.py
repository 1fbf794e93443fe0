"""A capture's records as requests per stage pair (:func:`build_trace`), their buckets, and what each key is.

Split from :mod:`omni_accum.capture.trace` (which re-exports these names and builds the replayed workload).

* A request whose first recorded chunk is not its chunk 0 (``seq`` 0) lost its head: the oldest files of a
  capture bounded by ``OMNI_ACCUM_CAPTURE_MAX_BYTES`` were rotated away. Such a request is left out of the trace
  (its figures and its replay: a replay without the prefill would time another stream), counted per pair and
  side in :attr:`Trace.dropped` and named in :meth:`Trace.warnings`.
* A request id whose chunk indexes (``seq``) repeat on one side was written by two servers, or two runs of one, into
  one capture folder: it is taken as separate requests, by the process that wrote each record (its files'
  ``capture-<stage>-<pid>``) and, within a process, at a file that repeats an index of the run before (a process
  restarted with the same pid writes files of its own); said in :meth:`Trace.notes`. Repeats in records that do not
  say their file leave the request out (:attr:`Trace.repeated`, a warning).
* A key's kind (append or replace, :meth:`Trace.key_kinds`): the built-in preset that has the key says it;
  for a key no preset has, the captured data where it shows it, else the records (a record holds the kind the
  policy running at capture time gave the key, which differs between policies): see :func:`decide_kind`.
* Bucket edges (:meth:`Trace.context_lens`) are floors, as a tuned table reads them: each edge is at most the
  prompt lengths it stands for (rounded *down* to 2 significant digits).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from omni_accum.bench.workloads import MAX_ROWS
from omni_accum.capture.keys import kind_of_key, known_key
from omni_accum.capture.reader import Capture
from omni_accum.capture.writer import FILE_SUFFIX

_NOT_ROWS = ("ids", "list", "names", "str", "bytes")


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
    """The requests of a capture, by ``(pair, role)``; ``dropped``: requests left out (their chunk 0 missing)."""

    requests: dict[tuple[str, str], list[Request]] = field(default_factory=dict)
    dropped: dict[tuple[str, str], int] = field(default_factory=dict)
    #: Request ids whose chunk indexes repeat on one side (two servers or runs in one folder), by ``(pair, role)``:
    #: ``[ids split, requests they were split into, ids left out (records without their file), files]``.
    repeated: dict[tuple[str, str], list[Any]] = field(default_factory=dict)
    _kinds: dict[str, tuple[dict[str, str], list[str]]] = field(default_factory=dict, repr=False)
    #: :meth:`concurrency` per ``(pair, id(of))`` with ``of`` (a trace is not changed once built).
    _conc: dict[tuple[str, int | None], tuple[Any, list[int]]] = field(default_factory=dict, repr=False)

    def pairs(self) -> list[str]:
        return sorted({p for p, _ in self.requests}, key=_pair_order)

    def side(self, pair: str) -> list[Request]:
        """The requests replayed for ``pair``: the sending side's, else the receiving side's."""
        return self.requests.get((pair, "send")) or self.requests.get((pair, "recv")) or []

    def concurrency(self, pair: str, of: list[Request] | None = None) -> list[int]:
        """Per request of ``pair`` (in start order): how many requests were streaming when it started (``of``:
        those requests instead of all of the pair's, e.g. the replayed ones)."""
        key = (pair, None if of is None else id(of))
        got = self._conc.get(key)
        if got is not None and got[0] is of:  # ``of``: the same list object (held here, so its id is not reused)
            return list(got[1])
        reqs = sorted(self.side(pair) if of is None else of, key=lambda r: r.start)
        self._conc[key] = (of, overlaps([(r.start, r.end) for r in reqs]))
        return list(self._conc[key][1])

    def key_kinds(self, pair: str) -> dict[str, str]:
        """``{path: "append" | "replace"}`` of every key of ``pair``'s replayed side (see :func:`decide_kind`)."""
        return self._decided(pair)[0]

    def _decided(self, pair: str) -> tuple[dict[str, str], list[str]]:
        if pair not in self._kinds:
            self._kinds[pair] = decide_kinds(self.side(pair))
        return self._kinds[pair]

    def warnings(self) -> list[str]:
        """Requests left out (their chunk 0 rotated away); keys whose records disagree on their kind (the kind
        taken, and why); keys whose rows change shape or dtype within a pair (an appended key's rows, any
        tensor's dtype): requests of two models or servers in one capture folder, say, which a replay takes as
        they came."""
        from omni_accum.capture.reader import ITEM_BYTES

        out = []
        for (pair, role), n in sorted(self.dropped.items()):
            out.append(
                f"stage pair {pair} ({'sending' if role == 'send' else 'receiving'} side): left out {n} request(s) "
                "whose first chunk (chunk 0, the prefill) is not in the capture (its oldest files were rotated away: "
                "OMNI_ACCUM_CAPTURE_MAX_BYTES); not replayed and not counted in the figures"
            )
        for (pair, role), (_, _, lost, files) in sorted(self.repeated.items()):
            if lost:
                out.append(
                    f"stage pair {pair} ({_SIDE[role]} side): left out {lost} request(s) whose chunk indexes repeat "
                    f"(two servers or runs wrote the same request ids; {_files(files) or 'records without their file'}"
                    "): which chunk belongs to which cannot be told; not replayed and not counted in the figures"
                )
        for pair in self.pairs():
            kinds, notes = self._decided(pair)
            out += [f"stage pair {pair}: {n}" for n in notes]
            forms: dict[str, set[str]] = {}
            for r in self.side(pair):
                for c in r.chunks:
                    for k in c.keys:
                        if k.dtype in ITEM_BYTES and k.shape:
                            row = list(k.shape[1:]) if kinds.get(k.path) == "append" else None
                            forms.setdefault(k.path, set()).add(k.dtype if row is None else f"{k.dtype} rows {row}")
            for path, got in forms.items():
                if len(got) > 1:
                    out.append(
                        f"stage pair {pair}: key {path} comes as {', '.join(sorted(got))}: requests of other models "
                        "or servers in one capture folder? (replayed as they came)"
                    )
        return out

    def notes(self) -> list[str]:
        """Request ids recorded again by another server or run (their chunk indexes repeat on one side): taken as
        separate requests, by the process and the files their records came from."""
        return [
            f"stage pair {pair} ({_SIDE[role]} side): {n} request id(s) recorded by more than one server or run "
            f"(their chunk indexes repeat: {_files(files)}), taken as {got} separate requests by the process and "
            "files their records came from"
            for (pair, role), (n, got, _, files) in sorted(self.repeated.items()) if n
        ]

    def context_lens(self, pair: str, most: int = 3, of: list[Request] | None = None) -> list[int]:
        """Bucket edges of context length: the prompt lengths at up to ``most`` quantiles, rounded down to 2
        significant digits (an edge is a floor: never above the prompt lengths it stands for), capped at the
        bench's row bound (``of``: of those requests instead of all of the pair's)."""
        lens = sorted(r.prompt_len() for r in (self.side(pair) if of is None else of))
        if not lens:
            return []
        qs = [lens[min(len(lens) - 1, int(q * (len(lens) - 1) + 0.5))] for q in _quantiles(most)]
        return sorted({min(MAX_ROWS, _floor2(x)) for x in qs})

    def concurrency_levels(self, pair: str, most: int = 3, of: list[Request] | None = None) -> list[int]:
        """Bucket edges of concurrency: the overlaps at up to ``most`` quantiles."""
        conc = sorted(self.concurrency(pair, of))
        if not conc:
            return [1]
        return sorted({conc[min(len(conc) - 1, int(q * (len(conc) - 1) + 0.5))] for q in _quantiles(most)})


def overlaps(spans: list[tuple[float, float]]) -> list[int]:
    """Per span ``(start, end)``: how many spans ``o`` have ``o.start <= start <= o.end`` (itself included), in
    O(n log n): those starting at or before ``start`` less those that ended before it (a span whose end is
    before its start holds no time: never counted)."""
    held = [(a, b) for a, b in spans if a <= b]
    starts, ends = sorted(a for a, _ in held), sorted(b for _, b in held)
    return [bisect_right(starts, a) - bisect_left(ends, a) for a, _ in spans]


_SIDE = {"send": "sending", "recv": "receiving"}


def _files(files: list[str], most: int = 4) -> str:
    """``files`` named, the first ``most``, then a count."""
    more = f" and {len(files) - most} more" if len(files) > most else ""
    return ", ".join(files[:most]) + more


def _quantiles(most: int) -> list[float]:
    return [0.5] if most <= 1 else [i / (most - 1) * 0.8 + 0.1 for i in range(most)]  # 10 % .. 90 %


def _floor2(x: int) -> int:
    """``x`` rounded down to 2 significant digits (128 -> 120, 2345 -> 2300; under 100: itself, at least 1)."""
    if x < 100:
        return max(1, x)
    p = 10 ** (int(math.log10(x)) - 1)
    return (x // p) * p


def _pair_order(pair: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in pair.split("->"))
    except ValueError:
        return (1 << 30,)


def decide_kind(path: str, reqs: list[Request]) -> tuple[str, str | None]:
    """``(kind, note)`` of key ``path`` over ``reqs``; ``note`` when its records disagree on the kind.

    The rule: a key a built-in preset has is that preset's kind. For any other key, the captured data where it
    shows the kind: a key carried in 2 or more chunks of a request whose first chunk has more rows than every
    later one (a prefill, then each step's rows) is ``append``; a list, string or bytes value carried in 2 or more
    chunks of a request with the same length every time (a value re-sent, as ``language`` or ``speaker``) is
    ``replace``. Else the kind most of its records hold (a tie: ``append``), which is what the policy running at
    capture time did with the key."""
    recorded: Counter[str] = Counter()
    shrinks = same_len = other = False
    for r in reqs:
        seen = [k for c in r.chunks for k in c.keys if k.path == path]
        recorded.update(k.kind for k in seen)
        if len(seen) < 2:
            continue
        if seen[0].dtype in _NOT_ROWS:
            if len({k.shape for k in seen}) == 1:
                same_len = True
            else:
                other = True
        elif all(k.shape for k in seen) and all(k.shape[0] < seen[0].shape[0] for k in seen[1:]):
            shrinks = True
        else:
            other = True
    known = known_key(path)
    if known is not None:
        return kind_of_key(path, "append"), None
    if shrinks and not same_len:
        kind, why = "append", "its first chunk has more rows than the later ones (a prefill, then each step's rows)"
    elif same_len and not shrinks and not other:
        kind, why = "replace", "it is re-sent with the same length in every chunk"
    else:
        kind = "append" if recorded["append"] >= recorded["replace"] else "replace"
        why = "the kind most of its records hold"
    if len(recorded) < 2:
        return kind, None
    return kind, (
        f"key {path} is recorded as append in {recorded['append']} record(s) and as replace in "
        f"{recorded['replace']} (the policies running at capture time differed); taken as {kind}: {why}"
    )


def decide_kinds(reqs: list[Request]) -> tuple[dict[str, str], list[str]]:
    """:func:`decide_kind` of every key of ``reqs`` (in first-seen order), and the notes."""
    paths = list(dict.fromkeys(k.path for r in reqs for c in r.chunks for k in c.keys))
    kinds, notes = {}, []
    for path in paths:
        kinds[path], note = decide_kind(path, reqs)
        if note:
            notes.append(note)
    return kinds, notes


def _process(file: str) -> str:
    """The process that wrote ``file``: its folder and ``capture-<stage>-<pid>`` (a process's files are numbered on:
    ``.0``, ``.1`` ...), else the file itself."""
    head, dot, n = file[: -len(FILE_SUFFIX)].rpartition(".") if file.endswith(FILE_SUFFIX) else ("", "", "")
    return head if dot and n.isdigit() else file


def _runs(recs: list[dict[str, Any]]) -> list[list[dict[str, Any]]] | None:
    """The records of one request id on one side split into the requests they are, when a chunk index repeats:
    by the process that wrote them (two servers writing into one folder), then, within a process, at a file whose
    records repeat a chunk index of the run before (a restarted process with the same pid writes files of its own;
    a rotated one goes on: no index repeats); repeats within one file stay one request (the recorder starts a
    forgotten request's indexes again). None: a repeat in records that do not say their file (left out)."""
    if len({r["seq"] for r in recs}) == len(recs):
        return [recs]
    if any(not isinstance(r.get("_file"), str) for r in recs):
        return None
    by_proc: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in recs:
        by_proc.setdefault(_process(r["_file"]), {}).setdefault(r["_file"], []).append(r)
    out = []
    for files in by_proc.values():
        run: list[dict[str, Any]] = []
        for part in files.values():
            if run and {r["seq"] for r in run} & {r["seq"] for r in part}:
                out.append(run)
                run = []
            run += part
        out.append(run)
    return out


def build_trace(capture: Capture) -> Trace:
    """Group ``capture``'s records by pair, role and request; chunks ordered by time, then index. A request whose
    first chunk is not chunk 0 is left out (counted in :attr:`Trace.dropped`)."""
    out = Trace()
    index: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for rec in capture.records:
        index.setdefault((rec["pair"], rec["role"], rec["req"]), []).append(rec)
    for (pair, role, req), recs in index.items():
        runs = _runs(recs)
        if runs is None or len(runs) > 1:
            seen = out.repeated.setdefault((pair, role), [0, 0, 0, []])
            if runs:
                seen[0] += 1
                seen[1] += len(runs)
            else:
                seen[2] += 1
            seen[3] += [f for f in dict.fromkeys(r.get("_file") for r in recs) if f and f not in seen[3]]
        for i, run in enumerate(runs or ()):
            r = Request(req if len(runs or ()) == 1 else f"{req}~{i + 1}", pair, role)
            out.requests.setdefault((pair, role), []).append(r)
            for rec in run:
                keys = [KeyRec(x[0], x[1], x[2], tuple(x[3]), x[4], x[5], x[6] if len(x) > 6 else None)
                        for x in rec["keys"]]
                r.chunks.append(Chunk(rec["seq"], float(rec["t"]), float(rec["dt"]), keys, rec.get("handoff_s")))
                if rec.get("ctx") is not None and r.ctx is None:
                    r.ctx = rec["ctx"]
                if rec.get("arm") is not None:
                    r.arm = rec["arm"]
    for side, reqs in list(out.requests.items()):
        for r in reqs:
            r.chunks.sort(key=lambda c: (c.t, c.seq))
        kept = [r for r in reqs if r.chunks[0].seq == 0]
        if len(kept) < len(reqs):
            out.dropped[side] = len(reqs) - len(kept)
        if kept:
            out.requests[side] = sorted(kept, key=lambda r: r.start)
        else:
            del out.requests[side]
    sent = {(r.pair, r.req): r.ctx for (_, role), reqs in out.requests.items() if role == "send" for r in reqs}
    for (_, role), reqs in out.requests.items():  # a receiving side knows the prompt length from its sender
        if role == "recv":
            for r in reqs:
                r.ctx = r.ctx or sent.get((r.pair, r.req))
    return out
