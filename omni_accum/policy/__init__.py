"""Policies: the model (which strategy each key gets), loading, the tuned table and its fingerprint.

* :mod:`~omni_accum.policy.model`: :class:`Policy`, :class:`Rule`, :class:`StrategyChoice` and
  the resolution order (exact rule, first glob, protocol key, tuned table, default);
* :mod:`~omni_accum.policy.tuned`: :class:`TunedTable`, what ``omni-accum tune`` writes;
* :mod:`~omni_accum.policy.fingerprint`: the environment a tuned table was measured in, and the
  check that refuses a stale table (the installed plugins are an argument);
* :mod:`~omni_accum.policy.environment`: this process's fingerprint (plugins from the global manager);
* :mod:`~omni_accum.policy.loader`: files, presets, mappings, ``OMNI_ACCUM_POLICY``.
"""

from __future__ import annotations

from omni_accum.policy.loader import ENV_POLICY, dump_policy, load_policy, preset_names
from omni_accum.policy.model import (
    GLOB_CHARS,
    PROTOCOL_REPLACE_KEYS,
    Policy,
    Rule,
    StrategyChoice,
    StrategyRef,
    is_glob,
)
from omni_accum.policy.tuned import TunedCell, TunedTable

__all__ = [
    "ENV_POLICY",
    "GLOB_CHARS",
    "PROTOCOL_REPLACE_KEYS",
    "Policy",
    "Rule",
    "StrategyChoice",
    "StrategyRef",
    "TunedCell",
    "TunedTable",
    "dump_policy",
    "is_glob",
    "load_policy",
    "preset_names",
]
