"""Environment fingerprint of a tuned table, and the check that refuses stale tables.

A tuned table is only trusted in the environment it was measured in: omni-accum, torch and
vllm-omni versions, the device, and the installed strategy plugins. A mismatch warns once and the
table is not used (rules and the default still apply), never silently.

This module asks nobody: the installed strategy plugins (``name -> "dist==version"``, see
:func:`plugin_versions`) are an argument of every function that compares or records them. The
process-wide values (from the global plugin manager) are in :mod:`omni_accum.policy.environment`.
"""

from __future__ import annotations

import logging
import platform
import warnings
from collections.abc import Iterable, Mapping
from importlib import metadata
from typing import Any

logger = logging.getLogger("omni_accum")

#: Fields compared at run time. ``candidates`` (what was timed) is recorded but not compared.
COMPARED = ("omni_accum", "torch", "vllm_omni", "device", "plugins")

_warned: set[str] = set()


class StaleTableWarning(UserWarning):
    """A tuned table was measured in another environment and is not used."""


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def device_name(device: str = "cpu") -> str:
    """Human-readable name of the device timings were taken on."""
    if device.startswith("cuda"):
        import torch

        return f"cuda:{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cuda:unavailable"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import os

    return f"cpu:{cpu} x{os.cpu_count()}"


def plugin_versions(specs: Iterable[Any]) -> dict[str, str]:
    """``{strategy name: "dist==version"}`` (or the plugin name when no distribution provides it).

    ``specs``: the registered :class:`~omni_accum.strategy.StrategySpec` objects (``StrategyManager.specs()``).
    """
    return {
        spec.name: (f"{spec.distribution[0]}=={spec.distribution[1]}" if spec.distribution else spec.plugin)
        for spec in specs
    }


def current_fingerprint(
    device: str = "cpu", candidates: str | None = None, *, plugins: Mapping[str, str]
) -> dict[str, Any]:
    """Fingerprint of this environment with the installed strategy ``plugins`` (see :func:`plugin_versions`).

    ``candidates``: hash of the candidate set that was timed.
    """
    fp: dict[str, Any] = {
        "omni_accum": _version("omni-accum"),
        "torch": _version("torch"),
        "vllm_omni": _version("vllm-omni"),
        "device": device_name(device),
        "plugins": dict(sorted(plugins.items())),
    }
    if candidates is not None:
        fp["candidates"] = candidates
    return fp


def fingerprint_mismatches(
    recorded: dict[str, Any], device: str | None = None, *, plugins: Mapping[str, str] | None
) -> list[str]:
    """Return the fields where ``recorded`` differs from this environment (empty when it matches).

    ``plugins``: the installed strategy plugins; None when they are not known (the table cannot
    be checked, which is reported as a mismatch).
    """
    if not recorded:
        return ["fingerprint missing"]
    if plugins is None:
        return [f"plugins: table {recorded.get('plugins')!r}, here not known (policy not loaded through load_policy)"]
    dev = device or ("cuda" if str(recorded.get("device", "")).startswith("cuda") else "cpu")
    now = current_fingerprint(dev, plugins=plugins)
    out = []
    for k in COMPARED:
        if recorded.get(k) != now.get(k):
            out.append(f"{k}: table {recorded.get(k)!r}, here {now.get(k)!r}")
    return out


def check_fingerprint(recorded: dict[str, Any], *, plugins: Mapping[str, str] | None, warn: bool = True) -> bool:
    """True when ``recorded`` matches this environment; otherwise warn once and return False."""
    diffs = fingerprint_mismatches(recorded, plugins=plugins)
    if not diffs:
        return True
    if warn:
        key = repr(sorted(diffs))
        if key not in _warned:
            _warned.add(key)
            msg = (
                "omni-accum: tuned table ignored, it was measured in another environment ("
                + "; ".join(diffs)
                + "). Rules and the default apply; re-run `omni-accum tune` here."
            )
            logger.warning(msg)
            warnings.warn(msg, StaleTableWarning, stacklevel=3)
    return False
