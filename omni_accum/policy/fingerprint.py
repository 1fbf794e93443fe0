"""Environment fingerprint of a tuned table, and the check that refuses stale tables.

A tuned table is only trusted in the environment it was measured in: omni-accum, torch and
vllm-omni versions, the device, and the plugins of the strategies it names (its cells and the
candidates it timed; other installed plugins do not matter). A mismatch warns once and the
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


def dist_version(dist: str) -> str | None:
    """The installed version of the distribution ``dist`` (None: not installed)."""
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
        "omni_accum": dist_version("omni-accum"),
        "torch": dist_version("torch"),
        "vllm_omni": dist_version("vllm-omni"),
        "device": device_name(device),
        "plugins": dict(sorted(plugins.items())),
    }
    if candidates is not None:
        fp["candidates"] = candidates
    return fp


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def _plugin_diffs(recorded: Any, now: Mapping[str, str], strategies: Iterable[str] | None) -> str | None:
    """The plugin entries that differ (only ``strategies`` when given), as ``name: table X, here Y``."""
    old = dict(recorded) if isinstance(recorded, Mapping) else {}
    names = sorted(set(strategies) if strategies is not None else set(old) | set(now))
    diffs = [
        f"{n}: table {old.get(n, 'not installed')}, here {now.get(n, 'not loaded (not installed, or disabled)')}"
        for n in names
        if old.get(n) != now.get(n)
    ]
    return "plugins: " + "; ".join(diffs) if diffs else None


def fingerprint_mismatches(
    recorded: dict[str, Any],
    device: str | None = None,
    *,
    plugins: Mapping[str, str] | None,
    strategies: Iterable[str] | None = None,
) -> list[str]:
    """Return the fields where ``recorded`` differs from this environment (empty when it matches).

    Each entry names only what changed, old against new (``torch: table 2.11.0, here 2.13.0``).
    ``plugins``: the installed strategy plugins; None when they are not known (the table cannot
    be checked, which is reported as a mismatch). ``strategies``: the strategies the table names
    (:meth:`~omni_accum.policy.tuned.TunedTable.strategy_names`); only their plugins are compared,
    so installing or removing a plugin the table never measured leaves it valid. None compares all.
    """
    if not recorded:
        return ["fingerprint missing"]
    if plugins is None:
        return [f"plugins: table {recorded.get('plugins')!r}, here not known (policy not loaded through load_policy)"]
    dev = device or ("cuda" if str(recorded.get("device", "")).startswith("cuda") else "cpu")
    now = current_fingerprint(dev, plugins=plugins)
    out = []
    for k in COMPARED:
        if k == "plugins":
            diff = _plugin_diffs(recorded.get(k), now[k], strategies)
            if diff:
                out.append(diff)
        elif recorded.get(k) != now.get(k):
            out.append(f"{k}: table {_shown(recorded.get(k))}, here {_shown(now.get(k))}")
    return out


def check_fingerprint(
    recorded: dict[str, Any],
    *,
    plugins: Mapping[str, str] | None,
    warn: bool = True,
    strategies: Iterable[str] | None = None,
) -> bool:
    """True when ``recorded`` matches this environment; otherwise warn once and return False."""
    diffs = fingerprint_mismatches(recorded, plugins=plugins, strategies=strategies)
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
