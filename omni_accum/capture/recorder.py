"""One capture record per chunk: what a stage sent or received, in a line built from cached parts.

A record (one JSON line, schema version 1)::

    {"v": 1, "t": 1234567890e-6, "req": "3f2a9c01b7e4", "pair": "0->1", "role": "send", "seq": 0,
     "dt": 0e-6, "keys": [["embed.prefill", "append", "bfloat16", [8001, 2048], 32772096, "cat"], ...],
     "handoff_s": null, "arm": null, "ctx": 8000}

``t``: the process's ``time.monotonic()`` in seconds (stages on one host share the clock), written as whole
microseconds with an exponent (``1234567890e-6`` is 1234.56789 s: a plain JSON number, no float formatting
on the hot path); ``req``: a salted hash of
the request id (the capture's salt, so both stages of a request agree); ``seq``: the chunk's index in the
request for this role; ``dt``: seconds since the request's previous chunk in this role (0 for its first; written as ``t`` is); ``keys``: per key
``[path, kind (append|replace), dtype, shape, bytes, strategy]`` (dtype: a tensor's torch dtype; else
``pybool``, ``int``, ``float``, ``none``, ``str``, ``bytes``, ``ids`` (a list of numbers), ``names`` (a
list of key names) or ``list``, with the length as shape), and a seventh element, a mapping, only
when there is more to say (``value``: a small protocol value such as a flag or the ``override_keys`` list;
``sample``: with ``values: sample``, the first rows of a tensor, base64, once per key and request);
``handoff_s``: the hand-off time on the receiving side where the sender's clock came with the chunk;
``arm``: the A/B arm the request runs (None: no split); ``ctx``: the request's prompt length where known.

No tensor contents are recorded unless ``values: sample`` is asked for, and never token ids or strings
(their lengths only). The hot path formats no object of the chunk's size: a key's part of the line is made
once per (key, value type, dtype, shape, strategy) and reused; per request only the hash and two numbers
are kept (a bounded table, so a request that is never released cannot grow it).
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

from omni_accum.capture.writer import CaptureWriter

VERSION = 1
#: Requests a recorder follows at once; past it, the oldest quarter is forgotten (their next chunk
#: starts a new ``seq`` run, and the reader joins them by hash).
MAX_REQUESTS = 65536
#: Rows of a tensor kept with ``values: sample``.
SAMPLE_ROWS = 2
#: Keys whose last part (value type x dtype x shape, as written) a recorder keeps, and top-level keys it keeps them
#: under; past it, the part of a key not kept is made again at each chunk (the records are the same).
MAX_KEY_PARTS = 4096
VALUES = ("none", "sample")

_Tensor = torch.Tensor
_dumps = json.dumps


def request_hash(salt: str, req_id: Any) -> str:
    """12 hex digits of a salted hash of ``req_id``."""
    return hashlib.blake2b(str(req_id).encode("utf-8", "replace"), digest_size=6, key=salt.encode()[:64]).hexdigest()


def _literal(value: Any) -> Any:
    """A small protocol value recorded as is (flags, counts, the ``override_keys`` pairs), or None."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (list, tuple)) and len(value) <= 64:
        if all(isinstance(x, (list, tuple)) and all(isinstance(y, str) for y in x) for x in value):
            return [list(x) for x in value]  # key names ([group, qualifier] pairs), never content
    return None


def describe(path: str, value: Any, kind_of: Callable[[str, Any], tuple[str, str]]) -> str:
    """The JSON text of one key's entry for ``value`` (``kind_of(path, value)`` gives (kind, strategy))."""
    kind, strategy = kind_of(path, value)
    extra: dict[str, Any] = {}
    if isinstance(value, _Tensor):
        dtype, shape, nbytes = str(value.dtype).removeprefix("torch."), list(value.shape), value.nbytes
        if kind == "append" and value.dim() == 0:
            kind = "replace"
    elif isinstance(value, bool) or value is None:
        dtype = "pybool" if value is not None else "none"
        shape, nbytes, kind = [], 1 if value is not None else 0, "replace"
        extra["value"] = value
    elif isinstance(value, (int, float)):
        dtype, shape, nbytes, kind = type(value).__name__, [], 8, "replace"
        extra["value"] = value
    elif isinstance(value, (list, tuple)):
        lit = _literal(value)
        dtype = "names" if lit is not None and value else ("ids" if all(type(x) is int for x in value[:8]) else "list")
        shape, nbytes = [len(value)], 8 * len(value)
        if lit is not None and value:
            extra["value"] = lit
            kind = "replace"
    elif isinstance(value, (str, bytes)):
        dtype, shape, nbytes, kind = type(value).__name__, [len(value)], len(value), "replace"
    else:
        dtype, shape, nbytes, kind = type(value).__name__, [], 0, "replace"
    entry: list[Any] = [path, kind, dtype, shape, int(nbytes), strategy]
    if extra:
        entry.append(extra)
    return _dumps(entry, separators=(",", ":"))


def sample_of(value: _Tensor) -> dict[str, Any] | None:
    """The first :data:`SAMPLE_ROWS` rows of a tensor, base64, with their dtype and shape (None: 0-d)."""
    if value.dim() == 0 or value.shape[0] == 0:
        return None
    rows = value[:SAMPLE_ROWS].detach().to("cpu").contiguous()
    raw = rows.view(torch.uint8).numpy().tobytes() if rows.numel() else b""
    return {"sample": base64.b64encode(raw).decode("ascii"), "sample_dtype": str(rows.dtype).removeprefix("torch."),
            "sample_shape": list(rows.shape)}


_NEVER = object()


def _signature(v: Any) -> Any:
    """What must stay the same for a non-tensor value's part to be reused: a scalar's value, a sequence's
    length (a list of key names: its items, never reused)."""
    if isinstance(v, (list, tuple)):
        return _NEVER if v and isinstance(v[0], (list, tuple)) else len(v)
    if isinstance(v, (str, bytes)):
        return len(v)
    return v if v is None or isinstance(v, (bool, int, float)) else None


class ChunkRecorder:
    """Records of one role (``send`` or ``recv``) of one stage pair into a :class:`CaptureWriter`.

    ``kind_of(path, value) -> (kind, strategy)``: the key's kind (``append``/``replace``) and the strategy
    the policy gives it (called once per key and value type, dtype, shape). ``values``: ``none`` or
    ``sample``. ``arm``: the A/B arm whose requests it records (in every record's ``arm``; None: no split).
    """

    __slots__ = (
        "writer", "role", "pair", "kind_of", "ctx_of", "sample", "arm", "_keys", "_n_parts", "_reqs", "_head", "_salt",
    )

    def __init__(
        self,
        writer: CaptureWriter,
        role: str,
        pair: str,
        kind_of: Callable[[str, Any], tuple[str, str]],
        values: str = "none",
        ctx_of: Callable[[Any], int | None] | None = None,
        arm: str | None = None,
    ) -> None:
        self.writer = writer
        self.arm = arm
        self.ctx_of = ctx_of
        self.role = role
        self.pair = pair
        self.kind_of = kind_of
        self.sample = values == "sample"
        self._salt = writer.salt
        self._keys: dict[Any, dict[Any, list[Any] | None]] = {}  # top -> qual -> [type, signature, part]
        self._n_parts = 0  # keys in self._keys (at most MAX_KEY_PARTS)
        # req id -> [hash, next seq, last t (us), line head, sampled keys, ctx, line end without handoff_s]
        self._reqs: dict[Any, list[Any]] = {}
        self._head = f',"pair":{_dumps(pair)},"role":{_dumps(role)},"seq":'

    def _request(self, req_id: Any, source: Any, name: Any, now: int) -> list[Any]:
        reqs = self._reqs
        if len(reqs) >= MAX_REQUESTS:
            for k in list(reqs)[: MAX_REQUESTS // 4]:
                del reqs[k]
        h = request_hash(self._salt, req_id if name is None else name)
        ctx = None
        if self.ctx_of is not None and source is not None:
            try:
                ctx = self.ctx_of(source)
            except Exception:  # noqa: BLE001 - an unknown prompt length is null
                ctx = None
        tail = "null" if ctx is None else str(int(ctx))
        state = reqs[req_id] = [
            h, 0, now, f'"req":"{h}"' + self._head, set() if self.sample else None, tail,
            f'],"handoff_s":null,"arm":{self._arm},"ctx":{tail}}}\n',  # the line's end without a hand-off
        ]
        return state

    @property
    def _arm(self) -> str:
        return "null" if self.arm is None else _dumps(self.arm)

    def forget(self, req_id: Any) -> None:
        """The request is released (its next chunk, if any, starts again at ``seq`` 0)."""
        self._reqs.pop(req_id, None)

    def record(
        self,
        req_id: Any,
        chunk: Mapping[str, Any],
        now: int,
        *,
        source: Any = None,
        handoff_s: float | None = None,
        arm: str | None = None,
        skip: tuple[str, ...] = (),
        name: Any = None,
    ) -> None:
        """One chunk of ``req_id`` (top-level keys in ``skip`` are not payload keys) at ``now``
        (``time.monotonic_ns() // 1000``: whole microseconds). ``source``: what ``ctx_of`` reads the prompt
        length from, at the request's first chunk. ``name``: the id hashed into ``req`` when it is not
        ``req_id`` (a receiving stage follows its own id and records the sender's, so both sides agree)."""
        state = self._reqs.get(req_id)
        if state is None:
            state = self._request(req_id, source, name, now)
        cache = self._keys
        sampled = state[4]
        parts: list[str] = []
        add = parts.append
        for top, value in chunk.items():
            sub = cache.get(top)  # a skipped top never has one
            if sub is not None and value.__class__ is dict and sampled is None:
                for qual, v in value.items():
                    c = sub.get(qual)
                    if (
                        c is not None
                        and v.__class__ is _Tensor
                        and c[0] is v.dtype
                        and (not v.ndim if c[1] is None else c[1] == v.shape)  # None: 0-d (a flag), checked cheaper
                    ):
                        add(c[2])  # the hot case: the part of the key's last value, when it still fits
                    else:
                        add(self._text(sub, top, qual, v, None))
            elif top not in skip:
                if sub is None:
                    sub = {}
                    if len(cache) < MAX_KEY_PARTS:
                        cache[top] = sub
                for qual, v in value.items() if value.__class__ is dict else ((None, value),):
                    add(self._text(sub, top, qual, v, sampled))
        seq = state[1]
        dt = now - state[2]
        state[1] = seq + 1
        state[2] = now
        if handoff_s is None and arm is None:
            tail = state[6]
        else:
            arm = self._arm if arm is None else _dumps(arm)
            tail = (
                f'],"handoff_s":{"null" if handoff_s is None else f"{handoff_s:.6f}"},'
                f'"arm":{arm},"ctx":{state[5]}}}\n'
            )
        # t and dt as whole microseconds with an exponent: JSON numbers any reader parses as the seconds
        # (1500823244e-6 is 1500.823244), written without float formatting
        self.writer.write(
            f'{{"v":1,"t":{now}e-6,{state[3]}{seq},"dt":{dt if dt > 0 else 0}e-6,"keys":[{",".join(parts)}{tail}',
            now,
        )

    def _text(self, sub: dict[Any, list[Any]], top: Any, qual: Any, v: Any, sampled: set[Any] | None) -> str:
        """The part of one key (from the cache when the value still fits it), with a sample when asked for."""
        c = sub.get(qual)
        if isinstance(v, _Tensor):
            if (
                v.__class__ is _Tensor
                and c is not None
                and c[0] is v.dtype
                and (not v.ndim if c[1] is None else c[1] == v.shape)
            ):
                text = c[2]
            else:
                text = self._part(sub, top, qual, v)
            if sampled is not None and (top, qual) not in sampled:
                sampled.add((top, qual))
                text = self._with_sample(text, v)
            return text
        if c is not None and c[0] is v.__class__ and c[1] == _signature(v):
            return c[2]
        return self._part(sub, top, qual, v)

    def _part(self, sub: dict[Any, list[Any]], top: Any, qual: Any, v: Any) -> str:
        path = str(top) if qual is None else f"{top}.{qual}"
        text = describe(path, v, self.kind_of)
        if qual not in sub:
            if self._n_parts >= MAX_KEY_PARTS:
                return text  # a stream of ever new key names: this key's part is made again at its next chunk
            self._n_parts += 1
        if isinstance(v, _Tensor):
            sub[qual] = [v.dtype, v.shape if v.ndim else None, text]
        else:
            sig = _signature(v)
            sub[qual] = None if sig is _NEVER else [v.__class__, sig, text]
        return text

    @staticmethod
    def _with_sample(text: str, value: _Tensor) -> str:
        try:
            extra = sample_of(value)
        except Exception:  # noqa: BLE001 - a dtype numpy cannot view, say: no sample
            extra = None
        if not extra:
            return text
        entry = json.loads(text)
        if len(entry) > 6 and isinstance(entry[6], dict):
            entry[6].update(extra)
        else:
            entry.append(extra)
        return _dumps(entry, separators=(",", ":"))
