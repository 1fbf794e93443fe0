"""Keep a measurement's resident memory bounded when glibc's heap fragments (between rounds, untimed).

glibc raises its mmap threshold to the size of every large block freed (up to 32 MiB). From then
on, the growing tensors of ``cat`` / ``token_list`` / upstream arms (a ``[P, 2048]`` bf16
concatenation per step) come from the heap. With several requests interleaved each new block is a
little larger than every hole the previous ones left, so the heap grows by about one
concatenation per step: on ``qwen3-omni-seed`` at concurrency 10 over the serializer wire,
~0.3 GiB per round from the second repeat on, and a three-repeat bench ran out of 24 GiB.

The allocator's policy is left alone (fixing the threshold low would make every concatenation
fault in fresh pages: upstream 6x slower at P=8000 than a warm process runs it, which would flatter
every other arm). Instead :class:`HeapGuard`, called between rounds outside the timed region,
returns the free holes' pages to the OS (``malloc_trim``) once resident memory has grown by more
than ``slack`` since the last time: a pathological pattern is bounded, a well-behaved one (blocks
reused in place) is never touched.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

#: Growth of resident memory (bytes) that makes :class:`HeapGuard` trim.
SLACK = 256 << 20

_libc: Any = None


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None off Linux / on another libc."""
    global _libc
    if _libc is None:
        _libc = False
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                trim = lib.malloc_trim
                trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
                _libc = trim
            except (OSError, AttributeError):
                pass
    return _libc or None


def resident_bytes() -> int:
    """Resident set size of this process in bytes (0 where /proc is not available)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * 4096
    except (OSError, ValueError, IndexError):
        return 0


class HeapGuard:
    """Call between rounds: trims the heap when resident memory grew by more than ``slack`` bytes.

    Attributes:
        trims: how many times it trimmed.
    """

    def __init__(self, slack: int = SLACK) -> None:
        self.slack = slack
        self.trims = 0
        self._trim = _malloc_trim()
        self._mark = resident_bytes() if self._trim else 0

    def __call__(self) -> None:
        if not self._trim:
            return
        now = resident_bytes()
        if now - self._mark > self.slack:
            self._trim(0)
            self.trims += 1
            self._mark = resident_bytes()
        elif now < self._mark:
            self._mark = now
