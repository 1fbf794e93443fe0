"""A single-producer / single-consumer byte ring over a slice of a shared mapping.

Two monotonically growing byte counters live in the region header, each on its own cache line:
``tail`` (written only by the producer) and ``head`` (written only by the consumer). A message is an
8-byte length followed by its bytes, padded to 8; a length of :data:`_WRAP` tells the consumer to
skip to the start of the ring. Publication needs no fence on x86 (stores are seen in program order):
the producer writes the message, then stores ``tail``; the consumer loads ``tail``, then reads the
message, then stores ``head``. Each counter is one aligned 8-byte store (a ``memoryview`` item
assignment), so it is never seen half-written.
"""

from __future__ import annotations

import struct

_LEN = struct.Struct("<Q")
_WRAP = 0xFFFF_FFFF_FFFF_FFFF


def _padded(n: int) -> int:
    return (n + 7) & ~7


class Ring:
    """One direction of a channel. ``counters`` is the header as 64-bit words; ``tail_i``/``head_i`` index it."""

    __slots__ = ("_buf", "_cap", "_q", "_tail_i", "_head_i")

    def __init__(self, buf: memoryview, counters: memoryview, tail_i: int, head_i: int) -> None:
        self._buf = buf
        self._cap = len(buf)
        self._q = counters
        self._tail_i = tail_i
        self._head_i = head_i

    @property
    def capacity(self) -> int:
        return self._cap

    def max_message(self) -> int:
        """The largest message :meth:`push` can ever accept."""
        return self._cap // 2 - 16

    def push(self, msg: bytes) -> bool:
        """Append ``msg``; False (nothing written) when the ring lacks room now (back-pressure)."""
        n = len(msg)
        cap = self._cap
        if n > cap // 2 - 16:
            raise ValueError(f"message of {n} bytes exceeds the ring's limit of {self.max_message()}")
        q = self._q
        tail = q[self._tail_i]
        head = q[self._head_i]
        pos = tail % cap
        need = 8 + _padded(n)
        skip = cap - pos if cap - pos < need else 0
        if cap - (tail - head) < need + skip:
            return False
        buf = self._buf
        if skip:
            if cap - pos >= 8:
                _LEN.pack_into(buf, pos, _WRAP)
            pos = 0
        buf[pos + 8 : pos + 8 + n] = msg  # the payload first ...
        _LEN.pack_into(buf, pos, n)
        q[self._tail_i] = tail + skip + need  # ... then the index that publishes it
        return True

    def pop(self) -> bytes | None:
        """The next message (a copy), or None when the ring is empty; ``b""`` when the ring holds a length no
        producer writes (every message published so far is then dropped: the reader counts it as malformed)."""
        q = self._q
        head = q[self._head_i]
        tail = q[self._tail_i]  # load the index first, then the payload it covers
        if head == tail:
            return None
        cap = self._cap
        buf = self._buf
        pos = head % cap
        n = _LEN.unpack_from(buf, pos)[0] if cap - pos >= 8 else _WRAP
        if n == _WRAP:
            head += cap - pos
            pos = 0
            n = _LEN.unpack_from(buf, 0)[0]
        if n > cap // 2 - 16 or head + 8 + _padded(n) > tail:  # a length no producer writes: the ring is
            q[self._head_i] = tail  # corrupt from here on; what was published is dropped, b"" says so
            return b""
        msg = bytes(buf[pos + 8 : pos + 8 + n])
        q[self._head_i] = head + 8 + _padded(n)
        return msg

    def empty(self) -> bool:
        return self._q[self._head_i] == self._q[self._tail_i]

    def reset(self) -> None:
        """Empty the ring; only when no peer is using it (its other side is dead)."""
        self._q[self._tail_i] = 0
        self._q[self._head_i] = 0
