"""How :class:`.mooncake_connector.MooncakeFastConnector`'s ``get`` waits for a key that is not in the store yet.

vllm-omni 0.30.0's ``MooncakeStoreConnector.get`` asks the store up to 20 times, 50 ms apart, inside the call
(up to ~1 s). Its callers (the chunk adapter's receive loop, the runner transport's) poll: they call ``get``
for one waiting request after the other and call it again later when it returned None. So a get that waits
holds back every other request's chunk behind it: with four requests waiting for their prefill, a chunk 0
that arrives can sit up to ~3 s before its get comes round, and even alone a chunk waits up to 50 ms for the
next try.

``mooncake_get_poll`` (the connector's ``extra``) chooses:

* ``blocking`` (the default): 0.30.0's 20 tries 50 ms apart within the call;
* a duration (``5ms``, ``0.002s``, a number of seconds; from 0.1 ms to 1 s): one try per call, and a key is asked for at
  most once per that interval, so the caller's loop goes round every waiting request and a chunk is found
  within about that interval of its put. A call in between asks nothing; when no key asked for lately
  (within :data:`RECENT_S`, or ten intervals if longer) may be asked yet, it first sleeps until the soonest may
  (never longer than the interval), then asks if its own key is due, else returns None. Nothing could be asked
  sooner, and the callers' loops, which retry after 1-5 ms, do not wake hundreds of times a second to find
  nothing due (CPU that the stage's model needs on a busy host).

Either way a key is counted in the connector's ``timeouts`` (and logged with the key, as 0.30.0 does) each
time it has been waited for another :data:`TIMEOUT_S` seconds.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

#: 0.30.0's wait within one get: 20 tries, 50 ms apart.
TRIES = 20
TRY_INTERVAL_S = 0.05
#: A key waited for this long (again) counts one timeout.
TIMEOUT_S = 1.0
#: The longest and the shortest poll interval taken (below 0.1 ms a polling get would ask the master without pause).
MAX_POLL_S = 1.0
MIN_POLL_S = 1e-4
#: Keys remembered (the oldest forgotten first: a request given up leaves its key here).
MAX_KEYS = 4096
#: A key asked for within this long (or ten intervals, if longer) holds a call back until it is due; one no
#: longer asked for (its request given up or taken elsewhere) stops counting after it.
RECENT_S = 0.1
BLOCKING = "blocking"

_BOUNDS = f"from {MIN_POLL_S * 1e3:g} ms to {MAX_POLL_S:g} s"
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$", re.IGNORECASE)


def parse_poll(value: Any, what: str = "extra.mooncake_get_poll") -> float | None:
    """``None`` for ``blocking`` (0.30.0's), else the interval in seconds (0.1 ms to 1 s)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == BLOCKING):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)  # a number of seconds, 1e-09 included (then refused by the range below)
    else:
        m = None if isinstance(value, bool) else _DURATION.match(str(value))
        if m is None:
            raise ValueError(f"{what} = {value!r} is not '{BLOCKING}' or a duration: the units taken are s (0.005s; "
                             f"a number without a unit is seconds too) and ms (5ms), {_BOUNDS}")
        seconds = float(m.group(1)) / (1000.0 if (m.group(2) or "s").lower() == "ms" else 1.0)
    if not MIN_POLL_S <= seconds <= MAX_POLL_S:
        raise ValueError(f"{what} = {value!r} is {seconds:g} s: it must be {_BOUNDS} (or '{BLOCKING}')")
    return seconds


class KeyWaits:
    """When each key was first asked for, when it may be asked again, how many timeouts it has counted
    (thread-safe: the adapter's and the runner transport's receive threads may share a connector)."""

    def __init__(self, interval: float | None) -> None:
        self.interval = interval
        self._keys: OrderedDict[str, list[float]] = OrderedDict()  # key -> [first ask, next ask, timeouts]
        self._lock = threading.Lock()

    def due(self, key: str, now: float) -> bool:
        """Whether the store may be asked for ``key`` now (always, the first time and when blocking)."""
        with self._lock:
            st = self._keys.get(key)
            if st is None:
                self._keys[key] = [now, now, 0]
                while len(self._keys) > MAX_KEYS:
                    self._keys.popitem(last=False)
                return True
        return self.interval is None or now >= st[1]

    def missed(self, key: str, now: float) -> bool:
        """``key`` was not there at ``now``; True when that makes another :data:`TIMEOUT_S` of waiting."""
        with self._lock:
            st = self._keys.setdefault(key, [now, now, 0])
            st[1] = now + (self.interval or 0.0)
            self._keys.move_to_end(key)  # most lately asked last (:meth:`pause`)
            n = int((now - st[0]) // TIMEOUT_S)
            if n <= st[2]:
                return False
            st[2] = n
            return True

    def turn(self, key: str, clock: Callable[[], float], sleep: Callable[[float], Any]) -> bool:
        """Whether the store may be asked for ``key`` now. When neither it nor any key asked for lately may be,
        first ``sleep`` until the soonest may (:meth:`pause`: nothing could be asked sooner), then say whether
        ``key`` may."""
        now = clock()
        if self.due(key, now):
            return True
        pause = self.pause(now)
        if pause <= 0:
            return False
        sleep(pause)
        return self.due(key, clock())

    def pause(self, now: float) -> float:
        """Seconds until a key asked for lately may be asked again, at most the interval: 0 when one may be now,
        when none was asked for lately, or when blocking."""
        if self.interval is None:
            return 0.0
        recent = max(RECENT_S, 10 * self.interval)
        soonest: float | None = None
        with self._lock:
            for st in reversed(self._keys.values()):
                if now - (st[1] - self.interval) > recent:
                    break  # asked for longer ago, as was every key before it
                if st[1] <= now:
                    return 0.0
                soonest = st[1] - now if soonest is None else min(soonest, st[1] - now)
        return 0.0 if soonest is None else min(soonest, self.interval)

    def found(self, key: str, now: float) -> float:
        """``key`` was found: how long it was waited for (0 when this was its first ask); forgotten."""
        with self._lock:
            st = self._keys.pop(key, None)
        return 0.0 if st is None else max(0.0, now - st[0])

    def __len__(self) -> int:
        return len(self._keys)


def monotonic() -> float:
    return time.monotonic()
