"""How a captured key is read: its kind (append or replace) and how the consumer reads it, from the built-in
workload preset that has the key (a capture records what the policy did with a key, not what the key is)."""

from __future__ import annotations

import functools
from typing import Any

from omni_accum.bench.workload_presets import DEFAULT_WORKLOAD, PRESETS


@functools.lru_cache(maxsize=1024)
def known_key(path: str) -> tuple[str, dict[str, Any]] | None:
    """``(preset, key spec)`` of the built-in workload preset that has ``path`` (the default preset first, then
    the others in order: 0.16's flat keys are in ``qwen3-omni-seed``), or None for a key no preset has."""
    for name in (DEFAULT_WORKLOAD, *(n for n in PRESETS if n != DEFAULT_WORKLOAD)):
        for spec in PRESETS[name]["keys"]:
            if spec["path"] == path:
                return name, spec
    return None


def kind_of_key(path: str, recorded: str) -> str:
    """``append`` or ``replace``: what the key is, from the preset that has it (a capture records what the
    policy did with it: under ``default`` every tensor reads ``append``), else as recorded."""
    known = known_key(path)
    if known is None:
        return recorded
    return "append" if known[1].get("kind", "append") == "append" else "replace"


def _read_of(path: str, kind: str) -> str:
    """How the consumer reads ``path``: as the preset that has the key says (:func:`known_key`), else ``delta``
    (append: the receiving stage takes each chunk's rows, as 0.30.0's does) or ``every``."""
    known = known_key(path)
    if known is not None:
        read = known[1].get("read", "every")
        if read != "delta" or kind == "append":
            return read
    return "delta" if kind == "append" else "every"
