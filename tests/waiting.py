"""One way for the tests to wait on another process or thread: poll a probe a bounded number of times.

A wait is a hang guard, never a speed check: the caller asserts on the state the probe returns (or on what it
saw last), never on how long the wait took. The bound is a number of polls, so a slow machine only makes a
wait longer, never a test fail on a clock.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def poll(probe: Callable[[], T], timeout: float, interval: float = 0.05) -> T:
    """Call ``probe`` until it returns something truthy, at most about ``timeout / interval`` times with
    ``interval`` seconds of sleep between; return its last value (falsy if it never came true)."""
    got = probe()
    for _ in range(max(1, round(timeout / interval))):
        if got:
            return got
        time.sleep(interval)
        got = probe()
    return got
