"""This process's environment for tuned tables: the fingerprint with the installed plugins filled in.

:mod:`omni_accum.policy.fingerprint` takes the installed strategy plugins as an argument; this
module supplies them from the process-wide plugin manager (``omni_accum.get_manager()``), for the
loader (which binds them to the policies it loads), the tuner (which records them) and the CLI
(which reports mismatches).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from omni_accum.manager import get_manager
from omni_accum.policy.fingerprint import current_fingerprint as _fingerprint
from omni_accum.policy.fingerprint import fingerprint_mismatches as _mismatches
from omni_accum.policy.fingerprint import plugin_versions


def installed_plugins() -> dict[str, str]:
    """The strategy plugins the process-wide manager has registered: ``name -> "dist==version"``."""
    return plugin_versions(get_manager().specs())


def current_fingerprint(device: str = "cpu", candidates: str | None = None) -> dict[str, Any]:
    """Fingerprint of this process (``candidates``: hash of the candidate set that was timed)."""
    return _fingerprint(device, candidates, plugins=installed_plugins())


def fingerprint_mismatches(
    recorded: dict[str, Any], device: str | None = None, strategies: Iterable[str] | None = None
) -> list[str]:
    """The fields where ``recorded`` differs from this process (empty when it matches).

    ``strategies``: compare only these strategies' plugins (a table's ``strategy_names()``).
    """
    return _mismatches(recorded, device, plugins=installed_plugins(), strategies=strategies)


def table_mismatches(table: Any, device: str | None = None) -> list[str]:
    """What differs between this process and the environment the :class:`TunedTable` ``table`` was measured in."""
    return fingerprint_mismatches(table.fingerprint, device, table.strategy_names())
