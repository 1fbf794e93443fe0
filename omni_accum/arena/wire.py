"""The arena rings' control messages: a small tagged binary format that can only make plain values.

What a ring carries (tuples of tags, request ids, page spans, key paths and the small non-tensor values of
a chunk) is encoded as None, bools, 64-bit ints, floats, str, bytes, lists, tuples and dicts, nothing else:
decoding constructs no other object and runs no code (the rings were ``pickle``\\ d before; whoever can
write to a region could have run code in the stage process reading it). Every length and count is
bounded by the bytes that are left, nesting by :data:`MAX_DEPTH`; a malformed message raises
:class:`BadFrame` (the reader drops that message and counts it).
"""

from __future__ import annotations

import struct
from typing import Any

from omni_accum.arena._common import CHAINS_DONE, CHUNK, DONE, DTYPES, MSG
from omni_accum.arena.region import ArenaError

MAX_DEPTH = 32

_Q = struct.Struct("<q")
_D = struct.Struct("<d")
_N = struct.Struct("<I")
_q_pack, _d_pack, _n_pack = _Q.pack, _D.pack, _N.pack
_q_unpack, _d_unpack, _n_unpack = _Q.unpack_from, _D.unpack_from, _N.unpack_from


class BadFrame(ArenaError):
    """A ring message that is not a well-formed message of this format (or not one this side expects)."""


def dumps(obj: Any) -> bytes:
    """Encode ``obj`` (plain values only); TypeError for anything else (a tensor, an object)."""
    out: list[bytes] = []
    _enc(obj, out.append, 0)
    return b"".join(out)


def _enc(v: Any, put: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise TypeError(f"nested deeper than {MAX_DEPTH}")
    t = type(v)
    if v is None:
        put(b"N")
    elif t is bool:
        put(b"T" if v else b"F")
    elif t is int:
        if -(1 << 63) <= v < 1 << 63:
            put(b"i" + _q_pack(v))
        else:
            b = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            put(b"I" + _n_pack(len(b)) + b)
    elif t is float:
        put(b"f" + _d_pack(v))
    elif t is str:
        b = v.encode("utf-8", "surrogatepass")
        put(b"s" + _n_pack(len(b)) + b)
    elif t is bytes or t is bytearray or t is memoryview:
        b = bytes(v)
        put(b"b" + _n_pack(len(b)) + b)
    elif t is list or t is tuple:
        put((b"l" if t is list else b"t") + _n_pack(len(v)))
        for x in v:
            _enc(x, put, depth + 1)
    elif t is dict:
        put(b"d" + _n_pack(len(v)))
        for k, x in v.items():
            _enc(k, put, depth + 1)
            _enc(x, put, depth + 1)
    else:
        raise TypeError(f"a {t.__name__} does not go on an arena ring (plain values only)")


def loads(buf: bytes) -> Any:
    """Decode one message; BadFrame when it is malformed or has bytes left over."""
    try:
        v, pos = _dec(buf, 0, 0)
    except BadFrame:
        raise
    except (struct.error, IndexError, ValueError, TypeError, UnicodeDecodeError, OverflowError) as e:
        raise BadFrame(f"a malformed ring message ({type(e).__name__}: {e})") from None
    if pos != len(buf):
        raise BadFrame(f"a ring message with {len(buf) - pos} bytes left over")
    return v


def _count(buf: bytes, pos: int) -> tuple[int, int]:
    n = _n_unpack(buf, pos)[0]
    if n > len(buf) - pos - 4:  # every item takes at least one byte: a count past the end is a lie
        raise BadFrame(f"a count of {n} past the end of a {len(buf)}-byte message")
    return n, pos + 4


def _dec(buf: bytes, pos: int, depth: int) -> tuple[Any, int]:
    if depth > MAX_DEPTH:
        raise BadFrame(f"a ring message nested deeper than {MAX_DEPTH}")
    tag = buf[pos]
    pos += 1
    if tag == 0x69:  # i
        return _q_unpack(buf, pos)[0], pos + 8
    if tag == 0x73 or tag == 0x62 or tag == 0x49:  # s b I
        n, pos = _count(buf, pos)
        raw = buf[pos : pos + n]
        if tag == 0x73:
            return raw.decode("utf-8", "surrogatepass"), pos + n
        if tag == 0x49:
            return int.from_bytes(raw, "little", signed=True), pos + n
        return bytes(raw), pos + n
    if tag == 0x74 or tag == 0x6C:  # t l
        n, pos = _count(buf, pos)
        items = []
        for _ in range(n):
            x, pos = _dec(buf, pos, depth + 1)
            items.append(x)
        return (tuple(items) if tag == 0x74 else items), pos
    if tag == 0x4E:  # N
        return None, pos
    if tag == 0x54 or tag == 0x46:  # T F
        return tag == 0x54, pos
    if tag == 0x66:  # f
        return _d_unpack(buf, pos)[0], pos + 8
    if tag == 0x64:  # d
        n, pos = _count(buf, pos)
        d = {}
        for _ in range(n):
            k, pos = _dec(buf, pos, depth + 1)
            if type(k) not in (str, int):
                raise BadFrame(f"a dict key of type {type(k).__name__} in a ring message")
            d[k], pos = _dec(buf, pos, depth + 1)
        return d, pos
    raise BadFrame(f"an unknown tag {tag:#x} in a ring message")


# ------------------------------------------------------------------- the frequent messages, flat
#: A keyed message (the connector's put): b"M", then the lengths (key, body, spans, chains, openings), the
#: key (UTF-8), the body, the spans as (page, pages) u64 pairs, the chain numbers as u64, the chain
#: openings (rare) in the tagged format above. Released pages (ring B): b"F", the request id's length
#: (-1: none), the span count, the id, the spans.
_MSG_HEAD = struct.Struct("<IIIII")
_FREE_HEAD = struct.Struct("<iI")
MSG_TAG, FREE_TAG = 0x4D, 0x46


def dump_msg(key: str, body: bytes, spans: Any, opens: Any, chains: Any) -> bytes:
    kb = key.encode("utf-8", "surrogatepass")
    ob = dumps(tuple(opens)) if opens else b""
    flat = [x for s in spans for x in s]
    return b"".join((b"M", _MSG_HEAD.pack(len(kb), len(body), len(spans), len(chains), len(ob)), kb, body,
                     struct.pack(f"<{len(flat)}Q", *flat), struct.pack(f"<{len(chains)}Q", *chains), ob))


def load_msg(buf: bytes) -> tuple:
    """``(MSG, key, body, spans, opens, chains)`` of a :func:`dump_msg` message (not yet checked)."""
    try:
        lk, lb, ns, nc, lo = _MSG_HEAD.unpack_from(buf, 1)
    except struct.error:
        raise BadFrame(f"a keyed message of {len(buf)} bytes") from None
    pos = 1 + _MSG_HEAD.size
    need(len(buf) == pos + lk + lb + 16 * ns + 8 * nc + lo, "lengths that do not add up")
    key = buf[pos : pos + lk].decode("utf-8", "surrogatepass")
    pos += lk
    body = buf[pos : pos + lb]
    pos += lb
    flat = struct.unpack_from(f"<{2 * ns}Q", buf, pos)
    pos += 16 * ns
    chains = struct.unpack_from(f"<{nc}Q", buf, pos)
    pos += 8 * nc
    opens = loads(buf[pos:]) if lo else ()
    return MSG, key, body, list(zip(flat[::2], flat[1::2])), opens, chains


def dump_free(rid: str | None, spans: Any) -> bytes:
    rb = rid.encode("utf-8", "surrogatepass") if rid is not None else b""
    flat = [x for s in spans for x in s]
    return b"".join((b"F", _FREE_HEAD.pack(len(rb) if rid is not None else -1, len(spans)), rb,
                     struct.pack(f"<{len(flat)}Q", *flat)))


def load_free(buf: bytes, npages: int) -> tuple[str | None, list[tuple[int, int]]]:
    """``(request id or None, spans)`` of a :func:`dump_free` message, its spans inside ``npages`` pages."""
    try:
        lr, ns = _FREE_HEAD.unpack_from(buf, 1)
        pos = 1 + _FREE_HEAD.size
        need(buf[0] == FREE_TAG and len(buf) == pos + max(lr, 0) + 16 * ns, "lengths that do not add up")
        rid = buf[pos : pos + lr].decode("utf-8", "surrogatepass") if lr >= 0 else None
        flat = struct.unpack_from(f"<{2 * ns}Q", buf, pos + max(lr, 0))
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise BadFrame(f"a malformed release ({e})") from None
    spans = list(zip(flat[::2], flat[1::2]))
    need(all(n >= 1 and p + n <= npages for p, n in spans), "pages outside the arena")
    return rid, spans


# ---------------------------------------------------------------------------------- schema checks
def need(cond: bool, what: str) -> None:
    """Raise BadFrame(``what``) unless ``cond``: the checks of a decoded message's fields."""
    if not cond:
        raise BadFrame(f"a ring message with {what}")


def is_int(v: Any, lo: int = 0, hi: int = 1 << 63) -> bool:
    return type(v) is int and lo <= v < hi


def spans_ok(spans: Any, npages: int) -> bool:
    """``[(page, npages), ...]`` inside a data area of ``npages`` pages."""
    return type(spans) in (list, tuple) and all(
        type(s) in (list, tuple) and len(s) == 2 and is_int(s[0]) and is_int(s[1], 1) and s[0] + s[1] <= npages
        for s in spans
    )


def shape_ok(shape: Any) -> bool:
    return type(shape) in (list, tuple) and len(shape) <= 16 and all(is_int(d, 0, 1 << 40) for d in shape)


_SEQ = (list, tuple)


def checked(m: Any, layout: Any) -> Any:
    """``m`` if it is a well-formed forward message (sender -> receiver) whose pages lie in the data area of
    ``layout``; else BadFrame."""
    need(type(m) is tuple and m and m[0] in (MSG, CHAINS_DONE, DONE, CHUNK), "an unknown tag")
    npages, page = layout.npages, layout.page
    if m[0] in (CHAINS_DONE, DONE):
        need(len(m) == 2 and type(m[1]) is str, "a bad request id")
        return m
    if m[0] == MSG:  # (load_msg's: the spans and chain numbers are unsigned ints)
        need(len(m) == 6 and type(m[5]) is tuple, "a keyed message not framed as one")
        need(all(n >= 1 and p + n <= npages for p, n in m[3]), "pages outside the arena")
        opens = m[4]
        if not opens:
            return m
        need(type(opens) in _SEQ and all(type(o) in _SEQ and len(o) == 8 for o in opens), "bad chain openings")
        for rid, path, no, pg, npg, cap, dt, shape in opens:
            need(type(rid) is str and type(path) is str and is_int(no) and is_int(cap), "a bad chain opening")
            _slab_ok(pg, npg, cap, dt, shape, npages, page)
        return m
    need(len(m) == 8, "a bad chunk descriptor")
    _, rid, t0, opens, rows, values, rix, keys = m
    need(type(rid) is str and is_int(t0, -(1 << 63)) and is_int(rix), "a bad request")
    need(type(opens) in _SEQ and all(type(o) in _SEQ and len(o) == 7 for o in opens), "bad slab openings")
    for path, pg, npg, cap, dt, shape, append in opens:
        need(type(path) is str and type(append) is bool and is_int(cap), "a bad slab opening")
        _slab_ok(pg, npg, cap if append else 1, dt, shape, npages, page)
    need(type(rows) in _SEQ and all(type(r) in _SEQ and len(r) == 2 and type(r[0]) is str and is_int(r[1])
                                    for r in rows), "bad rows")
    need(type(values) is dict and all(type(p) is str and type(v) in _SEQ and len(v) == 2
                                      for p, v in values.items()), "bad values")
    need(type(keys) in _SEQ and all(type(k) in _SEQ and len(k) == 2 and is_int(k[0], 0, 1 << 16)
                                    and type(k[1]) is str for k in keys), "bad key numbers")
    return m


def _slab_ok(pg: Any, npg: Any, cap: int, dt: Any, shape: Any, npages: int, page: int) -> None:
    need(spans_ok(((pg, npg),), npages) and dt in DTYPES and shape_ok(shape), "a slab out of bounds")
    n = cap * DTYPES[dt].itemsize
    for d in shape:
        n *= d
    need(n <= npg * page, f"a slab of {n} bytes in {npg} pages")
