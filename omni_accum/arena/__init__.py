"""A shared-memory arena between two stages on one host: the accumulation buffer is the wire.

The receiving stage creates one region per stage pair (:class:`ArenaReceiver`); the sending stage
attaches to it (:class:`ArenaSender`) and writes each new row of an append key straight into the
receiver's buffer for that request, then publishes a small descriptor on a single-producer /
single-consumer ring. The receiver's view is a zero-copy tensor over the shared pages. See
docs/arena.md.
"""

from __future__ import annotations

from omni_accum.arena.receiver import ArenaReceiver, Event
from omni_accum.arena.region import ArenaError, ArenaFull, PeerDied, path_for, pid_alive, sweep_stale
from omni_accum.arena.sender import ArenaSender

__all__ = [
    "ArenaError",
    "ArenaFull",
    "ArenaReceiver",
    "ArenaSender",
    "Event",
    "PeerDied",
    "path_for",
    "pid_alive",
    "sweep_stale",
]
