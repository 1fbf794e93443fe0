"""Pin glibc's mmap threshold while measuring, so one arm's freed buffers cannot inflate the next one's memory.

glibc raises its mmap threshold to the size of every large block freed (up to 32 MiB). After the
first repeat of a bench, the growing tensors of ``cat`` / ``token_list`` / upstream arms (a
``[P, 2048]`` bf16 concatenation every step) then come from the heap, where each is a little
larger than every hole left by the previous ones: the heap grows by one concatenation per step.
On ``qwen3-omni-seed`` at concurrency 10 over the serializer wire that is ~0.3 GiB per round, and
a three-repeat bench ran out of 24 GiB. Fixing the threshold (glibc then stops adjusting it) keeps
every block of 1 MiB or more mmapped and returned to the OS when freed, in every repeat alike,
which is what the first repeat sees anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

#: glibc's ``M_MMAP_THRESHOLD`` option of ``mallopt``.
M_MMAP_THRESHOLD = -3
#: Blocks at least this large are mmapped while measuring.
MMAP_THRESHOLD = 1 << 20

_pinned: bool | None = None


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Fix the mmap threshold of this process at ``nbytes`` (once); True when it is pinned.

    A no-op (False) off Linux, on a libc without ``mallopt``, or when the user set
    ``MALLOC_MMAP_THRESHOLD_`` themselves (their choice stands).
    """
    global _pinned
    if _pinned is not None:
        return _pinned
    _pinned = False
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _pinned = bool(mallopt(M_MMAP_THRESHOLD, int(nbytes)))
    return _pinned
